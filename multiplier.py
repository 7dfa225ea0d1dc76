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
  a single cell's few budgets cannot pin), alpha_c the baseline's for a cell with fewer than 3 budgets. A fit
  with a parameter at its bound, or whose multiplier moves by more than the measured figure's interval
  half-width when one baseline budget is left out, is named degenerate and gives no number.
Overall: the geometric mean over the in-range budgets. Per 2x compute: 2^slope of log multiplier on log
budget, printed with at least MIN_TREND_BUDGETS in-range budgets. A budget where a cell trained fewer than
MIN_STEPS optimizer steps is printed but flagged "short" and left out of every headline figure: there depth is
confounded with training length.

Intervals and p-values (stats.py): a sweep runs every cell at the same seeds, so every figure's 95% interval
comes from the delete-one-seed jackknife, each seed left out of every cell at once (the pairing kept), with
Student's t at n_seeds - 1 degrees of freedom; p is the two-sided test of "worth its compute" (log multiplier
0). Each table names its family and prints p raw and Holm-adjusted.

Across depths (cells named <design>_L<depth>): each design's overall multiplier at each depth and its change
per doubling of depth, per budget and pooled, over every measured depth; the compute-optimal frontier (each
design's best depth at each budget, whether it has a measured depth on both sides, its best-of-depths loss
against the baseline's, and the compute the baseline's best needs to reach it); and with bench.py's step
times (one CSV per bench run, pooled with the drift between runs), the throughput-adjusted multiplier (FLOP
multiplier x the baseline's step time / the cell's).
"""

import csv
import math
import re
import statistics

import numpy as np

import stats
from configurator import ConfigError

MIN_TREND_BUDGETS = 4  # a per-2x-compute trend needs this many in-range budgets
MIN_STEPS = 300  # a cell below this many optimizer steps at a budget is "short": no headline figure rests on it
ALPHA_BOUNDS = (1e-3, 5.0)  # the fit's exponent range; an exponent on either bound: a degenerate fit
BOUND_TOL = 1e-3  # a fitted parameter this close to a bound (a fraction of its range) is on it


class Degenerate(ValueError):
    """A figure the data cannot give; its message is the one line printed instead of a number."""


def seed_of(row):
    """The seed a run shares with the other cells' runs (its run name when the CSV has no seed column)."""
    return row["seed"] if row.get("seed") is not None else row["run"]


def seed_groups(rows):
    """{budget: {seed: (training FLOPs, final val loss, optimizer steps)}} of a cell's finished runs."""
    out = {}
    for r in rows:
        if r.get("status") == "done" and r.get("val_loss") is not None:
            out.setdefault(r.get("budget"), {})[seed_of(r)] = (float(r.get("flops") or r["budget"]),
                                                                float(r["val_loss"]), r.get("iters"))
    return out


def at_seeds(groups, seeds=None):
    """Budget groups {budget: [(compute, loss)]} of seed_groups, of the runs at `seeds` (None: all); a budget
    left without a run is dropped."""
    out = {b: [(c, y) for s, (c, y, _) in runs.items() if seeds is None or s in seeds] for b, runs in groups.items()}
    return {b: g for b, g in out.items() if g}


def budget_groups(rows):
    """{budget: [(training FLOPs, final val loss)]} of a cell's finished runs."""
    return at_seeds(seed_groups(rows))


def seeds_in(*groups):
    """The seeds of every run of the given seed_groups, sorted (a jackknife leaves each out in turn)."""
    return sorted({s for g in groups for runs in g.values() for s in runs}, key=str)


def steps_at(groups, budget):
    """The mean optimizer steps of a cell's runs at a budget (None when the CSV has no iters)."""
    steps = [n for _, _, n in groups.get(budget, {}).values() if n is not None]
    return mean(steps) if steps else None


def short(groups, budget):
    """Whether the cell trained fewer than MIN_STEPS optimizer steps at the budget."""
    n = steps_at(groups, budget)
    return n is not None and n < MIN_STEPS


def long_enough(groups):
    """The budgets where a cell trained MIN_STEPS steps or more: a baseline's curve is made of these alone, so
    that no headline figure is read off a short run's loss."""
    return {b: g for b, g in groups.items() if not short(groups, b)}


def means(groups):
    """[(mean compute, mean loss)] of each budget, by compute."""
    return sorted((mean(c for c, _ in g), mean(y for _, y in g)) for g in groups.values() if g)


def mean(values):
    """The mean of floats (statistics.mean's exact fractions are slow, and the jackknife calls this often)."""
    values = list(values)
    return math.fsum(values) / len(values)


def geomean(values):
    return math.exp(mean(math.log(v) for v in values))


def log_or_none(x):
    return math.log(x) if x is not None and x > 0 else None


def jackknife_log(estimate, seeds):
    """stats.jackknife of a positive figure estimate(seeds) (None: no figure), on its log; its value, interval
    and p in the figure's own units are out["m"], out["mci"] (None when a replicate had no figure)."""
    out = stats.jackknife(lambda s: log_or_none(estimate(s)), seeds)
    if out is None:
        return None
    out["m"] = math.exp(out["value"])
    out["mci"] = None if out["ci"] is None else tuple(math.exp(x) for x in out["ci"])
    return out


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


