"""
Compute multipliers: how much compute a residual design is worth, read from a budget sweep's results
(`python flops.py multiplier out/<sweep>/results.csv`; docs/flops.md, "Compute multipliers").

At a budget, a cell's multiplier is the compute its baseline needs to reach the cell's mean final val loss,
over the compute the cell spent (> 1: the design is worth more than it cost). Read two ways that check
each other:
- measured: the baseline's mean loss at its budgets, joined in log compute by a monotone cubic (no model).
  This is the headline. A loss outside the baseline's measured range needs the end segment extended: that
  figure is flagged "extrapolated" wherever it is printed and left out of the overall figure and the trend.
- fitted: L = E + A_c (C/s)^-alpha_c for every cell of a depth at once, E shared (one asymptote for all, which
  a single cell's few budgets cannot pin), alpha_c the baseline's for a cell with fewer than 3 budgets. A fit with a parameter at its bound, or whose multiplier moves
  by more than the measured figure's interval half-width when one baseline budget is left out, is named
  degenerate and gives no number.
Overall: the geometric mean over the in-range budgets. Per 2x compute: 2^slope of log multiplier on log
budget, printed with at least MIN_TREND_BUDGETS in-range budgets. 95% intervals: percentile bootstrap,
the baseline's runs and the cell's runs drawn again (with replacement) at every budget.

Across depths (cells named <design>_L<depth>): each design's overall multiplier at each depth and its change
per doubling of depth; the compute-optimal frontier (each design's best depth at each budget, and its
best-of-depths loss against the baseline's best-of-depths curve); and with bench.py's step times, the
throughput-adjusted multiplier (FLOP multiplier x the baseline's step time / the cell's).
"""

import csv
import math
import re
import statistics
import zlib

import numpy as np

from configurator import ConfigError

LEVEL = (2.5, 97.5)  # the intervals' percentiles: 95%
MIN_TREND_BUDGETS = 4  # a per-2x-compute trend needs this many in-range budgets
ALPHA_BOUNDS = (1e-3, 5.0)  # the fit's exponent range; an exponent on either bound: a degenerate fit
BOUND_TOL = 1e-3  # a fitted parameter this close to a bound (a fraction of its range) is on it


class Degenerate(ValueError):
    """A figure the data cannot give; its message is the one line printed instead of a number."""


def budget_groups(rows):
    """{budget: [(training FLOPs, final val loss)]} of a cell's finished runs."""
    out = {}
    for r in rows:
        if r.get("status") == "done" and r.get("val_loss") is not None:
            out.setdefault(r.get("budget"), []).append((float(r.get("flops") or r["budget"]), float(r["val_loss"])))
    return out


def means(groups):
    """[(mean compute, mean loss)] of each budget, by compute."""
    return sorted((mean(c for c, _ in g), mean(y for _, y in g)) for g in groups.values() if g)


def mean(values):
    """The mean of floats (statistics.mean's exact fractions cost most of a bootstrap's time)."""
    values = list(values)
    return math.fsum(values) / len(values)


def geomean(values):
    return math.exp(mean(math.log(v) for v in values))


# -----------------------------------------------------------------------------
# one cell against its baseline

def measured_curve(groups):
    """The baseline's curve without a model: its budgets' (mean compute, mean loss) joined, in log compute,
    by a monotone cubic (PCHIP: through every measured point, falling wherever they fall; a straight chord
    between budgets 2x apart reads a curved baseline about 2% off, more than a 3-seed interval's width), a
    straight line with two budgets. Returns (inverse, (lo, hi)): inverse(loss) is the compute at which the
    curve reaches that loss (beyond the measured losses lo..hi, the end segment extended straight:
    extrapolation).
    Raises Degenerate for one budget, or a mean loss that does not fall with every budget."""
    pts = means(groups)
    if len(pts) < 2:
        raise Degenerate("one budget: a multiplier needs the baseline at two budgets or more")
    xs, ys = [math.log(c) for c, _ in pts], [y for _, y in pts]
    if len(set(xs)) < len(xs):
        raise Degenerate("two budgets spent the same compute: no curve to read compute from")
    if not all(b < a for a, b in zip(ys, ys[1:])):
        raise Degenerate("the baseline's mean loss does not fall with every budget: no curve to read compute from")

    from scipy.interpolate import PchipInterpolator
    from scipy.optimize import brentq
    curve = PchipInterpolator(xs, ys, extrapolate=False)

    def inverse(loss):
        i = next((j for j in range(1, len(ys) - 1) if loss >= ys[j]), len(ys) - 1)  # segment i-1..i
        if len(ys) > 2 and ys[i] <= loss <= ys[i - 1]:  # inside: the cubic (monotone on every segment)
            return math.exp(brentq(lambda x: float(curve(x)) - loss, xs[i - 1], xs[i], xtol=1e-12))
        return math.exp(xs[i - 1] + (loss - ys[i - 1]) / (ys[i] - ys[i - 1]) * (xs[i] - xs[i - 1]))
    return inverse, (ys[-1], ys[0])


