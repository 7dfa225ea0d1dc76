"""Compute multipliers (flops.py multiplier) on synthetic budget sweeps with known answers, and budget
sweeps (budgets = [...]) on fake train.py runs."""

import csv
import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import flops  # noqa: E402
import multiplier as mult  # noqa: E402
from configurator import ConfigError  # noqa: E402
from test_flops import fake_train, tiny_train_config  # noqa: E402,F401  (fake_train: a fixture)

BUDGETS = [1e12, 2e12, 4e12, 8e12, 1.6e13]  # 16x


def base_loss(c):
    """The baseline's curve: L = 1.5 + 40 (C / 1e8)^-0.3 (4.02 at 1e12, 2.59 at 1.6e13)."""
    return 1.5 + 40 * (c / 1e8) ** -0.3


def write_csv(path, budgets, cells, seeds=(1, 2, 3), noise=0.004, seed=0):
    """A results.csv of a budget sweep: cells {name: loss(C) or dict(loss=, budgets=, n_layer=, noise=)}, each
    run at its budgets (else `budgets`) with a seeded Gaussian noise on its loss (its own noise, else `noise`)."""
    rng = random.Random(seed)
    cells = {c: v if isinstance(v, dict) else {"loss": v} for c, v in cells.items()}
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, flops.FIELDS)
        w.writeheader()
        for b in sorted({b for v in cells.values() for b in v.get("budgets", budgets)}):
            for s in seeds:
                for cell, v in cells.items():
                    if b not in v.get("budgets", budgets):
                        continue
                    w.writerow({k: "" for k in flops.FIELDS} | {
                        "run": f"{cell}_s{s}", "cell": cell, "seed": s, "residual": v.get("residual", cell),
                        "n_layer": v.get("n_layer", 4), "mod": "", "mod_rate": 0.0, "args": "", "status": "done",
                        "iters": 100, "tokens": 1000, "flops": b, "budget": b, "device": "cpu",
                        "val_loss": v["loss"](b) + rng.gauss(0, v.get("noise", noise)), "seconds": b * 1e-10})
    return path


def rows_of(text, cell):
    """{budget column: the row's cells} of the multiplier table's rows for `cell` (the budget column cut at its
    first space: 'overall (3 in-range budgets)' is 'overall', 'per 2x compute' is 'per')."""
    out = {}
    for line in text.split("The fits")[0].splitlines():
        parts = [p.strip() for p in line.strip("|").split("|")]
        if len(parts) == 7 and parts[0] == cell:
            out[parts[2].split(" ")[0]] = parts
    return out


def number(shown):
    return float(shown.split("x")[0])


def interval_of(shown):
    return tuple(number(v) for v in shown.split(" - "))


def times(m):
    """A design whose loss is the baseline's at m(C) x its compute: its multiplier is m(C)."""
    return lambda c: base_loss(m(c) * c)


def two_x(c):  # worth 2x the baseline's compute at every budget
    return base_loss(2 * c)


def test_multiplier_recovers_a_known_value_in_range(tmp_path):
    """A design worth 2x at 2e12 and 4e12, against a baseline measured from 1e12 to 1.6e13: its losses lie on the
    baseline's measured budgets (4e12, 8e12), so the measured multiplier is 2 (a C/C_base inversion gives 0.5);
    the interval holds 2 and is not everything; the fit agrees; the figure is written beside the CSV."""
    path = write_csv(tmp_path / "results.csv", BUDGETS, {"prenorm": base_loss,
                                                         "nag": {"loss": two_x, "budgets": [2e12, 4e12]}})
    text = flops.multiplier([str(path), "--boot=200"])
    rows = rows_of(text, "nag")
    for b in ("2e+12", "4e+12"):
        assert number(rows[b][3]) == pytest.approx(2.0, rel=0.03) and rows[b][6] == "in range"
    assert rows["overall"][2] == "overall (2 in-range budgets)"
    assert number(rows["overall"][3]) == pytest.approx(2.0, rel=0.03)
    lo, hi = interval_of(rows["overall"][4])
    assert lo < 2.0 < hi and hi / lo < 1.3
    assert number(rows["overall"][5]) == pytest.approx(2.0, rel=0.05) and rows["overall"][6] == "agrees"
    assert rows["per"][3] == "-" and "needs 4 in-range budgets, has 2" in rows["per"][6]
    e, alpha = re.search(r"\| prenorm \| L = ([\d.]+) \+ \S+ \(C/\S+\)\^-([\d.]+) \(E shared", text).groups()
    assert float(e) == pytest.approx(1.5, abs=0.1) and float(alpha) == pytest.approx(0.3, abs=0.03)  # the truth
    assert (tmp_path / "results_multiplier.png").stat().st_size > 0


def test_overall_is_the_geometric_mean_and_the_trend_follows_it(tmp_path):
    """A design whose multiplier grows 2^0.5 per doubling over 5 budgets (1, 1.41, 2, 2.83, 4x): overall 2.0 within
    5% (an arithmetic mean gives 2.25) and 1.41 per 2x compute, 'grows with compute'; a design worth 2x
    throughout has no trend at 95%. The baseline runs from 5e11 to 6.4e13, past every design's loss."""
    grow = times(lambda c: (c / 1e12) ** 0.5)
    wide = [5e11 * 2 ** k for k in range(8)]
    path = write_csv(tmp_path / "r.csv", wide, {"prenorm": base_loss, "grows": {"loss": grow, "budgets": BUDGETS},
                                                "flat": {"loss": two_x, "budgets": BUDGETS}}, noise=0.002)
    text = flops.multiplier([str(path), "--boot=100"])
    grows, flat = rows_of(text, "grows"), rows_of(text, "flat")
    assert grows["overall"][2] == "overall (5 in-range budgets)"
    assert number(grows["overall"][3]) == pytest.approx(2.0, rel=0.05)
    assert number(grows["per"][3]) == pytest.approx(2 ** 0.5, rel=0.05) and grows["per"][6] == "grows with compute"
    assert number(flat["per"][3]) == pytest.approx(1.0, abs=0.01) and flat["per"][6] == "no trend at 95%"
    at = {b: (m, True) for b, m in zip(BUDGETS, (1, 2 ** 0.5, 2, 2 ** 1.5, 4))}
    assert mult.overall(at, BUDGETS) == pytest.approx(2.0, rel=1e-12)
    assert mult.trend(at, BUDGETS) == pytest.approx(2 ** 0.5, rel=1e-12)
    assert mult.trend(at, BUDGETS[:3]) is None  # fewer than MIN_TREND_BUDGETS


