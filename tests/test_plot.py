"""plot.py on hand-written log.jsonl files: each subcommand writes a PNG of the data in the log; routing
on tiny MoD checkpoints."""
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from model import routing  # noqa: E402

import plot
import run_config
import stats
from configurator import ConfigError
from tiny_checkpoint import BLOCK, make_checkpoint

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
REPO = Path(__file__).resolve().parents[1]

# two layers = four sublayers + the head, as train.py --diagnose=True logs them
NAG = [{"sublayer": 1, "kind": "attn", "rms": 1.0, "alpha": 0.9, "m": 0.5, "angle": 0.4, "update": 0.5},
       {"sublayer": 2, "kind": "mlp", "rms": 1.5, "alpha": 0.7, "m": 0.5, "angle": 0.3, "update": 0.4},
       {"sublayer": 3, "kind": "attn", "rms": 2.0, "alpha": 0.6, "m": 0.5, "angle": 0.2, "update": 0.3},
       {"sublayer": 4, "kind": "mlp", "rms": 3.0, "alpha": 0.5, "m": 0.5, "angle": 0.2, "update": 0.2},
       {"sublayer": 5, "kind": "head", "rms": 4.0}]
NAG = [{**r, "gain": 0.1 * r["sublayer"]} for r in NAG[:-1]] + [{**NAG[-1], "dead": 1.0}]  # gate health
ATTNRES = [{"sublayer": 1, "kind": "attn", "rms": 0.02, "update": 0.9},
           {"sublayer": 2, "kind": "mlp", "rms": 0.01, "depth_weights": [0.6, 0.4], "update": 1.3},
           {"sublayer": 3, "kind": "attn", "rms": 0.03, "depth_weights": [0.2, 0.3, 0.5], "update": 0.3},
           {"sublayer": 4, "kind": "mlp", "rms": 0.04, "depth_weights": [0.1, 0.2, 0.3, 0.4], "update": 0.8},
           {"sublayer": 5, "kind": "head", "rms": 0.05, "depth_weights": [0.3, 0.1, 0.2, 0.2, 0.2]}]
PRENORM = [{"sublayer": l, "kind": k, "rms": 0.1 * l, "update": 0.5} for l, k in
           [(1, "attn"), (2, "mlp"), (3, "attn"), (4, "mlp")]] + [{"sublayer": 5, "kind": "head", "rms": 0.6}]


def scaled(rows, f):
    """rows with rms scaled by f: an earlier eval that --iter must pick instead of the last."""
    return [{**r, "rms": r["rms"] * f} for r in rows]


