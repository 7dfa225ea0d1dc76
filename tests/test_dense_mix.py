"""kernels.dense_mix, the dense mixes of DenseFormer (dwa: one weight per source) and MUDDFormer (mudd:
weights per token and way): the Triton kernels (through the interpreter on CPU, as tests/test_kernels.py)
and the PyTorch reference (the CPU path users run, impl="torch") against the definition in fp64, values and
the gradients of every source and of the weights, per element at tests/test_kernels.py's tolerances; the
op kept whole under torch.compile; the model's two calls."""
import contextlib

import pytest
import torch

import kernels
from test_kernels import DEVICE, assert_close, compare, gpu_path

pytest.importorskip("triton")


def definition(sources, weights):
    """sum_s w[s] x_s, or per way c: sum_s w[..., c, s] x_s, one product per source (model.py's former code)."""
    if weights.dim() == 1:
        return sum(weights[s] * v for s, v in enumerate(sources))
    return torch.stack([sum(weights[..., c, s, None] * v for s, v in enumerate(sources))
                        for c in range(weights.shape[-2])], -2)


def mix_fn(*inputs, impl):
    *sources, w = inputs
    return kernels.dense_mix(list(sources), w, impl=impl)


def mix_inputs(rows, d, S, C, seed):
    """S sources of different scales; weights [S] (C = 0) or [rows, C, S]."""
    torch.manual_seed(seed)
    scale = torch.logspace(-1, 1, S)[torch.randperm(S)]
    sources = [torch.randn(rows, d) * s for s in scale]
    return sources, torch.randn(S) if C == 0 else torch.randn(rows, C, S)


