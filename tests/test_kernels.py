"""Each kernel's GPU path against its PyTorch reference: values and gradients over a grid of widths
(powers of two and not, up to 4096), row counts, source counts, layouts (contiguous, transposed,
sliced) and storage dtypes; then the custom ops under torch.compile, and the memory depth
attention saves.

On CPU the GPU path runs in Triton's interpreter (TRITON_INTERPRET=1, set in conftest.py) inside
kernels.triton_on_cpu(): the public function with impl="triton" -> the custom op ->
the Triton launchers and kernels, forward and backward, exactly as on a GPU. The reference is the
public function with impl="torch": kernels.py's one PyTorch forward and backward per kernel (the
same functions are the ops' CPU implementation). The interpreter stores fp16 and
bf16 as the GPU does and computes in fp32 as the kernels ask, so all three dtypes are tested here;
it is slow, so large widths come with few rows.

Both paths see the same inputs and output gradients (rounded to the storage dtype); the reference
computes in fp64, so the test measures the kernel's own error. An element passes when
|x - ref| <= tol * (scale + |ref|) (+ fp16's subnormal step, 6e-8), scale being the RMS of its row
([..., d] tensors) or of the whole tensor (vectors and per-row scalars). tol per storage dtype of
the tensor compared (an fp32 output or gradient of a bf16 run, e.g. Sinkhorn's H or a coefficient's
gradient, is held to fp32's):
    fp32 2e-4   fp32 dot products over up to 4096 terms that then cancel (seen: 7e-5 at d = 4096)
    fp16 4e-3   4 units in the last place of a stored fp16 (11 significant bits; seen: 7e-4)
    bf16 3e-2   4 units in the last place of a stored bf16 (8 significant bits; seen: 6e-3)
A kernel that drops a term, an eps or a rescaling is off by far more (for the hyper-connection
kernels each such change was tried once by hand, and failed these tests)."""
import contextlib
import functools
import math

import pytest
import torch
import torch.nn.functional as F

import kernels

triton = pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
# (rows, d): d not a power of two, d = 768 in BLOCK 1024, d >= 1024 with few rows (the interpreter
# runs one program per row); 33 rows > the 8 programs of the backward's row loop on CPU
SHAPES = [(1, 64), (33, 65), (4, 768), (3, 1024), (2, 4096)]
# The interpreter's time goes with the grid (one program per row, a Python loop per Sinkhorn step), not
# with d: the largest grids (the 33 rows here, and below Sinkhorn's 20 steps over 40-70 matrices and
# n = 8 streams) run in fp32 alone, the tightest tolerance (a row, term or step dropped shows most
# there; fp32 is also the dtype of mhc's Sinkhorn logits). Every other shape runs in every dtype: the
# dtypes' loads, casts and stores are the same code at any grid size.
BIG_GRID_ROWS = 33


def dtypes_for(rows):
    return DTYPES if rows < BIG_GRID_ROWS else [torch.float32]


GRID = [(rows, d, dtype) for rows, d in SHAPES for dtype in dtypes_for(rows)]
LAYOUTS = ["contiguous", "transposed", "sliced"]


def gpu_path():
    """The Triton kernels: on CPU tensors, through the interpreter."""
    return contextlib.nullcontext() if CUDA else kernels.triton_on_cpu()


def in_layout(t, layout):
    """t's values in a non-contiguous tensor: column-major rows, or rows with a stride past d."""
    if layout == "transposed":
        return t.mT.contiguous().mT
    if layout == "sliced":
        return torch.cat([t, t[..., :3]], -1)[..., :t.shape[-1]]
    return t


def scale_of(ref):
    if ref.dim() >= 2 and ref.shape[-1] > 1:
        return ref.square().mean(-1, keepdim=True).sqrt()
    return ref.square().mean().sqrt()


def assert_close(x, ref, dtype, what):
    err = (x.double() - ref).abs()
    # plus the storage's resolution near 0 (fp16: the subnormal step 6e-8, that tiny gradients reach)
    bound = TOL[dtype] * (scale_of(ref) + ref.abs()) + torch.finfo(dtype).tiny * torch.finfo(dtype).eps
    bad = err > bound
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} elements off, worst error "
                           f"{(err / bound).max().item():.3g} x the bound ({dtype})")


def compare(fn, inputs, dtype, layout="contiguous", seed=0, fp32=()):
    """fn(*inputs, impl=...) through the GPU path in `dtype` (its [rows, d] inputs in `layout`)
    against the reference (impl="torch") in fp64 on the same rounded values, with the same output
    gradients; compares the outputs and every input's gradient, each at the tolerance of its own
    storage dtype (an fp32 output computed from bf16 inputs must be exact to fp32). The inputs at
    the indices `fp32` stay fp32 whatever `dtype` (coefficients beside a bf16 stream, as the model
    passes them)."""
    torch.manual_seed(seed)
    rounded = [x.to(torch.float32 if i in fp32 else dtype) for i, x in enumerate(inputs)]
    a = [(in_layout(x.to(DEVICE), layout) if x.dim() >= 2 and x.shape[-1] > 1 else x.to(DEVICE))
         .detach().requires_grad_() for x in rounded]
    b = [x.to(DEVICE, torch.float64).detach().requires_grad_() for x in rounded]
    assert layout == "contiguous" or not all(x.is_contiguous() for x in a)
    with gpu_path():
        out_a = fn(*a, impl="triton")
        out_a = out_a if isinstance(out_a, tuple) else (out_a,)
        out_b = fn(*b, impl="torch")
        out_b = out_b if isinstance(out_b, tuple) else (out_b,)
        grads = [torch.randn(o.shape, dtype=torch.float64).to(dtype).to(DEVICE, torch.float64) for o in out_b]
        for i, (x, y) in enumerate(zip(out_a, out_b)):
            assert x.shape == y.shape and x.dtype in (dtype, torch.float32)  # per-row statistics: fp32
            assert_close(x, y, x.dtype, f"output {i}")
        torch.autograd.backward(out_a, [g.to(o.dtype) for g, o in zip(grads, out_a)])
        torch.autograd.backward(out_b, grads)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.grad is not None and x.grad.dtype == x.dtype and x.grad.shape == x.shape
        assert_close(x.grad, y.grad, x.dtype, f"grad of input {i}")


# -----------------------------------------------------------------------------
# rms_norm

@pytest.mark.parametrize("rows, d, dtype", GRID, ids=str)
def test_rms_norm(rows, d, dtype):
    torch.manual_seed(d + rows)
    x = torch.randn(rows, d) * 3 + 0.5
    w = 1 + 0.5 * torch.randn(d)
    compare(lambda x, w, impl: kernels.rms_norm(x, w, impl=impl), [x, w], dtype)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rows, d", [(33, 65), (3, 1024)])
