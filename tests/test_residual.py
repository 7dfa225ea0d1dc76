"""The residual modes: NAG's geometry, AttnRes's sources and weights, and what every mode
must do (causal, trains, all parameters learn, sampling, diagnostics, clear errors)."""
import copy
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train
from kernels import depth_attention, nag_update
from model import GPT, NAG, RESIDUALS, GPTConfig, Modulator
from model import BlockAttnRes, diagnose  # noqa: E402

MODES = list(RESIDUALS)
REPO = Path(__file__).resolve().parents[1]


def tiny(residual, **kw):
    args = dict(block_size=16, vocab_size=65, n_layer=2, n_head=2, n_embd=32, residual=residual)
    args.update(kw)
    return GPTConfig(**args)


def randomize(model, std=0.3):
    """Move every parameter of the mode (queries, mixing matrices, norm weights, gains) off its init, by
    the mode's own perturb(), so that a test cannot pass just because they are still trivial."""
    model.stream.perturb(std, torch.Generator().manual_seed(1))
    return model


# -----------------------------------------------------------------------------
# nag: the write-back's geometry, in float64

@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_nag_norm_grows_by_sqrt_one_plus_a_squared(scale):
    torch.manual_seed(0)
    stream = NAG(tiny("nag", n_layer=3, n_embd=64)).double()
    e = scale * torch.randn(4, 8, 64, dtype=torch.float64)
    state = stream.embed(e)
    x = stream.value(state, 0)
    # the stream starts as the mean-centred embedding: x = e^s r with g_enc = 0
    torch.testing.assert_close(x, e - e.mean(-1, keepdim=True))
    for l in range(6):
        r = state.direction
        u = 5.0 * torch.randn(4, 8, 64, dtype=torch.float64)  # any sublayer output
        a = stream.tangent(r, l)
        state = stream.write(state, l, u, None)
        x_new = stream.value(state, l + 1)
        ratio = x_new.norm(dim=-1) / x.norm(dim=-1)
        torch.testing.assert_close(ratio, torch.sqrt(1 + a.squeeze(-1) ** 2), rtol=1e-10, atol=0)
        r_new = state.direction
        torch.testing.assert_close(r_new.square().mean(-1), torch.ones(4, 8, dtype=torch.float64))
        # rotation by arctan(a): cos of the angle between r and r_new is 1 / sqrt(1 + a^2)
        cos = (r * r_new).sum(-1) / (r.norm(dim=-1) * r_new.norm(dim=-1))
        torch.testing.assert_close(torch.acos(cos.clamp(-1, 1)), torch.atan(a.squeeze(-1)), rtol=1e-6, atol=1e-6)
        x = x_new


def test_nag_update_is_orthogonal_to_r_and_keeps_unit_rms():
    torch.manual_seed(0)
    d = 48
    r = torch.randn(5, 7, d, dtype=torch.float64)
    r = r - r.mean(-1, keepdim=True)  # the direction is always centred: embed centres, updates are centred
    r = r / r.square().mean(-1, keepdim=True).sqrt()
    u = torch.randn(5, 7, d, dtype=torch.float64) + 3.0 * r + 2.0  # large components along r and 1
    a = torch.rand(5, 7, 1, dtype=torch.float64) * 2
    r_new, log_gain = nag_update(r, u, a, eps=0.0, impl="torch")  # eps = 0: the exact geometry
    step = r_new * torch.sqrt(1 + a * a) - r  # = a v, the written-back part
    assert (step * r).sum(-1).abs().max() < 1e-10 * d  # orthogonal to r
    assert step.mean(-1).abs().max() < 1e-12  # centred
    torch.testing.assert_close(step.square().mean(-1, keepdim=True).sqrt(), a)  # |a v| with rms(v) = 1
    torch.testing.assert_close(r_new.square().mean(-1), torch.ones(5, 7, dtype=torch.float64))
    torch.testing.assert_close(log_gain, 0.5 * torch.log(1 + a * a))
    # a = 0 leaves r alone
    r_same, gain0 = nag_update(r, u, torch.zeros_like(a), impl="torch")
    torch.testing.assert_close(r_same, r)
    assert gain0.abs().max() == 0


