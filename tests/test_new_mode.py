"""Adding a residual mode is one class and one registry line, and a wrong mode fails a generic test.

Two modes are defined here and registered with one line each: ReZero (x = x + alpha_l f(x), alpha_l = 0
at init; Bachlechner et al. 2020) and DepthWeighted, a DenseFormer-style depth-weighted average with a
learned 2-D matrix over depth that starts as prenorm. Both go through the checks every registered mode
gets. Then realistic bugs are planted in DepthWeighted, one at a time, and each is caught by a generic
check with a message that names the problem (test_a_planted_bug_fails_a_generic_check)."""
import collections
import dataclasses
import os
import sys
from dataclasses import asdict
from typing import NamedTuple

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import flops  # noqa: E402
import model as model_module  # noqa: E402
from model import GPT, GPTConfig, RMSNorm, Residual, Route  # noqa: E402
from test_flops import counted_flops  # noqa: E402


class ReZero(Residual):
    """x = x + alpha_l f(x), alpha_l = 0 at init, no pre-norm; the head reads RMSNorm(x)."""
    mods, ops = ("router",), ("rms_norm",)
    vector_flops = ("rezero_scale",)

    @staticmethod
    def flops(config):
        return {"rezero_scale": config.n_embd * config.n_sublayers}  # alpha_l f: a multiply per element

    def __init__(self, config):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(config.n_sublayers))
        self.norm_f = RMSNorm(config.n_embd, config.kernels)

    def embed(self, e):
        return e

    def read(self, x, l):
        return x, None

    def write(self, x, l, out, carry):
        return x + self.alpha[l].to(x.dtype) * out

    def write_kept(self, x, l, out, carry, route):
        return route.scatter_add(x, route.weigh(self.alpha[l].to(out.dtype) * out))

    def head(self, x, lm_head):
        return lm_head(self.norm_f(x))

    def no_decay_parameters(self):
        return []  # alpha is a vector


class DepthWeighted(Residual):
    """A depth-weighted average after every sublayer (DenseFormer's DWA, per sublayer): sublayer l reads
    RMSNorm(Y_l) and adds its output, X_{l+1} = Y_l + f_l, and the stream becomes
    Y_{l+1} = sum_{j <= l+1} alpha[l, j] X_j over X_0 = the embedding and every X since. alpha [2L, 2L+1]
    starts as the identity (alpha[l, l+1] = 1), so the model starts as prenorm. The history grows by one
    per sublayer, skipped or not."""

    class State(NamedTuple):
        y: torch.Tensor  # the stream a sublayer reads
        history: list  # X_0 (the embedding), X_1, ..: the stream after each sublayer's output, before its mix

    mods, ops, starts_as = ("router",), ("rms_norm",), "prenorm"
    vector_flops = ("dwa_mix",)  # a weighted sum over the history: broadcasts, not a matmul

    @staticmethod
    def flops(config):
        return {"dwa_mix": 2 * config.n_embd * sum(l + 2 for l in range(config.n_sublayers))}

    @staticmethod
    def init_alpha(n):
        return torch.diag(torch.ones(n), 1)[:n]  # alpha[l, l + 1] = 1

    def __init__(self, config):
        super().__init__()
        n, d = config.n_sublayers, config.n_embd
        self.norms = nn.ModuleList(RMSNorm(d, config.kernels) for _ in range(n))
        self.norm_f = RMSNorm(d, config.kernels)
        self.alpha = nn.Parameter(self.init_alpha(n))

    def no_decay_parameters(self):
        return [self.alpha]  # mixing weights, as DenseFormer's

    def embed(self, e):
        return self.State(e, [e])

    def read(self, state, l):
        return self.norms[l](state.y), None

    def mix(self, history, l):
        H = torch.stack(history)
        w = self.alpha[l, :len(history)].to(H.dtype)
        return (w.view(-1, *[1] * (H.dim() - 1)) * H).sum(0)

    def write(self, state, l, out, carry):
        history = state.history + [state.y + out]
        return self.State(self.mix(history, l), history)

    def write_kept(self, state, l, out, carry, route):
        x = route.scatter_add(state.y, route.weigh(out))  # a skipped token's X_{l+1} is its Y_l
        history = state.history + [x]
        ran = route.ran(*x.shape[:2], x.device).unsqueeze(-1)
        return self.State(torch.where(ran, self.mix(history, l), state.y), history)

    def skip(self, state, l):
        return self.State(state.y, state.history + [state.y])  # the history still grows: X_{l+1} = Y_l

    def head(self, state, lm_head):
        return lm_head(self.norm_f(state.y))

    def value(self, state, l):
        return state.y

    def tokens(self, state):
        return [state.y, *state.history]


