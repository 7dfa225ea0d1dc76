"""What the fidelity tests share: a backbone moved off its init, and every parameter's gradient compared.

At init the output projections are 0.02/sqrt(2L): blocks barely move the stream, so a wrong mix hardly shows
in the logits. And logits alone let a detached input (v_1 under a stop-gradient, say) through. So the
fidelity tests redraw the backbone's matrices with std 1/sqrt(fan_in) and compare, in float64, the gradient
of every parameter of the model with the reference's, both functions of the very same parameter tensors."""
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

ELEMENTWISE = ("mul.Tensor", "add.Tensor", "sub.Tensor", "rsub.Scalar", "mul.Scalar")  # the ops a mix is made of


def perturb_backbone(model, seed=0):
    """Every Linear weight of the sublayers (attention, MLP) redrawn N(0, 1/fan_in), in place."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.sublayers.modules():
            if isinstance(m, nn.Linear):
                w = m.weight
                w.copy_(torch.randn(w.shape, generator=g, dtype=torch.float64).to(w.dtype) / w.shape[1] ** 0.5)


def assert_same_gradients(model, logits, reference, seed=0, rtol=1e-8, atol=1e-10):
    """The gradients of sum(logits * w), w a fixed random weight, with respect to every parameter of the
    model, through the model's logits and through the reference's: equal per element, in float64. A
    parameter that gets a gradient through one and not the other fails too."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(seed), dtype=logits.dtype)
    got = torch.autograd.grad((logits * w).sum(), [p for _, p in params], allow_unused=True)
    want = torch.autograd.grad((reference * w).sum(), [p for _, p in params], allow_unused=True)
    for (name, p), a, b in zip(params, got, want):
        a = torch.zeros_like(p) if a is None else a
        b = torch.zeros_like(p) if b is None else b
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m, name=name: f"grad of {name}: {m}")


class _Elementwise(TorchDispatchMode):
    """Counts the output elements of the ELEMENTWISE ops dispatched while it is on (n)."""
    ops = {getattr(getattr(torch.ops.aten, name.split(".")[0]), name.split(".")[1]) for name in ELEMENTWISE}
    n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.ops and torch.is_tensor(out):
            _Elementwise.n += out.numel()
        return out


def elementwise_per_token(model, B=2, T=8):
    """The element-wise multiplies, adds and subtracts (ELEMENTWISE: one FLOP per output element) of one forward
    of model on random tokens, per token, counted with a dispatch mode: the FLOPs a declared mixing term must
    match, taken as a difference to another model's count (so the backbone's own element-wise work cancels)."""
    _Elementwise.n = 0
    with torch.no_grad(), _Elementwise():
        model(torch.randint(0, model.config.vocab_size, (B, T)))
    return _Elementwise.n / (B * T)
