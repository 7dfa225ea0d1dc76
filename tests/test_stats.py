"""The sweep tables' statistics (run_config.welch, seeds_for_power, significance_cells): Welch's t-test
against a textbook example worked by hand and against scipy on random data, and the seeds for 80%
power against a simulation."""
import numpy as np
import pytest
from scipy import stats

import run_config

# Wikipedia, "Welch's t-test", example 1: two samples of 15; t = -2.46, nu = 25.0, p = 0.021
A1 = [27.5, 21.0, 19.0, 23.6, 17.0, 17.9, 16.9, 20.1, 21.9, 22.6, 23.1, 19.6, 19.0, 21.7, 21.4]
A2 = [27.1, 22.0, 20.8, 23.4, 23.4, 23.5, 25.8, 22.0, 24.8, 20.2, 21.9, 22.1, 22.9, 20.5, 24.4]


def test_welch_on_a_textbook_example():
    """The difference of means, Welch's t and nu from their formulas, worked here by hand; the
    published p (0.021), and the 95% CI as diff ± t_{0.975, nu} x se."""
    w = run_config.welch(A1, A2)
    m1, m2 = sum(A1) / 15, sum(A2) / 15
    v1 = sum((x - m1) ** 2 for x in A1) / 14 / 15  # squared standard errors
    v2 = sum((x - m2) ** 2 for x in A2) / 14 / 15
    t = (m1 - m2) / (v1 + v2) ** 0.5
    nu = (v1 + v2) ** 2 / (v1 ** 2 / 14 + v2 ** 2 / 14)
    assert round(t, 2) == -2.46 and round(nu, 1) == 25.0  # the published figures
    assert w["diff"] == pytest.approx(m1 - m2, rel=1e-12)
    assert round(w["p"], 3) == 0.021 and w["significant"] and w["seeds"] is None
    half = stats.t.ppf(0.975, nu) * (v1 + v2) ** 0.5
    assert w["ci"] == pytest.approx((m1 - m2 - half, m1 - m2 + half), rel=1e-9)
    assert w["ci"][1] < 0  # significant at 5%: the 95% CI excludes 0


@pytest.mark.parametrize("seed", range(5))
def test_welch_equals_scipy_on_random_data(seed):
    """p and the CI of scipy.stats.ttest_ind(equal_var=False) for random cells of 2 to 8 seeds."""
    rng = np.random.default_rng(seed)
    a = list(rng.normal(1.80, rng.uniform(0.005, 0.05), rng.integers(2, 9)))
    b = list(rng.normal(1.80 + rng.uniform(-0.05, 0.05), rng.uniform(0.005, 0.05), rng.integers(2, 9)))
    w, ref = run_config.welch(a, b), stats.ttest_ind(a, b, equal_var=False)
    assert w["p"] == pytest.approx(ref.pvalue, rel=1e-9)
    assert w["ci"] == pytest.approx(tuple(ref.confidence_interval(0.95)), rel=1e-9)
    assert w["significant"] == (ref.pvalue < 0.05)


def test_nothing_to_test():
    """One seed: no test; no spread in either cell: the diff, but no p."""
    assert run_config.welch([1.0], [1.0, 2.0]) is None
    w = run_config.welch([1.0, 1.0], [2.0, 2.0])
    assert w["diff"] == -1.0 and w["p"] is None and not w["significant"]
    assert run_config.significance_cells([1.0], [1.0, 2.0]) == ["–"] * 4
    assert run_config.significance_cells([1.0, 1.0], [2.0, 2.0]) == ["-1.0000", "–", "–", "–"]


def simulated_power(diff, s1, s2, n, draws=20000, seed=0):
    """The fraction of `draws` simulated pairs of n-seed cells, true means diff apart, whose Welch test
    has p < 0.05."""
    rng = np.random.default_rng(seed)
    a = rng.normal(diff, s1, (draws, n))
    b = rng.normal(0.0, s2, (draws, n))
    return float((stats.ttest_ind(a, b, axis=1, equal_var=False).pvalue < 0.05).mean())


@pytest.mark.parametrize("diff, s1, s2", [(0.02, 0.01, 0.01), (0.013, 0.0083, 0.0105), (0.05, 0.03, 0.01),
                                          (0.05, 0.05, 0.001)])
def test_seeds_for_power_against_a_simulation(diff, s1, s2):
    """n = seeds_for_power(...): simulated Welch tests with n seeds per cell find the difference at
    least 80% of the time, with n - 1 seeds less often (within the simulation's noise, ~0.003).
    (0.05, 0.05, 0.001): stds 50x apart, where Welch's degrees of freedom (about n - 1) are far below the
    pooled 2n - 2: 10 seeds (simulated power 0.80; 9 seeds: 0.74), where 2n - 2 would say 9."""
    n = run_config.seeds_for_power(diff, s1, s2)
    assert n is not None and n > 2
    assert simulated_power(diff, s1, s2, n) >= 0.79, f"{n} seeds: simulated power below 80%"
    assert simulated_power(diff, s1, s2, n - 1) < 0.81, f"{n - 1} seeds already have 80% power"


def test_significance_cells_format():
    """diff, CI, p with a * where p < 0.05, then "significant" or the seeds that would make it so."""
    cells = run_config.significance_cells(A1, A2, spec=".2f")
    w = run_config.welch(A1, A2)
    assert cells == [f"{w['diff']:+.2f}", f"[{w['ci'][0]:+.2f}, {w['ci'][1]:+.2f}]", "0.021 *", "significant"]
    # not significant at 4 seeds: the last cell is the seeds per cell at which simulated Welch tests, with the
    # observed diff and sample stds as the truth, find the diff 80% of the time (one seed fewer: less often)
    a, b = [1.81, 1.85, 1.80, 1.83], [1.79, 1.80, 1.78, 1.80]
    cells = run_config.significance_cells(a, b)
    assert not cells[2].endswith("*") and cells[3].isdigit(), cells
    diff, s1, s2, n = np.mean(a) - np.mean(b), np.std(a, ddof=1), np.std(b, ddof=1), int(cells[3])
    assert simulated_power(diff, s1, s2, n) >= 0.79, f"{n} seeds: simulated power below 80%"
    assert simulated_power(diff, s1, s2, n - 1) < 0.79, f"{n - 1} seeds already have 80% power"
