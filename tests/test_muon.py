"""--optimizer=muon: Muon (torch.optim.Muon, optim.py) for the hidden matrices, AdamW for the rest.

A Muon step equals one computed here by hand; the optimizer train.py builds carries every muon_* value of
the configuration, and each of its group's values moves the step; the split comes from the modes'
declarations, checked for every registered residual and MoD mode; a skipped step leaves Muon's state as it
was; resume is bit-exact; DDP matches one process; bad values are one-line errors before out_dir is touched.
(The no-host-sync and exact-skip checks of a training step with Muon are in tests/test_step_sync.py.)"""
import inspect
import math
import os
import statistics
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from model import GPT, MODS, RESIDUALS, GPTConfig  # noqa: E402
from optim import MuonAdamW, SkippingMuon  # noqa: E402
from run_config import DEFAULTS, MUON_KEYS  # noqa: E402
from test_optimizer_keys import build_trainer  # noqa: E402
from test_train import (assert_one_line_error, load_ckpt, read_log, run, run_train_here, tiny_args,  # noqa: E402
                        train_ok)

MUON = dict(lr=0.02, momentum=0.95, weight_decay=0.0, adjust_lr_fn="original")
SHAPE = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=65)


def newton_schulz(G, steps=5):
    """Keller Jordan's quintic Newton-Schulz iteration (a, b, c) = (3.4445, -4.7750, 2.0315), in float64:
    G / ||G||_F, on the wide orientation, then X <- aX + (bA + cA^2)X with A = XX^T."""
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G.double()
    tall = X.size(0) > X.size(1)
    X = X.T if tall else X
    X = X / X.norm().clamp(min=1e-7)
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


def muon_by_hand(p, grads, lr, momentum, weight_decay, adjust):
    """p after one Muon step per gradient in grads: buf <- mu buf + (1 - mu) g (an EMA), Nesterov's
    g + mu (buf - g), orthogonalised; decoupled decay p <- p (1 - lr wd); p <- p - lr' O with lr' the
    adjusted LR: original sqrt(max(1, rows / cols)), match_rms_adamw 0.2 sqrt(max(rows, cols)).
    Also returns the size of the orthogonalised steps, the sum over steps of lr' max |O|."""
    p, buf = p.double().clone(), torch.zeros_like(p, dtype=torch.float64)
    rows, cols = p.shape
    scale = math.sqrt(max(1, rows / cols)) if adjust == "original" else 0.2 * math.sqrt(max(rows, cols))
    size = 0.0
    for g in grads:
        g = g.double()
        buf = momentum * buf + (1 - momentum) * g
        update = newton_schulz(g + momentum * (buf - g))
        p = p * (1 - lr * weight_decay) - lr * scale * update
        size += lr * scale * update.abs().max().item()
    return p, size


@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
def test_a_muon_step_equals_one_by_hand(adjust):
    """Two steps (the second reads the momentum) of a GPT's non-square matrices, with a weight decay large
    enough to see (1 - lr wd = 0.8 a step): tall (q/k/v: 96 x 32, LR x sqrt(3)), wide (the MLP's out:
    32 x 128) and square. Muon orthogonalises in bf16, 2-3% off float64 at most: the tolerance is 5% of
    the orthogonalised step, where a wrong LR adjustment is off by 13% (original vs match_rms_adamw on
    the tall one) to 73% (none), and a missing or coupled decay by over 5 times the tolerance."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SHAPE))
    settings = dict(MUON, weight_decay=10.0, adjust_lr_fn=adjust)
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), muon=settings)
    watched = {"tall": model.sublayers[0].c_attn.weight, "wide": model.sublayers[1].c_proj.weight,
               "square": model.sublayers[0].c_proj.weight}
    assert [tuple(p.shape) for p in watched.values()] == [(96, 32), (32, 128), (32, 32)]
    start = {k: p.detach().clone() for k, p in watched.items()}
    grads = {k: [] for k in watched}
    for step in range(2):
        x = torch.randint(0, 65, (4, 16), generator=torch.Generator().manual_seed(step))
        model(x, x)[1].backward()
        for k, p in watched.items():
            grads[k].append(p.grad.clone())
        opt.step()
        opt.zero_grad(set_to_none=True)
    for k, p in watched.items():
        want, size = muon_by_hand(start[k], grads[k], settings["lr"], settings["momentum"], 10.0, adjust)
        err = (p.detach().double() - want).abs().max().item()
        assert err <= 0.05 * size, f"{k}: Muon's step is {err:.3g} off the hand one (its size {size:.3g})"


# every muon_* key, away from its default here and from torch.optim.Muon's, and the group key it becomes
MUON_VALUES = dict(muon_lr=0.03, muon_momentum=0.85, muon_weight_decay=0.04, muon_adjust_lr="match_rms_adamw")
GROUP_KEY = dict(muon_lr="lr", muon_momentum="momentum", muon_weight_decay="weight_decay",
                 muon_adjust_lr="adjust_lr_fn")


def test_train_pys_optimizer_carries_every_muon_value(data_dir, tmp_path):
    """The optimizer train.py builds (Trainer.build_model: configure_optimizers(..., muon_settings(cfg))) holds
    every muon_* value of the configuration in Muon's group. Each is set away from its default and from
    torch.optim.Muon's, so a value dropped on the way (torch's weight decay 0.1 for the configured one, its
    momentum, its adjust_lr_fn None) fails; the step by hand (above) and the next test show the group's values
    are the ones a step uses."""
    assert set(MUON_VALUES) == set(MUON_KEYS) == {k for k in DEFAULTS if k.startswith("muon_")}
    torch_default = {k: p.default for k, p in inspect.signature(torch.optim.Muon.__init__).parameters.items()}
    for key, value in MUON_VALUES.items():
        assert value != DEFAULTS[key] and value != torch_default[GROUP_KEY[key]], key
    trainer = build_trainer(data_dir, tmp_path / "out", optimizer="muon", **MUON_VALUES)
    (group,) = trainer.optimizer.muon.param_groups
    assert {k: group[GROUP_KEY[k]] for k in MUON_VALUES} == MUON_VALUES
    assert group["lr_scale"] == pytest.approx(MUON_VALUES["muon_lr"] / trainer.cfg["learning_rate"])
    assert {id(p) for p in group["params"]} >= {id(m.weight) for m in trainer.raw_model.sublayers.modules()
                                               if isinstance(m, nn.Linear)}


@pytest.mark.parametrize("key, wrong", [("lr", 0.06), ("momentum", 0.0), ("weight_decay", 10.0),
                                        ("adjust_lr_fn", "original")])
def test_each_muon_group_value_moves_the_step(key, wrong, data_dir, tmp_path):
    """Two Muon steps of train.py's optimizer (MUON_VALUES), from the same start and gradients, with one value
    of its group changed: the parameters move by over 10% of the steps' size (by 42% to 114% here), so the
    step reads the group's values, not a copy made when the optimizer was built."""
    trainer = build_trainer(data_dir, tmp_path / "out", optimizer="muon", **MUON_VALUES)
    muon = trainer.optimizer.muon
    (group,) = muon.param_groups
    params = group["params"]
    start = [p.detach().clone() for p in params]
    gen = torch.Generator().manual_seed(0)
    grads = [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(2)]

    def two_steps():
        muon.state.clear()
        with torch.no_grad():
            for p, p0 in zip(params, start):
                p.copy_(p0)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            muon.step()
        return [p.detach().clone() for p in params]

    configured = two_steps()
    group[key] = wrong
    changed = two_steps()
    size = max((a - b).abs().max().item() for a, b in zip(configured, start))
    moved = max((a - b).abs().max().item() for a, b in zip(changed, configured))
    assert size > 0 and moved > 0.1 * size, (key, moved, size)


