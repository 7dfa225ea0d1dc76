"""Compute multipliers (flops.py multiplier) on synthetic budget sweeps with known answers, their seed-paired
jackknife intervals recomputed by hand, and budget sweeps (budgets = [...]) on fake train.py runs."""

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
import stats  # noqa: E402
from configurator import ConfigError  # noqa: E402
from test_flops import fake_train, tiny_train_config  # noqa: E402,F401  (fake_train: a fixture)

BUDGETS = [1e12, 2e12, 4e12, 8e12, 1.6e13]  # 16x


def base_loss(c):
    """The baseline's curve: L = 1.5 + 40 (C / 1e8)^-0.3 (4.02 at 1e12, 2.59 at 1.6e13)."""
    return 1.5 + 40 * (c / 1e8) ** -0.3


def write_csv(path, budgets, cells, seeds=(1, 2, 3), noise=0.004, seed=0, iters=1000):
    """A results.csv of a budget sweep: cells {name: loss(C) or dict(loss=, budgets=, n_layer=, noise=, iters=,
    seed_loss=)}, each run at its budgets (else `budgets`) with a seeded Gaussian noise on its loss (its own
    noise, else `noise`); seed_loss(C, seed) in place of loss gives each seed its own loss. Every run trains
    `iters` optimizer steps (above multiplier.MIN_STEPS: no budget is short), or the cell's own iters (a number
    or {budget: steps}, the rest `iters`); iters None writes no iters, as a CSV from before that column."""
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
                    steps = v.get("iters", iters)
                    steps = steps.get(b, iters) if isinstance(steps, dict) else steps
                    loss = v["seed_loss"](b, s) if "seed_loss" in v else v["loss"](b)
                    w.writerow({k: "" for k in flops.FIELDS} | {
                        "run": f"{cell}_s{s}", "cell": cell, "seed": s, "residual": v.get("residual", cell),
                        "n_layer": v.get("n_layer", 4), "mod": "", "mod_rate": 0.0, "args": "", "status": "done",
                        "iters": "" if steps is None else steps, "tokens": 1000, "flops": b, "budget": b,
                        "device": "cpu", "val_loss": loss + rng.gauss(0, v.get("noise", noise)),
                        "seconds": b * 1e-10})
    return path


def rows_of(text, cell):
    """{budget column: the row's cells} of the multiplier table's rows for `cell` (the budget column cut at its
    first space: 'overall (3 headline budgets)' is 'overall', 'per 2x compute' is 'per'). A row's cells: cell,
    baseline, budget, multiplier, 95% interval, p, p (Holm), fitted, note."""
    out = {}
    for line in text.split("The fits")[0].splitlines():
        parts = [p.strip() for p in line.strip("|").split("|")]
        if len(parts) == 9 and parts[0] == cell:
            out[parts[2].split(" ")[0]] = parts
    return out


def number(shown):
    return float(shown.split("x")[0])


def interval_of(shown):
    return tuple(number(v) for v in shown.split(" - "))


def p_of(shown):
    """A p-value as the tables print it (stats.fmt_p), as a number ('<1e-4': 1e-4)."""
    return 1e-4 if shown == "<1e-4" else float(shown)


def shown_interval(ci):
    """An interval (lo, hi) of a multiplier as the tables print it."""
    return f"{ci[0]:.3g}x - {ci[1]:.3g}x"


def report(path, tmp_path, *args):
    """flops.py multiplier on a CSV, its figures written under tmp_path."""
    return flops.multiplier([str(path), *args, f"--out={tmp_path / 'm.png'}"])


def times(m):
    """A design whose loss is the baseline's at m(C) x its compute: its multiplier is m(C)."""
    return lambda c: base_loss(m(c) * c)


def two_x(c):  # worth 2x the baseline's compute at every budget
    return base_loss(2 * c)


def cell_groups(rows, cell, without=None):
    """mult.seed_groups of a cell's rows of a results.csv, the runs of seed `without` left out."""
    return mult.seed_groups([r for r in rows if r["cell"] == cell and r["seed"] != without])


def test_multiplier_recovers_a_known_value_in_range(tmp_path):
    """A design worth 2x at 2e12 and 4e12, against a baseline measured from 1e12 to 1.6e13: its losses lie on the
    baseline's measured budgets (4e12, 8e12), so the measured multiplier is 2 (a C/C_base inversion gives 0.5);
    both budgets are headline ones; the interval holds 2 and is not everything, p says it is worth more than its
    compute; the fit agrees; the figure is written beside the CSV."""
    path = write_csv(tmp_path / "results.csv", BUDGETS, {"prenorm": base_loss,
                                                         "nag": {"loss": two_x, "budgets": [2e12, 4e12]}})
    text = flops.multiplier([str(path)])
    rows = rows_of(text, "nag")
    for b in ("2e+12", "4e+12"):
        assert number(rows[b][3]) == pytest.approx(2.0, rel=0.03) and rows[b][8] == "headline"
        assert rows[b][6] == "-"  # a budget's figure is not in the family
    assert rows["overall"][2] == "overall (2 headline budgets)"
    assert number(rows["overall"][3]) == pytest.approx(2.0, rel=0.03)
    lo, hi = interval_of(rows["overall"][4])
    assert lo < 2.0 < hi and hi / lo < 1.3
    assert p_of(rows["overall"][5]) < 0.01 and rows["overall"][6] == rows["overall"][5]  # a family of one
    assert number(rows["overall"][7]) == pytest.approx(2.0, rel=0.05) and rows["overall"][8] == "agrees"
    assert rows["per"][3] == "-" and "needs 4 headline budgets, has 2" in rows["per"][8]
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
    text = report(path, tmp_path)
    grows, flat = rows_of(text, "grows"), rows_of(text, "flat")
    assert grows["overall"][2] == "overall (5 headline budgets)"
    assert number(grows["overall"][3]) == pytest.approx(2.0, rel=0.05)
    assert number(grows["per"][3]) == pytest.approx(2 ** 0.5, rel=0.05) and grows["per"][8] == "grows with compute"
    assert number(flat["per"][3]) == pytest.approx(1.0, abs=0.01) and flat["per"][8] == "no trend at 95%"
    at = {b: (m, True) for b, m in zip(BUDGETS, (1, 2 ** 0.5, 2, 2 ** 1.5, 4))}
    assert mult.overall(at, BUDGETS) == pytest.approx(2.0, rel=1e-12)
    assert mult.trend(at, BUDGETS) == pytest.approx(2 ** 0.5, rel=1e-12)
    assert mult.trend(at, BUDGETS[:3]) is None  # fewer than MIN_TREND_BUDGETS