@pytest.fixture(autouse=True)
def new_modes(monkeypatch):
    monkeypatch.setitem(model_module.RESIDUALS, "rezero", ReZero)  # the one registry line
    monkeypatch.setitem(model_module.RESIDUALS, "dwa_sublayer", DepthWeighted)


MODES = list(dict.fromkeys([*model_module.RESIDUALS, "rezero", "dwa_sublayer"]))  # a registered rezero: once
VARIANTS = model_module.VARIANTS  # the options that change what a mode computes, as modes of their own
CASES = MODES + list(VARIANTS)
SHAPE = dict(block_size=16, vocab_size=65, n_layer=2, n_head=2, n_embd=32)


def options(case):
    """The GPTConfig options of a case: a mode's name, or a variant's."""
    return VARIANTS.get(case, {"residual": case})


def make(case, seed=0, **kw):
    """A model off its init: every parameter of the mode moved by its own perturb(), so no write is
    exactly zero and no mixing matrix is the identity."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**{**SHAPE, **options(case), **kw}))
    model.stream.perturb(0.2, torch.Generator().manual_seed(seed))
    return model


def tokens(seed=1, B=2, T=16):
    return torch.randint(0, 65, (B, T), generator=torch.Generator().manual_seed(seed))


def test_rezero_starts_as_the_embedding_through_the_head():
    """alpha = 0: every sublayer's write is 0, so the logits are the head of the embedding."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SHAPE, residual="rezero"))
    idx = tokens()
    logits, _ = model(idx, idx)
    torch.testing.assert_close(logits, model.lm_head(model.stream.norm_f(model.wte(idx))), rtol=0, atol=0)


@pytest.mark.parametrize("residual", CASES)
def test_causal(residual):
    model = make(residual).eval()
    a, b = tokens(seed=1), tokens(seed=2)
    b[:, :9] = a[:, :9]
    (la, _), (lb, _) = model(a, a), model(b, b)
    torch.testing.assert_close(la[:, :9], lb[:, :9], rtol=0, atol=0)
    assert (la[:, 9:] - lb[:, 9:]).abs().max() > 1e-4  # the later tokens do matter


@pytest.mark.parametrize("residual", CASES)
def test_trains_a_step(residual):
    model = make(residual).train()
    opt = model.configure_optimizers(0.1, 1e-2, (0.9, 0.95))
    idx = tokens()
    losses = []
    for _ in range(3):
        _, loss = model(idx, idx)
        opt.zero_grad()
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        assert any(p.grad.abs().max() > 0 for p in model.stream.parameters())  # the mode's own parameters learn
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("residual", CASES)
def test_kv_cache_generation_equals_recomputation(residual):
    model = make(residual).eval()
    prompt = tokens(T=5)
    cached = model.generate(prompt, 8, temperature=0, kv_cache=True)
    assert torch.equal(cached, model.generate(prompt, 8, temperature=0, kv_cache=False))


@pytest.mark.parametrize("residual", CASES)
def test_flop_counter_equals_the_analytic_count(residual):
    config = GPTConfig(**{**SHAPE, "block_size": 48, **options(residual), "kernels": "torch"})
    parts = flops.forward_flops(config)
    matmuls = sum(v for k, v in parts.items() if k in flops.matmul_parts(config))
    assert counted_flops(config) == pytest.approx(matmuls, rel=0.02)


def test_a_mode_that_states_no_flops_is_an_error(monkeypatch):
    """An inherited count would silently be another mode's: flops.py refuses it."""
    monkeypatch.setitem(model_module.RESIDUALS, "rezero", type("ReZeroNoFlops", (ReZero,), {}))
    with pytest.raises(ValueError, match="ReZeroNoFlops states no FLOPs"):
        flops.forward_flops(GPTConfig(**SHAPE, residual="rezero"))