def test_bootstrap_interval_is_the_percentiles_of_the_same_draws():
    """bootstrap()'s overall interval is np.percentile(..., [2.5, 97.5]) of the geometric-mean multipliers
    recomputed here from the same seeded draws (a 90% interval, or an arithmetic mean, differs)."""
    rng = random.Random(3)
    budgets = [1e12, 2e12, 4e12, 8e12]
    base = {b: [(b, base_loss(b) + rng.gauss(0, 0.01)) for _ in range(3)] for b in budgets}
    cell = {b: [(b, base_loss(1.4 * b) + rng.gauss(0, 0.01)) for _ in range(3)] for b in budgets[1:3]}
    inside = [2e12, 4e12]
    _, ci, _, draws = mult.bootstrap(base, cell, 300, 11, inside, ("p", "c"))
    again = []
    for b_draw, c_draw in mult.bootstrap_draws(base, cell, 300, 11, ("p", "c")):
        at, _, _ = mult.multipliers(b_draw, c_draw)
        again.append(math.exp(np.mean([math.log(at[b][0]) for b in inside])))
    assert draws == pytest.approx(again, rel=1e-12)
    assert ci == pytest.approx(tuple(np.percentile(again, [2.5, 97.5])), rel=1e-12)
    assert ci != pytest.approx(tuple(np.percentile(again, [5, 95])), rel=1e-3)


@pytest.mark.parametrize("noisy", ["design", "baseline"])
def test_the_interval_resamples_both_sides(tmp_path, noisy):
    """Noise on one side only (the design's runs, or the baseline's): the interval still has width, so a
    bootstrap that skips either side's runs fails; with no noise at all it collapses to the point."""
    cells = {"prenorm": {"loss": base_loss, "noise": 0.02 if noisy == "baseline" else 0.0},
             "nag": {"loss": two_x, "budgets": [2e12, 4e12], "noise": 0.02 if noisy == "design" else 0.0}}
    lo, hi = interval_of(rows_of(flops.multiplier([str(write_csv(tmp_path / "r.csv", BUDGETS, cells)), "--boot=200"]),
                                 "nag")["overall"][4])
    assert hi / lo > 1.02
    cells["prenorm"]["noise"] = cells["nag"]["noise"] = 0.0
    lo, hi = interval_of(rows_of(flops.multiplier([str(write_csv(tmp_path / "z.csv", BUDGETS, cells)), "--boot=50"]),
                                 "nag")["overall"][4])
    assert hi / lo == pytest.approx(1.0, abs=1e-9)


def test_extrapolation_is_flagged_and_left_out(tmp_path):
    """A design below the baseline's lowest mean loss at its top budget: that figure is flagged 'extrapolated'
    and the overall is the geometric mean of the in-range budgets alone; one worse than the baseline's
    smallest budget is flagged too; a design never in range has no overall."""
    path = write_csv(tmp_path / "r.csv", BUDGETS, {
        "prenorm": base_loss, "nag": {"loss": two_x, "budgets": [2e12, 4e12, 1.6e13]},
        "slow": {"loss": times(lambda c: 0.25), "budgets": [1e12, 8e12]},
        "magic": {"loss": lambda c: 1.2, "budgets": [4e12]}}, noise=0.0)
    text = flops.multiplier([str(path), "--boot=20"])
    nag = rows_of(text, "nag")
    assert nag["1.6e+13"][3].endswith("(extrapolated)") and nag["1.6e+13"][6].startswith("extrapolated")
    assert nag["overall"][2] == "overall (2 in-range budgets)"
    in_range = [number(nag[b][3]) for b in ("2e+12", "4e+12")]
    assert number(nag["overall"][3]) == pytest.approx(math.sqrt(in_range[0] * in_range[1]), rel=0.01)
    slow = rows_of(text, "slow")
    assert slow["1e+12"][3].endswith("(extrapolated)") and slow["8e+12"][6] == "in range"
    assert number(slow["overall"][3]) == pytest.approx(0.25, rel=0.05)
    assert rows_of(text, "magic")["overall"][3] == "none: no budget in the baseline's range"


def test_a_degenerate_fit_is_named_and_gives_no_number(tmp_path):
    """A baseline straight in log compute (a power law only in the limit E -> 0, alpha -> 0) puts E on its bound:
    the fit is named degenerate, no fitted number and no law is printed; a baseline with one budget off its curve
    makes the fit move with that budget left out by more than the measured interval: named too, per cell."""
    straight = lambda c: 4 - 0.3 * math.log(c / 1e12)  # noqa: E731
    path = write_csv(tmp_path / "r.csv", BUDGETS, {"prenorm": straight,
                                                   "nag": {"loss": lambda c: straight(2 * c), "budgets": [2e12, 4e12]}},
                     noise=0.001)
    text = flops.multiplier([str(path), "--boot=50"])
    assert "| prenorm | degenerate fit: E at its lower bound 0 |" in text and "L = " not in text
    assert rows_of(text, "nag")["overall"][5] == "degenerate fit"
    rng = random.Random(0)
    base = {b: [(b, base_loss(b) + (0.06 if b == 4e12 else 0) + rng.gauss(0, 0.002)) for _ in range(3)]
            for b in BUDGETS}
    cell = {b: [(b, base_loss(2 * b) + rng.gauss(0, 0.002)) for _ in range(3)] for b in BUDGETS[:3]}
    at, inside, m = mult.multipliers(base, cell)
    _, ci, _, _ = mult.bootstrap(base, cell, 100, 0, inside)
    law, fitted = mult.fit_check({"p": base, "c": cell}, "p", ["c"], {"c": inside}, {"c": ci})
    assert law.startswith("L = ") and fitted["c"][0] is None
    assert fitted["c"][1].startswith("degenerate fit: without the baseline's budget ")


