"""NAG against its reference code, github.com/AlxSp/nag-nanochat (nanochat/nag_gpt.py at commit
5f23a8f, scripts/base_train.py at 0c362cc), in float64; the paper's (Figliolia & Millidge, arXiv
2606.16112) head was not available, so the reference code decides the defaults.

The references below are written from that code's equations, not from model.py: the head as e^s times
the cosine of (mean-centred) W_U rows with r (nag_head=cosine) or as e^(s + g_dec) sqrt(d) times it
(nag_head=sqrt_d), the modulator as max(p, 1e-6) ** beta, and the whole model: the embedding split
into a unit-RMS direction and a log-norm, each sublayer's update centred, made orthogonal to r,
RMS-normalised and added with the tangent a = alpha_l m_l(r), r re-normalised by its RMS, s growing by
1/2 log(1 + a^2). Each compares values and the gradients through them (tests/fidelity.py: the whole
model with its backbone perturbed, every parameter). Then one test per recipe option that fails
without it: the gate group's LR, no weight decay on the modulators, the alpha warm-up, the gate-health
diagnostics."""
import math

import pytest
import torch
import torch.nn.functional as F

import plan
import train
from configurator import ConfigError, configure
from fidelity import assert_same_gradients, perturb_backbone
from model import GPT, NAG, GPTConfig, Modulator, diagnose
from run_config import DEFAULTS

TOL = dict(rtol=1e-5, atol=1e-10)  # float64; the head's RMS epsilon (1e-6) is the only approximation
EPS = 1e-6  # the RMS epsilon of every RMS normalisation here (the update's)


def tiny(**kw):
    args = dict(block_size=8, vocab_size=65, n_layer=2, n_head=2, n_embd=16, residual="nag")
    args.update(kw)
    return GPTConfig(**args)


def random_state(d, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(2, 5, d, generator=g, dtype=torch.float64)
    r = r / r.square().mean(-1, keepdim=True).sqrt()  # unit RMS, as the stream keeps it
    return r, torch.randn(2, 5, 1, generator=g, dtype=torch.float64)


def assert_same_input_gradients(out, reference, inputs, **tol):
    """The gradients of sum(out * w), w a fixed random weight, with respect to the input tensors, through
    out and through the reference (the parameters' are assert_same_gradients')."""
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(0), dtype=out.dtype)
    got = torch.autograd.grad((out * w).sum(), inputs, retain_graph=True)
    want = torch.autograd.grad((reference * w).sum(), inputs, retain_graph=True)
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, **tol, msg=lambda m, i=i: f"grad of input {i}: {m}")


# -----------------------------------------------------------------------------
# the head

def reference_head(form, r, s, w_u, g_dec=0.0):
    """cosine: logits_v = e^s cos(w_v - mean(w_v), r); sqrt_d: e^(s + g_dec) sqrt(d) cos(..)."""
    w = w_u - w_u.mean(-1, keepdim=True)
    cos = F.cosine_similarity(r.unsqueeze(-2), w, dim=-1)
    return torch.exp(s) * cos if form == "cosine" else torch.exp(s + g_dec) * math.sqrt(r.size(-1)) * cos


@pytest.mark.parametrize("form", ["cosine", "sqrt_d"])
def test_head_matches_reference(form):
    """The head's logits equal the reference's to its RMS epsilon (TOL); with W_U's rows scaled up, so
    that the epsilon vanishes, the logits and their gradients with respect to W_U, g_dec (sqrt_d), s and
    the direction equal the reference's in float64 (rtol 1e-8). The direction reaches the head as the
    stream leaves it, normalised to unit RMS (here from r0): the model's head divides by sqrt(d), the
    cosine by |r|, which agree only on unit-RMS r, so only the gradient along that sphere is the
    reference's."""
    torch.manual_seed(0)
    model = GPT(tiny(nag_head=form)).double()
    with torch.no_grad():
        model.lm_head.weight.normal_(0.1, 0.7)  # rows off-centre and not unit RMS: the head must fix both
        if form == "sqrt_d":
            model.stream.g_dec.fill_(0.3)
    r0, s = (t.requires_grad_() for t in random_state(16))
    r = r0 / r0.square().mean(-1, keepdim=True).sqrt()
    torch.testing.assert_close(model.stream.head(NAG.State(r, s), model.lm_head),
                               reference_head(form, r, s, model.lm_head.weight, model.stream.g_dec), **TOL)
    # the gradients with W_U's rows 1000x larger (the same cosines): the epsilon then moves them by < 1e-12
    # (at RMS 0.7 it moves a small element of W_U's gradient by 1e-4 of itself)
    with torch.no_grad():
        model.lm_head.weight.mul_(1000.0)
    logits = model.stream.head(NAG.State(r, s), model.lm_head)
    reference = reference_head(form, r, s, model.lm_head.weight, model.stream.g_dec)
    torch.testing.assert_close(logits, reference, rtol=1e-10, atol=1e-10)
    assert_same_input_gradients(logits, reference, (r0, s), rtol=1e-8, atol=1e-10)
    assert_same_gradients(model, logits, reference)


