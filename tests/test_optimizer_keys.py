"""Every configuration key that reaches the optimizer or the LR schedule arrives where it acts, through
train.py's own code path: a train.Trainer built from a tiny command line (Trainer.build_model's
configure_optimizers(..., muon_settings(cfg)), the run's plan) and, for what acts inside the loop, a few
iterations of its loop, watched at every optimizer step. Each key is set to a value that is neither its
default nor torch's, so a value dropped on the way (torch's default, or ours, in its place) fails.

The keys are the DEFAULTS that run_config.py writes under its optimizer and schedule headings (# AdamW down
to # system): a key added there fails test_every_optimizer_and_schedule_key_arrives until it has a check.
Also: a torch.compile cache folder that cannot be made does not stop a run that never compiles."""
import ast
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from unittest import mock

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import optim  # noqa: E402
import run_config  # noqa: E402
import train  # noqa: E402
from configurator import ConfigError, configure  # noqa: E402
from plan import iterations_for_budget  # noqa: E402
from test_train import tiny_args  # noqa: E402


def section_keys(first, last):
    """The DEFAULTS keys written in run_config.py below the comment line `# first...` and above `# last...`."""
    source = Path(run_config.__file__).read_text()
    rows = source.splitlines()
    start = next(n for n, row in enumerate(rows, 1) if row.strip().startswith("# " + first))
    end = next(n for n, row in enumerate(rows, 1) if n > start and row.strip().startswith("# " + last))
    node = next(node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Assign)
                and [getattr(t, "id", None) for t in node.targets] == ["DEFAULTS"])
    return [kw.arg for kw in node.value.keywords if start < kw.value.lineno < end]


OPTIMIZER_KEYS = section_keys("AdamW", "system")


def build_trainer(data_dir, out_dir, **overrides):
    """train.Trainer of tiny_args + overrides: set up as train.main does, not run (one thread, RNG kept)."""
    args = tiny_args(data_dir, out_dir, **overrides)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng():
            return train.Trainer(configure(args, run_config.DEFAULTS), args)
    finally:
        torch.set_num_threads(threads)


def run_watched(trainer):
    """trainer.run(), recording at each optimizer step every group's settings (without its params) keyed by
    the names of its parameters, and the max_norm each gradient clip was given."""
    names = {id(p): n for n, p in trainer.raw_model.named_parameters()}
    steps, step = [], trainer.optimizer.step

    def watched_step(*args, **kwargs):
        steps.append({names[id(p)]: {k: v for k, v in g.items() if k != "params"}
                      for g in trainer.optimizer.param_groups for p in g["params"]})
        return step(*args, **kwargs)

    trainer.optimizer.step = watched_step
    clip = mock.Mock(wraps=torch.nn.utils.clip_grad_norm_)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(), mock.patch.object(torch.nn.utils, "clip_grad_norm_", clip):
            trainer.run()
    finally:
        torch.set_num_threads(threads)
    return steps, [c.args[1] if len(c.args) > 1 else c.kwargs["max_norm"] for c in clip.call_args_list]


# run A: Muon + AdamW on nag, every optimizer value and the schedule's numbers away from their defaults;
# 5 iterations: warm-up 1, cosine to lr_decay_iters 3, then min_lr
TOKENS_PER_ITER = 2 * 4 * 32  # tiny_args: 2 micro-steps of 4 x 32
RUN_A = dict(optimizer="muon", residual="nag", learning_rate=2e-3, min_lr=3e-4, beta1=0.8, beta2=0.9,
             weight_decay=0.07, warmup_iters=1, lr_decay_iters=3, max_iters=5, grad_clip=0.5, muon_lr=0.03,
             muon_momentum=0.85, muon_weight_decay=0.04, muon_adjust_lr="match_rms_adamw", nag_gate_lr_scale=0.5,
             nag_alpha_warmup_tokens=10 * TOKENS_PER_ITER, eval_interval=100, eval_iters=1, final_eval_tokens=0)
# the LR of iterations 0..4 by hand: warm-up lr (0 + 1) / (1 + 1), the peak, half way down the cosine, min_lr at
# lr_decay_iters and after it
LRS_A = [1e-3, 2e-3, 3e-4 + 0.5 * (2e-3 - 3e-4), 3e-4, 3e-4]
# run B (built, not run): AdamW on nag with decayed gates and no LR decay
RUN_B = dict(residual="nag", nag_gate_decay=True, decay_lr=False, weight_decay=0.07, learning_rate=2e-3)


