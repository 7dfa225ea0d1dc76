"""Compute multipliers (flops.py multiplier) on synthetic budget sweeps with known answers, and budget
sweeps (budgets = [...]) on fake train.py runs."""

import csv
import math
import random
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import flops  # noqa: E402
from configurator import ConfigError  # noqa: E402
from test_flops import fake_train, tiny_train_config  # noqa: E402,F401  (fake_train: a fixture)

BUDGETS = [1e12, 2e12, 4e12, 8e12, 1.6e13]  # 16x


def base_loss(c):
    """The baseline's curve: L = 1.5 + 40 (C / 1e8)^-0.3 (4.02 at 1e12, 2.59 at 1.6e13)."""
    return 1.5 + 40 * (c / 1e8) ** -0.3


def write_csv(path, budgets, cells, seeds=(1, 2, 3), noise=0.004, seed=0):
    """A results.csv of a budget sweep: cells {name: (loss(C), seconds per FLOP)}, each run at its budget
    with a seeded Gaussian noise on its loss."""
    rng = random.Random(seed)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, flops.FIELDS)
        w.writeheader()
        for b in budgets:
            for s in seeds:
                for cell, (loss, pace) in cells.items():
                    w.writerow({k: "" for k in flops.FIELDS} | {
                        "run": f"{cell}_s{s}", "cell": cell, "seed": s, "residual": cell, "n_layer": 4, "mod": "",
                        "mod_rate": 0.0, "args": "", "status": "done", "iters": 100, "tokens": 1000, "flops": b,
                        "val_loss": loss(b) + rng.gauss(0, noise), "seconds": b * pace, "budget": b,
                        "device": "cpu"})
    return path


def rows_of(text, cell):
    """{budget column: the row's cells} of a multiplier table's rows for `cell`."""
    out = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.strip("|").split("|")]
        if len(parts) == 7 and parts[0] == cell:
            out[parts[2]] = parts
    return out


def number(shown):
    return float(shown.split("x")[0])


def two_x(c):  # the design's loss is the baseline's at twice the compute: its multiplier is 2 at every budget
    return base_loss(2 * c)


def test_multiplier_recovers_known_value_and_time_multiplier(tmp_path):
    """A design whose loss is the baseline's at 2x compute gives 2 at every budget and overall (a C/C_base
    inversion gives 0.5, a loss difference ~0.1); at 1.25x the baseline's seconds per FLOP it is worth
    2 / 1.25 = 1.6 at equal time, labelled with the device; the figure is written beside the CSV."""
    path = write_csv(tmp_path / "results.csv", BUDGETS, {"prenorm": (base_loss, 1e-10), "nag": (two_x, 1.25e-10)})
    text = flops.multiplier([str(path), "--boot=200"])
    flops_part, time_part = text.split("Compute multiplier at equal time")
    rows = rows_of(flops_part, "nag")
    assert "power-law fit" in rows["1e+12"][6]
    for b in ("1e+12", "2e+12", "4e+12"):  # (at 8e12 the design reaches the baseline's lowest loss: an edge)
        assert number(rows[b][3]) == pytest.approx(2.0, rel=0.1)
        assert rows[b][5] == "-"  # inside the baseline's range
    assert number(rows["overall"][3]) == pytest.approx(2.0, rel=0.08)
    lo, hi = (number(v) for v in rows["overall"][4].split(" - "))
    assert lo < 2.0 < hi and hi / lo < 2  # the interval holds the truth, and is not everything
    assert "measured on CPU" in time_part
    t = rows_of(time_part, "nag")
    assert number(t["overall"][3]) == pytest.approx(1.6, rel=0.08)
    assert (tmp_path / "results_multiplier.png").stat().st_size > 0


def test_the_trend_says_whether_the_multiplier_grows(tmp_path):
    """A design worth 1.5x at 1e12 and 2^0.2 = 1.149x more each time compute doubles: the trend row gives
    1.149 and says it grows; the constant 2x design's interval holds 1 (no trend); one that loses its edge
    (2^-0.2 per doubling) shrinks."""
    def drifting(power):
        return lambda c: base_loss(1.5 * (c / 1e12) ** power * c)
    path = write_csv(tmp_path / "r.csv", BUDGETS, {"prenorm": (base_loss, 1e-10), "grows": (drifting(0.2), 1e-10),
                                                   "flat": (two_x, 1e-10), "shrinks": (drifting(-0.2), 1e-10)})
    text = flops.multiplier([str(path), "--boot=100"]).split("Compute multiplier at equal time")[0]
    grows, flat, shrinks = (rows_of(text, c)["per 2x compute"] for c in ("grows", "flat", "shrinks"))
    assert number(grows[3]) == pytest.approx(2 ** 0.2, rel=0.03) and grows[5] == "grows with compute"
    assert number(shrinks[3]) == pytest.approx(2 ** -0.2, rel=0.03) and shrinks[5] == "shrinks with compute"
    lo, hi = (number(v) for v in flat[4].split(" - "))
    assert lo < 1 < hi and flat[5] == "no trend at 95%"


