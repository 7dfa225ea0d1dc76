"""AttnRes against the published method (Chen et al., "Attention Residuals", arXiv 2603.15031, and the
Block AttnRes pseudocode in the README of github.com/MoonshotAI/Attention-Residuals), in float64.

The reference below is written from the paper, not from model.py: its own loop over layers with the
pseudocode's block boundaries (`layer % k == 0`, before the layer's attention: the finished block is
appended after the attention has read it as its "partial block"), its own RMSNorm of the keys, its
own softmax (or sigmoid) over depth. It borrows only the sublayers themselves (attention, MLP: the
paper's f_l) and the weights. Every query and norm weight is moved off its init first, and the
backbone's matrices too (tests/fidelity.py: at init the blocks barely move the stream), so a wrong
partition, a missing key norm or a wrong query cannot pass by accident; and every parameter's
gradient is compared with the reference's, so neither can a depth mix whose input, key or weight is
under a stop-gradient. Also here: the partition rule and its errors, and one test per ablation switch
that fails without it."""
import math

import pytest
import torch

from fidelity import assert_same_gradients, perturb_backbone
from model import GPT, GPTConfig
from model import RESIDUALS, diagnose  # noqa: E402

EPS = 1e-6  # the model's RMSNorm epsilon
TOL = dict(rtol=1e-10, atol=1e-10)  # float64 end to end



def blocks_used(config):
    """The sources a residual=attnres/block_attnres model ends with, besides the embedding."""
    return sum(RESIDUALS[config.residual].block_ends(config))

def tiny(residual="block_attnres", **kw):
    args = dict(block_size=8, vocab_size=65, n_layer=4, n_head=2, n_embd=16, residual=residual)
    args.update(kw)
    return GPTConfig(**args)


def random_model(config, seed=0):
    """A float64 model whose AttnRes queries, projections and norm weights are random, not 0 / 1, and
    whose backbone is perturbed (the same draw for every model of one shape: perturb_backbone's seed)."""
    torch.manual_seed(seed)
    model = GPT(config).double().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.stream.named_parameters():
            std = 0.3 / math.sqrt(p.size(-1)) if p.dim() == 2 else 0.5
            p.add_(std * torch.randn(p.shape, generator=g, dtype=p.dtype))
    perturb_backbone(model, seed=seed + 2)  # blocks that move the stream, so a wrong mix shows
    return model


# -----------------------------------------------------------------------------
# the reference

def rms_norm(x, weight=None):
    y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    return y if weight is None else y * weight


def attn_res(sources, mixer, l, query="static", weights="softmax", key_norm=True, record=None):
    """The pseudocode's block_attn_res for mixing point l (1..2L-1, 2L: the head): V = stack(sources),
    K = RMSNorm_l(V), logits = <q_l, K>, h = sum softmax_0(logits) V. record: a dict that gets the
    depth weights alpha [S, B, T] at key l."""
    V = torch.stack(sources)  # [S, B, T, d]
    K = rms_norm(V, mixer.key_norm_weights[l - 1]) if key_norm else V
    if query == "static":
        q = mixer.queries[l - 1]  # [d]
    else:  # projected from the current hidden state (the partial block), ours: through a weightless RMSNorm
        q = rms_norm(sources[-1]) @ mixer.query_projs[l - 1].T  # [B, T, d]
    logits = (K * q).sum(-1)  # [S, B, T]
    alpha = torch.sigmoid(logits) if weights == "sigmoid" else torch.softmax(logits, dim=0)
    if record is not None:
        record[l] = alpha
    return torch.einsum("sbt,sbtd->btd", alpha, V)


