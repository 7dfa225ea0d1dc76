"""Faults that must never lose a run: signals, kill -9 mid-save, NaN steps, bad input, random configs.

Helpers and the in-process fixture come from test_train.py; runs are tiny and on CPU.
"""
import contextlib
import errno
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch
from hypothesis import given, settings, strategies as st

import guards
import model as model_module
import run_config
import train
from configurator import ConfigError
from model import GPT, GPTConfig, executed_fraction
from test_train import (REPO, TOL, assert_one_line_error, in_process, load_ckpt, read_log, run,  # noqa: F401
                        tiny_args, tiny_dataset, train_once, wandb_history)


def assert_same_run(a_dir, b_dir, log_from=0):
    """Two runs agree: every eval in log.jsonl (from index log_from) and the final weights."""
    a, b = read_log(a_dir)[log_from:], read_log(b_dir)[log_from:]
    assert [x["iter"] for x in a] == [x["iter"] for x in b]
    for x, y in zip(a, b):
        assert x["lr"] == pytest.approx(y["lr"], rel=1e-12)
        assert abs(x["train_loss"] - y["train_loss"]) <= TOL and abs(x["val_loss"] - y["val_loss"]) <= TOL, (x, y)
    wa, wb = load_ckpt(a_dir)["model"], load_ckpt(b_dir)["model"]
    for k in wb:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=1e-6)


@pytest.fixture
def at_batch(monkeypatch):
    """at_batch(fn): call fn(iter_num, micro) whenever a training batch is drawn (a hook into the step)."""
    def install(fn):
        real = train.batch_generator

        def hooked(seed, iter_num, micro):
            fn(iter_num, micro)
            return real(seed, iter_num, micro)
        monkeypatch.setattr(train, "batch_generator", hooked)
    return install


# -----------------------------------------------------------------------------
# signals: checkpoint at the next step boundary, exit non-zero, resume exactly

def test_signal_mid_step_checkpoints_and_resume_is_exact(data_dir, tmp_path, in_process, at_batch):
    straight = tmp_path / "straight"
    in_process(tiny_args(data_dir, straight, dropout=0.1))  # 8 iterations, evals every 2

    out = tmp_path / "out"
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    # a real SIGTERM, delivered between the two micro-steps of iteration 4 (dropout on: the RNG matters)
    at_batch(lambda it, micro: os.kill(os.getpid(), signal.SIGTERM) if (it, micro) == (4, 1) else None)
    with pytest.raises(train.Interrupted) as e:
        in_process(tiny_args(data_dir, out, dropout=0.1))
    assert e.value.signum == signal.SIGTERM
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers  # given back
    ckpt = load_ckpt(out)
    assert ckpt["iter_num"] == 5  # iteration 4 finished, then the checkpoint, before iteration 5
    assert [r["iter"] for r in read_log(out)] == [0, 2, 4]

    # the message holds the exact command; run it (in-process, without the hook)
    message = str(e.value)
    assert "SIGTERM" in message and "before iteration 5" in message
    cmd = shlex.split(message.split("Resume with: ")[1])
    assert cmd[:2] == ["python", "train.py"] and f"--out_dir={out}" in cmd and cmd[-2] == "--init_from=resume"
    at_batch(lambda it, micro: None)
    in_process(cmd[2:])
    assert_same_run(out, straight)  # losses at 0..8, LR and final weights