def read_at(base, cell, seeds=None):
    """read_off() of a cell against its baseline (seed_groups of each) over the runs at `seeds` (None: all);
    None where the baseline has no curve there."""
    try:
        inverse, span = measured_curve(at_seeds(long_enough(base), seeds))
    except Degenerate:
        return None
    return read_off(inverse, span, at_seeds(cell, seeds))


def multipliers(base, cell):
    """The measured estimate of a cell against its baseline (seed_groups of each): (at, headline budgets,
    overall), at = read_off() off the baseline's long_enough budgets; the headline budgets are those in its
    range where the cell is not short. Raises Degenerate when the baseline has no curve."""
    if len(base) >= 2 > len(long_enough(base)):
        raise Degenerate(f"the baseline trained fewer than {MIN_STEPS} steps at {len(base) - len(long_enough(base))} "
                         f"of its {len(base)} budgets: too few long enough for a curve")
    inverse, span = measured_curve(at_seeds(long_enough(base)))
    at = read_off(inverse, span, at_seeds(cell))
    inside = [b for b, (m, ok) in at.items() if ok and m is not None and not short(cell, b)]
    return at, inside, overall(at, inside)


def intervals(base, cell, inside):
    """The jackknife (jackknife_log) of the multiplier at each budget, of the overall over `inside` and of
    the per-2x-compute trend: ({budget: jackknife}, overall's, trend's)."""
    seeds = seeds_in(base, cell)

    def at_budget(b):
        return lambda s: (read_at(base, cell, s) or {}).get(b, (None,))[0]
    per = {b: jackknife_log(at_budget(b), seeds) for b in cell}
    whole = jackknife_log(lambda s: overall(read_at(base, cell, s) or {}, inside), seeds)
    slope = jackknife_log(lambda s: trend(read_at(base, cell, s) or {}, inside), seeds)
    return per, whole, slope


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


def best_depth(groups_by_depth, budget, seeds=None):
    """(depth, mean loss) of the lowest mean loss at a budget among the depths measured there ({depth:
    seed_groups}), over the runs at `seeds`; a short depth (fewer than MIN_STEPS steps) is never the best.
    None without a depth."""
    pts = {}
    for d, g in groups_by_depth.items():
        runs = at_seeds({budget: g[budget]}, seeds) if budget in g and not short(g, budget) else {}
        if runs:
            pts[d] = mean(y for _, y in runs[budget])
    if not pts:
        return None
    d = min(pts, key=pts.get)
    return d, pts[d]


def on_edge(groups_by_depth, budget, depth, floor=None):
    """Whether `depth` lacks a measured depth on one side at the budget: the shallowest or the deepest run
    there (a short depth counts as measured: it bounds the optimum though it cannot be it). floor: the lowest
    loss any 0-layer model can reach (bigram_floor); a best depth of 1 whose mean loss is below it has the
    0-layer model beneath it, worse at every budget, so that side is bracketed."""
    measured = [d for d, g in groups_by_depth.items() if budget in g]
    if depth == max(measured):
        return True
    if depth != min(measured):
        return False
    return not (depth == 1 and floor is not None and mean(y for _, y in at_seeds({budget: groups_by_depth[1][budget]})[
        budget]) < floor)


def bigram_floor(val_bin, tokens):
    """The lowest mean loss any 0-layer model can reach on the first `tokens` next-token targets of a val split
    (val.bin: uint16 token ids, as train.py's final eval reads them). Without a block, a model's logits are a
    function of the current token alone (token embedding, final norm, head; RoPE adds no position embedding),
    and no predictor of the next token from the current one scores below their empirical conditional entropy
    on the very pairs scored (Gibbs' inequality): a bound that holds at every budget, for every design."""
    data = np.memmap(val_bin, dtype=np.uint16, mode="r")
    if len(data) < tokens + 1:
        raise ValueError(f"{val_bin} has {len(data)} tokens, fewer than the {tokens:,} the runs evaluated on + 1: "
                         f"pass the val split they evaluated on")
    data = data[:tokens + 1].astype(np.int64)
    V = int(data.max()) + 1
    counts = np.bincount(data[:-1] * V + data[1:], minlength=V * V).reshape(V, V).astype(np.float64)
    cond = counts / np.maximum(counts.sum(1, keepdims=True), 1)
    seen = counts > 0
    return float(-(counts[seen] * np.log(cond[seen])).sum() / tokens)


def best_curve(groups_by_depth, seeds=None):
    """The best-of-depths curve ({depth: seed_groups}): {budget: (best depth, mean loss, mean compute)} at every
    budget with a best depth, over the runs at `seeds`."""
    out = {}
    for b in sorted({b for g in groups_by_depth.values() for b in g}):
        best = best_depth(groups_by_depth, b, seeds)
        if best is not None:
            d, loss = best
            out[b] = (d, loss, mean(c for c, _ in at_seeds({b: groups_by_depth[d][b]}, seeds)[b]))
    return out