def test_head_default_is_the_reference_and_sqrt_d_is_sqrt_d_larger():
    assert GPTConfig.nag_head == "cosine"
    cosine, sqrt_d = GPT(tiny()), GPT(tiny(nag_head="sqrt_d"))
    assert "g_dec" not in dict(cosine.stream.named_parameters())  # nag-nanochat has no g_dec
    assert "g_dec" in dict(sqrt_d.stream.named_parameters())
    sqrt_d.load_state_dict(cosine.state_dict(), strict=False)
    r, s = (t.float() for t in random_state(16))
    torch.testing.assert_close(sqrt_d.stream.head(NAG.State(r, s), sqrt_d.lm_head),
                               4.0 * cosine.stream.head(NAG.State(r, s), cosine.lm_head))  # sqrt(16) at g_dec = 0


@pytest.mark.parametrize("kw, needle", [(dict(nag_head="d"), "unknown nag_head 'd'; valid: cosine, sqrt_d"),
                                        (dict(nag_m_floor=1.0), "nag_m_floor must be in [0, 1)"),
                                        (dict(residual="prenorm", nag_head="sqrt_d"),
                                         "nag_head=sqrt_d only applies to residual=nag; remove --nag_head or set"),
                                        (dict(residual="prenorm", nag_m_floor=0.0),
                                         "nag_m_floor=0.0 only applies to residual=nag")])
def test_nag_options_errors(kw, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace("[", r"\[").replace(")", r"\)")):
        tiny(**kw)


# -----------------------------------------------------------------------------
# the modulator's floor

def reference_modulator(r, w, b, c, beta_raw, floor=1e-6):
    p = (torch.softmax(c, 0) * torch.sigmoid(r @ w.T + b)).sum(-1).clamp_min(floor)
    return p.pow(F.softplus(beta_raw)).unsqueeze(-1)


def test_modulator_matches_reference_with_floor():
    """m(r) equals the reference's on both sides of the floor, and so do its gradients with respect to
    w, b, c, beta and r (float64, per element): 0 below the floor, through p ** beta above it."""
    torch.manual_seed(0)
    mod = Modulator(16, 8).double()
    with torch.no_grad():
        mod.proj.weight.normal_(0, 2.0)
        mod.proj.bias.normal_(-15.0, 1.0)  # small sigmoids: p below the floor for some tokens
        mod.mix.normal_(0, 1.0)
        mod.beta_raw.fill_(-0.5)  # beta < 1
    r = (torch.randn(64, 16, dtype=torch.float64) * 3).requires_grad_()
    ref = reference_modulator(r, mod.proj.weight, mod.proj.bias, mod.mix, mod.beta_raw)
    m = mod(r)
    torch.testing.assert_close(m, ref, rtol=1e-12, atol=0)
    assert (mod.mixture(r) == 1e-6).any() and (mod.mixture(r) > 1e-6).any()  # both sides of the floor
    assert_same_input_gradients(m, ref, (r,), rtol=1e-8, atol=1e-10)
    assert_same_gradients(mod, m, ref)


# -----------------------------------------------------------------------------
# the whole model: the stream's update, the modulators and the head together