def b8(c):
    """The baseline at 8 layers: 4 layers' curve shifted by 2x compute but starting 0.1 higher, so 4 layers is
    best at small budgets and 8 at large ones."""
    return base_loss(2 * c) + 0.1 * 4e12 / (c + 4e12)


def depth_grid(grid):
    """A two-depth sweep: the baseline at 4 and 8 layers over `grid`, a design worth 1.2x at 4 layers and 1.44x
    at 8 over its middle three budgets."""
    return {"prenorm_L4": {"loss": base_loss, "n_layer": 4, "residual": "prenorm"},
            "prenorm_L8": {"loss": b8, "n_layer": 8, "residual": "prenorm"},
            "nag_L4": {"loss": lambda c: base_loss(1.2 * c), "n_layer": 4, "residual": "nag", "budgets": grid[1:4]},
            "nag_L8": {"loss": lambda c: b8(1.44 * c), "n_layer": 8, "residual": "nag", "budgets": grid[1:4]}}


def test_depth_and_the_frontier_on_a_known_grid(tmp_path):
    """depth_grid: the design is worth 1.2 per doubling of depth ('grows with depth'). Its best depth per
    budget, the baseline's, and the frontier multiplier (the baseline's best-of-depths curve against the
    design's best) are the known ones."""
    b4 = base_loss
    grid = [1e12 * 2 ** k for k in range(6)]
    text = flops.multiplier([str(write_csv(tmp_path / "r.csv", grid, depth_grid(grid), noise=0.001)), "--boot=100"])
    assert number(rows_of(text, "nag_L4")["overall"][3]) == pytest.approx(1.2, rel=0.03)
    assert number(rows_of(text, "nag_L8")["overall"][3]) == pytest.approx(1.44, rel=0.03)
    (depth,) = [line for line in text.splitlines() if line.startswith("| nag |") and "layers" not in line
                and "grows with depth" in line]
    assert number(depth.split("|")[4]) == pytest.approx(1.2, rel=0.04)
    front = {}
    for line in text.split("compute-optimal frontier")[1].splitlines():
        parts = [p.strip() for p in line.strip("|").split("|")]
        if len(parts) == 8 and parts[0] == "nag":
            front[float(parts[2])] = parts
    known = {}
    for b in grid[1:4]:  # the known answer, from the noise-free curves
        best = min((4, 8), key=lambda d: (b4(1.2 * b), b8(1.44 * b))[d == 8])
        base_best = min((4, 8), key=lambda d: (b4(b), b8(b))[d == 8])
        known[b] = (best, base_best)
        assert front[b][3].startswith(str(best)) and front[b][4] == str(base_best)
    assert {v for v in known.values()} != {(4, 4)}  # the grid's answer is not the trivial one
    b = grid[2]
    loss = min(b4(1.2 * b), b8(1.44 * b))
    pts = sorted((c, min(b4(c), b8(c))) for c in grid)  # the baseline's best-of-depths, read as the code reads it
    i = next(i for i in range(1, len(pts)) if loss >= pts[i][1])
    (c0, y0), (c1, y1) = pts[i - 1], pts[i]
    expected = math.exp(math.log(c0) + (loss - y0) / (y1 - y0) * (math.log(c1) - math.log(c0))) / b
    assert number(front[b][5]) == pytest.approx(expected, rel=0.02)


def test_throughput_adjusted_multiplier(tmp_path):
    """With bench.py's step times (the design 1.25x the baseline's step time in every round), the 2x design is worth
    2 / 1.25 = 1.6 at equal time on that device; a file that is not step times is a one-line error."""
    path = write_csv(tmp_path / "r.csv", BUDGETS, {"prenorm": base_loss, "nag": {"loss": two_x, "budgets": [2e12, 4e12]}})
    steps = tmp_path / "steps.csv"
    steps.write_text("cell,baseline,n_layer,device,round,ms,baseline_ms\n" + "".join(
        f"nag,prenorm,4,test CPU,{i},{125 + d},{100 + 0.8 * d}\n" for i, d in enumerate((0, 1, -1, 2, -2))))
    text = flops.multiplier([str(path), "--boot=100", f"--step_times={steps}"])
    (line,) = [x for x in text.split("Throughput-adjusted")[1].splitlines() if x.startswith("| nag |")]
    parts = [p.strip() for p in line.strip("|").split("|")]
    assert float(parts[2].split()[0]) == pytest.approx(1.25, rel=0.01)
    assert number(parts[3]) == pytest.approx(1.6, rel=0.04)
    assert "measured on test CPU" in text
    with pytest.raises(ConfigError, match="not bench.py's step times"):
        flops.multiplier([str(path), "--boot=20", f"--step_times={path}"])


def test_a_committed_csv_keeps_its_committed_figure(tmp_path, monkeypatch):
    """Run on a CSV in docs/ (a committed result), the figure goes to out/, not over docs/'s tracked one;
    --out still writes where it says."""
    monkeypatch.setattr(flops, "HERE", str(tmp_path))
    (tmp_path / "docs").mkdir()
    path = write_csv(tmp_path / "docs" / "r.csv", [1e12, 4e12], {"prenorm": base_loss, "nag": two_x})
    (tmp_path / "docs" / "r_multiplier.png").write_bytes(b"the committed figure")
    text = flops.multiplier([str(path), "--boot=20"])
    assert (tmp_path / "docs" / "r_multiplier.png").read_bytes() == b"the committed figure"
    assert (tmp_path / "out" / "r_multiplier.png").stat().st_size > 0
    assert f"figure: {tmp_path / 'out' / 'r_multiplier.png'}" in text
    flops.multiplier([str(path), "--boot=20", f"--out={tmp_path / 'docs' / 'r_multiplier.png'}"])
    assert (tmp_path / "docs" / "r_multiplier.png").read_bytes() != b"the committed figure"


