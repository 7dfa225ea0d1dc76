"""The README's commands as a newcomer runs them, line by line from its ```bash blocks: the first two
commands are the quickstart and the tests, each after the install. With the docs/*.md pages the README
links to (the experiments, the modes' options, ...), their commands are one set: every training command
writes its own out_dir (a second one there would clobber the first's checkpoint and log), and every
out_dir that a command reads is one that a command of the README or the docs creates."""
import os
import re
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import flops  # noqa: E402
import run_config  # noqa: E402
from configurator import configure  # noqa: E402

INSTALL = ["pip", "install", "-r", "requirements.txt"]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))


def braces(word):
    """bash's {a,b} expansion (one group): out/{x,y}_s1 -> out/x_s1, out/y_s1."""
    m = re.match(r"(.*?)\{([^{}]*,[^{}]*)\}(.*)", word)
    return [m[1] + part + m[3] for part in m[2].split(",")] if m else [word]


def readme_lines(files=(README,)):
    """Each command line of the files' ```bash blocks, as its commands (split at &&), each a list of
    words: continuation lines joined, comments dropped, a block's variables (c="...", then $c) and {a,b}
    expanded, a leading VAR=value (the environment, e.g. OMP_NUM_THREADS=1) dropped."""
    lines = []
    blocks = [b for f in files for b in re.findall(r"```bash\n(.*?)```", f.read_text(), re.S)]
    for block in blocks:
        variables = {}
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\$(\w+)", lambda m: variables[m[1]], line)  # unquoted: bash splits it into words
            words = [w for word in shlex.split(line, comments=True) for w in braces(word)]
            if words and all(re.match(r"\w+=", w) for w in words):  # c="..." sets a variable, runs nothing
                variables.update(w.split("=", 1) for w in words)
            elif words:
                commands = [[]]
                for w in words:
                    if w == "&&":
                        commands.append([])
                    elif commands[-1] or not re.match(r"\w+=", w):  # a leading VAR=value: the environment
                        commands[-1].append(w)
                lines.append(commands)
    return lines


def script(cmd):
    """(script, its arguments) of `python x.py ...` or `torchrun ... x.py ...`; (None, cmd) otherwise."""
    if cmd[:1] == ["python"] and cmd[1:2] and cmd[1].endswith(".py"):
        return cmd[1], cmd[2:]
    if cmd[:1] == ["torchrun"]:
        i = next(i for i, w in enumerate(cmd) if w.endswith(".py"))
        return cmd[i], cmd[i + 1:]
    return None, cmd


def settings(args, defaults):
    """What the script reads from its command line (the configurator's rules; config files from the repo)."""
    return configure([a if a.startswith("--") else str(REPO / a) for a in args], defaults)


def writes(cmd):
    """(out_dir, settings) of a training command: train.py's out_dir (a config file may set it), a sweep's
    folder out_root/sweep_name (its runs live in it); None for any other command."""
    name, args = script(cmd)
    if name == "train.py":
        cfg = settings(args, run_config.DEFAULTS)
        return os.path.normpath(cfg["out_dir"]), cfg
    if name == "flops.py" and args[:1] == ["sweep"]:
        sw = settings(args[1:], flops.SWEEP_DEFAULTS)
        sw.pop("jobs")  # how many at a time: the same sweep
        return os.path.normpath(os.path.join(sw["out_root"], sw["sweep_name"])), sw
    return None


def reads(cmd):
    """The out_dirs a command reads: the runs plot.py is given, and the --out_dir of sample.py,
    tradeoff.py and bench.py (bench.py's default "": a random model)."""
    name, args = script(cmd)
    if name == "plot.py":
        return [os.path.normpath(a) for a in args[1:] if not a.startswith("--")]
    if name in ("sample.py", "tradeoff.py", "bench.py"):
        module = __import__(name[:-3])
        out_dir = configure(args, module.DEFAULTS)["out_dir"]
        return [os.path.normpath(out_dir)] if out_dir else []
    return []


def test_the_first_commands_install_then_run_the_quickstart_and_the_tests():
    first, second = readme_lines()[:2]
    assert first[0] == INSTALL and script(first[1]) == ("train.py", ["config/shakespeare_char_cpu.py"])
    assert script(first[2])[0] == "sample.py" and reads(first[2]) == [writes(first[1])[0]]  # the run just trained
    assert second == [INSTALL, ["python", "-m", "pytest", "-q"]]


