"""A run owns its out_dir (guards.OutDirLock): a second writer started into it, from scratch, resuming or
eval_only, is a one-line error that names the holder's pid and leaves every file as it was; a lock whose
process was killed (SIGKILL) is taken over with a line that says so; the lock is held from before the
earlier run is set aside to the run's end, and released however the run ends (test_reliability.py's
Ctrl-C test checks it after a real SIGINT).

The other writer is a real process: a small Python that takes the lock with guards' class and waits.
"""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import guards
import train
from configurator import ConfigError
from test_train import (REPO, assert_one_line_error, in_process, run_train, run_train_here, tiny_args,  # noqa: F401
                        train_once)

HOLDER = """
import sys
sys.path.insert(0, {repo!r})
import guards
lock = guards.OutDirLock(sys.argv[1], "the holder")
print("locked", flush=True)
sys.stdin.read()  # until the test closes stdin (or kills this process)
lock.release()
"""


def files(out_dir):
    """{name: bytes} of every file under out_dir (a folder's as 'folder/name')."""
    return {str(p.relative_to(out_dir)): p.read_bytes() for p in Path(out_dir).rglob("*") if p.is_file()}


@pytest.fixture
def holder(tmp_path):
    """holder(out_dir) -> a real process that holds out_dir's lock (started, and its lock taken, on return)."""
    procs = []

    def start(out_dir):
        p = subprocess.Popen([sys.executable, "-c", HOLDER.format(repo=str(REPO)), str(out_dir)], cwd=REPO,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, OMP_NUM_THREADS="1"))
        procs.append(p)
        assert p.stdout.readline() == "locked\n"
        return p
    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.fixture(scope="module")
def finished_run(data_dir, tmp_path_factory):
    """A finished 8-iteration run's out_dir."""
    out = tmp_path_factory.mktemp("locked") / "out"
    train_once(tiny_args(data_dir, out, eval_iters=1, gradient_accumulation_steps=1))
    return out


def test_a_second_writer_is_refused_and_touches_nothing(finished_run, data_dir, holder):
    """While another process holds out_dir: `python train.py` from scratch (a real second process), a
    resume and eval_only each stop with one line naming the holder's pid and the fix; every file in
    out_dir, the holder's lock file included, is as it was, and no run was moved aside."""
    out = finished_run
    p = holder(out)
    before = files(out)
    assert json.loads(before[guards.LOCK_FILE])["pid"] == p.pid
    needles = [f"out_dir {out} is in use by another run (pid {p.pid} on ", f"{out / guards.LOCK_FILE}",
               "wait for it to end, or choose another --out_dir"]
    assert_one_line_error(run_train(tiny_args(data_dir, out, eval_iters=1)), *needles)
    for overrides in (dict(max_iters=10, lr_decay_iters=10), dict(eval_only=True)):
        assert_one_line_error(run_train_here(tiny_args(data_dir, out, init_from="resume", eval_iters=1, **overrides)),
                              *needles)
    assert files(out) == before and not [d for d in out.iterdir() if d.is_dir()]
    p.stdin.close()  # the holder ends normally: its lock file goes with it
    assert p.wait(timeout=60) == 0 and not (out / guards.LOCK_FILE).exists()


def test_a_killed_runs_lock_is_taken_over(data_dir, tmp_path, holder, in_process, capsys):
    """A holder killed with SIGKILL leaves its lock file behind (the kernel's lock went with it): a fresh
    start says whose it was and takes out_dir over; the earlier run moves aside without the lock file, and
    the run leaves no lock behind."""
    out = tmp_path / "out"
    in_process(tiny_args(data_dir, out, max_iters=2, eval_iters=1, gradient_accumulation_steps=1))
    p = holder(out)
    p.kill()
    p.wait()
    assert json.loads((out / guards.LOCK_FILE).read_text())["pid"] == p.pid  # stale: the file, no lock
    capsys.readouterr()
    in_process(tiny_args(data_dir, out, max_iters=2, eval_iters=1, gradient_accumulation_steps=1))
    said = capsys.readouterr().out
    assert (f"{out / guards.LOCK_FILE}: the run that held it (pid {p.pid} on ") in said
    assert "ended without releasing it (killed?); this run takes out_dir over" in said
    (folder,) = [d for d in out.iterdir() if d.is_dir()]
    assert {"ckpt.pt", "log.jsonl", "config.json"} <= set(os.listdir(folder))
    assert guards.LOCK_FILE not in os.listdir(folder) and not (out / guards.LOCK_FILE).exists()