def reference_logits(model, idx, form, modulated=True):
    """nag-nanochat's forward, from its equations: e centred, r = e / rms(e), s = log rms(e) + g_enc; per
    sublayer l, u = f_l(r) (r read as is: unit RMS already), a = alpha_l m_l(r) (reference_modulator),
    v = the RMS-normalised (eps 1e-6) part of u - mean(u) orthogonal to r, r <- (r + a v) / rms(r + a v)
    (the RMS alone: no 1/sqrt(1 + a^2) first), s <- s + 1/2 log(1 + a^2); the head reference_head.
    modulated=False: a = alpha_l (no modulator; to show that the comparison can fail)."""
    stream, T = model.stream, idx.size(1)
    e = model.wte.weight[idx]
    e = e - e.mean(-1, keepdim=True)
    rms = e.square().mean(-1, keepdim=True).sqrt()
    r, s = e / rms, torch.log(rms) + stream.g_enc
    for l, sublayer in enumerate(model.sublayers):
        u = sublayer(r, model.rope[:T])[0] if l % 2 == 0 else sublayer(r)
        mod = stream.modulators[l]
        m = reference_modulator(r, mod.proj.weight, mod.proj.bias, mod.mix, mod.beta_raw) if modulated else 1.0
        a = stream.alpha[l] * m
        uc = u - u.mean(-1, keepdim=True)
        up = uc - (uc * r).sum(-1, keepdim=True) / (r * r).sum(-1, keepdim=True) * r
        v = up / torch.sqrt(up.square().mean(-1, keepdim=True) + EPS)
        p = r + a * v
        r = p / p.square().mean(-1, keepdim=True).sqrt()
        s = s + 0.5 * torch.log1p(a * a)
    return reference_head(form, r, s, model.lm_head.weight, stream.g_dec)[..., :model.config.vocab_size]


@pytest.mark.parametrize("form", ["cosine", "sqrt_d"])
def test_nag_model_matches_reference(form):
    """The whole residual=nag model against reference_logits, float64, with the backbone perturbed and
    every NAG parameter off its init (alpha, the modulators' w, b, c, beta, g_enc, g_dec): the logits at
    every position and every parameter's gradient, per element (rtol 1e-8, atol 1e-10), so a tangent,
    a modulator or the log-norm's growth under a stop-gradient fails though its logits pass; the
    hand-written backward of the update (kernels.nag_update) is checked on the way. W_U's rows are
    large (RMS ~1000), which leaves the head's RMS epsilon (1e-6) below 1e-12 of the cosine. The same
    reference without the modulators is far off: the update's gate shows in the logits."""
    torch.manual_seed(0)
    model = GPT(tiny(n_layer=3, nag_head=form)).double().eval()
    g = torch.Generator().manual_seed(1)

    def noise(p, std):
        return std * torch.randn(p.shape, generator=g, dtype=torch.float64)
    with torch.no_grad():
        stream = model.stream
        stream.alpha.mul_(0.5 + torch.rand(stream.alpha.shape, generator=g, dtype=torch.float64))
        for mod in stream.modulators:
            mod.proj.weight.copy_(noise(mod.proj.weight, 16 ** -0.5))  # sigmoids that vary from token to token
            mod.proj.bias.copy_(noise(mod.proj.bias, 1.0))
            mod.mix.copy_(noise(mod.mix, 1.0))
            mod.beta_raw.add_(noise(mod.beta_raw, 0.5))
        stream.g_enc.fill_(0.2)
        stream.g_dec.fill_(-0.3 if form == "sqrt_d" else 0.0)  # cosine: a buffer, 0 (the reference has none)
        model.lm_head.weight.copy_(100.0 + noise(model.lm_head.weight, 1000.0))  # off-centre rows
    perturb_backbone(model, seed=2)  # blocks that move the stream, so a wrong update shows
    assert model.stream.alpha_scale.item() == 1.0  # no warm-up
    idx = torch.randint(0, 65, (2, 8), generator=g)
    logits = model(idx, idx)[0]
    reference = reference_logits(model, idx, form)
    torch.testing.assert_close(logits, reference, rtol=1e-10, atol=1e-10)
    with torch.no_grad():
        assert (logits - reference_logits(model, idx, form, modulated=False)).abs().max() > 1e-2
    assert_same_gradients(model, logits, reference)