def reference_logits(model, idx, layers_per_block, record=None, **ablation):
    """Block AttnRes as the README's forward(): blocks of `layers_per_block` whole layers; the token
    embedding is b_0. layers_per_block=None: full AttnRes (Eqs. 2-4: every sublayer's output is a source).
    record: a dict that gets every mixing point's depth weights (see attn_res)."""
    mixer, T = model.stream, idx.size(1)
    rope = model.rope[:T]

    def sublayer(l, h):  # f_l(RMSNorm_l(h)), the pre-norm with its own learned weight
        x = rms_norm(h, mixer.norms[l].weight)
        return model.sublayers[l](x, rope)[0] if l % 2 == 0 else model.sublayers[l](x)

    def read(l, sources):
        # sublayer 1 has the embedding alone: softmax gives it weight 1 (a sigmoid gate would scale it
        # by a positive per-token scalar, which the pre-norm removes; the model reads it as is)
        return sources[0] if l == 0 else attn_res(sources, mixer, l, record=record, **ablation)

    emb = model.wte.weight[idx]
    if layers_per_block is None:
        sources = [emb]
        for l in range(len(model.sublayers)):
            sources.append(sublayer(l, read(l, sources)))
        blocks = sources
    else:
        blocks, partial = [], emb
        for layer in range(model.config.n_layer):
            h = read(2 * layer, blocks + [partial])
            if layer % layers_per_block == 0:  # block boundary: the partial block is finished
                blocks.append(partial)
                partial = None
            attn_out = sublayer(2 * layer, h)
            partial = attn_out if partial is None else partial + attn_out
            h = read(2 * layer + 1, blocks + [partial])
            partial = partial + sublayer(2 * layer + 1, h)
        blocks.append(partial)
    h = attn_res(blocks, mixer, len(model.sublayers), record=record, **ablation)  # the head: one more query
    return model.lm_head(rms_norm(h, mixer.norm_f.weight))[..., :model.config.vocab_size], len(blocks) - 1


def batch(B=2, T=8, seed=3):
    return torch.randint(0, 65, (B, T), generator=torch.Generator().manual_seed(seed))


# -----------------------------------------------------------------------------
# the logits equal the reference's

@pytest.mark.parametrize("n_layer, blocks", [
    (4, 2),  # N divides L: 2 blocks of 2 layers
    (4, 4),  # N = L: one block per layer
    (4, 1),  # N = 1: the embedding and one running sum
    (5, 2),  # N does not divide L: k = 3, blocks of 3 and 2 layers
    (5, 3),  # k = 2: blocks of 2, 2 and 1 layers
    (6, 4),  # k = 2: 3 blocks, fewer than N
    (3, None),  # default N = min(8, L) = 3
])
def test_block_attnres_equals_the_reference(n_layer, blocks):
    """Logits at every position and every parameter's gradient (the fused depth_attention kernel's own
    backward included) equal the reference's, float64, backbone perturbed, queries and norms random."""
    config = tiny(n_layer=n_layer, attnres_blocks=blocks)
    model = random_model(config)
    idx = batch()
    logits, _ = model(idx, idx)
    k = math.ceil(n_layer / (blocks or min(8, n_layer)))
    ref, used = reference_logits(model, idx, k)
    torch.testing.assert_close(logits, ref, **TOL)
    assert used == blocks_used(config) == math.ceil(n_layer / k)
    assert_same_gradients(model, logits, ref)  # a source, key or query under a stop-gradient passes the logits


def test_attnres_equals_the_reference_eqs_2_to_4():
    """Full AttnRes (every sublayer's output a source): logits and every parameter's gradient equal the
    reference's, float64, backbone perturbed, queries and norms random."""
    model = random_model(tiny("attnres", n_layer=3))
    idx = batch()
    logits, _ = model(idx, idx)
    ref, used = reference_logits(model, idx, None)
    torch.testing.assert_close(logits, ref, **TOL)
    assert used == blocks_used(model.config) == 6
    assert_same_gradients(model, logits, ref)