def frontier_at(base_by_depth, design_by_depth, budget, seeds=None, floor=None):
    """The frontier multiplier at a budget, over the runs at `seeds`: the compute at which the baseline's
    best-of-depths curve reaches the design's best-of-depths loss, over the design's compute there. Raises
    Degenerate (its reason) where an optimum it rests on is on the grid's edge (the design's at this budget,
    or the baseline's at either budget of the curve segment it reads), or the loss is outside the curve. floor:
    on_edge's 0-layer bound."""
    mine, curve = best_curve(design_by_depth, seeds), best_curve(base_by_depth, seeds)
    if budget not in mine:
        raise Degenerate("no depth of the design with enough steps here")
    d, loss, c = mine[budget]
    if on_edge(design_by_depth, budget, d, floor):
        raise Degenerate(f"the design's optimum ({d} layers) is on the grid's edge")
    pts = sorted((cb, y, b) for b, (_, y, cb) in curve.items())
    if len(pts) < 2 or not all(y2 < y1 for (_, y1, _), (_, y2, _) in zip(pts, pts[1:])):
        raise Degenerate("the baseline's best-of-depths loss does not fall with every budget")
    if not pts[-1][1] <= loss <= pts[0][1]:
        raise Degenerate("the design's best loss is outside the baseline's best-of-depths range")
    k = next(k for k in range(1, len(pts)) if loss >= pts[k][1])  # the segment pts[k-1]..pts[k]
    for _, _, b in (pts[k - 1], pts[k]):
        if on_edge(base_by_depth, b, curve[b][0], floor):
            raise Degenerate(f"the baseline's optimum at {b:.3g} ({curve[b][0]} layers) is on the grid's edge")
    inverse, _ = measured_curve({b: [(curve[b][2], curve[b][1])] for b in curve})
    return inverse(loss) / c


def shared_seeds(design_by_depth, base_by_depth, budget):
    """The seeds that every depth of the design has at the budget and every depth of the baseline at all of
    its budgets: the frontier is read on these alone, so that its jackknife leaves out whole seeds (a seed
    one cell lacks would be compared with nothing)."""
    groups = [g[budget] for g in design_by_depth.values() if budget in g]
    groups += [runs for g in base_by_depth.values() for runs in g.values()]
    return sorted(set.intersection(*(set(runs) for runs in groups)), key=str)


def best_gap(base_by_depth, design_by_depth, budget, seeds=None):
    """The design's best-of-depths mean loss minus the baseline's at a budget (negative: its best model is
    better), the best depths chosen over the runs at `seeds`; None without both."""
    a, b = best_depth(design_by_depth, budget, seeds), best_depth(base_by_depth, budget, seeds)
    return None if a is None or b is None else a[1] - b[1]


def depth_cells(rows, pairs):
    """{design: {depth: seed_groups}} of every cell in pairs (the cells and their baselines) and of every depth
    of a baseline's design (its best depth is chosen among all it ran)."""
    groups, by = {}, {}
    for r in rows:
        groups.setdefault(r["cell"], []).append(r)
    bases = {design_of(groups[b][0]) for b in pairs.values()}  # a baseline's every depth, compared or not
    for cell in sorted({*pairs, *pairs.values(), *(c for c, rs in groups.items() if design_of(rs[0]) in bases)}):
        r = groups[cell][0]
        by.setdefault(design_of(r), {})[r["n_layer"]] = seed_groups(groups[cell])
    return by


def fjk(j):
    """A jackknife's value and interval as the tables print them."""
    if j is None:
        return "-", "-"
    return fmt(j["m"]), fci(j["mci"])