def write_run(root, name, residual, diagnostics):
    """An out_dir whose log has evals at iters 0, 10, 20: the first without diagnostics (diagnose was
    off then), the others with; the last record has the diagnostics given."""
    d = root / name
    d.mkdir()
    records = [{"iter": 0, "train_loss": 4.2, "val_loss": 4.3, "lr": 0.0},
               {"iter": 10, "train_loss": 3.1, "val_loss": 3.2, "lr": 1e-4,
                "diagnostics": scaled(diagnostics, 10), "residual": residual},
               {"iter": 20, "train_loss": 2.5, "val_loss": 2.7, "lr": 2e-4,
                "diagnostics": diagnostics, "residual": residual}]
    (d / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(d)


@pytest.fixture
def runs(tmp_path):
    return {name: write_run(tmp_path, name, name, rows)
            for name, rows in [("nag", NAG), ("attnres", ATTNRES), ("prenorm", PRENORM)]}


def assert_png(path):
    data = path.read_bytes()
    assert len(data) > len(PNG_MAGIC) and data.startswith(PNG_MAGIC)


def test_depth(runs, tmp_path, capsys):
    out = tmp_path / "depth.png"
    fig = plot.main(["depth", runs["nag"], runs["attnres"], f"--out={out}"])
    assert_png(out)
    assert capsys.readouterr().out.strip() == str(out)
    ax_rms, ax_upd = fig.axes
    assert ax_rms.get_yscale() == "log"
    assert [l.get_label() for l in ax_upd.lines] == ["nag, 4 sublayers", "attnres, 4 sublayers"]
    for line, rows in zip(ax_rms.lines, [NAG, ATTNRES]):  # RMS includes the head's row
        assert list(line.get_xdata()) == [1, 2, 3, 4, 5]
        assert list(line.get_ydata()) == [r["rms"] for r in rows]
    for line, rows in zip(ax_upd.lines, [NAG, ATTNRES]):  # the head makes no update
        assert list(line.get_xdata()) == [1, 2, 3, 4]
        assert list(line.get_ydata()) == [r["update"] for r in rows[:4]]
    ylabel = ax_upd.get_ylabel()  # mathtext, which the PNG above rendered: ‖x_{l+1} - x_l‖, not "||x_{l+1} ..."
    assert ylabel.count("$") == 2 and r"\|x_{l+1} - x_l\|" in ylabel

    fig = plot.main(["depth", runs["nag"], "--iter=10", f"--out={out}"])
    assert list(fig.axes[0].lines[0].get_ydata()) == [r["rms"] for r in scaled(NAG, 10)]
    with pytest.raises(ConfigError, match="no diagnostics at iter 0"):
        plot.main(["depth", runs["nag"], "--iter=0", f"--out={out}"])


MHC = [{**r, "stream_cos": 1.0 - 0.1 * r["sublayer"], "gain_fwd": 1.0 + 0.01 * r["sublayer"],
        "gain_bwd": 1.0 - 0.01 * r["sublayer"]} for r in PRENORM]


def test_depth_draws_the_streams_of_hc_runs(runs, tmp_path):
    """An hc/mhc run adds a row: the composite H_res gains (max row sum solid, max column sum dashed)
    and the streams' mean cosine, per sublayer and the head; a run without them draws no line there."""
    mhc = write_run(tmp_path, "mhc", "mhc", MHC)
    fig = plot.main(["depth", mhc, runs["prenorm"], f"--out={tmp_path / 'd.png'}"])
    assert len(fig.axes) == 4
    ax_gain, ax_cos = fig.axes[2:]
    fwd, bwd = ax_gain.lines
    assert list(fwd.get_xdata()) == [1, 2, 3, 4, 5] and list(fwd.get_ydata()) == [r["gain_fwd"] for r in MHC]
    assert list(bwd.get_ydata()) == [r["gain_bwd"] for r in MHC] and bwd.get_linestyle() == "--"
    assert [list(l.get_ydata()) for l in ax_cos.lines][0] == [r["stream_cos"] for r in MHC]
    assert len(fig.axes[0].lines) == 2  # both runs in the RMS panel
    assert len(plot.main(["depth", runs["prenorm"], f"--out={tmp_path / 'p.png'}"]).axes) == 2


SCALARS = [{**r, **({"lam": 1.0 - 0.1 * r["sublayer"], "beta": 0.05 * r["sublayer"]} if r["kind"] == "attn" else {})}
           for r in PRENORM]


def test_depth_draws_the_residual_scalars(runs, tmp_path):
    """A scalars run adds a panel: lambda (solid) and beta (dashed) at each block's attention sublayer;
    beside an mhc run it is a panel of its own after the H_res gain and the cosine, and no other run draws there."""
    scalars = write_run(tmp_path, "scalars", "scalars", SCALARS)
    fig = plot.main(["depth", scalars, runs["prenorm"], f"--out={tmp_path / 's.png'}"])
    visible = [ax for ax in fig.axes if ax.get_visible()]
    assert len(visible) == 3
    lam, beta = visible[2].lines
    assert list(lam.get_xdata()) == [1, 3] and list(lam.get_ydata()) == pytest.approx([0.9, 0.7])
    assert list(beta.get_ydata()) == pytest.approx([0.05, 0.15]) and beta.get_linestyle() == "--"
    assert visible[2].get_ylabel().startswith("residual scalars")

    mhc = write_run(tmp_path, "mhc", "mhc", MHC)
    fig = plot.main(["depth", mhc, scalars, f"--out={tmp_path / 'ms.png'}"])
    ax_gain, ax_cos, ax_scalars = [ax for ax in fig.axes if ax.get_visible()][2:]
    assert len(ax_gain.lines) == 2 and len(ax_cos.lines) == 1 and len(ax_scalars.lines) == 2
    assert list(ax_scalars.lines[0].get_ydata()) == pytest.approx([0.9, 0.7])


def test_weights(runs, tmp_path):
    out = tmp_path / "weights.png"
    fig = plot.main(["weights", runs["attnres"], f"--out={out}"])
    assert_png(out)
    assert len(fig.axes) == 2  # the heat-map and its colorbar
    got = np.ma.filled(fig.axes[0].images[0].get_array().astype(float), np.nan)
    want = np.full((5, 5), np.nan)  # rows: sublayers 1..4 and the head; NaN: not a source of that row
    for i, r in enumerate(ATTNRES):
        want[i, :len(r.get("depth_weights", []))] = r.get("depth_weights", [])
    np.testing.assert_array_equal(got, want)
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()][-1] == "5 head"
    # the empty first row says why: sublayer 1 reads the embedding directly (one note, on row 0)
    notes = [t for t in fig.axes[0].texts if "embedding" in t.get_text()]
    assert len(notes) == 1 and notes[0].get_position()[1] == 0
    assert fig.axes[0].get_xlabel().startswith("source: sublayer output")


def test_weights_of_block_attnres_are_over_blocks(tmp_path):
    fig = plot.main(["weights", write_run(tmp_path, "block", "block_attnres", ATTNRES), f"--out={tmp_path / 'w.png'}"])
    assert fig.axes[0].get_xlabel().startswith("source block (0 = embedding")


