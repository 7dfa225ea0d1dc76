"""The compute-optimal frontier, the seed-paired intervals and the pooled clock (multiplier.py, stats.py), on
synthetic depth grids whose answers are known: where the optimum is, whether it is bracketed, what the
frontier multiplier is, and whether an interval covers the truth at its nominal rate."""

import csv
import math
import random
import re
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import flops  # noqa: E402
import multiplier as mult  # noqa: E402
import stats  # noqa: E402

BUDGETS = [1e12 * 2 ** k for k in range(5)]  # 16x
DEPTHS = (1, 2, 3, 4, 8)


def base_loss(c):
    """The curve at the best depth: L = 1.5 + 40 (C / 1e8)^-0.3."""
    return 1.5 + 40 * (c / 1e8) ** -0.3


def bowl(best, k=0.05):
    """A depth penalty 0 at `best` layers, growing as (log2 d - log2 best)^2: the optimum is `best`."""
    return lambda d: k * (math.log2(d) - math.log2(best)) ** 2


def sweep_csv(path, cells, seeds=(1, 2, 3, 4, 5), seed_sd=0.0, noise=0.0, seed=0, iters=1000, eval_tokens=""):
    """A depth grid's results.csv: cells {name: (design, depth, loss(C), budgets)}; every run's loss has its
    seed's effect (shared by every cell: sd seed_sd) and its own noise (sd noise). seeds: a tuple, or a
    function of the cell and budget giving its seeds."""
    rng = random.Random(seed)
    shared = {s: rng.gauss(0, seed_sd) for s in range(1, 11)}
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, flops.FIELDS)
        w.writeheader()
        for name, (design, depth, loss, budgets) in cells.items():
            for b in budgets:
                for s in (seeds(name, b) if callable(seeds) else seeds):
                    w.writerow({k: "" for k in flops.FIELDS} | {
                        "run": f"{name}_s{s}", "cell": name, "seed": s, "residual": design, "n_layer": depth,
                        "mod": "", "mod_rate": 0.0, "args": "", "status": "done", "iters": iters(name, b)
                        if callable(iters) else iters, "tokens": 1000, "flops": b, "budget": b, "device": "cpu",
                        "val_loss": loss(b) + shared[s] + rng.gauss(0, noise), "seconds": 1.0,
                        "eval_tokens": eval_tokens})
    return path


def grid(design_best, base_best, worth=1.5, depths=DEPTHS, **kw):
    """prenorm at every depth and budget with its optimum at base_best layers; nag at the middle three
    budgets, worth `worth` x prenorm's compute at its own optimum, design_best layers."""
    bp, dp = bowl(base_best), bowl(design_best)
    cells = {f"prenorm_L{d}": ("prenorm", d, lambda c, d=d: base_loss(c) + bp(d), BUDGETS) for d in depths}
    cells |= {f"nag_L{d}": ("nag", d, lambda c, d=d: base_loss(worth * c) + dp(d), BUDGETS[1:4]) for d in depths}
    return cells


