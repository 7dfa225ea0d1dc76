"""configurator.py: --help lists every key of every script with its default and its comment; the
errors a newcomer hits (a key without --, a comma list) name the fix. (Types and config files: test_train.py.)"""
import re

import pytest

import bench
import flops
import plot
import run_config
import sample
import tradeoff
import train
from configurator import ConfigError, configure, key_comments

# (what is run, the defaults its --help must list); the scripts' own entry points, in-process
SCRIPTS = {
    "train": (lambda: train.main(["--help"]), run_config.DEFAULTS),
    "sample": (lambda: sample.main(["--help"]), sample.DEFAULTS),
    "tradeoff": (lambda: tradeoff.main(["-h"]), tradeoff.DEFAULTS),
    "plot": (lambda: plot.main(["--help"]), plot.DEFAULTS),
    "bench": (lambda: bench.main(["--help"]), bench.DEFAULTS),
    "bench baseline": (lambda: bench.baseline_train(["--help"]), run_config.DEFAULTS),
    "flops": (lambda: flops.main(["--help"]), {**run_config.DEFAULTS, "budget": None}),
    "flops sweep": (lambda: flops.main(["sweep", "--help"]), flops.SWEEP_DEFAULTS),
}


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_lists_every_key_with_its_default_and_comment(script, capsys):
    run, defaults = SCRIPTS[script]
    with pytest.raises(SystemExit) as e:
        run()
    assert e.value.code in (0, None)  # exit status 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("  ") and not line.startswith("   ")]
    assert len(lines) == len(defaults)  # one line per key, no other key
    for key, value in defaults.items():
        # the key, its default as Python writes it, then its comment (not empty)
        assert any(re.match(rf"  {key} +{re.escape(repr(value))}  +\S", line) for line in lines), (key, out)
    if script == "plot":  # plot's first argument is a command: --help names them too
        assert all(cmd in out for cmd in plot.COMMANDS)


def test_help_comes_from_the_comments_beside_the_defaults(tmp_path, capsys):
    """key_comments reads a key's comment from its own line, in the dict or class named: a heading above
    a key, a '#' inside a string and another dict's same key are not comments on it."""
    source = tmp_path / "defs.py"
    source.write_text('DEFAULTS = dict(\n'
                      '    # I/O: a heading, not out_dir\'s comment\n'
                      '    out_dir="out#1",\n'
                      '    skip_rates=[0.1,\n'
                      '                0.2],  # where a value ends\n'
                      ')\n'
                      'class Config:\n'
                      '    n_layer: int = 12  # layers\n'
                      'OTHER = dict(n_layer=2)  # another dict\n')
    sources = [(str(source), "DEFAULTS"), (str(source), "Config")]
    assert key_comments(sources) == {"skip_rates": "where a value ends", "n_layer": "layers"}
    with pytest.raises(SystemExit):  # --help wins over anything else on the command line
        configure(["missing.py", "--nope=1", "-h"], {"out_dir": "out#1", "n_layer": 12}, sources)
    assert capsys.readouterr().out.splitlines()[1:] == ["  out_dir  'out#1'", "  n_layer  12       layers"]


def test_a_key_without_dashes_names_the_fix():
    with pytest.raises(ConfigError, match=r"^config file 'n_layer=8' not found; did you mean --n_layer=8\?$"):
        configure(["n_layer=8"], {"n_layer": 12})
    with pytest.raises(ConfigError, match="cannot read config file 'missing.py'"):
        configure(["missing.py"], {"n_layer": 12})  # a file name with no '=' is a missing file


def test_a_comma_list_sets_a_list_key(tmp_path):
    """--skip_rates=0.1,0.2 is a tuple to Python: a list key takes it as a list (on the command line and in a file)."""
    cfg = configure(["--skip_rates=0.1,0.2"], tradeoff.DEFAULTS)
    assert cfg["skip_rates"] == [0.1, 0.2] and type(cfg["skip_rates"]) is list
    assert tradeoff.check(cfg)[0] == [0.1, 0.2]
    path = tmp_path / "c.py"
    path.write_text("skip_rates = 0.3, 0.4\n")
    assert configure([str(path)], tradeoff.DEFAULTS)["skip_rates"] == [0.3, 0.4]
    with pytest.raises(ConfigError, match=r"expects list, got float 0\.1 \(a list: --skip_rates=\[a,b\] or"):
        configure(["--skip_rates=0.1"], tradeoff.DEFAULTS)


def test_a_list_of_bare_words(tmp_path):
    """--residuals=prenorm,nag (and [prenorm,nag], which a shell leaves of ['prenorm','nag']) is a list of
    strings, as the list hint says; a number in it stays a number."""
    defaults = dict(residuals=["prenorm"], depths=[2])
    for arg in ("--residuals=prenorm,nag", "--residuals=[prenorm,nag]", "--residuals=['prenorm','nag']"):
        assert configure([arg], defaults)["residuals"] == ["prenorm", "nag"], arg
    assert configure(["--residuals=nag"], defaults)["residuals"] == ["nag"]
    assert configure(["--depths=[4,8]"], defaults)["depths"] == [4, 8]