def depth_lines(rows, results, pairs):
    """Each design's overall multiplier at each depth, and its change per doubling of depth over every
    measured depth with a headline figure: at each budget, and pooled (the overall multipliers)."""
    layers = {r["cell"]: r["n_layer"] for r in rows}
    names = {r["cell"]: design_of(r) for r in rows}
    by = {}
    for cell, r in results.items():
        if r["why"] is None:
            by.setdefault(names[cell], {})[layers[cell]] = (cell, r)
    depths = sorted({d for v in by.values() for d in v})
    if len(depths) < 2:
        return []
    table = ["| design | " + " | ".join(f"{d} layers" for d in depths) + " |", "|" + "---|" * (len(depths) + 1)]
    for name, rs in by.items():
        table.append(f"| {name} | " + " | ".join(
            "-" if d not in rs else "none in range" if rs[d][1]["overall"] is None else
            f"{fmt(rs[d][1]['overall'])} ({fci(rs[d][1]['ci'] and rs[d][1]['ci']['mci'])})" for d in depths) + " |")
    trends = []  # (design, budget label, jackknife)
    for name, rs in by.items():
        if len(rs) < 2:
            continue
        cells = {d: (pairs_cell, r) for d, (pairs_cell, r) in rs.items()}
        seeds = seeds_in(*[r["cell_groups"] for _, r in cells.values()], *[r["base_groups"] for _, r in cells.values()])
        for b in sorted({b for _, r in cells.values() for b in r["inside"]}):
            have = {d: r for d, (_, r) in cells.items() if b in r["inside"]}
            if len(have) >= 2:
                est = lambda s, have=have, b=b: depth_slope(  # noqa: E731
                    {d: (read_at(r["base_groups"], r["cell_groups"], s) or {}).get(b, (None,))[0]
                     for d, r in have.items()})
                trends.append((name, f"{b:.3g} ({', '.join(map(str, sorted(have)))} layers)", jackknife_log(est, seeds)))
        have = {d: r for d, (_, r) in cells.items() if r["overall"] is not None}
        if len(have) >= 2:
            est = lambda s, have=have: depth_slope(  # noqa: E731
                {d: overall(read_at(r["base_groups"], r["cell_groups"], s) or {}, r["inside"]) for d, r in have.items()})
            trends.append((name, f"pooled ({', '.join(map(str, sorted(have)))} layers)", jackknife_log(est, seeds)))
    adj = stats.holm([j and j["p"] for _, _, j in trends])
    lines = ["", "By depth: each design's overall multiplier (its headline budgets) at each depth, with its 95% "
             "interval.", "", *table, "",
             f"Change per doubling of depth: 2^slope of log multiplier on log2 depth over every depth with a "
             f"figure, at each budget (a budget-specific trend) and pooled (the overall multipliers). Family: the "
             f"{sum(j is not None and j['p'] is not None for _, _, j in trends)} trends of this table, p Holm-"
             f"adjusted; the verdict follows the adjusted p.", "",
             "| design | budget (depths) | per 2x depth | 95% interval | p | p (Holm) | verdict |", "|" + "---|" * 7]
    for (name, label, j), pa in zip(trends, adj):
        shown = fjk(j)
        word = ("-" if pa is None else "grows with depth" if pa < stats.ALPHA and j["value"] > 0 else
                "shrinks with depth" if pa < stats.ALPHA else "no trend at 95% (adjusted)")
        lines.append(f"| {name} | {label} | {shown[0]} | {shown[1]} | {stats.fmt_p(j and j['p'])} | "
                     f"{stats.fmt_p(pa)} | {word} |")
    return lines


def optimum_lines(rows, pairs, floor=None):
    """Where each baseline's optimum is: at every budget it ran, its mean loss at each depth and its best depth
    (short depths in brackets, never the best; 'edge': no measured depth on one side). floor: the 0-layer
    model's bound (bigram_floor), a column of its own."""
    by = depth_cells(rows, pairs)
    design = {r["cell"]: design_of(r) for r in rows}
    lines = []
    for base in sorted({design[b] for b in pairs.values()}):
        depths = sorted(by[base])
        if len(depths) < 2:
            continue
        zero = floor is not None and depths[0] == 1
        lines += ["", f"Where {base}'s compute-optimal depth is: its mean final loss at each depth and budget (in "
                  f"brackets: short, under {MIN_STEPS} steps), and the best depth."
                  + (" 0 layers: the lowest loss any 0-layer model can reach on these val tokens (their bigram "
                     "conditional entropy, a bound at every budget, not a run)." if zero else ""), "",
                  "| budget | " + ("0 layers | " if zero else "") + " | ".join(f"{d} layers" for d in depths)
                  + " | best depth |", "|" + "---|" * (len(depths) + 2 + zero)]
        for b in sorted({b for g in by[base].values() for b in g if b is not None}):
            best = best_depth(by[base], b)
            shown = [f">= {floor:.4f}"] if zero else []
            for d in depths:
                runs = at_seeds({b: by[base][d][b]}) if b in by[base][d] else {}
                loss = f"{mean(y for _, y in runs[b]):.4f}" if runs else "-"
                shown.append(f"({loss})" if runs and short(by[base][d], b) else loss)
            where = "-" if best is None else f"{best[0]} (edge)" if on_edge(by[base], b, best[0], floor) else \
                f"{best[0]}"
            lines.append(f"| {b:.3g} | " + " | ".join(shown) + f" | {where} |")
    return lines