@pytest.mark.parametrize("residual", ["dwa", "mudd"])
def test_weights_of_dwa_and_mudd_are_over_block_outputs(tmp_path, residual):
    """dwa and mudd mix block outputs after each block, so no MLP row has weights: the axis says so, the rows
    are the sublayers that read a mix (each block's attention, and the head), a row with no mix says that, not that it reads the
    embedding; their weights are signed (no softmax): a diverging colour scale centred at 0."""
    rows = [{k: v for k, v in r.items() if k != "depth_weights" or r["kind"] != "mlp"} for r in ATTNRES]  # as they log
    rows[2] = {**rows[2], "depth_weights": [-0.2, 0.3, 0.5]}
    fig = plot.main(["weights", write_run(tmp_path, residual, residual, rows), f"--out={tmp_path / 'w.png'}"])
    ax = fig.axes[0]
    assert ax.get_xlabel().startswith("block output mixed (0 = embedding")
    assert [t.get_text() for t in ax.get_yticklabels()] == ["1 attn", "3 attn", "5 head"]
    got = np.ma.filled(ax.images[0].get_array().astype(float), np.nan)
    np.testing.assert_array_equal(got[1:, :3], [[-0.2, 0.3, 0.5], [0.3, 0.1, 0.2]])
    notes = [(t.get_position()[1], t.get_text()) for t in ax.texts if "mix" in t.get_text()]
    assert notes == [(0, "no mix before it")]
    norm = ax.images[0].norm
    assert norm.vmin == -norm.vmax == -0.5 and ax.images[0].get_cmap().name == "RdBu_r"


def test_weights_of_attnres_keep_a_linear_scale_from_zero(runs, tmp_path):
    im = plot.main(["weights", runs["attnres"], f"--out={tmp_path / 'w.png'}"]).axes[0].images[0]
    assert im.norm.vmin == 0 and type(im.norm).__name__ == "Normalize"


def test_weights_errors(runs, tmp_path):
    out = tmp_path / "weights.png"
    with pytest.raises(ConfigError, match="no depth weights.*prenorm"):
        plot.main(["weights", runs["prenorm"], f"--out={out}"])
    with pytest.raises(ConfigError, match="no log at"):
        plot.main(["weights", str(tmp_path / "missing"), f"--out={out}"])
    assert not out.exists()


def test_loss(runs, tmp_path):
    out = tmp_path / "loss.png"
    fig = plot.main(["loss", runs["nag"], runs["prenorm"], f"--out={out}"])
    assert_png(out)
    ax = fig.axes[0]
    val, train = ax.lines[:2]
    # iteration 0 (the untrained loss, 4.3) is left out, so the y range is the one the runs differ in
    assert list(val.get_xdata()) == [10, 20] and list(val.get_ydata()) == [3.2, 2.7]
    assert list(train.get_ydata()) == [3.1, 2.5] and train.get_linestyle() == "--"
    assert val.get_color() == train.get_color() and ax.get_ylim()[1] < 4.2
    assert len(ax.lines) == 4  # val and train for each of the two runs
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["nag, 4 sublayers", "prenorm, 4 sublayers"]
    assert "solid: val, dashed: train" in ax.get_ylabel()  # what the one entry per run leaves out


def test_a_figure_that_cannot_be_written_says_where_to_write_it(runs, monkeypatch):
    """A read-only run folder (root writes anywhere, so the write is made to fail): one line naming the file and
    --out, not a traceback."""
    import matplotlib.figure

    def read_only(self, path, **kw):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", read_only)
    with pytest.raises(ConfigError, match=r"cannot write .*loss.png \(Permission denied\): pass --out=PATH "
                                          r"somewhere writable \(e.g. --out=/tmp/loss.png\)"):
        plot.main(["loss", runs["nag"]])


def test_table(runs, tmp_path):
    out = tmp_path / "table.md"
    text = plot.main(["table", runs["nag"], runs["prenorm"], f"--out={out}"])
    assert out.read_text().strip() == text
    rows = [line.split("|")[1:-1] for line in text.splitlines()[2:]]
    nag, prenorm = ([c.strip() for c in row] for row in rows)
    # final and best val from the log; stream growth = head RMS / first sublayer RMS of the last eval
    assert nag[:6] == ["nag", "nag", "4", "2.7000", "2.7000", "4.00"]
    assert prenorm[5] == f"{0.6 / 0.1:.2f}"
    assert nag[6] == f"{4.0 / 2.0:.2f}" and prenorm[6] == f"{0.6 / 0.3:.2f}"  # growth after the first block
    assert nag[7] == f"{(0.1 + 0.2 + 0.3 + 0.4) / 4:.3f}, 1 of 4" and prenorm[7] == "–"  # nag's gate health


