"""Mixture-of-Depths at the model level: routing in training (top-k, in order, original
RoPE positions) and in eval (causal thresholds tau), skipped tokens left exactly as they were and
never read as keys, gradients, the tau EMA and the checkpoint, KV-cache generation, skip-middle's
gated attention, hard skip and controller, and the executed fractions that FLOPs are counted from."""

import pytest
import torch
import torch.nn.functional as F

from model import (GPT, CausalSelfAttention, GPTConfig, KVCache, SkipMiddle, apply_rope, capacity, diagnose, executed_fraction,
                   mask_route, rope_table, topk_route)
from model import MODS, RESIDUALS, TopKMoD, Visibility  # noqa: E402

def pairings():
    """(mod, residual, extra config) for every pairing the registries allow (a residual mode's `mods`);
    block_attnres with 2 blocks of 1 layer, so that a write lands in a running partial sum as well
    as in a finished block."""
    return [(m, r, {"attnres_blocks": 2} if "attnres_blocks" in cls.options else {})
            for m in MODS if MODS[m] for r, cls in RESIDUALS.items() if m in cls.mods]


PAIRS = pairings()
ROUTED = [p for p in PAIRS if issubclass(MODS[p[0]], TopKMoD)]  # top-k routing: nag, router
GATED = [p for p in PAIRS if not issubclass(MODS[p[0]], TopKMoD)]  # skip_middle's gates
FIRST = [next(p for p in PAIRS if p[0] == m) for m in dict.fromkeys(p[0] for p in PAIRS)]  # one pairing per mod


def config(mod, residual, **kw):
    args = dict(block_size=16, vocab_size=65, n_layer=2, n_head=2, n_embd=32, residual=residual, mod=mod,
                mod_rate=0.0 if mod == "none" else 0.5)
    args.update(kw)
    return GPTConfig(**args)


def routed_model(mod, residual, seed=0, **kw):
    """A small model with every parameter of its residual mode off init (its perturb(): an identity or
    zero init hides a wrong write), whose routing scores are spread well apart (so float noise between
    two ways of computing the same thing never flips a routing decision), with eval thresholds set by
    training forwards (top-k routers) or producers that saturate some tokens' gates (skip_middle)."""
    torch.manual_seed(seed)
    model = GPT(config(mod, residual, **kw))
    model.stream.perturb(0.2, torch.Generator().manual_seed(seed))
    with torch.no_grad():
        if mod == "nag":  # m = mean of sigmoids ~ 0.5 +- 0.005 at init: spread it
            for m in model.stream.modulators:
                m.proj.weight.mul_(20)
        if mod == "skip_middle":  # s ~ ReLU(N(0, 3.4)): gates 1, in (0, 1) and exactly 0
            for p in model.mod.producers:
                p.weight.mul_(30)
        if mod in ("nag", "router"):
            model.train()
            model(torch.randint(0, 65, (4, model.config.block_size)))  # tau = mean k-th score
    return model.eval()


def spy_routes(monkeypatch, model):
    """Record (l, route, ctx, x) for every routed sublayer of the forward passes that follow (x: what
    the sublayer reads)."""
    seen, route = [], model.mod.route

    def spy(stream, state, x, l, ctx):
        r = route(stream, state, x, l, ctx)
        seen.append((l, r, ctx, x))
        return r
    monkeypatch.setattr(model.mod, "route", spy)
    return seen


def kept(route, B, T):
    """[B, T] bool: the tokens that ran the sublayer (route None or without idx: all of them)."""
    if route is None or route.idx is None:
        return torch.ones(B, T, dtype=torch.bool)
    valid = torch.ones_like(route.idx, dtype=torch.bool) if route.valid is None else route.valid.squeeze(-1)
    return torch.zeros(B, T, dtype=torch.bool).scatter(1, route.idx, valid)


def kept_masks(seen, B, T):
    """[2L, B, T]: per sublayer, the tokens that ran it, from spy_routes' record of one forward."""
    return torch.stack([kept(r, B, T) for _, r, *_ in seen])


# -----------------------------------------------------------------------------
# config errors name the fix