def test_bootstrap_reproducible_and_covers(tmp_path):
    """The same CSV and boot_seed print the same table; another boot_seed another one; over 15 noisy sweeps
    the 95% interval of a design worth 1.25x holds the truth at least 13 times."""
    cells = {"prenorm": base_loss, "nag": {"loss": times(lambda c: 1.25), "budgets": [2e12, 4e12, 8e12]}}
    path = write_csv(tmp_path / "r.csv", BUDGETS, cells)
    one = flops.multiplier([str(path), "--boot=50"])
    assert flops.multiplier([str(path), "--boot=50"]) == one
    assert flops.multiplier([str(path), "--boot=50", "--boot_seed=1"]) != one
    covered = 0
    for draw in range(15):
        rows = write_csv(tmp_path / "d.csv", BUDGETS, cells, noise=0.01, seed=100 + draw)
        lo, hi = interval_of(rows_of(flops.multiplier([str(rows), "--boot=80"]), "nag")["overall"][4])
        covered += lo <= 1.25 <= hi
    assert covered >= 13


def test_the_same_csv_prints_the_same_intervals_in_every_process(tmp_path):
    """The bootstrap's draws follow the CSV and boot_seed only: two processes with other string hashes (which
    order a set of cell names) print the same report, the frontier's intervals included."""
    grid = [1e12 * 2 ** k for k in range(6)]
    path = write_csv(tmp_path / "r.csv", grid, depth_grid(grid), noise=0.01)
    cmd = [sys.executable, str(REPO / "flops.py"), "multiplier", str(path), "--boot=40", f"--out={tmp_path / 'm.png'}"]
    out = [subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO,
                          env=os.environ | {"PYTHONHASHSEED": h}).stdout for h in ("1", "2")]
    assert "compute-optimal frontier" in out[0] and out[0] == out[1]


def test_degenerate_inputs_give_a_line(tmp_path):
    """One budget, and a baseline whose loss does not fall with compute: a one-line message, no number; a
    boot below 10 is a one-line error."""
    one = write_csv(tmp_path / "one.csv", [1e12], {"prenorm": base_loss, "nag": two_x})
    assert "| nag | prenorm | - | no multiplier: one budget" in flops.multiplier([str(one), "--boot=10"])
    flat = write_csv(tmp_path / "flat.csv", BUDGETS, {"prenorm": lambda c: 3.0 + c / 1e14, "nag": two_x}, noise=0.0)
    assert "no multiplier: the baseline's mean loss does not fall" in flops.multiplier([str(flat), "--boot=10"])
    with pytest.raises(mult.Degenerate, match="does not fall"):
        mult.measured_curve({1: [(1.0, 3.0)], 2: [(2.0, 3.0)], 3: [(3.0, 3.0)]})
    with pytest.raises(ConfigError, match="boot must be"):
        flops.multiplier([str(flat), "--boot=5"])


def test_old_single_budget_csvs_still_load():
    """Every shipped docs/sweep_*.csv (no budget column) still builds its results tables, and the
    multiplier says in one line per cell that one budget gives none."""
    for path in sorted((REPO / "docs").glob("sweep_*.csv")):
        assert "| cell | residual |" in flops.results([str(path)])
    text = flops.multiplier([str(REPO / "docs" / "sweep_shakespeare_cpu.csv"), "--boot=10"])
    assert "no multiplier: one budget" in text
    assert not any(ch.isdigit() for line in text.splitlines() if "no multiplier" in line
                   for ch in line.split("|")[3])


def test_budget_sweep_runs_per_budget_folders(data_dir, tmp_path, fake_train, monkeypatch):
    """budgets = [...] runs every cell at each budget (train.py --max_flops) in its own b<budget>/ folder and
    writes one results.csv with a budget column, after each budget (a sweep cut short keeps the budgets it
    ran); a list budget_seconds does so in time (--max_seconds, s<S>/); a list and a single budget together
    are an error, and so is a repeated budget."""
    base = tiny_train_config(data_dir, tmp_path)
    cfg = tmp_path / "sweep_budgets.py"
    cfg.write_text(f"train_config = {str(base)!r}\nout_root = {str(tmp_path)!r}\nsweep_name = 'm'\n"
                   "residuals = ['prenorm', 'nag']\ndepths = [1]\nseeds = [1]\nbudget = None\n"
                   "budgets = [2e9, 1e9]\njobs = 2\n")
    root, seen, run_sweep = tmp_path / "m", [], flops.run_sweep

    def watching(argv, top_argv=None):  # the top results.csv as the second budget starts
        if "--sweep_name=m/b2e09" in argv:
            with open(root / "results.csv") as f:
                seen.extend(float(r["budget"]) for r in csv.DictReader(f))
        return run_sweep(argv, top_argv)
    monkeypatch.setattr(flops, "run_sweep", watching)
    rows = flops.run_sweep([str(cfg)])
    assert seen == [1e9, 1e9]
    assert len(rows) == 4 and all(r["status"] == "done" for r in rows)
    for b, tag in ((1e9, "b1e09"), (2e9, "b2e09")):
        for run in ("prenorm_L1_s1", "nag_L1_s1"):
            (cmd,) = fake_train(root / tag / run)
            assert f"--max_flops={b!r}" in cmd and f"--out_dir={root / tag / run}" in cmd
        assert (root / tag / "results.csv").exists()
    with open(root / "results.csv") as f:
        read = list(csv.DictReader(f))
    assert [float(r["budget"]) for r in read] == [1e9] * 2 + [2e9] * 2  # smallest budget first
    assert {r["device"] for r in read} == {"cpu"}
    # the fake train.py spends the same FLOPs whatever the budget: one line, no number
    assert "no multiplier: two budgets spent the same compute" in flops.multiplier([str(root / "results.csv"),
                                                                                     "--boot=10"])
    timed = flops.run_sweep([str(cfg), "--budgets=None", "--budget_seconds=[30, 60]", "--residuals=['prenorm']",
                             "--sweep_name=t"])  # a time axis: --max_seconds per budget, folders s<seconds>
    assert [r["budget"] for r in timed] == [30, 60]
    for b in (30, 60):
        (cmd,) = fake_train(tmp_path / "t" / f"s{b}" / "prenorm_L1_s1")
        assert f"--max_seconds={b}" in cmd and not any(a.startswith("--max_flops") for a in cmd)
    with pytest.raises(ConfigError, match="set one of them"):
        flops.run_sweep([str(cfg), "--budget=1e9"])
    with pytest.raises(ConfigError, match="list of distinct numbers"):
        flops.run_sweep([str(cfg), "--budgets=[1e9, 1e9]"])