def read_off(inverse, span, cell):
    """{budget: (multiplier or None, in range?)} of a cell's budget groups against a baseline curve
    (inverse and span from measured_curve or a fit): the compute the curve needs for the cell's mean
    loss, over the cell's mean compute."""
    lo, hi = span
    out = {}
    for b, g in sorted(cell.items(), key=lambda t: (t[0] is None, t[0] or 0)):
        c, loss = mean(x for x, _ in g), mean(y for _, y in g)
        cb = inverse(loss)
        out[b] = (None if cb is None else cb / c, lo <= loss <= hi)
    return out


def overall(at, budgets):
    """The geometric mean of the multipliers at `budgets` (the in-range ones); None without a number."""
    got = [at[b][0] for b in budgets if b in at and at[b][0] is not None]
    return geomean(got) if got and len(got) == len(budgets) else None


def per_doubling(pts):
    """e^s, s the least-squares slope of pts [(log2 x, log m)]: m's factor per doubling of x."""
    mx, my = mean(x for x, _ in pts), mean(y for _, y in pts)
    return math.exp(sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts))


def trend(at, budgets):
    """2^s, s the least-squares slope of log multiplier on log budget over `budgets`; None with fewer than
    MIN_TREND_BUDGETS of them (or one without a number)."""
    pts = [(math.log2(b), math.log(at[b][0])) for b in budgets if at.get(b, (None,))[0] is not None]
    if len(budgets) < MIN_TREND_BUDGETS or len(pts) < len(budgets):
        return None
    return per_doubling(pts)


def multipliers(base, cell):
    """The measured estimate of a cell against its baseline (budget groups of each): (at, in-range
    budgets, overall), at = read_off(). Raises Degenerate when the baseline has no curve."""
    inverse, span = measured_curve(base)
    at = read_off(inverse, span, cell)
    inside = [b for b, (m, ok) in at.items() if ok and m is not None]
    return at, inside, overall(at, inside)


def resample(rng, groups):
    """Every budget's runs drawn again with replacement, as many as there are."""
    return {b: [runs[i] for i in rng.integers(len(runs), size=len(runs))] for b, runs in groups.items()}


def bootstrap_draws(base, cell, n, seed, names=("", "")):
    """n resamples (baseline, cell): both drawn again at every budget. Each has its own generator, seeded by
    seed and its name (names: the baseline's, the cell's), so every cell compared with a baseline meets the
    same baseline resamples, and two cells are drawn independently."""
    rb, rc = (np.random.default_rng([seed, k, zlib.crc32(name.encode())]) for k, name in enumerate(names))
    return [(resample(rb, base), resample(rc, cell)) for _ in range(n)]


def interval(values, n):
    """The LEVEL percentiles of the finite values; None when under half of the n resamples gave one."""
    v = np.asarray([x for x in values if x is not None and math.isfinite(x)], float)
    return tuple(float(q) for q in np.percentile(v, LEVEL)) if len(v) and len(v) >= n / 2 else None


def bootstrap(base, cell, n, seed, inside, names=("", "")):
    """Intervals of the measured estimate from n bootstrap_draws: ({budget: interval}, overall's interval,
    trend's interval, the overall of every draw (None where the draw had no curve)). The overall and the
    trend of a draw are over the point estimate's in-range budgets `inside`."""
    per, overalls, trends = {}, [], []
    for b_draw, c_draw in bootstrap_draws(base, cell, n, seed, names):
        try:
            inverse, span = measured_curve(b_draw)
        except Degenerate:
            overalls.append(None)
            trends.append(None)
            continue
        at = read_off(inverse, span, c_draw)
        for b, (m, _) in at.items():
            per.setdefault(b, []).append(m)
        overalls.append(overall(at, inside))
        trends.append(trend(at, inside))
    return {b: interval(v, n) for b, v in per.items()}, interval(overalls, n), interval(trends, n), overalls


