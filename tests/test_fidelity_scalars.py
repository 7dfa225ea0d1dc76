"""residual=scalars against nanochat's residual scalars (github.com/karpathy/nanochat, nanochat/gpt.py:
GPT.forward, init_weights, setup_optimizer; dev/LOG.md, 2026-01-11) and modded-nanogpt's embed shortcut
(records of November 2024: Block.lambdas = [1, 0]), in float64.

The reference is nanochat's forward loop, written here: x = norm(wte(idx)), x0 = x; before each block
x = resid_lambdas[i] x + x0_lambdas[i] x0; the block is x + attn(norm(x)), then x + mlp(norm(x)); the
head reads norm(x). It borrows the sublayers, the norms' weights (nanochat's norms have none) and the
head; its lambdas are random, written into model.py's by name."""
import pytest
import torch

from fidelity import assert_same_gradients, elementwise_per_token, perturb_backbone
from model import GPT, GPTConfig

EPS = 1e-6


def rms_norm(x, weight=None):
    y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    return y if weight is None else y * weight


def reference_logits(model, idx, resid_lambdas, x0_lambdas):
    stream, T = model.stream, idx.size(1)
    rope = model.rope[:T]
    x = rms_norm(model.wte(idx))
    x0 = x
    for i in range(model.config.n_layer):
        x = resid_lambdas[i] * x + x0_lambdas[i] * x0
        x = x + model.sublayers[2 * i](rms_norm(x, stream.norms[2 * i].weight), rope)[0]
        x = x + model.sublayers[2 * i + 1](rms_norm(x, stream.norms[2 * i + 1].weight))
    return model.lm_head(rms_norm(x, stream.norm_f.weight))[..., :model.config.vocab_size]


def tiny(**kw):
    return GPTConfig(block_size=8, vocab_size=65, n_layer=4, n_head=2, n_embd=16, residual="scalars", **kw)


def test_scalars_match_the_published_code():
    torch.manual_seed(0)
    model = GPT(tiny()).double().eval()
    g = torch.Generator().manual_seed(1)
    resid = 1 + 0.3 * torch.randn(4, generator=g, dtype=torch.float64)
    x0 = 0.3 * torch.randn(4, generator=g, dtype=torch.float64)
    with torch.no_grad():
        model.stream.lam.copy_(resid)
        model.stream.beta.copy_(x0)
    perturb_backbone(model, seed=2)
    idx = torch.randint(0, 65, (2, 8), generator=g)
    logits = model(idx, idx)[0]
    torch.testing.assert_close(logits, reference_logits(model, idx, resid, x0), rtol=1e-10, atol=1e-10)
    # the same with the model's own lam and beta in the reference, so that their gradients flow through both
    assert_same_gradients(model, logits, reference_logits(model, idx, model.stream.lam, model.stream.beta))
    assert (logits - reference_logits(model, idx, resid, torch.zeros(4, dtype=torch.float64))).abs().max() > 1e-4


@pytest.mark.parametrize("init,lam,beta", [
    ("nanochat", [1.15, 1.15 - 0.1 / 3, 1.15 - 0.2 / 3, 1.05], [0.20, 0.15, 0.10, 0.05]),  # 1.15 - 0.10 i/(L-1), 0.20 - 0.15 i/(L-1)
    ("modded", [1.0] * 4, [0.0] * 4),
])
def test_scalars_init_is_the_published_init(init, lam, beta):
    stream = GPT(tiny(scalars_init=init)).stream
    torch.testing.assert_close(stream.lam.detach(), torch.tensor(lam), rtol=0, atol=1e-6)
    torch.testing.assert_close(stream.beta.detach(), torch.tensor(beta), rtol=0, atol=1e-6)


def test_the_multipliers_train_at_a_hundredth_of_the_lr():
    """nanochat: resid_lambdas at scalar_lr * 0.01, x0_lambdas at scalar_lr; neither decays here. train.py
    sets every group's LR to the schedule's times its lr_scale."""
    import train
    model = GPT(tiny())
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95))
    group = {id(p): g for g in opt.param_groups for p in g["params"]}
    lam, beta = group[id(model.stream.lam)], group[id(model.stream.beta)]
    assert lam["lr_scale"] == 0.01 and lam["weight_decay"] == 0.0 and len(lam["params"]) == 1
    assert beta.get("lr_scale", 1.0) == 1.0 and beta["weight_decay"] == 0.0
    train.set_lr(opt, 2e-3)
    assert lam["lr"] == pytest.approx(2e-5) and beta["lr"] == pytest.approx(2e-3)
    with pytest.raises(ValueError, match="scalars_lr_scale must be a number > 0"):
        tiny(scalars_lr_scale=0)


def test_the_declared_flops_are_the_scaling_each_block_computes():
    """flops.py's scalars term per block equals the element-wise work the scaling really adds (lam x, beta x0 and
    their sum: 3 per element of the stream), counted with a dispatch mode as the per-block increment (L = 3 less
    L = 2, which cancels the x0 norm and the head) over prenorm's. A declared 2d per block is d off per block."""
    import flops
    B, T, counts = 2, 8, {}
    for residual in ("prenorm", "scalars"):
        for L in (2, 3):
            torch.manual_seed(0)
            model = GPT(GPTConfig(block_size=T, vocab_size=65, n_layer=L, n_head=2, n_embd=16, residual=residual))
            counts[residual, L] = elementwise_per_token(model, B, T)
    per_block = (counts["scalars", 3] - counts["scalars", 2]) - (counts["prenorm", 3] - counts["prenorm", 2])
    declared = [flops.forward_flops(GPTConfig(block_size=T, vocab_size=65, n_layer=L, n_head=2, n_embd=16,
                                              residual="scalars"))["scalars"] for L in (2, 3)]
    assert per_block == declared[1] - declared[0] == 3 * 16
