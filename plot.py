"""
Plot nanodepth runs from the log.jsonl that train.py appends to in each out_dir.

    python plot.py depth out-nag out-prenorm [--iter=N] [--out=depth.png]   # RMS and update size vs depth
    python plot.py weights out-attnres [--iter=N] [--out=weights.png]       # AttnRes depth-attention heat-map
    python plot.py loss out-nag out-prenorm [--out=loss.png]                # val (solid) and train (dashed) loss
    python plot.py table out-nag out-prenorm [--out=table.md]               # Markdown table of the runs
    python plot.py table out/sweep_depth16_cpu/*                            # ... and mean ± std per sweep cell
    python plot.py routing out-mod [--text=...] [--out=routing.png]          # which token ran which sublayer

The command comes first, then the runs' out_dirs, then --key=value options (the configurator's rules:
unknown keys and wrong types are errors). depth and weights read the diagnostics that train.py logs
only with --diagnose=True; routing runs a MoD checkpoint (out_dir/ckpt.pt) on the CPU.
Without --out a figure goes beside its run: into the run's out_dir for one run (routing's table too,
as routing.md), into the runs' common folder for several, or under out/ when that folder is the
current one. Each residual mode has one colour in every figure; a second run of a mode is lighter.
"""

import os
import sys

import matplotlib
matplotlib.use("Agg")  # files only, so it runs on a headless box
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap, SymLogNorm, to_rgb
from matplotlib.ticker import MaxNLocator

from configurator import ConfigError, configure
from model import RESIDUALS
from run_config import (EVAL_SEED, get_batch, load_checkpoint, load_codec, load_log, model_from_checkpoint,
                        pick_baselines, seed_cell)
from stats import MISSING, family_cells, family_header, family_sentence, mean_std

DEFAULTS = dict(
    iter=None,  # depth, weights: the eval at this iter (None: the last one with diagnostics)
    out=None,  # the file written (None: <command>.png beside the runs; table: print only; routing: its table goes to .md)
    text=None,  # routing: the passage drawn (None: the first block_size tokens of the val split)
    batches=20,  # routing: val batches (seed EVAL_SEED) the table of which tokens skip most counts over
    baseline=None,  # table: the cell every sweep cell is tested against (None: its depth's prenorm cell, else first)
)


def pick(records, out_dir, it=None):
    """The record at iter `it`, or else the last one that has diagnostics."""
    diag = [r for r in records if r.get("diagnostics")]
    if not diag:
        raise ConfigError(f"{out_dir} logged no diagnostics (train with --diagnose=True)")
    if it is None:
        return diag[-1]
    for r in diag:
        if r["iter"] == it:
            return r
    raise ConfigError(f"{out_dir} has no diagnostics at iter {it}; it has {[r['iter'] for r in diag]}")


MODE_COLOURS = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink",
                "tab:olive", "tab:cyan", "gold", "teal", "navy", "magenta", "lime", "black"]  # by RESIDUALS' order:
# prenorm blue, sandwich orange, nag green, ...; gray is for a run whose mode is not logged


def run_residual(records):
    """The residual mode a run logged (train.py puts it in every eval record), or None."""
    return next((r["residual"] for r in reversed(records) if "residual" in r), None)


def mode_colours(records):
    """A colour per run, the same for a mode in every figure: its residual's (gray when not logged);
    a later run of a mode already drawn is lighter, so the runs of one mode stay apart."""
    colours, seen = [], {}
    for recs in records:
        residual = run_residual(recs)
        base = (MODE_COLOURS[list(RESIDUALS).index(residual) % len(MODE_COLOURS)] if residual in RESIDUALS
                else "tab:gray")
        k = seen[residual] = seen.get(residual, -1) + 1
        mix = min(0.6, 0.3 * k)  # towards white
        colours.append(tuple(1 - (1 - c) * (1 - mix) for c in to_rgb(base)))
    return colours


def labels(out_dirs, records):
    """residual + depth when every run logged them and that tells the runs apart, else the dir names."""
    names = [os.path.basename(os.path.normpath(d)) for d in out_dirs]
    rs = [next((r for r in reversed(recs) if r.get("diagnostics")), None) for recs in records]
    if any(r is None for r in rs):
        return names
    mode = [f"{r['residual']}, {len(r['diagnostics']) - 1} sublayers" for r in rs]
    return mode if len(set(mode)) == len(mode) else [f"{m} ({n})" for m, n in zip(mode, names)]


