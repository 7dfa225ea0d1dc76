"""Every eval of a model depends on its weights alone, dropout on (dropout=0.1): estimate_loss, final_eval,
eval_only and a resumed final eval each give the same numbers, to the bit, under two RNG states, and hand
the model back in train mode where training goes on. eval_only reads a checkpoint: without
--init_from=resume it is refused before out_dir is touched, and it never moves a run aside.
"""
import contextlib
import json
import shutil
from pathlib import Path

import pytest
import torch

import run_config
import train
from configurator import ConfigError
from model import GPT, GPTConfig
from test_train import in_process, read_log, tiny_args, train_once  # noqa: F401

DROPOUT = 0.1
EVAL_CFG = dict(eval_iters=2, batch_size=4, block_size=32, final_eval_tokens=1024, dataset="shakespeare_char")


@pytest.fixture(scope="module")
def dropout_model():
    """A tiny GPT with dropout on, in train mode (as the training loop hands it to an eval)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = GPT(GPTConfig(block_size=32, vocab_size=65, n_layer=2, n_head=2, n_embd=32, dropout=DROPOUT))
    return model.train()


def under_seeds(fn, seeds=(1, 2)):
    """fn() once under each torch seed (the caller's RNG state restored after), one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = []
        for seed in seeds:
            with torch.random.fork_rng():
                torch.manual_seed(seed)
                results.append(fn())
        return results
    finally:
        torch.set_num_threads(threads)


def test_dropout_is_on_in_training(dropout_model, data_dir):
    """The control: in train mode two RNG states give two losses, so the tests below can fail."""
    X, Y = run_config.get_batch(str(data_dir / "shakespeare_char" / "val.bin"), 4, 32,
                                torch.Generator().manual_seed(0), torch.device("cpu"))
    with torch.no_grad():
        a, b = under_seeds(lambda: dropout_model(X, Y)[1].item())
    assert a != b


def test_estimate_loss_is_the_same_under_two_rng_states(dropout_model, data_dir):
    paths = {s: str(data_dir / "shakespeare_char" / f"{s}.bin") for s in ("train", "val")}
    a, b = under_seeds(lambda: train.estimate_loss(dropout_model, paths, EVAL_CFG, torch.device("cpu"),
                                                   contextlib.nullcontext(), lambda: False, None))
    assert a == b  # bit-identical: floats compared exactly
    assert dropout_model.training  # handed back in train mode: training goes on with dropout


def test_final_eval_is_the_same_under_two_rng_states(dropout_model, data_dir, tmp_path):
    val = str(data_dir / "shakespeare_char" / "val.bin")

    def record():
        path = tmp_path / "final_eval.json"
        assert train.final_eval(dropout_model, val, EVAL_CFG, torch.device("cpu"), contextlib.nullcontext(), 2,
                                str(path), lambda: False, None)
        return json.loads(path.read_text())
    a, b = under_seeds(record)
    assert a == b and a["windows"] == 32
    assert dropout_model.training


# -----------------------------------------------------------------------------
# the paths through train.py: an eval in training, eval_only, a resumed final eval

@pytest.fixture(scope="module")
def dropout_run(data_dir, tmp_path_factory):
    """A finished 2-iteration run with dropout on: its eval at 2 is the checkpoint's, then its final eval."""
    out = tmp_path_factory.mktemp("dropout") / "out"
    train_once(tiny_args(data_dir, out, max_iters=2, dropout=DROPOUT, gradient_accumulation_steps=1))
    return out


def seeded(monkeypatch, name, seed):
    """train.<name> (an eval function) called with the RNG seeded to seed first: another RNG state."""
    real = getattr(train, name)

    def wrapped(*args, **kw):
        torch.manual_seed(seed)
        return real(*args, **kw)
    monkeypatch.setattr(train, name, wrapped)


def test_eval_only_repeats_the_runs_eval_under_any_rng_state(dropout_run, data_dir, tmp_path, in_process,
                                                             monkeypatch):
    """eval_only of the checkpoint saved at the eval at iteration 2, twice, under two other RNG states: the
    losses logged equal that eval's, to the last digit logged; ckpt.pt stays as it was."""
    out = tmp_path / "out"
    shutil.copytree(dropout_run, out)
    at_2 = read_log(out)[-1]
    assert at_2["iter"] == 2
    ckpt = (out / "ckpt.pt").read_bytes()
    for seed in (1, 2):
        seeded(monkeypatch, "estimate_loss", seed)
        in_process(tiny_args(data_dir, out, init_from="resume", eval_only=True))
        monkeypatch.undo()
        last = read_log(out)[-1]
        assert (last["iter"], last["train_loss"], last["val_loss"]) == (2, at_2["train_loss"], at_2["val_loss"])
    assert len(read_log(out)) == 4 and (out / "ckpt.pt").read_bytes() == ckpt


def test_a_resumed_final_eval_repeats_the_runs_under_any_rng_state(dropout_run, data_dir, tmp_path, in_process,
                                                                   monkeypatch):
    """A finished run without its final eval (final_eval.json gone) resumed runs the final eval alone:
    under two other RNG states it writes exactly the run's own final eval."""
    out = tmp_path / "out"
    shutil.copytree(dropout_run, out)
    own = json.loads((out / train.FINAL_EVAL).read_text())
    for seed in (1, 2):
        (out / train.FINAL_EVAL).unlink()
        seeded(monkeypatch, "final_eval", seed)
        in_process(tiny_args(data_dir, out, init_from="resume", max_iters=2))
        monkeypatch.undo()
        assert json.loads((out / train.FINAL_EVAL).read_text()) == own


# -----------------------------------------------------------------------------
# eval_only reads a checkpoint

def test_eval_only_without_resume_is_refused_and_moves_nothing(dropout_run, data_dir, tmp_path, in_process):
    """--eval_only=True from scratch would evaluate a random init and move the run in out_dir aside: a
    one-line error naming --init_from=resume, every file as it was."""
    out = tmp_path / "out"
    shutil.copytree(dropout_run, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ConfigError) as e:
        in_process(tiny_args(data_dir, out, eval_only=True))
    assert str(e.value).startswith("eval_only evaluates a checkpoint: add --init_from=resume")
    assert "\n" not in str(e.value)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_eval_only_never_moves_a_run_aside(dropout_run, data_dir, tmp_path, in_process, monkeypatch):
    """eval_only with --init_from=resume: set_aside_previous_run is never called; only log.jsonl grows."""
    out = tmp_path / "out"
    shutil.copytree(dropout_run, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(train, "set_aside_previous_run", lambda *a: pytest.fail("eval_only moved a run aside"))
    in_process(tiny_args(data_dir, out, init_from="resume", eval_only=True, eval_iters=1))
    after = {p.name: p.read_bytes() for p in out.iterdir()}
    assert after.pop("log.jsonl").startswith(before.pop("log.jsonl")) and after == before
    assert not [p for p in Path(out).iterdir() if p.is_dir()]