def test_the_later_record_of_a_repeated_iter_wins(tmp_path):
    """A run resumed from an older checkpoint logs some iters again: the later record of each iter is the
    one load_log returns, and the one the loss curve, the table (final and best val, stream growth) and the
    depth plot show. The earlier records here have lower losses and another head RMS, so they would show."""
    stale = [{**r, "rms": r["rms"] * (3 if r["kind"] == "head" else 1)} for r in PRENORM]
    first = [(0, 4.2, 4.3, None), (10, 3.1, 3.2, None), (20, 2.0, 2.1, stale), (30, 1.8, 1.9, stale)]
    again = [(10, 3.0, 3.3, None), (20, 2.6, 2.8, PRENORM), (30, 2.4, 2.6, PRENORM)]  # resumed at 10
    d = tmp_path / "resumed"
    d.mkdir()
    (d / "log.jsonl").write_text("".join(
        json.dumps({"iter": i, "train_loss": t, "val_loss": v, "residual": "prenorm",
                    **({"diagnostics": diag} if diag else {})}) + "\n" for i, t, v, diag in first + again))
    latest = {i: (t, v, diag) for i, t, v, diag in first + again}  # later lines overwrite earlier ones
    recs = run_config.load_log(str(d))
    assert [r["iter"] for r in recs] == sorted(latest)
    assert [(r["train_loss"], r["val_loss"], r.get("diagnostics")) for r in recs] == [latest[i] for i in sorted(latest)]
    val, train = plot.main(["loss", str(d), f"--out={tmp_path / 'loss.png'}"]).axes[0].lines[:2]
    assert list(val.get_ydata()) == [v for _, _, v, _ in again]  # iter 0 is left out of the curve
    assert list(train.get_ydata()) == [t for _, t, _, _ in again]
    row = [c.strip() for c in plot.main(["table", str(d)]).splitlines()[2].split("|")[1:-1]]
    final = again[-1][2]  # also the best: the earlier records' lower losses are gone
    assert row[3:6] == [f"{final:.4f}", f"{final:.4f}", f"{PRENORM[-1]['rms'] / PRENORM[0]['rms']:.2f}"], row
    fig = plot.main(["depth", str(d), f"--out={tmp_path / 'depth.png'}"])
    assert list(fig.axes[0].lines[0].get_ydata()) == [r["rms"] for r in PRENORM]


def test_runs_trained_without_diagnose(runs, tmp_path):
    """A log without diagnostics (train.py without --diagnose) still gets its losses in a table, the rest
    –, in the per-run table and in the per-cell one; and its loss curve."""
    log = "".join(json.dumps({"iter": i, "train_loss": t, "val_loss": v, "residual": "sandwich"}) + "\n"
                  for i, t, v in [(0, 4.2, 4.3), (10, 2.9, 3.0), (20, 2.5, 3.1)])
    for seed in (1, 2):
        (tmp_path / f"plain_s{seed}").mkdir()
        (tmp_path / f"plain_s{seed}" / "log.jsonl").write_text(log)
    text = plot.main(["table", runs["nag"], str(tmp_path / "plain_s1"), str(tmp_path / "plain_s2")])
    per_run, per_cell = text.split("Per cell")
    nag, plain = ([c.strip() for c in line.split("|")[1:-1]] for line in per_run.splitlines()[2:4])
    assert plain == ["plain_s1", "sandwich", "–", "3.1000", "3.0000", "–", "–", "–"]  # val losses from the log
    assert nag[3:6] == ["2.7000", "2.7000", "4.00"]
    cell = [c.strip() for c in per_cell.strip().splitlines()[-1].split("|")[1:-1]]
    assert cell == ["plain", "2", "3.1000 ± 0.0000", "3.0000 ± 0.0000", "–", "–", "–", "plain", *["–"] * 7]
    fig = plot.main(["loss", str(tmp_path / "plain_s1"), runs["nag"], f"--out={tmp_path / 'loss.png'}"])
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["plain_s1", "nag"]  # the dir names


def test_table_per_cell_over_seeds(tmp_path):
    """Runs named <cell>_s<seed> (flops.py sweep's names) get a second table, one row per cell with two or
    more seeds: mean ± sample std of each figure; other runs are in the per-run table only."""
    seed2 = [{**r, "gain": r["gain"] * 2} if "gain" in r else {**r, "rms": 6.0, "dead": 3.0} for r in NAG]
    dirs = [write_run(tmp_path, "nag_L2_s1", "nag", NAG), write_run(tmp_path, "nag_L2_s2", "nag", seed2),
            write_run(tmp_path, "prenorm_L2_s1", "prenorm", PRENORM), write_run(tmp_path, "prenorm", "prenorm", PRENORM)]
    log = tmp_path / "nag_L2_s2" / "log.jsonl"  # seed 2 ends at val 2.5 instead of 2.7
    log.write_text(log.read_text().replace('"val_loss": 2.7', '"val_loss": 2.5'))
    (tmp_path / "results.csv").write_text("run\n")  # a sweep's own files beside its runs are skipped
    text = plot.main(["table", *dirs, str(tmp_path / "results.csv")])
    per_run, per_cell = text.split("Per cell")
    assert len([line for line in per_run.splitlines() if line.startswith("| ") and "---" not in line]) == 1 + 4
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in per_cell.splitlines() if line.startswith("| ")]
    assert [row[0] for row in cells[1:]] == ["nag_L2"]  # prenorm_L2 has one seed, prenorm none
    std = lambda a, b: abs(a - b) / 2 ** 0.5  # noqa: E731  (sample std of two values)
    gain1, gain2 = 0.25, 0.5  # mean |a| of NAG's gains 0.1..0.4, and twice that
    assert cells[1] == ["nag_L2", "2", f"{2.6:.4f} ± {std(2.7, 2.5):.4f}", f"{2.6:.4f} ± {std(2.7, 2.5):.4f}",
                        f"{(4.0 + 6.0) / 2:.2f} ± {std(4.0, 6.0):.2f}", f"{(2.0 + 3.0) / 2:.2f} ± {std(2.0, 3.0):.2f}",
                        f"{(gain1 + gain2) / 2:.3f} ± {std(gain1, gain2):.3f}, {2.0:.1f} ± {std(1.0, 3.0):.1f} of 4",
                        "nag_L2", *["–"] * 7]  # its own baseline: nothing to test