def test_rms_norm_no_weight_and_layouts(rows, d, layout):
    torch.manual_seed(0)
    x = torch.randn(rows, d) * 3 + 0.5
    compare(lambda x, impl: kernels.rms_norm(x, impl=impl), [x], torch.float32, layout)


def test_rms_norm_reference_gradcheck():
    """The reference's hand-written backward against finite differences (gradcheck, fp64), and its
    forward against F.rms_norm."""
    torch.manual_seed(0)
    x = torch.randn(3, 5, 17, dtype=torch.float64, requires_grad=True)
    w = torch.randn(17, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: kernels.rms_norm(x, w, impl="torch"), (x, w))
    assert torch.autograd.gradcheck(lambda x: kernels.rms_norm(x, impl="torch"), (x,))
    torch.testing.assert_close(kernels.rms_norm(x, w, impl="torch"), F.rms_norm(x, (17,), w, 1e-6))


@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_rms_norm_reference_bf16_backward_rounds_once(w_dtype):
    """bf16 x (and a bf16 or fp32 weight) through the reference (impl="torch"): computed in fp32, every
    output and gradient is the exact value rounded once to its storage dtype, within half an ulp
    (2^-8 relative in bf16) of fp64 on the same inputs; bf16 intermediates (products, the <g, x_hat>
    dot, the addcmul that nearly cancels) are off by many ulps. The rows are powers of two >= 1 times
    random-sign permutations of 64 values k/8 whose mean square is exactly 1, so that x_hat is exact
    (eps moves it < 1e-6) even stored in bf16: the bound measures the outputs' own rounding."""
    g = torch.Generator().manual_seed(0)
    R, d = 64, 64
    row = torch.tensor([5] * 20 + [7] * 20 + [9] * 12 + [11] * 8 + [13] * 4, dtype=torch.float64) / 8
    assert row.square().mean() == 1
    x = torch.stack([row[torch.randperm(d, generator=g)] for _ in range(R)])
    x = x * (torch.randint(0, 2, (R, d), generator=g) * 2 - 1) * 2.0 ** torch.randint(0, 7, (R, 1), generator=g)
    x = x.bfloat16()
    w = (1 + 0.5 * torch.randn(d, generator=g)).to(w_dtype)
    dy = torch.randn(R, d, generator=g).bfloat16()
    a, b = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = kernels.rms_norm(a, b, impl="torch")
    y.backward(dy)
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    ref = xr / torch.sqrt(xr.square().mean(-1, keepdim=True) + 1e-6) * wr
    ref.backward(dy.double())
    for got, want, what in ((y, ref.detach(), "y"), (a.grad, xr.grad, "dx"), (b.grad, wr.grad, "dw")):
        assert got.dtype == (w_dtype if what == "dw" else torch.bfloat16), what
        half_ulp = torch.finfo(got.dtype).eps / 2
        err = (got.double() - want).abs()
        bound = half_ulp * want.abs() + 1e-5 * (scale_of(want) + want.abs())  # + fp32 arithmetic
        assert (err <= bound).all(), f"{what}: worst error {(err / bound).max().item():.3g} x the bound"


# -----------------------------------------------------------------------------
# nag_update

def unit_rms_centred(rows, d):
    r = torch.randn(rows, d)
    r = r - r.mean(-1, keepdim=True)
    return r / r.square().mean(-1, keepdim=True).sqrt()


def tangents(rows):
    """Tangents from 1e-4 to 2: the small ones are what a sublayer that barely writes produces."""
    return torch.logspace(-4, math.log10(2), rows).view(rows, 1)[torch.randperm(rows)]


@pytest.mark.parametrize("rows, d, dtype", GRID, ids=str)
def test_nag_update(rows, d, dtype):
    torch.manual_seed(d + rows)
    r = unit_rms_centred(rows, d)
    u = torch.randn(rows, d) + 2 * r + 0.3  # components along r and along 1, which the update removes
    compare(lambda r, u, a, impl: kernels.nag_update(r, u, a, impl=impl), [r, u, tangents(rows)], dtype)


@pytest.mark.parametrize("layout", LAYOUTS[1:])
def test_nag_update_layouts(layout):
    torch.manual_seed(0)
    r = unit_rms_centred(33, 65)
    compare(lambda r, u, a, impl: kernels.nag_update(r, u, a, impl=impl),
            [r, torch.randn(33, 65), tangents(33)], torch.float32, layout)


def test_nag_update_log_gain_small_tangents():
    """log_gain = 0.5 log1p(a^2) to fp32 precision at tiny tangents, against fp64: 0.5 log(1 + a^2)
    in fp32 gives 0 at a = 1e-4 (the truth is 5e-9) and is 5% off at a = 1e-3."""
    a = torch.tensor([0.0, 1e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 0.1, 1.0, 30.0], device=DEVICE).view(-1, 1)
    r, u = unit_rms_centred(len(a), 16).to(DEVICE), torch.randn(len(a), 16, device=DEVICE)
    _, log_gain = kernels.nag_update_fwd_triton(r, u, a, 1e-6)
    truth = 0.5 * torch.log1p(a.double() ** 2)
    torch.testing.assert_close(log_gain.double(), truth, rtol=1e-6, atol=0.0)


def test_nag_update_broadcast_tangent_and_batch_dims():
    """a of shape [1] broadcast over all rows, and r, u with two batch dims."""
    torch.manual_seed(0)
    r = unit_rms_centred(12, 40).view(3, 4, 40)
    compare(lambda r, u, a, impl: kernels.nag_update(r, u, a, impl=impl),
            [r, torch.randn(3, 4, 40), torch.tensor([0.7])], torch.float32)


def test_nag_update_reference_gradcheck():
    """The reference's hand-written backward (the backward kernel's steps) against finite
    differences, fp64; a broadcast over rows included."""
    torch.manual_seed(0)
    r = unit_rms_centred(4, 9).double().requires_grad_()
    u = torch.randn(4, 9, dtype=torch.float64, requires_grad=True)
    a = torch.rand(4, 1, dtype=torch.float64, requires_grad=True)
    a1 = torch.tensor([0.4], dtype=torch.float64, requires_grad=True)  # one tangent for every row
    for tangent in (a, a1):
        assert torch.autograd.gradcheck(lambda r, u, a: kernels.nag_update(r, u, a, impl="torch"), (r, u, tangent))


# -----------------------------------------------------------------------------
# depth_attention