@pytest.mark.parametrize("residual", CASES)
def test_diagnostics_rows(residual):
    model = make(residual)
    rows = model_module.diagnose(model, tokens())
    assert [r["sublayer"] for r in rows] == list(range(1, 2 * SHAPE["n_layer"] + 2))
    assert [r["kind"] for r in rows] == ["attn", "mlp"] * SHAPE["n_layer"] + ["head"]
    assert all(r["rms"] > 0 for r in rows) and all(r["update"] > 0 for r in rows[:-1])


@pytest.mark.parametrize("residual", CASES)
def test_checkpoint_round_trip(residual, tmp_path):
    model = make(residual).eval()
    torch.save({"model": model.state_dict(), "model_args": asdict(model.config)}, tmp_path / "ckpt.pt")
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    loaded = GPT(GPTConfig(**ckpt["model_args"])).eval()
    loaded.load_state_dict(ckpt["model"])
    idx = tokens()
    torch.testing.assert_close(loaded(idx, idx)[0], model(idx, idx)[0], rtol=0, atol=0)


def dtypes(state):
    """The dtypes of every tensor in a stream state (a tensor, or NamedTuples, tuples and lists of them)."""
    if torch.is_tensor(state):
        return {state.dtype}
    return set().union(*(dtypes(s) for s in state)) if isinstance(state, (list, tuple)) else set()


def snapshot(state):
    """What a state holds, as values a later in-place change would alter: each tensor's identity, shape and
    version counter (bumped by every in-place op), each list's length and items, recursively."""
    if torch.is_tensor(state):
        return ("tensor", id(state), tuple(state.shape), state._version)
    if isinstance(state, (list, tuple)):
        return (type(state).__name__, len(state), tuple(snapshot(s) for s in state))
    return (type(state).__name__, id(state))


@pytest.mark.parametrize("residual", CASES)
def test_the_state_names_itself_and_a_read_leaves_it_as_it_was(residual, monkeypatch):
    """A mode's state is one tensor or a NamedTuple of its own (fields that say what they hold), never a
    positional list or tuple, from embed() through every write; and read() changes nothing in it (no
    field set, no list appended to, no tensor changed in place): what a write needs from its read is
    the carry read() returns."""
    model = make(residual)
    read, write, seen = model.stream.read, model.stream.write, []

    def named(state):
        return torch.is_tensor(state) or (isinstance(state, tuple) and hasattr(state, "_fields"))

    def recording_read(state, l):
        before = snapshot(state)
        x, carry = read(state, l)
        seen.append((l, named(state), snapshot(state) == before))
        return x, carry

    def recording_write(state, l, out, carry):
        state = write(state, l, out, carry)
        seen.append((l, named(state), True))
        return state

    monkeypatch.setattr(model.stream, "read", recording_read)
    monkeypatch.setattr(model.stream, "write", recording_write)
    model(tokens(), tokens(2))
    assert len(seen) == 2 * model.config.n_sublayers
    assert all(ok for _, ok, _ in seen), f"{residual}: a state that is not a tensor or a NamedTuple: {seen}"
    assert all(same for _, _, same in seen), f"{residual}: read() changed the state it read: {seen}"


