"""
The statistics of the sweep tables and the compute multipliers, in one place (scipy.stats underneath).

A sweep runs every cell at the same seeds, and a seed is shared: it fixes the init, the batch order and the
eval windows, so two cells' losses at the same seed move together (in the depth grid their correlation over
seeds is about 0.5). A difference between cells is then tested on its seed pairs (`paired`), and Welch's test
(`welch`) is kept for cells that share no seeds. A figure that is not a difference of means (a compute
multiplier, a frontier, a trend) gets its interval from the delete-one-seed jackknife (`jackknife`): each seed
left out of every cell at once, so the pairing is kept, and the t quantile with n - 1 degrees of freedom, the
small-sample correction a percentile bootstrap over 5 seeds lacks. For a difference of means the jackknife
interval is the paired t interval exactly.

A table of many comparisons names its family and prints each p raw and adjusted for the family's size:
Holm's step-down (`holm`, the family-wise error) or Benjamini-Hochberg's step-up (`bh`, the false discovery
rate). A claim is worded by the adjusted figure.

Run-to-run drift: step times from several bench.py runs are pooled with each run's mean as one replicate
(`pooled_runs`), so their interval holds the drift between runs as well as the noise within one.
"""

import math

ALPHA = 0.05  # every interval here is at 1 - ALPHA (95%) and every test two-sided at ALPHA
MISSING = "–"  # in a table: a figure a run did not log, or a test with nothing to test


def mean_std(values):
    """Mean and sample standard deviation (n - 1; None for a single value) of a list of numbers."""
    n = len(values)
    mean = sum(values) / n
    return mean, ((sum((v - mean) ** 2 for v in values) / (n - 1)) ** 0.5 if n > 1 else None)


def t_quantile(df, alpha=ALPHA):
    """The two-sided 1 - alpha quantile of Student's t with df degrees of freedom."""
    from scipy import stats  # here: only the tables need scipy
    return float(stats.t.ppf(1 - alpha / 2, df))


def t_test(estimate, se, df, alpha=ALPHA):
    """(1 - alpha interval, two-sided p of estimate = 0) of an estimate with standard error se and df degrees
    of freedom; p None (and the interval a point) when se is 0."""
    from scipy import stats
    if se == 0:
        return (estimate, estimate), None
    half = t_quantile(df, alpha) * se
    return (estimate - half, estimate + half), float(2 * stats.t.sf(abs(estimate / se), df))


def welch(values, baseline, alpha=ALPHA, power=0.8):
    """A cell's final losses over seeds against its baseline cell's: Welch's t-test (unequal variances,
    scipy.stats), for cells that share no seeds. Returns diff (mean - baseline mean), the diff's (1 - alpha)
    confidence interval ci, the two-sided p, significant (p < alpha), test "Welch", n (the runs of each), se
    and df (the diff's standard error and Welch-Satterthwaite degrees of freedom, as combine() takes them), and
    seeds: the seeds per cell at which the observed diff, with the observed stds, would be significant with
    probability `power` (None: it already is, or a cell has no spread). None when a cell has < 2 values."""
    from scipy import stats
    if len(values) < 2 or len(baseline) < 2:
        return None
    (m1, s1), (m2, s2) = mean_std(values), mean_std(baseline)
    v1, v2 = s1 ** 2 / len(values), s2 ** 2 / len(baseline)
    diff = m1 - m2
    out = dict(diff=diff, test="Welch", n=(len(values), len(baseline)))
    if v1 + v2 == 0:  # no spread at all: no test
        return out | dict(ci=(diff, diff), p=None, significant=False, seeds=None, se=0.0, df=None)
    test = stats.ttest_ind(values, baseline, equal_var=False)
    half = t_quantile(test.df, alpha) * (v1 + v2) ** 0.5
    p = float(test.pvalue)
    out |= dict(ci=(diff - half, diff + half), p=p, significant=p < alpha, se=(v1 + v2) ** 0.5, df=float(test.df))
    out["seeds"] = None if out["significant"] else seeds_for_power(diff, s1, s2, alpha, power)
    return out


def paired(values, baseline, alpha=ALPHA, power=0.8):
    """A cell's final losses against its baseline's over the seeds both ran ({seed: loss} each): the paired
    t-test on the per-seed differences. Returns what welch() does, test "paired t" and n the shared seeds;
    seeds: the seeds at which the observed mean difference, with the observed sd of the differences, would
    be significant with probability `power`. None with fewer than 2 shared seeds."""
    shared = sorted(set(values) & set(baseline))
    if len(shared) < 2:
        return None
    d = [values[s] - baseline[s] for s in shared]
    diff, sd = mean_std(d)
    out = dict(diff=diff, test="paired t", n=len(shared))
    ci, p = t_test(diff, sd / len(d) ** 0.5, len(d) - 1, alpha)
    out |= dict(ci=ci, p=p, significant=p is not None and p < alpha, se=sd / len(d) ** 0.5, df=len(d) - 1)
    out["seeds"] = None if out["significant"] or not sd else seeds_for_power(diff, sd, None, alpha, power)
    return out