def depth_inputs(rows, d, n_sources, seed):
    torch.manual_seed(seed)
    # sources of very different scales, and a query that makes the softmax far from uniform (scores
    # of std 3) but not degenerate (at std 30, weights of 1e-50 underflow fp32 and the gradients of
    # the query come from cancelling terms: no fp32 computation could match fp64 there)
    scale = torch.logspace(-1, 1, n_sources)[torch.randperm(n_sources)]
    sources = [torch.randn(rows, d) * s for s in scale]
    return sources, torch.randn(d) * 3 / math.sqrt(d), 1 + 0.3 * torch.randn(d)


def depth_fn(*inputs, impl):
    *sources, q, w = inputs
    return kernels.depth_attention(sources, q, w, impl=impl)


# for the interpreter's time, many sources come with few rows, and the widest cases run in bf16
# only (the dtype a GPU trains in)
DEPTH_CASES = [(rows, d, n, dtype) for rows, d in SHAPES for n in (1, 3, 9) for dtype in dtypes_for(rows)
               if rows * n <= 100 and (rows * d * n <= 40_000 or dtype == torch.bfloat16)]


@pytest.mark.parametrize("rows, d, n_sources, dtype", DEPTH_CASES, ids=str)
def test_depth_attention(rows, d, n_sources, dtype):
    sources, q, w = depth_inputs(rows, d, n_sources, seed=d + rows + n_sources)
    compare(depth_fn, [*sources, q, w], dtype)


@pytest.mark.parametrize("layout", LAYOUTS[1:])
def test_depth_attention_layouts(layout):
    sources, q, w = depth_inputs(9, 65, 4, seed=1)
    compare(depth_fn, [*sources, q, w], torch.float32, layout)


@pytest.mark.parametrize("layout", ["stacked", "stacked-transposed"])
def test_depth_attention_stacked_sources(layout):
    """One [S, ..., d] tensor of sources, as before the list API: its unbound views, at offsets of
    one storage (or strided), go through the address table like separate tensors."""
    sources, q, w = depth_inputs(7, 48, 4, seed=2)
    stacked = torch.stack(sources)
    if layout == "stacked-transposed":
        stacked = stacked.transpose(0, 1).contiguous().transpose(0, 1)
    compare(lambda s, q, w, impl: kernels.depth_attention(s, q, w, impl=impl), [stacked, q, w], torch.float32)


def mix_chain(x, params, use_stack):
    """A chain as the models make it: each step mixes every source so far (depth_attention, dense_mix with
    shared weights, dense_mix with per-token weights, in turn) and appends the result, from a SourceStack (or
    a plain list); capacity 3, so the stack outgrows its buffer. Returns the outputs."""
    sources = kernels.SourceStack.start(x, 3, "torch") if use_stack else [x]
    outs = []
    for i, p in enumerate(params):
        S = len(sources)
        if i % 3 == 0:
            y = kernels.depth_attention(sources, p[0], p[1], impl="torch")
        elif i % 3 == 1:
            y = kernels.dense_mix(sources, p[0, :S], impl="torch")
        else:
            w = (x[..., :2 * S].unflatten(-1, (2, S)) * p[0, :2 * S].view(2, S)).tanh()
            y = kernels.dense_mix(sources, w, impl="torch").sum(-2)
        outs.append(y)
        sources = sources.append(y) if use_stack else sources + [y]
    return outs


def source_stack_chain(use_stack, dtype, grow=4):
    """mix_chain on the same values in any dtype: (the outputs, grads of every input)."""
    torch.manual_seed(0)  # the same values in every dtype
    x = torch.randn(2, 5, 24).to(dtype).requires_grad_()
    params = [torch.randn(2, 24).to(dtype).requires_grad_() for _ in range(grow)]
    outs = mix_chain(x, params, use_stack)
    loss = sum((o.float() * (i + 1)).sum() for i, o in enumerate(outs))
    return outs, torch.autograd.grad(loss, [x, *params])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_source_stack_mixes_equal_the_lists(dtype):
    """A SourceStack's buffer holds the sources the list holds: the same mixes bit for bit (the reference
    stacks the list the same way), across appends past the buffer's capacity and backwards that run after
    later appends. The gradients: the stack's mixes sum each source's gradients in fp32 slots (SourceGrads)
    and hand it over once, where autograd sums the list's, one per mix, in the source's dtype: the same
    terms in another order and rounding, within the kernels' tolerance of the dtype, element by element."""
    a, b = source_stack_chain(True, dtype), source_stack_chain(False, dtype)
    for x, y in zip(a[0], b[0]):
        assert torch.equal(x, y)
    for i, (x, y) in enumerate(zip(a[1], b[1])):
        assert x.dtype == y.dtype == dtype
        if dtype == torch.float32:
            assert_close(x, y.double(), dtype, f"grad of input {i}")
        else:  # a source's gradient rounded once or once per mix: the difference reaches, through the later
            # mixes' backwards, the gradients of every source before it, so 4x the bf16 tolerance
            err, ref = (x.double() - y.double()).abs(), y.double()
            assert (err <= 4 * TOL[dtype] * (scale_of(ref) + ref.abs())).all(), f"grad of input {i}"


def test_source_stack_gradients_gradcheck():
    """The gradients through a stack's slots against finite differences, in fp64, on a chain that outgrows
    its buffer (its sources then move to a second buffer with slots of its own). gradcheck runs a backward per
    output element on one graph: a slot that kept its sum after handing it over would count it twice."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    params = [torch.randn(2, 8, dtype=torch.float64, requires_grad=True) for _ in range(5)]
    assert torch.autograd.gradcheck(lambda x, *p: tuple(mix_chain(x, p, True)), (x, *params))
    outs = mix_chain(x, params, True)  # and a source read by the mixes and by the loss besides
    gx = torch.autograd.grad(sum(o.sum() for o in outs) + x.square().sum(), x)[0]
    expect = torch.autograd.grad(sum(o.sum() for o in mix_chain(x, params, False)) + x.square().sum(), x)[0]
    torch.testing.assert_close(gx, expect, rtol=1e-12, atol=1e-12)
    with torch.no_grad():  # a source appended without a gradient that needs one at the mix: one per source
        stack = kernels.SourceStack.start(x, 2, "torch")
    w = torch.tensor([0.5], dtype=torch.float64)
    assert kernels._slot_grads(stack) is None
    assert torch.equal(torch.autograd.grad(kernels.dense_mix(stack, w).sum(), x)[0], torch.full_like(x, 0.5))


def test_source_stack_branches_keep_their_own_slots():
    """Two appends to one stack (a test writing one state twice) give two stacks, each holding its own source,
    and the first mix's backward still reads the slots it mixed."""
    torch.manual_seed(0)
    e, b, c = (torch.randn(3, 8, requires_grad=True) for _ in range(3))
    root = kernels.SourceStack.start(e, 4, "torch")
    first = root.append(b)
    q, w = torch.randn(8), torch.ones(8)
    mix = kernels.depth_attention(first, q, w, impl="torch")
    second = root.append(c)
    assert torch.equal(first.stacked()[1], b.detach()) and torch.equal(second.stacked()[1], c.detach())
    assert first.stacked()[0].data_ptr() != second.stacked()[0].data_ptr()  # the branch got its own buffer
    third = first.append(c)  # first's buffer, extended in place
    assert third.buffer is first.buffer and torch.equal(third.stacked()[2], c.detach())
    grown = kernels.SourceStack.start(e, 1, "torch").append(b).append(c)  # full at 1, then at 2: doubled each time
    assert len(grown.buffer) == 4 and torch.equal(grown.stacked(), torch.stack([e, b, c]).detach())
    grads = torch.autograd.grad(mix.sum(), [e, b])
    expect = torch.autograd.grad(kernels.depth_attention([e, b], q, w, impl="torch").sum(), [e, b])
    for g, h in zip(grads, expect):
        assert torch.equal(g, h)


