"""Each Triton kernel against its PyTorch reference: values and gradients over a grid of widths
(powers of two and not), row counts and source counts. On CPU the kernels run in Triton's
interpreter (TRITON_INTERPRET=1, set in conftest.py), in fp32 only; on a GPU also in bf16.

Both run on the same inputs (rounded to the storage dtype); the reference computes in fp64, so
the test measures the kernel's own error. Tolerance, relative and absolute, with the absolute part
scaled by the largest magnitude of the quantity compared (gradients summed over hundreds of rows
reach 1e3): fp32 1e-5, fp16 (GPU only) 5e-3, bf16 (GPU only) 2e-2."""
import pytest
import torch
import torch.nn.functional as F

import kernels

triton = pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32] + ([torch.float16, torch.bfloat16] if CUDA else [])
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
WIDTHS = [64, 65, 384]
ROWS = [1, 7, 300]


def leaf(t, dtype):
    return t.to(DEVICE, dtype).detach().requires_grad_()


def assert_close(x, ref, dtype):
    tol = TOL[dtype]
    torch.testing.assert_close(x.double(), ref, rtol=tol, atol=tol * max(1.0, ref.abs().max().item()))


def compare(fn_triton, fn_ref, inputs, dtype, seed=0):
    """Run the kernel in `dtype` and the reference in fp64 on the same (rounded) inputs, with the
    same random output gradients; compare the outputs and every input's gradient."""
    torch.manual_seed(seed)
    a = [leaf(x, dtype) for x in inputs]
    b = [leaf(x.to(dtype), torch.float64) for x in inputs]
    out_a, out_b = fn_triton(*a), fn_ref(*b)
    out_a = out_a if isinstance(out_a, tuple) else (out_a,)
    out_b = out_b if isinstance(out_b, tuple) else (out_b,)
    grads = [torch.randn(o.shape, device=DEVICE, dtype=torch.float64) for o in out_b]
    for x, y in zip(out_a, out_b):
        assert x.shape == y.shape and x.dtype in (dtype, torch.float32)  # log_gain is always fp32
        assert_close(x, y, dtype)
    torch.autograd.backward(out_a, [g.to(o.dtype) for g, o in zip(grads, out_a)])
    torch.autograd.backward(out_b, grads)
    for x, y in zip(a, b):
        assert x.grad is not None and x.grad.dtype == x.dtype
        assert_close(x.grad, y.grad, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("d", WIDTHS)
@pytest.mark.parametrize("with_weight", [True, False], ids=["weight", "no-weight"])
def test_rms_norm(d, rows, dtype, with_weight):
    torch.manual_seed(d + rows)
    x = torch.randn(rows, d) * 3 + 0.5
    if with_weight:
        w = 1 + 0.5 * torch.randn(d)
        compare(lambda x, w: kernels.rms_norm(x, w, impl="triton"),
                lambda x, w: kernels.rms_norm(x, w, impl="torch"), [x, w], dtype)
    else:
        compare(lambda x: kernels.rms_norm(x, impl="triton"), lambda x: kernels.rms_norm(x, impl="torch"), [x], dtype)


def test_rms_norm_reference_matches_autograd():
    """The reference's hand-written backward against autograd through its own formula, in fp64."""
    torch.manual_seed(0)
    x = torch.randn(3, 5, 17, dtype=torch.float64, requires_grad=True)
    w = torch.randn(17, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: kernels.rms_norm(x, w, impl="torch"), (x, w))
    assert torch.autograd.gradcheck(lambda x: kernels.rms_norm(x, impl="torch"), (x,))
    torch.testing.assert_close(kernels.rms_norm(x, w, impl="torch"), F.rms_norm(x, (17,), w, 1e-6))


def unit_rms_centred(rows, d):
    r = torch.randn(rows, d)
    r = r - r.mean(-1, keepdim=True)
    return r / r.square().mean(-1, keepdim=True).sqrt()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("d", WIDTHS)
def test_nag_update(d, rows, dtype):
    torch.manual_seed(d + rows)
    r = unit_rms_centred(rows, d)
    u = torch.randn(rows, d) + 2 * r + 0.3  # components along r and along 1, which the update removes
    a = torch.rand(rows, 1) * 2
    compare(lambda r, u, a: kernels.nag_update(r, u, a, impl="triton"),
            lambda r, u, a: kernels.nag_update(r, u, a, impl="torch"), [r, u, a], dtype)


def test_nag_update_broadcast_tangent_and_batch_dims():
    """a of shape [1] broadcast over all rows, and r, u with two batch dims."""
    torch.manual_seed(0)
    r = unit_rms_centred(12, 40).view(3, 4, 40)
    u = torch.randn(3, 4, 40)
    a = torch.tensor([0.7])
    compare(lambda r, u, a: kernels.nag_update(r, u, a, impl="triton"),
            lambda r, u, a: kernels.nag_update(r, u, a, impl="torch"), [r, u, a], torch.float32)


def test_nag_update_reference_gradcheck():
    torch.manual_seed(0)
    r = unit_rms_centred(4, 9).double().requires_grad_()
    u = torch.randn(4, 9, dtype=torch.float64, requires_grad=True)
    a = torch.rand(4, 1, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda r, u, a: kernels.nag_update(r, u, a, impl="torch"), (r, u, a))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n_sources", [1, 3, 17])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("d", WIDTHS)
def test_depth_attention(d, rows, n_sources, dtype):
    torch.manual_seed(d + rows + n_sources)
    # sources of very different scales, and a query large enough to make the softmax far from uniform
    scale = torch.logspace(-1, 1, n_sources).view(n_sources, 1, 1)
    sources = torch.randn(n_sources, rows, d) * scale
    q = torch.randn(d) * 0.5
    w = 1 + 0.3 * torch.randn(d)
    compare(lambda s, q, w: kernels.depth_attention(s, q, w, impl="triton"),
            lambda s, q, w: kernels.depth_attention(s, q, w, impl="torch"), [sources, q, w], dtype)


def test_depth_attention_batch_dims_and_definition():
    """[S, B, T, d] sources; and the reference against the definition, one source at a time."""
    torch.manual_seed(0)
    sources = torch.randn(4, 2, 3, 24, dtype=torch.float64)
    q, w = torch.randn(24, dtype=torch.float64), torch.rand(24, dtype=torch.float64) + 0.5
    normed = sources / (sources.square().mean(-1, keepdim=True) + 1e-6).sqrt() * w
    weights = torch.softmax((normed * q).sum(-1), dim=0)
    torch.testing.assert_close(kernels.depth_attention(sources, q, w, impl="torch"),
                               (weights.unsqueeze(-1) * sources).sum(0))
    compare(lambda s, q, w: kernels.depth_attention(s, q, w, impl="triton"),
            lambda s, q, w: kernels.depth_attention(s, q, w, impl="torch"),
            [sources.float(), q.float(), w.float()], torch.float32)


def test_impl_choice():
    x = torch.randn(2, 8)
    assert kernels.use_triton("auto", x) is False  # CPU tensors take the reference
    assert kernels.use_triton("torch", x) is False
    assert kernels.use_triton("triton", x) is True
    with pytest.raises(ValueError, match="valid: auto, torch, triton"):
        kernels.use_triton("cuda", x)


@pytest.mark.parametrize("residual", ["prenorm", "nag", "block_attnres"])
def test_model_same_loss_and_gradients_with_either_impl(residual):
    """The whole model through the Triton kernels (RMSNorm everywhere, nag's write-back, depth
    attention) against the same weights through the references."""
    from model import GPT, GPTConfig
    results = []
    for impl in ("triton", "torch"):
        torch.manual_seed(0)
        config = GPTConfig(block_size=16, vocab_size=65, n_layer=2, n_head=2, n_embd=48, residual=residual,
                           attnres_blocks=3, kernels=impl)
        model = GPT(config).to(DEVICE)
        with torch.no_grad():  # off the init, so that AttnRes queries and norm weights matter
            for p in model.stream.parameters():
                p.add_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())).to(DEVICE))
        idx = torch.randint(0, 65, (2, 16), generator=torch.Generator().manual_seed(1)).to(DEVICE)
        _, loss = model(idx, idx)
        loss.backward()
        results.append((loss.item(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_t, grads_t), (loss_r, grads_r) = results
    assert loss_t == pytest.approx(loss_r, rel=1e-6)
    for name in grads_r:
        torch.testing.assert_close(grads_t[name], grads_r[name], rtol=1e-4, atol=1e-6, msg=name)
