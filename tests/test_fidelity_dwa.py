"""residual=dwa against DenseFormer's published code (Pagliardini et al., arXiv 2402.02622;
github.com/epfml/DenseFormer, denseformer/denseformer.py), in float64.

The reference below is written from that code, not from model.py: its accumulators, one per dilation
group ((i + 1) mod k holds the outputs of blocks i with the same residue; group 0 starts with the
embedding), a weight vector per DWA of length (i + 1 + k) // k over its group in order, the newest output
last, and a DWA only after blocks with (i + 1) mod p == 0. It borrows only the sublayers, the pre-norms
and the head. Its weight vectors are random and written into model.py's alpha by the reference's own
indexing, so a wrong group, row or order cannot pass by accident."""
import pytest
import torch

from fidelity import assert_same_gradients, perturb_backbone
from model import GPT, GPTConfig

EPS = 1e-6  # the model's RMSNorm epsilon
TOL = dict(rtol=1e-10, atol=1e-10)  # float64 end to end


def rms_norm(x, weight):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


def reference_weights(L, k, p, seed):
    """The published DWAModules' parameters: for block i (0-based) with (i + 1) % p == 0, a vector of
    (i + 1 + k) // k weights (its Linear's weight), here random around the published init (1 on the
    newest output)."""
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for i in range(L):
        if (i + 1) % p == 0:
            w = 0.3 * torch.randn((i + 1 + k) // k, generator=g, dtype=torch.float64)
            w[-1] += 1.0
            weights[i] = w
    return weights


def load(model, weights, k, p):
    """Write the reference's vectors into alpha: entry m of block i's vector weighs output
    j = (i + 1) % k + m k (the m-th of its group), in row (i + 1) / p - 1. Every other entry is never
    read: it gets a value that would show if it were."""
    with torch.no_grad():
        model.stream.alpha.fill_(7.0)
        for i, w in weights.items():
            for m, value in enumerate(w):
                model.stream.alpha[(i + 1) // p - 1, (i + 1) % k + m * k] = value


def reference_logits(model, idx, weights, k):
    """DenseFormer's forward: accumulators per dilation group, a block, the output into its group, the
    tensordot of the block's weights with its group."""
    stream, T = model.stream, idx.size(1)
    rope = model.rope[:T]
    x = model.wte(idx)
    L = len(model.sublayers) // 2
    accumulators = [[] for _ in range(k)]
    accumulators[0].append(x)
    for i in range(L):
        x = x + model.sublayers[2 * i](rms_norm(x, stream.norms[2 * i].weight), rope)[0]
        x = x + model.sublayers[2 * i + 1](rms_norm(x, stream.norms[2 * i + 1].weight))
        group = accumulators[(i + 1) % k]
        group.append(x)
        assert len(group) == (i + 1) // k + 1
        if i in weights:
            assert len(weights[i]) == len(group)
            x = torch.tensordot(weights[i], torch.stack(group), dims=1)
    return model.lm_head(rms_norm(x, stream.norm_f.weight))


@pytest.mark.parametrize("k,p,L", [(1, 1, 6), (2, 1, 6), (1, 2, 6), (2, 3, 6), (3, 2, 6), (1, 2, 7), (2, 3, 7)])
def test_dwa_matches_the_published_code(k, p, L):
    """Logits at every position, float64, for dilations and periods that leave some blocks without a
    DWA and groups without the embedding; at L = 7 no period divides L, so the last block has no DWA."""
    config = GPTConfig(block_size=8, vocab_size=65, n_layer=L, n_head=2, n_embd=16, residual="dwa",
                       dwa_dilation=k, dwa_period=p)
    torch.manual_seed(0)
    model = GPT(config).double().eval()
    weights = reference_weights(L, k, p, seed=k * 10 + p)
    load(model, weights, k, p)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for norm in model.stream.norms:
            norm.weight.add_(0.2 * torch.randn(norm.weight.shape, generator=g, dtype=torch.float64))
    perturb_backbone(model, seed=2)
    idx = torch.randint(0, 65, (2, 8), generator=g)
    logits = model(idx, idx)[0]  # with targets: every position
    torch.testing.assert_close(logits, reference_logits(model, idx, weights, k)[..., :65], **TOL)
    # the reference's vectors read out of alpha (load's inverse), so that alpha's gradient flows through both
    alpha = model.stream.alpha
    own = {i: alpha[(i + 1) // p - 1, (i + 1) % k::k][:len(w)] for i, w in weights.items()}
    assert_same_gradients(model, logits, reference_logits(model, idx, own, k)[..., :65])


def test_dwa_init_is_the_published_init():
    """alpha starts as the published init: 1 on the newest output of each DWA, 0 elsewhere."""
    config = GPTConfig(block_size=8, vocab_size=65, n_layer=6, n_head=2, n_embd=16, residual="dwa",
                       dwa_dilation=2, dwa_period=3)
    alpha = GPT(config).stream.alpha
    assert alpha.shape == (2, 7)
    expected = torch.zeros(2, 7)
    expected[0, 3] = expected[1, 6] = 1.0  # the DWAs after blocks 3 and 6
    assert torch.equal(alpha.detach(), expected)


def test_dwa_weight_decay_is_a_switch():
    """alpha takes no weight decay by default; dwa_decay=True decays it, as the reference's Linear weights."""
    def decayed(**kw):
        model = GPT(GPTConfig(block_size=8, vocab_size=65, n_layer=2, n_head=2, n_embd=16, residual="dwa", **kw))
        groups = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95)).param_groups
        return any(p is model.stream.alpha for g in groups if g["weight_decay"] > 0 for p in g["params"])
    assert not decayed() and decayed(dwa_decay=True)


@pytest.mark.parametrize("kw,msg", [
    (dict(dwa_dilation=0), "dwa_dilation must be an integer in \\[1, n_layer = 4\\]"),
    (dict(dwa_period=5), "dwa_period must be an integer in \\[1, n_layer = 4\\]"),
    (dict(dwa_period=2.0), "dwa_period must be an integer"),
])
def test_dwa_options_are_checked(kw, msg):
    with pytest.raises(ValueError, match=msg):
        GPTConfig(block_size=8, vocab_size=65, n_layer=4, n_head=2, n_embd=16, residual="dwa", **kw)