def test_a_skipped_muon_step_keeps_parameters_and_momentum():
    """found_inf > 0: parameters and momentum bit-identical (the buffer made on that step is zeros, as
    a fresh Muon's); found_inf == 0: exactly torch.optim.Muon's step."""
    torch.manual_seed(0)
    p, q = nn.Parameter(torch.randn(6, 4)), nn.Parameter(torch.randn(6, 4))
    q.data.copy_(p.data)
    ours, plain = SkippingMuon([p], lr=0.1), torch.optim.Muon([q], lr=0.1)
    for step, bad in enumerate([False, True, False, True]):
        g = torch.randn(6, 4) if not bad else torch.full((6, 4), float("nan"))
        p.grad = g.clone()
        before = (p.detach().clone(), ours.state[p]["momentum_buffer"].clone() if step else None)
        ours.found_inf = torch.tensor(1.0 if bad else 0.0)
        ours.step()
        if bad:
            assert torch.equal(p.detach(), before[0]), step
            assert torch.equal(ours.state[p]["momentum_buffer"], before[1]), step
        else:
            q.grad = g.clone()
            plain.step()
            assert torch.equal(p.detach(), q.detach()), step
            assert torch.equal(ours.state[p]["momentum_buffer"], plain.state[q]["momentum_buffer"]), step


def declared(part, *names):
    """The ids of the parameters part declares in the named declarations."""
    ids = set()
    for name in names:
        if name == "lr_groups" and hasattr(part, name):
            ids |= {id(p) for params, _ in part.lr_groups() for p in params}
        elif hasattr(part, name):
            ids |= {id(p) for p in getattr(part, name)()}
    return ids


def cases():
    """Every registered residual mode, a decayed-alpha dwa and nag's gate groups, and every MoD mode
    on a residual mode it works with."""
    out = [(r, {}) for r in RESIDUALS]
    out += [("dwa", dict(dwa_decay=True)), ("nag", dict(gate_lr_scale=0.05)), ("nag", dict(gate_decay=True))]
    for mod, cls in MODS.items():
        if cls is not None:
            residual = next(r for r, c in RESIDUALS.items() if mod in c.mods)
            out.append((residual, dict(mod=mod, mod_rate=0.5)))
    return out