def table(text, title, width):
    """The rows of the first table after `title` with `width` cells, as lists of stripped cells."""
    out, started = [], False
    for line in text.split(title, 1)[1].splitlines():
        parts = [p.strip() for p in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(parts) == width and not set(parts[0]) <= {"-"}:
            out.append(parts)
            started = True
        elif started and not line.startswith("|"):
            break  # the first such table after the title only
    return out[1:]  # the header


def frontier_rows(text, seeds=False):
    """{(design, budget): row} of the frontier table, without its seeds column (with it: seeds=True)."""
    rows = table(text, "The compute-optimal frontier", 12)
    return {(r[0], float(r[2])): r if seeds else r[:3] + r[4:] for r in rows}


def test_an_interior_optimum_is_found_and_gives_the_known_frontier_multiplier(tmp_path):
    """prenorm's best depth is 2 and nag's 3 at every budget, each with measured depths on both sides; nag's
    best loss is prenorm's best curve at 1.5x the compute: the frontier multiplier is 1.5, its interval holds
    it, nag moves the optimum (significantly), and its best model is better than prenorm's by the known gap."""
    path = sweep_csv(tmp_path / "r.csv", grid(design_best=3, base_best=2), seed_sd=0.02, noise=0.002)
    text = flops.multiplier([str(path), f"--out={tmp_path / 'm.png'}"])
    rows = frontier_rows(text)
    assert sorted(b for _, b in rows) == BUDGETS[1:4]
    for b in BUDGETS[1:4]:
        r = rows[("nag", b)]
        assert r[3] == "3" and r[4] == "2"  # no "(edge)": both bracketed
        assert float(r[5].rstrip("x")) == pytest.approx(1.5, rel=0.02)
        lo, hi = (float(v.rstrip("x")) for v in r[6].split(" - "))
        assert lo <= 1.5 <= hi and hi / lo < 1.1
        gap = float(r[7].split()[0])
        assert gap == pytest.approx(base_loss(1.5 * b) - base_loss(b), abs=0.004)
        assert r[9].startswith("yes: ") and float(r[9].split()[1]) == pytest.approx(bowl(3)(2), abs=0.004)
    assert (tmp_path / "m_frontier.png").stat().st_size > 0


@pytest.mark.parametrize("case", ["baseline at 1 layer", "design at its deepest"])
def test_an_optimum_on_the_grids_edge_is_named_and_gives_no_frontier_multiplier(tmp_path, case):
    """prenorm's optimum at 1 layer (the shallowest run), or nag's at 8 (the deepest): the table marks the
    edge and prints no frontier multiplier, only why; the best-against-best difference is still given."""
    cells = grid(design_best=3, base_best=1) if case.startswith("baseline") else grid(design_best=12, base_best=2)
    text = flops.multiplier([str(sweep_csv(tmp_path / "r.csv", cells, noise=0.002)), f"--out={tmp_path / 'm.png'}"])
    for b in BUDGETS[1:4]:
        r = frontier_rows(text)[("nag", b)]
        if case.startswith("baseline"):
            assert r[4] == "1 (edge)" and "the baseline's optimum" in r[5] and "edge" in r[5]
        else:
            assert r[3] == "8 (edge)" and r[5] == "none: the design's optimum (8 layers) is on the grid's edge"
        assert not any(ch.isdigit() for ch in r[6]) and r[7] != "-"


def val_bin(path, tokens):
    """A val split (uint16 ids, as data/*/prepare.py writes them)."""
    np.asarray(tokens, dtype=np.uint16).tofile(path)
    return str(path)


def test_the_zero_layer_floor_is_the_conditional_entropy_of_the_scored_pairs(tmp_path):
    """On a hand-worked split (a a b a b b a: next given a is a 1/3 or b 2/3, given b is a 2/3 or b 1/3 ... over
    its first 6 pairs), the floor is their conditional entropy; the count-fitted bigram scores exactly it, and any
    other next-token-from-current predictor scores above it. Only the first `tokens` pairs count."""
    path = val_bin(tmp_path / "val.bin", [0, 0, 1, 0, 1, 1, 0, 5, 5])
    h = -(1 * math.log(1 / 3) + 2 * math.log(2 / 3)) / 3  # 3 pairs from a, 3 from b, the same split of 1 and 2
    assert mult.bigram_floor(path, 6) == pytest.approx(h, rel=1e-12)
    pairs = [(0, 0), (0, 1), (1, 0), (0, 1), (1, 1), (1, 0)]
    for q in ({0: {0: 1 / 3, 1: 2 / 3}, 1: {0: 2 / 3, 1: 1 / 3}}, {0: {0: 0.5, 1: 0.5}, 1: {0: 0.5, 1: 0.5}},
              {0: {0: 0.3, 1: 0.7}, 1: {0: 0.6, 1: 0.4}}):
        ce = -sum(math.log(q[a][b]) for a, b in pairs) / 6
        assert ce >= mult.bigram_floor(path, 6) - 1e-12
    assert mult.bigram_floor(path, 8) > h  # the pairs 0 -> 5 and 5 -> 5 now count
    with pytest.raises(ValueError, match="pass the val split"):
        mult.bigram_floor(path, 9)


@pytest.mark.parametrize("floor", ["above", "below"])
def test_a_one_layer_optimum_under_the_zero_layer_floor_is_bracketed(tmp_path, floor):
    """prenorm's and nag's optima at 1 layer (the shallowest run): with --val_bin whose 0-layer floor is above
    every 1-layer loss (uniform random tokens: about ln 128, above every loss of the grid, at most 4.1), both are bracketed, the optimum table has the 0-layer
    column and the frontier multiplier is printed (1.5x); with a floor below them (a repeating sequence: 0), they
    stay on the edge, with no figure."""
    cells = grid(design_best=1, base_best=1)
    csv_path = sweep_csv(tmp_path / "r.csv", cells, noise=0.001, eval_tokens=200_000)
    tokens = np.random.default_rng(0).integers(0, 128, 200_001) if floor == "above" else np.arange(200_001) % 7
    text = flops.multiplier([str(csv_path), f"--out={tmp_path / 'm.png'}",
                             f"--val_bin={val_bin(tmp_path / 'val.bin', tokens)}"])
    bound = mult.bigram_floor(str(tmp_path / "val.bin"), 200_000)
    assert (bound > 4.5) if floor == "above" else bound == pytest.approx(0, abs=1e-12)
    optimum = table(text, "Where prenorm's compute-optimal depth is", 8)
    assert all(r[1] == f">= {bound:.4f}" for r in optimum)
    for b in BUDGETS[1:4]:
        r = frontier_rows(text)[("nag", b)]
        if floor == "above":
            assert r[3] == "1" and r[4] == "1" and float(r[5].rstrip("x")) == pytest.approx(1.5, rel=0.02)
        else:
            assert r[3] == "1 (edge)" and r[4] == "1 (edge)" and r[5].startswith("none: ")


def test_the_frontier_reads_the_seeds_every_cell_has(tmp_path):
    """nag has seeds 1-5 at 2e12 and 8e12 but seed 1 alone at 4e12: that row says 1 seed and gives its figure
    without an interval; the others say 5 and give one. Without --val_bin a CSV of no final eval is refused."""
    cells = grid(design_best=3, base_best=2)
    seeds = lambda name, b: (1,) if name.startswith("nag") and b == BUDGETS[2] else (1, 2, 3, 4, 5)  # noqa: E731
    csv_path = sweep_csv(tmp_path / "r.csv", cells, seeds=seeds, seed_sd=0.02, noise=0.002)
    rows = frontier_rows(flops.multiplier([str(csv_path), f"--out={tmp_path / 'm.png'}"]), seeds=True)
    assert [rows[("nag", b)][3] for b in BUDGETS[1:4]] == ["5", "1", "5"]
    one = rows[("nag", BUDGETS[2])]
    assert float(one[6].rstrip("x")) == pytest.approx(1.5, rel=0.03) and one[7] == "-" and one[8] == "-"
    assert " - " in rows[("nag", BUDGETS[1])][7]
    with pytest.raises(flops.ConfigError, match="one number of val tokens"):
        flops.multiplier([str(csv_path), f"--out={tmp_path / 'm.png'}", f"--val_bin={tmp_path / 'r.csv'}"])


def test_the_baselines_edge_matters_only_where_the_reading_falls(tmp_path):
    """prenorm's optimum is on the edge (1 layer) at the smallest budget alone: a design loss read between
    budgets where the optimum is bracketed gets its figure; one read in the edge budget's segment does not."""
    def base(c, d):
        return base_loss(c) + (bowl(1)(d) if c == BUDGETS[0] else bowl(2)(d))
    cells = {f"prenorm_L{d}": ("prenorm", d, lambda c, d=d: base(c, d), BUDGETS) for d in DEPTHS}
    cells |= {f"nag_L{d}": ("nag", d, lambda c, d=d: base_loss(1.5 * c) + bowl(2)(d), BUDGETS[:4]) for d in DEPTHS}
    text = flops.multiplier([str(sweep_csv(tmp_path / "r.csv", cells, noise=0.001)), f"--out={tmp_path / 'm.png'}"])
    rows = frontier_rows(text)
    assert "1e+12 (1 layers) is on the grid's edge" in rows[("nag", BUDGETS[0])][5]
    assert float(rows[("nag", BUDGETS[2])][5].rstrip("x")) == pytest.approx(1.5, rel=0.02)


def test_a_short_cell_bounds_the_optimum_but_is_never_it(tmp_path):
    """nag's 8-layer cell trains 150 steps at 2e12 and has the lowest loss there: it is not the best depth
    (3 is), it still brackets 4, and the training-length table flags it short."""
    cells = grid(design_best=3, base_best=2)
    cells["nag_L8"] = ("nag", 8, lambda c: base_loss(1.5 * c) - 0.2, BUDGETS[1:4])
    iters = lambda name, b: 150 if (name, b) == ("nag_L8", BUDGETS[1]) else 1000  # noqa: E731
    text = flops.multiplier([str(sweep_csv(tmp_path / "r.csv", cells, iters=iters)), f"--out={tmp_path / 'm.png'}"])
    assert frontier_rows(text)[("nag", BUDGETS[1])][3] == "3"
    assert frontier_rows(text)[("nag", BUDGETS[2])][3] == "8 (edge)"
    (row,) = [r for r in table(text, "Training length", 6) if r[0] == "nag_L8"]
    assert row[2] == "150, 15 (short)" and row[3] == "1000, 100"


def test_the_depth_trend_uses_every_depth_per_budget_and_pooled(tmp_path):
    """nag worth 1.1x more per doubling of depth at every budget (1, 2, 4, 8 layers): each budget's trend and
    the pooled one read 1.1 over all four depths, and the family's Holm column is holm() of its p column."""
    depths = (1, 2, 4, 8)
    cells = {f"prenorm_L{d}": ("prenorm", d, lambda c, d=d: base_loss(c) + 0.01 * d, BUDGETS) for d in depths}
    cells |= {f"nag_L{d}": ("nag", d, lambda c, d=d: base_loss(1.1 ** math.log2(d) * c) + 0.01 * d, BUDGETS[1:4])
              for d in depths}
    text = flops.multiplier([str(sweep_csv(tmp_path / "r.csv", cells, seed_sd=0.02, noise=0.003)),
                             f"--out={tmp_path / 'm.png'}"])
    rows = table(text, "Change per doubling of depth", 7)
    assert [r[1] for r in rows] == [f"{b:.3g} (1, 2, 4, 8 layers)" for b in BUDGETS[1:4]] + ["pooled (1, 2, 4, 8 layers)"]
    for r in rows:
        assert float(r[2].rstrip("x")) == pytest.approx(1.1, abs=0.01) and r[6] == "grows with depth"


def test_every_holm_column_is_the_adjustment_of_its_raw_column(tmp_path):
    """In the overall, trend and frontier tables, p (Holm) is stats.holm of the printed raw p (to their 2
    printed figures) and is not the raw p itself: printing raw p as adjusted fails here."""
    path = sweep_csv(tmp_path / "r.csv", grid(design_best=2, base_best=2, worth=1.02), seed_sd=0.01, noise=0.01)
    text = flops.multiplier([str(path), f"--out={tmp_path / 'm.png'}"])
    p = lambda s: 5e-5 if s == "<1e-4" else float(s)  # noqa: E731
    overall = [r for r in table(text, "| cell | baseline |", 9) if r[2].startswith("overall")]
    trends = table(text, "Change per doubling of depth", 7)
    front = list(frontier_rows(text).values())
    families = [([r[5] for r in overall], [r[6] for r in overall]),
                ([r[4] for r in trends], [r[5] for r in trends]),
                ([r[8].split()[0] for r in front], [r[8].split()[1].strip("()") for r in front])]
    for raw, adj in families:
        assert len(raw) >= 3
        for want, got in zip(stats.holm([p(x) for x in raw]), adj):
            assert p(got) == pytest.approx(want, rel=0.1, abs=2e-4)
        assert adj != raw


def simulate(rep, m_true=1.5, noise=0.004, seed_sd=0.02, seeds=(1, 2, 3, 4, 5)):
    """One synthetic sweep with a shared seed effect: (baseline, design) seed_groups, the design worth m_true."""
    rng = random.Random(2000 + rep)
    shared = {s: rng.gauss(0, seed_sd) for s in seeds}
    base = {b: {s: (b, base_loss(b) + shared[s] + rng.gauss(0, noise), 1000) for s in seeds} for b in BUDGETS}
    cell = {b: {s: (b, base_loss(m_true * b) + shared[s] + rng.gauss(0, noise), 1000) for s in seeds}
            for b in BUDGETS[1:4]}
    return base, cell


def unpaired_bootstrap(base, cell, inside, rng, n=200):
    """The interval a percentile bootstrap gives when it draws each cell's seeds on their own (the pairing
    lost): the 2.5 and 97.5 percentiles of the overall log multiplier."""
    draw = lambda g: {b: dict(enumerate(list(runs.values())[i] for i in rng.integers(len(runs), size=len(runs))))  # noqa: E731
                      for b, runs in g.items()}
    logs = []
    for _ in range(n):
        at, _, _ = mult.multipliers(draw(base), draw(cell))
        logs.append(math.log(mult.overall(at, inside)))
    return tuple(np.percentile(logs, [2.5, 97.5]))


def test_the_paired_interval_covers_at_its_nominal_rate_and_is_narrower_than_an_unpaired_one():
    """A shared seed effect (sd 0.02) much larger than each run's own noise (0.004): over 100 seeded sweeps of
    5 seeds, the jackknife's 95% interval holds the true multiplier at least 90 times, and its width is within
    8 sampling sds of the estimate (the sd over the sweeps); an unpaired percentile bootstrap, applied to the
    same sweeps, fails that width check (the seed effect it does not pair away inflates it)."""
    covered, widths, estimates = 0, [], []
    for rep in range(100):
        base, cell = simulate(rep)
        _, inside, m = mult.multipliers(base, cell)
        j = mult.intervals(base, cell, inside)[1]
        covered += j["mci"][0] <= 1.5 <= j["mci"][1]
        widths.append(j["ci"][1] - j["ci"][0])
        estimates.append(math.log(m))
    sd = float(np.std(estimates, ddof=1))
    assert covered >= 90
    assert np.median(widths) < 8 * sd
    rng = np.random.default_rng(0)
    unpaired = []
    for rep in range(12):
        base, cell = simulate(rep)
        lo, hi = unpaired_bootstrap(base, cell, mult.multipliers(base, cell)[1], rng)
        unpaired.append(hi - lo)
    assert np.median(unpaired) > 8 * sd


def test_the_jackknife_of_a_difference_of_means_is_the_paired_t():
    """For a mean difference the jackknife interval and p are exactly the paired t-test's."""
    rng = np.random.default_rng(4)
    a, b = rng.normal(1.8, 0.02, 5), rng.normal(1.79, 0.02, 5)
    a = dict(enumerate(a))
    b = {s: v + a[s] - 1.8 for s, v in enumerate(b)}  # a shared seed effect
    j = stats.jackknife(lambda s: float(np.mean([a[k] - b[k] for k in s])), list(a))
    t = stats.paired(a, b)
    assert j["ci"] == pytest.approx(t["ci"], rel=1e-9) and j["p"] == pytest.approx(t["p"], rel=1e-9)


def test_the_pooled_clock_keeps_the_drift_between_runs():
    """Three bench runs whose means drift with a known sd (0.031, the between-run sd of the committed runs) and
    10 rounds each: over 100 repetitions the pooled 95% interval holds the true log ratio at least 90 times;
    treating the 30 rounds as one run (no between-run term) holds it far less often."""
    rng = np.random.default_rng(7)
    truth, pooled, flat = math.log(1.3), 0, 0
    for _ in range(100):
        runs = [list(truth + rng.normal(0, 0.031) + rng.normal(0, 0.03, 10)) for _ in range(3)]
        p = stats.pooled_runs(runs)
        pooled += p["ci"][0] <= truth <= p["ci"][1]
        one = stats.pooled_runs([sum(runs, [])])
        flat += one["ci"][0] <= truth <= one["ci"][1]
    assert pooled >= 90 and flat < 80


def test_the_throughput_table_pools_three_bench_csvs(tmp_path):
    """Three step-time CSVs (one per bench run) with run means 1.2, 1.3, 1.4x: the printed ratio is their
    geometric mean and its interval exp(mean log ± t_2 sd / sqrt 3) of the run means; the bench runs column
    says 3 and the drift column the sd."""
    path = sweep_csv(tmp_path / "r.csv", {"prenorm": ("prenorm", 4, base_loss, BUDGETS),
                                          "nag": ("nag", 4, lambda c: base_loss(2 * c), BUDGETS[1:4])},
                     seed_sd=0.01, noise=0.003)
    files = []
    for k, ratio in enumerate((1.2, 1.3, 1.4)):
        f = tmp_path / f"steps{k}.csv"
        f.write_text("cell,baseline,n_layer,device,round,ms,baseline_ms\n" + "".join(
            f"nag,prenorm,4,test CPU,{i},{100 * ratio * (1 + d)},{100}\n" for i, d in enumerate((0, 0.01, -0.01))))
        files.append(str(f))
    text = flops.multiplier([str(path), f"--step_times={','.join(files)}", f"--out={tmp_path / 'm.png'}"])
    (row,) = table(text, "Throughput-adjusted", 7)
    means = [float(np.mean([math.log(r * (1 + d)) for d in (0, 0.01, -0.01)])) for r in (1.2, 1.3, 1.4)]
    m, sd = float(np.mean(means)), float(np.std(means, ddof=1))
    half = stats.t_quantile(2) * sd / math.sqrt(3)
    assert row[2] == f"{math.exp(m):.3f} ({math.exp(m - half):.3f} - {math.exp(m + half):.3f})"
    assert row[3] == "3" and row[4] == f"{sd:.3f}"


def test_a_baseline_curve_is_made_of_its_long_enough_budgets():
    """A baseline short (under 300 steps) at all but one budget has no curve, said in one line; two budgets
    that spent the same compute have none either."""
    def g(iters):
        return {b: {1: (b, base_loss(b), n)} for b, n in zip(BUDGETS, iters)}
    with pytest.raises(mult.Degenerate, match="fewer than 300 steps at 4 of its 5 budgets"):
        mult.multipliers(g([100, 100, 100, 100, 1000]), g([1000] * 5))
    assert mult.long_enough(g([100, 1000, 1000, 1000, 1000])).keys() == set(BUDGETS[1:])
    with pytest.raises(mult.Degenerate, match="same compute"):
        mult.measured_curve({1: [(1.0, 3.0)], 2: [(1.0, 2.0)]})


def test_the_baselines_optimum_table_gives_every_budget_and_depth(tmp_path):
    """prenorm's optimum at 2 layers at every budget (and 1 layer, the edge, where its bowl is moved): the
    table has a row per budget with each depth's mean loss, short ones in brackets, and the best depth."""
    cells = grid(design_best=3, base_best=2)
    cells["prenorm_L1"] = ("prenorm", 1, lambda c: base_loss(c) - (0.2 if c == BUDGETS[0] else 0) + bowl(2)(1),
                           BUDGETS)
    iters = lambda name, b: 150 if (name, b) == ("prenorm_L8", BUDGETS[0]) else 1000  # noqa: E731
    text = flops.multiplier([str(sweep_csv(tmp_path / "r.csv", cells, iters=iters)), f"--out={tmp_path / 'm.png'}"])
    rows = table(text, "Where prenorm's compute-optimal depth is", 7)
    assert [r[0] for r in rows] == [f"{b:.3g}" for b in BUDGETS]
    assert rows[0][6] == "1 (edge)" and [r[6] for r in rows[1:]] == ["2"] * 4
    assert rows[0][5] == f"({base_loss(BUDGETS[0]) + bowl(2)(8):.4f})"  # short: in brackets
    assert rows[2][2] == f"{base_loss(BUDGETS[2]):.4f}"


def test_every_table_names_its_loss_measure(tmp_path):
    """A CSV from before the final eval (no eval_tokens) is labelled as the last periodic eval in both the
    results and the multiplier tables; one whose runs all have a final eval says so."""
    cells = {"prenorm": ("prenorm", 4, base_loss, BUDGETS), "nag": ("nag", 4, lambda c: base_loss(2 * c), BUDGETS[1:4])}
    old = sweep_csv(tmp_path / "old.csv", cells, noise=0.003)
    text = flops.multiplier([str(old), f"--out={tmp_path / 'm.png'}"])
    assert "Loss measure: " in text and "have no final eval" in text
    rows = list(csv.DictReader(open(old)))
    for r in rows:
        r["eval_tokens"], r["val_se"] = "111360", "0.005"
    with open(tmp_path / "new.csv", "w", newline="") as f:
        w = csv.DictWriter(f, flops.FIELDS)
        w.writeheader()
        w.writerows(rows)
    text = flops.multiplier([str(tmp_path / "new.csv"), f"--out={tmp_path / 'm.png'}"])
    assert "Loss measure: the final eval on the whole val split" in text and "have no final eval" not in text
    one = [r for r in rows if float(r["budget"]) == BUDGETS[1]]
    for name, measure in (("final", "the final eval on the whole val split"), ("periodic", "the last periodic eval")):
        with open(tmp_path / f"{name}.csv", "w", newline="") as f:
            w = csv.DictWriter(f, flops.FIELDS)
            w.writeheader()
            w.writerows([r | {"eval_tokens": r["eval_tokens"] if name == "final" else ""} for r in one])
        assert f"The loss: {measure}" in flops.results([str(tmp_path / f"{name}.csv")])


def test_plan_like_gives_hours_from_finished_runs(tmp_path):
    """flops.py plan --like=CSV: each run's seconds are its training FLOPs x the seconds per FLOP of the finished
    runs of the same residual and args at the nearest depth; the hours are their sum over the jobs."""
    rows = []
    for cell, depth, rate in (("prenorm_L1", 1, 3e-11), ("prenorm_L4", 4, 1e-11), ("nag_L4", 4, 2e-11)):
        rows.append({k: "" for k in flops.FIELDS} | {
            "run": f"{cell}_s1", "cell": cell, "seed": 1, "residual": cell.split("_")[0], "n_layer": depth,
            "mod": "", "mod_rate": 0.0, "args": "", "status": "done", "iters": 10, "tokens": 1, "val_loss": 2.0,
            "flops": 1e12, "seconds": rate * 1e12})
    like = tmp_path / "like.csv"
    with open(like, "w", newline="") as f:
        w = csv.DictWriter(f, flops.FIELDS)
        w.writeheader()
        w.writerows(rows)
    pace = flops.seconds_per_flop(str(like))
    assert pace("prenorm", "", 1) == pytest.approx(3e-11) and pace("prenorm", "", 2) == pytest.approx(3e-11)
    assert pace("prenorm", "", 3) == pytest.approx(1e-11) and pace("nag", "", 16) == pytest.approx(2e-11)
    assert pace("mudd", "", 4) == pytest.approx(1.5e-11)  # no mudd run: every run's at that depth, their median
    cfg = tmp_path / "sweep.py"
    cfg.write_text(f"train_config = {str(REPO / 'config/shakespeare_char_cpu.py')!r}\nbudget = 1e15\n"
                   "depths = [1, 4]\nresiduals = ['prenorm']\njobs = 2\n")
    text = flops.plan([str(cfg), f"--like={like}"])
    hours = float(re.search(r"in \S+: ([\d.]+) hours, 2 at a time", text)[1])
    assert hours == pytest.approx((3e-11 + 1e-11) * 1e15 / 2 / 3600, rel=0.02)  # 5.6 hours
