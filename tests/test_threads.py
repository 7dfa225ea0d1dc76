"""train.py's CPU threads (run_config.pick_threads): torch's own count on idle cores, fewer when other work
keeps cores busy at the start, what the user pins kept."""
import os
import subprocess
import sys
import time

import pytest
import torch

import run_config
from configurator import ConfigError

CPU = torch.device("cpu")


@pytest.fixture
def threads(monkeypatch):
    """torch's threads restored after the test; OMP_NUM_THREADS unset inside it (the suite pins it)."""
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("free, chosen", [(2.0, 2), (1.6, 2), (1.4, 1), (0.9, 1), (0.0, 1)])
def test_the_threads_follow_the_free_cores(threads, monkeypatch, free, chosen):
    """Rounded to the nearest whole core, at least 1, never more than torch's own count."""
    monkeypatch.setattr(run_config, "free_cores", lambda: (2, free))
    line = run_config.pick_threads(0, CPU)
    assert torch.get_num_threads() == chosen
    if chosen == 2:
        assert line == "2 threads"
    else:  # the start-up line says why, and how to take every core
        assert line == f"1 thread: {free:.1f} of 2 cores free at the start (--threads=2 takes 2)"


def test_what_the_user_pins_is_kept(threads, monkeypatch):
    monkeypatch.setattr(run_config, "free_cores", lambda: (2, 0.2))  # a busy machine
    assert run_config.pick_threads(3, CPU) == "3 threads (--threads)" and torch.get_num_threads() == 3
    torch.set_num_threads(2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert run_config.pick_threads(0, CPU) == "2 threads (OMP_NUM_THREADS)" and torch.get_num_threads() == 2
    monkeypatch.setattr(run_config, "free_cores", lambda: pytest.fail("a GPU run reads no load"))
    assert run_config.pick_threads(0, torch.device("cuda")) == "" and torch.get_num_threads() == 2
    with pytest.raises(ConfigError, match=r"--threads=-1: give a whole number >= 0"):
        run_config.pick_threads(-1, CPU)


def test_free_cores_sees_a_busy_core():
    """A process spinning on one core leaves at most cores - 1/2 free; /proc/stat is read for this
    process's own cores."""
    cores, free = run_config.free_cores()
    if free is None or cores < 2:
        pytest.skip("needs /proc/stat and 2 cores")
    assert cores == len(os.sched_getaffinity(0)) and 0.0 <= free <= cores + 0.05
    spin = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 3: pass"])
    try:
        time.sleep(0.3)  # the spinner is running
        _, busy = run_config.free_cores(seconds=0.3)
    finally:
        spin.kill()
        spin.wait()
    assert busy < cores - 0.5


def test_a_resume_keeps_its_own_threads():
    """--threads is this process's setting, as --device is: a resume never takes the checkpoint's run's count
    (another machine, another load), while a run setting such as eval_iters comes from the checkpoint."""
    from guards import resumed_config
    taken = resumed_config(dict(run_config.DEFAULTS), {"threads": 2, "eval_iters": 7}, explicit=set())
    assert taken == {"eval_iters": 7}


def test_train_py_takes_the_threads_key(threads, monkeypatch):
    """--threads reaches torch through train.py's start (start_processes), and the start-up line gets its words."""
    import train
    monkeypatch.setattr(run_config, "free_cores", lambda: pytest.fail("a pinned count reads no load"))
    cfg = dict(run_config.DEFAULTS, device="cpu", threads=1)
    *_, line, follower = train.start_processes(cfg)
    assert torch.get_num_threads() == 1 and line == "1 thread (--threads)" and follower.mark is None  # pinned: not followed


class FakeMachine:
    """A 2-core machine's clock, this process's CPU time and /proc/stat's ticks, moved on by hand."""

    def __init__(self, monkeypatch):
        self.now, self.cpu, self.idle, self.total = 100.0, 10.0, 0, 0
        monkeypatch.setattr(run_config, "own_cores", lambda: [0, 1])
        monkeypatch.setattr(run_config, "core_ticks", lambda cores: (self.idle, self.total))
        monkeypatch.setattr(run_config.time, "monotonic", lambda: self.now)
        monkeypatch.setattr(run_config.time, "process_time", lambda: self.cpu)

    def run(self, seconds, ours, others):
        """seconds pass with this process on `ours` cores and other work on `others`; 100 ticks a second a core."""
        self.now, self.cpu = self.now + seconds, self.cpu + ours * seconds
        self.total += 200 * seconds
        self.idle += round(100 * seconds * max(0.0, 2 - min(2.0, ours + others)))


def test_the_threads_follow_load_that_comes_after_the_start(threads, monkeypatch):
    """Other work that starts during the run takes threads away at the next check (every CHECK_S seconds), and
    gives them back when it ends; this process's own CPU time (its spinning threads too) is not other work."""
    machine = FakeMachine(monkeypatch)
    follower = run_config.ThreadFollower(0, CPU)
    machine.run(6, ours=2.0, others=0.0)  # alone: both cores are ours
    assert follower.check() is None and torch.get_num_threads() == 2
    machine.run(1, ours=1.0, others=1.0)
    assert follower.check() is None  # before CHECK_S: not read
    machine.run(5, ours=1.0, others=1.0)  # a process spinning on a core since the last check
    assert follower.check() == "threads: 2 -> 1, 1.0 of 2 cores free over the last 6s (--threads=N pins the count)"
    assert torch.get_num_threads() == 1
    machine.run(6, ours=1.0, others=0.3)  # 1.7 free: rounded to 2
    assert follower.check() == "threads: 1 -> 2, 1.7 of 2 cores free over the last 6s (--threads=N pins the count)"
    machine.run(6, ours=1.4, others=0.6)  # 1.4 free (the busy time less ours): 1
    assert follower.check().startswith("threads: 2 -> 1, 1.4 of 2") and torch.get_num_threads() == 1
    machine.run(6, ours=1.0, others=5.0)  # more than the cores: at least one thread
    assert follower.check() is None and torch.get_num_threads() == 1


def test_a_pinned_count_does_not_follow(threads, monkeypatch):
    """--threads, OMP_NUM_THREADS, a GPU run, no /proc/stat: the count never changes, whatever the load."""
    machine = FakeMachine(monkeypatch)
    followers = [run_config.ThreadFollower(2, CPU), run_config.ThreadFollower(0, torch.device("cuda"))]
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    followers.append(run_config.ThreadFollower(0, CPU))
    monkeypatch.delenv("OMP_NUM_THREADS")

    def unreadable(cores):
        raise OSError("no /proc/stat")
    with monkeypatch.context() as m:
        m.setattr(run_config, "core_ticks", unreadable)
        followers.append(run_config.ThreadFollower(0, CPU))
    control = run_config.ThreadFollower(0, CPU)  # followed
    machine.run(10, ours=1.0, others=1.0)  # one core taken
    assert [f.check() for f in followers] == [None] * 4 and torch.get_num_threads() == 2
    assert control.check().startswith("threads: 2 -> 1") and torch.get_num_threads() == 1


def test_a_cpu_run_keeps_the_memory_its_steps_free(threads, monkeypatch):
    """keep_freed_memory asks glibc to serve buffers up to 32 MiB from the heap and never to trim it (a CPU step's
    freed activations come back for the next step, without fresh page faults); a GPU run, or a C library
    without mallopt, is left alone; train.py's start does it for a CPU run."""
    calls = []

    class Libc:
        def mallopt(self, param, value):
            calls.append((param, value))
            return 1
    monkeypatch.setattr(run_config.ctypes, "CDLL", lambda name: Libc())
    assert run_config.keep_freed_memory(CPU) is True
    assert calls == [(-3, 32 * 2 ** 20), (-1, 2 ** 31 - 1)]  # malloc.h: M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
    calls.clear()
    assert run_config.keep_freed_memory(torch.device("cuda")) is False and calls == []
    monkeypatch.setattr(run_config.ctypes, "CDLL", lambda name: object())  # no mallopt (not glibc)
    assert run_config.keep_freed_memory(CPU) is False
    seen = []
    import train
    monkeypatch.setattr(train, "keep_freed_memory", seen.append)
    train.start_processes(dict(run_config.DEFAULTS, device="cpu", threads=1))
    assert seen == [CPU]
