"""No stale figure in the README's Results: every decimal figure a row quotes is printed by the `python flops.py`
command(s) beside it, run here on the committed CSVs. A row whose figures come from a timing measurement
(bench.py), which a test cannot rerun, is listed in MEASURED by its first words, so that a new row cannot slip
past unchecked."""

import contextlib
import functools
import io
import os
import re
import shlex
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import SHAKESPEARE_TEXT

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
import flops  # noqa: E402

MEASURED = (  # rows quoting bench.py timings (or a look at routing): their figures come from runs, not from CSVs
    "the quickstart against nanoGPT itself",
    "MoD saves time when sampling",
    "what the designs cost on this CPU",
)
FIGURE = re.compile(r"(?<![\w.])[+\-−]?(\d+\.\d+)x?(?![\w.])")  # a decimal figure, its sign and an "x" dropped


def results_rows(readme):
    """(question, result, command) of each row of the README's Results table."""
    section = readme.split("\n## Results\n", 1)[1].split("\n### ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if line.startswith("| ") and len(cells) == 4 and cells[0] not in ("question",) and not cells[0].startswith("---"):
            rows.append(tuple(cells[:3]))
    return rows


@functools.lru_cache(maxsize=None)
def shakespeare_split(name):
    """data/shakespeare_char/<name> (val.bin), prepared from the exact text (conftest's) into a temporary folder:
    a fresh checkout has no .bin files until a run prepares them."""
    from data.shakespeare_char.prepare import prepare
    out = Path(tempfile.mkdtemp(prefix="claims_data_")) / "shakespeare_char"
    prepare(out_dir=str(out), input_path=str(SHAKESPEARE_TEXT))
    return str(out / name)


@functools.lru_cache(maxsize=None)
def printed(command):
    """What `python flops.py ...` prints, run in this process on the committed files (and the Shakespeare val
    split, prepared, where a command names it)."""
    argv = shlex.split(command)[2:]
    argv = [str(REPO / a) if a.startswith("results/") else a for a in argv]
    argv = [f"--val_bin={shakespeare_split(os.path.basename(a))}" if a.startswith("--val_bin=data/shakespeare_char/")
            else a for a in argv]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        flops.main(argv + (["--out=" + str(REPO / "out" / "claims_check.png")] if argv[0] == "multiplier" else []))
    return out.getvalue()


def not_in(result, text):
    """The decimal figures of `result` that `text` does not hold (as printed: same digits, any sign)."""
    return [m[1] for m in FIGURE.finditer(result)
            if not re.search(rf"(?<![\d.]){re.escape(m[1])}(?![\d])", text)]


def stale(result, commands):
    """The decimal figures of `result` that none of the commands prints."""
    return not_in(result, "\n".join(printed(c) for c in commands))


def measured_rows(readme):
    """(question, result, output files) of the MEASURED rows that name their committed output (results/*.txt)."""
    return [(q, r, re.findall(r"results/[\w.-]+\.txt", c)) for q, r, c in results_rows(readme)
            if q.startswith(MEASURED) and re.search(r"results/[\w.-]+\.txt", c)]


def checked_rows(readme):
    return [(q, r, re.findall(r"`(python flops\.py [^`]+)`", c)) for q, r, c in results_rows(readme)
            if not q.startswith(MEASURED)]


README = (REPO / "README.md").read_text()


def test_every_results_row_is_checked_or_named_as_measured():
    """Each Results row either names the flops.py command(s) that print its figures, or is one of MEASURED."""
    rows = results_rows(README)
    assert len(rows) >= 10
    for q, r, commands in checked_rows(README):
        assert commands, f"the Results row {q[:60]!r} names no python flops.py command that prints its figures"
    for prefix in MEASURED:
        assert any(q.startswith(prefix) for q, _, _ in rows), f"MEASURED names a row the README no longer has: {prefix}"


@pytest.mark.parametrize("question", [q[:50] for q, _, _ in checked_rows(README)])
def test_every_figure_of_a_row_is_what_its_command_prints(question):
    (row,) = [(r, c) for q, r, c in checked_rows(README) if q.startswith(question)]
    missing = stale(*row)
    assert not missing, f"Results row {question!r}: {missing} not printed by {row[1]}"


def test_a_changed_figure_is_caught():
    """One quoted figure changed in a copy of the README (the router row's loss, 1.8409 -> 1.8419): the check fails
    on that row and on that figure alone."""
    changed = README.replace("1.8409 against 1.9024", "1.8419 against 1.9024")
    assert changed != README
    bad = {q[:30]: stale(r, c) for q, r, c in checked_rows(changed)}
    assert [(q, v) for q, v in bad.items() if v] == [("`mod=router` on prenorm at equ", ["1.8419"])]


def test_a_measured_rows_figures_are_in_its_committed_output():
    """A timing row that names its output (the quickstart against nanoGPT: results/quickstart_nanogpt_cpu*.txt, what
    bench.py printed) quotes only figures that output holds, each machine's from its own: the figures before
    "On the earlier sessions' machine" from the first file the row names, those after it from the second. A figure
    changed in a copy of the README is caught, and so is the earlier machine's ratio quoted as this one's."""
    def misquoted(result, files):
        this, earlier = result.split(EARLIER)
        return not_in(this, (REPO / files[0]).read_text()) + not_in(earlier, (REPO / files[1]).read_text())

    rows = measured_rows(README)
    assert [q[:37] for q, _, _ in rows] == ["the quickstart against nanoGPT itself"]
    for q, r, files in rows:
        assert len(files) == 2 and r.count(EARLIER) == 1, files  # this machine's run, and the earlier machine's
        missing = misquoted(r, files)
        assert not missing, f"Results row {q[:40]!r} quotes {missing}, which {files} do not hold"
    for old, new, caught in (("in 6.0 s, **0.26x**", "in 6.0 s, **0.29x**", ["0.29"]),
                             ("**0.68x** nanoGPT's", "**0.90x** nanoGPT's", ["0.90"])):
        changed = README.replace(old, new)
        assert changed != README
        (q, r, files), = measured_rows(changed)
        assert misquoted(r, files) == caught


EARLIER = "On the earlier sessions' machine"


def epyc_steps():
    """{(side, design): [its step / prenorm's, per run]} from results/model16_epyc_gradient_slots.txt, the 12
    bench outputs (before and after the gradient slots, 6 runs each) that docs/kernels.md's EPYC table reads."""
    steps, side = {}, None
    for line in (REPO / "results" / "model16_epyc_gradient_slots.txt").read_text().splitlines():
        head = re.match(r"# ==== (before|after), run \d", line)
        side = head[1] if head else side
        row = re.match(r"\| (.+?) \| [\d.]+ \| ([\d.]+)x \| n/a", line)  # the step table, not the fit's
        if row:
            steps.setdefault((side, row[1]), []).append(float(row[2]))
    return steps


def test_the_epyc_step_table_is_the_median_and_range_of_its_runs():
    """docs/kernels.md's table of the designs' steps on the EPYC, before and after the gradient slots: each
    cell is the median (range) of the committed runs; a changed figure is caught."""
    import statistics
    steps = epyc_steps()
    assert {len(v) for v in steps.values()} == {6}
    section = (REPO / "docs" / "kernels.md").read_text().split("**On an AMD EPYC, with the gradient slots.**")[1]
    section = section.split("\nPaired by run")[0]
    names = {"value_residual (learned)": "prenorm (value_residual=learned)",
             "mhc_lite (`mhc_res=birkhoff`)": "mhc (mhc_res=birkhoff)"}

    def cell(side, design):
        x = steps[(side, design)]
        return f"{statistics.median(x):.2f}x ({min(x):.2f}-{max(x):.2f})"

    def misquoted(text):
        rows = re.findall(r"^\| ([^|]+?) \| [\d.]+x \| ([^|]+?) \| ([^|]+?) \|", text, re.M)
        assert len(rows) == 7, rows
        return [d for d, before, after in rows if before != cell("before", names.get(d, d))
                or after.replace("**", "") != cell("after", names.get(d, d))]
    assert misquoted(section) == []
    assert misquoted(section.replace("**1.48x** (1.40-1.50)", "**1.40x** (1.40-1.50)")) == ["attnres"]
    # the paired reading below it: each run's after over the before of the same run, geometric mean, t-interval
    import math
    import stats
    paired = (REPO / "docs" / "kernels.md").read_text().split("\nPaired by run")[1].split("\n\n")[0]
    d = [math.log(a / b) for a, b in zip(steps[("after", "attnres")], steps[("before", "attnres")])]
    mean, sd = stats.mean_std(d)
    (lo, hi), p = stats.t_test(mean, sd / len(d) ** 0.5, len(d) - 1)
    quoted = f"attnres **{math.exp(mean):.2f}x** ({math.exp(lo):.2f}-{math.exp(hi):.2f}, p {p:.2g}; Holm over the"
    assert quoted in " ".join(paired.split()), quoted
    assert f"four designs the slots touch, attnres, block_attnres, dwa and mudd: {min(1, 4 * p):.2f})" in " ".join(paired.split())
    # and the README's sentence of it
    med = {design: statistics.median(steps[("after", design)]) for _, design in steps}
    readme = (f"the gradient slots take attnres from {statistics.median(steps[('before', 'attnres')]):.2f}x to "
              f"{med['attnres']:.2f}x (paired {math.exp(mean):.2f}x, p {p:.2g}, Holm {min(1, 4 * p):.2f} over the 4 designs "
              f"they touch: not significant after adjustment) and attnres's bytes per step")
    assert readme in README, readme
    others = ", ".join(f"{name} {med[names.get(name, name)]:.2f}x" for name in
                       ("mudd", "block_attnres", "dwa", "mhc", "mhc_lite (`mhc_res=birkhoff`)"))
    assert others.replace(" (`mhc_res=birkhoff`)", "") in README, others


def test_the_depth_tables_figures_are_what_the_multiplier_command_prints():
    """The README's "Compute multipliers by depth" section: every decimal figure is printed by its command."""
    section = README.split("\n### Compute multipliers by depth\n", 1)[1].split("```bash", 1)[0]
    command = ("python flops.py multiplier results/sweep_depth_multiplier_cpu.csv --step_times=results/step_times_cpu_1.csv,"
               "results/step_times_cpu_2.csv,results/step_times_cpu_3.csv --val_bin=data/shakespeare_char/val.bin")
    assert command in README.split("\n### Compute multipliers by depth\n", 1)[1]
    missing = stale(section, [command])
    assert not missing, f"the depth section quotes {missing}, not printed by {command}"


def test_the_zero_layer_bound_quoted_is_the_eval_tokens_conditional_entropy():
    """docs/flops.md quotes the 0-layer bound on the Shakespeare eval tokens (the 111,360 every depth-grid run
    scored): it is multiplier.bigram_floor's, to the digits quoted."""
    import multiplier
    quoted = re.search(r"on the Shakespeare eval tokens (\d\.\d+)\s+nats", (REPO / "docs" / "flops.md").read_text())
    assert quoted, "docs/flops.md no longer quotes the 0-layer bound"
    bound = multiplier.bigram_floor(shakespeare_split("val.bin"), 111_360)
    assert f"{bound:.4f}" == quoted[1]


EXPERIMENTS = (REPO / "docs" / "experiments.md").read_text()
MEASURED_CLAIMS = (  # claims rows quoting runs' diagnostics or timings (plot.py, bench.py), not a CSV's tables
    "mHC: beats HC",
    "NAG: its routing is interpretable",
    "MoD saves compute when sampling",
)


def claims_rows():
    """(claim, here, [the commands in its evidence cell, and those of the README Results rows that link the same
    sections]) of each row of docs/experiments.md's claims table ("What the results say")."""
    section = EXPERIMENTS.split("\n## What the results say\n", 1)[1].split("\n## ", 1)[0]
    readme = [(r, d, re.findall(r"`(python flops\.py [^`]+)`", c)) for line in
              README.split("\n## Results\n", 1)[1].split("\n### ", 1)[0].splitlines() if line.startswith("| ")
              for q, r, c, d in [([x.strip() for x in line.strip().strip("|").split(" | ")] + [""] * 4)[:4]]]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if line.startswith("| ") and len(cells) == 3 and cells[0] != "claim (paper)" and not cells[0].startswith("---"):
            anchors = re.findall(r"\(#([\w-]+)\)", cells[2])
            commands = re.findall(r"`(python flops\.py [^`]+)`", cells[2])
            commands += [c for _, d, cs in readme if any(f"experiments.md#{a})" in d for a in anchors) for c in cs]
            rows.append((cells[0], cells[1], commands))
    return rows


def test_every_claims_row_is_checked_or_named_as_measured():
    rows = claims_rows()
    assert len(rows) >= 10
    for prefix in MEASURED_CLAIMS:
        assert any(c.startswith(prefix) for c, _, _ in rows), f"MEASURED_CLAIMS names a row that is gone: {prefix}"
    for claim, _, commands in rows:
        assert commands or claim.startswith(MEASURED_CLAIMS), \
            f"the claims row {claim[:50]!r} links no section that a README Results row's command prints"


@pytest.mark.parametrize("claim", [c[:40] for c, _, _ in claims_rows() if not c.startswith(MEASURED_CLAIMS)])
def test_every_figure_of_a_claims_row_is_what_its_commands_print(claim):
    """docs/experiments.md's claims table: each row's decimal figures are printed by the commands of the README
    Results rows that link the same sections (the same evidence)."""
    (here, commands), = [(h, c) for q, h, c in claims_rows() if q.startswith(claim)]
    missing = stale(here, commands)
    assert not missing, f"claims row {claim!r}: {missing} not printed by {commands}"


def test_a_changed_claims_figure_is_caught():
    """One figure of the claims table changed (skip-middle's 1.8326 -> 1.8336): that row's check fails on it alone."""
    (here, commands), = [(h, c) for q, h, c in claims_rows() if q.startswith("skip-middle")]
    assert "1.8326" in here and not stale(here, commands)
    assert stale(here.replace("1.8326", "1.8336"), commands) == ["1.8336"]
