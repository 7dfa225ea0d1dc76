"""What train.py keeps and says about a run: earlier runs kept whole on a fresh start, resumes that take
the run from the checkpoint and say what they change, finished runs and eval_only, stops during an eval,
long evals and slow CPU runs, the progress line of short runs, the end-of-run summary.

Tiny in-process runs (train.main, one thread), as in test_train.py; a fake clock where time matters.
"""
import ast
import json
import os
import re
import shlex
import signal
import time
import types
from pathlib import Path

import pytest

import configurator
import guards
import run_config
import train
from configurator import ConfigError
from test_reliability import assert_same_run
from test_train import LOG_LINE, REPO, in_process, load_ckpt, read_log, tiny_args  # noqa: F401


def files(out_dir):
    """{name: bytes} of the files directly in out_dir."""
    return {p.name: p.read_bytes() for p in Path(out_dir).iterdir() if p.is_file()}


@pytest.fixture
def eval_batches(monkeypatch):
    """eval_batches(fn) -> a list that gets one entry per eval batch drawn; fn(n) is called before the
    n-th (from 1) of the whole process. Eval batches are the ones drawn with EVAL_SEED's generator."""
    def install(fn=lambda n: None):
        drawn, real = [], train.get_batch

        def hooked(path, batch_size, block_size, generator, device):
            if generator.initial_seed() == run_config.EVAL_SEED:
                drawn.append(1)
                fn(len(drawn))
            return real(path, batch_size, block_size, generator, device)
        monkeypatch.setattr(train, "get_batch", hooked)
        return drawn
    return install


@pytest.fixture
def fake_clock(monkeypatch):
    """train.py's clock moves only by what the test adds: clock.now[0] += seconds."""
    clock = types.SimpleNamespace(now=[1e9])
    monkeypatch.setattr(train, "time", types.SimpleNamespace(time=lambda: clock.now[0]))
    return clock


# -----------------------------------------------------------------------------
# 1. a fresh start keeps every earlier run

def test_three_fresh_starts_keep_all_three_runs(data_dir, tmp_path, in_process, capsys):
    """Seeds 1, 2, 3 started from scratch in one out_dir: the third is in out_dir, and each earlier one
    was moved whole (checkpoint, log, config.json) into a folder named by its start, which the start
    that moved it printed; config.json says how each started."""
    out = tmp_path / "out"
    moved = []
    for seed in (1, 2, 3):
        in_process(tiny_args(data_dir, out, seed=seed, max_iters=2, gradient_accumulation_steps=1, eval_iters=1))
        moved += re.findall(r"^\S+ held an earlier run \(started [\d-]+ [\d:]+\): moved its ckpt.pt, log.jsonl, "
                            r"config.json, final_eval.json to (\S+); sample it or resume it with --out_dir=(\S+)$",
                            capsys.readouterr().out, re.M)
    folders = sorted(p for p in out.iterdir() if p.is_dir())
    assert [Path(a) for a, b in moved] == [Path(b) for a, b in moved] == folders  # printed where each went
    assert all(re.fullmatch(r"run-\d{8}-\d{6}(-\d+)?", p.name) for p in folders), folders
    runs = [*folders, out]
    assert [load_ckpt(d)["config"]["seed"] for d in runs] == [1, 2, 3]
    for d, seed in zip(runs, (1, 2, 3)):
        assert {"ckpt.pt", "log.jsonl", "config.json", "final_eval.json"} <= set(files(d))
        assert [r["iter"] for r in read_log(d)] == [0, 2]
        record = json.loads((d / "config.json").read_text())
        assert record["config"]["seed"] == seed and f"--seed={seed}" in record["command"]
    assert not any((d / guards.LOCK_FILE).exists() for d in runs)  # the lock neither moved nor left behind
    for d in folders:  # each named by the start of the run it holds
        started = json.loads((d / "config.json").read_text())["started"]
        assert d.name.startswith(time.strftime("run-%Y%m%d-%H%M%S", time.localtime(started)))