def signal_after_iter_2(cmd, signum):
    """Start cmd (a training command line), send it signum once it has printed iteration 2, wait for it."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    p = subprocess.Popen(cmd, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for line in p.stdout:
        if line.startswith("iter 2/"):
            break
    p.send_signal(signum)
    stdout, stderr = p.communicate(timeout=120)
    return p, stdout, stderr


def test_ctrl_c_from_the_command_line(data_dir, tmp_path):
    """A real process gets SIGINT mid-run: it checkpoints, exits 130 and prints the resume command."""
    out = tmp_path / "out"
    args = tiny_args(data_dir, out, max_iters=100_000, lr_decay_iters=100_000, eval_interval=100_000)
    p, stdout, stderr = signal_after_iter_2([sys.executable, "train.py", *args], signal.SIGINT)
    assert p.returncode == 130, stderr
    assert "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert "interrupted by SIGINT" in last and "Resume with: python train.py" in last
    assert f"--out_dir={out}" in last and last.endswith("--init_from=resume --out_dir=" + str(out))
    # a loadable checkpoint past the last step printed (the printed command is run in the tests above and below)
    assert run_config.load_checkpoint(str(out / "ckpt.pt"), torch.device("cpu"))["iter_num"] >= 3
    assert not (out / guards.LOCK_FILE).exists()  # out_dir released: the resume may take it


def test_a_second_signal_during_a_real_save(data_dir, tmp_path):
    """A real process, 8 layers 512 wide (a checkpoint of 300 MB with AdamW's moments: its save takes a
    while), gets SIGTERM, and a second one while the stop's checkpoint is being written (its temp file
    growing: torch.save is inside its zip writer, which the handler's Interrupted leaves broken, so that
    torch.save raises a RuntimeError of its own on the way out). It exits 143 with one line, no traceback;
    ckpt.pt is the eval's at iteration 2, untouched, and no temp file is left."""
    out = tmp_path / "out"
    ckpt, tmp = out / "ckpt.pt", out / "ckpt.pt.tmp"
    args = tiny_args(data_dir, out, n_layer=8, n_embd=512, n_head=8, batch_size=1, gradient_accumulation_steps=1,
                     max_iters=1000, lr_decay_iters=1000, eval_interval=2, eval_iters=1, final_eval_tokens=0)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, "train.py", *args], cwd=REPO, env=env, text=True, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    try:
        for line in p.stdout:
            if line.startswith("saved checkpoint"):  # the eval at iteration 2 saved ckpt.pt
                break
        kept = os.stat(ckpt)
        p.send_signal(signal.SIGTERM)  # the first: a checkpoint at the next step boundary
        deadline = time.time() + 120
        while not (tmp.exists() and tmp.stat().st_size > 2 ** 20):  # past data.pkl: writing the tensors
            assert time.time() < deadline and p.poll() is None, "the stop's save never started"
            time.sleep(0.001)
        p.send_signal(signal.SIGTERM)
        stdout, stderr = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert lines[-1].startswith(f"stopped at once by a second signal: no checkpoint written for this stop; {ckpt} "
                                f"is as it was (iter 2). Resume with: python train.py"), lines
    assert [x for x in lines if not x.startswith("got SIGTERM")] == [lines[-1]]
    assert not tmp.exists()
    now = os.stat(ckpt)
    assert (now.st_ino, now.st_size, now.st_mtime_ns) == (kept.st_ino, kept.st_size, kept.st_mtime_ns)
    assert torch.load(ckpt, map_location="cpu", weights_only=True, mmap=True)["iter_num"] == 2