# -----------------------------------------------------------------------------
# the fit: every cell of a depth at once, one asymptote E

def joint_fit(groups_by_cell):
    """L_c(C) = E + A_c (C/s)^-alpha_c fitted to every run of every cell at once (scipy least_squares): E
    shared, between 0 and every cell's lowest mean loss (a cross-entropy is never below 0); alpha_c in
    ALPHA_BOUNDS for the first cell (the baseline) and for every cell with 3 budgets or more, the baseline's
    for a cell with fewer (two points cannot pin an exponent too: such a cell is the baseline's curve moved
    along compute); s the geometric mean compute. Returns ({cell: (E, A, alpha)}, s, [why it is degenerate:
    each parameter on a bound])."""
    from scipy.optimize import least_squares
    cells = list(groups_by_cell)
    own = [k == 0 or len(groups_by_cell[c]) >= 3 for k, c in enumerate(cells)]
    slot = np.cumsum(own) - 1  # cell k's exponent: p[1 + len(cells) + slot[k]], the baseline's if not its own
    alpha_of = np.array([slot[k] if own[k] else 0 for k in range(len(cells))])
    runs = [(i, x, y) for i, c in enumerate(cells) for g in groups_by_cell[c].values() for x, y in g]
    s = math.exp(mean(math.log(x) for _, x, _ in runs))
    i_of = np.array([i for i, _, _ in runs])
    x, y = np.array([x / s for _, x, _ in runs]), np.array([y for _, _, y in runs])
    floor = min(m for c in cells for _, m in means(groups_by_cell[c]))
    top = max(m for c in cells for _, m in means(groups_by_cell[c]))
    e0 = min(max(floor - 0.5 * (top - floor), 0.1 * floor), 0.9 * floor)
    p0 = [e0] + [math.log(max(means(groups_by_cell[c])[0][1] - e0, 1e-3)) for c in cells] + [0.3] * sum(own)
    lower = [0.0] + [-np.inf] * len(cells) + [ALPHA_BOUNDS[0]] * sum(own)
    upper = [floor] + [np.inf] * len(cells) + [ALPHA_BOUNDS[1]] * sum(own)
    n = len(cells)

    def residuals(p):
        la, al = np.asarray(p[1:1 + n])[i_of], np.asarray(p[1 + n:])[alpha_of][i_of]
        return p[0] + np.exp(la) * x ** -al - y
    with np.errstate(all="ignore"):
        p = least_squares(residuals, p0, bounds=(lower, upper), x_scale="jac").x
    params = {c: (float(p[0]), float(math.exp(p[1 + k])), float(p[1 + n + alpha_of[k]])) for k, c in enumerate(cells)}
    # on a bound: within BOUND_TOL of the parameter's range (the solver stops near a bound, not on it)
    tol = BOUND_TOL * floor
    bound = ([f"E at its upper bound (the lowest mean loss, {floor:.4f})"] if p[0] > floor - tol else
             ["E at its lower bound 0"] if p[0] < tol else [])
    bound += [f"alpha of {c} at its bound {a:g}" for k, (c, (_, _, al)) in enumerate(params.items()) if own[k]
              for a in ALPHA_BOUNDS if abs(al - a) < BOUND_TOL * (ALPHA_BOUNDS[1] - ALPHA_BOUNDS[0])]
    return params, s, bound


def fit_inverse(e, a, alpha, s):
    """The compute at which E + A (C/s)^-alpha reaches a loss (None at or below E)."""
    return lambda loss: s * ((loss - e) / a) ** (-1 / alpha) if loss > e else None


def fitted_overall(params, s, base_name, cell, span, inside):
    """The fit's overall multiplier of a cell (budget groups) over the budgets `inside`: the compute at
    which the baseline's fitted curve reaches the cell's mean loss, over the cell's compute."""
    at = read_off(fit_inverse(*params[base_name], s), span, cell)
    return overall(at, inside)