def test_source_stack_buffer_is_saved_once():
    """The mixes of one stack save its buffer (so saved-activation counts and hooks see it) as one storage,
    whatever the number of mixes; the appends after a mix leave its saved view valid for the backward."""
    torch.manual_seed(0)
    x = torch.randn(4, 16, requires_grad=True)
    q, w = torch.randn(16), torch.ones(16)

    def chain():
        stack = kernels.SourceStack.start(x, 6, "torch")
        for _ in range(5):
            stack = stack.append(kernels.depth_attention(stack, q, w, impl="torch") * 0.5 + x)
        return stack[-1]
    _, saved, out = saved_storage(chain)
    buffers = [t for t in saved if t.untyped_storage().nbytes() == 6 * 4 * 16 * 4]
    assert len(buffers) == 1 and buffers[0].dtype == torch.float32
    out.sum().backward()
    assert x.grad.abs().max() > 0


def test_source_stack_has_no_buffer_where_the_reference_does_not_run_eagerly():
    """The Triton path reads the list (no buffer), and so does torch.compile, which fuses the reference."""
    x = torch.randn(2, 8, requires_grad=True)
    assert kernels.SourceStack.start(x, 4, "torch").buffer is not None
    if kernels.triton is not None:
        assert kernels.SourceStack.start(x, 4, "triton").buffer is None
    seen = []

    def f(x):
        stack = kernels.SourceStack.start(x, 4, "torch")
        seen.append(stack.buffer is None)
        return kernels.dense_mix(stack.append(x * 2), torch.tensor([1.0, 0.5]), impl="torch")
    torch._dynamo.reset()
    out = torch.compile(f, backend="eager", fullgraph=True)(x)
    torch._dynamo.reset()
    assert seen == [True] and torch.equal(out, 2 * x.detach())


def test_depth_attention_batch_dims_and_definition():
    """[B, T, d] sources: the reference against the definition, one source at a time, and the
    Triton kernels against the reference."""
    torch.manual_seed(0)
    sources = [torch.randn(2, 3, 24, dtype=torch.float64) for _ in range(4)]
    q, w = torch.randn(24, dtype=torch.float64), torch.rand(24, dtype=torch.float64) + 0.5
    scores = torch.stack([(v / (v.square().mean(-1, keepdim=True) + 1e-6).sqrt() * w * q).sum(-1) for v in sources])
    weights = torch.softmax(scores, dim=0)
    torch.testing.assert_close(kernels.depth_attention(sources, q, w, impl="torch"),
                               sum(wt.unsqueeze(-1) * v for wt, v in zip(weights, sources)))
    compare(depth_fn, [*[v.float() for v in sources], q.float(), w.float()], torch.float32)


def test_depth_attention_reference_gradcheck():
    torch.manual_seed(0)
    inputs = [torch.randn(*shape, dtype=torch.float64, requires_grad=True) for shape in [(3, 7)] * 3 + [(7,)] * 2]
    assert torch.autograd.gradcheck(lambda *x: depth_fn(*x, impl="torch"), inputs)


# -----------------------------------------------------------------------------
# hyper-connections: mhc_pre_mix, sinkhorn, hc_post_mix (n streams [rows, n, d] per token)

# the widths above at n = 4 (the model's default), and n = 1, 3 (NP 4: masked streams) and 8 (fp32: the
# largest tiles) at d = 65
HC_CASES = [(rows, d, 4, dtype) for rows, d, dtype in GRID] + \
    [(9, 65, n, dtype) for n in (1, 3) for dtype in DTYPES] + [(9, 65, 8, torch.float32)]
# eps and norm_eps large enough that dropping one fails the fp32 tolerance (at 1e-6 they are below it)
MHC_ARGS = dict(norm_eps=1e-3, pre_eps=0.05, post_mult=2.0)


def mhc_inputs(rows, d, n, seed):
    """(x, proj, scale, base): rows of streams from RMS 0.01 (below sqrt(norm_eps): the eps matters)
    to 10, each stream at its own scale; proj = vec(x) phi^T, so that proj * rstd is O(1); scale and
    base that put c in the sigmoids' curved range."""
    torch.manual_seed(seed)
    x = torch.randn(rows, n, d) * torch.logspace(-2, 1, rows).view(rows, 1, 1)
    x = x * torch.logspace(-0.5, 0.5, n).view(n, 1)
    K = n * (n + 2)
    proj = x.flatten(-2) @ (torch.randn(K, n * d) / math.sqrt(n * d)).T
    return x, proj, torch.tensor([0.8, 1.3, 1.7]), 0.5 * torch.randn(K)


def mhc_fn(x, proj, scale, base, impl):
    return kernels.mhc_pre_mix(x, proj, scale, base, **MHC_ARGS, impl=impl)


@pytest.mark.parametrize("rows, d, n, dtype", HC_CASES, ids=str)
def test_mhc_pre_mix(rows, d, n, dtype):
    """x and proj in the storage dtype, scale and base fp32 (parameters); u in x's dtype, h_post
    and res_logits fp32, at fp32's tolerance."""
    compare(mhc_fn, list(mhc_inputs(rows, d, n, seed=rows + d + n)), dtype, fp32=(2, 3))


@pytest.mark.parametrize("layout", LAYOUTS[1:])
def test_mhc_pre_mix_layouts(layout):
    compare(mhc_fn, list(mhc_inputs(9, 65, 4, seed=1)), torch.float32, layout)