@pytest.mark.parametrize("floor, finite", [(1e-6, True), (0.0, False)])
def test_floor_keeps_the_gradient_finite_at_p_zero(floor, finite):
    """sigmoid underflows to 0 (fp64: below -745): 0 ** beta, beta < 1, has an infinite derivative, and
    inf * sigmoid'(= 0) is NaN. nag-nanochat's NaN run; the clamp fixes it."""
    model = GPT(tiny(nag_m_floor=floor)).double()
    mod = model.stream.modulators[0]
    with torch.no_grad():
        mod.proj.bias.fill_(-1000.0)
        mod.beta_raw.fill_(-0.5)
    idx = torch.randint(0, 65, (2, 8))
    _, loss = model(idx, idx)
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    assert bool(torch.isfinite(grads).all()) == finite


# -----------------------------------------------------------------------------
# the optimiser recipe: the gate group's LR, no decay on the modulators

def group_of(opt, p):
    return next(g for g in opt.param_groups if any(q is p for q in g["params"]))


def test_gate_group_lr_scale():
    """nag_gate_lr_scale: alpha and every modulator parameter (nag-nanochat's alphas, betas, coefs,
    m_downs) in one group whose LR is the scheduled LR times the scale, every step (train.set_lr)."""
    model = GPT(tiny())
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), gate_lr_scale=0.05)
    gates = [model.stream.alpha, *model.stream.modulators.parameters()]
    group = group_of(opt, model.stream.alpha)
    assert len(group["params"]) == len(gates) and all(group_of(opt, p) is group for p in gates)
    assert group["weight_decay"] == 0.0 and group["lr_scale"] == 0.05
    train.set_lr(opt, 4e-4)
    assert group["lr"] == pytest.approx(2e-5)
    assert all(g["lr"] == 4e-4 for g in opt.param_groups if g is not group)
    assert group_of(opt, model.stream.g_enc)["lr"] == 4e-4  # g_enc: not a gate (its own group in the reference)
    # the default: no group of its own, every group at the scheduled LR (checkpoints keep their two groups)
    opt = GPT(tiny()).configure_optimizers(0.1, 1e-3, (0.9, 0.95))
    assert len(opt.param_groups) == 2 and all("lr_scale" not in g for g in opt.param_groups)


def test_modulators_get_no_weight_decay():
    model = GPT(tiny())
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95))
    for mod in model.stream.modulators:
        assert group_of(opt, mod.proj.weight)["weight_decay"] == 0.0
    assert group_of(opt, model.sublayers[0].c_attn.weight)["weight_decay"] == 0.1
    # the ablation switch (train.py's nag_gate_decay): the modulator matrices decay, their biases and alpha do not
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), gate_decay=True)
    for mod in model.stream.modulators:
        assert group_of(opt, mod.proj.weight)["weight_decay"] == 0.1
        assert group_of(opt, mod.proj.bias)["weight_decay"] == 0.0
    assert group_of(opt, model.stream.alpha)["weight_decay"] == 0.0
    with pytest.raises(ValueError, match="gate_decay=True needs gate_lr_scale=1"):
        model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), gate_lr_scale=0.5, gate_decay=True)


def test_nag_recipe_keys_only_apply_to_nag():
    for key, value in (("nag_gate_lr_scale", 0.05), ("nag_alpha_warmup_tokens", 1000)):
        cfg = configure([f"--{key}={value}"], DEFAULTS)
        with pytest.raises(ConfigError, match=f"{key}={value} only applies to residual=nag"):
            train.check_nag_recipe(cfg)
        train.check_nag_recipe({**cfg, "residual": "nag"})
    for cfg in ({**DEFAULTS, "nag_gate_decay": True},
                {**DEFAULTS, "residual": "nag", "nag_gate_decay": True, "nag_gate_lr_scale": 0.05}):
        with pytest.raises(ConfigError, match="nag_gate_decay=True applies to residual=nag with nag_gate_lr_scale=1"):
            train.check_nag_recipe(cfg)
    train.check_nag_recipe({**DEFAULTS, "residual": "nag", "nag_gate_decay": True})
    with pytest.raises(ConfigError, match="nag_gate_lr_scale must be a number >= 0"):
        train.check_nag_recipe({**DEFAULTS, "residual": "nag", "nag_gate_lr_scale": -1.0})


# -----------------------------------------------------------------------------
# the alpha warm-up