def fit_check(groups_by_cell, base_name, cell_names, inside, cis):
    """The fit of a baseline's depth (joint_fit over groups_by_cell: {cell: budget groups}, the baseline
    among them) and, for each cell in cell_names, its fitted overall multiplier or why the fit gives none.
    Degenerate: a parameter on its bound, or leaving one of the baseline's budgets out (while 3 remain)
    moves a cell's fitted overall by more than the half-width of its measured interval (cis[cell]).
    Returns (the law or why it is degenerate, {cell: (fitted overall or None, note)})."""
    params, s, bound = joint_fit(groups_by_cell)
    base = groups_by_cell[base_name]
    _, span = measured_curve(base)
    e, a, alpha = params[base_name]
    law = f"L = {e:.3f} + {a:.3g} (C/{s:.3g})^-{alpha:.3f} (E shared by {len(groups_by_cell)} cells)"
    if bound:
        return f"degenerate fit: {'; '.join(bound)}", {c: (None, "degenerate fit") for c in cell_names}
    out = {}
    for c in cell_names:
        m = fitted_overall(params, s, base_name, groups_by_cell[c], span, inside[c])
        out[c] = (m, "")
        if m is None or cis.get(c) is None or len(base) < 4:
            continue
        half = (cis[c][1] - cis[c][0]) / 2
        for b in sorted(base):
            p2, s2, bound2 = joint_fit({**groups_by_cell, base_name: {k: v for k, v in base.items() if k != b}})
            m2 = fitted_overall(p2, s2, base_name, groups_by_cell[c], span, inside[c])
            if bound2 or m2 is None or abs(m2 - m) > half:
                shown = "a degenerate fit" if bound2 or m2 is None else f"{m2:.3g}x"
                out[c] = (None, f"degenerate fit: without the baseline's budget {b:.3g} it gives {shown}, not "
                                f"{m:.3g}x (more than the interval's half-width, {half:.3g})")
                break
    return law, out


# -----------------------------------------------------------------------------
# across depths: each design at each depth, and the compute-optimal frontier

def design_of(row):
    """A cell's design: its name without the _L<n_layer> suffix that the depth sweeps add."""
    return re.sub(rf"_L{row['n_layer']}$", "", row["cell"]) if row.get("n_layer") is not None else row["cell"]


def depth_slope(by_depth):
    """2^s per doubling of depth, s the least-squares slope of log multiplier on log2 depth ({depth: m});
    None with fewer than 2 depths or a depth without a number."""
    pts = [(math.log2(d), math.log(m)) for d, m in by_depth.items() if m is not None]
    if len(pts) < 2 or len(pts) < len(by_depth):
        return None
    return per_doubling(pts)


def frontier_curve(groups_by_depth):
    """The best-of-depths curve: at each budget where every depth was measured, the lowest mean loss over
    the depths ({depth: budget groups}). Returns ({budget: (best depth, loss, compute)}, inverse, span):
    measured_curve's reading of it (None, None where it has no curve)."""
    budgets = set.intersection(*(set(g) for g in groups_by_depth.values()))
    best = {}
    for b in sorted(budgets):
        pts = {d: (mean(y for _, y in g[b]), mean(x for x, _ in g[b]))
               for d, g in groups_by_depth.items()}
        d = min(pts, key=lambda k: pts[k][0])
        best[b] = (d, *pts[d])
    try:
        inverse, span = measured_curve({b: [(c, y)] for b, (_, y, c) in best.items()})
    except Degenerate:
        inverse, span = None, None
    return best, inverse, span


def frontier(base_by_depth, design_by_depth):
    """At each budget the design has at every one of its depths: (its best depth, the baseline's best
    depth, the frontier multiplier or None, in range?): the compute at which the baseline's best-of-depths
    curve reaches the design's best-of-depths loss, over the design's compute there."""
    base_best, inverse, span = frontier_curve(base_by_depth)
    mine, _, _ = frontier_curve(design_by_depth)
    out = {}
    for b, (d, loss, c) in mine.items():
        m = inverse(loss) / c if inverse is not None and inverse(loss) else None
        out[b] = (d, base_best.get(b, (None,))[0], m, span is not None and span[0] <= loss <= span[1])
    return out