def frontier_lines(rows, pairs, floor=None):
    """The compute-optimal frontier of each design against its baseline's, over their depths, at each budget
    the design ran: both optima with the depths on their sides, the frontier multiplier where both are
    bracketed, the best model against the best model (a loss difference), and whether the design moves the
    optimum (its loss at the baseline's best depth against at its own)."""
    by = depth_cells(rows, pairs)
    design = {r["cell"]: design_of(r) for r in rows}
    found = []
    for base in sorted({design[b] for b in pairs.values()}):
        for name in sorted({design[c] for c, b in pairs.items() if design[b] == base}):
            if len(by[name]) < 2 or len(by[base]) < 2:
                continue
            for b in sorted({b for g in by[name].values() for b in g}):
                seeds = shared_seeds(by[name], by[base], b)
                mine, theirs = best_depth(by[name], b, seeds), best_depth(by[base], b, seeds)
                if mine is None or theirs is None:
                    continue
                try:
                    point = frontier_at(by[base], by[name], b, seeds, floor)
                    front, why = jackknife_log(lambda s, b=b, n=name, k=base: _frontier_or_none(by[k], by[n], b, s, floor),
                                               seeds) or {"m": point, "mci": None}, ""
                except Degenerate as err:
                    front, why = None, str(err)
                gap = stats.jackknife(lambda s, b=b, n=name, k=base: best_gap(by[k], by[n], b, s), seeds)
                moved = None
                if mine[0] != theirs[0] and theirs[0] in by[name] and b in by[name][theirs[0]]:
                    at_theirs = {s: y for s, (_, y, _) in by[name][theirs[0]][b].items()}
                    at_mine = {s: y for s, (_, y, _) in by[name][mine[0]][b].items()}
                    moved = stats.paired(at_theirs, at_mine)
                found.append((name, base, b, len(seeds), mine, theirs, front, why, gap, moved))
    if not found:
        return []
    gap_adj = stats.holm([g and g["p"] for *_, g, _ in found])
    move_adj = stats.holm([m and m["p"] for *_, m in found])
    lines = ["", "The compute-optimal frontier: at each budget, each design's best depth and the baseline's (the "
             "lowest mean loss among the depths with enough steps; 'edge': no measured depth on one side, so the "
             "optimum may lie beyond the grid" + ("; a best depth of 1 below the 0-layer bound is bracketed by it" if floor
             is not None else "") + "), the frontier multiplier (the compute at which the baseline's "
             "best-of-depths curve reaches the design's best-of-depths loss, over the design's compute; printed only "
             "where both optima it rests on are bracketed), the best model against the best model (the design's "
             "best mean loss minus the baseline's, the best depths chosen again in every jackknife replicate), and "
             "whether the design moves the optimum (its loss at the baseline's best depth minus at its own, paired "
             "t), each on the seeds that every cell it reads has (fewer than 3: no interval). Two families, each Holm-adjusted: the best-against-best differences and the moves.", "",
             "| design | baseline | budget | seeds | its best depth | baseline's best depth | frontier multiplier | "
             "95% interval | best - best (95% interval) | p (Holm) | moves the optimum? | p (Holm) |",
             "|" + "---|" * 12]
    for (name, base, b, n, mine, theirs, front, why, gap, moved), ga, ma in zip(found, gap_adj, move_adj):
        edge = lambda groups, d: f"{d} (edge)" if on_edge(groups, b, d, floor) else f"{d}"  # noqa: E731
        shown = fjk(front) if front is not None else (f"none: {why}", "-")
        gap_shown = "-" if gap is None else f"{gap['value']:+.4f}" + (
            "" if gap["ci"] is None else f" ({gap['ci'][0]:+.4f}, {gap['ci'][1]:+.4f})")
        gap_p = "-" if gap is None else f"{stats.fmt_p(gap['p'])} ({stats.fmt_p(ga)})"
        if mine[0] == theirs[0]:
            move, move_p = "no: the same best depth", "-"
        elif moved is None:
            move, move_p = f"best depth {mine[0]}, not run at {theirs[0]}", "-"
        else:
            move = (f"yes: {moved['diff']:+.4f} at {theirs[0]} layers" if ma is not None and ma < stats.ALPHA else
                    f"not significant: {moved['diff']:+.4f} at {theirs[0]} layers")
            move_p = f"{stats.fmt_p(moved['p'])} ({stats.fmt_p(ma)})"
        lines.append(f"| {name} | {base} | {'-' if b is None else f'{b:.3g}'} | {n} | {edge(by[name], mine[0])} | "
                     f"{edge(by[base], theirs[0])} | "
                     f"{shown[0]} | {shown[1]} | {gap_shown} | {gap_p} | {move} | {move_p} |")
    return lines


def _frontier_or_none(base_by_depth, design_by_depth, budget, seeds, floor=None):
    try:
        return frontier_at(base_by_depth, design_by_depth, budget, seeds, floor)
    except Degenerate:
        return None


# -----------------------------------------------------------------------------
# step times: the throughput-adjusted multiplier

def read_step_times(paths):
    """bench.py --section=steps's CSVs, one per bench run (a comma-separated list): ({cell: [[the log of the
    cell's step time over its baseline's, one per round] per run]}, the devices they were measured on)."""
    runs, devices = {}, set()
    for path in [p for p in paths.split(",") if p]:
        try:
            with open(path, newline="") as f:
                rows = list(csv.DictReader(f))
            here = {}
            for r in rows:
                here.setdefault(r["cell"], []).append(math.log(float(r["ms"]) / float(r["baseline_ms"])))
            devices |= {r["device"] for r in rows}
        except (OSError, KeyError, ValueError, csv.Error):
            raise ConfigError(f"step_times={path} is not bench.py's step times: make it with python bench.py "
                              f"--section=steps --sweep=config/<sweep>.py --steps_out={path}") from None
        for cell, v in here.items():
            runs.setdefault(cell, []).append(v)
    return runs, " + ".join(sorted(devices))


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