def test_the_interval_is_the_delete_one_seed_jackknife_with_t(tmp_path):
    """The overall interval and p of a design worth 1.25x (5 seeds, noisy) are exp(log m ± t_{4, 0.975} se) and
    2 t_4.sf(|log m| / se), se the jackknife's, sqrt((n - 1) / n sum (r_i - mean r)^2), over the 5 overall log
    multipliers recomputed here by mult.multipliers on the runs without each seed (left out of both cells at
    once); each budget's interval likewise. The printed rows show them. A normal quantile, t with 5 degrees of
    freedom, or a seed left out of the design's runs alone (the pairing lost) gives other figures."""
    from scipy import stats as st
    seeds = (1, 2, 3, 4, 5)
    cells = {"prenorm": base_loss, "nag": {"loss": times(lambda c: 1.25), "budgets": [2e12, 4e12, 8e12]}}
    path = write_csv(tmp_path / "r.csv", BUDGETS, cells, seeds=seeds, noise=0.01, seed=7)
    rows = flops.read_results(str(path))
    at, inside, m = mult.multipliers(cell_groups(rows, "prenorm"), cell_groups(rows, "nag"))
    assert inside == [2e12, 4e12, 8e12]
    left_out = [mult.multipliers(cell_groups(rows, "prenorm", s), cell_groups(rows, "nag", s)) for s in seeds]
    unpaired = [mult.multipliers(cell_groups(rows, "prenorm"), cell_groups(rows, "nag", s))[2] for s in seeds]

    def by_hand(value, reps, q=st.t.ppf(0.975, 4)):
        reps = np.log(reps)
        se = math.sqrt(4 / 5 * sum((r - reps.mean()) ** 2 for r in reps))
        return (math.exp(math.log(value) - q * se), math.exp(math.log(value) + q * se)), se
    ci, se = by_hand(m, [r[2] for r in left_out])
    p = 2 * st.t.sf(abs(math.log(m)) / se, 4)
    j = mult.intervals(cell_groups(rows, "prenorm"), cell_groups(rows, "nag"), inside)[1]
    assert j["m"] == pytest.approx(m, rel=1e-12) and j["se"] == pytest.approx(se, rel=1e-9)
    assert j["mci"] == pytest.approx(ci, rel=1e-9) and j["p"] == pytest.approx(p, rel=1e-9) and j["df"] == 4
    width = j["ci"][1] - j["ci"][0]  # on the log scale
    assert width == pytest.approx(2 * st.t.ppf(0.975, 4) * se, rel=1e-9)
    assert width != pytest.approx(2 * st.norm.ppf(0.975) * se, rel=0.05)
    assert width != pytest.approx(2 * st.t.ppf(0.975, 5) * se, rel=0.05)
    assert j["se"] != pytest.approx(by_hand(m, unpaired)[1], rel=0.1)
    text = report(path, tmp_path)
    printed = rows_of(text, "nag")
    assert printed["overall"][4] == shown_interval(ci) and printed["overall"][5] == stats.fmt_p(p)
    assert "jackknife over the 5 seeds" in text
    for b in inside:
        ci_b, se_b = by_hand(at[b][0], [r[0][b][0] for r in left_out])
        assert printed[f"{b:.3g}"][4] == shown_interval(ci_b)
        assert printed[f"{b:.3g}"][5] == stats.fmt_p(2 * st.t.sf(abs(math.log(at[b][0])) / se_b, 4))


@pytest.mark.parametrize("noisy", ["design", "baseline"])
def test_the_interval_leaves_each_seed_out_of_both_sides(tmp_path, noisy):
    """Noise on one side only (the design's runs, or the baseline's): the interval still has width, so a
    jackknife that leaves the seeds out of one side's runs alone fails; with no noise at all it collapses to
    the point (p: none, no spread to test)."""
    cells = {"prenorm": {"loss": base_loss, "noise": 0.02 if noisy == "baseline" else 0.0},
             "nag": {"loss": two_x, "budgets": [2e12, 4e12], "noise": 0.02 if noisy == "design" else 0.0}}
    lo, hi = interval_of(rows_of(report(write_csv(tmp_path / "r.csv", BUDGETS, cells), tmp_path), "nag")["overall"][4])
    assert hi / lo > 1.02
    cells["prenorm"]["noise"] = cells["nag"]["noise"] = 0.0
    still = rows_of(report(write_csv(tmp_path / "z.csv", BUDGETS, cells), tmp_path), "nag")["overall"]
    lo, hi = interval_of(still[4])
    assert hi / lo == pytest.approx(1.0, abs=1e-9) and still[5] == "–"