def plot_depth(out_dirs, it=None):
    """RMS and update size against depth; with an hc or mhc run, two more panels: the composite H_res
    gain from the embedding to each sublayer (max row sum, solid; max column sum, dashed) and the
    mean cosine between the n streams (1: collapsed); with a scalars run, one more: its residual scalars
    per block, lambda (solid) and beta (dashed), at the block's attention sublayer."""
    runs = [load_log(d) for d in out_dirs]
    picked = [pick(recs, d, it)["diagnostics"] for d, recs in zip(out_dirs, runs)]
    # the panels beyond RMS and update, each {key: the figure a row must have, ylabel}
    extra = [("gain_fwd", "composite H_res gain"), ("stream_cos", "mean cosine between the n streams"),
             ("lam", "residual scalars: lambda (solid), beta (dashed)")]
    extra = [(key, ylabel) for key, ylabel in extra if any(key in r for rows in picked for r in rows)]
    n_rows = 1 + (len(extra) + 1) // 2
    fig, axes = plt.subplots(n_rows, 2, figsize=(11, 4.2 if n_rows == 1 else 4.1 * n_rows), squeeze=False)
    ax_rms, ax_upd, *ax_extra = axes.flat
    for ax in ax_extra[len(extra):]:
        ax.set_visible(False)
    panels = {key: ax for (key, _), ax in zip(extra, ax_extra)}
    for rows, label, colour in zip(picked, labels(out_dirs, runs), mode_colours(runs)):
        def draw(key, dashed=None):
            """This run's `key` against sublayer in its panel; `dashed`: a second figure, same colour."""
            have = [r for r in rows if key in r]  # a run with the key has its panel: extra holds every key drawn
            if have:
                x = [r["sublayer"] for r in have]
                panels[key].plot(x, [r[key] for r in have], marker="o", label=label, color=colour)
                if dashed:
                    panels[key].plot(x, [r[dashed] for r in have], "--", color=colour)
        draw("gain_fwd", dashed="gain_bwd")
        draw("stream_cos")
        draw("lam", dashed="beta")
        # the head's row is the stream the head reads: part of the RMS curve, but it makes no update
        ax_rms.plot([r["sublayer"] for r in rows], [r["rms"] for r in rows], marker="o", label=label, color=colour)
        upd = [r for r in rows if "update" in r]
        ax_upd.plot([r["sublayer"] for r in upd], [r["update"] for r in upd], marker="o", label=label, color=colour)
    ax_rms.set_yscale("log")  # modes differ by orders of magnitude in stream scale
    ax_upd.set_yscale("log")  # the first sublayers' updates dwarf the small embedding they are added to
    ax_rms.set_ylabel("RMS of the residual stream entering it")
    ax_upd.set_ylabel(r"relative update $\|x_{l+1} - x_l\| \,/\, \|x_l\|$")
    for key, ylabel in extra:
        panels[key].set_ylabel(ylabel)
        panels[key].legend(fontsize=8)
    if "gain_fwd" in panels:
        ax = panels["gain_fwd"]
        ax.set_title("solid: max row sum, dashed: max column sum", fontsize=9)
        ax.ticklabel_format(axis="y", useOffset=False)  # mhc's gains sit at 1 within 1e-6: no offset notation
        lo, hi = ax.get_ylim()
        if hi - lo < 0.1:
            ax.set_ylim((lo + hi) / 2 - 0.05, (lo + hi) / 2 + 0.05)
    # a panel whose curves end with the head's row says so; the update panel has none (the head makes no update)
    keys = {ax_rms: "rms", ax_upd: "update", **{ax: key for key, ax in panels.items()}}
    for ax in keys:
        head = any(rows[-1].get("kind") == "head" and keys[ax] in rows[-1] for rows in picked)
        ax.set_xlabel("sublayer" + (" (last point: the head)" if head else ""))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    ax_upd.legend()
    fig.suptitle("residual stream vs depth" + (f" at iter {it}" if it is not None else " (last eval)"))
    fig.tight_layout()
    return fig


