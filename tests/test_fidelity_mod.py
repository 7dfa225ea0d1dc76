"""mod=router against Raposo et al. 2024, "Mixture-of-Depths" (arXiv 2404.02258).

Eq. 1, written out here independently of model.py and in fp64: in a routed block, per sequence the
top-k tokens by the router's raw score r = <w, x> run the whole block f (attention among the kept
tokens only, causal in their order, RoPE at their original positions; then the MLP on x + a), and
x_{l+1} = x + r f(x) for them; the others keep x. The model must give the same logits with
mod_layout=block, router_weight=raw; and each switch (mod_layout, mod_every, router_weight,
mod_inference) must change what it says it changes. With the backbone perturbed, every parameter's
gradient through the routed forward equals the reference's too, at the routing both make. The
predictor (mod_inference=predictor, the paper's sampling method) is trained by a BCE that leaves the
main model's gradients alone."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import flops
from fidelity import assert_same_gradients, perturb_backbone
from model import GPT, GPTConfig, executed_fraction
from model import TopKMoD  # noqa: E402
from test_mod import spy_routes
from test_step_sync import HostReads

L, T, C, H, V = 4, 16, 32, 2, 65


def config(**kw):
    args = dict(block_size=T, vocab_size=V, n_layer=L, n_head=H, n_embd=C, residual="prenorm", mod="router",
                mod_rate=0.25, kernels="torch", mod_layout="block", router_weight="raw")
    args.update(kw)
    return GPTConfig(**args)


def model_fp64(seed=0, **kw):
    """A tiny model in fp64 with N(0, 1) router weights: scores spread far apart, so the float noise
    between two ways of computing the same thing never flips a routing decision."""
    torch.manual_seed(seed)
    model = GPT(config(**kw)).double()
    with torch.no_grad():
        for router in model.mod.routers:
            router.weight.normal_()
        for p in model.stream.parameters():  # norm gains off 1, so that every one matters
            p.add_(0.2 * torch.randn_like(p))
    return model


# -----------------------------------------------------------------------------
# Eq. 1, from the paper

def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w


def rotate(x, pos, table=None):
    """RoPE on x [k, nh, hd] at positions pos [k]: feature pairs (2i, 2i+1) turned by pos / 10000^(2i/hd).
    table: the cos and sin of those angles from a [T, hd/2, 2] table (model.py's, float32 angles: a
    float64 recomputation differs by ~1e-8, which the gradients' float64 comparison would see); None:
    computed here, in float64."""
    hd = x.size(-1)
    if table is None:
        angle = pos[:, None, None].double() * 10000.0 ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        cos, sin = angle.cos(), angle.sin()
    else:
        cos, sin = table[pos][:, None, :, 0].double(), table[pos][:, None, :, 1].double()
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2)


def attention(p, x, pos, table=None):
    """Causal self-attention of the sequence x [k, C] whose tokens sit at positions pos."""
    k = x.size(0)
    q, key, v = (x @ p["c_attn.weight"].T).view(k, 3, H, C // H).unbind(1)
    q, key = rotate(q, pos, table).transpose(0, 1), rotate(key, pos, table).transpose(0, 1)
    s = q @ key.transpose(-1, -2) / math.sqrt(C // H)
    s = s.masked_fill(~torch.ones(k, k, dtype=torch.bool).tril(), float("-inf"))
    y = (s.softmax(-1) @ v.transpose(0, 1)).transpose(0, 1).reshape(k, C)
    return y @ p["c_proj.weight"].T


def mlp(p, x):
    return F.gelu(x @ p["c_fc.weight"].T) @ p["c_proj.weight"].T


def reference_logits(model, idx, weight=lambda r: r, every=1, keep=None, record=None, table=None):
    """Eq. 1 per block b (pre-norm; sandwich also normalises the embedding and each sublayer's
    output): f(x) = a + m with a = attn(N(x)), m = mlp(N(x + a)); routed blocks (b % every == 0)
    give the top-k tokens of each row x + weight(r) f(x) with r = <w_b, N(x)>; dense blocks x + f(x).
    It reads the model's parameters themselves, so its logits carry their gradients (at its routing:
    top-k is piecewise constant). record: a dict that gets each routed block's kept positions, [B, k]
    at key b. table: RoPE's cos and sin (see rotate)."""
    sd = {k: v.double() for k, v in (*model.named_buffers(), *model.named_parameters())}
    sandwich = model.config.residual == "sandwich"
    sub = lambda l: {k.split(".", 2)[2]: v for k, v in sd.items() if k.startswith(f"sublayers.{l}.")}  # noqa: E731
    post = (lambda l, y: rms(y, sd[f"stream.post_norms.{l}.weight"])) if sandwich else (lambda l, y: y)
    embedded = sd["wte.weight"][idx]
    if sandwich:
        embedded = rms(embedded, sd["stream.norm_embed.weight"])
    k = math.ceil(keep * T)
    out = []
    for row in range(idx.size(0)):
        x = embedded[row]
        for b in range(model.config.n_layer):
            attn_in = rms(x, sd[f"stream.norms.{2 * b}.weight"])
            if b % every == 0:
                r = attn_in @ sd[f"mod.routers.{b // every}.weight"][0]
                kept = r.topk(k).indices.sort().values
                if record is not None:
                    record.setdefault(b, []).append(kept)
            else:
                r, kept = torch.ones(T, dtype=torch.float64), torch.arange(T)
            xs = x[kept]
            a = post(2 * b, attention(sub(2 * b), attn_in[kept], kept, table))
            m = post(2 * b + 1, mlp(sub(2 * b + 1), rms(xs + a, sd[f"stream.norms.{2 * b + 1}.weight"])))
            w = weight(r[kept])[:, None] if b % every == 0 else 1.0
            x = x.index_copy(0, kept, xs + w * (a + m))
        out.append(x)
    if record is not None:
        record.update({b: torch.stack(rows) for b, rows in record.items()})
    return (rms(torch.stack(out), sd["stream.norm_f.weight"]) @ sd["lm_head.weight"].T)[..., :V]