def test_mhc_pre_mix_batch_dims_and_storage_dtypes():
    """[B, T, n, d] streams; bf16 scale and base (everything rounded to bf16)."""
    x, proj, scale, base = mhc_inputs(6, 40, 4, seed=2)
    compare(mhc_fn, [x.view(2, 3, 4, 40), proj.view(2, 3, 24), scale, base], torch.bfloat16)


# (rows, n, repeat): 70 rows at n = 4 are two programs of 64 matrices, the second masked; 20 steps over
# 40-70 matrices of n >= 3, the largest grids, in fp32 alone (mhc's logits are fp32)
SINKHORN_CASES = [(rows, n, repeat, dtype) for rows, n, repeat in [(70, 4, 1), (70, 4, 2), (1, 4, 20), (40, 2, 20)]
                  for dtype in DTYPES] + \
    [(rows, n, 20, torch.float32) for rows, n in [(70, 4), (40, 3), (40, 8)]]


def sinkhorn_fn(eps, repeat):
    return lambda logits, impl: kernels.sinkhorn(logits, repeat, eps, impl=impl)


@pytest.mark.parametrize("rows, n, repeat, dtype", SINKHORN_CASES, ids=str)
def test_sinkhorn(rows, n, repeat, dtype):
    """Logits in the storage dtype, H fp32 at fp32's tolerance; the gradient in the logits' dtype.
    eps 1e-3, which moves H by far more than the tolerance."""
    torch.manual_seed(rows + n + repeat)
    compare(sinkhorn_fn(1e-3, repeat), [2 * torch.randn(rows, n, n)], dtype)


@pytest.mark.parametrize("layout", LAYOUTS[1:])
def test_sinkhorn_layouts_and_default_eps(layout):
    torch.manual_seed(0)
    compare(sinkhorn_fn(1e-6, 10), [2 * torch.randn(2, 5, 4, 4)], torch.float32, layout)


def test_sinkhorn_one_stream():
    """n = 1: H is the one entry's normalisation, and the logits' gradient is 0 (a softmax over one
    value is constant)."""
    logits = torch.randn(5, 1, 1, device=DEVICE, requires_grad=True)
    with gpu_path():
        h = kernels.sinkhorn(logits, 20, 1e-3, impl="triton")
        h.sum().backward()
    torch.testing.assert_close(h.cpu(), kernels.sinkhorn(logits.detach().cpu(), 20, 1e-3, impl="torch"))
    assert (logits.grad == 0).all()


def sinkhorn_cols_rows(h):
    return (h.sum(-2) - 1).abs().max().item(), (h.sum(-1) - 1).abs().max().item()


def test_sinkhorn_is_doubly_stochastic():
    """The GPU path's H: columns sum to 1 (the last step, within eps), rows to within the
    iterations' error, which 20 iterations make small (seen on these logits: 0.43 after 1, 3e-5
    after 20; logits of std 2 converge slower, 0.02 after 20)."""
    torch.manual_seed(0)
    logits = torch.randn(64, 4, 4, device=DEVICE)
    with gpu_path():
        cols, rows = sinkhorn_cols_rows(kernels.sinkhorn(logits, 20, impl="triton"))
        rows_1 = sinkhorn_cols_rows(kernels.sinkhorn(logits, 1, impl="triton"))[1]
    assert cols < 1e-5 and rows < 1e-4 and rows_1 > 0.1


def post_inputs(rows, d, n, shared, seed):
    """(x, out, h_post, h_res): per-row coefficients (mhc's: h_res doubly stochastic-ish) or shared
    ones (hc's parameters), of both signs for h_res's off-diagonal when shared."""
    torch.manual_seed(seed)
    x = torch.randn(rows, n, d) * torch.logspace(-0.5, 0.5, n).view(n, 1)
    out = torch.randn(rows, d)
    lead = () if shared else (rows,)
    h_post = 2 * torch.sigmoid(torch.randn(*lead, n))
    h_res = torch.softmax(torch.randn(*lead, n, n), -1) if not shared else torch.eye(n) + 0.3 * torch.randn(n, n)
    return [x, out, h_post, h_res]


def post_fn(x, out, h_post, h_res, impl):
    return kernels.hc_post_mix(x, out, h_post, h_res, impl=impl)


@pytest.mark.parametrize("shared", [False, True], ids=["per-row", "shared"])
@pytest.mark.parametrize("rows, d, n, dtype", HC_CASES, ids=str)
def test_hc_post_mix(rows, d, n, dtype, shared):
    """x and out in the storage dtype, the coefficients fp32 (mhc's from sinkhorn, hc's
    parameters); a shared coefficient's gradient is summed over the rows."""
    compare(post_fn, post_inputs(rows, d, n, shared, seed=rows + d + n), dtype, fp32=(2, 3))


@pytest.mark.parametrize("layout", LAYOUTS[1:])
@pytest.mark.parametrize("shared", [False, True], ids=["per-row", "shared"])
def test_hc_post_mix_layouts(layout, shared):
    """Non-contiguous streams, output and coefficients (a transposed shared h_res is copied)."""
    compare(post_fn, post_inputs(9, 65, 4, shared, seed=3), torch.float32, layout)


def test_hc_post_mix_batch_dims_and_partial_broadcast():
    """[B, T, n, d] streams with coefficients per token [B, T, ...], per position [T, ...] (broadcast
    over B, copied per row by the launcher) and bf16 coefficients."""
    x, out, h_post, h_res = post_inputs(6, 40, 4, False, seed=4)
    x, out = x.view(2, 3, 4, 40), out.view(2, 3, 40)
    compare(post_fn, [x, out, h_post.view(2, 3, 4), h_res.view(2, 3, 4, 4)], torch.bfloat16)
    compare(post_fn, [x, out, h_post[:3], h_res[:3]], torch.float32)


# the definitions, written without the references' folding: the RMSNorm before the projection,
# Sinkhorn as alternating divisions, the post-mix as an einsum

def mhc_definition(x, phi, scale, base, norm_eps, pre_eps, post_mult):
    n = x.shape[-2]
    flat = x.flatten(-2)
    c = (flat / torch.sqrt(flat.square().mean(-1, keepdim=True) + norm_eps)) @ phi.T
    pre = torch.sigmoid(scale[0] * c[..., :n] + base[:n]) + pre_eps
    post = torch.sigmoid(scale[1] * c[..., n:2 * n] + base[n:2 * n]) * post_mult
    res = (scale[2] * c[..., 2 * n:] + base[2 * n:]).unflatten(-1, (n, n))
    return torch.einsum("...m,...md->...d", pre, x), post, res