def test_extrapolation_is_flagged_and_left_out(tmp_path):
    """A design below the baseline's lowest mean loss at its top budget: that figure is flagged 'extrapolated'
    and the overall is the geometric mean of the in-range budgets alone; one worse than the baseline's
    smallest budget is flagged too; a design never in range has no overall."""
    path = write_csv(tmp_path / "r.csv", BUDGETS, {
        "prenorm": base_loss, "nag": {"loss": two_x, "budgets": [2e12, 4e12, 1.6e13]},
        "slow": {"loss": times(lambda c: 0.25), "budgets": [1e12, 8e12]},
        "magic": {"loss": lambda c: 1.2, "budgets": [4e12]}}, noise=0.0)
    text = report(path, tmp_path)
    nag = rows_of(text, "nag")
    assert nag["1.6e+13"][3].endswith("(extrapolated)")
    assert nag["1.6e+13"][8] == "extrapolated: outside the baseline range, not in the overall"
    assert nag["overall"][2] == "overall (2 headline budgets)"
    in_range = [number(nag[b][3]) for b in ("2e+12", "4e+12")]
    assert number(nag["overall"][3]) == pytest.approx(math.sqrt(in_range[0] * in_range[1]), rel=0.01)
    slow = rows_of(text, "slow")
    assert slow["1e+12"][3].endswith("(extrapolated)") and slow["8e+12"][8] == "headline"
    assert number(slow["overall"][3]) == pytest.approx(0.25, rel=0.05)
    assert rows_of(text, "magic")["overall"][3] == "none: no headline budget"


def test_a_short_budget_is_flagged_and_left_out_of_the_overall(tmp_path):
    """A design that trains 150 optimizer steps at 4e12 (< MIN_STEPS), 300 (MIN_STEPS: enough) at 2e12 and 1000 at
    8e12: its 4e12 figure is printed, flagged short, and left out; the overall is the geometric mean of the other
    two (not of all three), its interval the jackknife over those two; the training-length table flags the cell
    there."""
    cells = {"prenorm": base_loss, "nag": {"loss": times(lambda c: 1.25 if c != 4e12 else 2.0),
                                           "budgets": [2e12, 4e12, 8e12], "iters": {4e12: 150, 2e12: 300}}}
    path = write_csv(tmp_path / "r.csv", BUDGETS, cells, noise=0.002)
    text = report(path, tmp_path)
    nag = rows_of(text, "nag")
    assert nag["4e+12"][3].endswith("(short (150 steps))") and number(nag["4e+12"][3]) == pytest.approx(2, rel=0.03)
    assert nag["4e+12"][8] == f"short: 150 optimizer steps (< {mult.MIN_STEPS}), not in the overall"
    assert nag["2e+12"][8] == nag["8e+12"][8] == "headline"
    assert nag["overall"][2] == "overall (2 headline budgets)"
    assert number(nag["overall"][3]) == pytest.approx(1.25, rel=0.02)  # with 4e12: 1.46
    rows = flops.read_results(str(path))
    base, cell = cell_groups(rows, "prenorm"), cell_groups(rows, "nag")
    assert mult.steps_at(cell, 4e12) == 150 and mult.short(cell, 4e12) and not mult.short(cell, 2e12)
    at, inside, m = mult.multipliers(base, cell)
    assert inside == [2e12, 8e12] and m == pytest.approx(math.sqrt(at[2e12][0] * at[8e12][0]), rel=1e-12)
    assert f"{m:.3g}x" == nag["overall"][3]
    j = mult.jackknife_log(lambda s: mult.overall(mult.read_at(base, cell, s), [2e12, 8e12]), [1, 2, 3])
    assert nag["overall"][4] == shown_interval(j["mci"])
    (line,) = [x for x in text.split("Training length")[1].splitlines() if x.startswith("| nag |")]
    assert line == "| nag | - | 300, 30 | 150, 15 (short) | 1000, 100 | - |"


def test_a_csv_without_iters_has_no_short_budget(tmp_path):
    """A results.csv from before the iters column (none written): steps_at is None, no budget is short, every
    in-range budget is a headline one, and no training-length table is printed."""
    cells = {"prenorm": base_loss, "nag": {"loss": two_x, "budgets": [2e12, 4e12]}}
    path = write_csv(tmp_path / "r.csv", BUDGETS, cells, iters=None)
    rows = flops.read_results(str(path))
    assert all(r["iters"] is None for r in rows)
    cell = cell_groups(rows, "nag")
    assert mult.steps_at(cell, 2e12) is None and not mult.short(cell, 2e12)
    text = report(path, tmp_path)
    nag = rows_of(text, "nag")
    assert nag["overall"][2] == "overall (2 headline budgets)" and nag["2e+12"][8] == nag["4e+12"][8] == "headline"
    assert "Training length" not in text


