"""The run's plan (plan.py) on its own: no model, no data, a configuration dict. What a budget buys, the
warm-up cap, the LR schedule and the re-planning of a time budget, against numbers worked by hand."""

import math
import subprocess
import sys
from pathlib import Path

import pytest

import plan
from configurator import ConfigError

REPO = Path(__file__).resolve().parents[1]


def config(**kw):
    """train.py's plan keys, at values that make the arithmetic easy to follow."""
    cfg = dict(max_iters=100, warmup_iters=10, lr_decay_iters=None, learning_rate=1e-3, min_lr=None, decay_lr=True,
               max_flops=None, max_seconds=None, eval_interval=25, nag_alpha_warmup_tokens=0,
               init_from="scratch", eval_only=False)
    cfg.update(kw)
    return cfg


def test_the_plan_needs_no_model():
    """plan.py imports neither torch nor the model: a plan is arithmetic on the configuration."""
    code = "import sys, plan; print(sorted(m for m in ('torch', 'model', 'flops') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_lr_warms_up_then_follows_the_cosine_to_min_lr():
    p = plan.RunPlan(config(), tokens_per_iter=128, flops_per_token=1.0, verbose=False)
    assert p.cfg["lr_decay_iters"] == 100 and p.cfg["min_lr"] == pytest.approx(1e-4)  # the defaults fill in
    assert p.lr(0) == pytest.approx(1e-3 * 1 / 11) and p.lr(9) == pytest.approx(1e-3 * 10 / 11)
    assert p.lr(10) == pytest.approx(1e-3)  # the peak, where the cosine starts
    assert p.lr(55) == pytest.approx(1e-4 + 0.5 * 9e-4)  # half way down the cosine
    assert p.lr(100) == pytest.approx(1e-4) and p.lr(500) == pytest.approx(1e-4)
    lrs = [p.lr(i) for i in range(10, 101)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))  # the decay never goes back up
    flat = plan.RunPlan(config(decay_lr=False), 128, 1.0, verbose=False)
    assert {flat.lr(i) for i in (0, 5, 50, 100)} == {1e-3}


def test_a_flop_budget_sets_the_iterations_and_caps_the_warm_up(capsys):
    """3.2e6 FLOPs at 100 FLOPs/token and 128 tokens/iter buy 250 iterations; lr_decay_iters follows them,
    and a 40-iteration warm-up is capped at ceil(10% of 250) = 25 (a short one is left as it is)."""
    p = plan.RunPlan(config(max_flops=3.2e6, warmup_iters=40), 128, 100.0, dense_note=" (counted dense)")
    assert (p.cfg["max_iters"], p.cfg["lr_decay_iters"], p.cfg["warmup_iters"]) == (250, 250, 25)
    out = capsys.readouterr().out
    assert "250 iters, warmup_iters 25 (capped at 10% of the iters), lr_decay_iters 250 (counted dense)" in out
    odd = plan.RunPlan(config(max_flops=243 * 12800, warmup_iters=40), 128, 100.0, verbose=False)
    assert (odd.cfg["max_iters"], odd.cfg["warmup_iters"]) == (243, 25)  # 24.3 rounded up
    short = plan.RunPlan(config(max_flops=3.2e6, warmup_iters=5), 128, 100.0, verbose=False)
    assert short.cfg["warmup_iters"] == 5
    kept = plan.RunPlan(config(max_flops=3.2e6, lr_decay_iters=80), 128, 100.0, verbose=False)
    assert kept.cfg["lr_decay_iters"] == 80  # set apart from max_iters: the budget leaves it


def test_a_flop_budget_that_ends_before_a_kept_decay_says_so(capsys):
    """lr_decay_iters set apart from max_iters stays as it is under a FLOP budget: past the 250 iterations the
    budget buys, the LR never reaches min_lr, and one warning says so with the fix; a decay inside the run, one
    that follows max_iters and a constant LR say nothing."""
    p = plan.RunPlan(config(max_flops=3.2e6, lr_decay_iters=400), 128, 100.0)
    err = capsys.readouterr().err
    assert err.strip() == (f"warning: lr_decay_iters 400 > max_iters 250 (what the budget buys): the run ends before the cosine "
                           f"does, at LR {p.lr(250):.2e}, not min_lr; to decay over the run, --lr_decay_iters=250")
    for kw in (dict(lr_decay_iters=200), dict(lr_decay_iters=None), dict(lr_decay_iters=400, decay_lr=False)):
        plan.RunPlan(config(max_flops=3.2e6, **kw), 128, 100.0)
        assert capsys.readouterr().err == "", kw