# (rows, d, S, C): odd widths, d = 768 in BLOCK 1024; 33 rows > the backward's 2 programs on CPU (their
# partial sums of the shared weights' gradient); C = 3 in a CBLOCK of 4; one source
CASES = [(1, 64, 1, 0), (33, 65, 5, 0), (4, 768, 9, 0), (2, 4096, 3, 0),
         (1, 64, 1, 1), (33, 65, 5, 4), (4, 768, 9, 3), (2, 4096, 3, 4), (7, 17, 17, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows, d, S, C", CASES, ids=str)
def test_triton_against_reference(rows, d, S, C, dtype):
    """The Triton kernels (forward and backward) against the reference in fp64, per element."""
    sources, w = mix_inputs(rows, d, S, C, seed=rows + d + S + C)
    compare(mix_fn, [*sources, w], dtype)


@pytest.mark.parametrize("layout", ["transposed", "sliced"])
def test_triton_layouts(layout):
    sources, w = mix_inputs(9, 65, 4, 4, seed=1)
    compare(mix_fn, [*sources, w], torch.float32, layout)


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows, d, S, C", [(33, 65, 5, 0), (33, 65, 5, 4), (5, 130, 17, 3), (3, 8, 1, 1)], ids=str)
def test_against_definition(rows, d, S, C, dtype, impl):
    """Either path in its storage dtype (the reference is what a CPU runs) against the definition in fp64
    on the same rounded values: the mix, and the gradients of every source and of the weights."""
    sources, w = mix_inputs(rows, d, S, C, seed=3)
    a = [x.to(dtype).detach().requires_grad_() for x in (*sources, w)]
    b = [x.to(dtype).double().detach().requires_grad_() for x in (*sources, w)]
    with gpu_path() if impl == "triton" else contextlib.nullcontext():
        out = kernels.dense_mix([x.to(DEVICE) for x in a[:-1]], a[-1].to(DEVICE), impl=impl)
    ref = definition(b[:-1], b[-1])
    assert out.shape == ref.shape and out.dtype == dtype
    assert_close(out.cpu(), ref, dtype, "mix")
    g = torch.randn(ref.shape, dtype=torch.float64).to(dtype)
    with gpu_path() if impl == "triton" else contextlib.nullcontext():
        out.backward(g.to(DEVICE))
    ref.backward(g.double())
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.grad.dtype == dtype and x.grad.shape == x.shape
        assert_close(x.grad.cpu(), y.grad, dtype, f"grad of input {i}")


def test_batch_dims_and_stacked_sources():
    """[B, T, d] sources with weights [B, T, C, S], a stacked [S, B, T, d], and the checks on the weights."""
    torch.manual_seed(0)
    sources = [torch.randn(2, 3, 24, dtype=torch.float64) for _ in range(4)]
    w = torch.randn(2, 3, 2, 4, dtype=torch.float64)
    torch.testing.assert_close(kernels.dense_mix(sources, w, impl="torch"), definition(sources, w), rtol=1e-12, atol=0)
    torch.testing.assert_close(kernels.dense_mix(torch.stack(sources), w[0, 0, 0], impl="torch"),
                               definition(sources, w[0, 0, 0]), rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="weights must be"):
        kernels.dense_mix(sources, w[..., :3], impl="torch")
    with pytest.raises(ValueError, match="weights must be"):
        kernels.dense_mix(sources, w[0], impl="torch")


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("C", [0, 3])
def test_gradcheck(C, impl):
    """fp64 against finite differences: the reference's autograd.Function (torch) and the op's registered
    autograd with the backward op (triton on CPU tensors: the op's CPU implementation)."""
    torch.manual_seed(0)
    xs = [torch.randn(3, 5, 7, dtype=torch.float64, requires_grad=True) for _ in range(4)]
    w = torch.randn(*((3, 5, C) if C else ()), 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda w, *x: kernels.dense_mix(list(x), w, impl=impl), (w, *xs))


def test_opcheck():
    torch.manual_seed(0)
    xs = [torch.randn(6, 16, requires_grad=True) for _ in range(3)]
    for w in (torch.randn(3, requires_grad=True), torch.randn(6, 4, 3, requires_grad=True)):
        g = torch.randn(6, 4, 16) if w.dim() > 1 else torch.randn(6, 16)
        for path in (contextlib.nullcontext, gpu_path):
            with path():
                torch.library.opcheck(kernels.dense_mix_op, (xs, w))
                torch.library.opcheck(kernels.dense_mix_backward_op, ([x.detach() for x in xs], w.detach(), g))


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_saves_the_sources_and_weights_only(impl):
    """Autograd keeps the sources (alive anyway) and the weights: no product, no stacked copy."""
    torch.manual_seed(0)
    xs = [torch.randn(4, 8, 32, requires_grad=True) for _ in range(5)]
    for w in (torch.randn(5, requires_grad=True), torch.randn(4, 8, 4, 5, requires_grad=True)):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            kernels.dense_mix(xs, w, impl=impl)
        ptrs = {t.untyped_storage().data_ptr() for t in saved}
        assert ptrs == {t.untyped_storage().data_ptr() for t in (*xs, w)}


def test_compile_keeps_the_op_whole():
    """torch.compile(fullgraph=True): the op is one node forward (dense_mix) and one backward
    (dense_mix_backward), values and gradients as eager's bit for bit; the reference compiles too."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    torch.manual_seed(0)
    xs = [torch.randn(6, 16, requires_grad=True) for _ in range(3)]
    ws = (torch.randn(3, requires_grad=True), torch.randn(6, 2, 3, requires_grad=True))

    def fn(*t, impl):
        *x, w1, w2 = t
        return kernels.dense_mix(list(x), w1, impl=impl) * 2, kernels.dense_mix([x[0].tanh(), *x[1:]], w2, impl=impl)

    for impl in ("triton", "torch"):
        graphs = {"fw": [], "bw": []}

        def rec(kind):
            def backend(gm, example_inputs):
                graphs[kind].append(gm)
                return make_boxed_func(gm.forward)
            return backend
        results = []
        torch._dynamo.reset()
        compiled = torch.compile(lambda *t: fn(*t, impl=impl), fullgraph=True,
                                 backend=aot_autograd(fw_compiler=rec("fw"), bw_compiler=rec("bw")))
        for f in (lambda *t: fn(*t, impl=impl), compiled):
            outs = f(*xs, *ws)
            loss = sum((o * (i + 1)).sum() for i, o in enumerate(outs))
            results.append((outs, torch.autograd.grad(loss, [*xs, *ws])))
        torch._dynamo.reset()
        for x, y in zip(results[1][0] + results[1][1], results[0][0] + results[0][1]):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
        targets = [str(n.target) for kind in graphs for gm in graphs[kind] for n in gm.graph.nodes
                   if n.op == "call_function" and "nanodepth" in str(n.target)]
        if impl == "triton":
            assert sorted(targets) == sorted(["nanodepth.dense_mix.default"] * 2 + ["nanodepth.dense_mix_backward.default"] * 2)
        else:
            assert targets == []


@pytest.mark.parametrize("mode, kw", [("dwa", {}), ("dwa", dict(dwa_dilation=2, dwa_period=2)),
                                      ("mudd", {}), ("mudd", dict(mudd_ways=1))])
def test_model_mix_matches_per_source_sums(mode, kw):
    """The model's calls (DenseFormer.average, MUDD.write) against the per-source sums they replaced, logits and
    every parameter's gradient, with the mixing weights moved off their identity init (fp32, different
    summation order: within 1e-4 of each tensor's scale)."""
    from model import GPT, GPTConfig, MUDD, DenseFormer

    def old_average(self, outputs, i):
        if self.group[i - 1] is None:
            return None
        w = self.alpha[self.row[i - 1]]
        return sum(w[j] * outputs[j] for j in self.group[i - 1])

    def old_write(self, state, l, out, carry):
        x = state.x + out
        if l % 2 == 0:
            return self.State(x, state.outputs, None)
        outputs = list(state.outputs) + [x]  # the list the stack replaced
        dw = self.weights(x, l // 2)
        *qkv, x = [sum(dw[..., c, j, None] * X for j, X in enumerate(outputs)) for c in range(dw.size(-2))]
        return self.State(x, outputs, tuple(qkv) if qkv else None)

    results = []
    for patch in (False, True):
        torch.manual_seed(0)
        m = GPT(GPTConfig(residual=mode, n_layer=4, n_head=2, n_embd=32, block_size=16, vocab_size=65, **kw))
        with torch.no_grad():
            for n, p in m.named_parameters():
                if "alpha" in n or "static" in n or "w2" in n:
                    p.add_(0.1 * torch.randn_like(p))
        x = torch.randint(0, 65, (2, 16))
        with pytest.MonkeyPatch.context() as mp:
            if patch:
                mp.setattr(DenseFormer, "average", old_average)
                mp.setattr(MUDD, "write", old_write)
            logits, loss = m(x, x)
            loss.backward()
        results.append([logits.detach()] + [p.grad for p in m.parameters()])
    for new, old in zip(*results):
        assert (new - old).abs().max() <= 1e-4 * old.abs().max()


def test_bad_inputs_are_one_line_errors_that_name_the_op():
    x = torch.randn(2, 3, 8)
    with pytest.raises(ValueError, match="^dense_mix needs at least one source$"):
        kernels.dense_mix([], torch.ones(0))
    with pytest.raises(ValueError, match="^dense_mix: every source must have one shape"):
        kernels.dense_mix([x, torch.randn(2, 3, 9)], torch.ones(2))
    with pytest.raises(ValueError, match=r"^dense_mix: weights must be \[2\] or \[\.\.\., C, 2\]"):
        kernels.dense_mix([x, x], torch.ones(3))