@pytest.mark.parametrize("residual", CASES)
def test_bf16_autocast_keeps_the_stream_dtype(residual, monkeypatch):
    """Under autocast the stream keeps the dtype embed() gave it at every write (a write that
    rounds it to bf16 and back would not show in the final dtype), and a training step's backward runs
    (train.py trains in bf16 autocast on a CPU that computes it): finite gradients for every parameter
    that has one in fp32, and a loss within bf16's rounding of fp32's."""
    model = make(residual)
    seen, write = [], model.stream.write

    def recording_write(state, l, out, carry):
        state = write(state, l, out, carry)
        seen.append(dtypes(state))
        return state

    _, loss32 = model(tokens(), tokens())
    loss32.backward()
    in_fp32 = {n for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    monkeypatch.setattr(model.stream, "write", recording_write)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        first = dtypes(model.stream.embed(model.wte(tokens())))
        _, loss = model(tokens(), tokens())
    assert len(seen) == 2 * SHAPE["n_layer"] and all(d == first for d in seen), (first, seen)
    loss.backward()
    assert abs(loss.item() - loss32.item()) < 0.03 * loss32.item()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(grads) == in_fp32 and all(torch.isfinite(g).all() for g in grads.values()), residual


@pytest.mark.parametrize("residual", ["rezero", "dwa_sublayer"])
def test_the_new_modes_take_router_mod(residual):
    """The MoD modes a mode declares work with it; the others are a one-line error."""
    model = make(residual, mod="router", mod_rate=0.5, mod_inference="threshold").train()
    idx = tokens()
    _, loss = model(idx, idx)
    loss.backward()
    assert model.stream.alpha.grad.abs().max() > 0 and model.mod.routers[0].weight.grad.abs().max() > 0
    with pytest.raises(ValueError, match=f"mod=nag does not work with residual={residual}"):
        GPTConfig(**SHAPE, residual=residual, mod="nag", mod_rate=0.25)


# -----------------------------------------------------------------------------
# the contract's checks: each a function, so that a planted bug can be shown to fail it

def check_starts_as(residual):
    """A mode that declares starts_as = "prenorm" gives prenorm's logits at init with prenorm's backbone
    weights: float64, every RMSNorm eps 0 (a norm removes a scale only up to its eps), to 1e-6 (mhc's
    Sinkhorn eps leaves column sums 1 - 1e-6: 5e-7 in the logits). A mode's options may change what it
    starts as (its stream's starts_as); backbone options (value_residual) are given to both models."""
    opts = options(residual)
    starts_as = GPT(GPTConfig(**SHAPE, **opts)).stream.starts_as
    assert starts_as is None or starts_as in model_module.RESIDUALS, \
        f"{residual}: starts_as={starts_as!r} is not a residual mode"
    if starts_as is None:
        return
    backbone = {k: v for k, v in opts.items() if k != "residual" and k not in model_module.option_owners()}
    models = []
    for config in ({**backbone, "residual": starts_as}, opts):
        torch.manual_seed(0)
        models.append(GPT(GPTConfig(**SHAPE, **config)).double().eval())
    base, other = models
    missing, unexpected = other.load_state_dict(base.state_dict(), strict=False)  # the backbone: base's
    assert all(k.startswith("stream.") for k in missing + unexpected), (missing, unexpected)
    for m in (*base.modules(), *other.modules()):
        if isinstance(m, RMSNorm):
            m.eps = 0.0
    idx = tokens()
    with torch.no_grad():
        want, got = base(idx, idx)[0], other(idx, idx)[0]
    err = (got - want).abs().max().item()
    assert err <= 1e-6, f"{residual} declares starts_as={starts_as!r}, but its logits at init differ " \
                        f"from {starts_as}'s by {err:.3g}: its init is not {starts_as}"


def check_decay(residual):
    """configure_optimizers knows, from the mode's own declarations, which parameters decay (else a
    one-line error), and it decays exactly the Linear/Embedding weights and decay_parameters()."""
    model = make(residual)
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95))
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    stream = model.stream
    for name, p in stream.named_parameters():
        declared = any(p is q for q in stream.decay_parameters())
        linear = any(p is m.weight for m in stream.modules() if isinstance(m, (nn.Linear, nn.Embedding)))
        exempt = any(p is q for q in stream.no_decay_parameters())
        assert (id(p) in decayed) == ((declared or linear) and not exempt and p.dim() >= 2), \
            f"{residual}: stream.{name} {list(p.shape)} {'decays' if id(p) in decayed else 'does not decay'}"


