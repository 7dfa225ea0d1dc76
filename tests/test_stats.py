"""The sweep tables' statistics (stats.py: welch, paired, compare, seeds_for_power, holm, bh, family_cells):
Welch's t-test against a textbook example worked by hand and against scipy on random data, the paired
t-test against scipy.stats.ttest_rel, compare's choice between them, the seeds for 80% power against a
simulation, Holm's and Benjamini-Hochberg's adjustments against values worked by hand, the paired interval
against Welch's where the seeds share an effect, and flops.py results' table printing both p columns."""
import csv

import numpy as np
import pytest
from scipy import stats as scipy_stats

import flops
import stats

# Wikipedia, "Welch's t-test", example 1: two samples of 15; t = -2.46, nu = 25.0, p = 0.021
A1 = [27.5, 21.0, 19.0, 23.6, 17.0, 17.9, 16.9, 20.1, 21.9, 22.6, 23.1, 19.6, 19.0, 21.7, 21.4]
A2 = [27.1, 22.0, 20.8, 23.4, 23.4, 23.5, 25.8, 22.0, 24.8, 20.2, 21.9, 22.1, 22.9, 20.5, 24.4]


def by_seed(values, first=1):
    """{seed: value}, seeds first, first + 1, ...: a cell as flops.aggregate keeps it."""
    return dict(enumerate(values, first))


def test_welch_on_a_textbook_example():
    """The difference of means, Welch's t and nu from their formulas, worked here by hand; the
    published p (0.021), and the 95% CI as diff ± t_{0.975, nu} x se."""
    w = stats.welch(A1, A2)
    m1, m2 = sum(A1) / 15, sum(A2) / 15
    v1 = sum((x - m1) ** 2 for x in A1) / 14 / 15  # squared standard errors
    v2 = sum((x - m2) ** 2 for x in A2) / 14 / 15
    t = (m1 - m2) / (v1 + v2) ** 0.5
    nu = (v1 + v2) ** 2 / (v1 ** 2 / 14 + v2 ** 2 / 14)
    assert round(t, 2) == -2.46 and round(nu, 1) == 25.0  # the published figures
    assert w["diff"] == pytest.approx(m1 - m2, rel=1e-12)
    assert round(w["p"], 3) == 0.021 and w["significant"] and w["seeds"] is None
    half = scipy_stats.t.ppf(0.975, nu) * (v1 + v2) ** 0.5
    assert w["ci"] == pytest.approx((m1 - m2 - half, m1 - m2 + half), rel=1e-9)
    assert w["ci"][1] < 0  # significant at 5%: the 95% CI excludes 0
    assert w["se"] == pytest.approx((v1 + v2) ** 0.5) and w["df"] == pytest.approx(nu)
    assert w["test"] == "Welch" and w["n"] == (15, 15)


@pytest.mark.parametrize("seed", range(5))
def test_welch_equals_scipy_on_random_data(seed):
    """p and the CI of scipy.stats.ttest_ind(equal_var=False) for random cells of 2 to 8 seeds."""
    rng = np.random.default_rng(seed)
    a = list(rng.normal(1.80, rng.uniform(0.005, 0.05), rng.integers(2, 9)))
    b = list(rng.normal(1.80 + rng.uniform(-0.05, 0.05), rng.uniform(0.005, 0.05), rng.integers(2, 9)))
    w, ref = stats.welch(a, b), scipy_stats.ttest_ind(a, b, equal_var=False)
    assert w["p"] == pytest.approx(ref.pvalue, rel=1e-9)
    assert w["ci"] == pytest.approx(tuple(ref.confidence_interval(0.95)), rel=1e-9)
    assert w["significant"] == (ref.pvalue < 0.05)