def final_val_runs(root, cells, paces=None):
    """Runs <cell>_s<seed> whose final val losses are given, per cell: {cell: (diagnostics, [losses])};
    paces: {cell: [ms per iteration, per run]}, logged with each of the run's evals."""
    dirs = []
    for cell, (diagnostics, losses) in cells.items():
        for seed, loss in enumerate(losses, 1):
            d = write_run(root, f"{cell}_s{seed}", "nag", diagnostics)
            log = Path(d) / "log.jsonl"
            pace = f', "ms_per_iter": {paces[cell][seed - 1]}' if paces else ""
            log.write_text(log.read_text().replace('"val_loss": 2.7', f'"val_loss": {loss}{pace}'))
            dirs.append(d)
    return dirs


def test_table_tests_each_cell_against_its_baseline(tmp_path):
    """Each cell's final val loss against a baseline cell, by default the first cell of its depth
    (sublayers), else --baseline: the columns are stats.family_cells of the table's pairs of cells, their losses
    by seed (tests/test_stats.py), so a cell compared with the wrong baseline fails."""
    deep = [{"sublayer": l, "kind": "mlp" if l % 2 == 0 else "attn", "rms": 0.1 * l, "update": 0.5}
            for l in range(1, 9)] + [{"sublayer": 9, "kind": "head", "rms": 1.0}]  # 4 layers
    losses = {"a_L2": [2.70, 2.72, 2.71], "b_L2": [2.60, 2.61, 2.63], "c_L4": [2.50, 2.58, 2.52],
              "d_L4": [2.49, 2.53, 2.50]}
    cells = {c: (PRENORM if c.endswith("L2") else deep, v) for c, v in losses.items()}
    paces = {"a_L2": [10, 12, 11], "b_L2": [30, 22, 20], "c_L4": [10, 10, 10], "d_L4": [24, 25, 26]}  # medians 11, 22, 10, 25
    dirs = final_val_runs(tmp_path, cells, paces)

    def rows(*options):
        text = plot.main(["table", *dirs, *options])
        per_cell = text.split("Per cell")[1]
        return {r[0]: r for r in ([c.strip() for c in line.split("|")[1:-1]] for line in per_cell.splitlines()
                                  if line.startswith("| ") and "---" not in line)}
    seeded = {c: dict(enumerate(v, 1)) for c, v in losses.items()}
    family = lambda *pairs: stats.family_cells([(seeded[c], seeded[b]) for c, b in pairs])[0]  # noqa: E731
    got = rows()
    assert got["a_L2"][7:] == ["a_L2", *["–"] * 7] and got["c_L4"][7:] == ["c_L4", *["–"] * 7]
    want = family(("b_L2", "a_L2"), ("d_L4", "c_L4"))
    assert got["b_L2"][7:] == ["a_L2", *want[0], "2.00x"]
    assert got["d_L4"][7:] == ["c_L4", *want[1], "2.50x"]
    assert got["b_L2"][10] == "paired t (3)"
    assert got["b_L2"][12].endswith(" *") and got["b_L2"][13] == "significant"  # 0.1 apart, sd of diffs ~0.015
    assert not got["d_L4"][12].endswith(" *")  # 0.027 apart, sd of diffs ~0.02: not at 3 seeds
    got = rows("--baseline=b_L2")
    assert got["d_L4"][7:] == ["b_L2", *family(("a_L2", "b_L2"), ("c_L4", "b_L2"), ("d_L4", "b_L2"))[2], "1.14x"]
    with pytest.raises(ConfigError, match="--baseline=e_L2 is not a cell"):
        plot.main(["table", *dirs, "--baseline=e_L2"])


def test_command_line_errors(runs, tmp_path):
    """The configurator's rules: the command first, then out_dirs, then known --key=value options."""
    with pytest.raises(ConfigError, match="first argument is the command"):
        plot.main(["lose", runs["nag"]])
    with pytest.raises(ConfigError, match="unknown config key 'itr'"):
        plot.main(["depth", runs["nag"], "--itr=10"])
    with pytest.raises(ConfigError, match="--iter applies to depth and weights"):
        plot.main(["loss", runs["nag"], "--iter=10"])
    with pytest.raises(ConfigError, match="weights takes one out_dir, got 2"):
        plot.main(["weights", runs["attnres"], runs["nag"]])
    assert not list(tmp_path.glob("*.png"))