def test_a_degenerate_fit_is_named_and_gives_no_number(tmp_path):
    """A baseline straight in log compute (a power law only in the limit E -> 0, alpha -> 0) puts E on its bound:
    the fit is named degenerate, no fitted number and no law is printed; a baseline with one budget off its curve
    makes the fit move with that budget left out by more than the measured interval: named too, per cell."""
    straight = lambda c: 4 - 0.3 * math.log(c / 1e12)  # noqa: E731
    path = write_csv(tmp_path / "r.csv", BUDGETS, {"prenorm": straight,
                                                   "nag": {"loss": lambda c: straight(2 * c), "budgets": [2e12, 4e12]}},
                     noise=0.001)
    text = report(path, tmp_path)
    assert "| prenorm | degenerate fit: E at its lower bound 0 |" in text and "L = " not in text
    assert rows_of(text, "nag")["overall"][7] == "degenerate fit"
    rng = random.Random(0)
    base = {b: {s: (b, base_loss(b) + (0.06 if b == 4e12 else 0) + rng.gauss(0, 0.002), 1000) for s in range(3)}
            for b in BUDGETS}
    cell = {b: {s: (b, base_loss(2 * b) + rng.gauss(0, 0.002), 1000) for s in range(3)} for b in BUDGETS[:3]}
    at, inside, m = mult.multipliers(base, cell)
    ci = mult.intervals(base, cell, inside)[1]["mci"]
    law, fitted = mult.fit_check({"p": mult.at_seeds(base), "c": mult.at_seeds(cell)}, "p", ["c"], {"c": inside},
                                 {"c": ci})
    assert law.startswith("L = ") and fitted["c"][0] is None
    assert fitted["c"][1].startswith("degenerate fit: without the baseline's budget ")


def b8(c):
    """The baseline at 8 layers: 4 layers' curve shifted by 2x compute but starting 0.1 higher (0.05 at 4e12,
    fading at large budgets); 8 layers is the better depth at every budget of these grids."""
    return base_loss(2 * c) + 0.1 * 4e12 / (c + 4e12)


def depth_grid(grid):
    """A two-depth sweep: the baseline at 4 and 8 layers over `grid`, a design worth 1.2x at 4 layers and 1.44x
    at 8 over its middle three budgets."""
    return {"prenorm_L4": {"loss": base_loss, "n_layer": 4, "residual": "prenorm"},
            "prenorm_L8": {"loss": b8, "n_layer": 8, "residual": "prenorm"},
            "nag_L4": {"loss": lambda c: base_loss(1.2 * c), "n_layer": 4, "residual": "nag", "budgets": grid[1:4]},
            "nag_L8": {"loss": lambda c: b8(1.44 * c), "n_layer": 8, "residual": "nag", "budgets": grid[1:4]}}


def frontier_of(text, design="nag"):
    """{budget: the row's cells, its seeds column left out} of a design's rows in the compute-optimal frontier
    table."""
    out = {}
    for line in text.split("compute-optimal frontier")[1].splitlines():
        parts = [p.strip() for p in line.strip("|").split("|")]
        if len(parts) == 12 and parts[0] == design:
            out[float(parts[2])] = parts[:3] + parts[4:]
    return out


def test_depth_and_the_frontier_on_a_known_grid(tmp_path):
    """depth_grid: the design is worth 1.2 per doubling of depth at each of its budgets and pooled ('grows with
    depth'). Its best depth per budget and the baseline's are the known ones, both on the two-depth grid's edge,
    so no frontier multiplier is printed (test_frontier.py checks its value where both optima are bracketed);
    the best model against the best model is the known loss difference."""
    b4 = base_loss
    grid = [1e12 * 2 ** k for k in range(6)]
    text = report(write_csv(tmp_path / "r.csv", grid, depth_grid(grid), noise=0.001), tmp_path)
    assert number(rows_of(text, "nag_L4")["overall"][3]) == pytest.approx(1.2, rel=0.03)
    assert number(rows_of(text, "nag_L8")["overall"][3]) == pytest.approx(1.44, rel=0.03)
    trends = [[p.strip() for p in line.strip("|").split("|")] for line in text.split("Change per doubling of depth")[1]
              .split("compute-optimal frontier")[0].splitlines() if line.startswith("| nag |")]
    assert [t[1] for t in trends] == [f"{b:.3g} (4, 8 layers)" for b in grid[1:4]] + ["pooled (4, 8 layers)"]
    for t in trends:
        assert number(t[2]) == pytest.approx(1.2, rel=0.04) and t[6] == "grows with depth"
    front = frontier_of(text)
    assert sorted(front) == grid[1:4]
    for b in grid[1:4]:  # the known answer, from the noise-free curves
        best = min((4, 8), key=lambda d: (b4(1.2 * b), b8(1.44 * b))[d == 8])
        base_best = min((4, 8), key=lambda d: (b4(b), b8(b))[d == 8])
        assert front[b][3] == f"{best} (edge)" and front[b][4] == f"{base_best} (edge)"
        assert front[b][5] == f"none: the design's optimum ({best} layers) is on the grid's edge" and front[b][6] == "-"
        gap = min(b4(1.2 * b), b8(1.44 * b)) - min(b4(b), b8(b))
        assert float(front[b][7].split()[0]) == pytest.approx(gap, abs=0.003)
        assert front[b][9] == "no: the same best depth"


def steps_csv(path, rounds, device="test CPU"):
    """bench.py --section=steps's CSV: rounds {cell: [(its ms, its baseline's ms), one per round]}."""
    path.write_text("cell,baseline,n_layer,device,round,ms,baseline_ms\n" + "".join(
        f"{cell},base,4,{device},{i},{ms},{base_ms}\n" for cell, times in rounds.items()
        for i, (ms, base_ms) in enumerate(times)))
    return path


