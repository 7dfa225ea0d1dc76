"""No stale figure in the README's Results: every decimal figure a row quotes is printed by the `python flops.py`
command(s) beside it, run here on the committed CSVs. A row whose figures come from a timing measurement
(bench.py), which a test cannot rerun, is listed in MEASURED by its first words, so that a new row cannot slip
past unchecked."""

import contextlib
import functools
import io
import re
import shlex
import sys
from pathlib import Path

import pytest

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
def printed(command):
    """What `python flops.py ...` prints, run in this process on the committed files."""
    argv = shlex.split(command)[2:]
    argv = [str(REPO / a) if a.startswith("docs/") else a for a in argv]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        flops.main(argv + (["--out=" + str(REPO / "out" / "claims_check.png")] if argv[0] == "multiplier" else []))
    return out.getvalue()


def stale(result, commands):
    """The decimal figures of `result` that none of the commands prints (as printed: same digits, any sign)."""
    text = "\n".join(printed(c) for c in commands)
    return [m[1] for m in FIGURE.finditer(result)
            if not re.search(rf"(?<![\d.]){re.escape(m[1])}(?![\d])", text)]


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


def test_the_depth_tables_figures_are_what_the_multiplier_command_prints():
    """The README's "Compute multipliers by depth" section: every decimal figure is printed by its command."""
    section = README.split("\n### Compute multipliers by depth\n", 1)[1].split("```bash", 1)[0]
    command = "python flops.py multiplier docs/sweep_depth_multiplier_cpu.csv --step_times=docs/step_times_cpu.csv"
    assert command in README.split("\n### Compute multipliers by depth\n", 1)[1]
    missing = stale(section, [command])
    assert not missing, f"the depth section quotes {missing}, not printed by {command}"
