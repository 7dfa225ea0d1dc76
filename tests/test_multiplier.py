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