def plot_weights(out_dir, it=None):
    """A run's depth weights as a heat-map, a row per sublayer that reads a mix (and the head), a column per
    source. Softmax weights (attnres) on a linear scale from 0; signed ones (dwa, mudd: no softmax) on a
    diverging symmetric-log scale around 0, so that a few large weights do not hide the rest."""
    rec = pick(load_log(out_dir), out_dir, it)
    rows = rec["diagnostics"]
    if not any("depth_weights" in r for r in rows):
        raise ConfigError(f"{out_dir} has no depth weights (residual={rec.get('residual')}; "
                          "only attnres, block_attnres, dwa and mudd runs log them)")
    # a mode that mixes block outputs after each block (dwa, mudd) gives no MLP row weights: only a block's
    # attention sublayer and the head read a mix, so those are the rows
    blocks = not any("depth_weights" in r for r in rows if r["kind"] == "mlp")
    if blocks:
        rows = [r for r in rows if r["kind"] != "mlp"]
    # NaN where a sublayer does not attend that source (sublayer 1 reads the embedding directly)
    w = np.full((len(rows), max(len(r.get("depth_weights", [])) for r in rows)), np.nan)
    for i, r in enumerate(rows):
        dw = r.get("depth_weights", [])
        w[i, :len(dw)] = dw
    fig, ax = plt.subplots(figsize=(1.2 + 0.6 * w.shape[1], 1.2 + 0.45 * w.shape[0]))
    signed = np.nanmin(w) < 0
    if signed:
        top = np.nanmax(np.abs(w))
        norm = SymLogNorm(linthresh=min(0.05, top), vmin=-top, vmax=top)
        im = ax.imshow(w, cmap="RdBu_r", norm=norm, aspect="auto")
        dark = lambda v: abs(v) > 0.5 * top  # noqa: E731  (the strong ends of the diverging map)
    else:
        im = ax.imshow(w, cmap="viridis", vmin=0, aspect="auto")
        dark = lambda v: v < 0.6 * np.nanmax(w)  # noqa: E731
    for i, j in zip(*np.nonzero(~np.isnan(w))) if w.size <= 200 else []:  # numbers while cells are readable
        ax.text(j, i, f"{w[i, j]:.2f}", ha="center", va="center", fontsize=7,
                color="white" if dark(w[i, j]) else "black")
    for i in np.nonzero(np.isnan(w).all(1))[0]:  # an empty row would look like missing data
        ax.text((w.shape[1] - 1) / 2, i, "no mix before it" if blocks else "reads only the embedding", ha="center",
                va="center", fontsize=7, color="dimgray")
    ax.set_yticks(range(len(rows)), [f"{r['sublayer']} {r['kind']}" for r in rows])
    ax.set_xticks(range(w.shape[1]))
    if rec.get("residual") == "block_attnres":  # sources are blocks: finished ones, then the current one's sum
        ax.set_xlabel("source block (0 = embedding;\na mid-block row's last: its block so far)")
    elif blocks:
        ax.set_xlabel("block output mixed (0 = embedding)")
    else:
        ax.set_xlabel("source: sublayer output (0 = embedding)")
    ax.set_ylabel("sublayer")
    ax.set_title(f"{rec.get('residual')} depth weights, iter {rec['iter']}", fontsize=10)
    fig.colorbar(im, ax=ax, label="weight (mean over tokens)" + (", symmetric log scale" if signed else ""))
    fig.tight_layout()
    return fig