@pytest.mark.parametrize("kwargs, message", [
    (dict(mod="nag", residual="prenorm"), "mod=nag does not work with residual=prenorm; use mod=router, or residual=nag"),
    (dict(mod="router", residual="nag"), "mod=router does not work with residual=nag; use mod=nag, or residual=prenorm or sandwich"),
    (dict(mod="skip_middle", residual="prenorm"), "use mod=router, or residual=sandwich"),
    (dict(mod="skip_middle", residual="sandwich", n_layer=3), "n_layer must be even"),
    (dict(mod="moe", residual="prenorm"), r"unknown mod 'moe'; valid: none, nag, router, skip_middle"),
    (dict(mod="none", residual="prenorm", mod_rate=0.5), "needs a mod: set --mod=nag"),
    (dict(mod="router", residual="prenorm", mod_rate=1.0), r"mod_rate must be in \[0, 1\)"),
    (dict(mod="router", residual="prenorm", mod_rate=-0.1), r"mod_rate must be in \[0, 1\)"),
    (dict(mod="router", residual="prenorm", skip_target=0.3), "skip_target=0.3 only applies to mod=skip_middle; remove --skip_target"),
    (dict(mod="skip_middle", residual="sandwich", skip_target=1.5), r"skip_target must be in \[0, 1\]"),
])
def test_bad_mod_config_is_a_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        config(**kwargs)


def test_config_is_checked_again_when_the_model_is_built():
    cfg = config("router", "prenorm")
    cfg.residual = "nag"  # an edit after construction
    with pytest.raises(ValueError, match="use mod=nag, or residual=prenorm"):
        GPT(cfg)


# -----------------------------------------------------------------------------
# training routing: the top-k in original order, at original RoPE positions

def test_capacity():
    assert [capacity(16, r) for r in (0.0, 0.5, 0.3, 0.9, 0.99)] == [16, 8, 12, 2, 1]
    assert capacity(10, 0.7) == 3  # (1 - 0.7) * 10 = 3.0000000000000004 must not round up to 4
    assert TopKMoD.keep_fraction(config("router", "prenorm", mod_rate=0.3)) == 0.75


def test_topk_route_keeps_the_true_top_k_in_order():
    torch.manual_seed(0)
    score = torch.randn(3, 20)
    route, kth = topk_route(score, 7)
    assert route.idx.shape == (3, 7) and (route.idx.diff(dim=1) > 0).all()  # ascending: original order
    for b in range(3):
        assert set(route.idx[b].tolist()) == set(score[b].argsort(descending=True)[:7].tolist())
    assert torch.equal(kth, score.sort(dim=1, descending=True).values[:, 6])
    assert torch.equal(route.score.squeeze(-1), score.gather(1, route.idx))
    assert route.executed == 21 and route.valid is None


def test_mask_route_pads_rows_after_their_kept_tokens():
    keep = torch.tensor([[1, 0, 1, 1, 0, 0], [0, 0, 0, 1, 0, 0]], dtype=torch.bool)
    route = mask_route(keep, torch.arange(12.0).view(2, 6))
    assert route.idx.tolist() == [[0, 2, 3], [3, 0, 1]]  # kept tokens in order, then padding
    assert route.valid.squeeze(-1).tolist() == [[True, True, True], [True, False, False]]
    assert route.executed == 4
    assert route.score.squeeze(-1).tolist() == [[0, 2, 3], [9, 6, 7]]
    assert mask_route(torch.ones(2, 6, dtype=torch.bool)).idx is None  # everyone: the dense path
    same = mask_route(torch.tensor([[1, 0, 1], [0, 1, 1]], dtype=torch.bool))
    assert same.valid is None and same.idx.tolist() == [[0, 2], [1, 2]]
    nobody = mask_route(torch.zeros(2, 3, dtype=torch.bool))
    assert nobody.idx.shape == (2, 0) and nobody.executed == 0
    # one row (generation's path): the same tokens and scores as that row of a batch, no padding
    for row in keep:
        one = mask_route(row[None], torch.arange(6.0)[None])
        assert one.valid is None and one.idx.tolist() == [row.nonzero().flatten().tolist()]
        assert one.executed == int(row.sum()) and one.score.flatten().tolist() == row.nonzero().flatten().tolist()
    assert mask_route(torch.ones(1, 6, dtype=torch.bool)).idx is None
    assert mask_route(torch.zeros(1, 1, dtype=torch.bool)).idx.shape == (1, 0)