def throughput_row(text, cell):
    """A cell's row of the throughput table: (FLOP multiplier's interval, step-time ratio's interval, bench runs,
    drift, throughput-adjusted figure, its interval)."""
    (line,) = [x for x in text.split("Throughput-adjusted")[1].splitlines() if x.startswith(f"| {cell} |")]
    parts = [p.strip() for p in line.strip("|").split("|")]
    ratio = re.fullmatch(r"\S+ \((\S+) - (\S+)\)", parts[2]).groups()
    return (interval_of(parts[1].split("(")[1].rstrip(")")), tuple(map(float, ratio)), parts[3], parts[4],
            number(parts[5]), interval_of(parts[6]))


def test_throughput_adjusted_multiplier(tmp_path):
    """With bench.py's step times (the design 1.25x the baseline's step time in every round), the 2x design is worth
    2 / 1.25 = 1.6 at equal time on that device; a file that is not step times is a one-line error."""
    path = write_csv(tmp_path / "r.csv", BUDGETS, {"prenorm": base_loss, "nag": {"loss": two_x, "budgets": [2e12, 4e12]}})
    steps = tmp_path / "steps.csv"
    steps.write_text("cell,baseline,n_layer,device,round,ms,baseline_ms\n" + "".join(
        f"nag,prenorm,4,test CPU,{i},{125 + d},{100 + 0.8 * d}\n" for i, d in enumerate((0, 1, -1, 2, -2))))
    text = report(path, tmp_path, f"--step_times={steps}")
    _, ratio, runs, _, adjusted, _ = throughput_row(text, "nag")
    assert ratio == pytest.approx((1.25, 1.25), rel=1e-3) and runs == "1"
    assert adjusted == pytest.approx(1.6, rel=0.04)
    assert "measured on test CPU" in text
    with pytest.raises(ConfigError, match="not bench.py's step times"):
        report(path, tmp_path, f"--step_times={path}")
    with pytest.raises(ConfigError, match=f"step_times={path} is not bench.py's step times"):
        report(path, tmp_path, f"--step_times={steps},{path}")  # one bad file of several: named


def test_the_throughput_interval_pools_the_runs_and_keeps_the_drift(tmp_path):
    """One bench run, noisy rounds, noiseless losses: the FLOP interval is the point 2, the step-time ratio's
    interval exp(mean ± t_8 sd / 3) of its 9 log ratios, the adjusted interval 2 over it turned round, and the
    table says that one run has no drift term. Noisy losses, rounds all 1.25: the adjusted interval is the FLOP
    interval / 1.25. Three runs of such rounds whose means differ (1.2, 1.25, 1.3x): the bench runs column says
    3, the drift column the sd of the run means, and the pooled interval is wider than any one run's (one that
    pooled the 27 rounds as one run is narrower)."""
    from scipy import stats as st
    cells = {"prenorm": base_loss, "nag": {"loss": two_x, "budgets": [2e12, 4e12]}}
    quiet = write_csv(tmp_path / "r.csv", BUDGETS, cells, noise=0.0)
    rng = random.Random(5)
    noise = [rng.gauss(0, 0.05) for _ in range(27)]
    runs = [steps_csv(tmp_path / f"run{k}.csv", {"nag": [(100 * r * (1 + e), 100) for e in noise[9 * k:9 * k + 9]]})
            for k, r in enumerate((1.2, 1.25, 1.3))]
    text = report(quiet, tmp_path, f"--step_times={runs[1]}")
    flop, ratio, n_runs, drift, _, adj = throughput_row(text, "nag")
    logs = [math.log(1.25 * (1 + e)) for e in noise[9:18]]
    half = st.t.ppf(0.975, 8) * np.std(logs, ddof=1) / 3
    assert ratio == pytest.approx((math.exp(np.mean(logs) - half), math.exp(np.mean(logs) + half)), abs=1e-3)
    assert flop[0] == pytest.approx(2.0, rel=1e-3) and flop[1] == pytest.approx(flop[0], rel=1e-9)
    assert ratio[1] / ratio[0] > 1.02 and adj == pytest.approx((flop[0] / ratio[1], flop[0] / ratio[0]), rel=0.01)
    assert n_runs == "1" and drift == "-" and "With one run the interval has no drift term" in text
    steady = steps_csv(tmp_path / "steady.csv", {"nag": [(125, 100)] * 9})
    text = report(write_csv(tmp_path / "n.csv", BUDGETS, cells, noise=0.02), tmp_path, f"--step_times={steady}")
    flop, ratio, *_, adj = throughput_row(text, "nag")
    assert ratio == (1.25, 1.25) and flop[1] / flop[0] > 1.02
    assert adj == pytest.approx((flop[0] / 1.25, flop[1] / 1.25), rel=0.01)
    alone = [throughput_row(report(quiet, tmp_path, f"--step_times={r}"), "nag")[1] for r in runs]
    text = report(quiet, tmp_path, f"--step_times={','.join(map(str, runs))}")
    _, ratio, n_runs, drift, _, adj = throughput_row(text, "nag")
    means = [np.mean([math.log(r * (1 + e)) for e in noise[9 * k:9 * k + 9]]) for k, r in enumerate((1.2, 1.25, 1.3))]
    assert n_runs == "3" and drift == f"{np.std(means, ddof=1):.3f}" and "With one run" not in text
    width = math.log(ratio[1] / ratio[0])
    assert all(width > 1.5 * math.log(hi / lo) for lo, hi in alone)
    flat = stats.pooled_runs([[math.log(r * (1 + e)) for k, r in enumerate((1.2, 1.25, 1.3))
                               for e in noise[9 * k:9 * k + 9]]])
    assert width > 1.5 * (flat["ci"][1] - flat["ci"][0])
    assert adj == pytest.approx((2 / ratio[1], 2 / ratio[0]), rel=0.01)