def compare(values, baseline, alpha=ALPHA):
    """The test that matches how two cells were run ({seed: loss} each): paired on their shared seeds when
    they share at least 2, else Welch over all their runs."""
    return paired(values, baseline, alpha) or welch(list(values.values()), list(baseline.values()), alpha)


def seeds_for_power(diff, s1, s2, alpha=ALPHA, power=0.8, most=1000):
    """The fewest seeds n (n >= 2) at which a test finds a true difference diff with probability `power`
    (the noncentral t), or None if more than `most`: Welch's between cells with stds s1, s2 (n per cell), or
    with s2 None the paired t's, s1 the sd of the per-seed differences."""
    from scipy import stats
    for n in range(2, most + 1):
        if s2 is None:
            se, df = s1 / n ** 0.5, n - 1
        else:
            se = ((s1 ** 2 + s2 ** 2) / n) ** 0.5
            df = (s1 ** 2 + s2 ** 2) ** 2 * (n - 1) / (s1 ** 4 + s2 ** 4)
        crit = t_quantile(df, alpha)
        nc = abs(diff) / se
        if stats.nct.sf(crit, df, nc) + stats.nct.cdf(-crit, df, nc) >= power:
            return n
    return None


# -----------------------------------------------------------------------------
# a family of comparisons: adjusted p-values

def holm(ps):
    """Holm's step-down adjustment of a family of p-values (None: not tested, left out of the family and
    None again): the k-th smallest becomes max over j <= k of min(1, (m - j + 1) p_(j)). Controls the
    chance of any false claim in the family at the level a p is read at."""
    idx = sorted((i for i, p in enumerate(ps) if p is not None), key=lambda i: ps[i])
    out, m, run = [None] * len(ps), len(idx), 0.0
    for j, i in enumerate(idx):
        run = max(run, min(1.0, (m - j) * ps[i]))
        out[i] = run
    return out


def bh(ps):
    """Benjamini-Hochberg's step-up adjustment (None: left out, as in holm): the k-th smallest becomes
    min over j >= k of min(1, m p_(j) / j). Controls the expected share of false claims among the claims."""
    idx = sorted((i for i, p in enumerate(ps) if p is not None), key=lambda i: ps[i])
    out, m, run = [None] * len(ps), len(idx), 1.0
    for j in range(m - 1, -1, -1):
        run = min(run, min(1.0, m * ps[idx[j]] / (j + 1)))
        out[idx[j]] = run
    return out


ADJUST = {"holm": holm, "bh": bh}
ADJUST_NAMES = {"holm": "Holm", "bh": "Benjamini-Hochberg"}
ADJUST_SHORT = {"holm": "Holm", "bh": "BH"}  # a column's name


def fmt_p(p):
    """A p-value as the tables print it: two significant figures, '<1e-4' below that."""
    return MISSING if p is None else "<1e-4" if p < 1e-4 else f"{p:.2g}"


# -----------------------------------------------------------------------------
# a figure that is not a difference of means: the seed jackknife

def jackknife(estimate, seeds, alpha=ALPHA):
    """A statistic estimate(seeds) -> float (on the scale its interval is symmetric on, e.g. a log
    multiplier) and its delete-one-seed jackknife: each seed left out of every cell at once (the pairing
    kept). Returns dict(value, se, df, ci, p: two-sided, of value = 0, replicates), or None when fewer than 3
    seeds or the full estimate is None. A replicate that gives None (a resample without a curve) makes se
    None too: its interval is not printed rather than printed narrow."""
    seeds = sorted(seeds)
    n = len(seeds)
    value = estimate(seeds) if n >= 3 else None
    if value is None:
        return None
    reps = [estimate([s for s in seeds if s != left]) for left in seeds]
    out = dict(value=value, df=n - 1, replicates=reps, se=None, ci=None, p=None)
    if any(r is None for r in reps):
        return out
    m = sum(reps) / n
    out["se"] = math.sqrt((n - 1) / n * sum((r - m) ** 2 for r in reps))
    out["ci"], out["p"] = t_test(value, out["se"], n - 1, alpha)
    return out