def plot_loss(out_dirs):
    runs = [load_log(d) for d in out_dirs]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for recs, label, colour in zip(runs, labels(out_dirs, runs), mode_colours(runs)):
        # iteration 0's loss is the untrained model's (ln vocab): it would squash the range that matters
        recs = [r for r in recs if r["iter"] > 0] or recs
        iters = [r["iter"] for r in recs]
        ax.plot(iters, [r["val_loss"] for r in recs], label=label, color=colour)
        ax.plot(iters, [r["train_loss"] for r in recs], "--", color=colour)  # no legend entry: the y-label
    ax.set_xlabel("iter (the eval at iteration 0 left out)")
    ax.set_ylabel("loss (solid: val, dashed: train)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig





def run_figures(out_dir):
    """One run's figures for the table: final and best val loss, the stream growth with depth (RMS the
    head reads / RMS entering sublayer 1, and / RMS entering sublayer 3: the growth after the first
    block, apart from the jump from a small embedding) and, for nag, gate health (mean |a| over the
    sublayers, and the dead branches: mean |a| < 0.05). None where the log lacks the diagnostics."""
    recs = load_log(out_dir)
    last = next((r for r in reversed(recs) if r.get("diagnostics")), None)  # None: trained without --diagnose
    rows = last["diagnostics"] if last else None
    gains = [r["gain"] for r in rows or [] if "gain" in r]
    paces = [r["ms_per_iter"] / 1000 for r in recs if r.get("ms_per_iter")]
    residual = run_residual(recs)
    return {"s_per_iter": float(np.median(paces)) if paces else None, "run": os.path.basename(os.path.normpath(out_dir)),
            "residual": residual or MISSING,
            # the reference cell: prenorm without MoD (a MoD run logs its executed fractions)
            "plain_prenorm": residual == "prenorm" and not any("exec_train" in r for r in recs),
            "sublayers": len(rows) - 1 if rows else None, "final": recs[-1]["val_loss"],
            "best": min(r["val_loss"] for r in recs),
            "growth1": rows[-1]["rms"] / rows[0]["rms"] if rows else None,
            "growth3": rows[-1]["rms"] / rows[min(2, len(rows) - 1)]["rms"] if rows else None,
            "gain": sum(gains) / len(gains) if gains else None, "dead": rows[-1]["dead"] if gains else None}


def fmt(value, spec):
    """value formatted with spec, or MISSING for None."""
    return MISSING if value is None else f"{value:{spec}}"


def mean_pm(values, spec):
    """mean ± sample std of values (stats.mean_std), formatted with spec; MISSING if a run lacks one."""
    if None in values:
        return MISSING
    mean, std = mean_std(values)
    return f"{mean:{spec}}" + ("" if std is None else f" ± {std:{spec}}")


def table(out_dirs, baseline=None):
    """Markdown: a row per run (run_figures). Where runs are seeds of one sweep cell (`<cell>_s<seed>`), a
    second table gives each such cell's mean ± sample std over its seeds, its final val loss against a
    baseline cell (run_config.pick_baselines, as flops.py's tables: `baseline`, else the prenorm cell of
    the same depth, else that depth's first cell): the table's comparisons one family (stats.family_cells:
    paired on the seeds both cells ran, else Welch; p raw and Holm-adjusted), and its median seconds per
    iteration over the baseline's (their runs' median logged paces; comparable only for runs of one sweep,
    which share the machine alike).
    A run trained without --diagnose has its losses and MISSING for the rest."""
    runs = [run_figures(d) for d in out_dirs]
    lines = ["| run | residual | sublayers | final val | best val | RMS head / RMS sublayer 1 "
             "| RMS head / RMS sublayer 3 | nag gates: mean \\|a\\|, dead |",
             "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        gates = f"{r['gain']:.3f}, {r['dead']:.0f} of {r['sublayers']}" if r["gain"] is not None else MISSING
        lines.append(f"| {r['run']} | {r['residual']} | {fmt(r['sublayers'], 'd')} | {r['final']:.4f} "
                     f"| {r['best']:.4f} | {fmt(r['growth1'], '.2f')} | {fmt(r['growth3'], '.2f')} | {gates} |")
    cells = {}
    for r in runs:
        cells.setdefault(seed_cell(r["run"]), []).append(r)
    cells.pop(None, None)  # runs not named <cell>_s<seed>
    cells = {c: rs for c, rs in cells.items() if len(rs) > 1}
    if baseline is not None and baseline not in cells:
        raise ConfigError(f"--baseline={baseline} is not a cell of these runs; cells: {', '.join(cells)}")
    if cells:
        bases = pick_baselines([(c, rs[0]["sublayers"], all(r["plain_prenorm"] for r in rs)) for c, rs in cells.items()],
                               baseline)
        by_seed = lambda rs: {int(r["run"].rpartition("_s")[2]): r["final"] for r in rs}  # noqa: E731
        tested = [c for c in cells if bases[c] != c]
        rows, m = family_cells([(by_seed(cells[c]), by_seed(cells[bases[c]])) for c in tested])
        rows = dict(zip(tested, rows))
        lines += ["", "Per cell, mean ± sample std over its seeds; final val against the baseline cell: the "
                  "difference, its 95% CI, a paired t-test on the seeds both cells ran (Welch's t-test where they "
                  f"share fewer than 2), p raw and Holm-adjusted. {family_sentence(m)}.", "",
                  "| cell | seeds | final val | best val | RMS head / RMS sublayer 1 | RMS head / RMS sublayer 3 "
                  "| nag gates: mean \\|a\\|, dead | baseline | " + " | ".join(family_header())
                  + " | s/iter vs baseline |", "|" + "---|" * 15]
        for c, rs in cells.items():
            base = bases[c]
            vs = [MISSING] * 6 if base == c else list(rows[c])
            pace, base_pace = (None if None in p else float(np.median(p)) for p in
                               ([r["s_per_iter"] for r in rs], [r["s_per_iter"] for r in cells[base]]))
            vs.append(MISSING if base == c or not pace or not base_pace else f"{pace / base_pace:.2f}x")
            gains = [r["gain"] for r in rs]
            gates = MISSING if None in gains else (f"{mean_pm(gains, '.3f')}, "
                                                   f"{mean_pm([r['dead'] for r in rs], '.1f')} of {rs[0]['sublayers']}")
            lines.append(f"| {c} | {len(rs)} | {mean_pm([r['final'] for r in rs], '.4f')} "
                         f"| {mean_pm([r['best'] for r in rs], '.4f')} | {mean_pm([r['growth1'] for r in rs], '.2f')} "
                         f"| {mean_pm([r['growth3'] for r in rs], '.2f')} | {gates} | {base} | {' | '.join(vs)} |")
    return "\n".join(lines)


def token_label(s):
    """A token's text as a tick label: newline and space made visible."""
    return s.replace("\n", "⏎").replace(" ", "␣") or "∅"


def routing(out_dir, text=None, batches=20):
    """A MoD checkpoint's eval routing (thresholds tau, or the router's predictors): a grid of a
    passage's tokens x sublayers, whether each token ran each sublayer and the score it was routed on
    (nag: the tangent a; router: r); and a Markdown table of the tokens that skip most and least,
    counted over `batches` val batches. Returns (figure, table)."""
    import torch
    from model import TopKMoD, routing as model_routing
    device = torch.device("cpu")
    ckpt = load_checkpoint(os.path.join(out_dir, "ckpt.pt"), device, reader=True)
    model = model_from_checkpoint(ckpt, device)
    config = model.config
    if config.mod not in ("nag", "router") or config.mod_rate == 0:
        raise ConfigError(f"{out_dir} is a mod={config.mod} model at mod_rate {config.mod_rate:g}: routing draws "
                          f"a model trained with --mod=nag or --mod=router and mod_rate > 0")
    encode, decode = load_codec(ckpt)
    val = os.path.join(ckpt["config"]["data_dir"], ckpt["config"]["dataset"], "val.bin")
    if text is not None:
        ids = encode(text)
        if not 0 < len(ids) <= config.block_size:
            raise ConfigError(f"--text is {len(ids)} tokens; pass 1 to block_size={config.block_size} tokens")
    elif not os.path.exists(val):
        raise ConfigError(f"no {val} to take a passage from: pass --text=...")
    else:
        ids = np.memmap(val, dtype=np.uint16, mode="r")[:config.block_size].astype(np.int64).tolist()
    ran, score = model_routing(model, torch.tensor([ids]))
    ran, score = ran[:, 0].numpy(), score[:, 0].numpy()

    routed = sorted(TopKMoD.routed(config))
    kind = "tangent a" if config.residual == "nag" else "router score r"
    fig, (ax_ran, ax_score) = plt.subplots(2, 1, figsize=(2.5 + 0.2 * len(ids), 2 + 0.5 * config.n_sublayers),
                                           sharex=True)
    im_ran = ax_ran.imshow(ran, cmap=ListedColormap(["white", "dimgray"]), vmin=0, vmax=1, aspect="auto",
                           interpolation="nearest")
    fig.colorbar(im_ran, ax=ax_ran, ticks=[0.25, 0.75], fraction=0.03, pad=0.01).ax.set_yticklabels(["skipped", "ran"])
    im = ax_score.imshow(score, cmap="viridis", aspect="auto", interpolation="nearest")
    skipped = np.nonzero(~ran)
    ax_score.scatter(skipped[1], skipped[0], marker="x", s=12, color="red", linewidths=0.8, label="skipped")
    fig.colorbar(im, ax=ax_score, label=kind, fraction=0.03, pad=0.01)
    names = [f"{l + 1} {'attn' if l % 2 == 0 else 'mlp'}" + ("" if l in routed else " (dense)")
             for l in range(config.n_sublayers)]
    for ax in (ax_ran, ax_score):
        ax.set_yticks(range(config.n_sublayers), names, fontsize=7)
        ax.set_ylabel("sublayer")
    ax_score.set_xticks(range(len(ids)), [token_label(decode([i])) for i in ids], fontsize=8, family="monospace")
    ax_score.legend(loc="upper right", fontsize=7)
    skip = 1 - ran[routed].mean()
    ax_ran.set_title(f"{config.residual} + mod={config.mod} {config.mod_rate:g}: {skip:.0%} of the routed "
                     f"sublayers' tokens skipped here", fontsize=10)
    ax_score.set_title(f"{kind} (red x: skipped)", fontsize=10)
    fig.tight_layout()
    return fig, skip_table(model, val, ckpt["config"], decode, batches)


def skip_table(model, val, cfg, decode, batches, show=8):
    """Markdown: per token, over `batches` val batches, the fraction of its routed sublayer passes
    that were skipped (and nag's mean tangent a); the tokens that skip most, then least."""
    import torch
    from model import TopKMoD, routing as model_routing
    config, routed = model.config, sorted(TopKMoD.routed(model.config))
    seen, skips, a_sum = {}, {}, {}
    g = torch.Generator().manual_seed(EVAL_SEED)
    for _ in range(batches):
        X, _ = get_batch(val, cfg["batch_size"], config.block_size, g, torch.device("cpu"))
        ran, score = model_routing(model, X)
        skipped = (~ran[routed]).float().mean(0)  # [B, T]: the fraction of routed sublayers skipped
        a = score[routed].mean(0) if config.residual == "nag" else None
        for i, tok in enumerate(X.flatten().tolist()):
            seen[tok] = seen.get(tok, 0) + 1
            skips[tok] = skips.get(tok, 0.0) + skipped.flatten()[i].item()
            if a is not None:
                a_sum[tok] = a_sum.get(tok, 0.0) + a.flatten()[i].item()
    common = sorted((t for t in seen if seen[t] >= 20), key=lambda t: -skips[t] / seen[t])
    total = sum(skips.values()) / sum(seen.values())
    head = "| token | count | skipped |" + (" mean a |" if a_sum else "")
    lines = [f"Over {batches} val batches ({sum(seen.values()):,} tokens), {total:.1%} of the routed sublayer "
             f"passes skipped. Tokens seen at least 20 times, the {show} that skip most, then the {show} that "
             f"skip least:", "", head, "|---|---|---|" + ("---|" if a_sum else "")]
    rows = common if len(common) <= 2 * show else common[:show] + ["..."] + common[-show:]
    for t in rows:
        if t == "...":
            lines.append("| ... | | |" + (" |" if a_sum else ""))
            continue
        lines.append(f"| `{token_label(decode([t]))}` | {seen[t]} | {skips[t] / seen[t]:.1%} |"
                     + (f" {a_sum[t] / seen[t]:.3f} |" if a_sum else ""))
    return "\n".join(lines)


COMMANDS = {"depth": "residual RMS and relative update size vs sublayer",
            "weights": "AttnRes depth-attention heat-map of one run",
            "loss": "val and train loss vs iter",
            "table": "Markdown table: val loss, stream growth with depth, nag's gate health",
            "routing": "which tokens of a passage ran which sublayer of a MoD checkpoint, and what skips most"}


def default_out(cmd, out_dirs):
    """Where a figure goes without --out: beside its runs. One run: its out_dir/<cmd>.png; several: their
    common folder, or out/ when that folder is the current one or above it (the repo root is no place for
    figures). The folder is made if needed."""
    paths = [os.path.abspath(d) for d in out_dirs]
    where = paths[0] if len(paths) == 1 else os.path.commonpath(paths)
    here = os.path.abspath(os.getcwd())
    if len(paths) > 1 and (where == here or here.startswith(where.rstrip(os.sep) + os.sep)):
        where = os.path.join(here, "out")
    os.makedirs(where, exist_ok=True)
    return os.path.relpath(os.path.join(where, f"{cmd}.png"))


def main(argv):
    """Draw, write the file, print its path; returns the Figure (table: the text), which the tests read."""
    if "--help" in argv or "-h" in argv:
        print(__doc__)  # the commands; configure then lists the keys and exits
    options = [a for a in argv if a.startswith("--") or a == "-h"]
    cfg = configure(options, DEFAULTS, [(__file__, "DEFAULTS")])
    if not argv or argv[0] not in COMMANDS:
        raise ConfigError(f"the first argument is the command: {', '.join(COMMANDS)} (e.g. python plot.py "
                          f"loss out-nag out-prenorm)")
    cmd, out_dirs = argv[0], [a for a in argv[1:] if a not in options]
    single = cmd in ("weights", "routing")
    if not single:  # files are skipped, so that a sweep's out/<sweep>/* can be passed whole (its results.*)
        out_dirs = [d for d in out_dirs if not os.path.isfile(d)]
    if not out_dirs or (single and len(out_dirs) > 1):
        raise ConfigError(f"plot.py {cmd} takes {'one out_dir' if single else 'one or more out_dirs'}, "
                          f"got {len(out_dirs)}")
    if cfg["baseline"] is not None and cmd != "table":
        raise ConfigError(f"--baseline applies to table, not {cmd}: drop it")
    if cfg["iter"] is not None and cmd not in ("depth", "weights"):
        raise ConfigError(f"--iter applies to depth and weights, not {cmd}: drop it")
    if cmd != "routing" and (cfg["text"] is not None or cfg["batches"] != DEFAULTS["batches"]):
        raise ConfigError(f"--text and --batches apply to routing, not {cmd}: drop them")
    if isinstance(cfg["batches"], bool) or not isinstance(cfg["batches"], int) or cfg["batches"] < 1:
        raise ConfigError(f"--batches must be a positive integer, got {cfg['batches']!r}")
    if cfg["out"] is not None and cmd != "table":  # before drawing: savefig would refuse it at the end
        formats = sorted(plt.figure().canvas.get_supported_filetypes())
        plt.close()
        if os.path.splitext(str(cfg["out"]))[1][1:].lower() not in formats:
            raise ConfigError(f"--out={cfg['out']}: end the name with a format matplotlib writes "
                              f"({', '.join(formats)}), e.g. --out={cmd}.png")

    if cmd == "table":
        text = table(out_dirs, cfg["baseline"])
        print(text)
        if cfg["out"]:
            with open(cfg["out"], "w") as f:
                f.write(text + "\n")
        return text
    if cmd == "depth":
        fig = plot_depth(out_dirs, cfg["iter"])
    elif cmd == "weights":
        fig = plot_weights(out_dirs[0], cfg["iter"])
    elif cmd == "loss":
        fig = plot_loss(out_dirs)
    else:
        fig, text = routing(out_dirs[0], cfg["text"], cfg["batches"])
    out = cfg["out"] or default_out(cmd, out_dirs)  # after drawing: a run that fails leaves nothing behind
    try:
        if cmd == "routing":
            md = os.path.splitext(out)[0] + ".md"
            with open(md, "w") as f:
                f.write(text + "\n")
            print(text)
            print(md)
        fig.savefig(out, dpi=120)
    except OSError as e:  # a read-only run folder, a full disk: say where else to write
        raise ConfigError(f"cannot write {out} ({e.strerror or e}): pass --out=PATH somewhere writable "
                          f"(e.g. --out=/tmp/{cmd}.png)") from None
    finally:
        plt.close(fig)  # pyplot keeps every open figure alive otherwise
    print(out)
    return fig


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except ConfigError as e:
        sys.exit(f"error: {e}")
