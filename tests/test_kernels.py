"""Each kernel's GPU path against its PyTorch reference: values and gradients over a grid of widths
(powers of two and not, up to 4096), row counts, source counts, layouts (contiguous, transposed,
sliced) and storage dtypes; then the custom ops under torch.compile, and the memory depth
attention saves.

On CPU the GPU path runs in Triton's interpreter (TRITON_INTERPRET=1, set in conftest.py) inside
triton_on_cpu() (tests/triton_cpu.py): the public function with impl="triton" -> the custom op ->
the Triton launchers and kernels, forward and backward, exactly as on a GPU. The reference is the
public function with impl="torch": kernels.py's one PyTorch forward and backward per kernel (the
same functions are the ops' CPU implementation). The interpreter stores fp16 and
bf16 as the GPU does and computes in fp32 as the kernels ask, so all three dtypes are tested here;
it is slow, so large widths come with few rows.

Both paths see the same inputs and output gradients (rounded to the storage dtype); the reference
computes in fp64, so the test measures the kernel's own error. An element passes when
|x - ref| <= tol * (scale + |ref|) (+ fp16's subnormal step, 6e-8), scale being the RMS of its row
([..., d] tensors) or of the whole tensor (vectors and per-row scalars). tol per dtype:
    fp32 2e-4   fp32 dot products over up to 4096 terms that then cancel (seen: 7e-5 at d = 4096)
    fp16 4e-3   4 units in the last place of a stored fp16 (11 significant bits; seen: 7e-4)
    bf16 3e-2   4 units in the last place of a stored bf16 (8 significant bits; seen: 6e-3)
A kernel that drops a term, an eps or a rescaling is off by far more."""
import contextlib
import functools
import math

import pytest
import torch
import torch.nn.functional as F

import kernels
from triton_cpu import kernel_ops, triton_on_cpu

triton = pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
# (rows, d): d not a power of two, d = 768 in BLOCK 1024, d >= 1024 with few rows (the interpreter
# runs one program per row); 33 rows > the 8 programs of the backward's row loop on CPU
SHAPES = [(1, 64), (33, 65), (4, 768), (3, 1024), (2, 4096)]
LAYOUTS = ["contiguous", "transposed", "sliced"]


def gpu_path():
    """The Triton kernels: on CPU tensors, through the interpreter."""
    return contextlib.nullcontext() if CUDA else triton_on_cpu()


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


def compare(fn, inputs, dtype, layout="contiguous", seed=0):
    """fn(*inputs, impl=...) through the GPU path in `dtype` (its [rows, d] inputs in `layout`)
    against the reference (impl="torch") in fp64 on the same rounded values, with the same output
    gradients; compares the outputs and every input's gradient."""
    torch.manual_seed(seed)
    rounded = [x.to(dtype) for x in inputs]
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
            assert_close(x, y, dtype, f"output {i}")
        torch.autograd.backward(out_a, [g.to(o.dtype) for g, o in zip(grads, out_a)])
        torch.autograd.backward(out_b, grads)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.grad is not None and x.grad.dtype == x.dtype and x.grad.shape == x.shape
        assert_close(x.grad, y.grad, dtype, f"grad of input {i}")