def test_budget_sweep_with_cell_budgets(data_dir, tmp_path, fake_train, monkeypatch):
    """cell_budgets gives a cell budgets of its own: with budgets = [1e9, 2e9] and prenorm_L1 at [5e8, 1e9, 2e9,
    4e9], prenorm_L1 runs at all four (--max_flops of each, in b5e08/ ... b4e09/) and nag_L1 only at 1e9 and 2e9
    (no nag_L1 folder in b5e08/ or b4e09/); the top results.csv has each (cell, budget) once, smallest budget
    first. A cell's budgets that are not a list of distinct numbers > 0, and cell_budgets in a sweep over
    time (budget_seconds = [...]), are one-line errors naming cell_budgets, before anything runs."""
    monkeypatch.setattr(flops, "plot_results", lambda *args: None)
    base = tiny_train_config(data_dir, tmp_path)
    cfg = tmp_path / "sweep_cell_budgets.py"
    cfg.write_text(f"train_config = {str(base)!r}\nout_root = {str(tmp_path)!r}\nsweep_name = 'm'\n"
                   "residuals = ['prenorm', 'nag']\ndepths = [1]\nbudget = None\nbudgets = [1e9, 2e9]\n"
                   "cell_budgets = {'prenorm_L1': [4e9, 5e8, 1e9, 2e9]}\njobs = 2\n")
    rows = flops.run_sweep([str(cfg)])
    root = tmp_path / "m"
    expected = [("prenorm_L1", 5e8), ("prenorm_L1", 1e9), ("nag_L1", 1e9), ("prenorm_L1", 2e9), ("nag_L1", 2e9),
                ("prenorm_L1", 4e9)]
    assert [(r["cell"], r["budget"]) for r in rows] == expected and all(r["status"] == "done" for r in rows)
    for b, tag in ((5e8, "b5e08"), (1e9, "b1e09"), (2e9, "b2e09"), (4e9, "b4e09")):
        cells = [c for c, budget in expected if budget == b]
        assert sorted(p.name for p in (root / tag).iterdir() if p.is_dir()) == sorted(cells)
        for cell in cells:
            (cmd,) = fake_train(root / tag / cell)
            assert f"--max_flops={b!r}" in cmd and f"--out_dir={root / tag / cell}" in cmd
        with open(root / tag / "results.csv") as f:
            assert [r["cell"] for r in csv.DictReader(f)] == cells
    with open(root / "results.csv") as f:
        assert [(r["cell"], float(r["budget"])) for r in csv.DictReader(f)] == expected
    for bad in ("1e9", "[1e9, 1e9]", "[1e9, 0]", "[-1e9]", "[]", "[True, 1e9]", "['1e9']"):
        with pytest.raises(ConfigError, match=r"^cell_budgets\['prenorm_L1'\] must be a list of distinct numbers > 0"):
            flops.run_sweep([str(cfg), "--sweep_name=bad", f"--cell_budgets={{'prenorm_L1': {bad}}}"])
    with pytest.raises(ConfigError, match="^cell_budgets must be a dict .* of a FLOP budget sweep"):
        flops.run_sweep([str(cfg), "--sweep_name=bad", "--budgets=None", "--budget_seconds=[30, 60]"])
    assert not (tmp_path / "bad").exists()


def test_budget_sweep_keeps_the_cells_of_its_command_line(data_dir, tmp_path, fake_train, monkeypatch):
    """--cells=[...] on a budget sweep's command line runs those cells alone at every budget, as it does in a
    single-budget sweep (test_sweep_runs_only_the_named_cells) and as `cells` in the sweep config does."""
    monkeypatch.setattr(flops, "plot_results", lambda *args: None)
    base = tiny_train_config(data_dir, tmp_path)
    rows = flops.run_sweep([f"--train_config={base}", f"--out_root={tmp_path}", "--sweep_name=m",
                            "--residuals=['prenorm', 'nag']", "--depths=[1]", "--budget=None", "--budgets=[1e9, 2e9]",
                            "--cells=['nag_L1']"])
    assert [(r["cell"], r["budget"]) for r in rows] == [("nag_L1", 1e9), ("nag_L1", 2e9)]