def test_extrapolation_is_labelled(tmp_path):
    """At the largest budget the 2x design is below anything the baseline reached: labelled extrapolated,
    never a bare number; a design better than the baseline's asymptote gets no number at all."""
    path = write_csv(tmp_path / "r.csv", BUDGETS, {"prenorm": (base_loss, 1e-10), "nag": (two_x, 1e-10),
                                                   "magic": (lambda c: 1.2, 1e-10)})
    text = flops.multiplier([str(path), "--boot=50"]).split("Compute multiplier at equal time")[0]
    top = rows_of(text, "nag")["1.6e+13"]
    assert top[3].endswith("(extrapolated)") and top[5] == "extrapolated"
    assert "extrapolated" in rows_of(text, "nag")["overall"][3]
    magic = rows_of(text, "magic")
    assert all(r[3].startswith("none: below the baseline's asymptote") for b, r in magic.items()
               if b not in ("overall", "per 2x compute"))
    assert magic["per 2x compute"][3] == "-"  # no number to follow
    assert magic["overall"][3] == "none: below the baseline's asymptote at every budget"


def test_two_budgets_fall_back_to_interpolation(tmp_path):
    """With 2 budgets the power law is not fitted: log-log interpolation, named, gives about 2 (the curve is
    not a straight line in log-log, so within 15%); the 2-budget design's top budget is out of range: no number."""
    path = write_csv(tmp_path / "r.csv", [1e12, 4e12], {"prenorm": (base_loss, 1e-10), "nag": (two_x, 1e-10)})
    text = flops.multiplier([str(path), "--boot=50"]).split("Compute multiplier at equal time")[0]
    rows = rows_of(text, "nag")
    assert rows["1e+12"][6] == "log-log interpolation (fewer than 3 budgets)"
    assert number(rows["1e+12"][3]) == pytest.approx(2.0, rel=0.15)
    assert rows["4e+12"][3] == "none: extrapolated"


def test_a_committed_csv_keeps_its_committed_figure(tmp_path, monkeypatch):
    """Run on a CSV in docs/ (a committed result), the figure goes to out/, not over docs/'s tracked one;
    --out still writes where it says."""
    monkeypatch.setattr(flops, "HERE", str(tmp_path))
    (tmp_path / "docs").mkdir()
    path = write_csv(tmp_path / "docs" / "r.csv", [1e12, 4e12], {"prenorm": (base_loss, 1e-10), "nag": (two_x, 1e-10)})
    (tmp_path / "docs" / "r_multiplier.png").write_bytes(b"the committed figure")
    text = flops.multiplier([str(path), "--boot=20"])
    assert (tmp_path / "docs" / "r_multiplier.png").read_bytes() == b"the committed figure"
    assert (tmp_path / "out" / "r_multiplier.png").stat().st_size > 0
    assert f"figure: {tmp_path / 'out' / 'r_multiplier.png'}" in text
    flops.multiplier([str(path), "--boot=20", f"--out={tmp_path / 'docs' / 'r_multiplier.png'}"])
    assert (tmp_path / "docs" / "r_multiplier.png").read_bytes() != b"the committed figure"


def test_bootstrap_reproducible_and_covers(tmp_path):
    """The same CSV and boot_seed print the same table; another boot_seed another one; over 15 noisy sweeps
    the 95% interval at 1.25x holds the truth at least 13 times."""
    path = write_csv(tmp_path / "r.csv", BUDGETS, {"prenorm": (base_loss, 1e-10),
                                                   "nag": (lambda c: base_loss(1.25 * c), 1e-10)})
    one = flops.multiplier([str(path), "--boot=50"])
    assert flops.multiplier([str(path), "--boot=50"]) == one
    assert flops.multiplier([str(path), "--boot=50", "--boot_seed=1"]) != one
    covered = 0
    for draw in range(15):
        rows = write_csv(tmp_path / "d.csv", BUDGETS, {"prenorm": (base_loss, 1e-10),
                                                       "nag": (lambda c: base_loss(1.25 * c), 1e-10)},
                         noise=0.01, seed=100 + draw)
        table, _ = flops.multiplier_table(flops.read_results(rows), "flops", boot=80)
        lo, hi = (number(v) for v in rows_of(table, "nag")["overall"][4].split(" - "))
        covered += lo <= 1.25 <= hi
    assert covered >= 13


def test_degenerate_inputs_give_a_line(tmp_path):
    """One budget, and a baseline whose loss does not fall with compute: a one-line message, no number."""
    one = write_csv(tmp_path / "one.csv", [1e12], {"prenorm": (base_loss, 1e-10), "nag": (two_x, 1e-10)})
    assert "| nag | prenorm | - | no multiplier: one budget" in flops.multiplier([str(one), "--boot=10"])
    flat = write_csv(tmp_path / "flat.csv", BUDGETS, {"prenorm": (lambda c: 3.0 + c / 1e14, 1e-10),
                                                      "nag": (two_x, 1e-10)}, noise=0.0)
    assert "no multiplier: the baseline's mean loss does not fall" in flops.multiplier([str(flat), "--boot=10"])
    with pytest.raises(flops.Degenerate, match="does not fall"):
        flops.fit_curve({1: [(1.0, 3.0)], 2: [(2.0, 3.0)], 3: [(3.0, 3.0)]})


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

    def watching(argv):  # the top results.csv as the second budget starts
        if "--sweep_name=m/b2e09" in argv:
            with open(root / "results.csv") as f:
                seen.extend(float(r["budget"]) for r in csv.DictReader(f))
        return run_sweep(argv)
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