def compare(rows, pairs):
    """Every cell against its baseline (pairs: {cell: baseline cell}): {cell: dict(base, at, inside, overall,
    cis, ci, trend, ci_trend, fitted, why, base_groups, cell_groups)} (cis, ci, ci_trend: jackknifes), and
    {baseline: its depth's fit or why none}."""
    groups = {}
    for r in rows:
        groups.setdefault(r["cell"], []).append(r)
    groups = {c: seed_groups(rs) for c, rs in groups.items()}
    out, fits = {}, {}
    for cell, base in pairs.items():
        try:
            at, inside, m = multipliers(groups[base], groups[cell])
        except Degenerate as err:
            out[cell] = dict(base=base, why=str(err))
            continue
        cis, ci, ci_trend = intervals(groups[base], groups[cell], inside)
        out[cell] = dict(base=base, at=at, inside=inside, overall=m, cis=cis, ci=ci, trend=trend(at, inside),
                         ci_trend=ci_trend, fitted=(None, ""), why=None, base_groups=groups[base],
                         cell_groups=groups[cell])
    for base in sorted(set(pairs.values())):
        cells = [c for c, b in pairs.items() if b == base and out[c]["why"] is None and out[c]["inside"]]
        if not cells or len(groups[base]) < 3:
            fits[base] = "no fit: fewer than 3 budgets" if cells else "no fit: no cell in range"
            continue
        try:
            law, fitted = fit_check({base: at_seeds(groups[base]), **{c: at_seeds(groups[c]) for c in cells}}, base,
                                    cells, {c: out[c]["inside"] for c in cells},
                                    {c: out[c]["ci"] and out[c]["ci"]["mci"] for c in cells})
        except (Degenerate, ValueError, RuntimeError) as err:
            law, fitted = f"no fit: {str(err).splitlines()[0][:80]}", {}
        fits[base] = law
        for c, v in fitted.items():
            out[c]["fitted"] = v
    return out, fits


def cell_lines(cell, r, p_adj):
    """The multiplier table's rows of one cell (p_adj: its overall's Holm-adjusted p)."""
    base = r["base"]
    if r["why"]:
        return [f"| {cell} | {base} | - | no multiplier: {r['why']} | - | - | - | - | - |"]
    lines = []
    for b, (m, ok) in r["at"].items():
        steps = steps_at(r["cell_groups"], b)
        flag = ("extrapolated" if not ok and m is not None else
                f"short ({steps:.0f} steps)" if short(r["cell_groups"], b) else "")
        j = r["cis"].get(b)
        note = ("extrapolated: outside the baseline range, not in the overall" if flag == "extrapolated" else
                f"short: {steps:.0f} optimizer steps (< {MIN_STEPS}), not in the overall" if flag else "headline")
        lines.append(f"| {cell} | {base} | {b:.3g} | {fmt(m)}{f' ({flag})' if flag else ''} | "
                     f"{fci(j and j['mci'])} | {stats.fmt_p(j and j['p'])} | - | - | {note} |")
    m, j = r["overall"], r["ci"]
    fitted, note = r["fitted"]
    if m is None:
        lines.append(f"| {cell} | {base} | overall | none: no headline budget | - | - | - | - | - |")
    else:
        agree = ("-" if fitted is None else "disagrees with the measured figure by more than its interval"
                 if j and j["mci"] and abs(fitted - m) > (j["mci"][1] - j["mci"][0]) / 2 else "agrees")
        if j is not None and j["ci"] is None:
            agree = ("" if agree == "-" else agree + "; ") + "a jackknife replicate had no baseline curve: no interval"
        n = len(r["inside"])
        lines.append(f"| {cell} | {base} | overall ({n} headline budget{'s' if n > 1 else ''}) | {fmt(m)} | "
                     f"{fci(j and j['mci'])} | {stats.fmt_p(j and j['p'])} | {stats.fmt_p(p_adj)} | "
                     f"{fmt(fitted) if fitted is not None else note or '-'} | {agree} |")
    if len(r["inside"]) < MIN_TREND_BUDGETS:
        lines.append(f"| {cell} | {base} | per 2x compute | - | - | - | - | - | not printed: needs "
                     f"{MIN_TREND_BUDGETS} headline budgets, has {len(r['inside'])} |")
    else:
        t = r["ci_trend"]
        lines.append(f"| {cell} | {base} | per 2x compute | {fmt(r['trend'])} | {fci(t and t['mci'])} | "
                     f"{stats.fmt_p(t and t['p'])} | - | - | {verdict(t and t['mci'], 'compute')} |")
    return lines