@pytest.mark.parametrize("seed", range(5))
def test_paired_equals_scipy_ttest_rel(seed):
    """p and the CI of scipy.stats.ttest_rel on the seeds both cells ran (2 to 8), whatever else each ran
    and in whatever order its dict holds them; n the shared seeds, se and df the paired t's."""
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(2, 9))
    effect = rng.normal(0, 0.03, n)
    a = {s: 1.80 + e + rng.normal(0, 0.01) for s, e in enumerate(effect, 1)}
    b = {s: 1.79 + e + rng.normal(0, 0.01) for s, e in enumerate(effect, 1)}
    a[100] = 5.0  # a seed only one cell ran: not in the test
    b = dict(reversed(list(b.items())))
    w = stats.paired(a, b)
    shared = list(range(1, n + 1))
    ref = scipy_stats.ttest_rel([a[s] for s in shared], [b[s] for s in shared])
    assert w["test"] == "paired t" and w["n"] == n and w["df"] == n - 1
    assert w["diff"] == pytest.approx(np.mean([a[s] - b[s] for s in shared]), rel=1e-12)
    assert w["p"] == pytest.approx(ref.pvalue, rel=1e-9)
    assert w["ci"] == pytest.approx(tuple(ref.confidence_interval(0.95)), rel=1e-9)
    assert w["significant"] == (ref.pvalue < 0.05)


def test_compare_pairs_on_shared_seeds_and_falls_back_to_welch():
    """Two shared seeds or more: the paired t on those; fewer: Welch over every run of both cells."""
    a, b = by_seed([1.80, 1.83, 1.79, 1.85]), by_seed([1.82, 1.86, 1.80, 1.86])
    w = stats.compare(a, b)
    assert w["test"] == "paired t" and w["n"] == 4
    assert w["p"] == pytest.approx(scipy_stats.ttest_rel(list(a.values()), list(b.values())).pvalue)
    two = stats.compare(a, {1: 1.82, 2: 1.86, 9: 1.70})  # seeds 1 and 2 shared: paired on those two
    assert two["test"] == "paired t" and two["n"] == 2
    assert two["diff"] == pytest.approx(((1.80 - 1.82) + (1.83 - 1.86)) / 2)
    for other in (by_seed([1.82, 1.86, 1.80, 1.86], first=5), {4: 1.82, 5: 1.86, 6: 1.80}):  # 0 and 1 shared
        w = stats.compare(a, other)
        ref = scipy_stats.ttest_ind(list(a.values()), list(other.values()), equal_var=False)
        assert w["test"] == "Welch" and w["n"] == (4, len(other)) and w["p"] == pytest.approx(ref.pvalue)


def test_nothing_to_test():
    """One seed: no test; no spread in either cell (or in the per-seed differences): the diff, but no p; in a
    table, such a row is left out of the family."""
    assert stats.welch([1.0], [1.0, 2.0]) is None
    w = stats.welch([1.0, 1.0], [2.0, 2.0])
    assert w["diff"] == -1.0 and w["p"] is None and not w["significant"]
    assert stats.compare({1: 1.0}, {1: 1.0, 2: 2.0}) is None
    w = stats.compare({1: 1.0, 2: 2.0}, {1: 2.0, 2: 3.0})  # paired: every difference -1
    assert w["test"] == "paired t" and w["diff"] == -1.0 and w["p"] is None
    rows, m = stats.family_cells([({1: 1.0}, {1: 1.0, 2: 2.0}), ({1: 1.0, 2: 2.0}, {1: 2.0, 2: 3.0}),
                                  (by_seed(A1), by_seed(A2, first=20))])
    assert rows[0] == ["–"] * 6 and rows[1] == ["-1.0000"] + ["–"] * 5
    assert m == 1 and rows[2][3] == rows[2][4].rstrip(" *") == "0.021"  # a family of one: adjusted = raw


def simulated_power(diff, s1, s2, n, draws=20000, seed=0):
    """The fraction of `draws` simulated pairs of n-seed cells, true means diff apart, whose test has
    p < 0.05: Welch's (stds s1, s2), or with s2 None the paired t's (s1 the sd of the differences)."""
    rng = np.random.default_rng(seed)
    if s2 is None:
        d = rng.normal(diff, s1, (draws, n))
        return float((scipy_stats.ttest_1samp(d, 0.0, axis=1).pvalue < 0.05).mean())
    a = rng.normal(diff, s1, (draws, n))
    b = rng.normal(0.0, s2, (draws, n))
    return float((scipy_stats.ttest_ind(a, b, axis=1, equal_var=False).pvalue < 0.05).mean())


@pytest.mark.parametrize("diff, s1, s2", [(0.02, 0.01, 0.01), (0.013, 0.0083, 0.0105), (0.05, 0.03, 0.01),
                                          (0.05, 0.05, 0.001), (0.02, 0.015, None), (0.01, 0.012, None)])