def sinkhorn_definition(logits, repeat, eps):
    h = torch.softmax(logits, -1) + eps
    h = h / (h.sum(-2, keepdim=True) + eps)
    for _ in range(repeat - 1):
        h = h / (h.sum(-1, keepdim=True) + eps)
        h = h / (h.sum(-2, keepdim=True) + eps)
    return h


def post_definition(x, out, h_post, h_res):
    return torch.einsum("...mj,...md->...jd", h_res, x) + h_post.unsqueeze(-1) * out.unsqueeze(-2)


def same_values_and_grads(fn, definition, inputs):
    """fn (the reference, impl="torch") and the definition through autograd: equal outputs and
    input gradients, fp64."""
    results = []
    for f in (fn, definition):
        leaves = [t.detach().requires_grad_() for t in inputs]
        outs = f(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        torch.autograd.backward(outs, [torch.cos(torch.arange(o.numel(), dtype=o.dtype)).view(o.shape)
                                       for o in outs])
        results.append((outs, [t.grad for t in leaves]))
    (outs, grads), (outs_d, grads_d) = results
    for got, want in zip(outs + tuple(grads), outs_d + tuple(grads_d)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_hc_references_against_definitions():
    """The three references (forward and hand-written backward) against the definitions through
    autograd, fp64: proj = vec(x) phi^T folded with rstd afterwards, [B, T, ...] rows, per-row and
    shared post-mix coefficients."""
    torch.manual_seed(0)
    B, T, n, d = 2, 3, 4, 5
    dbl = dict(dtype=torch.float64)
    x, phi = torch.randn(B, T, n, d, **dbl), torch.randn(n * (n + 2), n * d, **dbl) / math.sqrt(n * d)
    scale, base = torch.tensor([0.8, 1.3, 1.7], **dbl), 0.5 * torch.randn(n * (n + 2), **dbl)
    same_values_and_grads(
        lambda x, phi, s, b: kernels.mhc_pre_mix(x, x.flatten(-2) @ phi.T, s, b, **MHC_ARGS, impl="torch"),
        lambda x, phi, s, b: mhc_definition(x, phi, s, b, **MHC_ARGS), [x, phi, scale, base])
    for repeat in (1, 2, 7):
        same_values_and_grads(lambda l: kernels.sinkhorn(l, repeat, 1e-3, impl="torch"),
                              lambda l: sinkhorn_definition(l, repeat, 1e-3), [2 * torch.randn(B, T, n, n, **dbl)])
    out = torch.randn(B, T, d, **dbl)
    for h_post, h_res in [(torch.rand(B, T, n, **dbl), torch.rand(B, T, n, n, **dbl)),  # per row, shared,
                          (torch.rand(n, **dbl), torch.randn(n, n, **dbl)),  # and h_post per position
                          (torch.rand(T, n, **dbl), torch.rand(n, n, **dbl))]:
        same_values_and_grads(lambda *t: post_fn(*t, impl="torch"), post_definition, [x, out, h_post, h_res])


def test_hc_references_gradcheck():
    """The references' hand-written backwards against finite differences, fp64."""
    torch.manual_seed(0)
    dbl = dict(dtype=torch.float64, requires_grad=True)
    n, d = 3, 5
    x, proj = torch.randn(2, n, d, **dbl), torch.randn(2, n * (n + 2), **dbl)
    scale, base = torch.tensor([0.8, 1.3, 1.7], **dbl), torch.randn(n * (n + 2), **dbl)
    assert torch.autograd.gradcheck(lambda *t: mhc_fn(*t, impl="torch"), (x, proj, scale, base))
    logits = torch.randn(2, n, n, **dbl)
    for repeat in (1, 4):
        assert torch.autograd.gradcheck(lambda l: kernels.sinkhorn(l, repeat, 1e-3, impl="torch"), (logits,))
    out = torch.randn(2, d, **dbl)
    for h_post, h_res in [(torch.rand(2, n, **dbl), torch.rand(2, n, n, **dbl)),
                          (torch.rand(n, **dbl), torch.randn(n, n, **dbl))]:
        assert torch.autograd.gradcheck(lambda *t: post_fn(*t, impl="torch"), (x, out, h_post, h_res))


# -----------------------------------------------------------------------------
# memory: what depth attention saves for the backward

def saved_storage(fn):
    """(bytes of every storage that autograd saves while fn runs, each counted once; the saved
    tensors themselves; fn's result)."""
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(t.untyped_storage().nbytes() for t in saved.values()), list(saved.values()), out


def depth_chain(n_sources, impl, rows=16, d=64, dtype=torch.float32):
    """Full AttnRes in miniature: each step mixes every source so far and appends a new one."""
    torch.manual_seed(0)
    x = torch.randn(rows, d, dtype=dtype, requires_grad=True)
    params = [torch.randn(2, d, requires_grad=True) for _ in range(n_sources - 1)]
    sources = [x]
    for q, w in params:
        sources.append(kernels.depth_attention(sources, q, w, impl=impl) * 0.5 + x)
    return sources[-1]


# impl="triton" is the custom op (its CPU implementation here): its setup_context decides what is
# saved, the same on every device
@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_depth_attention_saves_each_source_once(impl):
    """A chain over S sources saves O(S) activations: each source and lse once (the sources are
    shared by every later step), where re-stacking them would save sum_l l sources, O(S^2 d).
    The reference (impl="torch") also keeps the forward's per-source dots and rho, 2 l floats per row
    at step l: O(S^2) scalars, no d. Measured (16 x 64 fp32 sources, 4 KiB each): S = 8: 32 KiB,
    S = 32: 141 KiB (the op); the old stacked reference saved 123 KiB and 2.1 MiB."""
    rows, d, f32 = 16, 64, 4
    for n in (8, 32):
        total, saved, out = saved_storage(lambda: depth_chain(n, impl, rows, d))
        # the n - 1 sources that a later step reads (the last one is only the output), and per
        # step the lse and the query and weight (and the reference's statistics, per source mixed)
        stats = sum(2 * l * rows * f32 for l in range(1, n)) if impl == "torch" else 0
        assert total <= (n - 1) * rows * d * f32 + (n - 1) * (rows + 2 * d) * f32 + stats, (n, total)
        restacked = sum(l * rows * d * f32 for l in range(1, n))
        source_sized = sum(t.untyped_storage().nbytes() for t in saved if t.numel() >= rows * d)
        assert n < 32 or source_sized < restacked / 10
        out.sum().backward()  # and what was saved makes a backward


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_depth_attention_saves_bf16_under_autocast(impl):
    """Under bf16 autocast the sources stay bf16: nothing source-sized is saved in fp32."""
    rows, d = 16, 64
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, saved, out = saved_storage(lambda: depth_chain(6, impl, rows, d, torch.bfloat16))
    assert out.dtype == torch.bfloat16
    big = [t for t in saved if t.numel() >= rows * d]
    assert len(big) == 5 and all(t.dtype == torch.bfloat16 for t in big), [t.dtype for t in big]  # the sources
    out.float().sum().backward()


# -----------------------------------------------------------------------------
# the ops: schema and registrations, and what torch.compile sees

def all_kernels(x, w, r, u, a, s0, s1, s2, q, hx, proj, scale, base, impl="triton"):
    y = kernels.rms_norm(x, w, impl=impl) + kernels.rms_norm(x, impl=impl)
    r_new, log_gain = kernels.nag_update(r, u, a, impl=impl)
    mix = kernels.depth_attention([s0, s1, s2], q, w, impl=impl)
    # an mhc sublayer's mixes around a stand-in sublayer (2 u), and hc's post-mix with shared coefficients
    hu, h_post, res_logits = kernels.mhc_pre_mix(hx, proj, scale, base, impl=impl)
    h_res = kernels.sinkhorn(res_logits, 3, impl=impl)
    written = kernels.hc_post_mix(hx, 2 * hu, h_post, h_res, impl=impl)
    shared = kernels.hc_post_mix(hx, hu, base[:4], base[8:].view(4, 4), impl=impl)
    # the dense mixes: dwa's weights [S], mudd's per row and way [rows, C, S]
    dwa = kernels.dense_mix([s0, s1, s2], q[:3], impl=impl)
    mudd = kernels.dense_mix([s0, s1, s2], proj[:, :12].unflatten(-1, (4, 3)), impl=impl)
    return y, r_new, log_gain, mix, written, shared, dwa, mudd


def kernel_inputs(dtype=torch.float32, rows=6, d=16, device=DEVICE):
    torch.manual_seed(0)
    r = unit_rms_centred(rows, d)
    inputs = [torch.randn(rows, d), 1 + 0.3 * torch.randn(d), r, torch.randn(rows, d), torch.rand(rows, 1),
              *(torch.randn(rows, d) for _ in range(3)), torch.randn(d),
              torch.randn(rows, 4, d), torch.randn(rows, 24), torch.tensor([0.8, 1.3, 1.7]), 0.5 * torch.randn(24)]
    return [x.to(device, dtype).requires_grad_() for x in inputs]


@pytest.mark.parametrize("path", ["cpu-op", "gpu-path"])
def test_opcheck(path):
    """torch.library.opcheck: schema, autograd registration, fake tensors, AOT dispatch (which runs
    the backward op too), for each op with the inputs all_kernels gives it: through the ops' CPU
    implementations, and (forward ops, for the interpreter's time) through the GPU path."""
    x, w, r, u, a, s0, s1, s2, q, hx, proj, scale, base = kernel_inputs()
    _, rstd = kernels.rms_norm_op(x, w, 1e-6)
    _, lse = kernels.depth_attention_op([s0, s1, s2], q, w, 1e-6)
    g = torch.randn_like(x)
    hu, h_post, res_logits = (t.detach() for t in kernels.mhc_pre_mix_op(hx, proj, scale, base, 1e-6, 1e-6, 2.0))
    h_res = torch.softmax(res_logits, -1).requires_grad_()
    h_post.requires_grad_()
    hx0, gx = hx.detach(), torch.randn_like(hx)
    cases = [(kernels.rms_norm_op, (x, w, 1e-6)), (kernels.rms_norm_op, (x, None, 1e-6)),
             (kernels.rms_norm_backward_op, (g, x.detach(), w.detach(), rstd.detach())),
             (kernels.nag_update_op, (r, u, a, 1e-6)), (kernels.nag_update_op, (r, u, a[:1, 0], 1e-6)),
             (kernels.nag_update_backward_op, (r.detach(), u.detach(), a.detach(), g, g[:, :1], 1e-6)),
             (kernels.depth_attention_op, ([s0, s1, s2], q, w, 1e-6)),
             (kernels.depth_attention_backward_op, ([s.detach() for s in (s0, s1, s2)], q.detach(), w.detach(),
                                                    lse.detach(), g, 1e-6)),
             (kernels.mhc_pre_mix_op, (hx, proj, scale, base, 1e-3, 0.05, 2.0)),
             (kernels.mhc_pre_mix_backward_op, (hx0, proj.detach(), scale.detach(), base.detach(), torch.randn_like(hu),
                                                h_post.detach(), res_logits, 1e-3, 0.05, 2.0)),
             (kernels.sinkhorn_op, (res_logits.clone().requires_grad_(), 3, 1e-6)),
             (kernels.sinkhorn_backward_op, (res_logits, h_res.detach(), 3, 1e-6)),
             (kernels.hc_post_mix_op, (hx, u, h_post, h_res)),
             (kernels.hc_post_mix_op, (hx, u, base[:4], base[8:].view(4, 4))),  # shared coefficients
             (kernels.hc_post_mix_backward_op, (hx0, hu, h_post.detach(), h_res.detach(), gx)),
             (kernels.hc_post_mix_backward_op, (hx0, hu, base[:4].detach(), base[8:].view(4, 4).detach(), gx))]
    if path == "gpu-path":  # rms_norm, nag_update, depth_attention, mhc_pre_mix, sinkhorn, hc_post_mix (x2)
        cases = [cases[i] for i in (0, 3, 6, 8, 10, 12, 13)]
    with gpu_path() if path == "gpu-path" else contextlib.nullcontext():
        for op, args in cases:
            torch.library.opcheck(op, args)


# the fourteen kernels the launchers launch (_log1p, _source, _hc_tile, ... are helpers that kernels call)
LAUNCHED = ("_rms_norm_fwd", "_rms_norm_bwd", "_nag_fwd", "_nag_bwd", "_depth_attention_fwd", "_depth_attention_bwd",
            "_mhc_pre_mix_fwd", "_mhc_pre_mix_bwd", "_sinkhorn_fwd", "_sinkhorn_bwd",
            "_hc_post_mix_fwd", "_hc_post_mix_bwd", "_dense_mix_fwd", "_dense_mix_bwd")


def test_gpu_path_launches_the_triton_kernels(monkeypatch):
    """compare() measures the Triton kernels, not the reference against itself: inside gpu_path()
    impl="triton" launches every kernel, forward and backward, and impl="torch" launches none.
    (On CPU, triton_on_cpu() switches off the CPU implementation of every op kernels.py defines.)"""
    launched = []

    class Recording:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            launched.append(self.name)
            return self.kernel[grid]

    for name in LAUNCHED:
        monkeypatch.setattr(kernels, name, Recording(name, getattr(kernels, name)))
    assert len(kernels.custom_ops()) == 14  # a forward and a backward op per kernel
    inputs = kernel_inputs()
    for impl, want in (("torch", set()), ("triton", set(LAUNCHED))):
        launched.clear()
        with gpu_path():
            outs = all_kernels(*inputs, impl=impl)
            sum(o.float().sum() for o in outs).backward()
        assert set(launched) == want, impl


def test_ops_cpu_gradcheck():
    """The ops on CPU tensors, fp64: their CPU implementations (the references) through the ops'
    registered autograd (setup_context, the backward ops), against finite differences."""
    inputs = kernel_inputs(torch.float64, rows=3, d=7, device="cpu")
    x, w, r, u, a, s0, s1, s2, q, *hc = [t.detach().requires_grad_() for t in inputs]
    assert torch.autograd.gradcheck(lambda *t: all_kernels(*t), (x, w, r, u, a, s0, s1, s2, q, *hc))
    a1 = torch.tensor([0.4], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda r, u, a: kernels.nag_update(r, u, a, impl="triton"), (r, u, a1))


FORWARD_OPS = ("rms_norm", "nag_update", "depth_attention", "mhc_pre_mix", "sinkhorn", "hc_post_mix", "dense_mix")


def test_compile_sees_the_ops():
    """torch.compile(fullgraph=True) keeps each kernel as one nanodepth op in the forward graph,
    and each backward op in the backward graph (the kernels do not compile away)."""
    from torch._dynamo.backends.common import aot_autograd
    from functorch.compile import make_boxed_func

    def targets(graphs):
        return {str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}

    dynamo_graphs, forward_graphs, backward_graphs = [], [], []

    def recording(graphs):
        def backend(gm, example_inputs):
            graphs.append(gm)
            return make_boxed_func(gm.forward) if graphs is not dynamo_graphs else gm.forward
        return backend

    inputs = kernel_inputs()
    torch._dynamo.reset()
    torch.compile(all_kernels, backend=recording(dynamo_graphs), fullgraph=True)(*inputs)
    assert {f"nanodepth.{op}.default" for op in FORWARD_OPS} <= targets(dynamo_graphs)
    torch._dynamo.reset()
    aot = aot_autograd(fw_compiler=recording(forward_graphs), bw_compiler=recording(backward_graphs))
    outs = torch.compile(all_kernels, backend=aot, fullgraph=True)(*inputs)
    torch.autograd.backward([o for o in outs if o.requires_grad], [torch.ones_like(o) for o in outs if o.requires_grad])
    assert {f"nanodepth.{op}.default" for op in FORWARD_OPS} <= targets(forward_graphs)
    assert {f"nanodepth.{op}_backward.default" for op in FORWARD_OPS} <= targets(backward_graphs)
    torch._dynamo.reset()


@pytest.mark.parametrize("path", ["cpu-op", "gpu-path", "torch"])
def test_compile_matches_eager(path):
    """aot_eager over the ops (and over the references, impl="torch", which inductor would fuse):
    the same outputs and gradients as eager, bit for bit."""
    inputs = kernel_inputs()
    results = []
    torch._dynamo.reset()
    fn = functools.partial(all_kernels, impl="torch" if path == "torch" else "triton")
    with gpu_path() if path == "gpu-path" else contextlib.nullcontext():
        for fn in (fn, torch.compile(fn, backend="aot_eager", fullgraph=True)):
            outs = fn(*inputs)
            loss = sum((o.float() * (i + 1)).sum() for i, o in enumerate(outs))
            results.append((outs, torch.autograd.grad(loss, inputs)))
    torch._dynamo.reset()
    (outs_e, grads_e), (outs_c, grads_c) = results
    for x, y in zip(outs_c + grads_c, outs_e + grads_e):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_impl_choice(monkeypatch):
    x = torch.randn(2, 8)
    assert kernels.use_triton("auto", x) is False  # CPU tensors take the reference
    assert kernels.use_triton("torch", x) is False
    assert kernels.use_triton("triton", x) is True
    with pytest.raises(ValueError, match="valid: auto, torch, triton"):
        kernels.use_triton("cuda", x)

    class CudaTensor:
        is_cuda = True
    # CUDA tensors take the op, eager and compiled alike (no fallback to the reference under compile)
    assert kernels.use_triton("auto", CudaTensor()) is True
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert kernels.use_triton("auto", CudaTensor()) is True
    monkeypatch.setattr(kernels, "triton", None)
    assert kernels.use_triton("auto", CudaTensor()) is False
    with pytest.raises(RuntimeError, match="needs the triton package"):
        kernels.use_triton("triton", x)


def model_residuals():
    from model import RESIDUALS
    return ["prenorm", "nag", "block_attnres"] + [r for r in ("hc", "mhc") if r in RESIDUALS]


@pytest.mark.parametrize("residual", model_residuals())
def test_model_same_loss_and_gradients_with_either_impl(residual):
    """The whole model through the GPU path (RMSNorm everywhere, nag's write-back, depth
    attention, hyper-connections' mixes and Sinkhorn) against the same weights through the references.
    mhc with 3 Sinkhorn steps, not 20: the wiring is what is tested here (test_sinkhorn runs 20)."""
    from model import GPT, GPTConfig
    results = []
    for impl in ("triton", "torch"):
        torch.manual_seed(0)
        blocks = dict(attnres_blocks=2) if residual == "block_attnres" else {}  # an option of that mode alone
        if residual == "mhc":
            blocks["mhc_sinkhorn_repeat"] = 3
        config = GPTConfig(block_size=16, vocab_size=65, n_layer=2, n_head=2, n_embd=48, residual=residual,
                           kernels=impl, **blocks)
        model = GPT(config).to(DEVICE)
        model.stream.perturb(0.2, torch.Generator().manual_seed(0))  # off init: queries, mixes and norm weights matter
        idx = torch.randint(0, 65, (2, 16), generator=torch.Generator().manual_seed(1)).to(DEVICE)
        with gpu_path():
            _, loss = model(idx, idx)
            loss.backward()
        results.append((loss.item(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_t, grads_t), (loss_r, grads_r) = results
    assert loss_t == pytest.approx(loss_r, rel=1e-6)
    for name in grads_r:
        torch.testing.assert_close(grads_t[name], grads_r[name], rtol=1e-4, atol=1e-6, msg=name)