def rotate(x, pos):
    """RoPE written out independently of model.py: x [B, k, nh, hd] at positions pos [B, k]."""
    hd = x.size(-1)
    inv_freq = 10000.0 ** (-torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    angle = pos[:, :, None, None].float() * inv_freq
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()), -1).flatten(-2)


def attention_at(attn, xs, pos):
    """attn on the sequence xs [B, k, C] whose tokens sit at positions pos: causal in sequence order."""
    B, k, C = xs.shape
    q, key, v = attn.c_attn(xs).view(B, k, 3, attn.n_head, C // attn.n_head).unbind(2)
    q, key = rotate(q, pos), rotate(key, pos)
    y = F.scaled_dot_product_attention(q.transpose(1, 2), key.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return attn.c_proj(y.transpose(1, 2).reshape(B, k, C))


def test_training_attention_runs_the_kept_tokens_in_order_at_their_own_positions():
    torch.manual_seed(0)
    model = GPT(config("router", "prenorm", block_size=32, router_weight="sigmoid",
                       mod_layout="sublayer")).train()  # one sublayer's route
    attn = model.sublayers[0]
    with torch.no_grad():
        attn.c_attn.weight.mul_(10)  # sharp attention, so positions show in the output
        attn.c_proj.weight.mul_(10)
    B, T, k = 2, 32, 16
    idx = torch.randint(0, 65, (B, T))
    with torch.no_grad():
        x = model.stream.embed(model.wte(idx))
        new = model.sublayer(x, 0, model.new_context(B * T))
        h, _ = model.stream.read(x, 0)
        score = model.mod.routers[0](h).squeeze(-1)
        pos = score.topk(k, dim=1).indices.sort(dim=1).values
        gathered = h.gather(1, pos[..., None].expand(-1, -1, h.size(-1)))
        out = attention_at(attn, gathered, pos)
        write = out * torch.sigmoid(score.gather(1, pos))[..., None]
        expected = x.scatter_add(1, pos[..., None].expand_as(write), write)
        # RoPE rows 0..k-1 (compressed positions) instead of the original ones: another output
        wrong = attention_at(attn, gathered, torch.arange(k).expand(B, k))
    assert not torch.equal(pos, torch.arange(k).expand(B, k))  # the kept tokens have gaps
    torch.testing.assert_close(new, expected, rtol=1e-5, atol=1e-6)
    assert (wrong - out)[:, 1:].abs().amax() > 0.1 * out.abs().amax()


# -----------------------------------------------------------------------------
# skipped tokens: the stream stays exactly as it was, and they are not keys

@pytest.mark.parametrize("train", [True, False], ids=["topk", "tau"])
@pytest.mark.parametrize("mod, residual, kw", PAIRS, ids=lambda v: v if isinstance(v, str) else "")
def test_skipped_tokens_leave_the_stream_bit_identical(monkeypatch, mod, residual, kw, train):
    """The rule in the Residual docstring, on the per-token tensors the mode keeps (its tokens()): after a
    routed sublayer every skipped token is exactly as skip() leaves it, skip() changes nothing the state
    held (it may only append), and every kept token changed."""
    model = routed_model(mod, residual, **kw).train(train)
    stream, seen = model.stream, spy_routes(monkeypatch, model)
    B, T = 2, 16
    idx = torch.randint(0, 65, (B, T))
    with torch.no_grad():
        state = stream.embed(model.wte(idx))
        ctx = model.new_context(B * T)
        for l in range(len(model.sublayers)):
            before = [t.clone() for t in stream.tokens(state)]
            new = model.sublayer(state, l, ctx)
            keep = kept(seen[-1][1], B, T)
            assert seen[-1][0] == l and keep.any() and not keep.all(), f"sublayer {l}: nothing to compare"
            after, skipped = stream.tokens(new), stream.tokens(stream.skip(state, l))
            assert len(after) == len(skipped), f"sublayer {l}: write_kept and skip() leave different layouts"
            for a, s in zip(after, skipped):
                assert torch.equal(a[~keep], s[~keep]), f"sublayer {l} wrote to a skipped token"
            for b, s in zip(before, skipped):
                assert torch.equal(b, s), f"sublayer {l}: skip() changed the stream"
            changed = torch.stack([(a != s).flatten(2).any(-1) for a, s in zip(after, skipped)]).any(0)
            assert changed[keep].all(), f"sublayer {l} left a kept token unchanged"
            state = new


@pytest.mark.parametrize("train", [True, False], ids=["topk", "tau"])
def test_a_skipped_token_is_not_a_key(monkeypatch, train):
    torch.manual_seed(0)
    model = GPT(config("router", "prenorm", mod_inference="threshold")).train(train)
    B, T, C = 2, 16, 32
    score = torch.randn(B, T)
    score[0, 3], score[0, 1] = -5.0, 5.0  # token 3 skips, token 1 runs
    monkeypatch.setattr(model.mod, "score", lambda stream, state, x, l: score)  # routing fixed
    model.mod.tau.fill_(0.0)  # eval: the tokens with a positive score; rows keep different counts
    keep = kept(topk_route(score, 8)[0], B, T) if train else score >= 0
    assert keep[0, 3:].any() and keep[0, 1]
    x = model.wte(torch.randint(0, 65, (B, T)))

    def attention_sublayer(x):
        with torch.no_grad():
            return model.sublayer(x, 0, model.new_context(B * T))

    def nudge(p):
        x2 = x.clone()
        x2[0, p] += torch.randn(C)
        return attention_sublayer(x2)
    base = attention_sublayer(x)
    assert torch.equal(nudge(3)[keep], base[keep])  # no kept token read the skipped token 3
    later = keep[0] & (torch.arange(T) > 1)
    assert not torch.allclose(nudge(1)[0, later], base[0, later])  # kept token 1 is read


# -----------------------------------------------------------------------------
# gradients

@pytest.mark.parametrize("mod, residual, kw", FIRST,
                         ids=lambda v: v if isinstance(v, str) else "")
def test_every_parameter_gets_a_gradient_under_routing(mod, residual, kw):
    model = routed_model(mod, residual, **kw).train()
    idx = torch.randint(0, 65, (4, 16))
    _, loss, executed = model(idx, torch.roll(idx, -1, 1), executed=True)
    loss.backward()
    assert min(executed_fraction(executed, idx.numel())) < 1.0  # tokens were skipped
    special = {"nag": "stream.modulators", "router": "mod.routers", "skip_middle": "mod.producers"}[mod]
    names = [name for name, _ in model.named_parameters()]
    assert sum(name.startswith(special) for name in names) >= 2
    for name, p in model.named_parameters():
        if "key_norm_weights" in name:  # AttnRes: no gradient while the depth queries are still 0
            continue
        assert p.grad is not None and p.grad.abs().sum() > 0, f"{name} gets no gradient"


# -----------------------------------------------------------------------------
# tau: an EMA of the k-th score, in the checkpoint

def test_tau_is_the_ema_of_the_kth_score_and_lands_in_the_checkpoint(monkeypatch, tmp_path):
    torch.manual_seed(0)
    model = GPT(config("router", "prenorm")).train()
    assert model.mod.tau.isnan().all()
    scores, score = [], model.mod.score
    monkeypatch.setattr(model.mod, "score", lambda *a: scores.append(score(*a)) or scores[-1])
    expected = None
    with torch.no_grad():
        for _ in range(3):
            scores.clear()
            x = torch.randint(0, 65, (2, 16))
            model(x, x)
            kth = torch.stack([s.topk(8, dim=1).values[:, -1].mean() for s in scores])
            expected = kth if expected is None else 0.99 * expected + 0.01 * kth
            torch.testing.assert_close(model.mod.tau, expected)
        tau = model.mod.tau.clone()
        assert tau.isfinite().all()
        diagnose(model, x)  # neither diagnostics nor eval passes move tau
        model.eval()(x)
        assert torch.equal(model.mod.tau, tau)
    assert "mod.tau" in model.state_dict()
    torch.save({"model": model.state_dict()}, tmp_path / "ckpt.pt")
    fresh = GPT(config("router", "prenorm"))
    fresh.load_state_dict(torch.load(tmp_path / "ckpt.pt")["model"])
    assert torch.equal(fresh.mod.tau, tau)
    fresh.eval()
    x = torch.randint(0, 65, (2, 16))
    (fresh_logits, _, fresh_ran), (logits, _, ran) = fresh(x, x, executed=True), model(x, x, executed=True)
    torch.testing.assert_close(fresh_logits, logits, rtol=0, atol=0)
    assert executed_fraction(fresh_ran, x.numel()) == executed_fraction(ran, x.numel())
    assert 0 < min(executed_fraction(fresh_ran, x.numel())) < 1


@pytest.mark.parametrize("mod, residual", [("nag", "nag"), ("router", "prenorm")])
def test_mod_rate_zero_runs_every_token_and_is_the_dense_model(mod, residual):
    torch.manual_seed(0)
    model = GPT(config(mod, residual, mod_rate=0.0)).train()
    x = torch.randint(0, 65, (2, 16))
    with torch.no_grad():
        for _ in range(2):
            assert executed_fraction(model(x, x, executed=True)[2], x.numel()) == [1.0] * 4
        assert model.mod.tau.isnan().all()
        model.eval()
        logits, _, executed = model(x, x, executed=True)
        assert executed_fraction(executed, x.numel()) == [1.0] * 4
        dense = GPT(config("none", residual)).eval()
        dense.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("mod.")})
        assert torch.equal(dense(x, x)[0], logits)
        if mod == "nag":  # thresholds that keep everyone: the kept-token write-back is the dense one
            model.mod.tau.fill_(float("-inf"))
            assert torch.equal(model(x, x)[0], logits)


