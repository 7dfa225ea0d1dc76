"""bench.py runs on a CPU and prints one row per kernel, per residual mode and per MoD setting."""
import contextlib
import csv
import io
import math
import re
import statistics
import sys
import time
import types
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench  # noqa: E402
import multiplier  # noqa: E402
import train  # noqa: E402
from configurator import ConfigError  # noqa: E402
from model import RESIDUALS  # noqa: E402
from test_flops import tiny_train_config  # noqa: E402


@pytest.fixture(autouse=True)
def one_thread():
    """These tests check bench's tables, not the CPU's speed: one intra-op thread (tiny ops on a busy
    2-core box are many times slower with 2), as test_train.py's in-process runs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def tiny_steps(monkeypatch):
    """The timed steps (and saved activations) of the model, MoD and compile sections at most 2 layers
    deep, 32 wide, T = 16 instead of the CPU's 4 to 16 layers, 128 wide, T = 64: the same code, each
    config really built, stepped and measured, in a fraction of the time."""
    real = bench.step_shape

    def tiny(title, device, dtype, use_compile, batch_size, cpu_layers, layers=0):
        shape, B = real(title, device, dtype, use_compile, batch_size, cpu_layers, layers)
        return dict(shape, n_layer=min(shape["n_layer"], 2), n_head=2, n_embd=32, block_size=16), B
    monkeypatch.setattr(bench, "step_shape", tiny)


def test_bench_prints_every_kernel_and_mode(capsys, monkeypatch, tiny_steps):
    saved, measure = [], bench.saved_activation_bytes  # the model table's saved bytes, in its order
    monkeypatch.setattr(bench, "saved_activation_bytes", lambda *args, **kw: saved.append(measure(*args, **kw)) or saved[-1])
    times = bench.main(["--section=all", "--reps=1", "--compile=False", "--batch_size=2"])
    out = capsys.readouterr().out
    modes = [*RESIDUALS, *bench.VARIANTS]  # the modes, then the options timed beside them
    saved = dict(zip(modes, saved, strict=True))
    assert set(RESIDUALS) <= set(times) and all(t > 0 for t in times.values())
    for name in ("rms_norm", "nag_update", "depth_attention", "mhc_pre_mix", "sinkhorn", "hc_post_mix",
                 "dense_mix_dwa", "dense_mix_mudd"):
        assert f"| {name} | eager |" in out  # every kernel (hc/mhc's three were once left out)
    for residual in RESIDUALS:
        assert f"| {residual} |" in out
    # the model table: each mode's ratio is its own step time over prenorm's, and its saved activations
    # over prenorm's (attnres keeps every sublayer's output: more than prenorm)
    model_section, bounds = out.split("## model step")[1].split("##")[0].split("What each step moves")

    def table(text):
        return {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
                for line in text.splitlines() if line.startswith("| ") and not line.startswith("| residual")}
    rows = table(model_section)
    for residual in modes:
        ms, ratio, _, _, saved_mib, saved_ratio = rows[residual]
        assert ratio == f"{times[residual] / times['prenorm']:.2f}x"
        assert saved_mib == f"{saved[residual] / 2 ** 20:.1f}"
        assert saved_ratio == f"{saved[residual] / saved['prenorm']:.2f}x"
    assert saved["attnres"] > saved["prenorm"]
    # what each step moves: a row per mode, its step time as in the first table, and the fitted parts
    moved = table(bounds)
    assert set(moved) == set(modes) and "fit over the rows" in bounds
    for residual in modes:
        *_, kb, kb_ratio, ops, ops_ratio, ms, parts = moved[residual]
        assert ms == f"{times[residual] * 1e3:.1f}" and int(ops) > 0 and float(kb) > 0
        assert len(parts.split(" + ")) == 3
    assert int(moved["mhc"][4]) > int(moved["prenorm"][4])  # Sinkhorn's iterations: more ops than prenorm
    for residual, mod in bench.MOD_RUNS:
        assert all((residual, mod, rate) in times for rate in (0.0, 0.25, 0.5))
        assert f"| {residual} | {mod} | 0.5 |" in out


def test_traffic_counts_ops_and_bytes_and_the_fit_recovers_known_costs():
    """Traffic: an add of two 1000-float tensors is one op moving 12,000 bytes; a view moves nothing. The fit
    returns the per-unit costs that made a set of synthetic times."""
    a, b = torch.randn(1000), torch.randn(1000)
    traffic = bench.Traffic()
    with traffic:
        c = a + b
        c.view(10, 100).t()
    assert (traffic.ops, traffic.bytes) == (1, 12000)
    counts = {name: (f, by, o) for name, f, by, o in
              [("a", 1e9, 1e8, 1000), ("b", 2e9, 1e8, 3000), ("c", 1e9, 5e8, 2000), ("d", 3e9, 2e8, 9000)]}
    times = {name: 2e-12 * f + 3e-11 * by + 5e-6 * o for name, (f, by, o) in counts.items()}
    assert bench.fit_step_time(times, counts) == pytest.approx([2e-12, 3e-11, 5e-6], rel=1e-6)
    assert bench.fit_step_time(dict(list(times.items())[:3]), counts) is None  # 3 rows: no fit


def test_bench_rejects_an_unknown_section():
    with pytest.raises(ConfigError, match="unknown section"):
        bench.main(["--section=kernel", "--reps=1"])


@pytest.mark.parametrize("arg", ["--pairs=0", "--pairs=-1", "--max_iters=0", "--tokens=-5"])
def test_a_count_below_one_is_a_one_line_error(arg):
    """quickstart's and sample's counts: 0 or less used to end in a traceback (a median of nothing)."""
    with pytest.raises(ConfigError, match=f"{arg}: give a whole number >= 1"):
        bench.main(["--section=quickstart", arg])


NUMBERS = [k for k, v in bench.DEFAULTS.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]


def test_every_number_key_is_checked():
    """Every numeric key of DEFAULTS has its least value in COUNTS (whole numbers) or is max_minutes: a new
    key without a check fails here."""
    assert set(NUMBERS) == set(bench.COUNTS) | {"max_minutes"}


@pytest.mark.parametrize("key", NUMBERS)
def test_a_number_below_its_least_is_a_one_line_error_before_anything_runs(key, monkeypatch):
    """`--section=kernels --reps=-3` exited 0 with every row "failed: IndexError", `--section=model --layers=-1`
    gave a traceback: each numeric key below its least value is a one-line error before any device is picked
    or model built."""
    monkeypatch.setattr(bench, "pick_device", lambda *a, **k: pytest.fail(f"bench ran with a bad --{key}"))
    monkeypatch.setattr(bench, "bench_gpu", lambda *a: pytest.fail(f"bench ran with a bad --{key}"))
    least = bench.COUNTS.get(key, 0)
    bad = [least - 1, -3] if key in bench.COUNTS else [0.0, -1.5]  # a value of another type: configure's error
    for section in ("kernels", "model", "gpu"):
        for value in bad:
            with pytest.raises(ConfigError, match=f"^--{key}={value}: give a ") as e:
                bench.main([f"--section={section}", f"--{key}={value!r}"])
            assert "\n" not in str(e.value)


def test_help_lists_every_section(capsys):
    """`bench.py --help` left steps out of its sections: the section key's help names every one of SECTIONS."""
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.split()[:1] == ["section"]]
    assert set(bench.SECTIONS) <= set(re.findall(r"\w+", line.split("'all'", 1)[1]))


