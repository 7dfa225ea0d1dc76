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
    with pytest.raises(ConfigError, match=r"expects list, got bool True \(a list: --skip_rates=\[a,b\] or"):
        configure(["--skip_rates=True"], tradeoff.DEFAULTS)


def test_one_value_for_a_list_key_is_a_list_of_one(tmp_path):
    """--depths=2 is the list [2] (it used to be an error asking for a list), on the command line and in a
    file; a sweep takes it as one depth. A mod_runs entry that is not (residual, mod, mod_rate) is a one-line
    error, not a traceback in the sweep."""
    assert configure(["--depths=2"], flops.SWEEP_DEFAULTS)["depths"] == [2]
    assert configure(["--skip_rates=0.1"], tradeoff.DEFAULTS)["skip_rates"] == [0.1]
    path = tmp_path / "sweep.py"
    path.write_text("depths = 4\nresiduals = 'nag'\n")
    sw = configure([str(path)], flops.SWEEP_DEFAULTS)
    assert (sw["depths"], sw["residuals"]) == ([4], ["nag"])
    assert [name for name, _ in flops.sweep_cells(sw)] == ["nag_L4"]
    with pytest.raises(ConfigError, match=r"each entry of mod_runs must be \(residual, mod, mod_rate\)"):
        flops.sweep_cells(configure(["--mod_runs=('nag', 'nag', 0.25)"], flops.SWEEP_DEFAULTS))


@pytest.mark.parametrize("source, line, error", [
    ("n_layer = 2\nbatch_size = (8\n", 2, "SyntaxError"),
    ("n_layer = 2\nif True:\nn_embd = 64\n", 3, "IndentationError"),
    ("n_layer = 2\nn_embd = n_head * 32\n", 2, "NameError: name 'n_head' is not defined"),
    ("import math\nn_layer = 2\nlearning_rate = math.log(-1)\n", 3, "ValueError"),
])
def test_a_config_file_with_a_python_error_names_its_line(tmp_path, source, line, error):
    """A config file is Python: an error in it is one line with its file:line and the error (it used to be
    a traceback through configurator.py), from train.py's command line as from configure."""
    path = tmp_path / "mine.py"
    path.write_text(source)
    with pytest.raises(ConfigError) as e:
        configure([str(path)], run_config.DEFAULTS)
    message = str(e.value)
    assert message.startswith(f"{path}:{line}: ") and error in message and "\n" not in message, message
    assert "fix that line" in message


def test_a_run_folder_given_as_a_config_file_hints_out_dir(tmp_path, capsys):
    """`python sample.py out-x` (a run's folder, as plot.py takes it) names --out_dir=out-x, for a folder
    there and one that is not; a file name ending .py is still read as a config file."""
    run = tmp_path / "out-x"
    run.mkdir()
    for script in (sample, tradeoff):
        with pytest.raises(ConfigError, match=rf"^'{re.escape(str(run))}' is a folder, not a config file; "
                                              rf"for a run's folder write --out_dir={re.escape(str(run))}$"):
            script.main([str(run)])
    with pytest.raises(ConfigError, match=r"^config file 'out-y' not found; for a run's folder write --out_dir=out-y$"):
        sample.main(["out-y"])
    with pytest.raises(ConfigError, match="cannot read config file 'missing.py'"):
        sample.main(["missing.py"])


HELP_OPENS = {  # the script's --help: its first line says what it does and what it needs
    "sample": (lambda: sample.main(["--help"]), ["sample", "trained model", "--out_dir="]),
    "tradeoff": (lambda: tradeoff.main(["--help"]), ["val loss against executed FLOPs", "residual=nag", "--out_dir="]),
    "flops sweep": (lambda: flops.main(["sweep", "--help"]), ["sweep config"]),
    "flops results": (lambda: flops.main(["results", "--help"]), ["results.csv"]),
}


@pytest.mark.parametrize("script", HELP_OPENS)
def test_help_opens_with_what_the_script_does_and_needs(script, capsys):
    run, needles = HELP_OPENS[script]
    with pytest.raises(SystemExit):
        run()
    first = capsys.readouterr().out.splitlines()[0]
    assert all(n in first for n in needles), first


def test_flops_help_names_its_commands(capsys):
    """flops.py --help lists its three commands (the breakdown, sweep and results), then the breakdown's keys."""
    with pytest.raises(SystemExit):
        flops.main(["--help"])
    out = capsys.readouterr().out
    head = out.split("keys:")[0]
    for command in ("python flops.py [config", "python flops.py sweep config/", "python flops.py results "):
        assert command in head, out[:600]


def test_a_list_of_bare_words(tmp_path):
    """--residuals=prenorm,nag (and [prenorm,nag], which a shell leaves of ['prenorm','nag']) is a list of
    strings, as the list hint says; a number in it stays a number."""
    defaults = dict(residuals=["prenorm"], depths=[2])
    for arg in ("--residuals=prenorm,nag", "--residuals=[prenorm,nag]", "--residuals=['prenorm','nag']"):
        assert configure([arg], defaults)["residuals"] == ["prenorm", "nag"], arg
    assert configure(["--residuals=nag"], defaults)["residuals"] == ["nag"]
    assert configure(["--depths=[4,8]"], defaults)["depths"] == [4, 8]