# -----------------------------------------------------------------------------
# rms_norm

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, d", SHAPES)
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


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, d", SHAPES)
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
DEPTH_CASES = [(rows, d, n, dtype) for rows, d in SHAPES for n in (1, 3, 9) for dtype in DTYPES
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
    shared by every later step), where re-stacking them would save sum_l l sources, O(S^2).
    Measured (16 x 64 fp32 sources, 4 KiB each): S = 8: 32 KiB, S = 32: 141 KiB; the old stacked
    reference saved 123 KiB and 2.1 MiB."""
    rows, d, f32 = 16, 64, 4
    for n in (8, 32):
        total, _, out = saved_storage(lambda: depth_chain(n, impl, rows, d))
        # the n - 1 sources that a later step reads (the last one is only the output), and per
        # step the lse and the query and weight
        assert total <= (n - 1) * rows * d * f32 + (n - 1) * (rows + 2 * d) * f32, (n, total)
        restacked = sum(l * rows * d * f32 for l in range(1, n))
        assert n < 32 or total < restacked / 10
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

def all_kernels(x, w, r, u, a, s0, s1, s2, q, impl="triton"):
    y = kernels.rms_norm(x, w, impl=impl) + kernels.rms_norm(x, impl=impl)
    r_new, log_gain = kernels.nag_update(r, u, a, impl=impl)
    mix = kernels.depth_attention([s0, s1, s2], q, w, impl=impl)
    return y, r_new, log_gain, mix


def kernel_inputs(dtype=torch.float32, rows=6, d=16, device=DEVICE):
    torch.manual_seed(0)
    r = unit_rms_centred(rows, d)
    inputs = [torch.randn(rows, d), 1 + 0.3 * torch.randn(d), r, torch.randn(rows, d), torch.rand(rows, 1),
              *(torch.randn(rows, d) for _ in range(3)), torch.randn(d)]
    return [x.to(device, dtype).requires_grad_() for x in inputs]


@pytest.mark.parametrize("path", ["cpu-op", "gpu-path"])
def test_opcheck(path):
    """torch.library.opcheck: schema, autograd registration, fake tensors, AOT dispatch (which runs
    the backward op too), for each op with the inputs all_kernels gives it: through the ops' CPU
    implementations, and (forward ops, for the interpreter's time) through the GPU path."""
    x, w, r, u, a, s0, s1, s2, q = kernel_inputs()
    _, rstd = kernels.rms_norm_op(x, w, 1e-6)
    _, lse = kernels.depth_attention_op([s0, s1, s2], q, w, 1e-6)
    g = torch.randn_like(x)
    cases = [(kernels.rms_norm_op, (x, w, 1e-6)), (kernels.rms_norm_op, (x, None, 1e-6)),
             (kernels.rms_norm_backward_op, (g, x.detach(), w.detach(), rstd.detach())),
             (kernels.nag_update_op, (r, u, a, 1e-6)), (kernels.nag_update_op, (r, u, a[:1, 0], 1e-6)),
             (kernels.nag_update_backward_op, (r.detach(), u.detach(), a.detach(), g, g[:, :1], 1e-6)),
             (kernels.depth_attention_op, ([s0, s1, s2], q, w, 1e-6)),
             (kernels.depth_attention_backward_op, ([s.detach() for s in (s0, s1, s2)], q.detach(), w.detach(),
                                                    lse.detach(), g, 1e-6))]
    if path == "gpu-path":
        cases = [cases[0], cases[3], cases[6]]  # rms_norm, nag_update, depth_attention
    with gpu_path() if path == "gpu-path" else contextlib.nullcontext():
        for op, args in cases:
            torch.library.opcheck(op, args)


# the six kernels the launchers launch (_log1p and _source are helpers that kernels call)
LAUNCHED = ("_rms_norm_fwd", "_rms_norm_bwd", "_nag_fwd", "_nag_bwd", "_depth_attention_fwd", "_depth_attention_bwd")


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
    assert len(kernel_ops()) == 6  # a forward and a backward op per kernel
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
    x, w, r, u, a, s0, s1, s2, q = [t.detach().requires_grad_() for t in inputs]
    assert torch.autograd.gradcheck(lambda *t: all_kernels(*t), (x, w, r, u, a, s0, s1, s2, q))
    a1 = torch.tensor([0.4], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda r, u, a: kernels.nag_update(r, u, a, impl="triton"), (r, u, a1))


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
    assert {"nanodepth.rms_norm.default", "nanodepth.nag_update.default",
            "nanodepth.depth_attention.default"} <= targets(dynamo_graphs)
    torch._dynamo.reset()
    aot = aot_autograd(fw_compiler=recording(forward_graphs), bw_compiler=recording(backward_graphs))
    outs = torch.compile(all_kernels, backend=aot, fullgraph=True)(*inputs)
    torch.autograd.backward([o for o in outs if o.requires_grad], [torch.ones_like(o) for o in outs if o.requires_grad])
    assert {"nanodepth.rms_norm.default", "nanodepth.nag_update.default",
            "nanodepth.depth_attention.default"} <= targets(forward_graphs)
    assert {"nanodepth.rms_norm_backward.default", "nanodepth.nag_update_backward.default",
            "nanodepth.depth_attention_backward.default"} <= targets(backward_graphs)
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


@pytest.mark.parametrize("residual", ["prenorm", "nag", "block_attnres"])
def test_model_same_loss_and_gradients_with_either_impl(residual):
    """The whole model through the GPU path (RMSNorm everywhere, nag's write-back, depth
    attention) against the same weights through the references."""
    from model import GPT, GPTConfig
    results = []
    for impl in ("triton", "torch"):
        torch.manual_seed(0)
        blocks = dict(attnres_blocks=2) if residual == "block_attnres" else {}  # an option of that mode alone
        config = GPTConfig(block_size=16, vocab_size=65, n_layer=2, n_head=2, n_embd=48, residual=residual,
                           kernels=impl, **blocks)
        model = GPT(config).to(DEVICE)
        with torch.no_grad():  # off the init, so that AttnRes queries and norm weights matter
            for p in model.stream.parameters():
                p.add_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())).to(DEVICE))
        idx = torch.randint(0, 65, (2, 16), generator=torch.Generator().manual_seed(1)).to(DEVICE)
        with gpu_path():
            _, loss = model(idx, idx)
            loss.backward()
        results.append((loss.item(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_t, grads_t), (loss_r, grads_r) = results
    assert loss_t == pytest.approx(loss_r, rel=1e-6)
    for name in grads_r:
        torch.testing.assert_close(grads_t[name], grads_r[name], rtol=1e-4, atol=1e-6, msg=name)