@pytest.mark.parametrize("residual, options", cases(), ids=lambda c: c if isinstance(c, str) else
                         "-".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_every_parameter_has_one_group_and_mixing_weights_never_muon(residual, options):
    """Generic, for every registered mode: each trainable parameter is in exactly one group of one
    optimizer; Muon has the backbone's attention and MLP matrices (all of them) and 2-D decayed matrices
    only; AdamW has the embedding, the LM head, and everything a mode declares as no-decay, mixing,
    gate or lr-group parameters; a parameter keeps the decay and LR scale it has under AdamW alone."""
    options = dict(options)
    train_keys = {k: options.pop(k) for k in ("gate_lr_scale", "gate_decay") if k in options}
    model = GPT(GPTConfig(**SHAPE, residual=residual, **options))
    args = (0.1, 1e-3, (0.9, 0.95), train_keys.get("gate_lr_scale", 1.0), train_keys.get("gate_decay", False))
    opt = model.configure_optimizers(*args, muon=MUON)
    assert isinstance(opt, MuonAdamW)
    muon = [p for g in opt.muon.param_groups for p in g["params"]]
    adamw = [p for g in opt.adamw.param_groups for p in g["params"]]
    seen = [id(p) for p in muon + adamw]
    trainable = [id(p) for p in model.parameters() if p.requires_grad]
    assert len(seen) == len(set(seen)), "a parameter is in two groups"
    assert set(seen) == set(trainable), "a parameter is in no group"
    names = {id(p): n for n, p in model.named_parameters()}
    in_muon = {id(p) for p in muon}
    for m in model.sublayers.modules():
        if isinstance(m, nn.Linear):
            assert id(m.weight) in in_muon, f"{names[id(m.weight)]} is a hidden matrix, not under Muon"
    for p in muon:
        assert p.dim() == 2 and min(p.shape) > 1, f"{names[id(p)]} {list(p.shape)} under Muon is not a matrix"
    never = {id(model.wte.weight), id(model.lm_head.weight)}
    for part in (model.stream, model.mod):
        if part is not None:
            never |= declared(part, "no_decay_parameters", "mixing_parameters", "gate_parameters", "lr_groups")
    wrong = sorted(names[i] for i in never & in_muon)
    assert not wrong, f"declared mixing weights, gates or embedding/head under Muon: {wrong}"
    # AdamW alone: the same decay and LR scale for every parameter AdamW keeps under Muon
    alone = model.configure_optimizers(*args)
    rule = {id(p): (g["weight_decay"], g.get("lr_scale", 1.0)) for g in alone.param_groups for p in g["params"]}
    for g in opt.adamw.param_groups:
        for p in g["params"]:
            assert (g["weight_decay"], g.get("lr_scale", 1.0)) == rule[id(p)], names[id(p)]


def test_the_schedule_scales_both_optimizers_and_nag_gates_keep_the_references_ratio():
    """train.set_lr's scheduled LR reaches both: Muon's group at muon_lr x (scheduled / peak AdamW LR). With
    learning_rate 1e-3 and muon_lr 0.02, nag's gates (alpha, modulators: AdamW, no decay) train at 0.05 x
    the Muon LR at every point of the schedule, nag-nanochat's relation; nag_gate_lr_scale moves them."""
    import train
    model = GPT(GPTConfig(**SHAPE, residual="nag"))
    gates = {id(p) for p in model.stream.gate_parameters()}
    for scale, ratio in ((1.0, 0.05), (0.5, 0.025)):
        opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), scale, muon=MUON)
        for lr in (1e-3, 4e-4, 1e-4):  # peak, mid-cosine, min_lr
            train.set_lr(opt, lr)
            muon_lr = opt.muon.param_groups[0]["lr"]
            assert muon_lr == pytest.approx(0.02 * lr / 1e-3)
            gate_lrs = [g["lr"] for g in opt.adamw.param_groups for p in g["params"] if id(p) in gates]
            assert len(gate_lrs) == len(gates) and gate_lrs == pytest.approx([ratio * muon_lr] * len(gates))


# -----------------------------------------------------------------------------
# train.py with --optimizer=muon

def test_resume_with_muon_is_bit_exact(data_dir, tmp_path):
    """4 iterations + a resume to 8 == 8 straight, to the bit: weights, Muon's momentum and AdamW's moments."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    train_ok(tiny_args(data_dir, straight, optimizer="muon"))
    train_ok(tiny_args(data_dir, split, optimizer="muon", max_iters=4))
    r = train_ok(tiny_args(data_dir, split, optimizer="muon", init_from="resume"))
    assert "resuming from" in r.stdout and "Muon" in r.stdout
    log = read_log(straight)
    assert log[-1]["val_loss"] < log[0]["val_loss"] - 0.15  # it learns (AdamW's tiny run: 0.2 lower)
    assert [x["val_loss"] for x in read_log(split)] == [x["val_loss"] for x in log]
    a, b = load_ckpt(straight), load_ckpt(split)
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert set(a["optimizer"]) == {"muon", "adamw"}
    for name in ("muon", "adamw"):
        sa, sb = a["optimizer"][name]["state"], b["optimizer"][name]["state"]
        assert sa.keys() == sb.keys() and sa
        for i in sa:
            assert all(torch.equal(sa[i][k], sb[i][k]) for k in sa[i]), (name, i)
    assert all("momentum_buffer" in s for s in a["optimizer"]["muon"]["state"].values())


def test_ddp_with_muon_matches_one_process(data_dir, tmp_path):
    """2 gloo ranks x 1 micro-step == 1 process x 2 micro-steps under Muon: every rank applies the same
    Muon step to the all-reduced gradients."""
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    train_ok(tiny_args(data_dir, single, optimizer="muon", max_iters=4))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py"]
    r = run([*torchrun, *tiny_args(data_dir, ddp, optimizer="muon", max_iters=4)])
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    for a, b in zip(read_log(ddp), read_log(single), strict=True):
        assert abs(a["val_loss"] - b["val_loss"]) <= 1e-5, (a, b)
    w_ddp, w_single = load_ckpt(ddp)["model"], load_ckpt(single)["model"]
    for k in w_single:
        torch.testing.assert_close(w_ddp[k], w_single[k], rtol=0, atol=1e-5)


@pytest.mark.parametrize("override, needles", [
    (dict(optimizer="muon", muon_lr=-0.01), ["muon_lr", "> 0"]),
    (dict(optimizer="muon", muon_lr=0), ["muon_lr", "> 0"]),
    (dict(optimizer="muon", muon_momentum=1.0), ["muon_momentum", "[0, 1)"]),
    (dict(optimizer="muon", muon_momentum=-0.1), ["muon_momentum", "[0, 1)"]),
    (dict(optimizer="muon", muon_weight_decay=-1), ["muon_weight_decay", ">= 0"]),
    (dict(optimizer="muon", muon_adjust_lr="rms"), ["muon_adjust_lr", "match_rms_adamw"]),
    (dict(optimizer="sgd"), ["optimizer", "'muon'"]),
    (dict(muon_lr=0.05), ["muon_lr", "--optimizer=muon"]),
], ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()) if isinstance(v, dict) else "")
def test_bad_muon_values_are_one_line_errors(override, needles, data_dir, tmp_path):
    """Before out_dir is touched: a kept run in it stays byte-identical, and nothing new appears."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "ckpt.pt").write_bytes(b"a kept checkpoint")
    r = run_train_here(tiny_args(data_dir, out, **override))
    assert_one_line_error(r, *needles)
    assert sorted(os.listdir(out)) == ["ckpt.pt"] and (out / "ckpt.pt").read_bytes() == b"a kept checkpoint"