def test_bench_compile_prints_every_mode_and_variant(capsys, tiny_steps):
    """--section=compile's table (one layer and two modes here, to stay quick): each mode in every
    variant, with saved-activation ratios to prenorm (the compiled ones through AOTAutograd's partitioner,
    as bench measures them); and every compiled row really compiled. All GPTs share one dynamo cache, so a
    table of more compiled models than recompile_limit (the 5 modes x 2 of the real section against 8) used
    to time the last ones eager: here 4 models against a limit of 2. The timed models' backend records
    Dynamo's graph and runs it as it is (no AOTAutograd: what is tested is that Dynamo compiled each row;
    compiled forwards and backwards are test_compile.py's)."""
    graphs = []

    def recording(gm, example_inputs):  # noting the custom ops of each graph Dynamo compiles
        graphs.append(any("nanodepth" in str(n.target) for n in gm.graph.nodes if n.op == "call_function"))
        return gm.forward
    with torch._dynamo.config.patch(recompile_limit=2):
        times, saved = bench.bench_compile(torch.device("cpu"), torch.float32, reps=1, batch_size=2,
                                           backend=recording, layers=1, saved_layers=1,
                                           residuals=("prenorm", "attnres"))
    out = capsys.readouterr().out
    for residual in ("prenorm", "attnres"):
        for variant in bench.COMPILE_VARIANTS:
            assert times[(residual, variant)] > 0 and saved[(residual, variant)] > 0
            assert f"| {residual} | {variant} |" in out
    assert saved[("attnres", "eager")] > saved[("prenorm", "eager")]  # its sources are saved too
    # one graph per compiled row, in order: references fused (no custom op), then the custom ops kept
    assert graphs == [False, True] * 2