def test_a_log_without_a_checkpoint_is_kept_too(data_dir, tmp_path, in_process):
    """An earlier run that never checkpointed (max_iters=0: the eval at iteration 0 alone) left a log: a
    fresh start moves it aside too, instead of deleting it."""
    out = tmp_path / "out"
    in_process(tiny_args(data_dir, out, max_iters=0, eval_iters=1, final_eval_tokens=0))
    old_log = (out / "log.jsonl").read_text()
    in_process(tiny_args(data_dir, out, max_iters=2, eval_iters=1))
    (folder,) = [p for p in out.iterdir() if p.is_dir()]
    assert (folder / "log.jsonl").read_text() == old_log and not (folder / "ckpt.pt").exists()
    assert [r["iter"] for r in read_log(out)] == [0, 2]


# -----------------------------------------------------------------------------
# 1. a resume says what it changes; a config file alone changes nothing

def write_config(path, args):
    """A config file holding tiny_args' settings (a list of --key=value)."""
    lines = []
    for a in args:
        key, value = a[2:].split("=", 1)
        try:
            value = ast.literal_eval(value)  # numbers, True/False, None
        except (SyntaxError, ValueError):
            pass  # a bare string: a path, a dataset
        lines.append(f"{key} = {value!r}")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_a_config_file_cannot_extend_a_resumed_run(data_dir, tmp_path, in_process, capsys):
    """A run shortened on the command line (--max_iters=4) and resumed with its config
    file (max_iters=8) alone is refused, naming the fix, with out_dir as it was; with --max_iters=8 the
    resume says what it changes (and the LR plan) before its first step, and trains on."""
    out = tmp_path / "out"
    config = write_config(tmp_path / "tiny.py", tiny_args(data_dir, out, max_iters=8, lr_decay_iters=8))
    in_process([config, "--max_iters=4"])
    before = files(out)
    with pytest.raises(ConfigError) as e:
        in_process([config, "--init_from=resume"])
    assert str(e.value) == (f"{config} would change the resumed run: max_iters=8 (the run has 4); a resume keeps "
                            f"the run's settings unless the command line changes them: pass --max_iters=8 to change "
                            f"them on purpose, or resume without {config} (the checkpoint has them)")
    assert files(out) == before
    capsys.readouterr()
    in_process([config, "--init_from=resume", "--max_iters=8"])
    stdout = capsys.readouterr().out
    lines = stdout.splitlines()
    change = lines.index("this resume changes the run: max_iters 4 -> 8 (--max_iters=8)")
    assert lines[change + 1] == ("the plan from iter 4: LR 7.75e-04, cosine down to min_lr 1.00e-04 at iter 8 "
                                 "(lr_decay_iters); the run ends at iter 8")
    assert change < min(i for i, x in enumerate(lines) if x.startswith("iter "))  # before the first step
    assert [r["iter"] for r in read_log(out)] == [0, 2, 4, 6, 8]


def test_a_resume_says_when_the_decay_stays_short(data_dir, tmp_path, in_process, capsys):
    """--max_iters alone extends the run but not the cosine: the resume says where the LR reaches min_lr
    and how to decay over the new length; other changes are listed with where they come from."""
    out = tmp_path / "out"
    in_process(tiny_args(data_dir, out, max_iters=4, lr_decay_iters=4, eval_iters=1))
    capsys.readouterr()
    in_process(tiny_args(data_dir, out, init_from="resume", max_iters=6, lr_decay_iters=None, eval_iters=1,
                         eval_interval=6))
    stdout = capsys.readouterr().out
    assert ("this resume changes the run: eval_interval 2 -> 6 (--eval_interval=6), max_iters 4 -> 6 "
            "(--max_iters=6)\n") in stdout
    assert ("the plan from iter 4: LR 1.00e-04, min_lr 1.00e-04 from iter 4; the run ends at iter 6 "
            "(to decay over the new length as well, add --lr_decay_iters=6)\n") in stdout
    assert [r["iter"] for r in read_log(out)] == [0, 2, 4, 6]