def test_nag_init_and_modulator_range():
    config = tiny("nag", n_layer=4)
    stream = NAG(config)
    assert stream.alpha.shape == (8,)
    torch.testing.assert_close(stream.alpha, torch.tensor([1 / math.sqrt(l) for l in range(1, 9)]))
    assert stream.g_enc.item() == 0 and stream.g_dec.item() == 0  # nag_head=cosine: g_dec a constant 0
    mod = stream.modulators[0]
    assert torch.nn.functional.softplus(mod.beta_raw).item() == pytest.approx(1.0)  # beta = 1
    assert mod.proj.weight.shape == (config.nag_channels, config.n_embd)
    # m in [0, 1] also for extreme inputs and a trained-looking (random, large) modulator
    torch.manual_seed(0)
    mod = Modulator(32, 8)
    with torch.no_grad():
        mod.proj.weight.normal_(0, 3.0)
        mod.proj.bias.normal_(0, 3.0)
        mod.mix.normal_(0, 3.0)
        mod.beta_raw.fill_(2.0)
    r = torch.randn(64, 32) * torch.logspace(-3, 3, 64).unsqueeze(-1)
    m = mod(r)
    assert m.shape == (64, 1)
    assert m.min() >= 0 and m.max() <= 1 and m.std() > 0


def test_nag_extra_parameters():
    """C * (d + 2) + 2 per sublayer (modulator w, b, c; alpha and beta), plus g_enc and g_dec
    (nag_head=sqrt_d; the default, cosine, has no g_dec)."""
    config = tiny("nag", n_layer=3, nag_head="sqrt_d")
    base = GPT(tiny("prenorm", n_layer=3))
    prenorm_norms = sum(p.numel() for p in base.stream.parameters())
    nag = GPT(config)
    C, d, n = config.nag_channels, config.n_embd, config.n_sublayers
    extra = sum(p.numel() for p in nag.stream.parameters())
    assert extra == n * (C * (d + 2) + 2) + 2
    assert sum(p.numel() for p in GPT(tiny("nag", n_layer=3)).stream.parameters()) == extra - 1
    assert nag.get_num_params() - base.get_num_params() == extra - prenorm_norms


def test_nag_head_scales_with_log_norm():
    torch.manual_seed(0)
    model = randomize(GPT(tiny("nag", nag_head="sqrt_d"))).double()  # the cosine head: test_fidelity_nag.py
    r = torch.randn(2, 3, 32, dtype=torch.float64)
    r = r / r.square().mean(-1, keepdim=True).sqrt()
    s = torch.randn(2, 3, 1, dtype=torch.float64)
    logits = model.stream.head(NAG.State(r, s), model.lm_head)
    torch.testing.assert_close(model.stream.head(NAG.State(r, s + 0.7), model.lm_head), math.exp(0.7) * logits)
    w_before = model.lm_head.weight.clone()
    w = w_before - w_before.mean(-1, keepdim=True)
    w = w / (w.square().mean(-1, keepdim=True) + 1e-6).sqrt()
    expected = torch.exp(s + model.stream.g_dec) * (r @ w.T) / math.sqrt(32)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-8)
    assert torch.equal(model.lm_head.weight, w_before)  # normalised in the forward pass, not in place


# -----------------------------------------------------------------------------
# attnres / block_attnres

def naive_depth_attention(sources, query, norm_weight, eps=1e-6):
    """The definition, one source at a time."""
    scores = []
    for v in sources:
        normed = v / torch.sqrt(v.square().mean(-1, keepdim=True) + eps) * norm_weight
        scores.append((normed * query).sum(-1))
    weights = torch.softmax(torch.stack(scores), dim=0)
    return sum(w.unsqueeze(-1) * v for w, v in zip(weights, sources)), weights


def test_depth_attention_matches_definition_values_and_grads():
    torch.manual_seed(0)
    S, d = 5, 24
    srcs = (torch.randn(S, 3, 4, d, dtype=torch.float64) * torch.logspace(-1, 1, S, dtype=torch.float64)
            .view(S, 1, 1, 1)).requires_grad_()
    q = torch.randn(d, dtype=torch.float64, requires_grad=True)
    w = (1 + 0.3 * torch.randn(d, dtype=torch.float64)).requires_grad_()
    out = depth_attention(srcs, q, w, impl="torch")
    ref, _ = naive_depth_attention(srcs, q, w)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    grads = torch.autograd.grad((out * g).sum(), (srcs, q, w))
    ref_grads = torch.autograd.grad((ref * g).sum(), (srcs, q, w))
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("residual", ["attnres", "block_attnres"])
def test_depth_weights_are_uniform_at_init(residual):
    torch.manual_seed(0)
    model = GPT(tiny(residual, n_layer=3, attnres_blocks=3 if residual == "block_attnres" else None))
    rows = diagnose(model, torch.randint(0, 65, (2, 16)))
    assert "depth_weights" not in rows[0]  # sublayer 1 reads the embedding only
    for row in rows[1:]:
        w = row["depth_weights"]
        assert w == pytest.approx([1 / len(w)] * len(w), abs=1e-6)