def test_resume_refuses_another_optimizer(data_dir, tmp_path):
    """A Muon run resumed with AdamW (or back) would load the wrong optimizer state: one line, and the
    checkpoint stays as it was."""
    out = tmp_path / "out"
    train_ok(tiny_args(data_dir, out, optimizer="muon", max_iters=2))
    before = (out / "ckpt.pt").read_bytes()
    r = run_train_here(tiny_args(data_dir, out, optimizer="adamw", init_from="resume", max_iters=4))
    assert_one_line_error(r, "optimizer='muon'", "--optimizer=muon")
    assert (out / "ckpt.pt").read_bytes() == before


# -----------------------------------------------------------------------------
# flops.py optimizers: the comparison's table

def result_rows(optimizer, design_args, losses, n_layer=4, budget=5e12, flops_only=False, seeds=None,
                flops_per_token=None):
    """results.csv rows of one cell: a run per loss (seeds 1, 2, ..., or `seeds`)."""
    args = " ".join(filter(None, [design_args, "--optimizer='muon' --muon_lr=0.02" if optimizer == "muon" else ""]))
    return [dict(run=f"r{seed}", cell="c", seed=seed, residual="prenorm", n_layer=n_layer, mod=None, mod_rate=0.0,
                 args=args, status="done", val_loss=loss, flops=budget * 0.9985, train_flops_per_token=flops_per_token,
                 **({} if flops_only else {"budget": budget}))
            for seed, loss in zip(seeds or range(1, len(losses) + 1), losses)]


def table_lines(text, layers=4):
    """{design: its row} of the table of `layers` layers in optimizers_table's text."""
    part = text.split(f"**{layers} layers")[1].split("\n**")[0]
    return {row.split(" | ")[0][2:]: row for row in part.splitlines() if row.startswith("| prenorm")}


def test_optimizers_table_reads_each_gain_under_both():
    """A design 0.1 better under both survives; one better under AdamW only is gone; one better under
    AdamW and worse under Muon is reversed; each Δ a paired t-test on the seeds both cells ran; Muon's own gain
    is Muon's loss minus AdamW's, per design, by Welch's test (different runs), its p raw and BH-adjusted over the
    four designs."""
    import flops
    import stats
    base = [2.00, 2.01, 1.99]
    rows = result_rows("adamw", "", base) + result_rows("muon", "", [1.80, 1.81, 1.79])
    rows += result_rows("adamw", "--value_residual='half'", [1.90, 1.92, 1.88])
    rows += result_rows("muon", "--value_residual='half'", [1.70, 1.72, 1.68])  # -0.1 under both
    rows += result_rows("adamw", "--norm_scaling=True", [1.90, 1.92, 1.88])
    rows += result_rows("muon", "--norm_scaling=True", [1.80, 1.83, 1.77])  # 0 under Muon
    rows += result_rows("adamw", "--value_residual='learned'", [1.90, 1.92, 1.88])
    rows += result_rows("muon", "--value_residual='learned'", [1.90, 1.92, 1.88])  # +0.1 under Muon
    text = flops.optimizers_table(rows)
    line = table_lines(text)
    assert "| survives |" in line["prenorm --value_residual='half'"]
    assert "| n.s. under Muon |" in line["prenorm --norm_scaling=True"]
    assert "| reversed |" in line["prenorm --value_residual='learned'"]
    from scipy import stats as scipy_stats
    p = scipy_stats.ttest_rel([1.90, 1.92, 1.88], base).pvalue  # the three AdamW Δs alike: BH leaves p as it is
    assert f"| -0.1000 (paired t (3); p = {p:.2g}, BH = {p:.2g} *) |" in line["prenorm --value_residual='half'"]
    own = [scipy_stats.ttest_ind(m, a, equal_var=False).pvalue for m, a in (
        ([1.80, 1.81, 1.79], base), ([1.70, 1.72, 1.68], [1.90, 1.92, 1.88]), ([1.80, 1.83, 1.77], [1.90, 1.92, 1.88]),
        ([1.90, 1.92, 1.88], [1.90, 1.92, 1.88]))]  # prenorm, then the designs as the table sorts them
    assert own[0] < 1e-4 and stats.bh(own)[0] < 1e-4  # as the table prints them
    assert line["prenorm"].endswith("| -0.2000 (Welch (3, 3); p < 1e-4, BH < 1e-4 *) |")
    want = stats.fmt_p(stats.bh(own)[1])  # value_residual='half': -0.2 from its own runs
    assert line["prenorm --value_residual='half'"].endswith(f"p = {stats.fmt_p(own[1])}, BH = {want} *) |")
    assert "**4 layers, 5e+12 FLOPs**" in text
    rows += result_rows("adamw", "--norm_scaling=True", [1.9], n_layer=8) + result_rows("adamw", "", base, n_layer=8)
    rows += result_rows("muon", "--norm_scaling=True", [1.7], n_layer=8) + result_rows("muon", "", base, n_layer=8)
    one_seed = [r for r in flops.optimizers_table(rows).split("**8 layers")[1].splitlines() if "norm_scaling" in r]
    assert one_seed[0].endswith("| – | – | – | – |")  # one seed: no test, no verdict