def test_a_resume_without_a_config_file_takes_the_run_from_the_checkpoint(data_dir, tmp_path, in_process):
    """`train.py --init_from=resume --out_dir=X` alone: the dataset, data_dir, batches, LR schedule and
    evals come from the checkpoint (before, the defaults' openwebtext was missing), and the run goes on
    exactly as the straight one (--max_iters extends it; --device and --dtype are this process's own)."""
    straight, out = tmp_path / "straight", tmp_path / "out"
    in_process(tiny_args(data_dir, straight))
    in_process(tiny_args(data_dir, out, max_iters=4))  # lr_decay_iters=8: the straight run's schedule
    in_process(["--init_from=resume", f"--out_dir={out}", "--max_iters=8", "--device=cpu", "--dtype=float32"])
    assert_same_run(out, straight)


def test_a_finished_run_says_so(data_dir, tmp_path, in_process, monkeypatch, capsys):
    """A resume at (or past) max_iters trains nothing and says the run is finished and how to extend it."""
    out = tmp_path / "out"
    in_process(tiny_args(data_dir, out, max_iters=2, eval_iters=1))
    before, steps, train_step = files(out), [], train.train_step
    monkeypatch.setattr(train, "train_step", lambda *args, **kw: steps.append(1) or train_step(*args, **kw))
    capsys.readouterr()
    in_process(tiny_args(data_dir, out, init_from="resume", max_iters=2, eval_iters=1))
    assert (f"the run in {out} is finished: it is at iter 2, max_iters=2, so there is nothing to train. To train "
            f"on, resume with a larger --max_iters (and --lr_decay_iters for the LR to decay over it), e.g. "
            f"--max_iters=4 --lr_decay_iters=4; --eval_only=True evaluates it; python sample.py --out_dir={out} "
            f"samples from it") in capsys.readouterr().out
    assert not steps and files(out) == before


def stop_at(it, micro, signum=signal.SIGTERM):
    """A batch_generator that sends signum when iteration it's micro-step `micro` is drawn (one ahead)."""
    real = train.batch_generator

    def hooked(seed, iter_num, m):
        if (iter_num, m) == (it, micro):
            os.kill(os.getpid(), signum)
        return real(seed, iter_num, m)
    return hooked


def test_eval_only_resume_evaluates_at_any_iteration(data_dir, tmp_path, in_process, monkeypatch, capsys):
    """A run stopped by a signal before iteration 5 (not an eval iteration) resumed with --eval_only=True
    evaluates it: the losses printed and logged, the checkpoint as it was."""
    out = tmp_path / "out"
    monkeypatch.setattr(train, "batch_generator", stop_at(4, 1))
    with pytest.raises(train.Interrupted):
        in_process(tiny_args(data_dir, out))
    monkeypatch.undo()
    before = (out / "ckpt.pt").read_bytes()
    assert load_ckpt(out)["iter_num"] == 5 and [r["iter"] for r in read_log(out)] == [0, 2, 4]
    capsys.readouterr()
    in_process(tiny_args(data_dir, out, init_from="resume", eval_only=True))
    (line,) = re.findall(r"^step 5: train loss ([\d.]+), val loss ([\d.]+)$", capsys.readouterr().out, re.M)
    log = read_log(out)
    assert [r["iter"] for r in log] == [0, 2, 4, 5] and float(line[1]) == pytest.approx(log[-1]["val_loss"], abs=1e-4)
    assert (out / "ckpt.pt").read_bytes() == before


# -----------------------------------------------------------------------------
# 2. a stop during an eval