def test_seeds_for_power_against_a_simulation(diff, s1, s2):
    """n = seeds_for_power(...): simulated tests with n seeds find the difference at least 80% of the time,
    with n - 1 seeds less often (within the simulation's noise, ~0.003): Welch's (n per cell), and with s2
    None the paired t's (n shared seeds, s1 the sd of the per-seed differences).
    (0.05, 0.05, 0.001): stds 50x apart, where Welch's degrees of freedom (about n - 1) are far below the
    pooled 2n - 2: 10 seeds (simulated power 0.80; 9 seeds: 0.74), where 2n - 2 would say 9."""
    n = stats.seeds_for_power(diff, s1, s2)
    assert n is not None and n > 2
    assert simulated_power(diff, s1, s2, n) >= 0.79, f"{n} seeds: simulated power below 80%"
    assert simulated_power(diff, s1, s2, n - 1) < 0.81, f"{n - 1} seeds already have 80% power"


# -----------------------------------------------------------------------------
# a family of comparisons

def test_holm_and_bh_on_a_family_worked_by_hand():
    """p = [0.01, 0.04, 0.03, 0.005] (m = 4), sorted: 0.005, 0.01, 0.03, 0.04.
    Holm, the k-th smallest times (m - k + 1), then the running max (step-down):
        0.005 x 4 = 0.02; 0.01 x 3 = 0.03; 0.03 x 2 = 0.06; 0.04 x 1 = 0.04 -> max(0.06, 0.04) = 0.06
        -> [0.03, 0.06, 0.06, 0.02] in the family's order.
    BH, the k-th smallest times m / k, then the running min from the largest (step-up):
        0.005 x 4/1 = 0.02; 0.01 x 4/2 = 0.02; 0.03 x 4/3 = 0.04; 0.04 x 4/4 = 0.04
        -> [0.02, 0.04, 0.04, 0.02].
    A second family where BH's step-up matters, p = [0.001, 0.04, 0.045, 0.05]:
        x 4/k: 0.004, 0.08, 0.06, 0.05; the min from the top: 0.05, min(0.06, 0.05) = 0.05, min(0.08, 0.05) =
        0.05, 0.004 -> [0.004, 0.05, 0.05, 0.05]; Holm: 0.004, 0.12, 0.09 -> 0.12, 0.05 -> 0.12
        -> [0.004, 0.12, 0.12, 0.12].
    A None (a row with nothing to test) is not in the family and stays None. Caps and order: Holm [0.4, 0.45]
    -> 0.8, max(0.8, 0.45) = 0.8; [0.6, 0.7] -> min(1, 1.2) = 1, 1; BH [0.5, 0.9] -> 0.9, min(0.9, 1.0) = 0.9."""
    ps = [0.01, 0.04, 0.03, 0.005]
    assert stats.holm(ps) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert stats.bh(ps) == pytest.approx([0.02, 0.04, 0.04, 0.02])
    ps2 = [0.001, 0.04, 0.045, 0.05]
    assert stats.bh(ps2) == pytest.approx([0.004, 0.05, 0.05, 0.05])
    assert stats.holm(ps2) == pytest.approx([0.004, 0.12, 0.12, 0.12])
    with_none = [0.01, None, 0.04, 0.03, 0.005]
    assert stats.holm(with_none) == pytest.approx([0.03, None, 0.06, 0.06, 0.02])
    assert stats.bh(with_none) == pytest.approx([0.02, None, 0.04, 0.04, 0.02])
    assert stats.holm([0.4, 0.45]) == pytest.approx([0.8, 0.8]) and stats.holm([0.6, 0.7]) == [1.0, 1.0]
    assert stats.bh([0.5, 0.9]) == pytest.approx([0.9, 0.9])
    assert stats.holm([]) == [] and stats.bh([None]) == [None]