def test_the_verdicts_follow_the_adjusted_p_and_a_summary_counts_every_cell():
    """Two depths, one design: at 4 layers its AdamW gain has raw p < 0.05 but, adjusted with the 8-layer Δ
    (BH over the family of both), not: "n.s. under both", where the raw p would say "n.s. under Muon". The last
    line counts the Δ changes over both tables (2 lower under Muon, 1 higher), and how many have p < 0.05 and
    survive the adjustment. --adjust=holm: Holm's column instead."""
    import flops
    import stats
    base = [2.00, 2.01, 1.99, 2.02]
    rows = result_rows("adamw", "", base) + result_rows("muon", "", [1.80, 1.81, 1.79, 1.82])
    gain4 = [1.98, 1.985, 1.985, 1.99]  # -0.02, -0.025, -0.005, -0.03: raw p ~ 0.04
    rows += result_rows("adamw", "--norm_scaling=True", gain4)
    rows += result_rows("muon", "--norm_scaling=True", [1.80, 1.82, 1.78, 1.82])
    rows += result_rows("adamw", "--value_residual='half'", [2.00, 2.015, 1.985, 2.02])  # AdamW Δ 0, +-0.005: p = 1
    rows += result_rows("muon", "--value_residual='half'", [1.75, 1.77, 1.73, 1.77])  # Muon Δ -0.05, -0.04, ...
    rows += result_rows("adamw", "", base, n_layer=8) + result_rows("muon", "", [1.80, 1.81, 1.79, 1.82], n_layer=8)
    gain8 = [2.01, 2.03, 1.99, 2.02]  # +0.01, +0.02, 0, 0: raw p ~ 0.18
    rows += result_rows("adamw", "--norm_scaling=True", gain8, n_layer=8)
    rows += result_rows("muon", "--norm_scaling=True", [1.75, 1.765, 1.735, 1.77], n_layer=8)
    from scipy import stats as scipy_stats
    raw = [scipy_stats.ttest_rel(g, base).pvalue for g in (gain4, gain8, [2.00, 2.015, 1.985, 2.02])]
    assert raw[0] < 0.05 < stats.bh(raw)[0]
    text = flops.optimizers_table(rows)
    row4 = table_lines(text)["prenorm --norm_scaling=True"]
    assert f"p = {raw[0]:.2g}, BH = {stats.bh(raw)[0]:.2g})" in row4 and "| n.s. under both |" in row4
    assert "3 Δs under AdamW, 3 under Muon, 3 Δ changes, 5 Muon − AdamW" in text
    # Δ changes: norm_scaling at 4 layers, Muon Δ (0, +0.01, -0.01, 0) - AdamW Δ: +0.02, p ~ 0.11; value_residual
    # at 4 layers: -0.05, p ~ 3e-4; norm_scaling at 8 layers, Muon Δ (-0.05, -0.045, -0.055, -0.05) - AdamW Δ:
    # -0.0575, p ~ 3e-4. BH over the 3: the two small ones survive
    assert text.rstrip().endswith("of the 3 design cells with a Δ change, the Δ is lower under Muon than under "
                                  "AdamW (a larger gain, or a smaller loss) in 2 and higher in 1; 2 change test(s) "
                                  "have p < 0.05, 2 of the 3 survive Benjamini-Hochberg (adjusted p < 0.05): "
                                  "prenorm --value_residual='half' at 4 layers, 5e+12 FLOPs, "
                                  "prenorm --norm_scaling=True at 8 layers, 5e+12 FLOPs.")
    holm = flops.optimizers_table(rows, adjust="holm")
    assert ", Holm = " in holm and ", BH" not in holm and "survive Holm (adjusted p < 0.05)" in holm


def test_a_design_run_by_different_code_under_the_two_optimizers_is_flagged():
    """The AdamW and Muon runs of one design, depth and budget with different train FLOPs per token (code
    changed between the sweeps): a note under that table names the design and both values; equal: none."""
    import flops
    base = [2.00, 2.01, 1.99]
    rows = result_rows("adamw", "", base, flops_per_token=5161728.0)
    rows += result_rows("muon", "", [1.80, 1.81, 1.79], flops_per_token=5161728.0)
    rows += result_rows("adamw", "--value_residual='half'", [1.90, 1.92, 1.88], flops_per_token=5358336.0)
    rows += result_rows("muon", "--value_residual='half'", [1.70, 1.72, 1.68], flops_per_token=5359872.0)
    text = flops.optimizers_table(rows)
    notes = [line for line in text.splitlines() if line.startswith("note:")]
    assert notes == ["note: prenorm --value_residual='half': train FLOPs per token 5,358,336 (AdamW runs) against "
                     "5,359,872 (Muon runs): the two optimizers' runs came from different code"]