def frontier_bootstrap(base_by_depth, design_by_depth, n, seed):
    """The frontier from n resamples (every (depth, budget) group of both drawn again): per budget, the
    multiplier's interval, the share of draws where each design's best depth was d, and the share where
    the design's best depth differs from the baseline's."""
    rng = np.random.default_rng([seed, 2])
    ms, best, moved = {}, {}, {}
    for _ in range(n):
        fb = {d: resample(rng, base_by_depth[d]) for d in sorted(base_by_depth)}  # sorted: the same draws
        fd = {d: resample(rng, design_by_depth[d]) for d in sorted(design_by_depth)}  # in every process
        for b, (d, d_base, m, _) in frontier(fb, fd).items():
            ms.setdefault(b, []).append(m)
            best.setdefault(b, []).append(d)
            moved.setdefault(b, []).append(d != d_base)
    return ({b: interval(v, n) for b, v in ms.items()},
            {b: {d: v.count(d) / len(v) for d in sorted(set(v))} for b, v in best.items()},
            {b: sum(v) / len(v) for b, v in moved.items()})


# -----------------------------------------------------------------------------
# step times: the throughput-adjusted multiplier

def read_step_times(path):
    """bench.py --section=steps's CSV: ({cell: [the cell's step time over its baseline's, one per round]},
    the device it was measured on)."""
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        ratios = {}
        for r in rows:
            ratios.setdefault(r["cell"], []).append(float(r["ms"]) / float(r["baseline_ms"]))
        devices = sorted({r["device"] for r in rows})
    except (OSError, KeyError, ValueError, csv.Error):
        raise ConfigError(f"step_times={path} is not bench.py's step times: make it with python bench.py "
                          f"--section=steps --sweep=config/<sweep>.py --steps_out={path}") from None
    return ratios, " + ".join(devices)


def adjusted(overall_draws, m, ratios, seed):
    """The throughput-adjusted multiplier m / median(ratios) and its interval: each bootstrap draw of the
    FLOP multiplier over the median of a resample of the rounds' step-time ratios. Returns (value,
    interval, the median ratio, its interval)."""
    rng = np.random.default_rng([seed, 3])
    ratios = np.asarray(ratios, float)
    med = [float(np.median(ratios[rng.integers(len(ratios), size=len(ratios))])) for _ in overall_draws]
    n = len(overall_draws)
    return (m / float(np.median(ratios)), interval([o / r if o is not None else None for o, r in zip(overall_draws, med)], n),
            float(np.median(ratios)), interval(med, n))


# -----------------------------------------------------------------------------
# the report: flops.py multiplier's tables and figure

def fmt(m):
    return "-" if m is None else f"{m:.3g}x"


def fci(c):
    return "-" if c is None else f"{c[0]:.3g}x - {c[1]:.3g}x"


def verdict(ci, what):
    """'grows with <what>' when the interval lies above 1, 'shrinks ...' below, else no trend."""
    if ci is None:
        return "-"
    return f"grows with {what}" if ci[0] > 1 else f"shrinks with {what}" if ci[1] < 1 else "no trend at 95%"


def compare(rows, pairs, boot, seed):
    """Every cell against its baseline (pairs: {cell: baseline cell}): {cell: dict(base, at, inside,
    overall, cis, ci, trend, ci_trend, draws, fitted, why)}, and {baseline: its depth's fit or why none}."""
    groups = {}
    for r in rows:
        groups.setdefault(r["cell"], []).append(r)
    groups = {c: budget_groups(rs) for c, rs in groups.items()}
    out, fits = {}, {}
    for cell, base in pairs.items():
        try:
            at, inside, m = multipliers(groups[base], groups[cell])
        except Degenerate as err:
            out[cell] = dict(base=base, why=str(err))
            continue
        cis, ci, ci_trend, draws = bootstrap(groups[base], groups[cell], boot, seed, inside, (base, cell))
        out[cell] = dict(base=base, at=at, inside=inside, overall=m, cis=cis, ci=ci, trend=trend(at, inside),
                         ci_trend=ci_trend, draws=draws, fitted=(None, ""), why=None)
    for base in sorted(set(pairs.values())):
        cells = [c for c, b in pairs.items() if b == base and out[c]["why"] is None and out[c]["inside"]]
        if not cells or len(groups[base]) < 3:
            fits[base] = "no fit: fewer than 3 budgets" if cells else "no fit: no cell in range"
            continue
        try:
            law, fitted = fit_check({base: groups[base], **{c: groups[c] for c in cells}}, base, cells,
                                    {c: out[c]["inside"] for c in cells}, {c: out[c]["ci"] for c in cells})
        except (Degenerate, ValueError, RuntimeError) as err:
            law, fitted = f"no fit: {str(err).splitlines()[0][:80]}", {}
        fits[base] = law
        for c, v in fitted.items():
            out[c]["fitted"] = v
    return out, fits