def test_plan_counts_every_run_and_its_hours(data_dir, tmp_path):
    """flops.py plan: each cell at its budgets (cell_budgets for the baseline), times the seeds, the FLOPs each run
    trains on (its iterations x tokens x FLOPs per token) plus its evals (forward FLOPs of every eval's batches and
    the final eval), written out here; the hours are FLOPs / (peak x MFU). An unknown GPU or an MFU outside (0, 1]
    is a one-line error."""
    base = tiny_train_config(data_dir, tmp_path)
    cfg = tmp_path / "sweep.py"
    cfg.write_text(f"train_config = {str(base)!r}\nresiduals, depths = [], []\nruns = ["
                   "('prenorm_L1', {'residual': 'prenorm', 'n_layer': 1}), ('nag_L1', {'residual': 'nag', 'n_layer': 1})]\n"
                   "budget = None\nbudgets = [1e9, 2e9]\ncell_budgets = {'prenorm_L1': [5e8, 1e9, 2e9]}\nseeds = [1, 2]\n")
    text = flops.main(["plan", str(cfg), "--gpu=A100", "--mfu=0.5"])
    expected = {}
    for cell, residual, budgets in (("prenorm_L1", "prenorm", [5e8, 1e9, 2e9]), ("nag_L1", "nag", [1e9, 2e9])):
        c = flops.train_config([str(base), f"--residual={residual!r}", "--n_layer=1"])
        config = flops.model_config(c)
        for b in budgets:
            iters = flops.iterations_for_budget(b, flops.train_flops_per_token(config), 4 * 32)
            evals = (iters // 2 + 1) * 2 * 1 * 4 * 32 + c["final_eval_tokens"]
            one = iters * 4 * 32 * flops.train_flops_per_token(config) + evals * sum(flops.forward_flops(config).values())
            n, fl = expected.get(b, (0, 0.0))
            expected[b] = (n + 2, fl + 2 * one)
    assert "(2 cells x 2 seed(s)): 10 runs" in text
    for b, (n, fl) in expected.items():
        assert f"| {b:.3g} | {n} | {fl:.3g} | {fl / (312e12 * 0.5) / 3600:.1f} |" in text
    total = sum(fl for _, fl in expected.values())
    assert f"total: {total:.3g} FLOPs; on one A100 (312 TFLOP/s peak bf16) at 50% MFU:" in text
    with pytest.raises(ConfigError, match="not in flops.py's PEAK_FLOPS"):
        flops.main(["plan", str(cfg), "--gpu=TPU"])
    with pytest.raises(ConfigError, match="mfu must be a fraction"):
        flops.main(["plan", str(cfg), "--mfu=35"])


def test_the_joint_fit_shares_e_and_ties_a_short_cells_exponent():
    """joint_fit: one E for every cell (the true 1.5 recovered from noise-free runs), each cell its own A; a cell
    with 3 budgets or more its own exponent (a steeper design's 0.4 found), one with fewer the baseline's (its
    two points cannot pin an exponent as well: were it free, a 2-budget cell would be exactly fitted by any E)."""
    budgets = [1e12, 2e12, 4e12, 8e12]
    base = {b: [(b, base_loss(b))] for b in budgets}
    steep = {b: [(b, 1.5 + 40 * (b / 1e8) ** -0.4)] for b in budgets}
    short = {b: [(b, base_loss(2 * b))] for b in budgets[1:3]}
    params, s, bound = mult.joint_fit({"prenorm": base, "steep": steep, "short": short})
    assert not bound
    assert {e for e, _, _ in params.values()} == {params["prenorm"][0]}
    assert params["prenorm"][0] == pytest.approx(1.5, abs=1e-3)
    assert params["prenorm"][2] == pytest.approx(0.3, abs=1e-3) and params["steep"][2] == pytest.approx(0.4, abs=1e-3)
    assert params["short"][2] == params["prenorm"][2]
    assert params["short"][1] == pytest.approx(params["prenorm"][1] * 2 ** -0.3, rel=1e-3)  # the 2x shift in A


def test_draws_without_a_baseline_curve_are_counted(tmp_path):
    """Two baseline budgets whose means lie close against the seeds' noise: some draws' means do not fall with
    compute, have no curve, and are left out of the interval; the overall row says how many, the count of
    bootstrap_draws' baseline resamples without a curve."""
    cells = {"prenorm": {"loss": lambda c: 3.0 - 0.01 * math.log2(c / 1e12), "noise": 0.02},
             "nag": {"loss": lambda c: 2.995, "budgets": [1.5e12], "noise": 0.0}}
    path = write_csv(tmp_path / "r.csv", [1e12, 2e12], cells, seeds=(1, 2, 3, 4, 5), seed=6)
    overall = rows_of(flops.multiplier([str(path), "--boot=200"]), "nag")["overall"]
    shown = re.fullmatch(r"(\d+) of 200 draws had no baseline curve, left out of the interval", overall[6])
    rows = flops.read_results(str(path))
    base, cell = ({b: g for b, g in mult.budget_groups([r for r in rows if r["cell"] == c]).items()}
                  for c in ("prenorm", "nag"))
    lost = 0
    for b_draw, _ in mult.bootstrap_draws(base, cell, 200, 0, ("prenorm", "nag")):
        try:
            mult.measured_curve(b_draw)
        except mult.Degenerate:
            lost += 1
    assert shown and int(shown.group(1)) == lost and 10 <= lost <= 100


def steps_csv(path, rounds):
    """bench.py --section=steps's CSV: rounds {cell: [(its ms, its baseline's ms), one per round]}."""
    path.write_text("cell,baseline,n_layer,device,round,ms,baseline_ms\n" + "".join(
        f"{cell},base,4,test CPU,{i},{ms},{base_ms}\n" for cell, times in rounds.items()
        for i, (ms, base_ms) in enumerate(times)))
    return path


def throughput_row(text, cell):
    """(FLOP multiplier's interval, median ratio's interval, throughput-adjusted interval) of a cell's row."""
    (line,) = [x for x in text.split("Throughput-adjusted")[1].splitlines() if x.startswith(f"| {cell} |")]
    parts = [p.strip() for p in line.strip("|").split("|")]
    ratio = re.fullmatch(r"\S+ \((\S+) - (\S+)\)", parts[2]).groups()
    return interval_of(parts[1].split("(")[1].rstrip(")")), tuple(map(float, ratio)), interval_of(parts[4])


def test_the_throughput_adjusted_interval_resamples_the_rounds_and_the_draws(tmp_path):
    """The throughput-adjusted interval is the percentiles of (a FLOP multiplier draw) / (the median of a resample
    of the rounds' step-time ratios). Noiseless losses and noisy rounds: the FLOP interval is the point 2 and the
    adjusted interval has width, 2 over the median ratio's interval turned round (a draw that skips the rounds'
    resample collapses it). Noisy losses and rounds all 1.25: the adjusted interval is the FLOP interval / 1.25
    (a draw that multiplies, or that skips the FLOP draws, does not give it)."""
    cells = {"prenorm": base_loss, "nag": {"loss": two_x, "budgets": [2e12, 4e12]}}
    rng = random.Random(5)
    noisy = steps_csv(tmp_path / "noisy.csv", {"nag": [(125 * (1 + rng.gauss(0, 0.05)), 100) for _ in range(9)]})
    text = flops.multiplier([str(write_csv(tmp_path / "r.csv", BUDGETS, cells, noise=0.0)), "--boot=200",
                             f"--step_times={noisy}", f"--out={tmp_path / 'm.png'}"])
    flop, ratio, adj = throughput_row(text, "nag")
    assert flop[0] == pytest.approx(2.0, rel=1e-3) and flop[1] == pytest.approx(flop[0], rel=1e-9)
    assert ratio[1] / ratio[0] > 1.02 and adj[1] / adj[0] > 1.02
    assert adj == pytest.approx((flop[0] / ratio[1], flop[0] / ratio[0]), rel=0.01)
    steady = steps_csv(tmp_path / "steady.csv", {"nag": [(125, 100)] * 9})
    text = flops.multiplier([str(write_csv(tmp_path / "n.csv", BUDGETS, cells, noise=0.02)), "--boot=200",
                             f"--step_times={steady}", f"--out={tmp_path / 'm.png'}"])
    flop, ratio, adj = throughput_row(text, "nag")
    assert ratio == (1.25, 1.25) and flop[1] / flop[0] > 1.02
    assert adj == pytest.approx((flop[0] / 1.25, flop[1] / 1.25), rel=0.01)


DEPTH_GRID = [1e12 * 2 ** k for k in range(6)]


def close_at_4e12(c):
    """The design at 8 layers: its 4 layers' loss at 4e12, 0.04 lower per doubling of compute above it."""
    return base_loss(1.2 * c) - 0.04 * math.log2(c / 4e12)


def one_side_grid(side, noise=0.03):
    """The baseline at 4 and 8 layers over DEPTH_GRID; the design at both depths over its middle four budgets
    (4 in range: a trend), its two depths equally good at 4e12; Gaussian noise on `side`'s runs alone."""
    nb, nd = (noise if side == "baseline" else 0.0), (noise if side == "design" else 0.0)
    return {"prenorm_L4": {"loss": base_loss, "n_layer": 4, "residual": "prenorm", "noise": nb},
            "prenorm_L8": {"loss": b8, "n_layer": 8, "residual": "prenorm", "noise": nb},
            "nag_L4": {"loss": lambda c: base_loss(1.2 * c), "n_layer": 4, "residual": "nag",
                       "budgets": DEPTH_GRID[1:5], "noise": nd},
            "nag_L8": {"loss": close_at_4e12, "n_layer": 8, "residual": "nag", "budgets": DEPTH_GRID[1:5],
                       "noise": nd}}


def printed_intervals(text):
    """{kind: [(lo, hi)]} of every interval the multiplier report prints: per budget, overall and per 2x compute
    (the multiplier table), per depth and per 2x depth (the depth table), frontier (its table) and
    throughput-adjusted (its table)."""
    main, rest = text.split("By depth:")
    depth, rest = rest.split("The compute-optimal frontier")
    front, steps = rest.split("Throughput-adjusted")
    out = {}
    for line in main.split("The fits")[0].splitlines():
        parts = [p.strip() for p in line.strip("|").split("|")]
        if len(parts) == 7 and parts[0].startswith("nag_"):
            kind = {"overall": "overall", "per": "per 2x compute"}.get(parts[2].split(" ")[0], "per budget")
            out.setdefault(kind, []).append(interval_of(parts[4]))
    for line in depth.splitlines():
        parts = [p.strip() for p in line.strip("|").split("|")]
        if parts[0] == "nag":
            out["per depth"] = [interval_of(p.split("(")[1].rstrip(")")) for p in parts[1:-3]]
            out["per 2x depth"] = [interval_of(parts[-2])]
    out["frontier"] = [interval_of(line.strip("|").split("|")[6].strip()) for line in front.splitlines()
                       if line.startswith("| nag |")]
    out["throughput-adjusted"] = [interval_of(line.strip("|").split("|")[4].strip()) for line in steps.splitlines()
                                  if line.startswith("| nag_")]
    return out


@pytest.fixture(scope="module")
def one_side_reports(tmp_path_factory):
    """{side: the report} of one_side_grid with noise on the baseline's runs, on the design's, and on none; the
    step times the same in every round (1.25x the baseline's), so that their interval is a point."""
    tmp = tmp_path_factory.mktemp("one_side")
    steps = steps_csv(tmp / "steps.csv", {c: [(125, 100)] * 5 for c in ("nag_L4", "nag_L8")})
    return {side: flops.multiplier([str(write_csv(tmp / f"{side}.csv", DEPTH_GRID, one_side_grid(side))),
                                    "--boot=60", f"--step_times={steps}", f"--out={tmp / 'm.png'}"])
            for side in ("baseline", "design", "none")}


KINDS = ("per budget", "overall", "per 2x compute", "per depth", "per 2x depth", "frontier", "throughput-adjusted")


@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.replace(" ", "_"))
@pytest.mark.parametrize("side", ["baseline", "design"])
def test_every_printed_interval_has_width_when_one_side_is_noisy(one_side_reports, side, kind):
    """Every interval the report prints, with noise on the baseline's runs alone and on the design's alone: each
    has width (a bootstrap that skips either side's runs, in any of them, collapses it to its point); with no
    noise at all each is its point (the width comes from the runs' noise, nothing else)."""
    noisy, still = printed_intervals(one_side_reports[side]), printed_intervals(one_side_reports["none"])
    assert set(noisy) == set(still) == set(KINDS)
    assert len(noisy[kind]) == len(still[kind]) >= (8 if kind == "per budget" else 4 if kind == "frontier" else 1)
    assert min(hi / lo for lo, hi in noisy[kind]) > 1.01, noisy[kind]
    assert all(lo == hi for lo, hi in still[kind]), still[kind]