def test_gain_change_is_the_difference_of_the_two_deltas_with_welch_satterthwaite():
    """(Δ Muon) - (Δ AdamW) over four cells that share no seeds, against the formula written out: se^2 the sum
    of s^2/n, df = se^4 / sum((s^2/n)^2 / (n - 1)), p two-sided from Student's t."""
    import flops
    from scipy import stats
    cells = ([1.70, 1.73, 1.72], [1.75, 1.76, 1.74, 1.75], [1.90, 1.93], [2.00, 2.01, 2.02])
    first = (1, 10, 20, 30)  # no seed in common: each Δ is Welch's
    change = flops.gain_change(*(dict(enumerate(c, f)) for c, f in zip(cells, first)))
    m = [sum(c) / len(c) for c in cells]
    w = [sum((x - mc) ** 2 for x in c) / (len(c) - 1) / len(c) for c, mc in zip(cells, m)]
    want = (m[0] - m[1]) - (m[2] - m[3])
    df = sum(w) ** 2 / sum(wi ** 2 / (len(c) - 1) for wi, c in zip(w, cells))
    assert change["diff"] == pytest.approx(want) and want > 0  # a smaller gain under Muon
    assert change["p"] == pytest.approx(2 * stats.t.sf(want / sum(w) ** 0.5, df))
    assert change["test"] == "Welch-Satterthwaite"
    assert flops.gain_change({1: 1.7}, *(dict(enumerate(c, f)) for c, f in zip(cells[1:], first[1:]))) is None


def test_gain_change_pairs_the_seeds_when_both_deltas_are_paired_on_the_same_ones():
    """All four cells on seeds 1..4: a paired t-test (scipy.stats.ttest_rel) of the per-seed Δ Muon_s against
    Δ AdamW_s. Both Δs paired but on different seeds (the AdamW cells share 1..3 only): the two Δs as
    independent estimates, se^2 = se_muon^2 + se_adamw^2 with the Welch-Satterthwaite df of their n - 1."""
    import flops
    from scipy import stats
    dm, bm = [1.70, 1.73, 1.72, 1.69], [1.75, 1.76, 1.74, 1.75]
    da, ba = [1.90, 1.93, 1.91, 1.88], [2.00, 2.01, 2.02, 1.97]
    s = lambda v, seeds=(1, 2, 3, 4): dict(zip(seeds, v))  # noqa: E731
    change = flops.gain_change(s(dm), s(bm), s(da), s(ba))
    d_muon = [x - y for x, y in zip(dm, bm)]
    d_adamw = [x - y for x, y in zip(da, ba)]
    ref = stats.ttest_rel(d_muon, d_adamw)
    assert change["test"] == "paired t" and change["n"] == 4
    assert change["diff"] == pytest.approx(sum(d_muon) / 4 - sum(d_adamw) / 4)
    assert change["p"] == pytest.approx(ref.pvalue, rel=1e-9)
    change = flops.gain_change(s(dm), s(bm), s(da[:3], (1, 2, 3)), s(ba))  # AdamW's Δ on seeds 1..3
    se = [statistics.stdev(d) / len(d) ** 0.5 for d in (d_muon, d_adamw[:3])]
    diff = sum(d_muon) / 4 - sum(d_adamw[:3]) / 3
    df = (se[0] ** 2 + se[1] ** 2) ** 2 / (se[0] ** 4 / 3 + se[1] ** 4 / 2)
    assert change["test"] == "Welch-Satterthwaite" and change["diff"] == pytest.approx(diff)
    assert change["p"] == pytest.approx(2 * stats.t.sf(abs(diff) / (se[0] ** 2 + se[1] ** 2) ** 0.5, df))


def test_optimizers_table_counts_a_run_read_twice_once_and_matches_old_csvs_by_their_flops():
    """The same run in two CSVs counts once (its seeds are not doubled: the std would shrink); a CSV from
    before the budget column is matched on the FLOPs its runs spent."""
    import flops
    rows = result_rows("adamw", "", [2.0, 2.1], flops_only=True) + result_rows("adamw", "", [2.0, 2.1])
    rows += result_rows("muon", "", [1.8, 1.9])
    text = flops.optimizers_table(rows)
    assert "2 run(s) read twice counted once" in text
    assert "| prenorm | 2.0500 ± 0.0707 (2) |" in text


def test_optimizers_table_without_both_optimizers_names_the_fix():
    import flops
    from configurator import ConfigError
    with pytest.raises(ConfigError, match="under both AdamW and Muon"):
        flops.optimizers_table(result_rows("adamw", "", [2.0, 2.1]))


def test_the_compiled_step_check_sees_every_parameter_under_muon():
    """compile=True's ZeroGradientCheck hooks the optimizer's step: with Muon + AdamW it records the
    gradients of every trainable parameter, of both optimizers, and names a zero one."""
    from guards import GRAD_CHECK_STEPS, ZeroGradientCheck
    model = GPT(GPTConfig(**SHAPE))
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), muon=MUON)
    check = ZeroGradientCheck(model, opt, 0)
    check.arm(GRAD_CHECK_STEPS, 1)
    x = torch.randint(0, 65, (2, 16))
    model(x, x)[1].backward()
    model.sublayers[1].c_fc.weight.grad.zero_()  # a Muon parameter with an exactly zero gradient
    opt.step()
    assert len(check.params) == sum(1 for p in model.parameters() if p.requires_grad)
    assert "sublayers.1.c_fc.weight" in check.read(GRAD_CHECK_STEPS)


def test_the_results_row_records_the_optimizer_however_it_was_set():
    """A sweep that sets --optimizer=muon in train_args (not per cell) leaves the cells' args empty: the row's
    optimizer column, from the run's whole configuration, still says muon (and its non-default keys), and
    flops.py optimizers reads it from there; a CSV from before the column falls back to the args."""
    import flops
    import run_config
    cfg = dict(run_config.DEFAULTS, optimizer="muon", muon_momentum=0.9)
    assert flops.optimizer_label(cfg) == "muon --muon_momentum=0.9"
    assert flops.optimizer_label(dict(run_config.DEFAULTS)) == "adamw"
    row = dict(residual="prenorm", args="", n_layer=4, budget=5e12, flops=5e12)
    assert flops.optimizer_key({**row, "optimizer": "muon"})[0] == "muon"
    assert flops.optimizer_key(row)[0] == "adamw"
    legacy = {**row, "args": "--optimizer='muon' --muon_lr=0.02 --value_residual='half'"}
    assert flops.optimizer_key(legacy)[:2] == ("muon", "prenorm --value_residual='half'")