def test_a_committed_csv_keeps_its_committed_figure(tmp_path, monkeypatch):
    """Run on a CSV in results/ (a committed result), the figure goes to out/, not over results/'s tracked one;
    --out still writes where it says."""
    monkeypatch.setattr(flops, "HERE", str(tmp_path))
    (tmp_path / "results").mkdir()
    path = write_csv(tmp_path / "results" / "r.csv", [1e12, 4e12], {"prenorm": base_loss, "nag": two_x})
    (tmp_path / "results" / "r_multiplier.png").write_bytes(b"the committed figure")
    text = flops.multiplier([str(path)])
    assert (tmp_path / "results" / "r_multiplier.png").read_bytes() == b"the committed figure"
    assert (tmp_path / "out" / "r_multiplier.png").stat().st_size > 0
    assert f"figure: {tmp_path / 'out' / 'r_multiplier.png'}" in text
    flops.multiplier([str(path), f"--out={tmp_path / 'results' / 'r_multiplier.png'}"])
    assert (tmp_path / "results" / "r_multiplier.png").read_bytes() != b"the committed figure"


def test_the_jackknife_is_deterministic_and_covers(tmp_path):
    """The intervals follow the runs alone: the same CSV prints the same table twice, and so does a copy with its
    rows in another order; over 15 noisy sweeps of 5 seeds the 95% interval of a design worth 1.25x holds the
    truth at least 13 times (these sweeps: 14; with the normal quantile 12, with half the width 10)."""
    cells = {"prenorm": base_loss, "nag": {"loss": times(lambda c: 1.25), "budgets": [2e12, 4e12, 8e12]}}
    path = write_csv(tmp_path / "r.csv", BUDGETS, cells, seeds=(1, 2, 3, 4, 5), noise=0.01)
    one = report(path, tmp_path)
    assert report(path, tmp_path) == one
    lines = path.read_text().splitlines()
    shuffled = lines[1:]
    random.Random(1).shuffle(shuffled)
    (tmp_path / "shuffled").mkdir()
    (tmp_path / "shuffled" / "r.csv").write_text("\n".join(lines[:1] + shuffled) + "\n")
    assert shuffled != lines[1:] and report(tmp_path / "shuffled" / "r.csv", tmp_path) == one
    pairs = {"nag": "prenorm"}
    covered = 0
    for draw in range(15):
        rows = flops.read_results(str(write_csv(tmp_path / "d.csv", BUDGETS, cells, seeds=(1, 2, 3, 4, 5),
                                                noise=0.01, seed=100 + draw)))
        text, results = mult.report(rows, pairs)
        lo, hi = results["nag"]["ci"]["mci"]  # unrounded: the printed 3 digits are as coarse as the interval
        assert rows_of(text, "nag")["overall"][4] == shown_interval((lo, hi))
        covered += lo <= 1.25 <= hi
    assert covered >= 13


def test_the_same_csv_prints_the_same_intervals_in_every_process(tmp_path):
    """The jackknife follows the CSV alone: two processes with other string hashes (which order a set of cell
    names or seeds) print the same report, the depth trends' and the frontier's intervals included."""
    grid = [1e12 * 2 ** k for k in range(6)]
    path = write_csv(tmp_path / "r.csv", grid, depth_grid(grid), noise=0.01)
    cmd = [sys.executable, str(REPO / "flops.py"), "multiplier", str(path), f"--out={tmp_path / 'm.png'}"]
    out = [subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO,
                          env=os.environ | {"PYTHONHASHSEED": h}).stdout for h in ("1", "2")]
    assert "compute-optimal frontier" in out[0] and "Change per doubling of depth" in out[0] and out[0] == out[1]


def test_degenerate_inputs_give_a_line(tmp_path):
    """One budget, and a baseline whose loss does not fall with compute: a one-line message, no number."""
    one = write_csv(tmp_path / "one.csv", [1e12], {"prenorm": base_loss, "nag": two_x})
    assert "| nag | prenorm | - | no multiplier: one budget" in report(one, tmp_path)
    flat = write_csv(tmp_path / "flat.csv", BUDGETS, {"prenorm": lambda c: 3.0 + c / 1e14, "nag": two_x}, noise=0.0)
    assert "no multiplier: the baseline's mean loss does not fall" in report(flat, tmp_path)
    with pytest.raises(mult.Degenerate, match="does not fall"):
        mult.measured_curve({1: [(1.0, 3.0)], 2: [(2.0, 3.0)], 3: [(3.0, 3.0)]})