def test_saved_activation_bytes_count_each_storage_once():
    """Two sublayers reading one source save it once: the figure is bytes of distinct storages."""
    from model import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=8, vocab_size=65, n_layer=1, n_head=2, n_embd=16))
    idx = torch.zeros(2, 8, dtype=torch.long)
    seen = []

    def pack(t):
        seen.append(t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx, idx)
    distinct = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in seen}
    assert len(distinct) < len(seen)  # some storages are saved more than once
    assert bench.saved_activation_bytes(model, idx) == sum(distinct.values())


def test_bench_quickstart_times_both_commands(capsys, monkeypatch):
    """--section=quickstart runs train.py and the nanoGPT-like baseline on the quickstart config in
    interleaved pairs (who goes first alternates) and prints the median wall and CPU times, their ratios and
    each run's final val loss. Here each command line bench builds really runs, in this process (train.cli,
    and bench.py's `baseline` dispatch to baseline_train) with 2 eval batches of 4 rows appended, and a
    stubbed run_timed gives each run known wall and CPU times: medians that differ from the means, so a
    table of the means would show."""
    walls = {"train.py": [3.0, 9.0, 4.0], "bench.py": [2.0, 1.0, 5.0]}  # medians 4.0, 2.0; means 5.33, 2.67
    cpus = {"train.py": [6.0, 1.0, 9.0], "bench.py": [4.0, 3.0, 2.0]}  # medians 6.0, 3.0
    calls, final = [], {"train.py": [], "bench.py": []}

    fine, timed = [], []

    def run_in_process(cmd, cwd, stop_below=None, stop_at_iter=None):
        assert cmd[0] == sys.executable and Path(cwd) == Path(bench.REPO)
        if stop_below is not None:  # the time-to-loss run: its first eval at or below the pair's baseline loss
            assert stop_below == final["bench.py"][-1] and f"--eval_interval={bench.TO_LOSS_EVALS}" in cmd
            fine.append(cmd)
            return 99.0, 99.0, "", [(5.0, 4.3, 0), (7.0 + len(fine), stop_below, 25 * len(fine))]
        if stop_at_iter is not None:  # ours as timed, stopped at the iteration the last one found
            assert stop_at_iter == 25 * len(fine) and cmd[:-2] == calls[-2 if len(timed) % 2 == 0 else -1][:-1]
            assert cmd[-2] == f"--log_interval={bench.TO_LOSS_EVALS}" and cmd[-1].startswith("--out_dir=")
            timed.append(cmd)
            return [3.0, 1.0, 2.0][len(timed) - 1], 99.0, "", [(1.0, 4.2, 0)]  # median 2.0
        script = cmd[1]
        calls.append(cmd)
        argv = cmd[3:] if cmd[1:3] == ["bench.py", "baseline"] else cmd[2:]
        out = io.StringIO()
        with contextlib.redirect_stdout(out), torch.random.fork_rng():
            (bench.baseline_train if script == "bench.py" else train.cli)(argv + ["--eval_iters=2", "--batch_size=4"])
        # both print train.py's eval line, the last one at iteration 3
        evals = re.findall(r"^step (\d+): train loss [\d.]+, val loss ([\d.]+)$", out.getvalue(), re.M)
        assert evals[0][0] == "0" and evals[-1][0] == "3", out.getvalue()
        final[script].append(float(evals[-1][1]))
        k = len(final[script]) - 1
        return walls[script][k], cpus[script][k], out.getvalue(), [(1.0 + float(s), float(v), int(s)) for s, v in evals]
    monkeypatch.setattr(bench, "run_timed", run_in_process)
    result = bench.bench_quickstart(pairs=3, max_iters=3)
    out = capsys.readouterr().out
    # the commands: the quickstart config cut to 3 iterations, the LR schedule too, each run its own out_dir
    assert [c[1] for c in calls] == ["train.py", "bench.py", "bench.py", "train.py", "train.py", "bench.py"]
    assert len({c[-1] for c in calls}) == 6 and all(c[-1].startswith("--out_dir=") for c in calls)
    for c in calls:  # train.py without its final eval on the whole val split: the baseline has none
        assert (c[-2] == "--final_eval_tokens=0") == (c[1] == "train.py")
        c[:] = c[:-2] if c[1] == "train.py" else c[:-1]
        assert c[-3:] == [bench.QUICKSTART, "--max_iters=3", "--lr_decay_iters=3"]
    (ours, ours_loss), (base, base_loss) = result.values()
    assert (ours, base) == (4.0, 2.0)
    assert (ours_loss, base_loss) == (final["train.py"], final["bench.py"])  # each run's last val loss
    assert all(3.0 < x < 4.6 for x in ours_loss + base_loss)  # near ln(65) = 4.17 after 3 iterations
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ") and "command" not in line]
    assert [r[0].strip() for r in rows] == list(result)
    assert [r[1].strip() for r in rows] == ["4.0", "2.0"]
    assert rows[0][2].strip() == "2.00x" and rows[1][2].strip() == "1.00x"
    assert [r[3].strip() for r in rows] == ["6.0", "3.0"] and rows[0][4].strip() == "2.00x"
    assert rows[0][5].strip() == " ".join(f"{x:.4f}" for x in ours_loss)
    assert rows[1][5].strip() == " ".join(f"{x:.4f}" for x in base_loss)
    # reached at iterations 25, 50, 75 at 8, 9, 10 s with the evals (median 9), ours stopped there at 3, 1, 2 s
    assert len(fine) == len(timed) == 3
    assert ": 2.0 s, 1.00x the peer's wall (our run stopped at the iteration where it first reached it, evaluated " \
           "every 25: median 50); with those evals at most 9.0 s, 4.50x" in out


