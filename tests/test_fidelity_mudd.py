"""residual=mudd against MUDDFormer's published code (Xiao et al., arXiv 2502.12170;
github.com/Caiyun-AI/MUDDFormer: pytorch/muddformer/modeling_muddformer.py for the forward, with the
released config's round64 and expand_last, and jax/MaxText/layers/llama2.py for the init), in float64.

The reference below is that forward, written here: hiddens = [embedding]; block i's attention reads
x (block 0) or three separately normed ways x[0], x[1], x[2] with the residual x[-1]; h = res + attn,
out = h + mlp(norm(h)); dw = w2(gelu(w1(norm_noscale(out)))) laid out 'B T (C L) -> C B T L' plus the
static weights; x = tuple(sum_j dw[c, ..., j] hiddens[j]); the head reads x[0] after the last block.
Its attention is its own (as tests/test_fidelity_value_residual.py's). Every weight of the connections
is random."""
import math

import pytest
import torch
import torch.nn.functional as F

from fidelity import assert_same_gradients, perturb_backbone
from model import GPT, GPTConfig
from test_fidelity_value_residual import rope

EPS = 1e-6


def rms_norm(x, weight=None):
    y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    return y if weight is None else y * weight


def attention(attn, xq, xk, xv, n_head, table):
    B, T, C = xq.shape
    wq, wk, wv = attn.c_attn.weight.split(C)
    q, k, v = ((x @ w.T).view(B, T, n_head, C // n_head) for x, w in ((xq, wq), (xk, wk), (xv, wv)))
    q, k = rope(q, table), rope(k, table)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(C // n_head)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    y = torch.einsum("bhqk,bkhd->bqhd", F.softmax(scores, -1), v).reshape(B, T, C)
    return y @ attn.c_proj.weight.T


def reference_logits(model, idx):
    s, n_head = model.stream, model.config.n_head
    x = model.wte(idx)
    hiddens = [x]
    for i in range(model.config.n_layer):
        attn, mlp = model.sublayers[2 * i], model.sublayers[2 * i + 1]
        if isinstance(x, torch.Tensor):
            res = x
            xq = xk = xv = rms_norm(x, s.norms[2 * i].weight)
        elif len(x) == 1:  # mudd_ways=1: the residual way alone
            res = x[0]
            xq = xk = xv = rms_norm(res, s.norms[2 * i].weight)
        else:
            res = x[-1]
            xq, xk, xv = (rms_norm(x[0], s.norms[2 * i].weight), rms_norm(x[1], s.key_norms[i - 1].weight),
                          rms_norm(x[2], s.value_norms[i - 1].weight))
        h = res + attention(attn, xq, xk, xv, n_head, model.rope[:idx.size(1)])
        out = h + mlp.c_proj(F.gelu(mlp.c_fc(rms_norm(h, s.norms[2 * i + 1].weight))))
        hiddens.append(out)
        C, L = s.static[i].shape
        dw = F.gelu(rms_norm(out) @ s.w1[i].T) @ s.w2[i].T  # [B, T, C L]
        dw = dw.unflatten(-1, (C, L)).permute(2, 0, 1, 3) + s.static[i][:, None, None, :]  # 'B T (C L) -> C B T L'
        x = tuple(sum(dw[c, :, :, j, None] * hiddens[j] for j in range(i + 2)) for c in range(C))
    return model.lm_head(rms_norm(x[0], s.norm_f.weight))[..., :model.config.vocab_size]


@pytest.mark.parametrize("ways, L", [(4, 4), (1, 4), (4, 16)])
def test_mudd_matches_the_published_code(ways, L):
    """Logits in float64, the mixing weights moved off init; at L = 16 the deepest blocks' weight MLPs are
    wider (128 against 64: their width grows with the connections they mix)."""
    config = GPTConfig(block_size=8, vocab_size=65, n_layer=L, n_head=2, n_embd=16, residual="mudd", mudd_ways=ways)
    torch.manual_seed(0)
    model = GPT(config).double().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.stream.named_parameters():
            p.add_((0.5 if name.startswith(("w2", "static")) else 0.2) * torch.randn(p.shape, generator=g,
                                                                                      dtype=p.dtype))
    idx = torch.randint(0, 65, (2, 8), generator=g)
    if L == 16:
        assert {w.shape[0] for w in model.stream.w1} == {64, 128}
    perturb_backbone(model, seed=2)  # blocks that move the stream, so a wrong mix shows
    logits = model(idx, idx)[0]
    reference = reference_logits(model, idx)
    torch.testing.assert_close(logits, reference, rtol=1e-10, atol=1e-10)
    assert_same_gradients(model, logits, reference)


def test_mudd_init_and_shapes_are_the_published_ones():
    """W2 = 0, static weight 1 on the newest output (the JAX code's 'current_only'); W1's hidden width
    (C (i + 2) // 64 + 1) * 64, times 4 for the last block (round64, expand_last); four ways but one for
    the last block; W1 std 1/sqrt(d) (fan-in normal)."""
    config = GPTConfig(block_size=8, vocab_size=65, n_layer=3, n_head=2, n_embd=64, residual="mudd")
    s = GPT(config).stream
    assert [tuple(w.shape) for w in s.static] == [(4, 2), (4, 3), (1, 4)]
    assert [w.shape[0] for w in s.w1] == [64, 64, 64]  # 8 // 64 + 1, 12 // 64 + 1, 16 // 64 + 1 (x 64)
    assert all(torch.equal(w, torch.zeros_like(w)) for w in s.w2)
    for w in s.static:
        expected = torch.zeros_like(w)
        expected[:, -1] = 1.0
        assert torch.equal(w.detach(), expected)
    assert abs(torch.cat([w.flatten() for w in s.w1]).std().item() - 1 / 8) < 0.01
    deep = GPTConfig(block_size=8, vocab_size=65, n_layer=20, n_head=2, n_embd=16, residual="mudd")
    assert [w.shape[0] for w in GPT(deep).stream.w1][-2:] == [128, 128]  # 4 * 21 = 84 -> 128; 1 * 22 * 4 = 88 -> 128
    with pytest.raises(ValueError, match="mod=router does not work with residual=mudd"):
        GPTConfig(block_size=8, vocab_size=65, n_layer=2, n_head=2, n_embd=16, residual="mudd", mod="router",
                  mod_rate=0.25)


def test_mudd_static_weights_take_no_decay_and_its_weight_mlp_does():
    """The static mixing weights are mixing weights (no decay, as any); the weight MLP's w1 and w2 are
    projections and decay like a Linear's weight."""
    model = GPT(GPTConfig(block_size=8, vocab_size=65, n_layer=4, n_head=2, n_embd=16, residual="mudd"))
    groups = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95)).param_groups
    decayed = {id(p) for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    stream = model.stream
    assert len(stream.static) and not any(id(p) in decayed for p in stream.static)
    assert all(id(p) in decayed for p in (*stream.w1, *stream.w2))