def test_the_frontier_shares_split_where_two_depths_are_close(one_side_reports):
    """The design's 4 and 8 layers equally good at 4e12, noise on its runs alone: the draws disagree on its best
    depth there (each depth's share strictly between 0 and 1, and whether it moves the baseline's undecided); at
    1.6e13, where 8 layers are 0.08 ahead, they agree more. Without noise every share is 1."""
    def front(text):
        rows = {}
        for line in text.split("compute-optimal frontier")[1].splitlines():
            parts = [p.strip() for p in line.strip("|").split("|")]
            if len(parts) == 8 and parts[0] == "nag":
                shares = re.search(r"\((\d+: \d+%(?:, \d+: \d+%)*)\)$", parts[3]).group(1)
                rows[float(parts[2])] = ({int(d): int(v) for d, v in re.findall(r"(\d+): (\d+)%", shares)}, parts[7])
        return rows
    rows = front(one_side_reports["design"])
    shares, moves = rows[4e12]
    assert set(shares) == {4, 8} and all(0 < v < 100 for v in shares.values()) and sum(shares.values()) == 100
    assert moves.startswith("undecided at 95%")
    assert max(rows[1.6e13][0].values()) > max(shares.values())
    assert all(list(s.values()) == [100] for s, _ in front(one_side_reports["none"]).values())