def sources_read(model, idx):
    """How many sources each sublayer (and the head) mixes, from the diagnostics."""
    return [len(r.get("depth_weights", [0])) for r in diagnose(model, idx)]


@pytest.mark.parametrize("n_layer, blocks, counts", [
    (4, 3, [1, 2, 2, 2, 2, 3, 3, 3, 3]),  # L = 4, N = 3: k = ceil(4 / 3) = 2 layers per block, 2 blocks
    (4, 4, [1, 2, 2, 3, 3, 4, 4, 5, 5]),  # N = L: every layer (attention + MLP) is its own block
    (4, 1, [1, 2, 2, 2, 2, 2, 2, 2, 2]),  # one block: the embedding and a running sum
    (2, None, [1, 2, 2, 3, 3]),  # default N = min(8, L) = 2 = L
])
def test_block_partition(n_layer, blocks, counts):
    model = GPT(tiny("block_attnres", n_layer=n_layer, attnres_blocks=blocks))
    assert sources_read(model, torch.zeros(1, 4, dtype=torch.long)) == counts


def test_default_blocks_is_min_8_L():
    assert BlockAttnRes.layers_per_block(tiny("block_attnres", n_layer=16)) == 2  # N = 8 blocks of 2 layers
    assert sum(BlockAttnRes.block_ends(tiny("block_attnres", n_layer=12))) == 6  # N = 8: k = 2, so 6 blocks
    assert BlockAttnRes.layers_per_block(tiny("block_attnres", n_layer=3)) == 1  # N = L = 3


def test_attnres_sources_are_raw_sublayer_outputs_and_the_embedding():
    """Capture what each sublayer receives and returns; sublayer l must receive
    RMSNorm_l(sum_i softmax_i(<q_l, keynorm_l(v_i)>) v_i) over v_0 = embedding and the raw outputs."""
    torch.manual_seed(0)
    model = randomize(GPT(tiny("attnres", n_layer=3))).double().eval()
    inputs, outputs = [], []

    def capture(module, args, out):
        inputs.append(args[0])
        outputs.append(out[0] if isinstance(out, tuple) else out)  # attention: (its output, v1)
    for f in model.sublayers:
        f.register_forward_hook(capture)
    idx = torch.randint(0, 65, (2, 16))
    logits, _ = model(idx, idx)
    stream = model.stream
    sources = [model.wte(idx)]
    for l in range(len(model.sublayers)):
        if l == 0:
            h = sources[0]
        else:
            h, _ = naive_depth_attention(sources, stream.queries[l - 1], stream.key_norm_weights[l - 1])
        torch.testing.assert_close(inputs[l], stream.norms[l](h))
        sources.append(outputs[l])
    h, _ = naive_depth_attention(sources, stream.queries[-1], stream.key_norm_weights[-1])
    torch.testing.assert_close(logits, model.lm_head(stream.norm_f(h))[..., :65])


# -----------------------------------------------------------------------------
# every mode

@pytest.mark.parametrize("residual", MODES)
def test_causal(residual):
    torch.manual_seed(0)
    model = randomize(GPT(tiny(residual))).eval()
    x = torch.randint(0, 65, (2, 16))
    x2 = x.clone()
    x2[:, 9] = (x2[:, 9] + 1) % 65
    a, _ = model(x, x)
    b, _ = model(x2, x2)
    assert torch.equal(a[:, :9], b[:, :9])
    assert not torch.allclose(a[:, 9:], b[:, 9:])


@pytest.mark.parametrize("residual", MODES)
def test_trains_and_every_parameter_gets_a_gradient(residual):
    torch.manual_seed(0)
    model = GPT(tiny(residual))
    init = {name: p.detach().clone() for name, p in model.named_parameters()}
    x = torch.randint(0, 65, (4, 16))
    y = torch.roll(x, -1, dims=1)
    opt = model.configure_optimizers(0.0, 3e-3, (0.9, 0.99))
    losses = []
    for _ in range(30):
        _, loss = model(x, y)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=False)
    assert math.isfinite(losses[0]) and losses[-1] < losses[0] - 1.0, losses
    # (AttnRes key norms get no gradient while the queries are still 0, so look after training)
    _, loss = model(x, y)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad.abs().sum() > 0, f"{residual}: {name} gets no gradient"
        assert not torch.equal(p.detach(), init[name]), f"{residual}: {name} never moved"


