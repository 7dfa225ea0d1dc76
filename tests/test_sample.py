"""sample.py: KV-cache generation by default, tokens/s, and the realised MoD skip rate per sublayer.

Checkpoints are written directly in train.py's format (run_config.save_checkpoint; what load_checkpoint and
run_config.load_codec read) from a tiny model trained for a few AdamW steps in-process: n_layer 2, n_embd 32.
"""
import re
import shutil
from pathlib import Path

import pytest
import torch

import kernels
import sample
import run_config
from configurator import ConfigError
from model import GPT, routing
from tiny_checkpoint import BLOCK, make_checkpoint


@pytest.fixture(scope="module")
def mod_ckpt(data_dir, tmp_path_factory):
    """residual=nag + mod=nag at mod_rate 0.5: training leaves finite thresholds tau in the checkpoint."""
    out = tmp_path_factory.mktemp("sample") / "nag-mod"
    model = make_checkpoint(out, data_dir, steps=30, residual="nag", mod="nag", mod_rate=0.5)
    assert torch.isfinite(model.mod.tau).all()
    return out


def run_sample(out_dir, capsys, *extra):
    with torch.random.fork_rng():
        sample.main([f"--out_dir={out_dir}", "--start=ROMEO:", "--num_samples=2", "--max_new_tokens=20",
                     "--device=cpu", *extra])
    return capsys.readouterr()


SKIP_LINE = re.compile(r"^skip rate per new token, per sublayer: ((?:(?:attn|mlp)\d+ [01]\.\d\d ?)+) \(mean ([01]\.\d{3})\)$", re.M)


def test_mod_checkpoint_prints_tokens_per_s_and_skip_rates(mod_ckpt, capsys):
    out = run_sample(mod_ckpt, capsys, "--temperature=0")
    assert re.search(r"^40 tokens in [\d.]+s \(\d+ tokens/s, KV cache\)$", out.err, re.M), out.err
    m = SKIP_LINE.search(out.err)
    assert m, out.err
    pairs = m.group(1).split()
    names, rates = pairs[0::2], [float(x) for x in pairs[1::2]]
    assert names == ["attn1", "mlp1", "attn2", "mlp2"]
    assert abs(sum(rates) / len(rates) - float(m.group(2))) < 0.01
    assert all(0 <= r <= 1 for r in rates) and 0 < float(m.group(2)) < 1  # thresholds skip some, not all
    assert out.out.count("ROMEO:") == 2


def test_skip_rates_are_per_new_token_with_and_without_the_cache(mod_ckpt, capsys):
    """The printed rate of a sublayer is the fraction of the new tokens whose position sampled from (the
    prompt's last, then each new token) skipped it: recomputed here by model.routing() on the whole text,
    position by position (eval routing is causal). --kv_cache=False recomputes the context every step, and
    used to count those recomputed tokens too (a different rate for the same text); within block_size both
    now print this same line."""
    prompt, n_new = "ROMEO:", 20  # 6 + 20 tokens: within BLOCK
    outs = {kv: run_sample(mod_ckpt, capsys, "--temperature=0", "--num_samples=1", f"--kv_cache={kv}")
            for kv in (True, False)}
    ckpt = run_config.load_checkpoint(str(mod_ckpt / "ckpt.pt"), torch.device("cpu"))
    model = run_config.model_from_checkpoint(ckpt, torch.device("cpu"))
    encode, _ = run_config.load_codec(ckpt)
    text = outs[True].out.split("\n---------------\n")[0]
    assert text == outs[False].out.split("\n---------------\n")[0] and len(text) == len(prompt) + n_new
    ids = torch.tensor([encode(text)])
    with torch.no_grad():
        ran, _ = routing(model, ids[:, :-1])  # [2L, 1, T]: the last new token is sampled, never run
    sampled_from = ran[:, 0, len(prompt) - 1:]  # the positions the 20 new tokens were sampled from
    assert sampled_from.shape[1] == n_new and 0 < sampled_from.float().mean() < 1
    want = sample.skip_rate_line(sampled_from.sum(1).tolist(), n_new)
    for kv, out in outs.items():
        assert want in out.err.splitlines(), (kv, want, out.err)