def test_a_signal_during_an_eval_stops_at_the_next_batch(data_dir, tmp_path, in_process, eval_batches, monkeypatch,
                                                         capsys):
    """SIGINT during the eval at iteration 4 (its 3rd of 8 batches): the eval stops after that batch, the
    checkpoint (state before iteration 4) says the eval is due, and the printed resume command runs it
    first: the resumed run equals the straight one."""
    straight, out = tmp_path / "straight", tmp_path / "out"
    in_process(tiny_args(data_dir, straight, eval_iters=4))
    drawn = eval_batches(lambda n: os.kill(os.getpid(), signal.SIGINT) if n == 2 * 8 + 3 else None)
    with pytest.raises(train.Interrupted) as e:
        in_process(tiny_args(data_dir, out, eval_iters=4))
    assert len(drawn) == 2 * 8 + 3  # evals at 0 and 2, then 3 batches of the one at 4
    assert "eval at iter 4: stopped by SIGINT; a resume runs it first" in capsys.readouterr().out
    ckpt = load_ckpt(out)
    assert ckpt["iter_num"] == 4 and ckpt["eval_due"] and [r["iter"] for r in read_log(out)] == [0, 2]
    message = str(e.value)
    assert e.value.signum == signal.SIGINT and "before iteration 4 (its eval broken off" in message
    cmd = shlex.split(message.split("Resume with: ")[1])
    monkeypatch.setattr(train, "get_batch", run_config.get_batch)  # no more signals
    in_process(cmd[2:])
    assert_same_run(out, straight)


def test_a_second_signal_exits_at_once_and_writes_nothing(data_dir, tmp_path, in_process, eval_batches,
                                                          monkeypatch):
    """A second Ctrl-C while the stop's checkpoint is being written ends the run there: ckpt.pt is the
    one from before (the eval at 2), no temp file is left, the signal handlers are given back."""
    out = tmp_path / "out"
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    eval_batches(lambda n: os.kill(os.getpid(), signal.SIGINT) if n == 2 * 2 + 1 else None)  # the eval at 4
    saved, real_save = [], train.save_checkpoint

    def save(obj, path):
        saved.append(obj["iter_num"])
        if obj["iter_num"] == 4:  # the stop's checkpoint
            before.append((out / "ckpt.pt").read_bytes())
            os.kill(os.getpid(), signal.SIGINT)  # the handler raises here: nothing is written
        return real_save(obj, path)
    before = []
    monkeypatch.setattr(train, "save_checkpoint", save)
    with pytest.raises(train.Interrupted) as e:
        in_process(tiny_args(data_dir, out, eval_iters=1))
    assert saved == [2, 4] and load_ckpt(out)["iter_num"] == 2 and (out / "ckpt.pt").read_bytes() == before[0]
    assert not (out / "ckpt.pt.tmp").exists()
    assert str(e.value).startswith(f"stopped at once by a second signal: no checkpoint written for this stop; "
                                   f"{out / 'ckpt.pt'} is as it was (iter 2). Resume with: python train.py")
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers


def test_a_long_eval_shows_its_progress_and_warns_on_the_cpu(data_dir, tmp_path, in_process, eval_batches,
                                                              fake_clock, capsys):
    """An eval of 2 x 40 batches (eval_iters=40: train, then val) at 5 s each (fake clock): every 10 s a line
    with the batches done of each split and the time left, and on the CPU, since the eval takes over 5
    minutes, one warning that says so and what to do."""
    def batch(n):
        fake_clock.now[0] += 5.0
    eval_batches(batch)
    in_process(tiny_args(data_dir, tmp_path / "out", max_iters=0, final_eval_tokens=0, eval_iters=40))
    captured = capsys.readouterr()
    progress = re.findall(r"^eval at iter 0: train (\d+)/40, val (\d+)/40 batches in (\S+), about (\S+) left "
                          r"\(Ctrl-C stops it\)$", captured.out, re.M)
    assert [(int(t), int(v)) for t, v, _, _ in progress] == [(min(d, 40), max(d - 40, 0)) for d in range(2, 80, 2)]
    assert progress[0] == ("2", "0", "10s", "6m30s") and progress[-1] == ("40", "38", "6m30s", "10s")
    (warning,) = [x for x in captured.err.splitlines() if x.startswith("WARNING: on the CPU")]
    assert warning.startswith("WARNING: on the CPU each eval of this run takes about 6m40s (80 batches of 4 x 32 "
                              "tokens); a configuration sized for a GPU? On a CPU: config/shakespeare_char_cpu.py")