def test_block_attnres_with_one_layer_per_block_is_not_full_attnres():
    """N = L still sums a layer's attention and MLP outputs into one source (whole-layer blocks);
    full AttnRes keeps them apart."""
    full = random_model(tiny("attnres"))
    block = GPT(tiny(attnres_blocks=4)).double().eval()
    block.load_state_dict(full.state_dict())
    idx = batch()
    assert not torch.allclose(full(idx, idx)[0], block(idx, idx)[0])


# -----------------------------------------------------------------------------
# the partition

def test_no_boundary_splits_a_layer():
    for L in range(1, 10):
        for N in range(1, L + 1):
            config = tiny(n_layer=L, attnres_blocks=N)
            ends = [l for l in range(2 * L) if RESIDUALS[config.residual].block_ends(config)[l]]
            k = math.ceil(L / N)
            assert all(l % 2 == 1 for l in ends), (L, N)  # only after an MLP
            assert ends == [2 * j + 1 for j in range(L) if (j + 1) % k == 0 or j + 1 == L], (L, N)
            assert blocks_used(config) == len(ends) == math.ceil(L / k), (L, N)


def sources_read(model, idx):
    """How many sources each sublayer (then the head) mixes, from the diagnostics."""
    return [len(r.get("depth_weights", [0])) for r in diagnose(model, idx)]


@pytest.mark.parametrize("n_layer, blocks, counts", [
    # L = 4, N = 3: k = 2, blocks {0, 1}, {2, 3}. A block's first attention reads finished blocks only,
    # its MLP one more (the attention's output); later sublayers of the block read the same number
    (4, 3, [1, 2, 2, 2, 2, 3, 3, 3, 3]),
    (2, 2, [1, 2, 2, 3, 3]),  # N = L: one layer per block
])
def test_sources_per_sublayer(n_layer, blocks, counts):
    model = GPT(tiny(n_layer=n_layer, attnres_blocks=blocks))
    assert sources_read(model, batch(1, 4)) == counts


@pytest.mark.parametrize("n_layer, blocks, used", [
    (12, 8, 6), (12, None, 6),  # k = ceil(12 / 8) = 2 layers per block: 6 blocks
    (48, None, 8), (6, None, 6), (4, None, 4), (5, 4, 3),
    (27, 9, 9),  # the paper's 48B model: 27 layers (54 sublayers), blocks of 3 layers (6 sublayers)
])
def test_blocks_used(n_layer, blocks, used):
    assert blocks_used(tiny(n_layer=n_layer, attnres_blocks=blocks)) == used


@pytest.mark.parametrize("blocks", [0, -1, 5, 8, 2.5, True])
def test_blocks_out_of_range_is_a_one_line_error(blocks):
    with pytest.raises(ValueError, match=r"attnres_blocks must be an integer in \[1, n_layer = 4\]") as e:
        tiny(attnres_blocks=blocks)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kw, match", [
    (dict(attnres_query="dynamic"), "unknown attnres_query 'dynamic'; valid: static, input"),
    (dict(attnres_weights="relu"), "unknown attnres_weights 'relu'; valid: softmax, sigmoid"),
    (dict(attnres_key_norm="no"), "unknown attnres_key_norm 'no'; valid: True, False"),
    (dict(residual="prenorm", attnres_weights="sigmoid"), "only applies to residual=attnres or block_attnres"),
])
def test_bad_ablation_options_are_one_line_errors(kw, match):
    with pytest.raises(ValueError, match=match) as e:
        tiny(**kw)
    assert "\n" not in str(e.value)


# -----------------------------------------------------------------------------
# the ablations (paper §5.3): each switch changes the model, into the reference's version of it

ABLATIONS = [dict(attnres_query="input"), dict(attnres_weights="sigmoid"), dict(attnres_key_norm=False),
             dict(attnres_query="input", attnres_weights="sigmoid", attnres_key_norm=False)]