@pytest.fixture
def nanogpt_dir(tmp_path):
    """A stand-in nanoGPT checkout: the files bench checks for."""
    (tmp_path / "config").mkdir()
    (tmp_path / "data" / "shakespeare_char").mkdir(parents=True)
    for name in ("train.py", "config/train_shakespeare_char.py", "data/shakespeare_char/train.bin",
                 "data/shakespeare_char/val.bin", "data/shakespeare_char/meta.pkl"):
        (tmp_path / name).write_text("")
    return tmp_path


def test_bench_quickstart_against_nanogpt_itself(capsys, monkeypatch, nanogpt_dir):
    """--nanogpt=DIR: nanoGPT's own train.py in DIR at the quickstart's recipe against ours as the README runs
    it (final eval included), interleaved; after each pair, ours again with an eval every TO_LOSS_EVALS
    iterations, stopped at its first eval at or below that pair's nanoGPT last val loss: the median of those
    times against nanoGPT's median wall."""
    nano = iter([(20.0, 10.0, 2.30), (30.0, 12.0, 2.50), (25.0, 11.0, 2.40)])  # wall, CPU, last val loss
    ours = iter([(18.0, 9.0), (22.0, 13.0), (19.0, 10.0)])
    to_loss = iter([(14.0, 300), (8.0, 250), (7.0, 225)])  # median 8 s, iteration 250
    to_iter = iter([9.0, 6.0, 5.5])  # median 6 s
    calls = []

    def fake(cmd, cwd, stop_below=None, stop_at_iter=None):
        calls.append((cmd, cwd, stop_below, stop_at_iter))
        if stop_below is not None:
            t, it = next(to_loss)
            return 99.0, 99.0, "", [(3.0, 4.2, 0), (t, stop_below - 0.01, it)]
        if stop_at_iter is not None:
            return next(to_iter), 99.0, "", [(3.0, 4.2, 0)]
        if Path(cwd) == Path(bench.REPO):
            wall, cpu = next(ours)
            return wall, cpu, "", [(3.0, 4.2, 0), (wall - 1, 2.0, 600)]
        wall, cpu, last = next(nano)
        return wall, cpu, "", [(2.0, 4.16, 0), (wall - 1, last, 500)]
    monkeypatch.setattr(bench, "run_timed", fake)
    monkeypatch.setattr(bench, "cores_busy", lambda: 0.12)
    result = bench.bench_quickstart(pairs=3, max_iters=600, nanogpt=str(nanogpt_dir))
    out = capsys.readouterr().out
    kinds = ["to-loss" if c[2] is not None else "to-iter" if c[3] is not None else
             "ours" if Path(c[1]) == Path(bench.REPO) else "peer" for c in calls]
    assert kinds == ["ours", "peer", "to-loss", "to-iter", "peer", "ours", "to-loss", "to-iter",
                     "ours", "peer", "to-loss", "to-iter"]
    for (cmd, cwd, _, _), kind in zip(calls, kinds):
        assert cmd[-1].startswith("--out_dir=")
        if kind == "peer":  # nanoGPT's own command, cut as ours is
            assert Path(cwd) == nanogpt_dir and cmd[1:-1] == [*bench.NANOGPT_ARGS, "--max_iters=600", "--lr_decay_iters=600"]
        else:  # ours as the README runs it: its final eval is not switched off, but in the time-to-loss run
            assert cmd[1:4] == ["train.py", bench.QUICKSTART, "--max_iters=600"]
            assert any(a.startswith("--final_eval_tokens") for a in cmd) == (kind == "to-loss")
            assert ("--log_interval=25" in cmd) == (kind == "to-iter")  # its progress line at each 25 iterations
    # each time-to-loss run stops at its own pair's nanoGPT loss, each timed run at the iteration that one found
    assert [c[2] for c in calls if c[2] is not None] == [2.30, 2.50, 2.40]
    assert [c[3] for c in calls if c[3] is not None] == [300, 250, 225]
    (ours_wall, _), (peer_wall, peer_losses) = result.values()
    assert (ours_wall, peer_wall) == (19.0, 25.0) and peer_losses == [2.30, 2.50, 2.40]
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ") and "command" not in line]
    assert rows[0][2].strip() == "0.76x" and rows[0][4].strip() == "0.91x"  # 19 / 25 wall; 10 / 11 CPU
    assert "the cores were 12% busy in the second before the first run" in out
    assert "per pair, our wall / the peer's: 0.90 0.73 0.76;" in out  # each pair's own ratio: 18/20, 22/30, 19/25
    assert "time to the peer's last val loss (2.4000): 6.0 s, 0.24x the peer's wall (our run stopped at the " \
           "iteration where it first reached it, evaluated every 25: median 250); with those evals at most 8.0 s, " \
           "0.32x" in out


