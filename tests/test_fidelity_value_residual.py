"""value_residual against ResFormer (Zhou et al., arXiv 2410.17897; Zcchill/Value-Residual-Learning,
src/modeling/modeling_llama_resformer.py) and modded-nanogpt's learned lambda (records of November 2024),
in float64.

The reference below is its own attention, written from those codes, not from model.py: the values of
the first attention sublayer, raw (no RoPE touches values, and there is no head sharing here), are
handed to every later one, which attends with (1 - lam) v + lam v_1; lam = 1/2 (half) or a learned
scalar per later sublayer, here moved off its 1/2 init. Its RoPE rotates consecutive feature pairs by
t * 10000^(-2i / hd), with the cos and sin of model.py's table. It borrows only the weights."""
import math

import pytest
import torch
import torch.nn.functional as F

from fidelity import assert_same_gradients, elementwise_per_token, perturb_backbone
from model import GPT, GPTConfig

EPS = 1e-6
TOL = dict(rtol=1e-10, atol=1e-10)


def rms_norm(x, weight):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


def rope(x, table):
    """x [B, T, nh, hd]: pairs (x_2i, x_2i+1) of token t rotated by the angle t * 10000^(-2i/hd), whose cos
    and sin are model.py's table [T, hd/2, 2] (its float32 angles: a float64 recomputation differs by 1e-8)."""
    cos, sin = table[None, :, None, :, 0], table[None, :, None, :, 1]
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2)


def attention(attn, x, n_head, v1, lam, table):
    """One attention sublayer; returns (output, its raw values)."""
    B, T, C = x.shape
    q, k, v = (x @ attn.c_attn.weight.T).split(C, -1)
    q, k, v = (t.view(B, T, n_head, C // n_head) for t in (q, k, v))
    raw = v
    if v1 is not None:
        v = (1 - lam) * v + lam * v1
    q, k = rope(q, table), rope(k, table)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(C // n_head)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    y = torch.einsum("bhqk,bkhd->bqhd", F.softmax(scores, -1), v).reshape(B, T, C)
    return y @ attn.c_proj.weight.T, raw


def reference_logits(model, idx, mode):
    """mode: half, learned, or none (no value residual: to show that the comparison can fail)."""
    stream, x = model.stream, model.wte(idx)
    v1 = None
    for l, sublayer in enumerate(model.sublayers):
        h = rms_norm(x, stream.norms[l].weight)
        if l % 2:
            x = x + sublayer.c_proj(F.gelu(sublayer.c_fc(h)))
        else:
            lam = sublayer.value_lambda if mode == "learned" and l else 0.5
            out, raw = attention(sublayer, h, model.config.n_head, v1 if mode != "none" else None, lam,
                                 model.rope[:idx.size(1)])
            v1 = raw if l == 0 else v1
            x = x + out
    return model.lm_head(rms_norm(x, stream.norm_f.weight))[..., :model.config.vocab_size]


@pytest.mark.parametrize("value_residual", ["half", "learned"])
def test_value_residual_matches_the_published_code(value_residual):
    config = GPTConfig(block_size=8, vocab_size=65, n_layer=3, n_head=2, n_embd=16, value_residual=value_residual)
    torch.manual_seed(0)
    model = GPT(config).double().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("value_lambda"):
                p.copy_(torch.rand((), generator=g, dtype=torch.float64))
    perturb_backbone(model, seed=2)  # blocks that move the stream, so a wrong mix shows
    idx = torch.randint(0, 65, (2, 8), generator=g)
    logits = model(idx, idx)[0]
    reference = reference_logits(model, idx, value_residual)
    torch.testing.assert_close(logits, reference, **TOL)
    assert (logits - reference_logits(model, idx, "none")).abs().max() > 1e-3  # the values' mix shows
    assert_same_gradients(model, logits, reference)  # a v_1 under a stop-gradient would pass the logits

def test_value_residual_parameters():
    """half adds no parameter; learned one scalar per attention sublayer after the first, 1/2 at init and
    without weight decay; value_residual with MoD is refused."""
    def model(**kw):
        return GPT(GPTConfig(block_size=8, vocab_size=65, n_layer=3, n_head=2, n_embd=16, **kw))
    base = sum(p.numel() for p in model().parameters())
    assert sum(p.numel() for p in model(value_residual="half").parameters()) == base
    learned = model(value_residual="learned")
    lams = {n: p for n, p in learned.named_parameters() if n.endswith("value_lambda")}
    assert sorted(lams) == ["sublayers.2.value_lambda", "sublayers.4.value_lambda"]
    assert all(p.item() == 0.5 for p in lams.values())
    groups = learned.configure_optimizers(0.1, 1e-3, (0.9, 0.95)).param_groups
    assert not any(p is lam for g in groups if g["weight_decay"] > 0 for p in g["params"] for lam in lams.values())
    with pytest.raises(ValueError, match="value_residual=half needs every token to run the first attention"):
        GPTConfig(block_size=8, vocab_size=65, n_layer=2, n_head=2, n_embd=16, value_residual="half",
                  mod="router", mod_rate=0.25)
    with pytest.raises(ValueError, match="unknown value_residual 'yes'; valid: none, half, learned"):
        GPTConfig(value_residual="yes")


def test_the_declared_flops_are_the_mix_the_attentions_compute():
    """flops.py's value_residual term equals the element-wise FLOPs the mix really adds (a multiply, a multiply
    and an add per value element, in every attention sublayer but the first, which only hands v_1 on): counted
    with a dispatch mode as the difference to value_residual=none. Counting the first attention too is 3d off."""
    import flops
    B, T, counts = 2, 8, {}
    for mode in ("none", "half"):
        config = GPTConfig(block_size=T, vocab_size=65, n_layer=3, n_head=2, n_embd=16, value_residual=mode)
        torch.manual_seed(0)
        counts[mode] = elementwise_per_token(GPT(config), B, T)
    config = GPTConfig(block_size=T, vocab_size=65, n_layer=3, n_head=2, n_embd=16, value_residual="half")
    declared = flops.forward_flops(config)["value_residual"]
    assert counts["half"] - counts["none"] == declared == 3 * 16 * 2  # two attentions after the first