def test_alpha_warmup_schedule():
    """base_train.py: scale = min(1, step * total_batch_size / warmup_tokens), set before each step's eval
    and training step: 0 at step 0, linear, then 1; 0 tokens: off."""
    def scale(it, warmup_tokens, tokens_per_iter=1000):
        cfg = dict(max_iters=10, warmup_iters=0, lr_decay_iters=None, learning_rate=1e-3, min_lr=None, decay_lr=True,
                   max_flops=None, max_seconds=None, nag_alpha_warmup_tokens=warmup_tokens, init_from="scratch",
                   eval_only=False)
        return plan.RunPlan(cfg, tokens_per_iter, flops_per_token=1.0, verbose=False).alpha_scale(it)
    assert [scale(it, 4000) for it in (0, 1, 3, 9)] == [0.0, 0.25, 0.75, 1.0]
    assert scale(0, 0) == 1.0


def test_alpha_scale_scales_the_tangent():
    """At scale 0 no sublayer rotates r (the stream is the embedding's); at 0.5 every a is halved."""
    torch.manual_seed(0)
    model = GPT(tiny()).double()
    idx = torch.randint(0, 65, (2, 8))
    full = diagnose(model, idx)
    model.stream.alpha_scale.fill_(0.5)
    half = diagnose(model, idx)
    model.stream.alpha_scale.fill_(0.0)
    off = diagnose(model, idx)
    for f, h, o in zip(full[:-1], half[:-1], off[:-1]):
        assert o["gain"] == 0 and o["update"] == pytest.approx(0, abs=1e-12)
        assert f["gain"] > 0.1
    assert half[0]["gain"] == pytest.approx(0.5 * full[0]["gain"], rel=1e-12)  # same input r at sublayer 1


def test_trainer_sets_the_alpha_warmup(data_dir, tmp_path):
    """Trainer.run sets alpha_scale before every iteration (and eval) from the tokens trained so far."""
    args = [f"--{k}={v}" for k, v in dict(
        dataset="shakespeare_char", data_dir=data_dir, out_dir=tmp_path, device="cpu", dtype="float32",
        n_layer=1, n_head=2, n_embd=16, block_size=16, batch_size=2, gradient_accumulation_steps=1,
        eval_iters=1, eval_interval=100, log_interval=100, max_iters=3, warmup_iters=1, compile=False,
        residual="nag", nag_alpha_warmup_tokens=4 * 2 * 16, nag_gate_lr_scale=0.5).items()]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng():
            trainer = train.Trainer(configure(args, DEFAULTS), args)
            trainer.run()
    finally:
        torch.set_num_threads(threads)
    assert trainer.raw_model.stream.alpha_scale.item() == 0.75  # before iteration 3 (the final eval): 3 / 4
    gate = group_of(trainer.optimizer, trainer.raw_model.stream.alpha)
    assert gate["lr"] == pytest.approx(0.5 * trainer.plan.lr(3))


# -----------------------------------------------------------------------------
# gate health in the diagnostics

def test_diagnostics_floor_fraction_and_dead_branches():
    """Sublayer 1's modulator is forced to the floor exactly for the tokens whose (centred) embedding
    has a positive first feature; sublayer 2's for every token: floor = those fractions, sublayer 2
    is dead (mean |a| < 0.05, nag-nanochat's rule), and the head row counts one dead branch."""
    torch.manual_seed(0)
    model = GPT(tiny()).double()
    with torch.no_grad():
        first, second = model.stream.modulators[0], model.stream.modulators[1]
        first.proj.weight.zero_()
        first.proj.weight[:, 0] = -1e4  # sigmoid(-1e4 r_0) = 0 where r_0 > 0, 1 where r_0 < 0
        second.proj.bias.fill_(-1e4)
    idx = torch.randint(0, 65, (4, 8))
    e = model.wte(idx).double()
    expected = ((e - e.mean(-1, keepdim=True))[..., 0] > 0).double().mean().item()
    assert 0.2 < expected < 0.8
    rows = diagnose(model, idx)
    assert rows[0]["floor"] == pytest.approx(expected)
    assert rows[1]["floor"] == 1.0 and rows[1]["dead"] == 1.0
    assert rows[1]["gain"] == pytest.approx(model.stream.alpha[1].item() * 1e-6)  # beta = 1: a = alpha 1e-6
    assert rows[2]["floor"] == 0.0 and rows[2]["dead"] == 0.0
    assert rows[-1]["kind"] == "head" and rows[-1]["dead"] == 1