def test_a_log_that_is_not_a_train_py_log_is_a_one_line_error(runs, tmp_path):
    """`plot.py loss` on a log.jsonl that is not UTF-8 gave a traceback: a log of which not one line is a JSON
    record (a UTF-16 copy, a binary file) is a one-line error naming it, for every command that reads logs; one
    bad line among good ones (a line cut mid-character) is skipped with a warning, as a line cut mid-write is."""
    log = (Path(runs["nag"]) / "log.jsonl").read_text()
    for name, data in (("utf16", log.encode("utf-16")), ("binary", bytes(range(256)) * 4),
                       ("records", b'[1, 2]\n"text"\n{"val_loss": 2.0}\n')):
        d = tmp_path / name
        d.mkdir()
        (d / "log.jsonl").write_bytes(data)
        for cmd in ("loss", "depth", "table"):
            with pytest.raises(ConfigError, match=f"^{d / 'log.jsonl'} is not a train.py log .*: pass the") as e:
                plot.main([cmd, str(d), f"--out={tmp_path / 'x.png'}"])
            assert "\n" not in str(e.value)
    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / "log.jsonl").write_bytes(log.encode() + '{"iter": 30, "val_loss": "\u00e9'.encode()[:-1] + b"\n")
    assert [r["iter"] for r in run_config.load_log(torn)] == [0, 10, 20]
    assert not list(tmp_path.glob("*.png"))


@pytest.mark.parametrize("cmd", ["loss", "depth", "weights"])
def test_a_figure_format_matplotlib_cannot_write_is_a_one_line_error(runs, tmp_path, cmd):
    """`plot.py loss ... --out=x.xyz` drew the figure, then savefig's traceback: the format is checked before
    anything is drawn, and the error lists the formats matplotlib writes."""
    formats = plt_formats()
    assert {"png", "pdf", "svg"} <= set(formats)
    for out in ("x.xyz", "x"):
        with pytest.raises(ConfigError) as e:
            plot.main([cmd, runs["attnres"], f"--out={tmp_path / out}"])
        assert str(e.value) == (f"--out={tmp_path / out}: end the name with a format matplotlib writes "
                                f"({', '.join(sorted(formats))}), e.g. --out={cmd}.png")
    assert not [p for p in tmp_path.iterdir() if p.is_file()]
    fig = plot.main([cmd, runs["attnres"], f"--out={tmp_path / 'x.SVG'}"])  # any case
    assert (tmp_path / "x.SVG").read_bytes().lstrip().startswith(b"<?xml") and fig


def plt_formats():
    import matplotlib.figure
    return matplotlib.figure.Figure().canvas.get_supported_filetypes()


# -----------------------------------------------------------------------------
# routing: a tiny MoD checkpoint (tests/tiny_checkpoint.py) run through plot.py routing

@pytest.fixture(scope="module")
def mod_ckpts(data_dir, tmp_path_factory):
    """nag + mod=nag and prenorm + mod=router (one route per block, thresholds) at mod_rate 0.5, and a dense nag."""
    root = tmp_path_factory.mktemp("routing")
    models = {"nag": make_checkpoint(root / "nag", data_dir, steps=30, residual="nag", mod="nag", mod_rate=0.5),
              "router": make_checkpoint(root / "router", data_dir, steps=30, mod="router", mod_rate=0.5,
                                        mod_inference="threshold"),
              "dense": make_checkpoint(root / "dense", data_dir, steps=1, residual="nag")}
    return root, models


def val_batch(data_dir, n=4):
    g = torch.Generator().manual_seed(3)
    return run_config.get_batch(str(data_dir / "shakespeare_char" / "val.bin"), n, BLOCK, g, torch.device("cpu"))[0]


@pytest.mark.parametrize("name", ["nag", "router"])
def test_routing_is_the_eval_rule(mod_ckpts, data_dir, name):
    """GPT.routing: a token ran a routed sublayer exactly where its score reached the threshold tau
    (the eval rule, restated here), the counts are the forward pass's own, and a block's two sublayers
    share the router's route."""
    model = mod_ckpts[1][name]
    idx = val_batch(data_dir)
    ran, score = routing(model, idx)
    assert ran.shape == score.shape == (model.config.n_sublayers, *idx.shape)
    tau = model.mod.tau
    assert torch.isfinite(tau).all()
    for l in range(model.config.n_sublayers):
        assert torch.equal(ran[l], score[l] >= tau[model.mod.unit[l]])
    assert 0 < ran.float().mean() < 1  # some tokens skip, some run
    executed = model(idx, executed=True)[2]  # a plain eval forward runs the same tokens
    assert [int(e) for e in executed] == ran.sum((1, 2)).tolist()
    if name == "nag":  # the score is the tangent a of the stream's direction entering each sublayer
        assert (score >= 0).all() and torch.isfinite(score).all()
    else:
        assert torch.equal(ran[0::2], ran[1::2]) and torch.equal(score[0::2], score[1::2])