def cell_lines(cell, r):
    """The multiplier table's rows of one cell."""
    base = r["base"]
    if r["why"]:
        return [f"| {cell} | {base} | - | no multiplier: {r['why']} | - | - | - |"]
    lines = []
    for b, (m, ok) in r["at"].items():
        shown = fmt(m) + ("" if ok or m is None else " (extrapolated)")
        lines.append(f"| {cell} | {base} | {b:.3g} | {shown} | {fci(r['cis'].get(b))} | - | "
                     f"{'in range' if ok else 'extrapolated: outside the baseline range, not in the overall'} |")
    m, ci = r["overall"], r["ci"]
    fitted, note = r["fitted"]
    if m is None:
        lines.append(f"| {cell} | {base} | overall | none: no budget in the baseline's range | - | - | - |")
    else:
        agree = ("-" if fitted is None else "disagrees with the measured figure by more than its interval"
                 if ci and abs(fitted - m) > (ci[1] - ci[0]) / 2 else "agrees")
        lost = sum(d is None for d in r["draws"])
        if lost:  # draws whose baseline means did not fall with compute: the interval is of the others
            agree = ("" if agree == "-" else agree + "; ") + f"{lost} of {len(r['draws'])} draws had no baseline " \
                "curve, left out of the interval"
        lines.append(f"| {cell} | {base} | overall ({len(r['inside'])} in-range budget"
                     f"{'s' if len(r['inside']) > 1 else ''}) | {fmt(m)} | {fci(ci)} | "
                     f"{fmt(fitted) if fitted is not None else note or '-'} | {agree} |")
    if len(r["inside"]) < MIN_TREND_BUDGETS:
        lines.append(f"| {cell} | {base} | per 2x compute | - | - | - | not printed: needs {MIN_TREND_BUDGETS} "
                     f"in-range budgets, has {len(r['inside'])} |")
    else:
        lines.append(f"| {cell} | {base} | per 2x compute | {fmt(r['trend'])} | {fci(r['ci_trend'])} | - | "
                     f"{verdict(r['ci_trend'], 'compute')} |")
    return lines


def depth_lines(rows, results, boot):
    """Each design's overall multiplier at each depth, and its change per doubling of depth."""
    design = {r["cell"]: (design_of(r), r["n_layer"]) for r in rows}
    by = {}
    for cell, r in results.items():
        if r["why"] is None and r["overall"] is not None:
            by.setdefault(design[cell][0], {})[design[cell][1]] = r
    depths = sorted({d for v in by.values() for d in v})
    if len(depths) < 2:
        return []
    lines = ["", "By depth: each design's overall multiplier (in-range budgets) at each depth, and its change per "
             "doubling of depth (2^slope of log multiplier on log2 depth; its interval from the same bootstrap "
             "draws, depth by depth).", "",
             "| design | " + " | ".join(f"{d} layers" for d in depths) + " | per 2x depth | 95% interval | verdict |",
             "|" + "---|" * (len(depths) + 4)]
    for name, rs in by.items():
        shown = [f"{fmt(rs[d]['overall'])} ({fci(rs[d]['ci'])})" if d in rs else "-" for d in depths]
        slope = depth_slope({d: rs[d]["overall"] for d in rs})
        draws = [depth_slope({d: rs[d]["draws"][i] for d in rs}) for i in range(boot)] if len(rs) > 1 else []
        ci = interval(draws, boot) if draws else None
        lines.append(f"| {name} | " + " | ".join(shown) + f" | {fmt(slope)} | {fci(ci)} | {verdict(ci, 'depth')} |")
    return lines