@pytest.mark.parametrize("option", ["--boot=200", "--boot_seed=1"])
def test_the_bootstrap_options_are_gone_with_a_clear_line(tmp_path, option):
    """The percentile bootstrap's options (--boot, --boot_seed) are gone (the intervals are the seed jackknife's,
    which has no draws): an old command fails with the configurator's one line naming the key."""
    path = write_csv(tmp_path / "r.csv", BUDGETS, {"prenorm": base_loss, "nag": two_x})
    key = option[2:].split("=")[0]
    with pytest.raises(ConfigError, match=rf"^unknown config key '{key}' in '{option}'"):
        flops.multiplier([str(path), option])
    assert "boot" not in flops.MULTIPLIER_DEFAULTS and not hasattr(mult, "bootstrap")


def test_old_single_budget_csvs_still_load(tmp_path):
    """Every shipped results/sweep_*.csv of one budget (or none: no budget column) still builds its results tables
    (a budgets sweep's, every budget in one CSV, is read by the multiplier: results says so in one line), and
    the multiplier says in one line per cell that one budget gives none."""
    for path in sorted((REPO / "results").glob("sweep_*.csv")):
        if len({r.get("budget") for r in flops.read_results(str(path))}) > 1:
            with pytest.raises(ConfigError, match="read it with python flops.py multiplier"):
                flops.results([str(path)])
        else:
            assert "| cell | residual |" in flops.results([str(path)])
    text = report(REPO / "results" / "sweep_shakespeare_cpu.csv", tmp_path)
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
    # the fake train.py's runs are a few steps long: one line, no number
    assert "no multiplier: the baseline trained fewer than 300 steps at 2 of its 2 budgets" in report(
        root / "results.csv", tmp_path)
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


def test_a_replicate_without_a_baseline_curve_gives_no_interval(tmp_path):
    """Two baseline budgets whose mean losses lie close against one seed's (3.0 at 1e12 for every seed; 2.96,
    3.01, 3.01, 3.01, 3.00 at 2e12, mean 2.998): the full sample has a curve, but with seed 1 left out the mean
    at 2e12 (3.0075) does not fall, so that jackknife replicate has no figure. The interval is not printed
    rather than printed narrow, and the overall row says why; with seeds 2-4 at 2.99 there every replicate has
    a curve and the interval is printed."""
    def sweep(*losses):
        at_2e12 = dict(zip((1, 2, 3, 4, 5), losses))
        cells = {"prenorm": {"seed_loss": lambda c, s: 3.0 if c == 1e12 else at_2e12[s], "noise": 0.0},
                 "nag": {"loss": lambda c: 2.999, "budgets": [1.5e12], "noise": 0.0}}
        return write_csv(tmp_path / "r.csv", [1e12, 2e12], cells, seeds=(1, 2, 3, 4, 5))
    path = sweep(2.96, 3.01, 3.01, 3.01, 3.00)
    rows = flops.read_results(str(path))
    base, cell = cell_groups(rows, "prenorm"), cell_groups(rows, "nag")
    _, inside, m = mult.multipliers(base, cell)
    j = mult.intervals(base, cell, inside)[1]
    assert m is not None and j["m"] == pytest.approx(m, rel=1e-12)
    assert [r is None for r in j["replicates"]] == [True, False, False, False, False]
    assert j["se"] is None and j["ci"] is None and j["mci"] is None and j["p"] is None
    overall = rows_of(report(path, tmp_path), "nag")["overall"]
    assert overall[3] == f"{m:.3g}x" and overall[4] == "-" and overall[5] == overall[6] == "–"
    assert overall[8] == "a jackknife replicate had no baseline curve: no interval"
    overall = rows_of(report(sweep(2.96, 2.99, 2.99, 2.99, 3.00), tmp_path), "nag")["overall"]
    assert re.fullmatch(r"\S+x - \S+x", overall[4]) and "no interval" not in overall[8]


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


def additive(shown):
    """The interval of a loss difference as the frontier table prints it: '+0.0123 (-0.0100, +0.0300)'."""
    return tuple(float(v) for v in re.fullmatch(r"\S+ \((\S+), (\S+)\)", shown).groups())


def printed_intervals(text):
    """{kind: [(lo, hi)]} of every interval the multiplier report prints for the design: per budget, overall and
    per 2x compute (the multiplier table), per depth (the depth table), per 2x depth (the trend table: per
    budget and pooled), best - best (the frontier table's loss difference) and throughput-adjusted."""
    main, rest = text.split("By depth:")
    depth, rest = rest.split("The compute-optimal frontier")
    front, steps = rest.split("Throughput-adjusted")
    out = {}
    for line in main.split("The fits")[0].splitlines():
        parts = [p.strip() for p in line.strip("|").split("|")]
        if len(parts) == 9 and parts[0].startswith("nag_"):
            kind = {"overall": "overall", "per": "per 2x compute"}.get(parts[2].split(" ")[0], "per budget")
            out.setdefault(kind, []).append(interval_of(parts[4]))
    for line in depth.splitlines():
        parts = [p.strip() for p in line.strip("|").split("|")]
        if parts[0] == "nag" and len(parts) == 3:
            out["per depth"] = [interval_of(p.split("(")[1].rstrip(")")) for p in parts[1:]]
        elif parts[0] == "nag" and len(parts) == 7:
            out.setdefault("per 2x depth", []).append(interval_of(parts[3]))
    out["best - best"] = [additive(row[7]) for row in frontier_of("compute-optimal frontier" + front).values()]
    out["throughput-adjusted"] = [interval_of(line.strip("|").split("|")[6].strip()) for line in steps.splitlines()
                                  if line.startswith("| nag_")]
    return out