@pytest.mark.parametrize("residual", MODES)
def test_loss_at_init_is_sane_and_generate_works(residual):
    torch.manual_seed(0)
    model = GPT(tiny(residual, n_embd=64, n_head=4))
    idx = torch.randint(0, 65, (4, 16))
    _, loss = model(idx, idx)
    # nag's logits start larger (scale e^s ~ 1 and a unit-RMS head), so its loss starts above ln V
    assert abs(loss.item() - math.log(65)) < (1.0 if residual == "nag" else 0.1)
    out = model.generate(idx[:, :3], max_new_tokens=13, temperature=0)
    assert out.shape == (4, 16) and torch.equal(out[:, :3], idx[:, :3])
    # greedy decoding equals the argmax of a full forward pass at each step
    logits, _ = model(out[:, :-1], out[:, :-1])
    torch.testing.assert_close(logits[:, 2:].argmax(-1), out[:, 3:])


@pytest.mark.parametrize("residual", MODES)
def test_diagnostics(residual):
    torch.manual_seed(0)
    model = GPT(tiny(residual, n_layer=3))
    if residual == "nag":  # outputs well above nag_update's eps, so that v has RMS 1 to 1e-4
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("c_proj.weight"):
                    p.mul_(50)
    idx = torch.randint(0, 65, (2, 16))
    rows = diagnose(model, idx)
    assert [r["sublayer"] for r in rows] == list(range(1, 8))
    assert [r["kind"] for r in rows] == ["attn", "mlp"] * 3 + ["head"]
    moved = copy.deepcopy(model)  # off its init: a mode may start by writing nothing (ReZero's alpha = 0)
    moved.stream.perturb(0.2, torch.Generator().manual_seed(0))
    for r in diagnose(moved, idx):
        assert r["rms"] > 0 and math.isfinite(r["rms"])
        assert r["kind"] == "head" or r["update"] > 0 and math.isfinite(r["update"])
    if residual == "prenorm":  # the stream as the forward pass builds it
        x = model.wte(idx)
        for l, f in enumerate(model.sublayers):
            assert rows[l]["rms"] == pytest.approx(x.square().mean().sqrt().item(), rel=1e-5)
            h, _ = model.stream.read(x, l)
            x_new = x + (f(h, model.rope[:16])[0] if l % 2 == 0 else f(h))
            upd = ((x_new - x).norm(dim=-1) / x.norm(dim=-1)).mean().item()
            assert rows[l]["update"] == pytest.approx(upd, rel=1e-5)
            x = x_new
    if residual == "nag":
        for l, r in enumerate(rows[:-1]):
            assert r["alpha"] == pytest.approx(1 / math.sqrt(l + 1))
            assert 0 <= r["m"] <= 1
            assert r["angle"] == pytest.approx(math.atan(r["alpha"] * r["m"]), rel=0.01)
            # x_out - x_in = e^s a v with rms(v) = rms(r) = 1, so the relative update is a = alpha m
            assert r["update"] == pytest.approx(r["alpha"] * r["m"], rel=1e-3)
        # the log-norm lane: the head's RMS is the embedding's times prod sqrt(1 + a^2)
        assert rows[-1]["rms"] > rows[0]["rms"]


# -----------------------------------------------------------------------------
# bad input and checkpoints

def test_unknown_residual_lists_the_valid_ones():
    with pytest.raises(ValueError) as e:
        tiny("postnorm")
    for name in MODES:
        assert name in str(e.value)


@pytest.mark.parametrize("blocks", [0, -1, 3, 2.5])
def test_attnres_blocks_out_of_range(blocks):
    with pytest.raises(ValueError, match=r"attnres_blocks .*\[1, n_layer = 2\]"):
        tiny("block_attnres", attnres_blocks=blocks)


def test_checkpoint_of_one_mode_refuses_another(data_dir, tmp_path):
    out = tmp_path / "out"
    args = dict(dataset="shakespeare_char", data_dir=data_dir, out_dir=out, device="cpu", n_layer=1, n_head=2,
                n_embd=16, block_size=16, batch_size=2, eval_iters=1, eval_interval=2, max_iters=2, final_eval_tokens=256)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with torch.random.fork_rng():
        train.main([f"--{k}={v}" for k, v in args.items()] + ["--residual=prenorm"])
    torch.set_num_threads(threads)
    good = (out / "ckpt.pt").read_bytes()
    cmd = [sys.executable, "train.py"] + [f"--{k}={v}" for k, v in args.items()] + [
        "--init_from=resume", "--residual=nag", "--max_iters=4"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0, r.stderr
    assert "residual='prenorm'" in r.stderr and "'nag'" in r.stderr
    assert (out / "ckpt.pt").read_bytes() == good
    # and the weights themselves cannot be poured into another mode's model
    state = torch.load(out / "ckpt.pt", map_location="cpu", weights_only=True)["model"]
    with pytest.raises(RuntimeError):
        GPT(tiny("nag", n_layer=1, n_embd=16, vocab_size=65)).load_state_dict(state)