def combine(a, b, sign=1.0, alpha=ALPHA):
    """The sum a + sign * b of two independent estimates (dicts with value, se, df), its se and Welch-
    Satterthwaite df, interval and p: e.g. a log multiplier minus a log step-time ratio."""
    value = a["value"] + sign * b["value"]
    va, vb = a["se"] ** 2, b["se"] ** 2
    df = (va + vb) ** 2 / ((va ** 2 / a["df"] if va else 0) + (vb ** 2 / b["df"] if vb else 0) or 1)
    ci, p = t_test(value, math.sqrt(va + vb), df, alpha)
    return dict(value=value, se=math.sqrt(va + vb), df=df, ci=ci, p=p)


# -----------------------------------------------------------------------------
# step times from several runs: the drift between runs kept in

def pooled_runs(runs, alpha=ALPHA):
    """An estimate measured in several independent runs, each a list of repeats (e.g. the log step-time
    ratios of one bench.py run's rounds): each run's mean is one replicate, so the standard error holds the
    drift between runs as well as the noise within one. Returns dict(value, se, df, ci, runs, drift: the sd
    of the run means, within: the mean within-run standard error). With one run the se is the within-run
    one, and drift None: say so wherever it is printed."""
    runs = [list(r) for r in runs if len(r)]
    if not runs:
        return None
    run_means = [sum(r) / len(r) for r in runs]
    within = [mean_std(r)[1] / len(r) ** 0.5 if len(r) > 1 else None for r in runs]
    value = sum(run_means) / len(run_means)
    known = [w for w in within if w is not None]
    out = dict(value=value, runs=len(runs), within=sum(known) / len(known) if known else None)
    if len(runs) > 1:
        out["drift"] = mean_std(run_means)[1]
        out["se"], out["df"] = out["drift"] / len(runs) ** 0.5, len(runs) - 1
    else:
        out["drift"] = None
        out["se"], out["df"] = out["within"] or 0.0, max(len(runs[0]) - 1, 1)
    out["ci"], _ = t_test(value, out["se"], out["df"], alpha)
    return out


# -----------------------------------------------------------------------------
# a sweep table's cells

def describe_test(w):
    """A compare() result's test and its n, as the tables print it: "paired t (5)" (shared seeds), "Welch (3, 5)"
    (each cell's runs)."""
    n = w["n"] if isinstance(w["n"], int) else ", ".join(map(str, w["n"]))
    return f"{w['test']} ({n})"


def family_header(adjust="holm"):
    """The columns of family_cells."""
    return ("Δ vs baseline", "95% CI", "test (n)", "p", f"p {ADJUST_SHORT[adjust]}", "seeds for 80% power")


def family_sentence(m, adjust="holm", what="comparisons of this table"):
    """The sentence a table names its family with: what it is, its size m and the adjustment."""
    if not m:
        return "Family: none (no comparison here has the 2 seeds and the spread a test needs)"
    kind = ("Holm's step-down: the chance of any false claim in the family" if adjust == "holm" else
            "Benjamini-Hochberg: the expected share of false claims among the family's claims")
    return (f"Family: the {m} {what}; p is each test's own, p {ADJUST_SHORT[adjust]} is adjusted for the "
            f"family's size ({kind} held at {ALPHA:g}); * and \"significant\" follow the adjusted p (< {ALPHA:g})")


def family_cells(pairs, adjust="holm", spec=".4f"):
    """compare() of each (values, baseline) pair ({seed: loss} each) of one table, the table's family of
    comparisons, as table cells (family_header): the diff, its 95% CI (the comparison's own), the test and its n,
    p raw and adjusted over the family (ADJUST[adjust]; * where the adjusted p < ALPHA), and "significant" (by
    the adjusted p) or the seeds at which the observed diff would be significant at ALPHA / m (Bonferroni over
    the family's m tests, which passes Holm and BH too) with 80% power. "–" where there is nothing to test
    (< 2 seeds, no spread); such a pair is not in the family. Returns (rows, m)."""
    tests = [compare(v, b) for v, b in pairs]
    adjusted = ADJUST[adjust]([None if w is None else w["p"] for w in tests])
    m = sum(p is not None for p in adjusted)
    rows = []
    for (values, baseline), w, p in zip(pairs, tests, adjusted):
        if p is None:
            rows.append([MISSING if w is None else f"{w['diff']:+{spec}}"] + [MISSING] * 5)
            continue
        if p < ALPHA:
            seeds = "significant"
        else:
            n = compare(values, baseline, ALPHA / m)["seeds"]
            seeds = "> 1000" if n is None else str(n)
        rows.append([f"{w['diff']:+{spec}}", f"[{w['ci'][0]:+{spec}}, {w['ci'][1]:+{spec}}]", describe_test(w),
                     fmt_p(w["p"]), fmt_p(p) + (" *" if p < ALPHA else ""), seeds])
    return rows, m