@pytest.fixture(scope="module")
def one_side_reports(tmp_path_factory):
    """{side: (its CSV, the report)} of one_side_grid with noise on the baseline's runs, on the design's, and on
    none; the step times the same in every round (1.25x the baseline's), so that their interval is a point."""
    tmp = tmp_path_factory.mktemp("one_side")
    steps = steps_csv(tmp / "steps.csv", {c: [(125, 100)] * 5 for c in ("nag_L4", "nag_L8")})
    out = {}
    for side in ("baseline", "design", "none"):
        path = write_csv(tmp / f"{side}.csv", DEPTH_GRID, one_side_grid(side))
        out[side] = path, report(path, tmp, f"--step_times={steps}")
    return out


KINDS = ("per budget", "overall", "per 2x compute", "per depth", "per 2x depth", "best - best", "throughput-adjusted")


@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.replace(" ", "_"))
@pytest.mark.parametrize("side", ["baseline", "design"])
def test_every_printed_interval_has_width_when_one_side_is_noisy(one_side_reports, side, kind):
    """Every interval the report prints, with noise on the baseline's runs alone and on the design's alone: each
    has width (a jackknife that leaves a seed out of one side's runs alone, in any of them, collapses it to its
    point); with no noise at all each is its point (the width comes from the runs' noise, nothing else)."""
    noisy, still = printed_intervals(one_side_reports[side][1]), printed_intervals(one_side_reports["none"][1])
    assert set(noisy) == set(still) == set(KINDS)
    assert len(noisy[kind]) == len(still[kind]) >= {"per budget": 8, "per 2x depth": 5, "best - best": 4}.get(kind, 1)
    if kind == "best - best":  # a loss difference
        assert min(hi - lo for lo, hi in noisy[kind]) > 0.005, noisy[kind]
    else:
        assert min(hi / lo for lo, hi in noisy[kind]) > 1.01, noisy[kind]
    assert all(lo == hi for lo, hi in still[kind]), still[kind]


def test_the_best_depth_is_chosen_again_in_every_replicate(one_side_reports):
    """The design's 4 and 8 layers equally good at 4e12, noise on its runs alone: the jackknife replicates
    disagree on its best depth there, and the printed best-against-best difference and its interval are the
    jackknife (t, 2 df) of min over depths of the design's mean loss minus the baseline's, each replicate
    choosing its own best depths, recomputed here; keeping the full sample's best depth in every replicate
    gives another interval. Whether the design moves the baseline's optimum (8 layers) is never a 'yes' there.
    At 1.6e13, where 8 layers are 0.08 ahead, every replicate agrees."""
    from scipy import stats as st
    seeds = [1, 2, 3]

    def best(rows, design, b, keep):
        means = {d: np.mean([r["val_loss"] for r in rows if r["cell"] == f"{design}_L{d}" and r["budget"] == b
                             and r["seed"] in keep]) for d in (4, 8)}
        return min(means, key=means.get), means

    def jackknife(value, reps):
        se = math.sqrt(2 / 3 * sum((r - np.mean(reps)) ** 2 for r in reps))
        return value - st.t.ppf(0.975, 2) * se, value + st.t.ppf(0.975, 2) * se

    path, text = one_side_reports["design"]
    rows, front = flops.read_results(str(path)), frontier_of(text)
    for b in DEPTH_GRID[1:5]:
        full, means = best(rows, "nag", b, seeds)
        value = means[full] - min(best(rows, "prenorm", b, seeds)[1].values())
        chosen, reps, fixed = set(), [], []
        for s in seeds:
            keep = [k for k in seeds if k != s]
            d, m = best(rows, "nag", b, keep)
            base = min(best(rows, "prenorm", b, keep)[1].values())
            chosen.add(d)
            reps.append(m[d] - base)
            fixed.append(m[full] - base)
        lo, hi = jackknife(value, reps)
        assert front[b][7] == f"{value:+.4f} ({lo:+.4f}, {hi:+.4f})"
        assert not front[b][9].startswith("yes")
        if b == 4e12:
            assert chosen == {4, 8} and jackknife(value, fixed) != pytest.approx((lo, hi), abs=1e-4)
        if b == 1.6e13:
            assert chosen == {8} and front[b][3] == "8 (edge)"


def test_the_leave_one_budget_out_check_compares_with_the_half_width():
    """A baseline with one budget (4e12) 0.01 off its curve: leaving it out moves the fitted overall by D, the
    largest change over the budgets left out. Against a measured interval whose half-width is 0.75 D (its whole
    width 1.5 D) the fit is named degenerate at that budget; against one whose half-width is D / 0.95, it is not
    and the fitted number is given. A check against the whole width passes the first."""
    base = {b: [(b, base_loss(b) + (0.01 if b == 4e12 else 0))] for b in BUDGETS}
    cell = {b: [(b, base_loss(2 * b))] for b in BUDGETS[:3]}
    _, inside, _ = mult.multipliers(*({b: {1: (c, y, 1000) for c, y in g} for b, g in groups.items()}
                                      for groups in (base, cell)))
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
        report(path, tmp_path, f"--step_times={path}")
    command = str(err.value).split("python bench.py ", 1)[1]
    args = command.split(" ")
    assert len(args) >= 3 and all(a.startswith("--") for a in args), command
    defaults, sections = bench_keys()
    cfg = configure([a.replace("<sweep>", "sweep") for a in args], defaults)
    assert cfg["section"] == "steps" and "steps" in sections and cfg["steps_out"] == str(path)