def test_cores_busy_reads_the_kernels_counters(tmp_path, monkeypatch):
    """Busy = 1 - (idle + iowait ticks) / all ticks between two reads of /proc/stat's first line: here 100
    ticks pass, 30 of them idle and 10 iowait, so 60% busy; no counters: None."""
    stat = tmp_path / "stat"
    reads = iter(["cpu  100 0 50 800 20 0 5 0 0 0\n", "cpu  150 0 60 830 30 0 5 0 0 0\n"])
    monkeypatch.setattr(bench.time, "sleep", lambda s: stat.write_text(next(reads)))
    stat.write_text(next(reads))
    assert bench.cores_busy(stat=str(stat)) == pytest.approx(0.6)
    assert bench.cores_busy(0.0, stat=str(tmp_path / "none")) is None


def test_cpu_name_reads_the_model_name(tmp_path, monkeypatch):
    """The CPU a timing ran on: /proc/cpuinfo's first "model name" (the header bench prints names it); a file
    without one, or none at all, falls back to the platform module's name."""
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9R14\n\n"
                    "processor\t: 1\nmodel name\t: AMD EPYC 9R14\n")
    assert bench.cpu_name(str(info)) == "AMD EPYC 9R14"
    monkeypatch.setattr(bench.platform, "processor", lambda: "x86_64")
    info.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\n")
    assert bench.cpu_name(str(info)) == "x86_64"
    assert bench.cpu_name(str(tmp_path / "none")) == "x86_64"
    monkeypatch.setattr(bench, "cpu_name", lambda: "AMD EPYC 9R14")  # what bench prints and records a CPU as
    threads = torch.get_num_threads()
    assert bench.device_label(torch.device("cpu")) == f"CPU (AMD EPYC 9R14, {threads} thread{'s' if threads > 1 else ''})"


def test_pair_ratios_reads_the_pairs_as_pairs():
    """Interleaved pairs' wall ratios: their geometric mean and a t-interval over the pairs. Ratios 1.21, 1.00
    and 1.10: logs 2a, 0, a (a = ln 1.1), mean a, sd a, se a / sqrt(3); t(2) = 4.303: exp(a -+ 2.484 a) =
    0.87-1.39. The ratio of the medians (1.10 / 1.00 here too) would hide that spread; a normal interval
    (1.96) would give 0.99-1.23, and an interval over unpaired runs another width."""
    line = bench.pair_ratios([12.1, 20.0, 11.0], [10.0, 20.0, 10.0])
    assert line == "per pair, our wall / the peer's: 1.21 1.00 1.10; geometric mean 1.10x, 95% interval " \
                   "0.87-1.39x (t over the 3 pairs)"
    assert bench.pair_ratios([3.0], [4.0]).endswith("0.75; geometric mean 0.75x (one pair: no interval)")


def test_bench_quickstart_names_the_fix_for_a_bad_nanogpt_dir(tmp_path, nanogpt_dir):
    with pytest.raises(ConfigError, match="not a nanoGPT checkout.*git clone https://github.com/karpathy/nanoGPT"):
        bench.nanogpt_checkout(str(tmp_path / "nothing"))
    assert bench.nanogpt_checkout(str(nanogpt_dir / ".." / nanogpt_dir.name)) == str(nanogpt_dir)
    (nanogpt_dir / "data" / "shakespeare_char" / "val.bin").unlink()
    with pytest.raises(ConfigError, match=r"not prepared.*cp .*input.txt .* && python .*prepare.py"):
        bench.nanogpt_checkout(str(nanogpt_dir))


