"""mod=skip_middle against Lawson & Aitchison 2025, "Learning to Skip the Middle Layers of Transformers"
(arXiv 2506.21103), as its code does it (github.com/tim-lawson/skip-middle, commit 9c1d251f, read for
this file: projects/skip_middle/model/{model,utils,optimizer}.py, gate_controller/{utils,proportional}.py,
gate_metrics.py, train/train.py, train_fineweb.py).

Written out here independently of model.py and in fp64: the gates of all L layers (layer L-1-i reuses
gate i), the sparsity loss (a mean over all L layers of coef * mean(g) and coef * var(g), unbiased,
per micro-batch), the gate statistics the controller sees (per micro-batch means of g and g^2,
averaged over the step's micro-batches and ranks; var = E[g^2] - E[g]^2) and the proportional
controller (coef += 1e-3 (value - target) where |value - target| > 0.01; mean targets linspace(1, end)
mirrored, variance targets t(1 - t)). The whole gated model too, from the paper's description (the
default key axis): the gated sandwich block x + g PostNorm(f(PreNorm(x))) for each sublayer, its
attention among the tokens with g > 0 with log g of each key added to the scores; its logits and
every parameter's gradient (the producers' through the gates) against the model's, backbone perturbed.
And each switch: skip_middle_gate_axis (query: the published code's bias, which softmax cancels), the
producers' exemption from weight decay."""
import math

import pytest
import torch

from fidelity import assert_same_gradients, perturb_backbone
from model import GPT, CausalSelfAttention, GPTConfig, SkipMiddle, rope_table
from model import Visibility, executed_fraction  # noqa: E402

L, T, C, H, V, B = 6, 16, 32, 2, 65, 2
F64 = torch.float64


def config(**kw):
    args = dict(block_size=T, vocab_size=V, n_layer=L, n_head=H, n_embd=C, residual="sandwich",
                mod="skip_middle", mod_rate=0.25, skip_target=0.3, kernels="torch")
    args.update(kw)
    return GPTConfig(**args)


def model_fp64(seed=0, **kw):
    """A tiny fp64 model whose producers give s ~ ReLU(N(0, 3.4)): gates at 1, in (0, 1) and at 0."""
    torch.manual_seed(seed)
    model = GPT(config(**kw)).double()
    with torch.no_grad():
        for p in model.mod.producers:
            p.weight.mul_(30)
    return model


def record_producers(model):
    """The raw outputs <w_i, x_i> + b_i of every producer, in call order."""
    produced = []
    for p in model.mod.producers:
        p.register_forward_hook(lambda m, i, out: produced.append(out.detach().clone()))
    return produced


def batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (B, T), generator=g) for _ in range(n)]


# -----------------------------------------------------------------------------
# the reference, in fp64

def reference_gates(produced):
    """One forward's L/2 producer outputs [B, T, 1] -> the gates of all L layers [L, B, T]: the masks
    ReLU(s) cumulate, gate = 1 - clamp(mask, 0, 1), layer L-1-i reuses gate i."""
    masks = torch.stack([s.to(F64).relu().squeeze(-1) for s in produced]).cumsum(0)
    gates = 1.0 - masks.clamp(0.0, 1.0)
    return torch.cat([gates, gates.flip(0)])