def test_a_slow_cpu_run_warns_from_its_first_steps(data_dir, tmp_path, in_process, fake_clock, monkeypatch, capsys):
    """On the CPU at 20 s a step (fake clock), 1000 iterations are about 5.5 hours: the first progress line
    with a pace (5 steps in, though log_interval is 100) comes with a warning giving that estimate."""
    train_step = train.train_step

    def step(*args, **kw):
        fake_clock.now[0] += 20.0
        return train_step(*args, **kw)
    monkeypatch.setattr(train, "train_step", step)
    monkeypatch.setattr(train, "batch_generator", stop_at(7, 0))  # stop the run once the warning is out
    with pytest.raises(train.Interrupted):
        in_process(tiny_args(data_dir, tmp_path / "out", max_iters=1000, lr_decay_iters=1000, eval_interval=500,
                             log_interval=100, eval_iters=1))
    captured = capsys.readouterr()
    assert [m[0] for m in LOG_LINE.findall(captured.out)] == ["5"]
    (warning,) = [x for x in captured.err.splitlines() if x.startswith("WARNING")]
    assert warning.startswith("WARNING: on the CPU this run takes about 5h31m more at its first steps' pace "
                              "(20,000 ms/iter, evals about 0s each, to iter 1000)")


def test_a_slow_run_of_the_cpu_config_does_not_suggest_the_cpu_config(data_dir, tmp_path, in_process, fake_clock,
                                                                       monkeypatch, capsys):
    """The same slow first steps, run from config/shakespeare_char_cpu.py: the hint names a loaded machine,
    not the config that is already running."""
    train_step = train.train_step

    def step(*args, **kw):
        fake_clock.now[0] += 20.0
        return train_step(*args, **kw)
    monkeypatch.setattr(train, "train_step", step)
    monkeypatch.setattr(train, "batch_generator", stop_at(7, 0))
    with pytest.raises(train.Interrupted):
        in_process([guards.CPU_CONFIG, *tiny_args(data_dir, tmp_path / "out", max_iters=1000, lr_decay_iters=1000,
                                                 eval_interval=500, log_interval=100, eval_iters=1)])
    (warning,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("WARNING")]
    assert "other work on the cores? (this run's configuration is already the CPU one)" in warning
    assert "On a CPU: config/shakespeare_char_cpu.py" not in warning


def test_float16_on_the_cpu_warns(data_dir, tmp_path, in_process, capsys):
    in_process(tiny_args(data_dir, tmp_path / "out", dtype="float16", max_iters=0, final_eval_tokens=0, eval_iters=1))
    err = capsys.readouterr().err  # how much slower depends on the CPU (1.2x to 11x measured): no "over 10x"
    assert "WARNING: float16 on the CPU is slower than float32, by a factor that depends on the CPU" in err
    assert "over 10x" not in err


@pytest.mark.parametrize("native", [True, False])
def test_bfloat16_on_a_cpu_without_it_warns(native, data_dir, tmp_path, in_process, monkeypatch, capsys):
    monkeypatch.setattr(train, "cpu_computes_bf16", lambda: native)
    in_process(tiny_args(data_dir, tmp_path / "out", dtype="bfloat16", max_iters=0, final_eval_tokens=0, eval_iters=1))
    err = capsys.readouterr().err
    assert ("WARNING: this CPU has no bfloat16 instructions (AVX512-BF16): its bfloat16 matmuls are emulated"
            in err) == (not native)


# -----------------------------------------------------------------------------
# 2. the progress line of a short run, the end-of-run summary

@pytest.mark.parametrize("max_iters, line_at", [(4, 3), (8, 5)])
def test_a_run_shorter_than_log_interval_shows_its_pace(max_iters, line_at, data_dir, tmp_path, in_process,
                                                        capsys):
    """log_interval=100 and max_iters 4 or 8: a progress line with ms/iter and the ETA at the last
    iteration or 5 steps in, whichever comes first (besides iteration 0's, which has no timing)."""
    in_process(tiny_args(data_dir, tmp_path / "out", max_iters=max_iters, log_interval=100, eval_iters=1))
    assert [int(m[0]) for m in LOG_LINE.findall(capsys.readouterr().out)] == [line_at]