@pytest.mark.parametrize("seed", range(3))
def test_bh_equals_scipy_and_holm_its_definition_on_random_families(seed):
    """BH against scipy.stats.false_discovery_control; Holm against its definition written out (each p_(k)
    the max over j <= k of (m - j + 1) p_(j), capped at 1); Holm is never below BH nor below the raw p."""
    rng = np.random.default_rng(seed)
    ps = list(rng.uniform(0, 0.2, 12) ** 2)
    assert stats.bh(ps) == pytest.approx(list(scipy_stats.false_discovery_control(ps)))
    order = np.argsort(ps)
    want = [0.0] * len(ps)
    for k, i in enumerate(order):
        want[i] = min(1.0, max((len(ps) - j) * ps[order[j]] for j in range(k + 1)))
    assert stats.holm(ps) == pytest.approx(want)
    assert all(h >= b - 1e-15 and b >= p for h, b, p in zip(stats.holm(ps), stats.bh(ps), ps))


def test_paired_interval_is_narrower_than_welchs_and_covers_the_truth():
    """Synthetic sweeps whose seeds share an effect (loss = base + seed_effect[s] + noise, the seed effect 3x
    the noise, as the depth grid's within-seed correlation of ~0.5 and more): in 100 seeded repetitions of two
    5-seed cells 0.02 apart, compare() pairs them, and its 95% interval is narrower than Welch's on the same
    runs in at least 95 and covers the true difference in at least 90 (nominal 95). compare() falling back to
    Welch where seeds are shared fails the width check."""
    rng = np.random.default_rng(2026)
    truth, narrower, covers = 0.02, 0, 0
    for _ in range(100):
        effect = rng.normal(0.0, 0.03, 5)
        a = by_seed(1.8 + truth + effect + rng.normal(0.0, 0.01, 5))
        b = by_seed(1.8 + effect + rng.normal(0.0, 0.01, 5))
        p, w = stats.compare(a, b), stats.welch(list(a.values()), list(b.values()))
        assert p["test"] == "paired t"
        narrower += p["ci"][1] - p["ci"][0] < w["ci"][1] - w["ci"][0]
        covers += p["ci"][0] <= truth <= p["ci"][1]
    assert narrower >= 95 and covers >= 90, (narrower, covers)


# -----------------------------------------------------------------------------
# flops.py results: a table's family

LOSSES = {  # 4 seeds; per-seed differences to prenorm_L2 below, with the paired t's p (scipy.stats.ttest_rel)
    "prenorm_L2": [1.900, 1.950, 1.880, 1.930],
    "a_L2": [1.850, 1.905, 1.828, 1.877],  # -0.050, -0.045, -0.052, -0.053: p ~ 1e-4
    "b_L2": [1.880, 1.918, 1.872, 1.900],  # -0.020, -0.032, -0.008, -0.030: p ~ 0.026
    "c_L2": [1.912, 1.940, 1.895, 1.920],  # +0.012, -0.010, +0.015, -0.010: p ~ 0.81
}