def test_the_leave_one_budget_out_check_compares_with_the_half_width():
    """A baseline with one budget (4e12) 0.01 off its curve: leaving it out moves the fitted overall by D, the
    largest change over the budgets left out. Against a measured interval whose half-width is 0.75 D (its whole
    width 1.5 D) the fit is named degenerate at that budget; against one whose half-width is D / 0.95, it is not
    and the fitted number is given. A check against the whole width passes the first."""
    base = {b: [(b, base_loss(b) + (0.01 if b == 4e12 else 0))] for b in BUDGETS}
    cell = {b: [(b, base_loss(2 * b))] for b in BUDGETS[:3]}
    _, inside, _ = mult.multipliers(base, cell)
    _, span = mult.measured_curve(base)
    params, s, bound = mult.joint_fit({"p": base, "c": cell})
    m = mult.fitted_overall(params, s, "p", cell, span, inside)
    changes = {}
    for b in BUDGETS:
        p2, s2, bound2 = mult.joint_fit({"p": {k: v for k, v in base.items() if k != b}, "c": cell})
        assert not bound2
        changes[b] = abs(mult.fitted_overall(p2, s2, "p", cell, span, inside) - m)
    worst = max(changes, key=changes.get)
    d = changes[worst]
    assert worst == 4e12 and not bound and d > 0.005
    law, fitted = mult.fit_check({"p": base, "c": cell}, "p", ["c"], {"c": inside}, {"c": (1.9, 1.9 + 1.5 * d)})
    assert law.startswith("L = ") and fitted["c"][0] is None
    assert fitted["c"][1].startswith("degenerate fit: without the baseline's budget 4e+12 it gives ")
    assert fitted["c"][1].endswith(f"(more than the interval's half-width, {0.75 * d:.3g})")
    _, fitted = mult.fit_check({"p": base, "c": cell}, "p", ["c"], {"c": inside}, {"c": (1.9, 1.9 + 2 * d / 0.95)})
    assert fitted["c"] == (pytest.approx(m, rel=1e-9), "")


def runs_at(loss, budgets=BUDGETS):
    """One run at each budget on a loss curve: a cell's budget groups."""
    return {b: [(b, loss(b))] for b in budgets}


CLOSE = [1e12 * 1.15 ** k for k in range(5)]  # budgets close together: an exponent of 7 shows in them
BOUNDED = {  # a sweep whose joint fit puts one parameter on one of its bounds, and the line that names it
    "E_at_0": ({"p": runs_at(lambda c: 4 - 0.3 * math.log(c / 1e12))}, "E at its lower bound 0"),
    "E_at_the_lowest_loss": ({"p": runs_at(base_loss), "c": runs_at(lambda c: 1.44 + 0.01 * math.log2(c / 2e12),
                                                                    BUDGETS[1:3])},
                             "E at its upper bound (the lowest mean loss, 1.4400)"),
    "baseline_alpha_at_5": ({"p": runs_at(lambda c: 2 + 2 * (c / 1e12) ** -7, CLOSE)}, "alpha of p at its bound 5"),
    "baseline_alpha_at_0.001": ({"p": runs_at(lambda c: 3 - 0.0002 * math.log2(c / 1e12)), "c": runs_at(base_loss)},
                                  "alpha of p at its bound 0.001"),
    "cell_alpha_at_5": ({"p": runs_at(base_loss), "c": runs_at(lambda c: 2 + 2 * (c / 1e12) ** -7, CLOSE[:4])},
                            "alpha of c at its bound 5"),
    "cell_alpha_at_0.001": ({"p": runs_at(base_loss), "c": runs_at(lambda c: 3 + 0.05 * math.log2(c / 1e12),
                                                                       BUDGETS[:4])},
                                "alpha of c at its bound 0.001"),
}


@pytest.mark.parametrize("case", BOUNDED)
def test_a_fit_on_any_of_its_bounds_is_named_degenerate(case):
    """Every bound the joint fit has (E's 0 and the lowest mean loss; each exponent's ALPHA_BOUNDS, the baseline's
    and a cell's with its own) reached by a sweep made to reach it, that bound alone: the fit is named degenerate
    with that bound, as the fits table prints it, and no cell gets a fitted number."""
    groups, named = BOUNDED[case]
    _, _, bound = mult.joint_fit(groups)
    assert bound == [named]
    cells = [c for c in groups if c != "p"]
    law, fitted = mult.fit_check(groups, "p", cells, {c: list(groups[c]) for c in cells},
                                 {c: (1.0, 2.0) for c in cells})
    assert law == f"degenerate fit: {named}"
    assert fitted == {c: (None, "degenerate fit") for c in cells}


def bench_keys():
    """bench.py's DEFAULTS, read from its source (as its --help reads their comments) without importing it."""
    import ast
    tree = ast.parse((REPO / "bench.py").read_text())
    (call,) = [node.value for node in tree.body if isinstance(node, ast.Assign)
               and [getattr(t, "id", None) for t in node.targets] == ["DEFAULTS"]]
    sections = [node.value for node in tree.body if isinstance(node, ast.Assign)
                and [getattr(t, "id", None) for t in node.targets] == ["SECTIONS"]]
    return {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}, ast.literal_eval(sections[0])


def test_the_step_times_hint_names_real_bench_keys(tmp_path):
    """A --step_times file that is not bench.py's step times: the one-line error's command is one that bench.py's
    configurator takes (every --key in its DEFAULTS, of its type; the section one of its SECTIONS), and it writes
    the CSV where --step_times looked (--steps_out)."""
    from configurator import configure
    path = write_csv(tmp_path / "r.csv", BUDGETS, {"prenorm": base_loss, "nag": two_x})
    with pytest.raises(ConfigError, match="not bench.py's step times") as err:
        flops.multiplier([str(path), "--boot=20", f"--step_times={path}"])
    command = str(err.value).split("python bench.py ", 1)[1]
    args = command.split(" ")
    assert len(args) >= 3 and all(a.startswith("--") for a in args), command
    defaults, sections = bench_keys()
    cfg = configure([a.replace("<sweep>", "sweep") for a in args], defaults)
    assert cfg["section"] == "steps" and "steps" in sections and cfg["steps_out"] == str(path)
