"""sample.py: KV-cache generation by default, tokens/s, and the realised MoD skip rate per sublayer.

Checkpoints are written directly in train.py's format (run_config.save_checkpoint; what load_checkpoint and
run_config.load_codec read) from a tiny model trained for a few AdamW steps in-process: n_layer 2, n_embd 32.
"""
import re

import pytest
import torch

import sample
import run_config
from configurator import ConfigError
from model import GPT, GPTConfig
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


SKIP_LINE = re.compile(r"^skip rate per sublayer: ((?:(?:attn|mlp)\d+ [01]\.\d\d ?)+) \(mean ([01]\.\d{3})\)$", re.M)


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


def test_skip_rates_match_generate_stats(mod_ckpt, capsys):
    """The printed rates are 1 - executed / tokens of GPT.generate's own counts, summed over the samples."""
    out = run_sample(mod_ckpt, capsys, "--temperature=0", "--num_samples=1")
    ckpt = run_config.load_checkpoint(str(mod_ckpt / "ckpt.pt"), torch.device("cpu"))
    model = GPT(GPTConfig(**ckpt["model_args"]))
    model.load_state_dict(ckpt["model"])
    encode, _ = run_config.load_codec(ckpt)
    model.eval().generate(torch.tensor([encode("ROMEO:")]), 20, temperature=0)
    stats = model.generate_stats
    assert sample.skip_rate_line(stats["executed"], stats["tokens"]) in out.err


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


def test_kernels_is_a_run_setting(mod_ckpt, capsys, monkeypatch):
    """--kernels overrides the checkpoint's (here torch's references for the default auto): same text."""
    made = []
    monkeypatch.setattr(run_config, "GPT", lambda config: made.append(config) or GPT(config))
    default = run_sample(mod_ckpt, capsys, "--temperature=0")
    torch_refs = run_sample(mod_ckpt, capsys, "--temperature=0", "--kernels=torch")
    assert [c.kernels for c in made] == ["auto", "torch"]
    assert torch_refs.out == default.out
    with pytest.raises(ConfigError, match=r"unknown kernels 'cuda'; valid: auto, torch, triton"):
        run_sample(mod_ckpt, capsys, "--kernels=cuda")


def test_compile_is_refused_with_a_clear_error(mod_ckpt, capsys):
    """--compile=True used to compile a module that generation never ran: old command lines get an error."""
    with pytest.raises(ConfigError, match="no longer takes --compile=True.*drop --compile"):
        run_sample(mod_ckpt, capsys, "--compile=True")
    assert "tokens/s" in run_sample(mod_ckpt, capsys, "--compile=False").err
