"""bench.py --section=gpu, the one command for every GPU figure, run as its dry run: tiny shapes on the CPU,
the kernels checked in Triton's interpreter, the same code and the same two output files (here in a tmp
folder). Every kernel, residual mode and MoD setting gets its row; a wrong kernel is recorded as FAIL and the
rest still runs; the cap skips what does not fit and says so; a run cut short leaves valid files."""
import json
import re
import types
from pathlib import Path

import pytest
import torch

import bench
import kernels
from configurator import ConfigError
from model import RESIDUALS

triton = pytest.importorskip("triton")
KERNELS = ("rms_norm", "nag_update", "depth_attention", "mhc_pre_mix", "sinkhorn", "hc_post_mix", "dense_mix_dwa",
           "dense_mix_mudd")


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny ops on a busy 2-core box are many times slower with 2 threads (as tests/test_bench.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def md_tables(text):
    """{part: [row cells]} of the Markdown file's tables, each under its '## part (...)' heading."""
    tables = {}
    for section in text.split("\n## ")[1:]:
        part = section.split(" ", 1)[0]
        tables[part] = [[c.strip() for c in line.split("|")[1:-1]] for line in section.splitlines()
                        if line.startswith("| ") and not set(line) <= set("|- ")][1:]  # the header row left out
    return tables


def read(path):
    path = Path(path)
    return path.read_text(), json.loads(path.with_suffix(".json").read_text())


class Planted:
    """A Triton kernel launched as it is, then its output (argument `out`) moved by 0.5, or a launch that
    raises: a kernel the gpu section must record as FAIL."""

    def __init__(self, kernel, out=None):
        self.kernel, self.out = kernel, out

    def __getitem__(self, grid):
        def launch(*args, **kw):
            if self.out is None:
                raise RuntimeError("planted launch failure")
            self.kernel[grid](*args, **kw)
            args[self.out].add_(0.5)
        return launch


correctness = bench.gpu_correctness


def planted_correctness(*args):
    """The correctness part with two planted faults: nag_update's forward kernel writes a wrong r_new, and
    sinkhorn's forward launch raises (the timed parts after it run the real kernels)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "_nag_fwd", Planted(kernels._nag_fwd, out=3))  # (R, U, A, R_NEW, ...)
        mp.setattr(kernels, "_sinkhorn_fwd", Planted(kernels._sinkhorn_fwd))
        correctness(*args)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """One whole dry run (two modes compiled in the modes part, so it stays quick), its correctness part
    with the planted faults."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("gpu") / "results.md"
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(bench, "gpu_correctness", planted_correctness)
            data = bench.main(["--section=gpu", "--dry_run=True", f"--results={path}", "--compiled=prenorm,nag"])
    finally:
        torch.set_num_threads(threads)
    return path, data


def test_gpu_dry_run_writes_every_figure(dry_run):
    """The files hold the device, the versions and the command; a row for every kernel (checked in fp32 and
    bf16, timed against the copy), every residual mode (checked compiled, timed eager, the two asked for
    compiled too), every MoD setting; ratios that are the rows' own figures over their baseline's; nothing
    skipped; and the Markdown tables are the JSON's rows."""
    path, data = dry_run
    text, saved = read(path)
    assert saved == data  # the JSON holds what the run returned, written last at its end
    meta = saved["meta"]
    assert (meta["torch"], meta["triton"], meta["cuda"]) == (torch.__version__, triton.__version__, torch.version.cuda)
    assert meta["dry_run"] and "--section=gpu" in meta["command"] and meta["device"]
    assert f"torch {torch.__version__}, triton {triton.__version__}" in text and meta["command"] in text
    assert saved["status"] == "finished" and saved["pending"] == [] and saved["skipped"] == []
    assert "Skipped: nothing." in text
    parts = saved["parts"]
    assert list(parts) == list(bench.GPU_PARTS) and all(p["seconds"] > 0 for p in parts.values())
    rows = {part: p["rows"] for part, p in parts.items()}

    # correctness: every kernel in both dtypes and every mode's compiled step (the planted ones: next test)
    checks = [(r["check"], r["dtype"]) for r in rows["correctness"]]
    assert checks == [(name, dtype) for dtype in ("fp32", "bf16") for name in KERNELS] + \
        [(f"compiled step: {residual}", "fp32") for residual in [*RESIDUALS, *bench.VARIANTS]]

    # bandwidth: the copy, then each kernel against it
    copy, *timed = rows["bandwidth"]
    assert copy["kernel"] == "copy (clone)" and [r["kernel"] for r in timed] == list(KERNELS)
    for r in timed:
        assert r["of_copy"] == f"{r['fwd_gbs'] / copy['fwd_bwd_gbs']:.0%}, {r['fwd_bwd_gbs'] / copy['fwd_bwd_gbs']:.0%}"

    # modes: every mode eager, the two asked for compiled; each ratio is its own time over prenorm's
    modes = {(r["residual"], r["variant"]): r for r in rows["modes"]}
    tokens = bench.DRY_SHAPES["batch"] * bench.DRY_SHAPES["steps"]["block_size"]
    assert set(modes) == {(m, "eager") for m in [*RESIDUALS, *bench.VARIANTS]} | \
        {("prenorm", "compiled"), ("nag", "compiled")}
    for (residual, variant), r in modes.items():
        assert r["vs_prenorm"] == pytest.approx(r["ms"] / modes[("prenorm", variant)]["ms"])
        assert r["tokens_s"] == pytest.approx(tokens / (r["ms"] / 1e3))
        if not torch.cuda.is_available():  # (with a GPU the dry run runs on it, tiny)
            assert r["mfu"] is None and r["memory_gib"] is None  # a CPU: no peak FLOP/s, no CUDA memory
    assert modes[("nag", "eager")]["target"].startswith("<= 1.02x: ")

    # MoD: nag and router at each rate, against their own dense step
    mod = {(r["residual"], r["mod"], r["mod_rate"]): r for r in rows["mod"]}
    assert set(mod) == {(r, m, rate) for r, m in bench.MOD_RUNS for rate in (0.0, 0.25, 0.5)}
    for (r, m, rate), row in mod.items():
        assert row["vs_dense"] == pytest.approx(row["ms"] / mod[(r, m, 0.0)]["ms"])
    assert mod[("nag", "nag", 0.25)]["target"].startswith("<= 0.80x: ")

    # the Markdown file holds the same tables, row for row
    tables = md_tables(text)
    for part, part_rows in rows.items():
        assert len(tables[part]) == len(part_rows) and all(len(r) == len(bench.GPU_COLUMNS[part]) for r in tables[part])
    assert ["rms_norm", "bf16", "5x24", "ok"] in [r[:4] for r in tables["correctness"]]
    assert ["mhc", "eager", f"{modes[('mhc', 'eager')]['ms']:.2f}"] in [r[:3] for r in tables["modes"]]


def test_gpu_cap_skips_the_parts_after_it(tmp_path, monkeypatch):
    """A cap of a few milliseconds: the first part starts and runs its first check, every other check and
    part is listed as skipped, and the files are valid after every write (each row written at once)."""
    written = []
    write = bench.atomic_write

    def checked_write(path, text):
        if path.endswith(".json"):
            written.append(json.loads(text))  # valid JSON every time
        else:
            assert text.startswith("# GPU figures\n")
        write(path, text)
    monkeypatch.setattr(bench, "atomic_write", checked_write)
    path = tmp_path / "figures.md"
    data = bench.main(["--section=gpu", "--dry_run=True", f"--results={path}", "--max_minutes=0.00001"])
    text, saved = read(path)
    assert saved == data and saved["status"] == "finished"
    assert [(r["check"], r["dtype"], r["result"]) for r in saved["parts"]["correctness"]["rows"]] == \
        [("rms_norm", "fp32", "ok")]
    assert list(saved["parts"]) == ["correctness"]
    cap = "(the 1e-05-minute cap was reached)"
    assert saved["skipped"][-3:] == [f"{part} {cap}" for part in ("bandwidth", "modes", "mod")]
    # the correctness items that did not run: 15 kernel checks and every mode's compiled step
    skipped_checks = [s for s in saved["skipped"] if s.startswith("correctness: ")]
    assert len(skipped_checks) == len(KERNELS) * 2 - 1 + len(RESIDUALS) + len(bench.VARIANTS)
    assert "correctness: compiled step mudd (the part's time ran out)" in skipped_checks
    assert f"bandwidth {cap}" in text and md_tables(text)["correctness"][0][:4] == ["rms_norm", "fp32", "5x24", "ok"]
    # written as it went: the row was on disk while the run was still running, before the skips and the end
    rows_on_disk = [len(w["parts"].get("correctness", {}).get("rows", [])) for w in written]
    assert rows_on_disk == sorted(rows_on_disk) and rows_on_disk[0] == 0
    first_row = rows_on_disk.index(1)
    assert written[first_row]["status"] == "running" and written[first_row]["skipped"] == []
    assert [w["status"] for w in written].count("finished") == 1 and written[-1] == saved


def test_gpu_items_start_while_one_more_fits(tmp_path, monkeypatch):
    """Inside a part an item starts when one more like the last would end within the part's share of the
    cap: a fake clock, 10 s per item, a 60 s cap whose first part (correctness) ends at 60 * 3.5 / 4 = 52.5 s
    (the shares of correctness and bandwidth, 3.5 and 0.5); the items at 0 to 40 s run (40 + 10 < 52.5), the
    one at 50 s does not. The next part starts (the run is inside its cap) and runs its first item even past
    its share, and no more."""
    clock = [0.0]
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    ran = []

    def part(run, n):
        for i in range(n):
            if run.more(f"item {i}"):
                ran.append((run.part, i))
                clock[0] += 10
    meta = dict(command="python bench.py --section=gpu", device="a GPU", torch="2", triton="3", cuda="12", python="3",
                commit=None, started="now", max_minutes=1, dry_run=False, plan_s=dict(correctness=1, bandwidth=1))
    run = bench.GPURun(str(tmp_path / "r.md"), meta, ["correctness", "bandwidth"], max_minutes=1)
    assert run.ends == pytest.approx({"correctness": 60 * 3.5 / 4, "bandwidth": 60.0})
    run.run_part("correctness", part, 6)
    run.run_part("bandwidth", part, 3)
    assert ran == [("correctness", i) for i in range(5)] + [("bandwidth", 0)]
    assert run.data["skipped"] == ["correctness: item 5 (the part's time ran out)",
                                   "bandwidth: item 1 (the part's time ran out)",
                                   "bandwidth: item 2 (the part's time ran out)"]


def test_gpu_records_a_wrong_kernel_and_goes_on(dry_run):
    """The planted faults: nag_update's checks, and the compiled nag model that runs its kernel, are FAIL
    with their worst error over the tolerance; sinkhorn's checks and the compiled mhc model (Sinkhorn's
    H_res; mhc_res=birkhoff has none) are FAIL with the exception's line; every other kernel and mode,
    checked after them, passes."""
    path, data = dry_run
    rows = data["parts"]["correctness"]["rows"]
    for r in rows:
        if r["check"] in ("nag_update", "compiled step: nag"):
            assert r["result"] == "FAIL" and r["error"] > r["tol"], r
        elif r["check"] in ("sinkhorn", "compiled step: mhc"):
            assert r["result"] == "FAIL" and r["error"] is None and r["where"].endswith("planted launch failure"), r
        else:
            assert r["result"] == "ok" and 0 <= r["error"] <= r["tol"], r
    text = read(path)[0]
    assert len(re.findall(r"^\| sinkhorn \| (fp32|bf16) \| 5x24 \| FAIL \| n/a \| n/a \| RuntimeError: planted launch "
                          r"failure \|$", text, re.M)) == 2
    assert data["skipped"] == [] and data["status"] == "finished"


def test_gpu_a_model_that_fails_is_recorded_and_the_rest_timed(tmp_path, monkeypatch):
    """A model that cannot be built or stepped (on a GPU: out of memory) is a row saying so; the others of
    its table are still timed, each against its own dense step."""
    real = bench.train_step

    def failing(config, *args):
        if (config.mod, config.mod_rate) == ("router", 0.25):
            raise RuntimeError("planted: out of memory")
        return real(config, *args)
    monkeypatch.setattr(bench, "train_step", failing)
    data = bench.main(["--section=gpu", "--dry_run=True", f"--results={tmp_path / 'r.md'}", "--parts=mod"])
    rows = data["parts"]["mod"]["rows"]
    assert rows[0] == dict(residual="prenorm", mod="router", mod_rate=0.25,
                           target="failed: RuntimeError: planted: out of memory")
    timed = {(r["residual"], r["mod"], r["mod_rate"]): r for r in rows[1:]}
    assert set(timed) == {(r, m, rate) for r, m in bench.MOD_RUNS for rate in (0.0, 0.25, 0.5)} - \
        {("prenorm", "router", 0.25)}
    assert all(r["ms"] > 0 and r["vs_dense"] == pytest.approx(r["ms"] / timed[(r["residual"], r["mod"], 0.0)]["ms"])
               for r in timed.values())


def test_gpu_cut_short_leaves_valid_files(tmp_path, monkeypatch):
    """A run killed in the middle of a part (here an interrupt at the first kernel timing) leaves both files
    valid: the rows measured so far, the part marked as running or cut short, the parts not started named."""
    def interrupted(*args, **kw):
        raise KeyboardInterrupt
    monkeypatch.setattr(bench, "kernel_times", interrupted)
    path = tmp_path / "results.md"
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--section=gpu", "--dry_run=True", f"--results={path}", "--parts=bandwidth,mod"])
    text, saved = read(path)
    assert saved["status"] == "running" and saved["pending"] == ["mod"]
    assert [r["kernel"] for r in saved["parts"]["bandwidth"]["rows"]] == ["copy (clone)"]
    assert saved["parts"]["bandwidth"]["seconds"] is None
    assert "running, or cut short while running (not started: mod)" in text
    assert "## bandwidth (running, or cut short;" in text and len(md_tables(text)["bandwidth"]) == 1


def test_gpu_section_errors():
    """Without a GPU the section names its dry run; --dry_run belongs to it; unknown parts and modes are
    one-line errors."""
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"needs a CUDA GPU; .* --section=gpu --dry_run=True"):
            bench.main(["--section=gpu"])
    with pytest.raises(ConfigError, match="--dry_run=True is the gpu section's"):
        bench.main(["--section=model", "--dry_run=True"])
    with pytest.raises(ConfigError, match="--parts=speed"):
        bench.main(["--section=gpu", "--dry_run=True", "--parts=speed"])
    with pytest.raises(ConfigError, match="--compiled=prenorm,nga"):
        bench.main(["--section=gpu", "--dry_run=True", "--compiled=prenorm,nga"])