def test_iterations_for_budget_rounds_to_the_nearest_and_refuses_a_bad_budget():
    assert plan.iterations_for_budget(1000.4 * 128, 1.0, 128) == 1000
    assert plan.iterations_for_budget(1000.6 * 128, 1.0, 128) == 1001
    assert plan.iterations_for_budget(1.0, 1.0, 128) == 1  # at least one
    for bad in (0, -1.0, True, "1e6"):
        with pytest.raises(ConfigError, match="positive number"):
            plan.iterations_for_budget(bad, 1.0, 128)


def test_a_time_budget_re_plans_from_the_pace_and_ends_at_the_deadline():
    """max_seconds 60 at 0.5 s a step: after 20 timed steps (10 s, 12 s spent with the warm-up step), the
    48 s left buy 96 more iterations; the warm-up is capped at 10% of them, the decay ends with them. Once
    60 s are spent the run ends at the iteration it is at."""
    p = plan.RunPlan(config(max_seconds=60, warmup_iters=50), 128, 1.0, verbose=False)
    p.at_step(21, spent=12.0, timed=20, timed_seconds=10.0)
    assert (p.cfg["max_iters"], p.cfg["lr_decay_iters"], p.cfg["warmup_iters"]) == (117, 117, 12)
    p.at_step(0, spent=0.0, timed=0, timed_seconds=0.0)  # nothing timed yet: the plan as it was
    assert p.cfg["max_iters"] == 117
    p.at_step(130, spent=60.0, timed=128, timed_seconds=58.0)
    assert p.cfg["max_iters"] == 130
    p.at_step(5, spent=1.0, timed=4, timed_seconds=0.0)  # a frozen clock: one step at a time
    assert p.cfg["max_iters"] == 6


def test_a_time_budget_rounds_the_iterations_left_up():
    """48 s left at 0.52 s a step are 92.3 steps: 93 more, so the run reaches its deadline (rounded, or cut
    down, 92 would end it and its LR decay short of it)."""
    p = plan.RunPlan(config(max_seconds=60, warmup_iters=50), 128, 1.0, verbose=False)
    p.at_step(21, spent=12.0, timed=20, timed_seconds=10.4)
    assert (p.cfg["max_iters"], p.cfg["lr_decay_iters"]) == (21 + 93, 21 + 93)


def test_a_time_budgets_warm_up_cap_follows_each_estimate_up_as_well_as_down():
    """The cap is 10% of each new estimate of the run, on the warm-up asked (50): a slow first pace (1 s a
    step: 100 iterations, warm-up 10), then faster ones (0.25 s: 394, warm-up 40; 0.125 s: 778) give the
    warm-up back up to the 50 asked, and a slow pace again shrinks it (1 s: 110, 11); a cap taken from the
    last capped value could only shrink."""
    p = plan.RunPlan(config(max_seconds=100, warmup_iters=50), 128, 1.0, verbose=False)
    caps = []
    for iter_num, spent, timed, timed_seconds in ((2, 2.0, 1, 1.0), (10, 4.0, 8, 2.0), (10, 4.0, 8, 1.0),
                                                  (20, 10.0, 18, 18.0)):
        p.at_step(iter_num, spent, timed, timed_seconds)
        caps.append((p.cfg["max_iters"], p.cfg["warmup_iters"]))
    assert caps == [(100, 10), (394, 40), (778, 50), (110, 11)]