def test_the_lock_is_held_from_before_the_set_aside_to_the_end(data_dir, tmp_path, in_process, monkeypatch):
    """The run holds out_dir's lock (its pid in the file, a second OutDirLock refused) when the earlier run is
    set aside, at its last training step and at its final eval; once train.main returns it is released (the
    file gone, the lock free to take)."""
    out = tmp_path / "out"
    in_process(tiny_args(data_dir, out, max_iters=2, eval_iters=1))
    seen = []

    def held(where):
        assert json.loads((out / guards.LOCK_FILE).read_text())["pid"] == os.getpid(), where
        with pytest.raises(ConfigError, match=f"pid {os.getpid()} on "):
            guards.OutDirLock(str(out))
        seen.append(where)

    def spy(name, fn):
        def wrapped(*args, **kw):
            held(name)
            return fn(*args, **kw)
        monkeypatch.setattr(train, name, wrapped)
    spy("set_aside_previous_run", train.set_aside_previous_run)
    spy("final_eval", train.final_eval)
    real_batches = train.batch_generator
    monkeypatch.setattr(train, "batch_generator",
                        lambda seed, it, micro: (held("step 1") if (it, micro) == (1, 0) else None)
                        or real_batches(seed, it, micro))
    in_process(tiny_args(data_dir, out, max_iters=2, eval_iters=1))
    assert seen == ["set_aside_previous_run", "step 1", "final_eval"]
    assert not (out / guards.LOCK_FILE).exists()
    guards.OutDirLock(str(out)).release()  # free


def test_a_failed_start_releases_the_lock(data_dir, tmp_path, in_process, monkeypatch):
    """A start that fails after taking the lock (wandb missing) releases it: the next start runs."""
    out = tmp_path / "out"
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb fails
    with pytest.raises(ConfigError, match="pip install wandb"):
        in_process(tiny_args(data_dir, out, max_iters=2, eval_iters=1, wandb_log=True))
    assert not (out / guards.LOCK_FILE).exists()
    in_process(tiny_args(data_dir, out, max_iters=2, eval_iters=1))
    assert (out / "ckpt.pt").exists() and not (out / guards.LOCK_FILE).exists()


def test_the_lock_file_is_not_a_run_file():
    """set_aside_previous_run moves RUN_FILES: the lock file must never be one (it would move mid-run)."""
    assert guards.LOCK_FILE not in guards.RUN_FILES


def test_a_signal_releases_the_lock(data_dir, tmp_path, in_process, monkeypatch):
    """A run stopped by SIGTERM (in-process; the real process's Ctrl-C is test_reliability.py's) releases
    out_dir: a resume takes it."""
    out = tmp_path / "out"
    real_batches = train.batch_generator
    monkeypatch.setattr(train, "batch_generator", lambda seed, it, micro: (
        os.kill(os.getpid(), signal.SIGTERM) if (it, micro) == (1, 0) else None) or real_batches(seed, it, micro))
    with pytest.raises(train.Interrupted):
        in_process(tiny_args(data_dir, out, max_iters=4, eval_iters=1))
    assert not (out / guards.LOCK_FILE).exists()
    monkeypatch.setattr(train, "batch_generator", real_batches)
    in_process(tiny_args(data_dir, out, init_from="resume", max_iters=4, eval_iters=1))