def train_logits(model, idx):
    model.train()
    with torch.no_grad():
        logits, _ = model(idx, idx)
    return logits


@pytest.mark.parametrize("residual", ["prenorm", "sandwich"])
@pytest.mark.parametrize("every", [1, 2])
def test_block_routing_is_eq1_of_the_paper(residual, every, monkeypatch):
    """The routed training forward (mod_layout=block, router_weight=raw), backbone perturbed, against
    Eq. 1: the logits equal the reference's with RoPE computed in float64 (1e-6: model.py's table holds
    float32 angles); with model.py's table the reference routes the very same tokens in every routed
    block and row, and then its logits (1e-10) and every parameter's gradient (float64, per element)
    are the model's: the routers' (through r scaling the kept writes) and the blocks' alike, at that
    fixed routing (top-k is piecewise constant). A score or block output under a stop-gradient passes
    the logits and fails here."""
    model = model_fp64(residual=residual, mod_every=every, mod_rate=0.25)
    perturb_backbone(model, seed=2)  # blocks that move the stream, so a wrong write shows
    idx = torch.randint(0, V, (2, T))
    keep = TopKMoD.keep_fraction(model.config)
    assert keep == (0.75 if every == 1 else 0.5)  # mod_rate is the overall skipped fraction
    expected = reference_logits(model, idx, every=every, keep=keep)
    torch.testing.assert_close(train_logits(model, idx), expected, rtol=1e-6, atol=1e-6)
    seen = spy_routes(monkeypatch, model)
    logits, _ = model.train()(idx, idx)
    kept = {}
    reference = reference_logits(model, idx, every=every, keep=keep, record=kept, table=model.rope)
    routed = {l // 2: route.idx for l, route, _, _ in seen if route is not None and l % 2 == 0}
    assert sorted(routed) == sorted(kept) == list(range(0, L, every))
    assert all(torch.equal(routed[b], kept[b]) for b in kept)  # the same tokens: gradients at one routing
    torch.testing.assert_close(logits, reference, rtol=1e-10, atol=1e-10)
    assert_same_gradients(model, logits, reference)


# -----------------------------------------------------------------------------
# each switch does what it says, and the reference fails without it

def test_block_layout_shares_one_route_and_sublayer_layout_does_not(monkeypatch):
    idx = torch.randint(0, V, (2, T))
    block = model_fp64(mod_layout="block")
    seen = spy_routes(monkeypatch, block)
    expected = reference_logits(block, idx, keep=TopKMoD.keep_fraction(block.config))
    train_logits(block, idx)
    assert len(block.mod.routers) == L and all(seen[2 * b][1] is seen[2 * b + 1][1] for b in range(L))
    # the same model routed per sublayer, each MLP's router a copy of its block's: the MLP now
    # scores the stream after the attention, keeps other tokens, and the logits leave Eq. 1
    sub = model_fp64(mod_layout="sublayer")
    assert len(sub.mod.routers) == 2 * L
    state = {k: v for k, v in block.state_dict().items() if not k.startswith(("mod.routers", "mod.tau"))}
    state.update({f"mod.routers.{l}.weight": block.mod.routers[l // 2].weight for l in range(2 * L)})
    sub.load_state_dict(state, strict=False)
    seen = spy_routes(monkeypatch, sub)
    logits = train_logits(sub, idx)
    assert any(not torch.equal(seen[2 * b][1].idx, seen[2 * b + 1][1].idx) for b in range(L))
    assert (logits - expected).abs().max() > 1e-2


def test_mod_every_routes_every_kth_block_and_keeps_mod_rate_overall():
    model = model_fp64(mod_every=2, mod_rate=0.25)
    assert TopKMoD.routed(model.config) == (0, 1, 4, 5) and len(model.mod.routers) == 2
    idx = torch.randint(0, V, (2, T))
    model.train()
    with torch.no_grad():
        frac = executed_fraction(model(idx, idx, executed=True)[2], idx.numel())
    assert frac == [0.5, 0.5, 1.0, 1.0, 0.5, 0.5, 1.0, 1.0]  # odd blocks dense
    assert 1 - sum(frac) / len(frac) == 0.25  # mod_rate: the skipped share of (token, sublayer) pairs
    assert flops.forward_flops(model.config) == flops.forward_flops(model.config, frac)
    # the paper's recipe: 12.5% capacity in every other block
    assert TopKMoD.keep_fraction(config(mod_every=2, mod_rate=0.4375, block_size=64)) == 0.125
    # mod_every=1 routes the odd blocks too, and so leaves the reference
    idx = torch.randint(0, V, (2, T))
    every1 = model_fp64(mod_every=1, mod_rate=0.25)
    every1.load_state_dict({**every1.state_dict(), **{k: v for k, v in model.state_dict().items()
                                                      if k != "mod.tau"}}, strict=False)
    expected = reference_logits(model, idx, every=2, keep=0.5)
    assert (train_logits(every1, idx) - expected).abs().max() > 1e-2


def test_raw_weight_is_eq1_and_sigmoid_is_a_switch():
    idx = torch.randint(0, V, (2, T))
    raw, sig = model_fp64(router_weight="raw"), model_fp64(router_weight="sigmoid")
    assert all(torch.equal(p, sig.get_parameter(name)) for name, p in raw.named_parameters())
    keep = TopKMoD.keep_fraction(raw.config)
    eq1, with_sigmoid = reference_logits(raw, idx, keep=keep), reference_logits(raw, idx, torch.sigmoid, keep=keep)
    torch.testing.assert_close(train_logits(raw, idx), eq1, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(train_logits(sig, idx), with_sigmoid, rtol=1e-6, atol=1e-6)
    assert (eq1 - with_sigmoid).abs().max() > 1e-2


def test_config_errors_name_the_fix():
    base = dict(block_size=T, vocab_size=V, n_layer=L, n_head=H, n_embd=C, residual="prenorm", mod="router",
                mod_rate=0.25)
    for kw, message in [
        (dict(mod_layout="layer"), "unknown mod_layout 'layer'; valid: block, sublayer"),
        (dict(router_weight="softmax"), "unknown router_weight"),
        (dict(mod_inference="oracle"), "unknown mod_inference"),
        (dict(mod_every=0), "mod_every must be an integer >= 1"),
        (dict(mod_every=2, mod_rate=0.5), r"use mod_rate < 0.5 or a smaller mod_every"),
        (dict(mod="nag", residual="nag", mod_every=2),
         r"mod_every=2 only applies to mod=router; remove --mod_every or set --mod=router"),
        (dict(mod="skip_middle", residual="sandwich", mod_layout="sublayer", mod_inference="threshold"),
         r"mod_layout=sublayer only applies to mod=router; remove --mod_layout"),
    ]:
        with pytest.raises(ValueError, match=message):
            GPTConfig(**{**base, **kw})


# -----------------------------------------------------------------------------
# eval routing: the predictor

def test_eval_routing_follows_the_predictor_not_the_threshold(monkeypatch):
    model = model_fp64(mod_inference="predictor", mod_every=2)
    idx = torch.randint(0, V, (2, T))
    train_logits(model, torch.randint(0, V, (4, T)))  # sets tau too
    with torch.no_grad():
        for p in model.mod.predictors.parameters():
            p.normal_()  # a predictor that keeps some tokens and not others
    seen = spy_routes(monkeypatch, model)
    model.eval()
    with torch.no_grad():
        by_predictor = executed_fraction(model(idx, idx, executed=True)[2], idx.numel())
        for l, route, _, x in seen:
            if l % 4 == 0:  # each routed block's route, made at its attention
                keep = model.mod.predict(x, l // 4) > 0
                assert 0 < keep.sum() < keep.numel()
                assert route.valid is not None or route.idx.size(1) == keep.sum(1).max()
                ran = torch.zeros_like(keep).scatter(1, route.idx, True if route.valid is None else route.valid[..., 0])
                assert torch.equal(ran, keep)
        assert by_predictor[2:4] == [1.0, 1.0] and by_predictor[6:] == [1.0, 1.0]
        model.mod.predictors[0][-1].bias.fill_(1e6)  # block 0: every token predicted in the top-k
        model.mod.predictors[1][-1].bias.fill_(-1e6)  # block 2: none
        assert executed_fraction(model(idx, idx, executed=True)[2], idx.numel()) == [1.0] * 4 + [0.0, 0.0, 1.0, 1.0]
        model.mod.inference = "threshold"  # the same model routed by tau instead
        assert executed_fraction(model(idx, idx, executed=True)[2], idx.numel()) != [1.0] * 4 + [0.0, 0.0, 1.0, 1.0]


def test_the_predictor_loss_leaves_the_model_gradients_and_loss_alone():
    idx, y = torch.randint(0, V, (4, T)), torch.randint(0, V, (4, T))
    runs, shared = {}, model_fp64().state_dict()
    for inference in ("threshold", "predictor"):
        model = model_fp64(mod_inference=inference).train()
        model.load_state_dict(shared, strict=False)  # the same weights; the predictor's own on top
        _, loss = model(idx, y)
        loss.backward()
        runs[inference] = model, loss
    (plain, loss0), (pred, loss1) = runs["threshold"], runs["predictor"]
    assert loss1.item() == loss0.item()  # the BCE's value is not in the loss
    assert pred.mod.predictor_bce.isfinite().all() and (pred.mod.predictor_bce > 0.1).all()
    for name, p in plain.named_parameters():
        assert torch.equal(p.grad, pred.get_parameter(name).grad), name
    assert all(p.grad.abs().sum() > 0 for p in pred.mod.predictors.parameters())


@pytest.mark.parametrize("inference", ["threshold", "predictor"])
def test_a_short_run_reports_its_eval_skip_rate(inference):
    """A few dozen steps of a tiny router model with the paper's layout: the eval-routing skip rate is
    measured (train.py logs it as exec_eval) and, with the predictor, its BCE falls."""
    torch.manual_seed(0)
    model = GPT(config(mod_every=2, mod_rate=0.25, mod_inference=inference))
    opt = model.configure_optimizers(0.0, 3e-3, (0.9, 0.99))
    data = torch.randint(0, V, (8, T + 1))
    bce = []
    for step in range(40):
        rows = torch.randint(0, 8, (4,))
        _, loss = model(data[rows, :-1], data[rows, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if inference == "predictor":
            bce.append(model.mod.predictor_bce.mean().item())
    model.eval()
    with torch.no_grad():
        frac = executed_fraction(model(data[:, :-1], executed=True)[2], data[:, :-1].numel())
    skipped = 1 - sum(frac) / (2 * L)
    assert 0.0 <= skipped <= 0.5  # routed blocks only: at most half of the pairs (the target is 0.25)
    assert frac[2:4] == [1.0, 1.0]
    if inference == "predictor":
        assert sum(bce[-5:]) / 5 < 0.9 * sum(bce[:5]) / 5, bce


# -----------------------------------------------------------------------------
# the paper's configuration through the rest of the machinery

PAPER = dict(mod_layout="block", mod_every=2, router_weight="raw", mod_inference="predictor")


def test_a_training_step_makes_no_host_sync():
    model = GPT(config(**PAPER, kernels="auto")).train()
    idx = torch.randint(0, V, (2, T))
    with HostReads() as reads:
        _, loss = model(idx, idx)
        loss.backward()
    assert reads.ops == []


def test_the_paper_configuration_compiles_to_one_graph():
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = GPT(config(**PAPER))
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    for step in range(3):
        idx = torch.randint(0, V, (2, T))
        _, loss = compiled(idx, idx)
        loss.backward()
    assert counters["stats"]["unique_graphs"] == 1 and not counters["recompiles"]
    model.eval()
    with torch.no_grad():
        idx = torch.randint(0, V, (3, T))
        logits_c, _, exec_c = compiled(idx, idx, executed=True)
        logits_e, _, exec_e = model(idx, idx, executed=True)
    torch.testing.assert_close(logits_c, logits_e, rtol=1e-5, atol=1e-5)
    assert executed_fraction(exec_c, idx.numel()) == pytest.approx(executed_fraction(exec_e, idx.numel()))
    torch._dynamo.reset()


@pytest.mark.parametrize("residual", ["prenorm", "sandwich", "attnres", "block_attnres"])
def test_kv_cache_sampling_equals_recomputation(residual):
    torch.manual_seed(0)
    model = GPT(config(**PAPER, residual=residual))
    with torch.no_grad():
        for p in model.mod.predictors.parameters():
            p.normal_(0.0, 0.5)  # some tokens routed, some not
    model.eval()
    prompt = torch.randint(0, V, (2, 4))
    with torch.no_grad():
        cached, stats = model.generate(prompt, 10, temperature=0, kv_cache=True, stats=True)
        assert torch.equal(cached, model.generate(prompt, 10, temperature=0, kv_cache=False))
    routed = [e / stats["tokens"] for l, e in enumerate(stats["executed"]) if l in TopKMoD.routed(model.config)]
    assert any(0 < f < 1 for f in routed), routed