@pytest.mark.parametrize("residual, options, adamw, muon", [
    ("dwa", {}, ["stream.alpha"], []),
    ("dwa", dict(dwa_decay=True), ["stream.alpha"], []),  # decayed, and still a mixing weight
    ("mhc", {}, ["stream.phi", "stream.head_phi"], []),  # the coefficient projections stay together
    ("mudd", {}, ["stream.static.0"], ["stream.w1.0", "stream.w2.0"]),  # the weight MLP is a hidden layer
    ("nag", {}, ["stream.modulators.0.proj.weight"], []),  # nag-nanochat's gates: AdamW
])
def test_each_modes_named_parameters_go_where_docs_training_md_says(residual, options, adamw, muon):
    """The split of docs/training.md ("Muon"), parameter by parameter: the generic test reads the modes'
    declarations, so a declaration dropped (dwa's or mhc's mixing_parameters) would pass it; this one names them."""
    model = GPT(GPTConfig(**SHAPE, residual=residual, **options))
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), muon=MUON)
    under_muon = {id(p) for p in opt.muon.param_groups[0]["params"]}
    named = dict(model.named_parameters())
    assert not [n for n in adamw if id(named[n]) in under_muon], "under Muon, should be AdamW's"
    assert all(id(named[n]) in under_muon for n in muon), "under AdamW, should be Muon's"


def lr_rows(design_args, losses_by_lr, optimizer):
    """An LR check's rows: one run (seed 11) per LR of one design under one optimizer, 8 layers, 5e12."""
    flag = "--muon_lr=" if optimizer == "muon" else "--learning_rate="
    return [dict(run=f"lr{lr}", cell="c", seed=11, residual="prenorm", n_layer=8, mod=None, mod_rate=0.0,
                 args=" ".join(filter(None, [design_args, f"--optimizer='{optimizer}'", f"{flag}{lr}"])),
                 status="done", val_loss=loss, flops=5e12 * 0.9985, budget=5e12)
            for lr, loss in losses_by_lr.items()]


def test_the_lr_check_says_whether_each_evaluated_cell_ran_at_its_best_lr():
    """The evaluated cells (3 seeds, sd 0.01 each) ran AdamW at 1e-3 and Muon at 0.02. In the check: prenorm's
    AdamW best is 1e-3 ('the best'); its Muon best is 0.05 (the highest tried: 'edge'), 0.01 below 0.02, inside the
    band t(0.975, 2) x sqrt(2) x 0.01 = 0.0609 ('within noise'); value_residual's AdamW best is 2e-3, 0.1 below
    1e-3 ('off its best LR'). A design the comparison never ran has no band."""
    import flops
    from scipy import stats as scipy_stats
    rows = result_rows("adamw", "", [2.00, 2.01, 1.99], n_layer=8) + result_rows("muon", "", [1.80, 1.81, 1.79],
                                                                                 n_layer=8)
    rows += result_rows("adamw", "--value_residual='half'", [1.90, 1.91, 1.89], n_layer=8)
    check = lr_rows("", {0.0005: 2.05, 0.001: 2.0, 0.002: 2.02}, "adamw")
    check += lr_rows("", {0.008: 1.9, 0.02: 1.80, 0.05: 1.79}, "muon")
    check += lr_rows("--value_residual='half'", {0.0005: 2.0, 0.001: 1.9, 0.002: 1.8}, "adamw")
    check += lr_rows("--norm_scaling=True", {0.0005: 2.0, 0.001: 1.97, 0.002: 1.95}, "adamw")
    text = flops.lr_check_table(rows, check, {"adamw": 0.001, "muon": 0.02})
    line = {tuple(r.split(" | ")[:2]): r for r in text.splitlines() if r.startswith("| prenorm")}
    band = scipy_stats.t.ppf(0.975, 2) * math.sqrt(2) * 0.01
    assert line[("| prenorm", "adamw")].endswith(f"| 0.001 | 0.001 | +0.0000 | {band:.4f} (3) | the best |")
    assert line[("| prenorm", "muon")].endswith(f"| 0.05 (edge) | 0.02 | +0.0100 | {band:.4f} (3) | within noise |")
    assert line[("| prenorm --value_residual='half'", "adamw")].endswith(
        f"| 0.002 (edge) | 0.001 | +0.1000 | {band:.4f} (3) | off its best LR |")
    assert line[("| prenorm --norm_scaling=True", "adamw")].endswith("| +0.0200 | - | no evaluated cell: no band |")
    assert "0.0005: 2.0500, 0.001: 2.0000, 0.002: 2.0200" in line[("| prenorm", "adamw")]
    assert text.rstrip().endswith("Over the check: 1 the best, 1 no evaluated cell: no band, 1 off its best LR, "
                                  "1 within noise.")
    with pytest.raises(flops.ConfigError, match="no finished run"):
        flops.lr_check_table(rows, [], {"adamw": 0.001, "muon": 0.02})


def write_results(path, rows):
    """rows as a results.csv (flops.write_rows), for the commands that read files: its path."""
    import flops
    flops.write_rows(str(path), rows)
    return str(path)