def test_two_budgets_and_a_time_budget_under_ddp_are_one_line_errors():
    with pytest.raises(ConfigError, match="set one of them"):
        plan.RunPlan(config(max_flops=1e6, max_seconds=10), 128, 1.0, verbose=False)
    with pytest.raises(ConfigError, match="drop torchrun or use --max_flops"):
        plan.RunPlan(config(max_seconds=10), 128, 1.0, ddp=True, verbose=False)


def test_a_resumed_time_budget_starts_from_the_checkpoints_plan():
    p = plan.RunPlan(config(max_seconds=60), 128, 1.0, resumed_cfg={"max_iters": 340}, verbose=False)
    assert (p.cfg["max_iters"], p.cfg["lr_decay_iters"]) == (340, 340)


def test_the_alpha_warm_up_and_the_evals_left():
    p = plan.RunPlan(config(nag_alpha_warmup_tokens=512), tokens_per_iter=128, flops_per_token=1.0, verbose=False)
    assert [p.alpha_scale(i) for i in (0, 1, 2, 4, 9)] == [0.0, 0.25, 0.5, 1.0, 1.0]
    assert plan.RunPlan(config(), 128, 1.0, verbose=False).alpha_scale(0) == 1.0  # no warm-up
    assert p.evals_left(0) == 4 and p.evals_left(24) == 4 and p.evals_left(25) == 3 and p.evals_left(99) == 1
    odd = plan.RunPlan(config(max_iters=110), 128, 1.0, verbose=False)
    assert odd.evals_left(100) == 1  # the last eval, at max_iters, off the interval


def test_the_plan_in_words():
    p = plan.RunPlan(config(), 128, 1.0, verbose=False)
    assert p.describe(0) == ("the plan from iter 0: LR 9.09e-05, warm-up to 1.00e-03 at iter 10, cosine down to "
                             "min_lr 1.00e-04 at iter 100 (lr_decay_iters); the run ends at iter 100")
    p.cfg["max_iters"] = 200  # a resume that trains on without moving the decay's end
    text = p.describe(100, [("max_iters", 100, 200, "argv")])
    assert text.endswith("min_lr 1.00e-04 from iter 100; the run ends at iter 200 (to decay over the new length "
                         "as well, add --lr_decay_iters=200)")
    p.cfg["max_iters"] = 50
    assert p.describe(20).endswith(f"the run ends at iter 50, its LR {p.lr(50):.2e} there (the cosine ends later, "
                                   "at lr_decay_iters)")
    assert math.isclose(p.lr(50), 1e-4 + 0.5 * (1 + math.cos(math.pi * 40 / 90)) * 9e-4)


def test_a_cosine_that_outlasts_the_run_is_warned_about(capsys):
    """The quickstart config with --max_iters=300 keeps its lr_decay_iters 2000: the run ends with the LR near
    its peak, not at min_lr. One warning says so and names the fix; a decay that ends with the run, one left to
    follow max_iters, a constant LR, a budget (the plan sets lr_decay_iters itself) and a resume (its plan is
    described then) say nothing."""
    import run_config
    from configurator import configure

    def warned(*args):
        cfg = configure([str(REPO / "config" / "shakespeare_char_cpu.py"), *args], run_config.DEFAULTS)
        run_config.check_training_values(cfg, master=True)
        plan.RunPlan(cfg, 768, 1e5, resumed_cfg=cfg if cfg["init_from"] == "resume" else None)
        return capsys.readouterr().err
    p = plan.RunPlan(config(max_iters=300, warmup_iters=100, lr_decay_iters=2000, min_lr=1e-4), 128, 1.0,
                     verbose=False)
    assert warned("--max_iters=300").strip() == (
        f"warning: lr_decay_iters 2000 > max_iters 300: the run ends before the cosine does, at LR {p.lr(300):.2e}, "
        f"not min_lr; to decay over the run, --lr_decay_iters=300")
    for args in (["--max_iters=300", "--lr_decay_iters=300"], ["--max_iters=300", "--lr_decay_iters=None"],
                 ["--max_iters=300", "--decay_lr=False"], ["--max_iters=300", "--max_flops=1e12"],
                 ["--max_iters=300", "--max_seconds=60"], ["--max_iters=300", "--init_from=resume"], []):
        assert warned(*args) == "", args