@pytest.mark.parametrize("always_save", [True, False])
def test_the_end_of_a_run_says_what_it_left(always_save, data_dir, tmp_path, in_process, capsys):
    """The last lines: iterations, time, final and best val loss, the checkpoint (the last model, or with
    always_save_checkpoint=False the best) and the sample.py command, which samples from it."""
    out = tmp_path / "out"
    in_process(tiny_args(data_dir, out, always_save_checkpoint=always_save))
    log = read_log(out)
    final, best = log[-1]["val_loss"], min(r["val_loss"] for r in log)
    lines = capsys.readouterr().out.strip().splitlines()
    assert re.fullmatch(rf"done: iter 8/8 in \S+ \(evals included\); val loss {final:.4f} at the end, "
                        rf"best {best:.4f}", lines[-2]), lines[-2]
    ckpt = load_ckpt(out)
    kept = "the last model" if always_save else "the best model"
    assert lines[-1] == (f"checkpoint: {out / 'ckpt.pt'} ({kept}: iter {ckpt['iter_num']}, val "
                         f"{[r['val_loss'] for r in log if r['iter'] == ckpt['iter_num']][0]:.4f}); sample from it: "
                         f"python sample.py --out_dir={out}")
    if not always_save:
        assert ckpt["best_val_loss"] == pytest.approx(best, abs=1e-6)


def test_a_start_in_the_same_second_as_a_kept_run_gets_its_own_folder(tmp_path):
    """Two runs that started in the same second: the second one set aside goes to run-<start>-2 (then -3),
    never over the first, deterministically (a fresh start hits this only by timing luck)."""
    out = tmp_path / "out"
    out.mkdir()
    started = 1_790_000_000.0
    name = time.strftime("run-%Y%m%d-%H%M%S", time.localtime(started))
    kept = out / name
    kept.mkdir()
    (kept / "ckpt.pt").write_bytes(b"the kept run")
    for n, content in ((2, b"second"), (3, b"third")):
        (out / "config.json").write_text(json.dumps({"started": started}))
        (out / "ckpt.pt").write_bytes(content)
        folder = guards.set_aside_previous_run(str(out))
        assert Path(folder) == out / f"{name}-{n}" and (Path(folder) / "ckpt.pt").read_bytes() == content
        assert not (out / "ckpt.pt").exists()
    assert (kept / "ckpt.pt").read_bytes() == b"the kept run"


def test_a_resume_sets_a_torn_last_log_line_aside(data_dir, tmp_path, in_process, capsys):
    """log.jsonl's last line cut mid-write (no newline), twice: each resume moves the torn bytes to
    log.jsonl.torn, after the ones before (both kept, in order), says so, and its own evals follow as whole
    lines; every line of the log is JSON and no eval is lost."""
    out = tmp_path / "out"
    in_process(tiny_args(data_dir, out, max_iters=4))
    for torn, max_iters in (('{"iter": 99, "val_loss": ', 6), ('{"iter": 98', 8)):
        with open(out / "log.jsonl", "a") as f:
            f.write(torn)
        capsys.readouterr()
        in_process(tiny_args(data_dir, out, init_from="resume", max_iters=max_iters))
        assert (f"its last line was cut mid-write ({len(torn)} bytes, no newline): moved to"
                in capsys.readouterr().out)
    lines = (out / "log.jsonl").read_text().splitlines()
    assert [json.loads(line)["iter"] for line in lines] == [0, 2, 4, 6, 8]
    assert (out / "log.jsonl.torn").read_text() == '{"iter": 99, "val_loss": \n{"iter": 98\n'


def test_two_torn_lines_both_survive_in_order(tmp_path):
    """repair_torn_log appends to log.jsonl.torn: a second repair keeps the first's bytes, and a whole log
    (or none) is left as it is."""
    log, torn = tmp_path / "log.jsonl", tmp_path / "log.jsonl.torn"
    assert guards.repair_torn_log(str(log)) == 0 and not torn.exists()  # no log yet
    log.write_text('{"iter": 0}\n{"iter": 2, "val')
    assert guards.repair_torn_log(str(log)) == len('{"iter": 2, "val')
    with open(log, "a") as f:
        f.write('{"iter": 2}\n{"it')
    assert guards.repair_torn_log(str(log)) == len('{"it')
    assert guards.repair_torn_log(str(log)) == 0  # whole now: nothing moves
    assert log.read_text() == '{"iter": 0}\n{"iter": 2}\n'
    assert torn.read_text() == '{"iter": 2, "val\n{"it\n'