def test_routing_plot_and_table(mod_ckpts, data_dir, tmp_path, capsys):
    root, models = mod_ckpts
    out = tmp_path / "routing_nag.png"
    fig = plot.main(["routing", str(root / "nag"), f"--out={out}", "--batches=2"])
    assert out.read_bytes()[:8] == PNG_MAGIC
    table = (tmp_path / "routing_nag.md").read_text()
    assert table.strip() in capsys.readouterr().out
    # the table's total is the skipped share over the same val batches (EVAL_SEED), recounted here
    model, g, ran = models["nag"], torch.Generator().manual_seed(run_config.EVAL_SEED), []
    for _ in range(2):
        X, _ = run_config.get_batch(str(data_dir / "shakespeare_char" / "val.bin"), 4, BLOCK, g, torch.device("cpu"))
        ran.append(routing(model, X)[0])
    assert f"{1 - torch.cat(ran, 1).float().mean().item():.1%} of the routed sublayer passes skipped" in table
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    skipped = [float(line.split("|")[3].strip().rstrip("%")) for line in rows]
    assert rows and skipped == sorted(skipped, reverse=True)  # most skipped first
    # the passage's grid: tokens as labels along x, every sublayer along y
    ax_ran, ax_score = fig.axes[:2]
    assert len(ax_score.get_xticklabels()) == BLOCK and len(ax_ran.get_yticklabels()) == model.config.n_sublayers
    plot.main(["routing", str(root / "router"), f"--out={tmp_path / 'r.png'}", "--text=ROMEO: hi", "--batches=1"])
    assert (tmp_path / "r.png").read_bytes()[:8] == PNG_MAGIC


def test_routing_errors(mod_ckpts, tmp_path):
    root = mod_ckpts[0]
    for argv, match in ((["routing", str(root / "dense")], "routing draws a model trained with --mod=nag"),
                        (["routing", str(root / "nag"), "--text=" + "a" * (BLOCK + 1)], "pass 1 to block_size=32"),
                        (["routing", str(root / "nag"), "--text=€"], "outside the vocabulary"),
                        (["routing", str(root / "nag"), str(root / "router")], "takes one out_dir"),
                        (["routing", str(root / "nag"), "--batches=0"], "positive integer"),
                        (["routing", str(tmp_path)], "no checkpoint at"),
                        (["loss", str(root / "nag"), "--text=hi"], "apply to routing, not loss")):
        with pytest.raises(ConfigError, match=match):
            plot.main(argv)


# -----------------------------------------------------------------------------
# colours, axis labels, where figures go, the baseline rule (shared with flops.py results)

def line_colours(ax):
    """{label: colour} of an axes' labelled lines."""
    from matplotlib.colors import to_rgb
    return {l.get_label(): to_rgb(l.get_color()) for l in ax.lines if not l.get_label().startswith("_")}


def test_each_mode_has_one_colour_in_every_figure(runs, tmp_path):
    """hc and mhc used to take the colour cycle's next colours, prenorm's and sandwich's (and in the stream
    panels the first run's colour whatever its mode): each mode now has its own colour, whatever the order
    of the runs, in every panel of depth and in loss; no two modes share one."""
    mhc, hc = write_run(tmp_path, "mhc", "mhc", MHC), write_run(tmp_path, "hc", "hc", MHC)
    sandwich = write_run(tmp_path, "sandwich", "sandwich", PRENORM)
    order = [mhc, runs["prenorm"], hc, sandwich, runs["nag"]]
    seen = {}
    for dirs in (order, order[::-1]):
        fig = plot.main(["depth", *dirs, f"--out={tmp_path / 'd.png'}"])
        for ax in fig.axes:
            for label, colour in line_colours(ax).items():
                seen.setdefault(label.split(",")[0], set()).add(colour)
        loss = plot.main(["loss", *dirs, f"--out={tmp_path / 'l.png'}"])
        for label, colour in line_colours(loss.axes[0]).items():
            seen.setdefault(label.split(",")[0], set()).add(colour)
    assert set(seen) == {"mhc", "hc", "prenorm", "sandwich", "nag"}
    assert all(len(colours) == 1 for colours in seen.values()), seen  # one colour per mode, everywhere
    assert len({next(iter(c)) for c in seen.values()}) == 5  # and no two modes alike
    from model import RESIDUALS  # every registered mode has a colour of its own
    assert len(set(plot.mode_colours([[{"residual": r}] for r in RESIDUALS]))) == len(RESIDUALS)
    # two runs of one mode: the second is the same hue, lighter
    fig = plot.main(["depth", runs["prenorm"], write_run(tmp_path, "prenorm2", "prenorm", PRENORM), f"--out={tmp_path / 'p.png'}"])
    first, second = (tuple(l.get_color()) for l in fig.axes[0].lines)
    assert first != second and all(b >= a for a, b in zip(first, second))