def frontier_lines(rows, pairs, boot, seed):
    """The compute-optimal frontier of each design against its baseline's, over their depths."""
    design = {r["cell"]: (design_of(r), r["n_layer"]) for r in rows}
    groups = {}
    for r in rows:
        groups.setdefault(r["cell"], []).append(r)
    by = {}
    for cell in sorted({*pairs, *pairs.values()}):
        name, depth = design[cell]
        by.setdefault(name, {})[depth] = budget_groups(groups[cell])
    bases = {design[b][0] for b in pairs.values()}
    lines = []
    for base in sorted(bases):
        if len(by[base]) < 2 or any(len(g) < 2 or None in g for g in by[base].values()):
            continue  # one depth, or a depth at one budget: no frontier curve
        for name in sorted({design[c][0] for c, b in pairs.items() if design[b][0] == base}):
            if len(by[name]) < 2:
                continue
            front = frontier(by[base], by[name])
            cis, shares, moved = frontier_bootstrap(by[base], by[name], boot, seed)
            for b, (d, d_base, m, ok) in front.items():
                share = ", ".join(f"{k}: {v:.0%}" for k, v in shares[b].items())
                moves = ("moves it" if moved[b] >= 0.95 else "does not move it" if moved[b] <= 0.05
                         else f"undecided at 95% (differs in {moved[b]:.0%} of draws)")
                edge = " (the grid's shallowest: the optimum may lie lower)" if d == min(by[name]) else \
                    " (the grid's deepest)" if d == max(by[name]) else ""
                lines.append(f"| {name} | {base} | {b:.3g} | {d}{edge} ({share}) | {d_base} | "
                             f"{fmt(m)}{'' if ok or m is None else ' (extrapolated)'} | {fci(cis.get(b))} | {moves} |")
    if not lines:
        return []
    return ["", "The compute-optimal frontier: at each budget, each design's best depth among those it was run at "
            "(in brackets: its share of the bootstrap draws), the baseline's, and the frontier multiplier (the "
            "compute at which the baseline's best-of-depths curve reaches the design's best-of-depths loss, over "
            "the design's compute). 'Moves it': the design's best depth differs from the baseline's in at least "
            "95% of the draws.", "",
            "| design | baseline | budget | its best depth (draws) | baseline's best depth | frontier multiplier | "
            "95% interval | compute-optimal depth |", "|" + "---|" * 8, *lines]


def throughput_lines(results, step_times, seed):
    """The FLOP multiplier x the baseline's step time / the cell's, per cell, on the step times' device."""
    ratios, device = read_step_times(step_times)
    lines = []
    for cell, r in results.items():
        if cell not in ratios or r["why"] is not None or r["overall"] is None:
            continue
        value, ci, med, med_ci = adjusted(r["draws"], r["overall"], ratios[cell], seed)
        lines.append(f"| {cell} | {fmt(r['overall'])} ({fci(r['ci'])}) | {med:.3f} ({med_ci[0]:.3f} - "
                     f"{med_ci[1]:.3f}) | {fmt(value)} | {fci(ci)} |")
    return ["", f"Throughput-adjusted: the FLOP multiplier x the baseline's step time / the cell's, step times "
            f"measured on {device} by bench.py (interleaved rounds, the median ratio; {step_times}). The "
            "interval combines the multiplier's bootstrap draws with resamples of the rounds.", "",
            "| cell | FLOP multiplier | step time / baseline's | throughput-adjusted | 95% interval |",
            "|---|---|---|---|---|", *lines]


def precision_lines(rows):
    """Measurement noise against seed noise: the final evals' standard errors (over their windows) and the
    standard deviation of the final loss over the seeds of each (cell, budget), their medians."""
    ses = [r["val_se"] for r in rows if r.get("val_se") is not None and r.get("status") == "done"]
    spread = {}
    for r in rows:
        if r.get("status") == "done" and r.get("val_loss") is not None:
            spread.setdefault((r["cell"], r.get("budget")), []).append(r["val_loss"])
    stds = [statistics.stdev(v) for v in spread.values() if len(v) > 1]
    if not ses or not stds:
        return []
    tokens = sorted({r["eval_tokens"] for r in rows if r.get("eval_tokens")})
    return ["", f"Precision: each final loss is measured on the same {', '.join(f'{t:,.0f}' for t in tokens)} val "
            f"tokens, with a standard error over its windows of {statistics.median(ses):.4f} (median over the "
            f"{len(ses)} runs; an upper bound for a difference between two runs, which share the tokens); the "
            f"final loss varies over seeds by a standard deviation of {statistics.median(stds):.4f} (median over "
            f"{len(stds)} cells and budgets)."]