def check_skip(residual):
    """MoD's rule: skip(state, l) leaves the state as write_kept leaves a token that no route keeps, for
    every token, and changes nothing the state already held (it may only append)."""
    model = make(residual)
    if not model.stream.mods:
        pytest.skip(f"{residual} works with no MoD mode: nothing skips a sublayer")
    stream, B, T, d = model.stream, 2, 8, SHAPE["n_embd"]
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        state = stream.embed(model.wte(tokens(T=T)))
        for l in range(len(model.sublayers)):
            _, carry = stream.read(state, l)
            out = torch.randn(B, T, d, generator=g)
            nobody = Route(torch.arange(T).expand(B, T), executed=0, valid=torch.zeros(B, T, 1, dtype=torch.bool))
            nobody.score = torch.rand(B, T, 1, generator=g)  # what a top-k route carries (mod=nag writes with it)
            before = [t.clone() for t in stream.tokens(state)]
            kept = stream.tokens(stream.write_kept(state, l, out, carry, nobody))
            skipped = stream.tokens(stream.skip(state, l))
            assert len(kept) == len(skipped), (
                f"{residual}, sublayer {l}: skip() leaves {len(skipped)} per-token tensors, write_kept() with no "
                f"token kept {len(kept)}: the state carries per-layer work, so the mode must override skip()")
            for i, (a, b) in enumerate(zip(kept, skipped)):
                assert torch.equal(a, b), (f"{residual}, sublayer {l}: skip() and write_kept() with no token kept "
                                           f"differ in tensor {i}: override skip() to do what write_kept does")
            for i, (a, b) in enumerate(zip(before, skipped)):
                assert torch.equal(a, b), f"{residual}, sublayer {l}: skip() changed tensor {i} of the stream"
            state = stream.write(state, l, out, carry)