@pytest.fixture(scope="module")
def runs(data_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("keys")
    a = build_trainer(data_dir, root / "a", **RUN_A)
    a_steps, a_clips = run_watched(a)
    return dict(a=a, a_steps=a_steps, a_clips=a_clips, b=build_trainer(data_dir, root / "b", **RUN_B),
                c=build_trainer(data_dir, root / "c", max_iters=6, lr_decay_iters=None, warmup_iters=1),
                d=build_trainer(data_dir, root / "d", max_flops=3e9, lr_decay_iters=None, warmup_iters=1))


def lrs_of(runs, name):
    return [step[name]["lr"] for step in runs["a_steps"]]


def group_a(runs, name):
    """The settings of the group that trains parameter `name` in run A's first step."""
    return runs["a_steps"][0][name]


def check_learning_rate(runs):
    assert lrs_of(runs, "wte.weight") == pytest.approx(LRS_A, rel=1e-12)
    assert max(lrs_of(runs, "wte.weight")) == pytest.approx(RUN_A["learning_rate"])


def check_min_lr(runs):
    assert lrs_of(runs, "wte.weight")[3:] == pytest.approx([RUN_A["min_lr"]] * 2, rel=1e-12)


def check_warmup_iters(runs):
    assert lrs_of(runs, "wte.weight")[:2] == pytest.approx(LRS_A[:2], rel=1e-12)


def check_lr_decay_iters(runs):
    assert lrs_of(runs, "wte.weight")[2:] == pytest.approx(LRS_A[2:], rel=1e-12)


def check_decay_lr(runs):
    plan = runs["b"].plan
    assert [plan.lr(i) for i in range(9)] == [RUN_B["learning_rate"]] * 9  # no warm-up, no decay


def check_max_iters(runs):
    """lr_decay_iters None: the cosine ends at max_iters (6), not before."""
    plan = runs["c"].plan
    assert plan.cfg["lr_decay_iters"] == 6
    assert plan.lr(6) == pytest.approx(plan.cfg["min_lr"]) and plan.lr(5) > 1.01 * plan.cfg["min_lr"]


def check_max_flops(runs):
    t = runs["d"]
    iters = iterations_for_budget(3e9, t.flops_per_token, t.tokens_per_iter)
    assert t.cfg["max_iters"] == t.plan.cfg["lr_decay_iters"] == iters and iters not in (8, 600000)
    assert t.plan.lr(iters) == pytest.approx(t.cfg["min_lr"]) and t.plan.lr(iters - 1) > t.cfg["min_lr"]


def check_beta1(runs):
    assert group_a(runs, "wte.weight")["betas"] == (RUN_A["beta1"], RUN_A["beta2"])


check_beta2 = check_beta1


def check_weight_decay(runs):
    assert group_a(runs, "wte.weight")["weight_decay"] == RUN_A["weight_decay"]
    assert group_a(runs, "lm_head.weight")["weight_decay"] == RUN_A["weight_decay"]


def check_grad_clip(runs):
    assert runs["a_clips"] == [RUN_A["grad_clip"]] * RUN_A["max_iters"]


def check_optimizer(runs):
    assert isinstance(runs["a"].optimizer, optim.MuonAdamW)
    assert type(runs["b"].optimizer) is torch.optim.AdamW


MUON_GROUP_KEY = dict(muon_momentum="momentum", muon_weight_decay="weight_decay", muon_adjust_lr="adjust_lr_fn")
MATRIX = "sublayers.0.c_attn.weight"  # a hidden matrix: Muon's


def check_muon_lr(runs):
    """Muon's group: muon_lr at the peak, scheduled as learning_rate is."""
    ratio = RUN_A["muon_lr"] / RUN_A["learning_rate"]
    assert lrs_of(runs, MATRIX) == pytest.approx([ratio * lr for lr in LRS_A], rel=1e-12)


def check_muon_key(key):
    def check(runs):
        for step in runs["a_steps"]:
            assert step[MATRIX][MUON_GROUP_KEY[key]] == RUN_A[key]
    return check


def check_nag_gate_lr_scale(runs):
    assert lrs_of(runs, "stream.alpha") == pytest.approx([RUN_A["nag_gate_lr_scale"] * lr for lr in LRS_A],
                                                         rel=1e-12)


def check_nag_gate_decay(runs):
    names = {id(p): n for n, p in runs["b"].raw_model.named_parameters()}
    gates = [names[id(p)] for p in runs["b"].raw_model.stream.gate_parameters() if p.dim() >= 2]
    decay = {names[id(p)]: g["weight_decay"] for g in runs["b"].optimizer.param_groups for p in g["params"]}
    assert gates and all(decay[n] == RUN_B["weight_decay"] for n in gates), decay


def check_nag_alpha_warmup_tokens(runs):
    """Before iteration 5 (the end): 5 iterations' tokens of 10's."""
    assert runs["a"].raw_model.stream.alpha_scale.item() == 0.5


CHECKS = dict(learning_rate=check_learning_rate, min_lr=check_min_lr, warmup_iters=check_warmup_iters,
              lr_decay_iters=check_lr_decay_iters, decay_lr=check_decay_lr, max_iters=check_max_iters,
              max_flops=check_max_flops, beta1=check_beta1, beta2=check_beta2, weight_decay=check_weight_decay,
              grad_clip=check_grad_clip, optimizer=check_optimizer, muon_lr=check_muon_lr,
              nag_gate_lr_scale=check_nag_gate_lr_scale, nag_gate_decay=check_nag_gate_decay,
              nag_alpha_warmup_tokens=check_nag_alpha_warmup_tokens,
              **{key: check_muon_key(key) for key in MUON_GROUP_KEY})
ELSEWHERE = dict(  # keys of those headings that act somewhere else, and where that is tested
    max_seconds="re-plans the run at each step boundary: tests/test_train.py's test_max_seconds_* runs",
    max_bad_steps="stops the run after non-finite steps (guards.check_bad_steps): tests/test_reliability.py")


@pytest.mark.parametrize("key", [key for key in OPTIMIZER_KEYS if key not in ELSEWHERE])
def test_every_optimizer_and_schedule_key_arrives(key, runs):
    """The key, away from its default, is what the optimizer's groups or the plan's LR carry (run A: at
    every step of train.py's loop)."""
    assert key in CHECKS, f"{key} is a new optimizer or schedule key: add a check that it arrives where it acts"
    values = {**RUN_A, **RUN_B, "max_flops": 3e9, "max_iters": 6}
    assert values[key] != run_config.DEFAULTS[key], f"{key}: test it away from its default"
    CHECKS[key](runs)


def test_the_key_list_is_whole():
    """The headings hold the keys this file knows (a heading renamed would silently empty the list), and each
    is checked here or named with where it acts."""
    assert set(run_config.MUON_KEYS) <= set(OPTIMIZER_KEYS)
    assert {"learning_rate", "beta1", "beta2", "weight_decay", "grad_clip", "decay_lr", "warmup_iters",
            "lr_decay_iters", "min_lr", "nag_gate_lr_scale", "nag_gate_decay"} <= set(OPTIMIZER_KEYS)
    assert set(CHECKS) | set(ELSEWHERE) == set(OPTIMIZER_KEYS)


# -----------------------------------------------------------------------------
# torch.compile's cache folder

def test_an_unusable_compile_cache_folder_does_not_stop_a_run(data_dir, tmp_path):
    """TORCHINDUCTOR_CACHE_DIR under a regular file (so even root cannot make it) and HOME the same: torch's
    optimizers import torch._dynamo, which makes that folder. The run (no --compile) trains, with one note
    naming TORCHINDUCTOR_CACHE_DIR, and no traceback; the stand-in folder is gone after it."""
    (tmp_path / "file").write_text("not a folder")
    temp = tmp_path / "temp"
    temp.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", HOME=str(tmp_path / "file" / "home"), TMPDIR=str(temp),
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "file" / "cache"))
    args = tiny_args(data_dir, tmp_path / "out", max_iters=2, eval_interval=2, eval_iters=1, final_eval_tokens=0)
    r = subprocess.run([sys.executable, "train.py", *args], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    notes = [line for line in r.stderr.splitlines() if "TORCHINDUCTOR_CACHE_DIR" in line]
    assert len(notes) == 1 and "cannot be made" in notes[0] and str(temp) in notes[0], r.stderr
    assert (tmp_path / "out" / "ckpt.pt").exists() and os.listdir(temp) == []


def test_an_unusable_compile_cache_folder_and_no_temp_folder_is_one_line(tmp_path, monkeypatch):
    """With no temporary folder to stand in either, a ConfigError names TORCHINDUCTOR_CACHE_DIR."""
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.delitem(sys.modules, "torch._dynamo", raising=False)  # as before a first optimizer
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "file" / "cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "file" / "temp"))
    with pytest.raises(ConfigError, match=r"TORCHINDUCTOR_CACHE_DIR .* cannot be made .*: set "
                                          r"TORCHINDUCTOR_CACHE_DIR to a writable folder"):
        optim.check_compile_cache()