def test_kv_cache_and_recompute_sample_the_same_text_within_block_size(mod_ckpt, capsys):
    """The same seed samples the same tokens with and without the cache (one random draw per token) up to
    block_size; past it the contexts differ (the cache restarts from block_size / 2 tokens), as sample.py says."""
    args = ("--temperature=0.8", "--max_new_tokens=30", "--seed=7")  # "ROMEO:" + 30 characters > BLOCK + 1
    cached, recomputed = (run_sample(mod_ckpt, capsys, *args, f"--kv_cache={kv}") for kv in (True, False))
    samples = [out.out.split("\n---------------\n")[:2] for out in (cached, recomputed)]
    for a, b in zip(*samples):  # each sample: the prompt and 30 characters (one token each)
        assert len(a) == len(b) == 6 + 30 and a[:BLOCK + 1] == b[:BLOCK + 1]
    assert samples[0][0] != samples[0][1]  # two samples, drawn one after the other
    assert "no KV cache" in recomputed.err and SKIP_LINE.search(recomputed.err)


def test_dense_checkpoint_prints_no_skip_rates(data_dir, tmp_path, capsys):
    make_checkpoint(tmp_path / "dense", data_dir, steps=2, residual="prenorm")
    out = run_sample(tmp_path / "dense", capsys, "--num_samples=1")
    assert "tokens/s" in out.err and "skip rate" not in out.err


def impls(model):
    """The kernels setting of every module of the model that picks a kernel (its RMSNorms, the stream)."""
    found = {m.impl for m in model.modules() if hasattr(m, "impl")}
    assert found, "no module with a kernels setting"
    return found


def test_kernels_is_a_run_setting(mod_ckpt, tmp_path, capsys, monkeypatch):
    """Without --kernels the model takes the checkpoint's setting (here triton: the GPU path, which on CPU
    runs the Triton kernels through Triton's interpreter once the ops' CPU references are switched off);
    --kernels=torch overrides it in every module, and no Triton kernel runs. Both sample the same text."""
    from triton.runtime.interpreter import InterpretedFunction
    ckpt = run_config.load_checkpoint(str(mod_ckpt / "ckpt.pt"), torch.device("cpu"))
    ckpt["model_args"]["kernels"] = "triton"  # a run trained with --kernels=triton
    run_config.save_checkpoint(ckpt, str(tmp_path / "ckpt.pt"))
    made, launches = [], []
    monkeypatch.setattr(run_config, "GPT", lambda config: made.append(GPT(config)) or made[-1])
    launch = InterpretedFunction.run
    monkeypatch.setattr(InterpretedFunction, "run",
                        lambda self, *a, **kw: launches.append(self) or launch(self, *a, **kw))
    args = ("--temperature=0", "--num_samples=1", "--max_new_tokens=6")
    with kernels.triton_on_cpu():
        own = run_sample(tmp_path, capsys, *args)
        n_own = len(launches)
        refs = run_sample(tmp_path, capsys, *args, "--kernels=torch")
    assert [impls(m) for m in made] == [{"triton"}, {"torch"}]
    assert n_own > 0, "the checkpoint's kernels=triton ran no Triton kernel"
    assert len(launches) == n_own, "--kernels=torch still ran Triton kernels"
    assert own.out == refs.out and own.out.startswith("ROMEO:")
    with pytest.raises(ConfigError, match=r"unknown kernels 'cuda'; valid: auto, torch, triton"):
        run_sample(mod_ckpt, capsys, "--kernels=cuda")


def draw(out_dir, capsys, rng, *extra):
    """sample.py's text (stdout) for the options, run after the global RNG was reseeded with rng and drawn
    from: what sample.py prints must not depend on the RNG state it starts from."""
    with torch.random.fork_rng():
        torch.manual_seed(rng)
        torch.rand(rng + 1)
        sample.main([f"--out_dir={out_dir}", "--start=ROMEO:", "--num_samples=2", "--max_new_tokens=20",
                     "--device=cpu", *extra])
    return capsys.readouterr().out


def test_top_k_1_samples_the_greedy_text(mod_ckpt, capsys):
    """--top_k=1 keeps only the most likely token: at temperature 1 it draws the greedy (temperature 0)
    text, which sampling from all the tokens at temperature 1 does not."""
    greedy = draw(mod_ckpt, capsys, 0, "--temperature=0")
    assert greedy.count("ROMEO:") == 2
    top1 = draw(mod_ckpt, capsys, 1, "--temperature=1", "--top_k=1", "--seed=5")
    assert top1 == greedy, "--top_k=1 at temperature 1 did not sample the greedy text"
    assert draw(mod_ckpt, capsys, 1, "--temperature=1", "--top_k=None", "--seed=5") != greedy