@pytest.mark.parametrize("residual", ["block_attnres", "attnres"])
@pytest.mark.parametrize("ablation", ABLATIONS, ids=lambda kw: "-".join(map(str, kw.values())))
def test_ablation_equals_the_reference_and_differs_from_the_default(ablation, residual):
    """Each ablation (the plain path): logits and every parameter's gradient equal the reference's
    version of it, float64, backbone perturbed; and the logits are not the default's."""
    blocks = 3 if residual == "block_attnres" else None  # L = 4: k = 2
    default = random_model(tiny(residual, attnres_blocks=blocks))
    model = random_model(tiny(residual, attnres_blocks=blocks, **ablation))
    model.load_state_dict(default.state_dict(), strict=False)  # every weight they share
    idx = batch()
    logits, _ = model(idx, idx)
    ref, _ = reference_logits(model, idx, 2 if blocks else None,
                              **{name.removeprefix("attnres_"): value for name, value in ablation.items()})
    torch.testing.assert_close(logits, ref, **TOL)
    assert not torch.allclose(logits, default(idx, idx)[0], rtol=1e-4, atol=1e-4)
    assert_same_gradients(model, logits, ref)


def test_input_query_starts_as_the_uniform_mix():
    """W_l starts at 0, as the pseudo-query does: at init the two query kinds are the same model."""
    torch.manual_seed(0)
    static = GPT(tiny()).double()
    torch.manual_seed(0)
    projected = GPT(tiny(attnres_query="input")).double()
    assert all((w == 0).all() for w in projected.stream.query_projs)
    idx = batch()
    torch.testing.assert_close(static(idx, idx)[0], projected(idx, idx)[0], **TOL)


def test_sigmoid_gates_are_one_half_at_init():
    model = GPT(tiny(attnres_weights="sigmoid"))
    for row in diagnose(model, batch())[1:]:
        assert row["depth_weights"] == pytest.approx([0.5] * len(row["depth_weights"]))


@pytest.mark.parametrize("residual, blocks", [("attnres", None), ("block_attnres", 3)])
def test_diagnostics_report_each_mixing_points_own_depth_weights(residual, blocks):
    """diagnose()'s depth_weights of sublayer l, and of the head (l = 2L), are the reference's alpha at
    mixing point l averaged over the tokens, on a model whose queries and key-norm weights are random:
    every point's softmax is its own, so a row that reads another point's query or sources fails (at
    init every query is 0 and every row is uniform, whatever it reads)."""
    model = random_model(tiny(residual, attnres_blocks=blocks))
    idx = batch()
    record = {}
    reference_logits(model, idx, 2 if blocks else None, record=record)  # L = 4, N = 3: k = 2
    rows = diagnose(model, idx)
    assert "depth_weights" not in rows[0] and sorted(record) == list(range(1, len(rows)))
    assert rows[-1]["kind"] == "head"
    for l, row in enumerate(rows[1:], start=1):
        want = record[l].flatten(1).mean(1)
        assert (want - 1 / len(want)).abs().max() > 0.01, l  # far from uniform (10^4 x the tolerance)
        assert row["depth_weights"] == pytest.approx(want.tolist(), abs=1e-6), l


def test_plain_path_equals_the_fused_kernel_for_the_default():
    """The ablations' plain path, run with the default settings, is the fused depth_attention."""
    model = random_model(tiny(attnres_blocks=3))
    idx = batch()
    fused, _ = model(idx, idx)
    model.stream.fused = False
    torch.testing.assert_close(model(idx, idx)[0], fused, **TOL)


@pytest.mark.parametrize("ablation", ABLATIONS[:3] + [dict(attnres_query="input", mod="router", mod_rate=0.5)],
                         ids=lambda kw: "-".join(map(str, kw.values())))
def test_ablation_trains_every_parameter(ablation):
    model = random_model(tiny(attnres_blocks=3, **ablation)).train()
    idx = batch()
    _, loss = model(idx, torch.roll(idx, -1, 1))
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"{name} gets no gradient"