# -----------------------------------------------------------------------------
# train.py's optimizer and schedule values (run_config.check_training_values, called by check_run_config)

def train_cli(args):
    """train.py's command line in this process: (exit code, stdout, stderr), as tests/test_train.py's run_train_here."""
    import contextlib
    import io

    import torch
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), torch.random.fork_rng():
        try:
            train.cli([str(a) for a in args])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
            if isinstance(e.code, str):
                print(e.code, file=err)
    return code, out.getvalue(), err.getvalue()


def tiny_train(data_dir, out_dir, **overrides):
    args = dict(dataset="shakespeare_char", data_dir=data_dir, out_dir=out_dir, device="cpu", n_layer=1, n_head=2,
                n_embd=16, block_size=16, batch_size=2, gradient_accumulation_steps=1, eval_iters=1,
                eval_interval=2, max_iters=2, warmup_iters=1, compile=False, final_eval_tokens=256)
    args.update(overrides)
    return [f"--{k}={v}" for k, v in args.items()]


@pytest.mark.parametrize("key, value, needles", [
    ("learning_rate", "-1e-3", ["learning_rate must be a number > 0, got -0.001", "--learning_rate="]),
    ("beta2", "1.5", ["beta2 must be in [0, 1)", "got 1.5", "--beta2=0.95"]),
    ("beta1", "-0.1", ["beta1 must be in [0, 1)"]),
    ("beta1", "1", ["beta1 must be in [0, 1)", "got 1"]),  # the boundary (AdamW itself refuses it with a traceback, after out_dir exists)
    ("beta2", "1.0", ["beta2 must be in [0, 1)", "got 1.0"]),
    ("warmup_iters", "-5", ["warmup_iters must be a whole number >= 0", "got -5"]),
    ("grad_clip", "-1.0", ["grad_clip must be a number >= 0 (0: no clipping)", "got -1.0"]),
    ("weight_decay", "-0.1", ["weight_decay must be a number >= 0", "got -0.1"]),
    ("min_lr", "-1e-4", ["min_lr must be a number >= 0"]),
    ("min_lr", "2e-3", ["min_lr 0.002 is above learning_rate 0.0006", "--min_lr=6e-05"]),  # the decay would climb
    ("lr_decay_iters", "0", ["lr_decay_iters 0 ends inside the warm-up (warmup_iters 1)", "--lr_decay_iters"]),
])
def test_train_refuses_optimizer_values_before_touching_out_dir(data_dir, tmp_path, key, value, needles):
    """A learning rate or beta AdamW cannot take used to be its traceback, after out_dir was made (left
    empty); a negative warm-up, clip or decay was taken silently. Each is now one line naming the key and a
    value that works, and out_dir is never created."""
    out = tmp_path / "out"
    code, _, err = train_cli(tiny_train(data_dir, out, **{key: value}))
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert all(n in lines[0] for n in needles), lines[0]
    assert not out.exists()


def test_train_warns_when_the_whole_run_is_warm_up(capsys):
    """warmup_iters >= max_iters (from scratch, no budget: a budget caps the warm-up itself) runs, with one
    warning that says so and a warm-up that fits; a warm-up shorter than the run says nothing."""
    def check(**kw):
        cfg = configure([f"--{k}={v}" for k, v in kw.items()], run_config.DEFAULTS)
        train.check_run_config(cfg)
        return capsys.readouterr().err
    err = check(max_iters=100, warmup_iters=100, device="cpu")
    assert err.strip() == ("warning: warmup_iters 100 >= max_iters 100: the whole run is warm-up and the LR never "
                           "reaches learning_rate; lower it, e.g. --warmup_iters=10")
    assert check(max_iters=101, warmup_iters=100, device="cpu") == ""
    assert check(max_iters=100, warmup_iters=2000, max_flops=1e12, device="cpu") == ""  # the budget caps it


def test_kernels_triton_on_a_cpu_says_it_runs_the_reference(capsys):
    """--kernels=triton on a CPU runs each op's CPU implementation (the reference): train.py and sample.py say
    so on stderr instead of running it silently; on a CPU kernels=auto says nothing."""
    for kernels, said in (("triton", True), ("auto", False), ("torch", False)):
        cfg = configure(["--device=cpu", f"--kernels={kernels}"], run_config.DEFAULTS)
        train.check_run_config(cfg)
        err = capsys.readouterr().err
        assert (run_config.KERNELS_ON_CPU in err) == said, (kernels, err)
    assert "CPU implementation" in run_config.KERNELS_ON_CPU and "Triton kernels run on a GPU" in run_config.KERNELS_ON_CPU