def reference_targets(n_layers, start, end):
    """make_mean_targets("auto") mirrored (flipcat), make_var_targets with delta 0."""
    t = torch.linspace(start, end, n_layers // 2, dtype=F64)
    t = torch.cat([t, t.flip(0)])
    return t, (t * (1 - t)).clamp(min=0)


def reference_loss(gates, mean_coefs, var_coefs):
    """TargetGateController.loss: means over all L layers, torch's (unbiased) variance."""
    return (mean_coefs * gates.mean((1, 2))).mean() + (var_coefs * gates.var((1, 2))).mean()


def reference_statistics(step_gates):
    """GateMetrics over one step's micro-batches (and ranks): averaged means of g and g^2."""
    mean = torch.stack([g.mean((1, 2)) for g in step_gates]).mean(0)
    mean_sq = torch.stack([g.square().mean((1, 2)) for g in step_gates]).mean(0)
    return mean, mean_sq - mean.square()


def reference_update(coefs, deltas):
    """ProportionalGateController (delta_min 0.01, coef_update_multiplier 1e-3, no clamp)."""
    return coefs + 1e-3 * (deltas.abs() > 0.01).to(F64) * deltas


def mirror(half):
    return torch.cat([half, half.flip(0)])


def rms(x, weight, eps=1e-6):
    return x / torch.sqrt(x.square().mean(-1, keepdim=True) + eps) * weight


def gated_attention(attn, x, pos, log_g, table):
    """Causal self-attention of the tokens x [k, C] that sit at positions pos [k] (RoPE: consecutive
    feature pairs turned by the cos and sin of model.py's table rows), log_g [k] added to the scores of
    each key."""
    k = x.size(0)
    q, key, v = (x @ attn.c_attn.weight.T).view(k, 3, H, C // H).unbind(1)
    cos, sin = table[pos][:, None, :, 0].to(F64), table[pos][:, None, :, 1].to(F64)

    def rope(t):
        a, b = t[..., 0::2], t[..., 1::2]
        return torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2)
    scores = torch.einsum("qhd,khd->hqk", rope(q), rope(key)) / math.sqrt(C // H) + log_g
    scores = scores.masked_fill(~torch.ones(k, k, dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(k, C) @ attn.c_proj.weight.T


def reference_logits(model, idx, record=None):
    """The gated sandwich model (key axis): x_0 = N(e); block i < L/2 produces s_i = <w_i, x> + b_i from
    the stream entering it, the gates come from reference_gates, block L-1-i takes gate i; each sublayer
    of a block, on the tokens with g > 0 only: x += g PostNorm(f(PreNorm(x))), attention among those
    tokens with log g of each key added to its scores. Tokens with g = 0 keep x. It reads the model's
    parameters, so its logits carry their gradients. record: a list that gets the L gates [B, T]."""
    stream, mod = model.stream, model.mod
    x = rms(model.wte.weight[idx], stream.norm_embed.weight)
    produced = []
    for b in range(L):
        if b < L // 2:
            p = mod.producers[b]
            produced.append(x @ p.weight.T + p.bias)
        g = reference_gates(produced)[b]  # b < L/2: gate b from producers 0..b; then the mirror's
        rows = []
        for row in range(idx.size(0)):
            xr, kept = x[row], (g[row] > 0).nonzero().squeeze(-1)
            gk = g[row][kept]
            for l in (2 * b, 2 * b + 1):
                h = rms(xr[kept], stream.norms[l].weight)
                if l % 2 == 0:
                    f = gated_attention(model.sublayers[l], h, kept, gk.log(), model.rope)
                else:
                    f = model.sublayers[l](h)
                xr = xr.index_copy(0, kept, xr[kept] + gk[:, None] * rms(f, stream.post_norms[l].weight))
            rows.append(xr)
        x = torch.stack(rows)
    if record is not None:
        record.extend(reference_gates(produced))
    return (rms(x, stream.norm_f.weight) @ model.lm_head.weight.T)[..., :V]


# -----------------------------------------------------------------------------

def test_sparsity_loss_is_the_references_mean_over_all_layers():
    """The penalty is a mean over all L layers (mirrors included), not a sum over the L/2 producers;
    backbone perturbed. Its gradient too, for every parameter (the producers', and the blocks' and
    norms' upstream of them), against the penalty of the gates that reference_logits computes from the
    model's parameters: a gate or the running gate sum under a stop-gradient fails here."""
    model = model_fp64().train()
    perturb_backbone(model, seed=2)
    produced = record_producers(model)
    idx = batches(1)[0]
    _, loss0 = model(idx, idx)
    # new buffers, not copy_: loss0's graph keeps the zeros it was computed with
    model.mod.lam = torch.tensor([0.7, -1.3, 2.1], dtype=F64)
    model.mod.mu = torch.tensor([-0.4, 1.9, 0.8], dtype=F64)
    _, loss1 = model(idx, idx)
    gates = reference_gates(produced[:L // 2])
    assert (gates == 0).any() and (gates == 1).any() and ((gates > 0) & (gates < 1)).any()
    torch.testing.assert_close(reference_gates(produced[L // 2:]), gates)  # the same forward twice
    expected = reference_loss(gates, mirror(model.mod.lam), mirror(model.mod.mu))
    torch.testing.assert_close(loss1 - loss0, expected, rtol=1e-9, atol=1e-12)
    own = []  # the gates again, now functions of the parameters
    reference_logits(model, idx, record=own)
    own = torch.stack(own)
    torch.testing.assert_close(own, gates, rtol=1e-12, atol=0)
    # the difference of the two losses is the penalty alone: the LM loss's gradients cancel exactly
    assert_same_gradients(model, loss1 - loss0, reference_loss(own, mirror(model.mod.lam), mirror(model.mod.mu)))


def test_each_block_is_gated_by_its_own_or_its_mirrors_gate(monkeypatch):
    """What every block of a forward actually uses, read off its route: the weight that scales its
    writes and the tokens that run it (g > 0), as [B, T] per sublayer. Block i < L/2 uses its own gate,
    block L-1-i the same gate as block i, against reference_gates from the producers' raw outputs."""
    model = model_fp64().eval()
    produced = record_producers(model)
    used, route = {}, model.mod.route

    def spy(stream, state, x, l, ctx):
        r = route(stream, state, x, l, ctx)
        w = torch.where(r.valid, r.weight, 0.0) if r.valid is not None else r.weight
        used[l] = w.squeeze(-1) if r.idx is None else torch.zeros(B, T, dtype=F64).scatter(1, r.idx, w.squeeze(-1))
        used[l, "ran"] = r.ran(B, T, "cpu")
        return r
    monkeypatch.setattr(model.mod, "route", spy)
    with torch.no_grad():
        model(batches(1, seed=4)[0])
    gates = reference_gates(produced)
    # the gates differ from block to block, and some tokens skip: a wrong pairing cannot pass
    assert all((gates[i] - gates[j]).abs().max() > 0.1 for i in range(L // 2) for j in range(i))
    assert (gates == 0).any()
    for l in range(2 * L):
        torch.testing.assert_close(used[l], gates[l // 2], rtol=1e-12, atol=0, msg=f"sublayer {l}")
        assert torch.equal(used[l, "ran"], gates[l // 2] > 0), l


def test_gated_model_matches_the_reference_with_its_gradients():
    """The whole gated model (key axis, g = 0 tokens gathered out, rows padded to the longest) against
    reference_logits, float64, with the backbone perturbed and every norm weight off 1: the gates are 0,
    in (0, 1) and 1 (a gate in the write and in the scores shows), the logits equal the reference's, and
    so does every parameter's gradient, per element: the producers' through the gates (the write's g
    and the keys' log g), the blocks' and the norms'. A gate, a producer's input or the running gate
    sum under a stop-gradient passes the logits and fails here."""
    model = model_fp64().eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.stream.parameters():  # the pre-, post-, embedding and final norms' weights
            p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=F64))
    perturb_backbone(model, seed=2)  # blocks that move the stream, so a wrong gate shows
    idx = batches(1, seed=4)[0]
    logits, _, executed = model(idx, idx, executed=True)
    frac = executed_fraction(executed, idx.numel())
    gates = []
    reference = reference_logits(model, idx, record=gates)
    gates = torch.stack(gates)
    assert (gates == 0).any() and (gates == 1).any() and ((gates > 0) & (gates < 1)).sum() >= 10
    assert gates[gates > 0].min() > 1e-3  # the model's log-gate floor (1e-6) never binds
    assert 0 < min(frac) < max(frac) < 1  # gathered, padded rows
    torch.testing.assert_close(logits, reference, rtol=1e-10, atol=1e-10)
    assert_same_gradients(model, logits, reference)


def test_controller_matches_the_reference_over_steps():
    """3 steps of 2 micro-batches: the same statistics and the same lam, mu as the reference's 6 layer
    coefficients (mirrored pairs equal there)."""
    model = model_fp64().train()
    produced = record_producers(model)
    mean_targets, var_targets = reference_targets(L, 1.0, 0.3)
    torch.testing.assert_close(mirror(model.mod.target), mean_targets)
    mean_coefs, var_coefs = torch.zeros(L, dtype=F64), torch.zeros(L, dtype=F64)
    data = batches(6, seed=1)
    for step in range(3):
        produced.clear()
        with torch.no_grad():
            for idx in data[2 * step:2 * step + 2]:
                model(idx, idx)
        model.after_step()
        step_gates = [reference_gates(produced[i:i + L // 2]) for i in (0, L // 2)]
        mean, var = reference_statistics(step_gates)
        mean_coefs = reference_update(mean_coefs, mean - mean_targets)
        var_coefs = reference_update(var_coefs, var - var_targets)
        torch.testing.assert_close(mirror(model.mod.gate_mean), mean)
        torch.testing.assert_close(mirror(model.mod.gate_var), var)
        # (the model's targets were built in fp32: 0.65 is off by 1e-8, which moves a coefficient 1e-11)
        torch.testing.assert_close(mirror(model.mod.lam), mean_coefs, rtol=1e-6, atol=1e-12)
        torch.testing.assert_close(mirror(model.mod.mu), var_coefs, rtol=1e-6, atol=1e-12)
    assert (mean_coefs != 0).all() and (var_coefs != 0).any()  # every gap moved something


def test_controller_statistics_are_pooled_over_micro_batches():
    """2 micro-batches with different gates: the controller sees the mean and the population variance
    of all their gates together, not the last micro-batch's, nor an unbiased variance."""
    model = model_fp64().train()
    produced = record_producers(model)
    a, b = batches(2, seed=2)
    with torch.no_grad():
        model(a, a)
        model.mod.producers[0].bias.fill_(5.0)  # the second micro-batch's gates are all 0
        model(b, b)
    model.after_step()
    g1, g2 = (reference_gates(produced[i:i + L // 2])[:L // 2].flatten(1) for i in (0, L // 2))
    pooled = torch.cat([g1, g2], 1)
    torch.testing.assert_close(model.mod.gate_mean, pooled.mean(1))
    torch.testing.assert_close(model.mod.gate_var, pooled.var(1, unbiased=False))
    assert (model.mod.gate_mean - g2.mean(1)).abs().min() > 0.05  # the last micro-batch alone differs
    assert not torch.allclose(model.mod.gate_var, pooled.var(1))
    assert not model.mod.gate_sums.any()  # and the next step starts from 0


def test_one_producer_aims_at_skip_target_where_the_reference_aims_at_1():
    """L = 2: the reference's linspace(1, end, 1) is [1] (a gate that never aims to skip); ours is
    skip_target (documented in SkipMiddle). From L = 4 on the targets are the reference's."""
    assert reference_targets(2, 1.0, 0.5)[0].tolist() == [1.0, 1.0]
    assert GPT(config(n_layer=2, skip_target=0.5)).mod.target.tolist() == [0.5]
    for n_layer in (4, 6, 12):
        ours = GPT(config(n_layer=n_layer, n_embd=16)).mod.target.to(F64)
        torch.testing.assert_close(mirror(ours), reference_targets(n_layer, 1.0, 0.3)[0])


def test_gate_producers_get_no_weight_decay():
    """The reference trains everything with weight_decay=0 (train_fineweb.py), the gate producers in
    their own group; here they join the no-decay group, while the other matrices still decay."""
    model = GPT(config())
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95))
    groups = {g["weight_decay"]: {id(p) for p in g["params"]} for g in opt.param_groups}
    for p in model.mod.producers.parameters():
        assert id(p) in groups[0.0] and id(p) not in groups[0.1]
    assert id(model.sublayers[0].c_attn.weight) in groups[0.1]
    assert sum(len(g) for g in groups.values()) == len(list(model.parameters()))


def test_query_axis_bias_is_cancelled_by_softmax_and_key_axis_is_not():
    """The published code adds log g along the query axis: one constant per row, which softmax
    removes, so attention's output is the ungated one (the block write is then g times it). Along the
    key axis (our default) other tokens stop reading a low-gate token: the output changes."""
    torch.manual_seed(0)
    attn = CausalSelfAttention(config()).double()
    x = torch.randn(B, T, C, dtype=F64)
    rope = rope_table(C // H, T).to(F64)
    log_g = torch.log(torch.rand(B, T, dtype=F64).clamp(1e-6, 1.0))
    plain = attn(x, rope)[0]
    torch.testing.assert_close(attn(x, rope, Visibility(query_bias=log_g))[0], plain, rtol=1e-12, atol=1e-12)
    assert (attn(x, rope, Visibility(key_bias=log_g))[0] - plain).abs().max() > 1e-2


def test_query_axis_model_runs_every_token_and_its_bias_does_nothing(monkeypatch):
    """skip_middle_gate_axis=query: every token runs every block (executed 1; g = 0 tokens are still
    keys), and dropping the query bias leaves the logits as they were; key axis: other logits, and
    g = 0 tokens are gathered out."""
    idx = batches(1, seed=3)[0]
    query = model_fp64(skip_middle_gate_axis="query").eval()
    with torch.no_grad():
        logits, _, executed = query(idx, idx, executed=True)
        assert executed_fraction(executed, idx.numel()) == [1.0] * (2 * L)
        make = query.mod.gate_route

        def unbiased(state, block, ctx):
            route = make(state, block, ctx)
            route.query_bias = None
            return route
        monkeypatch.setattr(query.mod, "gate_route", unbiased)
        torch.testing.assert_close(query(idx, idx)[0], logits, rtol=1e-10, atol=1e-10)
        key = model_fp64().eval()
        key_logits, _, executed = key(idx, idx, executed=True)
        assert (key_logits - logits).abs().max() > 1e-3
        assert min(executed_fraction(executed, idx.numel())) < 1.0


@pytest.mark.parametrize("kw, error", [
    (dict(skip_middle_gate_axis="value"), r"unknown skip_middle_gate_axis 'value'; valid: key, query"),
    (dict(mod="router", residual="prenorm", skip_target=None, skip_middle_gate_axis="query"),
     r"skip_middle_gate_axis=query only applies to mod=skip_middle; "
     r"remove --skip_middle_gate_axis or set --mod=skip_middle"),
])
def test_gate_axis_validation(kw, error):
    with pytest.raises(ValueError, match=error):
        config(**kw)


def test_defaults_are_the_papers():
    assert GPTConfig.skip_middle_gate_axis == "key" and SkipMiddle.eta == 1e-3 and SkipMiddle.tolerance == 0.01
