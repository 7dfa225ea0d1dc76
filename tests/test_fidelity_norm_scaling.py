"""--norm_scaling=True against LayerNorm Scaling (Sun et al., "The Curse of Depth in Large Language
Models", arXiv 2502.05795; lmsdss/LayerNorm-Scaling, peft_pretraining/modeling_llama.py, norm type LNS),
in float64: both pre-norms of layer i (1-based) are multiplied by 1/sqrt(i), the final norm is not, and
the output projections keep the plain init (no GPT-2 scaling). The reference is its own loop; it
borrows the sublayers and the weights."""
import math

import torch

from fidelity import assert_same_gradients, perturb_backbone
from model import GPT, GPTConfig

EPS = 1e-6


def rms_norm(x, weight):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


def reference_logits(model, idx):
    stream, x, T = model.stream, model.wte(idx), idx.size(1)
    for l, sublayer in enumerate(model.sublayers):
        h = rms_norm(x, stream.norms[l].weight) / math.sqrt(l // 2 + 1)  # layer i = l // 2 + 1
        x = x + (sublayer(h, model.rope[:T])[0] if l % 2 == 0 else sublayer(h))
    return model.lm_head(rms_norm(x, stream.norm_f.weight))[..., :model.config.vocab_size]


def test_norm_scaling_matches_the_published_code():
    config = GPTConfig(block_size=8, vocab_size=65, n_layer=4, n_head=2, n_embd=16, norm_scaling=True)
    torch.manual_seed(0)
    model = GPT(config).double().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for norm in [*model.stream.norms, model.stream.norm_f]:
            norm.weight.add_(0.3 * torch.randn(norm.weight.shape, generator=g, dtype=torch.float64))
    perturb_backbone(model, seed=2)
    idx = torch.randint(0, 65, (2, 8), generator=g)
    logits = model(idx, idx)[0]
    reference = reference_logits(model, idx)
    torch.testing.assert_close(logits, reference, rtol=1e-10, atol=1e-10)
    assert_same_gradients(model, logits, reference)
    model.stream.scales = None  # the same weights without the scaling: far off
    assert (model(idx, idx)[0] - logits).abs().max() > 1e-3


def test_norm_scaling_drops_the_scaled_init():
    """With norm_scaling the output projections have std 0.02 as every other Linear; without, 0.02 / sqrt(2L)
    (L = 8: 0.005). 64 x 256 weights per MLP projection: the sample std is within 2% of its value."""
    def proj_std(**kw):
        torch.manual_seed(0)
        model = GPT(GPTConfig(block_size=8, vocab_size=65, n_layer=8, n_head=2, n_embd=64, **kw))
        return torch.cat([p.flatten() for n, p in model.named_parameters() if n.endswith("c_proj.weight")]).std().item()
    assert abs(proj_std(norm_scaling=True) - 0.02) < 0.0005
    assert abs(proj_std() - 0.02 / math.sqrt(16)) < 0.0002