def throughput_lines(results, step_times):
    """The FLOP multiplier x the baseline's step time / the cell's, per cell, on the step times' device: the
    step-time ratio pooled over the bench runs (stats.pooled_runs: each run's mean log ratio one replicate,
    so the interval holds the drift between runs), combined with the multiplier's jackknife."""
    runs, device = read_step_times(step_times)
    lines, n_runs = [], max((len(v) for v in runs.values()), default=0)
    for cell, r in results.items():
        if cell not in runs or r["why"] is not None or r["overall"] is None or r["ci"] is None \
                or r["ci"]["se"] is None:
            continue
        clock = stats.pooled_runs(runs[cell])
        both = stats.combine(r["ci"], clock, sign=-1.0)
        drift = "-" if clock["drift"] is None else f"{clock['drift']:.3f}"
        lines.append(f"| {cell} | {fmt(r['overall'])} ({fci(r['ci']['mci'])}) | {math.exp(clock['value']):.3f} "
                     f"({math.exp(clock['ci'][0]):.3f} - {math.exp(clock['ci'][1]):.3f}) | {clock['runs']} | {drift} | "
                     f"{fmt(math.exp(both['value']))} | {fci(tuple(math.exp(x) for x in both['ci']))} |")
    one = " With one run the interval has no drift term: it is too narrow for a claim." if n_runs < 2 else ""
    return ["", f"Throughput-adjusted: the FLOP multiplier x the baseline's step time / the cell's, step times "
            f"measured on {device} by bench.py ({step_times}): each run's interleaved rounds give a mean log step-time "
            f"ratio, and the runs' means are pooled (their spread is the drift between runs, kept in the interval: "
            f"t with runs - 1 degrees of freedom). The interval combines that with the multiplier's jackknife "
            f"(Welch-Satterthwaite).{one}", "",
            "| cell | FLOP multiplier | step time / baseline's | bench runs | drift (sd of log ratio) | "
            "throughput-adjusted | 95% interval |", "|---|---|---|---|---|---|---|", *lines]


def precision_lines(rows):
    """Measurement noise against seed noise: the final evals' standard errors (over their windows) and the
    standard deviation of the final loss over the seeds of each (cell, budget), their medians."""
    ses = [r["val_se"] for r in rows if r.get("val_se") is not None and r.get("status") == "done"]
    spread = {}
    for r in rows:
        if r.get("status") == "done" and r.get("val_loss") is not None:
            spread.setdefault((r["cell"], r.get("budget")), []).append(r["val_loss"])
    stds = [statistics.stdev(v) for v in spread.values() if len(v) > 1]
    done = [r for r in rows if r.get("status") == "done"]
    periodic = sum(r.get("eval_tokens") is None for r in done)
    if periodic:  # a CSV from before the final eval: its losses are not the other tables' measure
        return ["", f"Loss measure: {periodic} of the {len(done)} runs have no final eval (a results.csv from before "
                f"it): their loss is the last periodic eval on eval_iters batches, which reads 0.002-0.03 off the final "
                f"eval on the whole val split: compare these figures only with each other."]
    if not ses or not stds:
        return []
    tokens = sorted({r["eval_tokens"] for r in rows if r.get("eval_tokens")})
    return ["", f"Loss measure: the final eval on the whole val split. Precision: each final loss is measured on the same {', '.join(f'{t:,.0f}' for t in tokens)} val "
            f"tokens, with a standard error over its windows of {statistics.median(ses):.4f} (median over the "
            f"{len(ses)} runs; an upper bound for a difference between two runs, which share the tokens); the "
            f"final loss varies over seeds by a standard deviation of {statistics.median(stds):.4f} (median over "
            f"{len(stds)} cells and budgets)."]


def schedule_lines(rows):
    """Every (cell, budget): its mean optimizer steps and warm-up, so that training length is read apart from
    depth (train.py's warm-up: 100 iterations capped at 10% of them, rounded up)."""
    got = {}
    for r in rows:
        if r.get("status") == "done" and r.get("iters"):
            got.setdefault(r["cell"], {}).setdefault(r.get("budget"), []).append(r["iters"])
    if not got:
        return []
    budgets = sorted({b for v in got.values() for b in v if b is not None})
    if not budgets:  # a one-budget CSV (no budget column): its steps are in flops.py results' table
        return []
    cell = lambda v: "-" if not v else (f"{mean(v):.0f}, {min(100, math.ceil(0.1 * mean(v)))}"  # noqa: E731
                                        + (" (short)" if mean(v) < MIN_STEPS else ""))
    return ["", f"Training length: each cell's optimizer steps and warm-up at each budget (short: fewer than "
            f"{MIN_STEPS} steps, left out of the headline figures).", "",
            "| cell | " + " | ".join(f"{b:.3g}" for b in budgets) + " |", "|" + "---|" * (len(budgets) + 1),
            *[f"| {c} | " + " | ".join(cell(v.get(b)) for b in budgets) + " |" for c, v in got.items()]]