def report(rows, pairs, boot=1000, seed=0, step_times=""):
    """flops.py multiplier's Markdown, and the per-cell results (compare) for the figure."""
    results, fits = compare(rows, pairs, boot, seed)
    lines = ["Compute multiplier at equal training FLOPs: the compute the baseline needs to reach the cell's mean "
             "final val loss, over the cell's compute, read off the baseline's measured curve (its mean loss at "
             "each budget, joined by a monotone cubic in log compute). A loss outside the baseline's measured range is "
             "extrapolated: flagged, and left out of the overall figure (the geometric mean over the in-range "
             f"budgets) and the trend. Fitted: the same read off a power law fitted to the baseline and its "
             f"cells with a shared asymptote, as a check; a degenerate fit gives no number. 95% intervals: "
             f"{boot} bootstrap draws of the baseline's and the cell's runs at every budget (seed {seed}).", "",
             "| cell | baseline | budget | multiplier | 95% interval | fitted | note |", "|" + "---|" * 7]
    for cell, r in results.items():
        lines += cell_lines(cell, r)
    lines += precision_lines(rows)
    lines += ["", "The fits (each baseline with the cells compared with it):", "", "| baseline | fit |", "|---|---|"]
    lines += [f"| {b} | {law} |" for b, law in fits.items()]
    lines += depth_lines(rows, results, boot)
    lines += frontier_lines(rows, pairs, boot, seed)
    if step_times:
        lines += throughput_lines(results, step_times, seed)
    return "\n".join(lines) + "\n", results


def plot(rows, results, path):
    """Left: every cell's mean loss against compute (log x), a line per cell; right: the overall multiplier
    against depth per design with its 95% interval (one depth: against budget)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.8))
    cells = {}
    for r in rows:
        cells.setdefault(r["cell"], []).append(r)
    designs = sorted({design_of(rs[0]) for rs in cells.values()})
    depths = sorted({rs[0]["n_layer"] for rs in cells.values() if rs[0].get("n_layer") is not None})
    styles = {d: s for d, s in zip(depths, ["-", "--", ":", "-."] * 4)}
    color = {d: plt.cm.tab20(i % 20) if len(designs) > 10 else f"C{i}" for i, d in enumerate(designs)}
    for cell, rs in cells.items():
        pts = means(budget_groups(rs))
        if pts:
            ax.plot([c for c, _ in pts], [y for _, y in pts], "o", ls=styles.get(rs[0].get("n_layer"), "-"), ms=3,
                    color=color[design_of(rs[0])], label=cell)
    ax.set_xscale("log")
    ax.set_xlabel("training FLOPs")
    ax.set_ylabel("final val loss (mean over seeds)")
    ax.set_title("loss vs compute (line style: depth)", fontsize=10)
    layer = {r["cell"]: r.get("n_layer") for r in rows}
    for k, name in enumerate(designs):
        got = [(layer[c], r) for c, r in results.items() if design_of({"cell": c, "n_layer": layer[c]}) == name
               and r["why"] is None and r["overall"] is not None]
        if not got:
            continue
        if len(depths) > 1:
            got.sort(key=lambda t: t[0])
            shift = 2 ** (0.025 * (k - (len(designs) - 1) / 2))  # side by side at a depth: each interval seen
            xs, ms = [d * shift for d, _ in got], [r["overall"] for _, r in got]
            err = [[m - (r["ci"] or (m, m))[0] for m, (_, r) in zip(ms, got)],
                   [(r["ci"] or (m, m))[1] - m for m, (_, r) in zip(ms, got)]]
            bx.errorbar(xs, ms, yerr=err, fmt="o-", capsize=3, color=color[name], label=name)
        else:
            for _, r in got:
                bs = r["inside"]
                bx.plot(bs, [r["at"][b][0] for b in bs], "o-", color=color[name], label=name)
    bx.set_xscale("log", base=2 if len(depths) > 1 else 10)
    if len(depths) > 1:
        bx.set_xticks(depths, [str(d) for d in depths])
        bx.minorticks_off()
    bx.axhline(1.0, color="gray", lw=0.8)
    bx.set_xlabel("layers" if len(depths) > 1 else "budget (in range)")
    bx.set_ylabel("compute multiplier vs baseline")
    bx.set_title("overall multiplier (in-range budgets), 95% bootstrap interval" if len(depths) > 1 else
                 "multiplier at each in-range budget", fontsize=10)
    for a in (ax, bx):
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