def test_lr_check_and_chosen_lr_reach_the_table_from_the_command_line(tmp_path):
    """flops.py optimizers --lr_check=CSV --chosen_lr=adamw=0.002,muon=0.02: the table reads the check's CSV and
    takes the chosen AdamW LR from the option (0.002, the best here: 'the best'; with the default 0.001 it is
    0.1 off); a malformed --chosen_lr is a one-line error naming the form."""
    import flops
    write = write_results
    evaluated = result_rows("adamw", "", [2.00, 2.01, 1.99], n_layer=8) + result_rows("muon", "", [1.80, 1.81, 1.79],
                                                                                     n_layer=8)
    for i, r in enumerate(evaluated):
        r.update(run=f"{r['run']}_{i}", cell=f"c{i // 3}")
    base = write(tmp_path / "eval.csv", evaluated)
    check = write(tmp_path / "check.csv", lr_rows("", {0.001: 2.0, 0.002: 1.9}, "adamw"))
    adamw_line = lambda text: next(r for r in text.splitlines() if r.startswith("| prenorm | adamw |"))  # noqa: E731
    assert adamw_line(flops.optimizers([base, f"--lr_check={check}", "--chosen_lr=adamw=0.002,muon=0.02"])).endswith(
        "| 0.002 | 0.002 | +0.0000 | " + adamw_line(flops.optimizers([base, f"--lr_check={check}"])).split(" | ")[-2]
        + " | the best |")
    assert "| 0.002 | 0.001 | +0.1000 |" in adamw_line(flops.optimizers([base, f"--lr_check={check}"]))
    with pytest.raises(flops.ConfigError, match="optimizer=LR pairs"):
        flops.optimizers([base, f"--lr_check={check}", "--chosen_lr=adamw:0.002"])


def test_adamw_lr_compares_with_the_adamw_runs_at_that_lr(tmp_path):
    """--adamw_lr=0.002: the AdamW side of every table is the runs whose cells set --learning_rate=0.002, not the
    recipe's runs (which set none), and the LR check's chosen AdamW LR is 0.002. Here the recipe's AdamW prenorm is
    2.00 and value_residual 1.90 (a gain of 0.1), at 2e-3 both 1.80 (no gain): the AdamW column and Δ follow the
    option. Without it the 2e-3 runs are a setting of their own that no table reads (not a Muon setting, not the
    designs' "--learning_rate" variants), and --adamw_lr=0.001, the recipe's, reads the runs that set no LR: the
    same text as no option. A negative LR is a one-line error."""
    import flops
    rows = result_rows("adamw", "", [2.00, 2.01, 1.99], n_layer=8) + result_rows("muon", "", [1.70, 1.71, 1.69], n_layer=8)
    rows += result_rows("adamw", "--value_residual='half'", [1.90, 1.91, 1.89], n_layer=8)
    rows += result_rows("muon", "--value_residual='half'", [1.60, 1.61, 1.59], n_layer=8)
    at_2e3 = result_rows("adamw", "--learning_rate=0.002", [1.80, 1.81, 1.79], n_layer=8)
    at_2e3 += result_rows("adamw", "--value_residual='half' --learning_rate=0.002", [1.80, 1.82, 1.78], n_layer=8)
    assert flops.optimizer_key(at_2e3[0])[:2] == ("adamw --learning_rate=0.002", "prenorm")
    assert flops.optimizer_key(at_2e3[0], adamw_lr=0.002)[:2] == ("adamw", "prenorm")
    assert flops.optimizer_key(rows[0], adamw_lr=0.002)[0] == "adamw --learning_rate=(the recipe)"
    assert flops.optimizers_table(rows + at_2e3).count("**8 layers") == 1  # the 2e-3 runs: no Muon setting
    recipe = table_lines(flops.optimizers_table(rows + at_2e3), layers=8)
    best = flops.optimizers_table(rows + at_2e3, adamw_lr=0.002)
    assert best.count("**8 layers") == 1 and "learning_rate" not in best  # one table, no LR variant as a design
    assert recipe["prenorm"].startswith("| prenorm | 2.0000 ± 0.0100 (3) |")
    assert recipe["prenorm --value_residual='half'"].split(" | ")[2].startswith("-0.1000 (paired t (3)")
    line = table_lines(best, layers=8)
    assert line["prenorm"].startswith("| prenorm | 1.8000 ± 0.0100 (3) |")
    assert line["prenorm --value_residual='half'"].split(" | ")[2].startswith("+0.0000 (paired t (3)")
    both = write_results(tmp_path / "eval.csv", [r | {"run": f"{r['run']}_{i}", "cell": f"c{i // 3}"}
                                                 for i, r in enumerate(rows + at_2e3)])
    check = write_results(tmp_path / "check.csv", lr_rows("", {0.001: 2.0, 0.002: 1.8, 0.004: 1.85}, "adamw"))
    text = flops.optimizers([both, "--adamw_lr=0.002", f"--lr_check={check}"])
    assert "**8 layers, 5e+12 FLOPs** (AdamW at LR 0.002)" in text  # the table says which AdamW it reads
    assert flops.optimizers([both, "--adamw_lr=0.001"]) == flops.optimizers([both])  # the recipe's LR, named or not
    assert "AdamW at LR" not in flops.optimizers([both])
    assert table_lines(text.split("The learning rate:")[0], layers=8)["prenorm"].startswith("| prenorm | 1.8000 ± ")
    assert next(r for r in text.splitlines() if r.startswith("| prenorm | adamw |")).split(" | ")[4:7] == \
        ["0.002", "0.002", "+0.0000"]  # best LR 2e-3, bracketed by 1e-3 and 4e-3: not at the edge
    with pytest.raises(flops.ConfigError, match="adamw_lr.*give a learning rate"):
        flops.optimizers([both, "--adamw_lr=-1"])