def write_csv(path, losses, seeds=True):
    """A results.csv of the cells' runs (seeds 1, 2, ..., or with seeds=False an empty seed column)."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, flops.FIELDS)
        w.writeheader()
        for cell, vals in losses.items():
            for seed, v in enumerate(vals, 1):
                w.writerow({"run": f"{cell}_s{seed}", "cell": cell, "seed": seed if seeds else "",
                            "residual": "prenorm" if cell.startswith("prenorm") else "nag", "n_layer": 2, "mod": "",
                            "mod_rate": 0.0, "args": "", "status": "done", "iters": 100, "val_loss": v,
                            "best_val_loss": v, "seconds": 10.0})
    return path


def table_rows(text):
    """The comparison table of flops.py results' text: {cell: its columns after the cell's name}."""
    part = text.split("against a baseline cell")[1].split("Every run")[0]
    rows = ([c.strip() for c in line.split("|")[1:-1]] for line in part.splitlines() if line.startswith("| "))
    return {r[0]: r[1:] for r in rows}, part


def test_results_prints_raw_and_holm_adjusted_p(tmp_path, capsys):
    """flops.py results on a CSV of 4 cells at 4 seeds: three comparisons against prenorm_L2, one family.
    Each row: the paired t (4 shared seeds) and its raw p (scipy.stats.ttest_rel), then Holm's adjusted p,
    worked here: the raw p sorted are p_a < p_b < p_c, so Holm gives 3 p_a, max(3 p_a, 2 p_b), max(that, p_c).
    b's raw p is below 0.05 and its adjusted p above: no * and the seeds it would need, so a table that marks
    or prints the raw p as adjusted fails. --adjust=bh: Benjamini-Hochberg's column; a bad value: one line."""
    path = write_csv(tmp_path / "results.csv", LOSSES)
    base = LOSSES["prenorm_L2"]
    raw = {c: scipy_stats.ttest_rel(LOSSES[c], base).pvalue for c in ("a_L2", "b_L2", "c_L2")}
    assert raw["a_L2"] < raw["b_L2"] < 0.05 < raw["c_L2"]
    holm = {"a_L2": 3 * raw["a_L2"], "b_L2": max(3 * raw["a_L2"], 2 * raw["b_L2"])}
    holm["c_L2"] = max(holm["b_L2"], raw["c_L2"])
    assert holm["a_L2"] < 0.05 < holm["b_L2"]  # the case that tells raw from adjusted
    rows, part = table_rows(flops.main(["results", str(path)]) or capsys.readouterr().out)
    assert "| cell | baseline | Δ vs baseline | 95% CI | test (n) | p | p Holm | seeds for 80% power |" in part
    assert "Family: the 3 comparisons of this table" in part and "Holm's step-down" in part
    for cell in raw:
        diff = np.mean(LOSSES[cell]) - np.mean(base)
        star = " *" if holm[cell] < 0.05 else ""
        assert rows[cell][:6] == ["prenorm_L2", f"{diff:+.4f}", rows[cell][2], "paired t (4)", stats.fmt_p(raw[cell]),
                                  stats.fmt_p(holm[cell]) + star], cell
        assert (rows[cell][6] == "significant") == bool(star)
    # not significant after adjustment: the seeds at which the paired t would pass 0.05 / 3 (Bonferroni) with 80% power
    d = [x - y for x, y in zip(LOSSES["b_L2"], base)]
    assert rows["b_L2"][6] == str(stats.seeds_for_power(np.mean(d), np.std(d, ddof=1), None, 0.05 / 3))
    assert int(rows["b_L2"][6]) > 4
    # Benjamini-Hochberg: p_c, min(p_c, 3/2 p_b), min(that, 3 p_a)
    bh = {"c_L2": raw["c_L2"]}
    bh["b_L2"] = min(bh["c_L2"], 1.5 * raw["b_L2"])
    bh["a_L2"] = min(bh["b_L2"], 3 * raw["a_L2"])
    rows, part = table_rows(flops.main(["results", str(path), "--adjust=bh"]) or capsys.readouterr().out)
    assert "| p | p BH |" in part and "Benjamini-Hochberg" in part
    assert {c: rows[c][5].rstrip(" *") for c in raw} == {c: stats.fmt_p(p) for c, p in bh.items()}
    assert rows["b_L2"][5].endswith(" *")  # BH is the more lenient: b passes it
    with pytest.raises(flops.ConfigError, match="^adjust must be holm .* or bh .*, got 'bonferroni'$"):
        flops.main(["results", str(path), "--adjust=bonferroni"])


def test_results_without_seeds_is_welch_and_a_seed_read_twice_is_refused(tmp_path, capsys):
    """A CSV whose seed column is empty: each run keyed by its name, so the cells share nothing and the test
    is Welch's over their runs (scipy.stats.ttest_ind). The same cell and seed twice (a CSV passed twice, or a
    budgets sweep's): a one-line error, not a silent pairing of one of them."""
    path = write_csv(tmp_path / "results.csv", LOSSES, seeds=False)
    cells = {c["cell"]: c for c in flops.aggregate(flops.read_results(str(path)))}
    assert cells["a_L2"]["losses"] == {f"a_L2_s{s}": v for s, v in by_seed(LOSSES["a_L2"]).items()}
    rows, _ = table_rows(flops.main(["results", str(path)]) or capsys.readouterr().out)
    for cell in ("a_L2", "b_L2", "c_L2"):
        ref = scipy_stats.ttest_ind(LOSSES[cell], LOSSES["prenorm_L2"], equal_var=False).pvalue
        assert rows[cell][3:5] == ["Welch (4, 4)", stats.fmt_p(ref)]
    seeded = write_csv(tmp_path / "seeded.csv", LOSSES)
    with pytest.raises(flops.ConfigError, match="two finished runs") as e:
        flops.main(["results", str(seeded), str(seeded)])
    assert "\n" not in str(e.value)