# -----------------------------------------------------------------------------
# eval routing is causal

CAUSAL = PAIRS


@pytest.mark.parametrize("mod, residual, kw", CAUSAL, ids=lambda v: v if isinstance(v, str) else "")
def test_eval_routing_and_logits_do_not_depend_on_future_tokens(monkeypatch, mod, residual, kw):
    model = routed_model(mod, residual, n_layer=4, **kw)
    seen = spy_routes(monkeypatch, model)
    B, T = 2, 16
    idx = torch.randint(0, 65, (B, T))
    with torch.no_grad():
        full, _ = model(idx, idx)
        keep = kept_masks(seen, B, T)
        assert 0.1 < keep.float().mean() < 0.9  # a real share of (token, sublayer) pairs skipped
        for t in (1, 6, 11):
            seen.clear()
            logits, _ = model(idx[:, :t], idx[:, :t])
            assert torch.equal(kept_masks(seen, B, t), keep[..., :t])
            torch.testing.assert_close(logits, full[:, :t], rtol=0, atol=1e-5)
            other = torch.cat((idx[:, :t], torch.randint(0, 65, (B, T - t))), 1)  # another future
            seen.clear()
            logits, _ = model(other, other)
            assert torch.equal(kept_masks(seen, B, T)[..., :t], keep[..., :t])
            torch.testing.assert_close(logits[:, :t], full[:, :t], rtol=0, atol=1e-5)