def check_block_route(residual):
    """MoD's whole-block route (mod=router, mod_layout=block: Route.weigh), on a route that keeps some tokens
    with per-token weights w and carries the block's first write (Route.first): where a mode's block is the sum
    of its two sublayers' writes (checked here, with the block's outputs given: the change of the stream's
    value with outputs (a, m) is the change with (a, 0) plus that with (0, m)), the kept tokens' stream after
    the block is Eq. 1 of Raposo et al., x + w (f(x) - x) with f the dense block, and a skipped token's is x.
    That holds when write_kept hands route.weigh() the whole write (route.weigh(alpha * out)); a mode that
    scales after weigh (alpha * route.weigh(out)) leaves (1 - w)(alpha_attn - alpha_mlp) a behind."""
    model = make(residual).double()
    if "router" not in model.stream.mods:
        pytest.skip(f"{residual} does not work with mod=router")
    stream, (B, T, d) = model.stream, (2, SHAPE["block_size"], SHAPE["n_embd"])
    g = torch.Generator().manual_seed(5)
    a, m = (torch.randn(B, T, d, generator=g, dtype=torch.float64) for _ in range(2))

    def block(state, outs, route=None):  # block 0 (sublayers 0, 1) with the given outputs; the stream after it
        for l, out in enumerate(outs):
            _, carry = stream.read(state, l)
            state = stream.write(state, l, out, carry) if route is None else \
                stream.write_kept(state, l, route.gather(out), carry, route)
        return stream.value(state, 2)

    with torch.no_grad():
        state = stream.embed(model.wte(tokens(T=T)).double())
        x, zero = stream.value(state, 0), torch.zeros_like(a)
        dense = block(state, (a, m))
        if not torch.allclose(dense - x, (block(state, (a, zero)) - x) + (block(state, (zero, m)) - x), atol=1e-12):
            pytest.skip(f"{residual}'s block is not the sum of its sublayers' writes: Eq. 1's x + w f(x) is not its form")
        idx = torch.stack([torch.randperm(T, generator=g)[:T // 2].sort().values for _ in range(B)])
        w = torch.rand(B, T // 2, 1, generator=g, dtype=torch.float64)
        routed = block(state, (a, m), Route(idx, executed=idx.numel(), weight=w, whole_block=True))
    kept = torch.zeros(B, T, dtype=torch.bool).scatter(1, idx, True)
    weight = torch.zeros(B, T, 1, dtype=torch.float64).scatter(1, idx.unsqueeze(-1), w)
    want = x + weight * (dense - x)
    assert torch.allclose(routed[kept], want[kept], rtol=1e-10, atol=1e-10), (
        f"{residual}: a whole-block route's write is not x + w f(x) (max error "
        f"{(routed - want)[kept].abs().max():.3g}): hand route.weigh() the sublayer's whole write, "
        f"route.weigh(alpha * out), not alpha * route.weigh(out)")
    assert torch.equal(routed[~kept], x[~kept]), f"{residual}: a whole-block route moved a token it did not keep"


class ElementCounter(TorchDispatchMode):
    """FLOPs per token of the aten ops that touch the tokens' B T rows: matmuls (mm, bmm, addmm,
    baddbmm: 2 per multiply-add), and the vector work: the multiply-adds of adds, subtractions,
    products, sums and mat-vecs, 1 per element (addcmul and mat-vecs 2). Nonlinearities and divides
    are not FLOPs here, as norms and softmaxes are not in flops.py; paused > 0 stops the count."""
    MATMULS = ("mm", "bmm", "addmm", "baddbmm")
    POINTWISE = {"add": 1, "add_": 1, "sub": 1, "sub_": 1, "rsub": 1, "mul": 1, "mul_": 1, "addcmul": 2}
    REDUCTIONS = {"sum": 1, "mean": 1, "mv": 2, "dot": 2}

    def __init__(self, B, T):
        super().__init__()
        self.B, self.T, self.paused, self.flops = B, T, 0, collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, out)) if torch.is_tensor(t)]
        # a tensor of the tokens' rows has B T rows (B T = 21: no parameter at SHAPE has a multiple of it)
        if self.paused or not any(t.numel() % (self.B * self.T) == 0 and t.numel() > 0 for t in tensors):
            return out
        if name in self.MATMULS:
            a, b = [t for t in args if torch.is_tensor(t)][-2:]
            self.flops["matmul"] += 2 * a.numel() * b.shape[-1]
        elif name in self.POINTWISE:
            self.flops["vector"] += self.POINTWISE[name] * out.numel()
        elif name in self.REDUCTIONS:
            self.flops["vector"] += self.REDUCTIONS[name] * args[0].numel()
        return out


FLOP_SHAPE = {**SHAPE, "n_layer": 4}  # deep enough that a per-block term (scalars: 3d per block) exceeds the slack


def stream_flops(residual, monkeypatch, B=3, T=7):
    """(matmul, vector) FLOPs per token of the mode's embed, reads, writes and head, each sublayer's
    output a given tensor; the norms and the NAG write-back paused (flops.py does not count them)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**FLOP_SHAPE, **options(residual), "kernels": "torch"}))
    model.stream.perturb(0.2, torch.Generator().manual_seed(0))
    counter = ElementCounter(B, T)

    def paused(f):
        def run(*args, **kwargs):
            counter.paused += 1
            try:
                return f(*args, **kwargs)
            finally:
                counter.paused -= 1
        return run
    for op in ("rms_norm", "nag_update"):
        monkeypatch.setattr(model_module, op, paused(getattr(model_module, op)))
    outs = torch.randn(len(model.sublayers), B, T, FLOP_SHAPE["n_embd"])
    with torch.no_grad(), counter:
        state = model.stream.embed(model.wte(torch.randint(0, 65, (B, T))))
        for l in range(len(model.sublayers)):
            _, carry = model.stream.read(state, l)
            state = model.stream.write(state, l, outs[l], carry)
        model.stream.head(state, model.lm_head)
    monkeypatch.undo()
    return counter.flops["matmul"] / (B * T), counter.flops["vector"] / (B * T)


def check_element_flops(residual, monkeypatch):
    """What the mode's stream methods compute beyond prenorm's equals what its flops() declares: the
    matmuls exactly, and the vector terms within a factor of 1.5 plus a slack of 4d + V (the embedding's
    and the head's own normalisation and scale, which flops.py leaves out with the norms). A term left
    out, or filed as a matmul when it is computed as broadcasts (or the reverse), fails."""
    config = GPTConfig(**FLOP_SHAPE, **options(residual))
    parts = flops.mode_flops(config)
    vector_terms = set(model_module.RESIDUALS[config.residual].vector_flops)
    declared_matmul = sum(v for k, v in parts.items() if k not in vector_terms)
    declared_vector = sum(v for k, v in parts.items() if k in vector_terms)
    matmul, vector = (a - b for a, b in zip(stream_flops(residual, monkeypatch), stream_flops("prenorm", monkeypatch)))
    assert matmul == pytest.approx(declared_matmul, rel=1e-6, abs=1e-6), (
        f"{residual}: its stream methods do {matmul:g} matmul FLOPs per token beyond prenorm's, its flops() "
        f"declares {declared_matmul:g} as matmuls (terms {sorted(set(parts) - vector_terms)}): a term is missing, "
        f"or a vector term is not listed in vector_flops")
    slack = 4 * FLOP_SHAPE["n_embd"] + config.padded_vocab_size
    assert declared_vector / 1.5 - slack <= vector <= 1.5 * declared_vector + slack, (
        f"{residual}: its stream methods do {vector:g} vector FLOPs per token beyond prenorm's (adds, products, "
        f"sums, mat-vecs), its flops() declares {declared_vector:g} in vector_flops {sorted(vector_terms)}: "
        f"a term is missing or misfiled")


@pytest.mark.parametrize("residual", CASES)
def test_starts_as_what_it_declares(residual):
    check_starts_as(residual)


@pytest.mark.parametrize("residual", CASES)
def test_weight_decay_is_declared(residual):
    check_decay(residual)


@pytest.mark.parametrize("residual", [r for r in CASES if r != "nag"] + ["nag"])
def test_skip_is_write_kept_with_no_token_kept(residual):
    check_skip(residual)


@pytest.mark.parametrize("residual", CASES)
def test_a_whole_block_route_writes_eq1(residual):
    check_block_route(residual)


def test_scaling_after_weigh_fails_the_block_route_check(monkeypatch):
    """ReZero written the wrong way round, alpha * route.weigh(out): it passes the other checks (a route that keeps
    no token, the dense path), and fails the whole-block route's, by name."""
    def late_scale(self, x, l, out, carry, route):
        return route.scatter_add(x, self.alpha[l].to(out.dtype) * route.weigh(out))
    monkeypatch.setitem(model_module.RESIDUALS, "rezero", type("ReZeroLate", (ReZero,), {"write_kept": late_scale}))
    check_skip("rezero")
    with pytest.raises(AssertionError, match=r"not x \+ w f\(x\).*route.weigh\(alpha \* out\)"):
        check_block_route("rezero")


@pytest.mark.parametrize("residual", CASES)
def test_element_flops_match_the_declared_flops(residual, monkeypatch):
    check_element_flops(residual, monkeypatch)


def test_a_class_that_states_no_no_decay_parameters_is_an_error(monkeypatch):
    """An inherited list would silently decay a matrix the new class added: configure_optimizers refuses."""
    monkeypatch.setitem(model_module.RESIDUALS, "rezero", type("ReZeroInherited", (ReZero,), {}))
    with pytest.raises(ValueError, match=r"ReZeroInherited states no no_decay_parameters\(\)"):
        make("rezero").configure_optimizers(0.1, 1e-3, (0.9, 0.95))


def variant(name, **changes):
    """DepthWeighted with one planted bug (and its own flops(), as flops.py asks of every registered class)."""
    return type(name, (DepthWeighted,), {"flops": vars(DepthWeighted)["flops"], **changes})


PLANTED = {  # the bug, the check that must catch it, the message it must give
    "alpha weight-decayed": (variant("DWADecayed", no_decay_parameters=lambda self: []), check_decay,
                             r"DWADecayed.alpha \[4, 5\] is neither a Linear weight nor in no_decay_parameters"),
    "flops() returns {}": (variant("DWANoFlops", flops=staticmethod(lambda config: {})), check_element_flops,
                           "vector FLOPs per token beyond prenorm's.*declares 0 in vector_flops"),
    "the mix filed as a matmul": (variant("DWAMatmul", vector_flops=()), check_element_flops,
                                  "matmul FLOPs per token beyond prenorm's, its flops.. declares 2816"),
    "skip() the inherited no-op": (variant("DWANoSkip", skip=Residual.skip), check_skip,
                                   "the mode must override skip"),
    "init off by one": (variant("DWAOffByOne", init_alpha=staticmethod(lambda n: torch.eye(n, n + 1))),
                        check_starts_as, "declares starts_as='prenorm', but its logits at init differ"),
    "init a uniform average": (variant("DWAUniform", init_alpha=staticmethod(
        lambda n: torch.tril(torch.ones(n, n + 1), 1) / torch.arange(2, n + 2).unsqueeze(1))),
        check_starts_as, "declares starts_as='prenorm', but its logits at init differ"),
}


@pytest.mark.parametrize("bug", PLANTED)
def test_a_planted_bug_fails_a_generic_check(bug, monkeypatch):
    """Each bug passes silently unless the generic checks above run; each fails one, by name."""
    cls, check, message = PLANTED[bug]
    monkeypatch.setitem(model_module.RESIDUALS, "dwa_sublayer", cls)
    args = (monkeypatch,) if check is check_element_flops else ()
    with pytest.raises((AssertionError, ValueError), match=message):
        check("dwa_sublayer", *args)


def test_help_lists_the_registered_modes(capsys):
    """--help's list of residual modes comes from the registry: a mode added by its registry line is in it."""
    import train
    with pytest.raises(SystemExit):
        train.main(["--help"])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.split()[:1] == ["residual"])
    assert line.endswith("the residual mode: " + " | ".join(MODES)), line


def test_modes_that_share_an_option_declare_it_alike(monkeypatch):
    """GPTConfig has one field per option: two modes may share one (attnres and block_attnres share attnres_query)
    only with the same values; one that declares it otherwise is a TypeError naming both, not a silent first."""
    owners = model_module.option_owners()
    shared = next(o for o, (choices, key, modes) in owners.items() if key == "residual" and choices and len(modes) > 1)
    choices, _, modes = owners[shared]
    monkeypatch.setitem(model_module.RESIDUALS, "alike", type("Alike", (ReZero,), {"options": {shared: choices}}))
    assert model_module.option_owners()[shared][2] == [*modes, "alike"]
    for other in (choices[::-1], None):  # other values, or any value
        monkeypatch.setitem(model_module.RESIDUALS, "alike", type("Unlike", (ReZero,), {"options": {shared: other}}))
        with pytest.raises(TypeError, match=rf"option '{shared}': alike declares .*{modes[0]} declares"):
            model_module.option_owners()


def test_gptconfig_is_written_out_and_each_option_has_its_owner(monkeypatch):
    """GPTConfig is a plain dataclass whose fields are written in its body (not rebuilt at import): every field
    beyond the backbone's is an option a mode declares, and every declared option is a field whose default is
    among the values its mode allows. A mode that declares an option GPTConfig lacks gets a TypeError naming
    the fix; the refusals of an option set for another mode, or outside its values, stay."""
    assert GPTConfig.__bases__ == (object,)
    written = list(GPTConfig.__annotations__)
    assert written == [f.name for f in dataclasses.fields(GPTConfig)]
    backbone = {"block_size", "vocab_size", "n_layer", "n_head", "n_embd", "dropout", "residual", "mod", "mod_rate",
                "kernels", "value_residual"}
    owners = model_module.option_owners()
    assert set(written) - backbone == set(owners), set(written) ^ (backbone | set(owners))
    defaults = {f.name: f.default for f in dataclasses.fields(GPTConfig)}
    for name, (choices, _, _) in owners.items():
        assert choices is None or defaults[name] == choices[0], name
    monkeypatch.setitem(model_module.RESIDUALS, "rezero", type("Opt", (ReZero,), {"options": {"rezero_init": None}}))
    with pytest.raises(TypeError, match=r"residual=rezero declares the option 'rezero_init', which GPTConfig lacks"):
        GPTConfig(residual="rezero")
    monkeypatch.delitem(model_module.RESIDUALS, "rezero")
    with pytest.raises(ValueError, match=r"nag_head=sqrt_d only applies to residual=nag"):
        GPTConfig(nag_head="sqrt_d")
    with pytest.raises(ValueError, match=r"unknown nag_head 'cos'; valid: cosine, sqrt_d"):
        GPTConfig(residual="nag", nag_head="cos")
    with pytest.raises(TypeError, match="unexpected keyword argument 'nag_heads'"):
        GPTConfig(residual="nag", nag_heads="sqrt_d")
