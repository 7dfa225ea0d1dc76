"""Adding a residual mode is one class and one registry line. ReZero (x = x + alpha_l f(x), alpha_l = 0
at init; Bachlechner et al. 2020) is defined here, registered with one line, and put through the
checks every mode gets. The checks are generic: they run on every registered mode as well."""
import os
import sys
from dataclasses import asdict

import pytest
import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import flops  # noqa: E402
import model as model_module  # noqa: E402
from model import GPT, GPTConfig, RMSNorm, Residual  # noqa: E402
from test_flops import counted_flops  # noqa: E402


class ReZero(Residual):
    """x = x + alpha_l f(x), alpha_l = 0 at init, no pre-norm; the head reads RMSNorm(x)."""
    mods, ops = ("router",), ("rms_norm",)

    @staticmethod
    def flops(config):
        return {}  # one scalar multiply per sublayer: not counted

    def __init__(self, config):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(config.n_sublayers))
        self.norm_f = RMSNorm(config.n_embd, config.kernels)

    def embed(self, e):
        return e

    def read(self, x, l):
        return x

    def write(self, x, l, out):
        return x + self.alpha[l].to(x.dtype) * out

    def write_kept(self, x, l, out, route):
        return route.scatter_add(x, route.weigh(self.alpha[l].to(out.dtype) * out))

    def head(self, x, lm_head):
        return lm_head(self.norm_f(x))


@pytest.fixture(autouse=True)
def rezero(monkeypatch):
    monkeypatch.setitem(model_module.RESIDUALS, "rezero", ReZero)  # the one registry line


MODES = [*model_module.RESIDUALS, "rezero"]
SHAPE = dict(block_size=16, vocab_size=65, n_layer=2, n_head=2, n_embd=32)


def make(residual, seed=0, **kw):
    """A model off its init: every parameter of the mode nudged, so no write is exactly zero."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**{**SHAPE, "residual": residual, **kw}))
    with torch.no_grad():
        for p in model.stream.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
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


@pytest.mark.parametrize("residual", MODES)
def test_causal(residual):
    model = make(residual).eval()
    a, b = tokens(seed=1), tokens(seed=2)
    b[:, :9] = a[:, :9]
    (la, _), (lb, _) = model(a, a), model(b, b)
    torch.testing.assert_close(la[:, :9], lb[:, :9], rtol=0, atol=0)
    assert (la[:, 9:] - lb[:, 9:]).abs().max() > 1e-4  # the later tokens do matter


@pytest.mark.parametrize("residual", MODES)
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


@pytest.mark.parametrize("residual", MODES)
def test_kv_cache_generation_equals_recomputation(residual):
    model = make(residual).eval()
    prompt = tokens(T=5)
    cached = model.generate(prompt, 8, temperature=0, kv_cache=True)
    assert torch.equal(cached, model.generate(prompt, 8, temperature=0, kv_cache=False))


@pytest.mark.parametrize("residual", MODES)
def test_flop_counter_equals_the_analytic_count(residual):
    config = GPTConfig(**{**SHAPE, "block_size": 48, "residual": residual, "kernels": "torch"})
    parts = flops.forward_flops(config)
    matmuls = sum(v for k, v in parts.items() if k in flops.matmul_parts(config))
    assert counted_flops(config) == pytest.approx(matmuls, rel=0.02)


def test_a_mode_that_states_no_flops_is_an_error(monkeypatch):
    """An inherited count would silently be another mode's: flops.py refuses it."""
    monkeypatch.setitem(model_module.RESIDUALS, "rezero", type("ReZeroNoFlops", (ReZero,), {}))
    with pytest.raises(ValueError, match="ReZeroNoFlops states no FLOPs"):
        flops.forward_flops(GPTConfig(**SHAPE, residual="rezero"))


@pytest.mark.parametrize("residual", MODES)
def test_diagnostics_rows(residual):
    model = make(residual)
    rows = model.diagnostics(tokens())
    assert [r["sublayer"] for r in rows] == list(range(1, 2 * SHAPE["n_layer"] + 2))
    assert [r["kind"] for r in rows] == ["attn", "mlp"] * SHAPE["n_layer"] + ["head"]
    assert all(r["rms"] > 0 for r in rows) and all(r["update"] > 0 for r in rows[:-1])


@pytest.mark.parametrize("residual", MODES)
def test_checkpoint_round_trip(residual, tmp_path):
    model = make(residual).eval()
    torch.save({"model": model.state_dict(), "model_args": asdict(model.config)}, tmp_path / "ckpt.pt")
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    loaded = GPT(GPTConfig(**ckpt["model_args"])).eval()
    loaded.load_state_dict(ckpt["model"])
    idx = tokens()
    torch.testing.assert_close(loaded(idx, idx)[0], model(idx, idx)[0], rtol=0, atol=0)


def dtypes(state):
    """The dtypes of every tensor in a stream state (a tensor, or tuples and lists of them)."""
    if torch.is_tensor(state):
        return {state.dtype}
    return set().union(*(dtypes(s) for s in state)) if isinstance(state, (list, tuple)) else set()


@pytest.mark.parametrize("residual", MODES)
def test_bf16_autocast_keeps_the_stream_dtype(residual, monkeypatch):
    """Under autocast the stream keeps the dtype embed() gave it at every write (a write that
    rounds it to bf16 and back would not show in the final dtype)."""
    model = make(residual)
    seen, write = [], model.stream.write

    def recording_write(state, l, out):
        state = write(state, l, out)
        seen.append(dtypes(state))
        return state

    monkeypatch.setattr(model.stream, "write", recording_write)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        first = dtypes(model.stream.embed(model.wte(tokens())))
        model(tokens(), tokens())
    assert len(seen) == 2 * SHAPE["n_layer"] and all(d == first for d in seen), (first, seen)


def test_rezero_takes_router_mod():
    """The MoD modes a mode declares work with it: a skipped token's stream is left as it was."""
    model = make("rezero", mod="router", mod_rate=0.5, mod_inference="threshold").train()
    idx = tokens()
    _, loss = model(idx, idx)
    loss.backward()
    assert model.stream.alpha.grad.abs().max() > 0 and model.mod.routers[0].weight.grad.abs().max() > 0
    with pytest.raises(ValueError, match="mod=nag does not work with residual=rezero"):
        GPTConfig(**SHAPE, residual="rezero", mod="nag", mod_rate=0.25)