def test_training_top_k_is_not_causal_which_is_why_eval_uses_tau(monkeypatch):
    model = routed_model("router", "prenorm").train()
    seen = spy_routes(monkeypatch, model)
    idx = torch.randint(0, 65, (2, 16))
    with torch.no_grad():
        model(idx)
        full = kept_masks(seen, 2, 16)
        seen.clear()
        model(idx[:, :8])
    assert not torch.equal(kept_masks(seen, 2, 8), full[..., :8])


# -----------------------------------------------------------------------------
# KV-cache generation

GENERATE = [("none", "prenorm", {}), *PAIRS, ("router", "prenorm", {"mod_inference": "threshold"})]


def cached_logits(model, idx, prefill):
    """Logits at positions prefill-1 .. T-1 from cached_step: prefill tokens at once, then one at a time."""
    caches = [KVCache(model.config.block_size) if l % 2 == 0 else None for l in range(len(model.sublayers))]
    out = [model.cached_step(idx[:, :prefill], caches, 0)[0]]
    for t in range(prefill, idx.size(1)):
        out.append(model.cached_step(idx[:, t:t + 1], caches, t)[0])
    return torch.cat(out, 1)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("mod, residual, kw", GENERATE, ids=lambda v: v if isinstance(v, str) else "")
def test_kv_cache_generation_equals_recomputation(monkeypatch, mod, residual, kw, batch):
    model = routed_model(mod, residual, n_layer=4, **kw) if mod != "none" else GPT(config(mod, residual)).eval()
    prompt = torch.randint(0, 65, (batch, 5))
    routes = spy_routes(monkeypatch, model) if model.mod is not None else []
    with torch.no_grad():
        cached, stats = model.generate(prompt, 11, temperature=0, kv_cache=True, stats=True)
        padded = any(r is not None and r.valid is not None for _, r, *_ in routes)
        full = model.generate(prompt, 11, temperature=0, kv_cache=False)
        assert torch.equal(cached, full)
        assert stats["tokens"] == batch * 15  # the prompt once, then one token per row and step
        if mod != "none":
            frac = sum(stats["executed"]) / (stats["tokens"] * len(model.sublayers))
            assert 0.05 < frac < 0.95, frac  # a real share of (token, sublayer) pairs skipped
        if batch == 2 and mod != "none":
            assert padded  # rows kept different tokens: the padding path ran
        # logits too, not only their argmax
        logits, _ = model(cached[:, :-1], cached[:, :-1])
        torch.testing.assert_close(cached_logits(model, cached[:, :-1], 5), logits[:, 4:], rtol=0, atol=1e-5)