def test_run_timed_stamps_each_eval_line_and_counts_the_childs_cpu():
    """run_timed reads the child's output as it comes (unbuffered): each eval line gets the time it was printed,
    and the CPU time is the child's own (a busy loop of about 0.4 s), not the parent's."""
    script = ("import time\nprint('step 0: train loss 4.0, val loss 4.1000')\nt = time.process_time()\n"
              "while time.process_time() - t < 0.4: pass\nprint('step 250: train loss 2.0, val loss 2.2500')\n"
              "time.sleep(0.3)\nprint('done')")
    wall, cpu, out, evals = bench.run_timed([sys.executable, "-c", script], bench.REPO)
    assert [(v, it) for _, v, it in evals] == [(4.1, 0), (2.25, 250)] and out.endswith("done\n")
    assert evals[1][0] - evals[0][0] >= 0.35 and wall - evals[1][0] >= 0.25  # stamped when printed
    assert 0.35 <= cpu < wall
    # stopped at the first eval at or below 2.5: killed there, no error, nothing after it read
    wall, _, out, evals = bench.run_timed([sys.executable, "-c", script], bench.REPO, stop_below=2.5)
    assert [v for _, v, _ in evals] == [4.1, 2.25] and "done" not in out and wall < evals[1][0] + 0.25
    # stopped at the first progress line of iteration 25 or later: the line of 20 does not stop it
    script = ("import time\nprint('iter 20/600: loss 3.0')\nprint('iter 25/600: loss 2.9, lr 1e-3')\n"
              "time.sleep(0.3)\nprint('done')")
    wall, _, out, _ = bench.run_timed([sys.executable, "-c", script], bench.REPO, stop_at_iter=25)
    assert out.endswith("iter 25/600: loss 2.9, lr 1e-3\n") and wall < 0.3 + 1.0
    with pytest.raises(RuntimeError, match=r"failed \(exit 3\):\n.*boom"):
        bench.run_timed([sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"], bench.REPO)


# known per-pair times and routed skipped fractions for --section=sample with time_generate stubbed:
# medians (times) and means (skipped fractions) differ, so a table that used the other would show
SAMPLE_TIMES = {"dense": [2.0, 5.0, 1.0], "routed": [1.6, 1.2, 9.0], "skip_all": [0.5, 0.3, 4.0]}
SAMPLE_SKIPPED = {"dense": [0.0] * 3, "routed": [0.2, 0.25, 0.45], "skip_all": [1.0] * 3}


# routed medians 1.6 and 1.45 against dense 2.0: saved 20% and 27.5%, either side of 0.8 x 30% skipped
@pytest.mark.parametrize("routed", [[1.6, 1.2, 9.0], [1.45, 1.2, 9.0]], ids=["target-not-met", "target-met"])
def test_bench_sample_times_dense_and_routed(capsys, monkeypatch, routed):
    """--section=sample with the timed generate() stubbed to known times and skipped fractions: the
    table and the summary line are their medians (times) and means (skipped) through the documented
    formulas: saved = 1 - routed / dense, bound = skipped x (1 - skip_all / dense)."""
    times, calls, tokens = dict(SAMPLE_TIMES, routed=routed), [], 1000

    def fake_time_generate(model, n, device, dtype):
        tau = model.mod.tau  # what bench_sample set: nan dense, inf skip_all, the eval thresholds routed
        name = "dense" if tau.isnan().all() else "skip_all" if tau.isinf().all() else "routed"
        i = calls.count(name)
        calls.append(name)
        return times[name][i], {"executed": [n * (1 - SAMPLE_SKIPPED[name][i])] * len(model.sublayers), "tokens": n}
    monkeypatch.setattr(bench, "time_generate", fake_time_generate)
    result = bench.main(["--section=sample", "--device=cpu", f"--tokens={tokens}", "--pairs=3", "--layers=1",
                         "--width=8"])
    out = capsys.readouterr().out
    assert calls == ["dense", "routed", "skip_all"] * 3  # interleaved
    t = {name: statistics.median(v) for name, v in times.items()}
    skipped = statistics.mean(SAMPLE_SKIPPED["routed"])
    assert result == {("sample", name): t[name] / tokens for name in t}  # seconds per token
    rows = {r[1].strip(): [c.strip() for c in r[2:4]] for r in (line.split("|") for line in out.splitlines())
            if len(r) == 5}
    assert rows["dense (thresholds off)"] == [f"{tokens / t['dense']:.0f}", "0.000"]
    assert rows["mod=nag eval routing"] == [f"{tokens / t['routed']:.0f}", f"{skipped:.3f}"]
    assert rows["every sublayer skipped"] == [f"{tokens / t['skip_all']:.0f}", "1.000"]
    line = re.search(r"routed / dense = ([\d.]+)x: saved (-?[\d.]+%) for ([\d.]+%) skipped \(target: saved >= "
                     r"0.8 x skipped = ([\d.]+%): (met|not met)\); at most (-?[\d.]+%) at this shape.* skipped is "
                     r"([\d.]+%) of a dense one", out)
    assert line, out
    saved = 1 - t["routed"] / t["dense"]
    assert line.groups() == (f"{t['routed'] / t['dense']:.3f}", f"{saved:.1%}", f"{skipped:.1%}",
                             f"{0.8 * skipped:.1%}", "met" if saved >= 0.8 * skipped else "not met",
                             f"{skipped * (1 - t['skip_all'] / t['dense']):.1%}", f"{t['skip_all'] / t['dense']:.1%}")


def test_bench_sample_random_model_shape(capsys):
    """--layers and --width shape the random model, sampled for real: the routed run skips some tokens,
    dense none and skip_all every one; a width the 4 heads cannot split is a one-line error."""
    bench.main(["--section=sample", "--device=cpu", "--tokens=8", "--pairs=1", "--layers=2", "--width=32"])
    out = capsys.readouterr().out
    assert "(2 layers, 32 wide, mod=nag at mod_rate 0.25)" in out
    skipped = {r[1].strip(): float(r[3]) for r in (line.split("|") for line in out.splitlines())
               if len(r) == 5 and r[3].strip()[:1].isdigit()}
    assert skipped["dense (thresholds off)"] == 0.0 and skipped["every sublayer skipped"] == 1.0
    assert 0.05 < skipped["mod=nag eval routing"] < 0.6  # thresholds set at mod_rate 0.25 skip some tokens
    with pytest.raises(ConfigError, match="multiple of 4"):
        bench.main(["--section=sample", "--device=cpu", "--tokens=2", "--pairs=1", "--width=30"])


def test_baseline_model_is_nanogpts():
    """The baseline has nanoGPT's parameters: learned positions, LayerNorms with biases, a tied head."""
    model = bench.BaselineGPT(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128)
    d = 128
    per_block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    assert sum(p.numel() for p in model.parameters()) == 65 * d + 64 * d + 4 * per_block + 2 * d
    assert model.lm_head.weight is model.wte.weight
    torch.manual_seed(0)
    loss = model(torch.randint(0, 65, (2, 64)), torch.randint(0, 65, (2, 64)))
    assert abs(loss.item() - torch.log(torch.tensor(65.0)).item()) < 0.3  # small init: near-uniform logits


def fake_clock(durations):
    """A stand-in for bench's time module: each perf_counter() pair that brackets a timed call measures the
    next of `durations` (cycled)."""
    state = {"t": 0.0, "calls": 0}

    def perf_counter():
        state["calls"] += 1
        if state["calls"] % 2 == 0:  # the call that ends a measurement
            state["t"] += durations[(state["calls"] // 2 - 1) % len(durations)]
        return state["t"]
    return types.SimpleNamespace(perf_counter=perf_counter, time=time.time)


@pytest.mark.parametrize("durations, warning", [
    ([1.0], None),  # whole seconds: exact in floating point, so equal measurements tie exactly
    ([1.0, 1.0, 9.0, 1.0, 5.0], "16 measurement(s) unsteady (worst: rms_norm eager forward: its repeats "
                                      "spread by 400% of their median)"),
    ([2.0] * 5 + [1.0] * 5, "8 measurement(s) unsteady (worst: rms_norm eager: the forward alone took 2.0x its "
                              "forward+backward)"),
], ids=["quiet", "spread", "forward-slower"])
def test_bench_kernels_times_each_and_warns_when_loaded(capsys, monkeypatch, durations, warning):
    """--section=kernels times every kernel of kernels.py (the real calls, a stubbed clock): one eager row
    each, forward and forward+backward. Under load it once printed a 24 ms forward beside a 0.46 ms
    forward+backward: repeats that spread by more than half their median, or a forward slower than its
    forward+backward, now end the output with a warning that the machine is loaded; steady repeats print none."""
    monkeypatch.setattr(bench, "time", fake_clock(durations))
    bench.main(["--section=kernels", "--reps=5", "--compile=False", "--device=cpu"])
    out = capsys.readouterr().out
    names = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ") and "| eager |" in line]
    assert names == ["rms_norm", "nag_update", "depth_attention", "mhc_pre_mix", "sinkhorn", "hc_post_mix",
                     "dense_mix_dwa", "dense_mix_mudd"]
    if warning is None:
        assert "warning" not in out
    else:
        assert out.strip().splitlines()[-1] == (f"warning: the machine looks loaded: {warning}, so these figures are "
                                                f"unreliable; rerun on a quiet machine (or with more --reps)")


def test_bench_sample_missing_checkpoint_names_the_out_dir():
    """bench.py reads a trained run: no checkpoint asks for its --out_dir, not for --init_from=scratch."""
    with pytest.raises(ConfigError) as e:
        bench.main(["--section=sample", "--device=cpu", "--out_dir=/nonexistent-run"])
    assert "pass --out_dir=DIR" in str(e.value) and "init_from" not in str(e.value)


def test_the_quickstart_time_is_the_readmes():
    """docs/experiments.md gave its own quickstart time (3.6 min) beside the README's: the page now points to
    the README, the one place with the quiet machine's time, and states no minutes of its own."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "experiments.md").read_text()
    run = text.split("**The quickstart run.**")[1].split("\n\n")[0]
    assert not re.search(r"\d+(\.\d+)? ?min", run), run
    assert "[README](../README.md)" in run and "quiet machine" in run


def test_bench_steps_times_every_cell_against_its_baseline(capsys, tmp_path, data_dir, monkeypatch):
    """--section=steps builds each cell of a sweep config as its runs are (the value_residual cell's own key
    included), pairs it with its depth's prenorm cell, and writes every round's two times to the CSV that
    flops.py multiplier --step_times reads back: the printed median ratio is the CSV's, and the rounds' order
    alternates (so a cell timed first in every round would show)."""
    base = tiny_train_config(data_dir, tmp_path)
    sweep = tmp_path / "sweep.py"
    sweep.write_text(f"train_config = {str(base)!r}\nresiduals, depths = [], []\nruns = ["
                     "('prenorm_L1', {'residual': 'prenorm', 'n_layer': 1}), "
                     "('prenorm_L2', {'residual': 'prenorm', 'n_layer': 2}), "
                     "('nag_L2', {'residual': 'nag', 'n_layer': 2}), "
                     "('vr_L2', {'residual': 'prenorm', 'value_residual': 'half', 'n_layer': 2})]\n")
    built, real = [], bench.train_step
    bench_steps_csv = tmp_path / "steps.csv"

    def recording(config, *args, **kw):
        built.append(config)
        return real(config, *args, **kw)
    order = []
    real_timeit = bench.timeit

    def timing(fn, device, reps, warmup=3, what="a measurement"):
        if what.startswith("step of "):
            order.append(what[len("step of "):])
        return real_timeit(fn, device, reps, warmup, what)
    monkeypatch.setattr(bench, "train_step", recording)
    monkeypatch.setattr(bench, "timeit", timing)
    ratios = bench.main(["--section=steps", f"--sweep={sweep}", "--rounds=3", f"--steps_out={bench_steps_csv}",
                         "--device=cpu"])
    assert [(c.n_layer, c.residual, c.value_residual) for c in built] == [
        (1, "prenorm", "none"), (2, "prenorm", "none"), (2, "nag", "none"), (2, "prenorm", "half")]
    assert order == [*["prenorm_L1", "prenorm_L2", "nag_L2", "vr_L2"], *["vr_L2", "nag_L2", "prenorm_L2", "prenorm_L1"],
                     *["prenorm_L1", "prenorm_L2", "nag_L2", "vr_L2"]]
    with open(bench_steps_csv) as f:
        rows = list(csv.DictReader(f))
    assert [(r["cell"], r["baseline"], r["round"]) for r in rows] == [
        (c, "prenorm_L2", str(i)) for c in ("nag_L2", "vr_L2") for i in range(3)]
    assert set(ratios) == {"nag_L2", "vr_L2"}
    assert ratios["nag_L2"] == pytest.approx([float(r["ms"]) / float(r["baseline_ms"]) for r in rows[:3]], rel=1e-3)
    out = capsys.readouterr().out
    assert "| nag_L2 | prenorm_L2 | 2 |" in out and f"| {statistics.median(ratios['nag_L2']):.3f} |" in out
    read, device = multiplier.read_step_times(str(bench_steps_csv))  # one run: [[log ratio per round]]
    assert len(read["vr_L2"]) == 1 and device == f"CPU ({bench.cpu_name()}, 1 thread)"  # the CPU named
    assert [math.exp(x) for x in read["vr_L2"][0]] == pytest.approx(ratios["vr_L2"], rel=1e-3)
    again, _ = multiplier.read_step_times(f"{bench_steps_csv},{bench_steps_csv}")  # a list: one entry per run
    assert again["nag_L2"] == read["nag_L2"] * 2 and set(again) == {"nag_L2", "vr_L2"}
    with pytest.raises(ConfigError, match="add --sweep="):
        bench.main(["--section=steps"])