def test_a_reader_skips_a_bad_log_line_and_names_it(tmp_path, capsys):
    """plot.py and flops.py read logs with run_config.load_log: a line that is not JSON is skipped with a
    warning naming it, not the whole log refused."""
    (tmp_path / "log.jsonl").write_text('{"iter": 0, "val_loss": 4.0}\n{"iter": 2, "val_l\n{"iter": 4, "val_loss": 3.0}\n')
    assert [r["iter"] for r in run_config.load_log(tmp_path)] == [0, 4]
    assert f"{tmp_path / 'log.jsonl'} line 2 is not JSON (cut mid-write?): skipped" in capsys.readouterr().err


def test_a_full_disk_during_a_save_is_one_line_and_the_log_matches_the_checkpoint(data_dir, tmp_path, monkeypatch):
    """The save of iter 4 fails with ENOSPC: one line that says the checkpoint of iter 2 is as it was and how to
    resume; log.jsonl holds no eval that the checkpoint does not (it used to read 0, 2, 4 and then 4 again after
    the resume), and the resume then goes on as a straight run."""
    import errno
    from test_train import assert_one_line_error, run_train_here
    real, saves = train.save_checkpoint, []

    def full(obj, path):
        saves.append(obj["iter_num"])
        if obj["iter_num"] == 4:
            with open(path + ".tmp", "wb") as f:
                f.write(b"half a checkpoint")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(obj, path)
    monkeypatch.setattr(train, "save_checkpoint", full)
    out = tmp_path / "out"
    r = run_train_here(tiny_args(data_dir, out, max_iters=8))
    line = assert_one_line_error(r, "could not write the checkpoint of iter 4 (No space left on device)",
                                 f"{out / 'ckpt.pt'} is as it was (iter 2)", "resume with: python train.py")
    assert "--init_from=resume" in line and saves == [2, 4]
    assert not (out / "ckpt.pt.tmp").exists() and load_ckpt(out)["iter_num"] == 2
    assert [x["iter"] for x in read_log(out)] == [0, 2]
    monkeypatch.setattr(train, "save_checkpoint", real)
    r = run_train_here(tiny_args(data_dir, out, max_iters=8, init_from="resume"))
    assert r.returncode == 0, r.stderr
    assert [x["iter"] for x in read_log(out)] == [0, 2, 4, 6, 8]


# -----------------------------------------------------------------------------
# train.py's texts: --help, and the docs' list of what a fresh start moves

DANGLING = {"a", "an", "and", "as", "by", "for", "from", "its", "of", "or", "than", "the", "this", "with"}  # ("to": "attends to")


def test_no_help_line_of_train_py_ends_mid_sentence():
    """--help prints the comment on each key's line (configurator.key_comments): a description that goes on
    to the next line is cut there. Each one says something, closes every bracket it opens and does not end
    on a comma, a colon or a word that needs another after it."""
    comments = configurator.key_comments(run_config.HELP_FROM)
    for key in run_config.DEFAULTS:
        text = comments.get(key, "")
        assert text, f"{key}: no help"
        for opening, closing in ("()", "[]"):
            assert text.count(opening) == text.count(closing), f"{key}: {text!r}"
        assert not text.endswith((",", ":", ";", "-")), f"{key}: {text!r}"
        assert text.split()[-1].lower() not in DANGLING, f"{key}: {text!r}"


def test_the_docs_list_the_files_a_fresh_start_moves():
    """docs/training.md names the files set_aside_previous_run moves (guards.RUN_FILES), in its order."""
    text = (REPO / "docs" / "training.md").read_text()
    paragraph = text.split("**A fresh start keeps every earlier run.**")[1].split("\n\n")[0]
    listed = re.search(r"moves that run's files \((.*?)whichever\s+exist", paragraph, re.S).group(1)
    assert tuple(re.findall(r"`([^`]+)`", listed)) == guards.RUN_FILES