def test_only_panels_with_the_head_say_so(runs, tmp_path):
    """'(last point ...: the head)' labelled every panel; the update panel has no head point (the head makes no
    update): only the panels whose curves end at the head say so."""
    fig = plot.main(["depth", write_run(tmp_path, "mhc", "mhc", MHC), runs["prenorm"], f"--out={tmp_path / 'd.png'}"])
    rms, upd, gain, cos = fig.axes
    assert rms.get_xlabel() == gain.get_xlabel() == cos.get_xlabel() == "sublayer (last point: the head)"
    assert upd.get_xlabel() == "sublayer"


def test_figures_go_beside_their_runs(runs, tmp_path, tmp_path_factory, monkeypatch, capsys):
    """Without --out a figure went to the current folder (the repo root): now one run's goes into its
    out_dir, several runs' into their common folder, or under out/ when that folder holds the current one."""
    elsewhere = tmp_path_factory.mktemp("cwd")
    monkeypatch.chdir(elsewhere)
    plot.main(["weights", runs["attnres"]])
    assert_png(Path(runs["attnres"]) / "weights.png")
    plot.main(["depth", runs["nag"], runs["prenorm"]])
    assert_png(tmp_path / "depth.png")
    assert not list(elsewhere.iterdir())
    monkeypatch.chdir(tmp_path)  # the runs' folder is the current one: under out/
    plot.main(["loss", runs["nag"], runs["prenorm"]])
    assert_png(tmp_path / "out" / "loss.png")
    assert capsys.readouterr().out.splitlines()[-1] == os.path.join("out", "loss.png")
    assert (Path(REPO) / ".gitignore").read_text().splitlines().count("wandb/") == 1  # W&B's folder is not committed


def test_routing_table_goes_beside_its_run(mod_ckpts, tmp_path_factory, monkeypatch):
    root = mod_ckpts[0]
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))
    plot.main(["routing", str(root / "nag"), "--batches=1"])
    assert_png(root / "nag" / "routing.png")
    assert (root / "nag" / "routing.md").read_text().startswith("Over 1 val batches")


def test_table_and_flops_results_pick_the_same_baseline(tmp_path, capsys):
    """plot.py table took the alphabetically first cell of a depth as the baseline (attnres here), while
    flops.py results took the sweep's first (prenorm): both now take prenorm where there is one (a MoD
    prenorm cell is not the reference), else the depth's first cell."""
    import csv

    import flops
    losses = {"attnres_L2": [2.60, 2.62, 2.61], "nag_L2": [2.50, 2.52, 2.55], "prenorm_L2": [2.70, 2.69, 2.72],
              "prenorm_L2_router0.25": [2.65, 2.66, 2.60]}
    dirs = []
    for cell, vals in losses.items():
        for seed, v in enumerate(vals, 1):
            d = write_run(tmp_path, f"{cell}_s{seed}", cell.split("_")[0], PRENORM)
            log = Path(d) / "log.jsonl"
            mod = ', "exec_train": [1.0, 0.75, 1.0, 0.75]' if "router" in cell else ""
            log.write_text(log.read_text().replace('"val_loss": 2.7', f'"val_loss": {v}{mod}'))
            dirs.append(d)
    text = plot.main(["table", *sorted(dirs)])
    per_cell = [[c.strip() for c in line.split("|")[1:-1]] for line in text.split("Per cell")[1].splitlines()
                if line.startswith("| ") and "---" not in line][1:]
    assert {row[0]: row[7] for row in per_cell} == dict.fromkeys(losses, "prenorm_L2")
    path = tmp_path / "results.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, flops.FIELDS)
        w.writeheader()
        for cell in sorted(losses):
            for seed, v in enumerate(losses[cell], 1):
                router = "router" in cell
                w.writerow({"run": f"{cell}_s{seed}", "cell": cell, "seed": seed, "residual": cell.split("_")[0],
                            "n_layer": 2, "mod": "router" if router else "", "mod_rate": 0.25 if router else 0.0,
                            "args": "", "status": "done", "iters": 10, "val_loss": v, "seconds": 1.0})
    text = flops.main(["results", str(path)])
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in
            text.split("against a baseline cell")[1].split("Every run")[0].splitlines() if line.startswith("| ")]
    rows = [row for row in rows if row[0] in losses]
    assert {row[0]: row[1] for row in rows} == {c: "prenorm_L2" for c in losses if c != "prenorm_L2"}
    want = stats.family_cells([(dict(enumerate(losses[row[0]], 1)), dict(enumerate(losses["prenorm_L2"], 1)))
                               for row in rows])[0]
    plot_rows = {row[0]: row for row in per_cell}
    for row, cells in zip(rows, want):  # the same test of the same losses, the same family, in both tables
        assert row[2:8] == cells == plot_rows[row[0]][8:14]