@pytest.mark.parametrize("mod, residual, kw", GENERATE, ids=lambda v: v if isinstance(v, str) else "")
def test_generation_past_block_size_restarts_the_cache(mod, residual, kw):
    model = routed_model(mod, residual, **kw) if mod != "none" else GPT(config(mod, residual)).eval()
    prompt = torch.randint(0, 65, (2, 4))
    torch.manual_seed(1)
    out = model.generate(prompt, 30, temperature=1.0, top_k=10, kv_cache=True)
    assert out.shape == (2, 34) and out.min() >= 0 and out.max() < 65 and torch.equal(out[:, :4], prompt)
    greedy = model.generate(prompt, 30, temperature=0, kv_cache=True)
    # the first restart comes when 16 tokens fill the cache: up to there it is exact recomputation
    assert torch.equal(greedy[:, :17], model.generate(prompt, 13, temperature=0, kv_cache=False))


# -----------------------------------------------------------------------------
# skip_middle

def test_gated_attention_masks_keys_where_the_published_query_axis_does_nothing():
    torch.manual_seed(0)
    attn = CausalSelfAttention(config("none", "prenorm"))  # nn.Linear's default init: attention not flat
    B, T, C = 1, 8, 32
    x, rope = torch.randn(B, T, C), rope_table(16, T)
    with torch.no_grad():
        free = attn(x, rope)[0]
        torch.testing.assert_close(attn(x, rope, Visibility(key_bias=torch.zeros(B, T)))[0], free)
        gate = torch.ones(B, T)
        gate[0, 2], gate[0, 5] = 0.0, 1e-3
        bias = torch.where(gate > 0, gate.clamp(1e-6, 1).log(), float("-inf"))
        gated = attn(x, rope, Visibility(key_bias=bias))[0]
        assert gated.isfinite().all()  # query 2 still sees itself
        torch.testing.assert_close(gated[:, :2], free[:, :2])  # queries before the gated key
        assert (gated[0, 3:] - free[0, 3:]).abs().amax(-1).min() > 1e-3  # every later query changed
        # the same log-gates, by hand, along the key axis (ours) and the query axis (published code)
        qk, v = attn.c_attn(x).view(B, T, 3, 2, 16).split((2, 1), dim=2)
        q, k = apply_rope(qk, rope).unbind(2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.squeeze(2).transpose(1, 2)
        causal = torch.where(torch.ones(T, T, dtype=torch.bool).tril(), 0.0, float("-inf"))
        log_g = gate.clamp(1e-6, 1).log()  # finite: a -inf query row would be NaN

        def out(mask):
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            return attn.c_proj(y.transpose(1, 2).reshape(B, T, C))
        key_axis, query_axis = out(causal + log_g[:, None, None, :]), out(causal + log_g[:, None, :, None])
        torch.testing.assert_close(query_axis, free)  # softmax cancels a per-query constant
        torch.testing.assert_close(key_axis, gated, rtol=1e-4, atol=1e-5)  # log 1e-6 ~ -inf at this scale
        assert (key_axis[0, 3:] - free[0, 3:]).abs().amax(-1).min() > 1e-3


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_skip_middle_hard_skip_equals_the_soft_path(monkeypatch, train):
    model = routed_model("skip_middle", "sandwich", n_layer=4).train(train)
    seen = spy_routes(monkeypatch, model)
    idx = torch.randint(0, 65, (4, 16))
    y = torch.roll(idx, -1, 1)

    def run():
        model.zero_grad()
        logits, loss, executed = model(idx, y, executed=True)
        loss.backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        return logits, loss, grads, executed_fraction(executed, idx.numel())
    hard = run()
    gates = torch.stack(seen[-1][2].gates)
    assert (gates == 0).any() and ((gates > 0) & (gates < 1)).any() and (gates == 1).any()
    assert any(r.idx is not None for _, r, *_ in seen)  # tokens were gathered out
    model.mod.gather = False
    seen.clear()
    soft = run()
    assert all(r.idx is None for _, r, *_ in seen)
    torch.testing.assert_close(hard[0], soft[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hard[1], soft[1], rtol=1e-5, atol=1e-6)
    for name in hard[2]:
        torch.testing.assert_close(hard[2][name], soft[2][name], rtol=1e-4, atol=1e-6, msg=name)
    assert hard[3] == soft[3] and min(hard[3]) < 1.0  # both report the tokens with g > 0
    # the executed fraction is the share of gates above 0, per block (both sublayers of block i
    # and of its mirror L-1-i)
    per_gate = (gates > 0).float().flatten(1).mean(1).tolist()
    assert hard[3] == pytest.approx([per_gate[0]] * 2 + [per_gate[1]] * 4 + [per_gate[0]] * 2)


def test_skip_middle_targets_loss_and_controller_rule():
    assert config("skip_middle", "sandwich", n_layer=4, mod_rate=0.25)  # default target 1 - 2 mod_rate
    torch.testing.assert_close(GPT(config("skip_middle", "sandwich", n_layer=4, mod_rate=0.25)).mod.target,
                               torch.tensor([1.0, 0.5]))
    assert GPT(config("skip_middle", "sandwich", n_layer=4, mod_rate=0.7)).mod.target.tolist() == [1.0, 0.0]
    torch.manual_seed(0)
    model = GPT(config("skip_middle", "sandwich", n_layer=6, skip_target=0.4))
    target = torch.tensor([1.0, 0.7, 0.4])
    torch.testing.assert_close(model.mod.target, target)
    model.after_step()  # no gate statistics yet: nothing moves
    assert not model.mod.lam.any() and not model.mod.mu.any()
    # the loss adds the mean over producers of lam . mean(g) + mu . var(g) (unbiased) of this forward
    # pass's gates (tests/test_fidelity_skip.py checks it against the reference); gate_sums adds up
    idx = torch.randint(0, 65, (2, 16))
    with torch.no_grad():
        _, loss0 = model(idx, idx)
        n, s, sq = model.mod.gate_sums.float()
        mean, var = s / n, (sq / n - (s / n).square()) * n / (n - 1)
        model.mod.lam.copy_(torch.tensor([1.0, 2.0, 3.0]))
        model.mod.mu.copy_(torch.tensor([0.5, -1.0, 2.0]))
        _, loss1 = model(idx, idx)
    torch.testing.assert_close(loss1 - loss0, (model.mod.lam * mean + model.mod.mu * var).mean())
    torch.testing.assert_close(model.mod.gate_sums[0], 2 * n.double())  # two forward passes counted
    # controller: coef += eta (value - target) where they are more than 0.01 apart
    model.mod.lam.zero_(), model.mod.mu.zero_()
    mean = torch.tensor([0.995, 0.9, 0.2], dtype=torch.float64)
    var = target.double() * (1 - target.double()) + torch.tensor([0.0, 0.05, -0.005], dtype=torch.float64)
    model.mod.gate_sums.copy_(torch.stack([torch.ones(3, dtype=torch.float64), mean, var + mean.square()]))
    model.after_step()
    assert not model.mod.gate_sums.any()  # the next step's statistics start from 0
    # (atol far below eta * 0.005, the step a gap inside the tolerance would have taken)
    torch.testing.assert_close(model.mod.lam, SkipMiddle.eta * torch.tensor([0.0, 0.2, -0.2]), rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(model.mod.mu, SkipMiddle.eta * torch.tensor([0.0, 0.05, 0.0]), rtol=1e-5, atol=1e-9)


def test_skip_middle_controller_moves_each_gate_mean_toward_its_target(tmp_path):
    torch.manual_seed(0)
    model = GPT(config("skip_middle", "sandwich", n_layer=4, mod_rate=0.35, skip_target=0.3))
    model.mod.eta = 0.1  # the default 1e-3 is for thousands of steps
    target = model.mod.target
    torch.testing.assert_close(target, torch.tensor([1.0, 0.3]))
    opt = model.configure_optimizers(0.0, 1e-2, (0.9, 0.95))
    idx = torch.randint(0, 65, (4, 16))
    y = torch.roll(idx, -1, 1)
    for step in range(40):
        _, loss = model(idx, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.after_step()
        if step == 0:
            start = (model.mod.gate_mean - target).abs()
    end = (model.mod.gate_mean - target).abs()
    assert (end < start).all(), (start, end)
    assert end[1] < 0.5 * start[1]  # the inner gate travels most of the way
    assert model.mod.lam.abs().min() > 0 and model.mod.mu.abs().min() > 0
    sd = model.state_dict()
    assert {"mod.lam", "mod.mu", "mod.target"} <= set(sd) and "mod.gate_mean" not in sd
    torch.save(sd, tmp_path / "ckpt.pt")
    fresh = GPT(config("skip_middle", "sandwich", n_layer=4, mod_rate=0.35, skip_target=0.3))
    fresh.load_state_dict(torch.load(tmp_path / "ckpt.pt"))
    assert torch.equal(fresh.mod.lam, model.mod.lam) and torch.equal(fresh.mod.mu, model.mod.mu)


# -----------------------------------------------------------------------------
# diagnostics: the executed fraction per sublayer

@pytest.mark.parametrize("rate, keep", [(0.5, 0.5), (0.3, 0.75), (0.9, 0.125)])
def test_diagnostics_report_the_executed_fraction(rate, keep):
    torch.manual_seed(0)
    model = GPT(config("router", "prenorm", mod_rate=rate)).train()
    idx = torch.randint(0, 65, (2, 16))
    rows = diagnose(model, idx)  # training routing: exactly k / T per sublayer
    assert [r["executed"] for r in rows[:-1]] == [keep] * 4 and "executed" not in rows[-1]
    with torch.no_grad():
        assert executed_fraction(model(idx, idx, executed=True)[2], idx.numel()) == [keep] * 4
    model.eval()  # eval routing: the thresholds the training forward just set
    rows = diagnose(model, idx)
    with torch.no_grad():
        frac = executed_fraction(model(idx, executed=True)[2], idx.numel())
    assert [r["executed"] for r in rows[:-1]] == frac
    assert all(0 < f < 1 for f in frac)


def test_diagnostics_of_dense_and_skip_middle_models():
    torch.manual_seed(0)
    idx = torch.randint(0, 65, (2, 16))
    rows = diagnose(GPT(config("none", "prenorm")), idx)
    assert [r["executed"] for r in rows[:-1]] == [1.0] * 4
    model = routed_model("skip_middle", "sandwich", n_layer=4)
    rows = diagnose(model, idx)
    with torch.no_grad():
        frac = executed_fraction(model(idx, executed=True)[2], idx.numel())
    assert [r["executed"] for r in rows[:-1]] == frac
    assert min(frac) < 1.0