def test_the_docs_have_commands():
    """The pages below are read as the README's continuation: each one that moved commands out of the
    README still has them (a page renamed or its blocks dropped would silently shrink the checks)."""
    for page in ("experiments.md", "modes.md", "kernels.md", "testing.md"):
        assert REPO / "docs" / page in DOCS and readme_lines([REPO / "docs" / page]), page


def test_training_commands_write_their_own_out_dirs():
    """Two training commands share an out_dir (or a sweep's folder) only when one resumes the other or
    they are the same run (a sweep run again skips what it finished)."""
    writers = [w for line in readme_lines([README, *DOCS]) for cmd in line if (w := writes(cmd))]
    assert len(writers) > 10
    for i, (path, cfg) in enumerate(writers):
        for other, other_cfg in writers[:i]:
            if path == other or path.startswith(other + os.sep) or other.startswith(path + os.sep):
                assert "resume" in (cfg.get("init_from"), other_cfg.get("init_from")) or cfg == other_cfg, (
                    f"two commands (README or docs/) train into {path}: give one its own --out_dir")


def test_every_out_dir_read_is_created_by_a_readme_command():
    """sample.py, tradeoff.py, bench.py and plot.py read runs that a command of the README or docs/
    trains: a train.py out_dir, or a run of a sweep (out_root/sweep_name/<cell>_s<seed>; a glob: the
    sweep's folder)."""
    commands = [cmd for line in readme_lines([README, *DOCS]) for cmd in line]
    created, sweeps = set(), set()
    for cmd in commands:
        if writes(cmd) and script(cmd)[0] == "train.py":
            created.add(writes(cmd)[0])
        elif writes(cmd):
            root, sw = writes(cmd)
            sweeps.add(root)
            created |= {os.path.join(root, name) for name, _, _ in flops.sweep_runs(sw)}
    read = [(path, " ".join(cmd)) for cmd in commands for path in reads(cmd)]
    assert len(read) > 10
    for path, cmd in read:
        assert path in created or ("*" in path and os.path.dirname(path) in sweeps), (
            f"`{cmd}` reads {path}, which no command of the README or docs/ creates")


def anchors(path):
    """The #anchors of a Markdown file's headings, as GitHub makes them: lower case, punctuation other than
    - and _ dropped, spaces as -, a repeated heading numbered -1, -2, ... (headings in code blocks skipped)."""
    found, text = set(), re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = 0
        while (slug + (f"-{n}" if n else "")) in found:
            n += 1
        found.add(slug + (f"-{n}" if n else ""))
    return found


def test_every_relative_link_finds_its_file_and_heading():
    """Links and images in the README and docs/*.md, [text](path#anchor): the file exists and, given an
    anchor, has a heading that makes it (a moved or renamed section breaks the links to it)."""
    checked = 0
    for page in [README, *DOCS, *sorted((REPO / "results").glob("*.md"))]:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"\w+://|mailto:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            assert dest.exists(), f"{page.name}: link to {target}, which does not exist"
            if anchor:
                assert anchor in anchors(dest), f"{page.name}: link to {target}, no such heading in {dest.name}"
            checked += 1
    assert checked > 20


def test_the_mod_table_lists_the_residual_modes_each_mod_works_with():
    """README's Mixture-of-Depths table: each MoD mode's "works with" cell names exactly the residual modes
    whose class lists it in `mods` (the registry is the truth; the table used to leave dwa and scalars out)."""
    from model import MODS, RESIDUALS
    section = README.read_text().split("## Mixture-of-Depths", 1)[1].split("\n## ", 1)[0]
    rows = {m[1]: m[2] for m in re.finditer(r"^\| `(\w+)` \| ([^|]*) \|", section, re.M) if m[1] in MODS}
    assert set(rows) == {name for name, cls in MODS.items() if cls is not None}
    for mod, cell in rows.items():
        named = set(re.findall(r"`(?:residual=)?(\w+)`", cell))
        works = {r for r, cls in RESIDUALS.items() if mod in cls.mods}
        assert named & set(RESIDUALS) == works, f"README's {mod} row names {sorted(named)}, the code {sorted(works)}"