def test_seed_sets_the_text(mod_ckpt, capsys):
    """--seed alone decides the sampled text: the same seed gives the same text whatever the global RNG
    state before, a different seed a different text."""
    text = draw(mod_ckpt, capsys, 0, "--seed=3")
    assert text.count("ROMEO:") == 2
    assert draw(mod_ckpt, capsys, 123, "--seed=3") == text, "--seed=3 gave another text from another RNG state"
    assert draw(mod_ckpt, capsys, 0, "--seed=4") != text, "--seed=3 and --seed=4 gave the same text"


def test_compile_is_refused_with_a_clear_error(mod_ckpt, capsys):
    """--compile=True used to compile a module that generation never ran: old command lines get an error."""
    with pytest.raises(ConfigError, match="no longer takes --compile=True.*drop --compile"):
        run_sample(mod_ckpt, capsys, "--compile=True")
    assert "tokens/s" in run_sample(mod_ckpt, capsys, "--compile=False").err


@pytest.mark.parametrize("arg, message", [
    ("--top_k=0", "top_k must be a whole number >= 1 or None (all tokens), got 0"),
    ("--top_k=-3", "top_k must be a whole number >= 1 or None"),
    ("--temperature=-1", "temperature must be a number >= 0 (0: greedy, 1: the model's distribution), got -1"),
    ("--max_new_tokens=-5", "max_new_tokens must be a whole number >= 1, got -5"),
    ("--num_samples=0", "num_samples must be a whole number >= 1, got 0"),
])
def test_bad_sampling_values_are_one_line_errors(mod_ckpt, capsys, arg, message):
    """--top_k=0 used to be an IndexError inside generate(); a negative temperature or token count and no
    samples ran silently (printing nothing, or nonsense). Each is one line naming the key and a value that
    works, before the checkpoint is read."""
    with pytest.raises(ConfigError) as e:
        run_sample(mod_ckpt, capsys, arg)
    assert message in str(e.value) and "(e.g. --" in str(e.value) and "\n" not in str(e.value)
    assert capsys.readouterr().out == ""


def test_a_missing_checkpoint_names_the_out_dir_to_pass(tmp_path, capsys):
    """sample.py reads a trained run: no checkpoint asks for the run's --out_dir, not for
    --init_from=scratch (train.py's fix, which sample.py does not take)."""
    with pytest.raises(ConfigError) as e:
        run_sample(tmp_path, capsys)
    assert str(e.value).startswith(f"no checkpoint at {tmp_path / 'ckpt.pt'}: pass --out_dir=DIR")
    assert "init_from" not in str(e.value)


def test_a_missing_checkpoint_names_the_earlier_runs_that_hold_one(mod_ckpt, tmp_path, capsys):
    """After a fresh start that saved nothing (--max_iters=0) the earlier run sits in out_dir/run-*/: the
    error names that folder, and sampling from it works."""
    kept = tmp_path / "run-20260101-120000"
    kept.mkdir()
    shutil.copy(Path(mod_ckpt) / "ckpt.pt", kept / "ckpt.pt")
    with pytest.raises(ConfigError) as e:
        run_sample(tmp_path, capsys)
    assert f"earlier runs there hold one: {kept}; pass one as --out_dir=DIR" in str(e.value)
    run_sample(kept, capsys)


def test_kernels_triton_on_a_cpu_is_said(mod_ckpt, capsys):
    """--kernels=triton on a CPU runs the ops' CPU implementations (the reference): stderr says so, and the
    text is the reference's."""
    triton = run_sample(mod_ckpt, capsys, "--temperature=0", "--num_samples=1", "--max_new_tokens=4", "--kernels=triton")
    assert run_config.KERNELS_ON_CPU in triton.err
    torch_ = run_sample(mod_ckpt, capsys, "--temperature=0", "--num_samples=1", "--max_new_tokens=4", "--kernels=torch")
    assert run_config.KERNELS_ON_CPU not in torch_.err and torch_.out == triton.out