def test_gpu_mode_rows_step_muon_when_asked(tmp_path, monkeypatch):
    """--optimizer=muon: every mode row of the gpu command times a step of Muon + AdamW (train.py's
    split), and the meta says so; without it, AdamW alone."""
    from optim import MuonAdamW
    built, real = [], bench.GPT.configure_optimizers

    def spy(self, *args, **kw):
        opt = real(self, *args, **kw)
        built.append(type(opt))
        return opt
    monkeypatch.setattr(bench.GPT, "configure_optimizers", spy)
    data = bench.main(["--section=gpu", "--dry_run=True", f"--results={tmp_path / 'r.md'}", "--parts=modes",
                       "--compiled=", "--optimizer=muon"])
    rows = data["parts"]["modes"]["rows"]
    assert {r["residual"] for r in rows} == set(bench.RESIDUALS) | set(bench.VARIANTS)
    assert all(r["ms"] > 0 for r in rows) and data["meta"]["optimizer"] == "muon"
    assert built and set(built) == {MuonAdamW}
    built.clear()
    bench.main(["--section=gpu", "--dry_run=True", f"--results={tmp_path / 'r.md'}", "--parts=modes", "--compiled="])
    assert built and MuonAdamW not in built


def test_the_correctness_check_holds_each_dtype_to_its_own_tolerance():
    """A fused kernel 1e-3 off (relative) in its output alone, and one 1e-3 off in its gradients alone: each a
    FAIL in fp32 (tolerance 2e-4), decided by the rows it moved, and within bf16's 3e-2. An fp32 output (or
    gradient) held to bf16's tolerance would pass its fault: the other rows are exact and cannot decide it. The
    exact kernel passes in both."""
    def ref(x, w):
        return x * w

    def off_output(x, w):  # the forward 1e-3 off, the backward exact (the offset carries no gradient)
        return x * w + (x * w * 1e-3).detach()

    def off_grads(x, w):  # the forward exact (to fp32's rounding), every gradient 1e-3 off
        return x * w + x * w * 1e-3 - (x * w * 1e-3).detach()
    x, w = torch.randn(8, 32, generator=torch.Generator().manual_seed(0)), torch.rand(32) + 0.5
    for dtype, faulty in ((torch.float32, "FAIL"), (torch.bfloat16, "ok")):
        inputs = [x.to(dtype), w.to(dtype)]
        assert bench.check_kernel(inputs, ref, ref)["result"] == "ok", dtype
        for fused, rows in ((off_output, "output"), (off_grads, "grad of input")):
            result = bench.check_kernel(inputs, ref, fused)
            assert result["result"] == faulty and result["tol"] == bench.CHECK_TOL[dtype], (dtype, rows, result)
            if faulty == "FAIL":
                assert result["where"].startswith(rows), (dtype, rows, result)