def report(rows, pairs, step_times="", floor=None):
    """flops.py multiplier's Markdown, and the per-cell results (compare) for the figure. floor: the 0-layer
    model's bound (bigram_floor), which brackets a best depth of 1 below it."""
    results, fits = compare(rows, pairs)
    ok = [c for c, r in results.items() if r["why"] is None]
    adj = dict(zip(ok, stats.holm([results[c]["ci"] and results[c]["ci"]["p"] for c in ok])))
    n_seeds = len(seeds_in(*[r["cell_groups"] for r in results.values() if r["why"] is None]))
    lines = ["Compute multiplier at equal training FLOPs: the compute the baseline needs to reach the cell's mean "
             "final val loss, over the cell's compute, read off the baseline's measured curve (its mean loss at "
             "each budget, joined by a monotone cubic in log compute). A loss outside the baseline's measured range is "
             "extrapolated, and a budget where the cell trained fewer than "
             f"{MIN_STEPS} optimizer steps is short: both are flagged, and left out of the overall figure (the "
             f"geometric mean over the headline budgets) and the trend. Fitted: the same read off a power law "
             f"fitted to the baseline and its cells with a shared asymptote, as a check; a degenerate fit gives no "
             f"number. 95% intervals and p (of 'worth its compute', multiplier 1): the delete-one-seed jackknife "
             f"over the {n_seeds} seeds, each left out of every cell at once (paired), t with seeds - 1 degrees of "
             f"freedom. Family: the {sum(p is not None for p in adj.values())} overall figures of this table, "
             f"p Holm-adjusted.", "",
             "| cell | baseline | budget | multiplier | 95% interval | p | p (Holm) | fitted | note |", "|" + "---|" * 9]
    for cell, r in results.items():
        lines += cell_lines(cell, r, adj.get(cell))
    lines += precision_lines(rows)
    lines += schedule_lines(rows)
    lines += ["", "The fits (each baseline with the cells compared with it):", "", "| baseline | fit |", "|---|---|"]
    lines += [f"| {b} | {law} |" for b, law in fits.items()]
    lines += depth_lines(rows, results, pairs)
    lines += optimum_lines(rows, pairs, floor)
    lines += frontier_lines(rows, pairs, floor)
    if step_times:
        lines += throughput_lines(results, step_times)
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
            cis = [(r["ci"] and r["ci"]["mci"]) or (m, m) for m, (_, r) in zip(ms, got)]
            err = [[m - lo for m, (lo, _) in zip(ms, cis)], [hi - m for m, (_, hi) in zip(ms, cis)]]
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
    bx.set_title("overall multiplier (headline budgets), 95% jackknife interval" if len(depths) > 1 else
                 "multiplier at each in-range budget", fontsize=10)
    for a in (ax, bx):
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_frontier(rows, pairs, path, floor=None):
    """Loss against compute, one panel per design: a line per depth for the design (colour) and its baseline
    (grey), and each one's best-of-depths frontier (thick; an open marker where that optimum is on the grid's
    edge). Nothing is written when no design has two depths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    by = depth_cells(rows, pairs)
    design = {r["cell"]: design_of(r) for r in rows}
    panels = [(name, base) for base in sorted({design[b] for b in pairs.values()})
              for name in sorted({design[c] for c, b in pairs.items() if design[b] == base})
              if len(by[name]) > 1 and len(by[base]) > 1]
    if not panels:
        return None
    cols = min(3, len(panels))
    rows_n = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(5 * cols, 4 * rows_n), squeeze=False, sharey=True)
    for ax, (name, base) in zip(axes.flat, panels):
        for who, color in ((base, "0.6"), (name, "C0")):
            depths = sorted(by[who])
            shades = plt.cm.viridis(np.linspace(0, 0.9, len(depths))) if who == name else [color] * len(depths)
            for d, shade in zip(depths, shades):
                pts = means(at_seeds(by[who][d]))
                ax.plot([c for c, _ in pts], [y for _, y in pts], "-", color=shade, lw=0.9, alpha=0.9,
                        label=f"{who} {d} layers" if who == name else (f"{who} (each depth)" if d == depths[0] else None))
            curve = best_curve(by[who])
            xs = sorted(curve)
            ax.plot([curve[b][2] for b in xs], [curve[b][1] for b in xs], "-", color="k" if who == base else "C3",
                    lw=2.2, label=f"{who} frontier")
            for b in xs:
                edge = on_edge(by[who], b, curve[b][0], floor)
                ax.plot(curve[b][2], curve[b][1], "o", mfc="none" if edge else ("k" if who == base else "C3"),
                        mec="k" if who == base else "C3", ms=6)
                ax.annotate(str(curve[b][0]), (curve[b][2], curve[b][1]), fontsize=7, xytext=(3, 3 if who == name
                                                                                                else -9),
                            textcoords="offset points")
        if floor is not None:
            ax.axhline(floor, color="0.3", ls=":", lw=1, label="0 layers: the lowest loss reachable")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # 2x-apart budgets: no crowded labels
        ax.set_title(f"{name} against {base} (frontier: best depth, labelled; open: on the grid's edge)", fontsize=8)
        ax.set_xlabel("training FLOPs")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=5, ncol=2)
    for ax in axes[:, 0]:
        ax.set_ylabel("final val loss (mean over seeds)")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