def test_ddp_sigterm_all_ranks_stop_rank_0_saves_and_resume_works(data_dir, tmp_path):
    """SIGTERM to torchrun (as a cluster scheduler sends it): torchrun forwards it to both ranks, they agree
    on the step to stop at (at a log iteration: log_interval=2), rank 0 alone writes, and the printed
    torchrun command resumes."""
    out = tmp_path / "out"
    args = tiny_args(data_dir, out, max_iters=100_000, lr_decay_iters=100_000, eval_interval=100_000, log_interval=2)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    p, stdout, stderr = signal_after_iter_2([*torchrun, "train.py", *args], signal.SIGTERM)
    assert p.returncode != 0
    assert sorted(os.listdir(out)) == ["ckpt.pt", "config.json", "log.jsonl"]  # rank 0 alone wrote
    lines = [x for x in stderr.splitlines() if "Resume with: " in x]
    assert len(lines) == 1 and "interrupted by SIGTERM" in lines[0], stderr[-3000:]  # printed by rank 0 only
    cmd = shlex.split(lines[0].split("Resume with: ")[1])
    assert cmd[:4] == ["torchrun", "--standalone", "--nproc_per_node=2", "train.py"]
    ckpt = load_ckpt(out)
    it = ckpt["iter_num"]
    assert it >= 3 and it % 2 == 0 and len(ckpt["rng"]) == 2
    r = run([*torchrun, *cmd[3:], f"--max_iters={it + 1}"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"at iter {it}" in r.stdout and load_ckpt(out)["iter_num"] == it + 1


# train.main under DDP in a fresh interpreter: the threads of the process before leaving the process group
# and once main has returned
LEAVE_PROCESSES = """
import os, sys
sys.path.insert(0, {repo!r})
import train

def threads():
    return sorted(open(f"/proc/self/task/{{t}}/comm").read().strip() for t in os.listdir("/proc/self/task"))

leave = train.Trainer.leave_processes
def leave_processes(self, barrier=True):
    print("before leaving:", *threads())
    leave(self, barrier)
train.Trainer.leave_processes = leave_processes
train.main(sys.argv[1:])
print("after main:", *threads())
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="thread names come from /proc (Linux)")
def test_ddp_run_shuts_its_process_group_down(data_dir, tmp_path):
    """When train.main returns under DDP the process group is gone, its threads (gloo's workers and I/O
    loop, rank 0's TCPStore server) joined. A gloo worker alive at the interpreter's end can abort the
    process there ("terminate called without an active exception": on a loaded machine a torchrun rank
    exited -6 now and then; Trainer.leave_processes). One rank (gloo), as torchrun starts it, in a fresh
    interpreter: when torch.distributed.nn.functional is first imported matters (start_processes)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT="0")  # port 0: the store takes a free port
    script = LEAVE_PROCESSES.format(repo=str(REPO))
    args = tiny_args(data_dir, tmp_path / "out", max_iters=1, eval_iters=1)
    r = subprocess.run([sys.executable, "-c", script, *args], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (before,) = [x.split()[2:] for x in r.stdout.splitlines() if x.startswith("before leaving:")]
    (after,) = [x.split()[2:] for x in r.stdout.splitlines() if x.startswith("after main:")]
    assert "pt_gloo_runloop" in before  # DDP ran on a gloo group (gloo's I/O loop is named from torch 2.13 on)
    assert len(after) == 1, after  # the main thread alone: the group's threads were joined


def test_interrupt_keeps_the_best_checkpoint(data_dir, tmp_path, in_process, at_batch):
    """With always_save_checkpoint=False ckpt.pt is the best model: an interrupt keeps it as ckpt_best.pt."""
    out = tmp_path / "out"
    in_process(tiny_args(data_dir, out, max_iters=2, always_save_checkpoint=False))
    best = (out / "ckpt.pt").read_bytes()
    at_batch(lambda it, micro: os.kill(os.getpid(), signal.SIGINT) if (it, micro) == (2, 0) else None)
    with pytest.raises(train.Interrupted):
        in_process(tiny_args(data_dir, out, init_from="resume", max_iters=4, always_save_checkpoint=False))
    assert (out / "ckpt_best.pt").read_bytes() == best
    assert load_ckpt(out)["iter_num"] == 3


def test_a_signal_finishes_the_wandb_run(data_dir, tmp_path, in_process, at_batch, monkeypatch):
    """A run stopped by a signal finishes its wandb run too, with the exit code the process gets (143 for
    SIGTERM): when train.main raises, the offline .wandb file is complete, its evals and exit included."""
    pytest.importorskip("wandb")
    for var, value in dict(WANDB_MODE="offline", WANDB_DIR=tmp_path, WANDB_CONFIG_DIR=tmp_path / "config",
                           WANDB_CACHE_DIR=tmp_path / "cache", WANDB_DATA_DIR=tmp_path / "data",
                           WANDB_SILENT="true", WANDB_CONSOLE="off").items():
        monkeypatch.setenv(var, str(value))
    at_batch(lambda it, micro: os.kill(os.getpid(), signal.SIGTERM) if (it, micro) == (3, 0) else None)
    with pytest.raises(train.Interrupted):
        in_process(tiny_args(data_dir, tmp_path / "out", wandb_log=True))
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    rows, _, exit_record = wandb_history(run_file)
    assert [r["iter"] for r in rows] == [0, 2]  # stopped before iteration 4
    assert exit_record is not None and exit_record.exit_code == 128 + signal.SIGTERM


# -----------------------------------------------------------------------------
# kill -9 at any moment, including mid-save, leaves a loadable checkpoint

SAVER = """
import os, sys, time, torch
sys.path.insert(0, {repo!r})
import run_config
real_fsync = os.fsync

def slow_fsync(fd):  # a slow disk: the parent can kill us while the temp file is written but not renamed
    real_fsync(fd)
    print("fsync", flush=True)
    time.sleep(0.02)
os.fsync = slow_fsync
i = 0
while True:  # 8 MB checkpoints back to back: a kill almost always lands inside save_checkpoint
    i += 1
    run_config.save_checkpoint({{"model": {{"w": torch.full((2_000_000,), float(i))}}, "model_args": {{}},
                                "iter_num": i}}, sys.argv[1])
    print("saved", i, flush=True)
"""


def test_kill_9_mid_save_leaves_the_previous_checkpoint(tmp_path):
    path, tmp = tmp_path / "ckpt.pt", tmp_path / "ckpt.pt.tmp"
    script = tmp_path / "saver.py"
    script.write_text(SAVER.format(repo=str(REPO)))
    rng = random.Random(0)
    for round in range(3):
        p = subprocess.Popen([sys.executable, str(script), str(path)], stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, OMP_NUM_THREADS="1"))
        lines = []
        while not lines or lines[-1][0] != "saved":  # one save has completed (also after an earlier kill)
            lines.append(p.stdout.readline().split())
        if round == 0:  # kill inside the next save, after its temp file is written: deterministic
            while lines[-1] != ["fsync"]:
                lines.append(p.stdout.readline().split())
        else:  # kill at a random moment
            time.sleep(rng.uniform(0.0, 0.5))
        p.kill()
        p.wait()
        if round == 0:
            assert tmp.exists()  # the kill really did land mid-save
        lines += [x.split() for x in p.stdout.read().splitlines()]
        done = max(int(x[1]) for x in lines if x and x[0] == "saved")
        ckpt = run_config.load_checkpoint(str(path), torch.device("cpu"))
        assert ckpt["iter_num"] in (done, done + 1)  # + 1: renamed but not yet printed
        assert torch.equal(ckpt["model"]["w"], torch.full((2_000_000,), float(ckpt["iter_num"])))


# -----------------------------------------------------------------------------
# non-finite loss: the step is skipped; max_bad_steps in a row stop the run

class Overflow(torch.autograd.Function):
    """The identity forward; backward makes every gradient inf: an fp16 overflow in the backward of a
    finite loss, exactly what the grad scaler's found_inf is for."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


@pytest.fixture
def nan_at(monkeypatch):
    """nan_at(iters, overflow=False): the training loss is NaN at those iterations (evals are untouched);
    with overflow, the loss stays finite and its gradients are inf instead."""
    def install(bad_iters, overflow=False):
        current, batches = {}, train.train_batches

        def tracked(path, batch_size, block_size, seed, iter_num, first_micro, accum, device):
            # the iteration of the batch the step is handed (batches are drawn one ahead)
            for i, batch in enumerate(batches(path, batch_size, block_size, seed, iter_num, first_micro, accum, device)):
                current["it"] = iter_num + i // accum
                yield batch
        monkeypatch.setattr(train, "train_batches", tracked)
        forward = GPT.forward

        def poisoned(self, idx, targets=None, executed=False):
            logits, loss, ran = forward(self, idx, targets, executed=True)
            if self.training and current.get("it") in bad_iters:
                loss = Overflow.apply(loss) if overflow else loss * float("nan")
            return (logits, loss, ran) if executed else (logits, loss)
        monkeypatch.setattr(GPT, "forward", poisoned)
    return install


def test_nan_step_is_not_applied(data_dir, tmp_path, in_process, nan_at):
    clean = tmp_path / "clean"
    in_process(tiny_args(data_dir, clean, max_iters=3))  # iterations 0, 1, 2
    nan_at({3})
    bad = tmp_path / "bad"
    in_process(tiny_args(data_dir, bad, max_iters=4))  # iterations 0, 1, 2 and a NaN 3
    a, b = load_ckpt(clean), load_ckpt(bad)
    assert b["iter_num"] == 4
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k  # the NaN step changed nothing ...
    for sa, sb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)  # ... not even Adam's moments or step count


def test_fp16_bad_step_is_counted_once(data_dir, tmp_path, in_process, nan_at, capsys):
    """With fp16 a NaN loss is still a bad step: skipped, counted once, and the scale backs off once."""
    out = tmp_path / "out"
    nan_at({3})
    in_process(tiny_args(data_dir, out, dtype="float16", max_iters=4, max_bad_steps=2))
    assert capsys.readouterr().out.count("1 step(s) skipped since the last log (1 in a row") == 1
    scaler = load_ckpt(out)["scaler"]
    assert scaler["scale"] == 2.0 ** 16 * scaler["backoff_factor"]  # halved once from the initial 2^16


def test_fp16_overflow_is_the_scalers_business(data_dir, tmp_path, in_process, nan_at, capsys):
    """With fp16 a finite loss whose gradients overflow is a normal grad-scaler skip: the step changes
    nothing and the scale backs off, but it is neither printed nor counted (max_bad_steps=1 would stop
    the run at the first bad step)."""
    clean = tmp_path / "clean"
    in_process(tiny_args(data_dir, clean, dtype="float16", max_iters=3))  # iterations 0, 1, 2
    capsys.readouterr()
    out = tmp_path / "out"
    nan_at({3}, overflow=True)
    in_process(tiny_args(data_dir, out, dtype="float16", max_iters=4, max_bad_steps=1))  # and an overflowing 3
    assert "skipped" not in capsys.readouterr().out
    a, b = load_ckpt(clean), load_ckpt(out)
    assert b["iter_num"] == 4
    assert b["scaler"]["scale"] == 2.0 ** 16 * b["scaler"]["backoff_factor"]  # the scaler saw it: halved once
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k  # the step was skipped: it changed nothing
    for sa, sb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("max_bad_steps, stop_iter, ckpt_iter", [(0, 3, 2), (3, 5, 4)])
def test_too_many_bad_steps_stop_and_keep_the_checkpoint(max_bad_steps, stop_iter, ckpt_iter, data_dir, tmp_path,
                                                         in_process, nan_at):
    out = tmp_path / "out"
    nan_at(set(range(3, 100)))
    before = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN where the shell ignores it
    with pytest.raises(train.TrainingStopped) as e:
        in_process(tiny_args(data_dir, out, max_bad_steps=max_bad_steps))
    message = str(e.value)
    assert signal.getsignal(signal.SIGINT) is before  # the handlers were given back
    assert f"iteration {stop_iter}" in message and "--init_from=resume" in message and "\n" not in message
    ckpt = run_config.load_checkpoint(str(out / "ckpt.pt"), torch.device("cpu"))
    assert ckpt["iter_num"] == ckpt_iter
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values())


def test_bad_steps_are_read_at_the_next_log_or_eval(data_dir, tmp_path, in_process, nan_at):
    """Steps count bad steps on the device and the host reads them at log and eval iterations only: a
    run of max_bad_steps (5, 6) that good steps (7) follow is still caught at the next read, the eval
    at 8, before its checkpoint; the one at 4 is kept."""
    out = tmp_path / "out"
    nan_at({5, 6})
    with pytest.raises(train.TrainingStopped) as e:
        in_process(tiny_args(data_dir, out, max_bad_steps=2, log_interval=4, eval_interval=4, max_iters=12,
                             lr_decay_iters=12))
    assert "for 2 consecutive steps by iteration 7" in str(e.value)
    assert load_ckpt(out)["iter_num"] == 4


# -----------------------------------------------------------------------------
# bad input: a one-line error that names the fix. The rest of the table (README, "What is tested")
# is covered in test_train.py and test_residual.py.

@pytest.fixture(scope="module")
def tiny_run(data_dir, tmp_path_factory):
    """A 2-iteration shakespeare_char run, for the cases that need a checkpoint."""
    out = tmp_path_factory.mktemp("tiny") / "out"
    train_once(tiny_args(data_dir, out, max_iters=2, gradient_accumulation_steps=1))
    return data_dir, out


def _vocab_mismatch(data, out, tmp):
    other = tiny_dataset(tmp / "data", 2000, 500, vocab=50)
    return ["train.py", *tiny_args(other, out, dataset="tiny", init_from="resume", max_iters=4)]


def _sample(start):
    return lambda data, out, tmp: ["sample.py", f"--out_dir={out}", f"--start={start(tmp)}", "--max_new_tokens=2"]


def _not_utf8(tmp):
    (tmp / "prompt.bin").write_bytes(b"\xff\xfe\x00\x81")
    return f"FILE:{tmp / 'prompt.bin'}"


@pytest.mark.parametrize("make, needles", [
    (_vocab_mismatch, ["vocab_size 65", "has 50", "use the dataset it was trained on"]),
    (_sample(lambda tmp: f"FILE:{tmp / 'missing.txt'}"), ["missing.txt", "No such file", "--start=FILE:"]),
    (_sample(lambda tmp: f"FILE:{tmp}"), ["cannot read the prompt file", "--start=FILE:"]),
    (_sample(_not_utf8), ["prompt.bin", "not UTF-8", "--start=FILE:"]),
], ids=["vocab-vs-checkpoint", "start-file-missing", "start-file-is-a-dir", "start-file-not-utf8"])
def test_bad_input_is_a_one_line_error(make, needles, tiny_run, tmp_path):
    data, out = tiny_run
    before = (out / "ckpt.pt").read_bytes()
    r = run([sys.executable, *map(str, make(data, out, tmp_path))])
    assert_one_line_error(r, *needles)
    assert (out / "ckpt.pt").read_bytes() == before  # a failed start never touches the checkpoint


FAILED_STARTS = {  # a configuration that fails, of each kind: its overrides of tiny_args and the error's words
    # the model's configuration (GPTConfig), and the nag recipe's keys
    "residual-mod-pair": (dict(residual="prenorm", mod="nag", mod_rate=0.25),
                          "mod=nag does not work with residual=prenorm; use mod=router, or residual=nag"),
    "nag-router-pair": (dict(residual="nag", mod="router", mod_rate=0.25),
                        "mod=router does not work with residual=nag; use mod=nag"),
    "skip-middle-odd-depth": (dict(residual="sandwich", mod="skip_middle", mod_rate=0.25, n_layer=3),
                              "n_layer must be even, got 3"),
    "mod-rate-without-mod": (dict(mod_rate=0.25), "mod_rate=0.25 needs a mod: set --mod=nag"),
    "heads": (dict(n_embd=100, n_head=3), "divisible by n_head (3)"),
    "nag-recipe": (dict(nag_gate_lr_scale=0.5), "only applies to residual=nag"),
    # numbers
    **{f"{key}=0": ({key: 0}, f"{key} must be a whole number > 0, got 0") for key in train.POSITIVE_KEYS},
    "max_iters=-5": (dict(max_iters=-5), "max_iters must be a whole number >= 0, got -5"),
    "max_flops=-1": (dict(max_flops=-1.0), "a FLOP budget must be a positive number"),
    "block_size": (dict(block_size=10 ** 6), "lower --block_size"),
    # the run's other settings
    "device": (dict(device="mps"), "unknown device 'mps': use auto, cpu, cuda or cuda:N"),
    "eval-only-from-scratch": (dict(eval_only=True), "eval_only evaluates a checkpoint: add --init_from=resume"),
    "gpt2": (dict(init_from="gpt2-medium"), "pretrained GPT-2 weights don't fit nanodepth's backbone (RoPE, RMSNorm, "
             "untied head); train from scratch (--init_from=scratch) or resume (--init_from=resume)"),
    "wandb-missing": (dict(wandb_log=True), "pip install wandb"),
    # the data, out_dir
    "missing-data": (dict(dataset="openwebtext"), "python data/openwebtext/prepare.py"),
    "unwritable": ({}, "cannot write to out_dir"),
}


@pytest.mark.parametrize("case", FAILED_STARTS)
def test_a_failed_start_leaves_out_dir_as_it_was(case, data_dir, tmp_path, in_process, monkeypatch):
    """Every check comes before out_dir is touched: a start from scratch that fails, for any reason, in
    an out_dir that holds an earlier run leaves every file there as it was (nothing moved into a folder of
    its own) and raises a one-line ConfigError."""
    overrides, message = FAILED_STARTS[case]
    out = tmp_path / "out"
    out.mkdir()
    (out / "ckpt.pt").write_bytes(b"an earlier run's checkpoint")
    (out / "log.jsonl").write_text('{"iter": 0}\n')
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    if case == "unwritable":  # root may write anywhere: the file system refuses the probe instead
        def refuse(*args, **kw):
            raise PermissionError(errno.EACCES, "Permission denied")
        monkeypatch.setattr(tempfile, "NamedTemporaryFile", refuse)
    if case == "wandb-missing":
        monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb fails
    with pytest.raises(ConfigError) as e:
        in_process(tiny_args(data_dir, out, **overrides))
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.parametrize("where", ["proc", "under-a-file", "a-file", "sysfs"])
def test_an_unwritable_out_dir_fails_at_the_start(where, data_dir, tmp_path, in_process):
    """An out_dir that cannot be made, or made but not written (/sys/kernel/mm, even for root), is a
    one-line error at the start, not a traceback at the first eval or checkpoint."""
    (tmp_path / "file").write_text("")
    out_dir = {"proc": "/proc/x", "under-a-file": tmp_path / "file" / "out", "a-file": tmp_path / "file",
               "sysfs": "/sys/kernel/mm"}[where]
    if where in ("proc", "sysfs") and not os.path.isdir(os.path.dirname(out_dir)):
        pytest.skip(f"no {os.path.dirname(out_dir)} here")
    with pytest.raises(ConfigError, match=rf"cannot write to out_dir {out_dir} \(.*\); use another --out_dir"):
        in_process(tiny_args(data_dir, out_dir, eval_iters=1))


# -----------------------------------------------------------------------------
# property test: random small configs build and take two training steps, or fail with a ValueError

def _config_strategy():
    draws = dict(
        residual=st.sampled_from(sorted(model_module.RESIDUALS)),
        n_layer=st.integers(1, 6), n_head=st.integers(1, 3), head_size=st.sampled_from([2, 4, 8]),
        block_size=st.integers(1, 16), nag_channels=st.integers(1, 4),
        blocks=st.one_of(st.none(), st.integers(1, 12)),
        mod=st.sampled_from(sorted(model_module.MODS)), mod_rate=st.sampled_from([0.0, 0.25, 0.5, 0.9]),
    )
    return st.fixed_dictionaries(draws)


def _build(d):
    kw = dict(residual=d["residual"], n_layer=d["n_layer"], n_head=d["n_head"], n_embd=d["n_head"] * d["head_size"],
              block_size=d["block_size"], vocab_size=65)
    if d["residual"] == "nag":  # a mode's option is set only with its mode
        kw["nag_channels"] = d["nag_channels"]
    if d["residual"] == "block_attnres" and d["blocks"] is not None:
        kw["attnres_blocks"] = min(d["blocks"], d["n_layer"])
    kw["mod"] = d["mod"]
    kw["mod_rate"] = d["mod_rate"] if d["mod"] != "none" else 0.0
    return kw


@settings(max_examples=15, deadline=None)
@given(_config_strategy(), st.integers(1, 3))
def test_random_valid_configs_train(d, batch):
    try:
        config = GPTConfig(**_build(d))
    except ValueError as e:  # only a residual/mod pair (or skip_middle's odd depth) may be refused
        assert d["mod"] != "none" and "mod" in str(e) and "\n" not in str(e), e
        return
    with torch.random.fork_rng():
        torch.manual_seed(0)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # tiny ops: one thread is faster on a shared box
        model = GPT(config)
        idx = torch.randint(0, 65, (batch, config.block_size))
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        # two real training steps (train.py's: clipping, fused AdamW, the non-finite skip, skip_middle's controller)
        optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95))
        stats = train.StepStats(config, idx.numel(), torch.device("cpu"))
        batches = iter([(idx, torch.roll(idx, -1, 1))] * 2)
        losses = [train.train_step(model, model, optimizer, torch.amp.GradScaler("cpu", enabled=False), batches,
                                   stats, accum=1, autocast=contextlib.nullcontext(), grad_clip=1.0) for _ in range(2)]
        frac_train = executed_fraction(stats.executed[-1][0], idx.numel())  # the last micro-step's
        model.eval()  # eval routing: thresholds tau from the training forwards
        with torch.no_grad():
            logits, _, executed = model(idx, executed=True)
        torch.set_num_threads(threads)
    assert all(torch.isfinite(loss) for loss in losses) and torch.isfinite(logits).all()
    assert stats.read() == (0, 0, 0)  # no step was skipped as non-finite
    assert all(torch.isfinite(p).all() for p in model.parameters())
    stepped = [p for p in model.parameters() if p in optimizer.state]
    assert stepped and all(float(optimizer.state[p]["step"]) == 2 for p in stepped)  # both steps were taken
    assert not torch.equal(model.lm_head.weight, before["lm_head.weight"])  # and they moved the weights
    for frac in (frac_train, executed_fraction(executed, idx.numel())):
        assert len(frac) == 2 * config.n_layer and all(0.0 <= f <= 1.0 for f in frac)
    if config.mod in ("nag", "router"):  # top-k: every sublayer runs its capacity k / T in training
        assert frac_train == pytest.approx([model_module.TopKMoD.keep_fraction(config)] * (2 * config.n_layer))
        assert torch.isfinite(model.mod.tau).all() == (config.mod_rate > 0)


INVALID = [  # one fault each, on top of a valid config
    dict(n_embd=7),  # n_head >= 2 in the base: not divisible
    dict(n_layer=0), dict(n_head=0), dict(block_size=0), dict(vocab_size=0),
    dict(residual="postnorm"), dict(residual=""), dict(nag_channels=0), dict(dropout=1.0), dict(dropout=-0.1),
    dict(kernels="cuda"), dict(residual="block_attnres", attnres_blocks=0),
    dict(residual="block_attnres", attnres_blocks=99),
    dict(mod="depth"), dict(mod_rate=1.0), dict(mod_rate=-0.1), dict(mod="none", mod_rate=0.25),
    dict(residual="prenorm", mod="nag"), dict(residual="nag", mod="router"),
    dict(residual="nag", mod="skip_middle"), dict(residual="sandwich", mod="skip_middle", n_layer=3),
    dict(residual="sandwich", mod="skip_middle", n_layer=2, skip_target=1.5),
    dict(residual="nag", mod="nag", skip_target=0.5),
]


@settings(max_examples=15, deadline=None)
@given(_config_strategy(), st.sampled_from(INVALID))
def test_random_invalid_configs_fail_with_a_message(d, fault):
    kw = dict(_build(d), n_head=2, n_embd=2 * d["head_size"], attnres_blocks=None)
    kw.update(fault)
    with pytest.raises(ValueError) as e:
        GPTConfig(**kw)
    assert str(e.value) and "\n" not in str(e.value)
