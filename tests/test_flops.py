"""flops.py: the analytic count against torch's FlopCounterMode, MoD scaling, budget arithmetic,
MFU, train.py's max_flops, and sweeps that resume and survive a failing run (their bookkeeping on a fake
train.py; one real tiny run through it)."""
import contextlib
import csv
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import flops  # noqa: E402
import run_config  # noqa: E402
import stats  # noqa: E402
import train  # noqa: E402
from configurator import ConfigError, configure  # noqa: E402
from model import GPT, GPTConfig, executed_fraction  # noqa: E402
from model import MODS, RESIDUALS, TopKMoD  # noqa: E402

aten = torch.ops.aten


def cpu_sdpa_flop(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs):
    """FlopCounterMode has a formula for the GPU SDPA kernels (the full T x T square, the causal
    mask ignored) but none for the CPU kernel, which it counts as 0: give it the same formula.
    It takes the query and key lengths apart, so it also holds with an explicit attn_mask
    (skip_middle's gated keys, a KV cache: t queries against n keys, the full t x n rectangle)."""
    return sdpa_flop_count(q_shape, k_shape, v_shape)


CPU_SDPA = {aten._scaled_dot_product_flash_attention_for_cpu: cpu_sdpa_flop}


def count_forward(model, idx, fraction=None):
    """FlopCounterMode's FLOPs per token of one forward of model (in its current train/eval mode); the list
    `fraction`, if given, gets the pass's executed fraction per sublayer."""
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=CPU_SDPA) as counter:
        _, _, executed = model(idx, idx, executed=True)  # with targets: the head runs on every position
    if fraction is not None:
        fraction.extend(executed_fraction(executed, idx.numel()))
    return counter.get_total_flops() / idx.numel()


def counted_flops(config, B=2):
    """FlopCounterMode's forward FLOPs per token of the real model on a full training batch."""
    torch.manual_seed(0)
    model = GPT(config)
    return count_forward(model, torch.randint(0, config.vocab_size, (B, config.block_size)))


def matmul_part(parts, config):
    return sum(v for k, v in parts.items() if k in flops.matmul_parts(config))


CONFIGS = [dict(residual=r) for r in RESIDUALS] + [
    dict(residual="block_attnres", attnres_blocks=3), dict(residual="block_attnres", attnres_query="input"),
    dict(residual="nag", nag_channels=8), dict(residual="hc", hc_dynamic=True)]


@pytest.mark.parametrize("kw", CONFIGS, ids=lambda kw: "-".join(map(str, kw.values())))
def test_matmul_flops_match_flop_counter(kw):
    config = GPTConfig(block_size=48, vocab_size=65, n_layer=3, n_head=2, n_embd=32, kernels="torch", **kw)
    parts = flops.forward_flops(config)
    analytic = matmul_part(parts, config)
    assert counted_flops(config) == pytest.approx(analytic, rel=0.02)
    # what the counter does not see is only small extras (AttnRes depth mixing, hc's reads and writes,
    # mHC's Sinkhorn), at the quickstart's width (at width 32, mHC's Sinkhorn, which does not grow with
    # the width, is 5% of the matmuls)
    wide = flops.forward_flops(GPTConfig(block_size=48, vocab_size=65, n_layer=3, n_head=4, n_embd=128, **kw))
    assert sum(wide.values()) - matmul_part(wide, config) <= 0.05 * matmul_part(wide, config)


def test_attention_scores_are_counted_over_the_full_square():
    # T doubles: only the score term changes, and it doubles (nanoGPT/PaLM: the causal mask is not credited)
    small, big = (flops.forward_flops(GPTConfig(block_size=T, vocab_size=65, n_layer=2, n_head=2, n_embd=32))
                  for T in (32, 64))
    assert big["attn_scores"] == 2 * small["attn_scores"] == 2 * 2 * 64 * 32 * 2  # 2 layers
    rest = lambda parts: {k: v for k, v in parts.items() if k != "attn_scores"}  # noqa: E731
    assert rest(big) == rest(small)


def test_exec_frac_scales_each_sublayer():
    config = GPTConfig(block_size=64, vocab_size=65, n_layer=2, n_head=2, n_embd=32, residual="nag")
    dense = flops.forward_flops(config)
    assert dense == flops.forward_flops(config, [1.0] * 4)
    half = flops.forward_flops(config, [0.5] * 4)
    assert half["attn_proj"] == dense["attn_proj"] / 2 and half["mlp"] == dense["mlp"] / 2
    assert half["attn_scores"] == dense["attn_scores"] / 4  # a compressed sequence: quadratic
    assert half["head"] == dense["head"] and half["nag_modulator"] == dense["nag_modulator"]  # every token
    # one sublayer at a time: attention 1 at 0.25 only removes its own share
    one = flops.forward_flops(config, [0.25, 1, 1, 1])
    assert one["attn_proj"] == dense["attn_proj"] * (0.25 + 1) / 2
    assert one["attn_scores"] == dense["attn_scores"] * (0.25 ** 2 + 1) / 2
    assert one["mlp"] == dense["mlp"]
    assert flops.train_flops_per_token(config, [0.5] * 4) == 3 * sum(half.values())
    with pytest.raises(ValueError, match="one per sublayer"):
        flops.forward_flops(config, [1.0] * 3)


def test_mod_defaults_and_extras():
    base = dict(block_size=64, vocab_size=65, n_layer=2, n_head=2, n_embd=32)
    d, n = 32, 4
    # top-k modes: without a measured fraction, every sublayer runs its training capacity k / T
    nag = GPTConfig(**base, residual="nag", mod="nag", mod_rate=0.25)
    assert TopKMoD.keep_fraction(nag) == 48 / 64
    assert flops.forward_flops(nag) == flops.forward_flops(nag, [0.75] * n)
    assert flops.forward_flops(nag)["mlp"] == 0.75 * flops.forward_flops(GPTConfig(**base, residual="nag"))["mlp"]
    # the router: 2d per router (a block's, or a sublayer's), on every token; at mod_rate 0 the model
    # never routes (nor runs it)
    for layout, routers in (("block", n // 2), ("sublayer", n)):
        router = GPTConfig(**base, mod="router", mod_rate=0.5, mod_layout=layout, mod_inference="threshold")
        assert flops.forward_flops(router)["router"] == flops.forward_flops(router, [0.1] * n)["router"] == 2 * d * routers
    assert "router" not in flops.forward_flops(GPTConfig(**base, mod="router"))
    assert flops.forward_flops(GPTConfig(**base, mod="router")) == flops.forward_flops(GPTConfig(**base))
    # skip_middle: no fixed capacity (dense unless measured), plus L/2 gate producers of 2d each
    skip = GPTConfig(**base, residual="sandwich", mod="skip_middle", mod_rate=0.25)
    parts = flops.forward_flops(skip)
    assert parts["skip_gates"] == 2 * d * 1 and "skip_gates" in flops.matmul_parts(skip)
    assert {k: v for k, v in parts.items() if k != "skip_gates"} == flops.forward_flops(
        GPTConfig(**base, residual="sandwich"))
    assert flops.train_flops_per_token(skip, [0.5] * n) < flops.train_flops_per_token(skip)


MOD_CONFIGS = [dict(residual=r, mod=m) for m in MODS if MODS[m] for r, cls in RESIDUALS.items() if m in cls.mods]


@pytest.mark.parametrize("train_mode", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("kw", MOD_CONFIGS, ids=lambda kw: f"{kw['residual']}-{kw['mod']}")
def test_mod_flops_follow_the_executed_fraction(kw, train_mode):
    """On a real forward, FlopCounterMode's matmul FLOPs fall to the executed-fraction prediction:
    skipped tokens are gathered out of the matmuls (and out of attention), not masked."""
    config = GPTConfig(block_size=48, vocab_size=65, n_layer=4, n_head=2, n_embd=32, kernels="torch",
                       mod_rate=0.5, **kw)
    torch.manual_seed(0)
    model = GPT(config)
    # top-k training keeps k tokens in every row; mask routing (eval, skip_middle) keeps different
    # counts per row and pads to the longest, so those run one row: the padding is not skipped work
    B = 2 if train_mode and kw["mod"] != "skip_middle" else 1
    idx = torch.randint(0, config.vocab_size, (B, config.block_size))
    if kw["mod"] == "skip_middle":
        with torch.no_grad():  # large producer weights: many tokens saturate, their gate is exactly 0
            for p in model.mod.producers:
                p.weight.mul_(100)
    elif not train_mode:
        warm = torch.randint(0, config.vocab_size, (4, config.block_size))
        model(warm, warm)  # a training forward on other tokens sets the thresholds tau (mean k-th largest score)
        assert torch.isfinite(model.mod.tau).all()
    model.train(train_mode)
    frac = []
    counted = count_forward(model, idx, frac)
    assert all(0 < f <= 1 for f in frac) and sum(frac) / len(frac) < 0.8  # tokens were skipped
    if train_mode and kw["mod"] != "skip_middle":
        assert frac == pytest.approx([TopKMoD.keep_fraction(config)] * config.n_sublayers)
    predicted = matmul_part(flops.forward_flops(config, frac), config)
    assert counted == pytest.approx(predicted, rel=0.03)
    # real savings: the dense model of the same shape counts more, by the predicted amount
    dense_config = GPTConfig(**{**config.__dict__, "mod": "none", "mod_rate": 0.0})
    dense = counted_flops(dense_config)
    assert counted < 0.85 * dense
    assert dense - counted == pytest.approx(matmul_part(flops.forward_flops(dense_config), dense_config) - predicted, rel=0.05)


def test_sdpa_count_with_a_mask_is_the_full_rectangle():
    """skip_middle and KV-cache steps call SDPA with an explicit float attn_mask and t queries
    against n keys: torch's CPU kernel is the same op, and the count is 4 t n hd per head."""
    B, nh, t, n, hd = 2, 3, 5, 11, 8
    q, k, v = torch.randn(B, nh, t, hd), torch.randn(B, nh, n, hd), torch.randn(B, nh, n, hd)
    mask = torch.zeros(B, 1, t, n)
    mask[..., 0] = float("-inf")
    for kwargs in (dict(attn_mask=mask), dict(is_causal=False)):
        with FlopCounterMode(display=False, custom_mapping=CPU_SDPA) as counter:
            torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)
        assert counter.get_total_flops() == 4 * B * nh * t * n * hd, kwargs


@pytest.mark.parametrize("residual, blocks", [("attnres", None), ("block_attnres", 3), ("block_attnres", None)])
def test_attnres_sources_follow_the_model(residual, blocks, monkeypatch):
    """The sources counted per sublayer and head are those the model's depth attention receives."""
    import model as model_module
    seen, real = [], model_module.depth_attention
    monkeypatch.setattr(model_module, "depth_attention",
                        lambda sources, *a, **k: seen.append(len(sources)) or real(sources, *a, **k))
    config = GPTConfig(block_size=8, vocab_size=65, n_layer=4, n_head=2, n_embd=32, residual=residual,
                       attnres_blocks=blocks)
    GPT(config)(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))
    counts = RESIDUALS[config.residual].source_counts(config)
    assert counts[0] == 0 and counts[1:] == seen  # sublayer 1 reads the embedding without mixing
    if blocks == 3:  # L = 4, N = 3: blocks of k = ceil(4 / 3) = 2 whole layers
        assert counts == [0, 2, 2, 2, 2, 3, 3, 3, 3]


def test_count_params_matches_the_model():
    config = GPTConfig(block_size=32, vocab_size=65, n_layer=2, n_head=2, n_embd=32, residual="nag")
    model = GPT(config)
    assert flops.count_params(config) == (model.get_num_params(False), model.get_num_params())


@pytest.mark.parametrize("budget", [1e10, 3.3e12, 3e15])
def test_budget_arithmetic(budget):
    tpi = 12 * 64
    per_token = {L: flops.train_flops_per_token(
        GPTConfig(block_size=64, vocab_size=65, n_layer=L, n_head=4, n_embd=128)) for L in (2, 8)}
    iters = {L: flops.iterations_for_budget(budget, f, tpi) for L, f in per_token.items()}
    for L, f in per_token.items():
        assert abs(iters[L] * tpi * f - budget) <= 0.5 * tpi * f  # the nearest count: within half an iteration
    # a deeper model gets proportionally fewer tokens (to within an iteration each)
    tokens = {L: iters[L] * tpi for L in iters}
    assert tokens[2] * per_token[2] == pytest.approx(tokens[8] * per_token[8], abs=tpi * per_token[8])
    assert tokens[8] < tokens[2]


@pytest.mark.parametrize("iters, expected", [(10.6, 11), (10.4, 10), (0.4, 1)])
def test_budget_rounds_to_the_nearest_iteration(iters, expected):
    """A budget of 10.6 iterations' FLOPs buys 11, of 10.4 buys 10 (the nearest count, not the floor);
    one iteration at least."""
    per_token, tpi = flops.train_flops_per_token(GPTConfig(block_size=64, vocab_size=65, n_layer=2, n_head=4,
                                                           n_embd=128)), 12 * 64
    assert flops.iterations_for_budget(per_token * tpi * iters, per_token, tpi) == expected


@pytest.mark.parametrize("budget", [0, -1e12, "lots", True])
def test_bad_budget_is_a_config_error(budget):
    with pytest.raises(ConfigError, match="positive number"):
        flops.iterations_for_budget(budget, 1e6, 768)


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H200", 989e12),
    ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA L4", 121e12), ("NVIDIA L40S", 362e12),
    ("NVIDIA GeForce RTX 4090", 165e12), ("NVIDIA A10", 125e12)])
def test_mfu_known_gpu(name, peak):
    assert flops.peak_flops(name) == peak
    assert flops.mfu(6e8, 1e5, name) == pytest.approx(6e8 * 1e5 / peak)
    assert flops.mfu(6e8, 1e5, name, n_devices=8) == pytest.approx(6e8 * 1e5 / (8 * peak))


@pytest.mark.parametrize("name", ["Tesla K80", "NVIDIA GeForce GTX 1080", "NVIDIA A10G", "AMD Instinct MI300X", None, ""])
def test_mfu_unknown_gpu(name):
    assert flops.peak_flops(name) is None
    assert flops.mfu(6e8, 1e5, name) is None  # unknown: never a guess


def test_train_max_flops(data_dir, tmp_path):
    args = dict(dataset="shakespeare_char", data_dir=data_dir, out_dir=tmp_path / "out", device="cpu",
                dtype="float32", n_layer=2, n_head=2, n_embd=32, block_size=32, batch_size=4,
                gradient_accumulation_steps=1, eval_iters=1, eval_interval=4, warmup_iters=1, max_iters=1000,
                lr_decay_iters=1000, compile=False, final_eval_tokens=1024)
    config = GPTConfig(vocab_size=65, **{k: args[k] for k in ("n_layer", "n_head", "n_embd", "block_size")})
    per_token, tpi = flops.train_flops_per_token(config), 4 * 32
    budget = 10.2 * per_token * tpi
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng():
            train.main([f"--{k}={v}" for k, v in args.items()] + [f"--max_flops={budget}"])
    finally:
        torch.set_num_threads(threads)
    log = [json.loads(line) for line in open(tmp_path / "out" / "log.jsonl")]
    assert [r["iter"] for r in log] == [0, 4, 8, 10]  # the budget buys 10 iterations, not max_iters=1000
    assert log[-1]["flops"] == pytest.approx(10 * tpi * per_token)
    assert log[-1]["lr"] == pytest.approx(6e-4 / 10, rel=1e-6)  # lr_decay_iters followed max_iters: min_lr at the end
    assert all(r["mfu"] is None for r in log)  # CPU


@pytest.mark.parametrize("path", sorted((REPO / "config").glob("sweep_*.py")), ids=lambda p: p.name)
def test_shipped_sweep_configs_are_valid(path):
    """Every run of every shipped sweep is a valid train.py configuration and model."""
    sw = configure([str(path)], flops.SWEEP_DEFAULTS)
    runs = flops.sweep_runs(sw)
    assert runs
    for name, cell, overrides in runs:
        cfg = configure([str(REPO / sw["train_config"]), *sw["train_args"], *flops.override_args(overrides)],
                        run_config.DEFAULTS)
        assert all(cfg[k] == v for k, v in overrides.items())
        train.check_nag_recipe(cfg)
        run_config.model_config(cfg, 65)
    # flops.py plan counts each cell at each of its budgets, once per seed
    budgets = {c: sw["cell_budgets"].get(c, sw["budgets"]) if sw["budgets"] else [sw["budget"]]
               for c, _ in flops.sweep_cells(sw)}
    n = sum(len(b) for b in budgets.values()) * max(len(sw["seeds"]), 1)
    if sw["budget_seconds"] is None:
        assert f": {n} runs\n" in flops.plan([str(path), "--gpu=''"])
    else:
        with pytest.raises(ConfigError, match="time budget"):
            flops.plan([str(path)])


def tiny_train_config(data_dir, tmp_path):
    """A train.py config for sweeps of tiny CPU runs (the sweep adds residual, n_layer and its budget)."""
    base = tmp_path / "tiny.py"
    base.write_text(f"dataset = 'shakespeare_char'\ndata_dir = {str(data_dir)!r}\ndevice = 'cpu'\n"
                    "dtype = 'float32'\nn_head = 2\nn_embd = 32\nblock_size = 32\nbatch_size = 4\n"
                    "gradient_accumulation_steps = 1\neval_iters = 1\neval_interval = 2\nwarmup_iters = 1\n"
                    "max_iters = 1000\nlog_interval = 1\nfinal_eval_tokens = 1024\n")
    return base


# a stand-in for train.py: appends its argv to argv.jsonl; fails with n_layer=0; else logs evals at
# iters 0, 1 and max_iters (4 unless given) to log.jsonl, with fake_log()'s losses and FLOPs, its final eval
# (final_eval.json, the same loss) and a ckpt.pt
FAKE_TRAIN = r"""import ast, json, os, sys
args = {}
for a in sys.argv[2:]:  # after the train config file
    k, v = a[2:].split("=", 1)
    try:
        args[k] = ast.literal_eval(v)
    except (ValueError, SyntaxError):
        args[k] = v
with open(os.path.join(args["out_dir"], "argv.jsonl"), "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\n")
if args["n_layer"] == 0:
    sys.exit("error: n_layer must be positive")
L, seed, iters, mod = args["n_layer"], args.get("seed", 0), args.get("max_iters", 4), args.get("mod", "none")
final = 3 + L / 10 + seed / 100
with open(os.path.join(args["out_dir"], "log.jsonl"), "a") as f:
    for it, loss in ((0, 4.5), (1, final - 0.05), (iters, final)):
        rec = {"iter": it, "tokens": 128 * it, "val_loss": loss, "flops": 1000.0 * L * 128 * it}
        if it:  # the pace of the interval before each eval: the run's s_per_iter is their median
            rec["ms_per_iter"] = 10.0 * L * it
        if mod != "none":
            rec.update(exec_train=[0.75] * 2 * L if it else None, exec_eval=[0.5, 0.7] * L)
        f.write(json.dumps(rec) + "\n")
with open(os.path.join(args["out_dir"], "final_eval.json"), "w") as f:  # the final eval: the same loss here
    json.dump({"iter": iters, "val_loss": final, "val_se": 0.001, "tokens": 1000}, f)
open(os.path.join(args["out_dir"], "ckpt.pt"), "w").close()
print("fake train.py done")
"""


def fake_log(n_layer, seed):
    """What FAKE_TRAIN logs: (final val loss, best val loss, realised train FLOPs per token)."""
    final = 3 + n_layer / 10 + seed / 100
    return final, final - 0.05, 1000.0 * n_layer


@pytest.fixture
def fake_train(tmp_path, monkeypatch):
    """Sweeps launch FAKE_TRAIN instead of train.py; returns argv(out_dir): the argv of each launch there."""
    script = tmp_path / "fake_train.py"
    script.write_text(FAKE_TRAIN)
    monkeypatch.setattr(flops, "TRAIN_SCRIPT", str(script))
    return lambda out_dir: [json.loads(line) for line in open(out_dir / "argv.jsonl")]


def test_sweep_resumes_and_reports_failures(data_dir, tmp_path, capsys, monkeypatch, fake_train):
    """Sweep bookkeeping on fake runs: each run's command, a failed run recorded and the sweep going on,
    rows from each log (realised FLOPs, executed fractions, best loss), and a rerun that skips finished
    runs, retries failed ones and resumes one that left a checkpoint. The figure is drawn once, at the end."""
    base, budget = tiny_train_config(data_dir, tmp_path), 1.5e9
    plotted, plot_results = [], flops.plot_results
    monkeypatch.setattr(flops, "plot_results", lambda *args: plotted.append(args))
    argv = [f"--train_config={base}", f"--out_root={tmp_path}", "--sweep_name=s", "--residuals=['prenorm']",
            "--depths=[0, 1, 2]", f"--budget={budget}", "--mod_runs=[('nag', 'nag', 0.25)]"]
    rows = flops.run_sweep(argv)
    out = capsys.readouterr().out
    assert f"budget: {budget:.3g} training FLOPs per run (train.py --max_flops)" in out
    statuses = ["failed", "done", "done"] * 2  # prenorm at depths 0, 1, 2, then nag with MoD at each depth
    names = ["prenorm_L0", "prenorm_L1", "prenorm_L2", "nag_L0_nag0.25", "nag_L1_nag0.25", "nag_L2_nag0.25"]
    assert [r["run"] for r in rows] == names and [r["status"] for r in rows] == statuses
    assert "prenorm_L0: failed" in out and "nag_L2_nag0.25: done" in out
    root = tmp_path / "s"
    for name, r in zip(names, rows):  # each launched once: the config, its out_dir, the budget, its cell
        (cmd,) = fake_train(root / name)
        mod = ["--mod='nag'", "--mod_rate=0.25"] if name.startswith("nag") else []
        assert cmd == [str(base), f"--out_dir={root / name}", f"--max_flops={budget}",
                       f"--residual='{r['residual']}'", f"--n_layer={r['n_layer']}", *mod]
    for r in rows[1:3] + rows[4:]:  # each row is its log's: final and best loss, iters, realised FLOPs
        final, best, per_token = fake_log(r["n_layer"], 0)
        assert (r["val_loss"], r["best_val_loss"], r["iters"]) == (final, best, 4)
        assert r["train_flops_per_token"] == per_token
    assert "iters" not in rows[0] and "val_loss" not in rows[0]  # failed: nothing logged
    # MoD: executed fractions are the mean over sublayers, the eval FLOPs from the last eval's routing
    mod_config = GPTConfig(vocab_size=65, n_layer=1, n_head=2, n_embd=32, block_size=32, residual="nag",
                           mod="nag", mod_rate=0.25)
    assert (rows[4]["mod"], rows[4]["mod_rate"]) == ("nag", 0.25)
    assert rows[4]["exec_train"] == pytest.approx(0.75) and rows[4]["exec_eval"] == pytest.approx(0.6)
    assert rows[4]["eval_flops_per_token"] == sum(flops.forward_flops(mod_config, [0.5, 0.7]).values())
    assert rows[4]["params"] == flops.count_params(mod_config)[1]
    dense_config = GPTConfig(vocab_size=65, n_layer=1, n_head=2, n_embd=32, block_size=32)
    assert rows[1]["exec_train"] == rows[1]["exec_eval"] == 1.0
    assert rows[1]["eval_flops_per_token"] == sum(flops.forward_flops(dense_config).values())
    # after each run once a cell has finished one (5 runs), and at the end; then drawn for real (depths and
    # MoD cells: all three panels)
    assert len(plotted) == 6 and all(p[1:] == (budget, str(root / "results.png")) for p in plotted)
    assert [(c["cell"], c["n"]) for c in plotted[-1][0]] == [(n, int(s == "done")) for n, s in zip(names, statuses)]
    plot_results(*plotted[-1])
    for name in ("results.csv", "results.md", "results.png"):
        assert (root / name).stat().st_size > 0
    with open(root / "results.csv") as f:
        assert [(r["run"], r["status"], r["val_loss"]) for r in csv.DictReader(f)] == [
            (r["run"], r["status"], str(r.get("val_loss", ""))) for r in rows]
    table = (root / "results.md").read_text()
    assert "| prenorm_L0 | prenorm | 0 | - | 0 | - | 0/1 | - |" in table  # no finished run in that cell
    r = rows[4]
    assert (f"| nag_L1_nag0.25 | nag | 1 | nag | 0.25 | - | 1/1 | 4 | {r['params']:,} "
            f"| {r['train_flops_per_token']:.4g} | {r['eval_flops_per_token']:.4g} | 0.750 / 0.600 "
            f"| {r['val_loss']:.4f} | {r['best_val_loss']:.4f} |") in table
    assert "| prenorm_L0 | 1337 | failed |" in table and "| nag_L1_nag0.25 | 1337 | done | 4 |" in table

    # the sweep is killed during prenorm_L2: it left a checkpoint but no `done` marker
    os.remove(root / "prenorm_L2" / "done")
    finished = (root / "prenorm_L1" / "log.jsonl").read_text()
    rows = flops.run_sweep(argv)
    out = capsys.readouterr().out
    assert "prenorm_L1: already finished, skipped" in out and "nag_L1_nag0.25: already finished, skipped" in out
    assert "prenorm_L2: done" in out and "prenorm_L0: failed" in out  # unfinished and failed runs run again
    assert (root / "prenorm_L1" / "log.jsonl").read_text() == finished and len(fake_train(root / "prenorm_L1")) == 1
    first, again = fake_train(root / "prenorm_L2")
    assert again == first + ["--init_from=resume"]  # it continues from its checkpoint
    first, again = fake_train(root / "prenorm_L0")
    assert again == first  # a failed run left no checkpoint: it starts over
    assert [r["status"] for r in rows] == statuses


def test_equal_time_sweep(data_dir, tmp_path, capsys, monkeypatch, fake_train):
    """budget_seconds: every run gets --max_seconds and no --max_flops (budget's default gives way), and
    results.md says so and shows the FLOPs each cell really spent; a budget set too is an error."""
    monkeypatch.setattr(flops, "plot_results", lambda *args: None)  # drawn in test_sweep_resumes_and_reports_failures
    base = tiny_train_config(data_dir, tmp_path)
    argv = [f"--train_config={base}", f"--out_root={tmp_path}", "--sweep_name=s", "--residuals=['prenorm']",
            "--depths=[1, 2]", "--budget_seconds=30"]
    rows = flops.run_sweep(argv)
    assert "budget: 30 seconds of training per run (train.py --max_seconds)" in capsys.readouterr().out
    for r in rows:
        (cmd,) = fake_train(tmp_path / "s" / r["run"])
        assert cmd == [str(base), f"--out_dir={tmp_path / 's' / r['run']}", "--max_seconds=30",
                       "--residual='prenorm'", f"--n_layer={r['n_layer']}"]
    table = (tmp_path / "s" / "results.md").read_text()
    assert table.startswith("equal-time sweep at 30 seconds of training per run")
    for r in rows:  # the realised FLOPs of each cell's (one) run, as its log has them
        assert r["flops"] == 1000.0 * r["n_layer"] * 128 * 4
        assert table.split(f"| {r['cell']} |")[1].split("\n")[0].endswith(f"| {r['flops']:.3g} |")
    with pytest.raises(ConfigError, match="budget .FLOPs. and budget_seconds .time. are two kinds of sweep"):
        flops.run_sweep(argv + ["--budget=1e9"])


def test_sweep_runs_train_py(data_dir, tmp_path):
    """One real train.py run through the sweep: train.py takes its command line, trains the budget's
    iterations and logs what the row is read from (a MoD run: the FLOPs its top-k really ran)."""
    mod_config = GPTConfig(vocab_size=65, n_layer=1, n_head=2, n_embd=32, block_size=32, residual="nag",
                           mod="nag", mod_rate=0.25)
    per_token = flops.train_flops_per_token(mod_config)
    argv = [f"--train_config={tiny_train_config(data_dir, tmp_path)}", f"--out_root={tmp_path}", "--sweep_name=s",
            "--residuals=[]", "--depths=[1]", f"--budget={3 * per_token * 4 * 32}", "--mod_runs=[('nag', 'nag', 0.25)]"]
    (row,) = flops.run_sweep(argv)
    assert (row["run"], row["status"], row["iters"]) == ("nag_L1_nag0.25", "done", 3)  # the budget's 3 iterations
    assert row["flops"] == pytest.approx(3 * 4 * 32 * per_token)  # what train.py logged it ran
    assert row["train_flops_per_token"] == pytest.approx(per_token)  # realised: mod_keep of every sublayer
    assert row["train_flops_per_token"] < flops.train_flops_per_token(mod_config, [1.0] * 2)
    log = run_config.load_log(tmp_path / "s" / "nag_L1_nag0.25")
    assert all(r["exec_train"] == [TopKMoD.keep_fraction(mod_config)] * 2 for r in log if r["iter"] > 0)
    assert 3.0 < row["val_loss"] < 4.6  # near ln(65) = 4.17 after 3 iterations


def test_sweep_seeds_named_runs_and_parallel_jobs(data_dir, tmp_path, capsys, monkeypatch, fake_train):
    """On fake runs: seeds and named runs, each launched with its own keys, jobs at a time; results per cell."""
    base = tiny_train_config(data_dir, tmp_path)
    # no budget: every run trains its max_iters (3)
    argv = [f"--train_config={base}", f"--out_root={tmp_path}", "--sweep_name=s", "--residuals=['prenorm']",
            "--depths=[1]", "--budget=None", "--train_args=['--max_iters=3']", "--seeds=[1, 2]", "--jobs=2",
            "--runs=[('wide', {'residual': 'prenorm', 'n_layer': 1, 'n_embd': 64})]"]
    import matplotlib.pyplot as plt
    open_before = set(plt.get_fignums())  # figures other tests in this process left open
    live, most = [], [0]

    class Counting(subprocess.Popen):  # how many train.py processes run at once
        def __init__(self, *args, **kwargs):
            live[:] = [p for p in live if p.poll() is None] + [self]
            most[0] = max(most[0], len(live))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(flops.subprocess, "Popen", Counting)
    rows = flops.run_sweep(argv)
    out = capsys.readouterr().out
    assert most[0] == 2  # two at a time, never three
    # the plan comes first, then a progress line with an ETA per finished run
    root = tmp_path / "s"
    assert out.startswith(f"sweep s: 4 runs (2 cells x 2 seeds), 2 at a time: 0 finished (skipped), 0 to resume "
                          f"from a checkpoint, 4 to start\nbudget: each run's max_iters (3)\nresults: "
                          f"{root / 'results'}.{{csv,md,png}} after every run; each run in {root / '<run>'}/ "
                          f"(its output in stdout.txt)\nestimated time: unknown until the first run finishes\n")
    progress = re.findall(r"\[(\d)/4\] \w+: done in \d+s, val [\d.]+ \| elapsed [\d.]+ min, ETA [\d.]+ min\n", out)
    assert progress == ["1", "2", "3", "4"]
    assert [(r["run"], r["cell"], r["seed"], r["status"]) for r in rows] == [  # seed by seed
        ("prenorm_L1_s1", "prenorm_L1", 1, "done"), ("wide_s1", "wide", 1, "done"),
        ("prenorm_L1_s2", "prenorm_L1", 2, "done"), ("wide_s2", "wide", 2, "done")]
    for r in rows:  # each run launched with the train args, its own seed and the cell's overrides; no budget
        (cmd,) = fake_train(root / r["run"])
        wide = ["--n_embd=64"] if r["cell"] == "wide" else []
        assert cmd == [str(base), "--max_iters=3", f"--out_dir={root / r['run']}", "--residual='prenorm'",
                       "--n_layer=1", *wide, f"--seed={r['seed']}"]
        assert r["val_loss"] == fake_log(1, r["seed"])[0]
    assert all(r["iters"] == 3 for r in rows)
    assert all(r["s_per_iter"] == pytest.approx((10.0 + 30.0) / 2 / 1000) for r in rows)  # median of 10 and 30 ms
    assert rows[1]["params"] > rows[0]["params"] and rows[1]["args"] == "--n_embd=64" and rows[0]["args"] == ""
    with open(root / "results.csv") as f:
        assert [(r["run"], r["seed"]) for r in csv.DictReader(f)] == [(r["run"], str(r["seed"])) for r in rows]
    table = (root / "results.md").read_text()
    assert table.startswith("each run at its max_iters; seeds 1, 2.")
    for cell, pair in (("prenorm_L1", rows[0::2]), ("wide", rows[1::2])):  # mean ± sample std over the two seeds
        losses = [r["val_loss"] for r in pair]
        assert f"| {statistics.mean(losses):.4f} ± {statistics.stdev(losses):.4f} |" in table.split(f"| {cell} |")[1]
    # each cell against the first cell of its depth (both are 1 layer): the test of their losses by seed
    wide, base = ({r["seed"]: r["val_loss"] for r in rows[i::2]} for i in (1, 0))
    (cells,), _ = stats.family_cells([(wide, base)])
    assert f"| wide | prenorm_L1 | {' | '.join(cells)} |" in table
    assert "| prenorm_L1 | prenorm_L1 |" not in table  # a baseline is not tested against itself
    assert (root / "results.png").stat().st_size > 0
    assert set(plt.get_fignums()) == open_before  # the figure written after each run is closed, not kept alive
    # a rerun skips the finished runs and resumes a killed one (a checkpoint, no `done` marker); the plan
    # estimates the time left from the finished runs' seconds: 1 run at their mean, 200 s
    for r, seconds in zip(rows, ("100.0", "200.0", "300.0")):
        (root / r["run"] / "done").write_text(seconds)
    os.remove(root / rows[3]["run"] / "done")
    capsys.readouterr()
    flops.run_sweep(argv)
    out = capsys.readouterr().out
    assert out.count("already finished, skipped") == 3
    assert "4 runs (2 cells x 2 seeds), 2 at a time: 3 finished (skipped), 1 to resume from a checkpoint, 0 to start" in out
    assert "estimated time: 3.3 min: 1 to run at 200 s each (the mean of the 3 finished here), 2 at a time" in out
    # a bad key or seed list fails before anything runs
    for bad, match in (("--runs=[('x', {'n_layr': 2})]", "unknown config key 'n_layr'"),
                       ("--seeds=[1, 1]", "distinct integers"), ("--jobs=0", "positive integer"),
                       ("--baseline='wid'", "baseline='wid' is not a cell of this sweep")):
        with pytest.raises(ConfigError, match=match):
            flops.run_sweep([*argv[:2], "--sweep_name=bad", bad])
    assert not (tmp_path / "bad").exists()


def sweep_argv(base, tmp_path, *extra):
    """A single-budget sweep of prenorm at 1-4 layers (the fake train.py logs 4 iterations for each)."""
    return [f"--train_config={base}", f"--out_root={tmp_path}", "--sweep_name=s", "--residuals=['prenorm']",
            "--depths=[1, 2, 3, 4]", "--budget=1.5e9", *extra]


def results_csv(root):
    with open(root / "results.csv") as f:
        return {r["run"]: r for r in csv.DictReader(f)}


def test_sweep_reevaluates_finished_runs_without_a_final_eval(data_dir, tmp_path, capsys, monkeypatch, fake_train):
    """A finished run (done, log.jsonl, ckpt.pt) whose final_eval.json is gone is launched again by the next
    sweep, resumed from its checkpoint (--init_from=resume) and said to be re-evaluated; its `done` (the
    training's seconds) stays as it was, and its row gets the new final eval. A finished run with its
    final_eval.json is skipped; one without final_eval.json and without ckpt.pt (nothing to evaluate) is
    skipped too and keeps its log's last val loss, with no eval_tokens; and with final_eval_tokens=0 no run
    is re-evaluated."""
    monkeypatch.setattr(flops, "plot_results", lambda *args: None)
    argv = sweep_argv(tiny_train_config(data_dir, tmp_path), tmp_path)
    flops.run_sweep(argv)
    root = tmp_path / "s"
    for name in ("prenorm_L1", "prenorm_L3"):
        os.remove(root / name / "final_eval.json")
    os.remove(root / "prenorm_L3" / "ckpt.pt")
    (root / "prenorm_L1" / "done").write_text("123.4\n")  # the seconds its training took
    capsys.readouterr()
    rows = {r["run"]: r for r in flops.run_sweep(argv)}
    out = capsys.readouterr().out
    assert "prenorm_L1: finished without a final eval: re-evaluated from its checkpoint\n" in out.splitlines(True)
    # the progress count: the 3 skipped runs, then the re-evaluated one as it finishes
    assert re.findall(r"^\[(\d)/4\] (\w+)", out, re.M) == [
        ("1", "prenorm_L2"), ("2", "prenorm_L3"), ("3", "prenorm_L4"), ("4", "prenorm_L1")]
    assert "4 runs (4 cells, one run each), 1 at a time: 3 finished (skipped), 1 to resume from a checkpoint, " \
           "0 to start" in out
    first, again = fake_train(root / "prenorm_L1")
    assert again == first + ["--init_from=resume"]
    assert (root / "prenorm_L1" / "done").read_text() == "123.4\n"
    assert rows["prenorm_L1"]["seconds"] == 123.4 and rows["prenorm_L1"]["eval_tokens"] == 1000
    for name in ("prenorm_L2", "prenorm_L3", "prenorm_L4"):
        assert f"{name}: already finished, skipped" in out and len(fake_train(root / name)) == 1
    final, _, _ = fake_log(3, 0)
    assert rows["prenorm_L3"]["val_loss"] == final and "eval_tokens" not in rows["prenorm_L3"]
    read = results_csv(root)
    assert (read["prenorm_L3"]["eval_tokens"], read["prenorm_L3"]["val_se"]) == ("", "")
    assert (read["prenorm_L2"]["eval_tokens"], read["prenorm_L2"]["val_se"]) == ("1000", "0.001")
    assert (read["prenorm_L1"]["status"], read["prenorm_L1"]["eval_tokens"]) == ("done", "1000")
    # final_eval_tokens=0 (a sweep of its own: it is a setting of every run): a run without final_eval.json
    # is finished as it is
    argv = [*argv[:2], "--sweep_name=s0", *argv[3:], "--train_args=['--final_eval_tokens=0']"]
    flops.run_sweep(argv)
    os.remove(tmp_path / "s0" / "prenorm_L2" / "final_eval.json")
    capsys.readouterr()
    flops.run_sweep(argv)
    assert capsys.readouterr().out.count("already finished, skipped") == 4
    assert len(fake_train(tmp_path / "s0" / "prenorm_L2")) == 1


def test_a_sweep_never_mixes_runs_of_other_settings(data_dir, tmp_path, capsys, monkeypatch, fake_train):
    """A sweep run again after its budget, train_args, train config or a cell's keys changed skipped every
    finished run as "already finished" and titled their table with the new settings. Each run records the
    configuration it was started with (sweep_run.json; a run from before that: train.py's config.json); a
    rerun that would keep or resume a run started otherwise is a one-line error naming the runs, the
    settings and the fix, before anything runs or is written. The same settings resume; another sweep_name
    takes the new ones."""
    monkeypatch.setattr(flops, "plot_results", lambda *args: None)
    base = tiny_train_config(data_dir, tmp_path)
    wide = {"residual": "prenorm", "n_layer": 1, "n_embd": 64}
    argv = [f"--train_config={base}", f"--out_root={tmp_path}", "--sweep_name=s", "--residuals=['prenorm']",
            "--depths=[1, 2]", "--budget=1.5e9", f"--runs=[('wide', {wide!r})]"]
    flops.run_sweep(argv)
    root = tmp_path / "s"
    os.remove(root / "wide" / "done")  # killed mid-run: its checkpoint would be resumed
    before = (root / "results.csv").read_text()
    other = tmp_path / "other.py"
    other.write_text(base.read_text().replace("batch_size = 4", "batch_size = 8"))
    every = "prenorm_L1, prenorm_L2, wide"
    for change, names, said in (
            (["--budget=3e9"], every, "max_flops was 1500000000.0, now 3000000000.0"),
            (["--train_args=['--learning_rate=1e-3']"], every, "learning_rate was 0.0006, now 0.001"),
            ([f"--train_config={other}"], every, "batch_size was 4, now 8"),
            ([f"--runs=[('wide', {dict(wide, n_embd=96)!r})]"], "wide", "n_embd was 64, now 96")):
        with pytest.raises(ConfigError) as e:
            flops.run_sweep(argv + change)
        msg = str(e.value)
        assert "\n" not in msg and f"({names}: {said}); a sweep never mixes them" in msg, msg
        assert "another --sweep_name or --out_root" in msg
    assert all(len(fake_train(root / r)) == 1 for r in ("prenorm_L1", "prenorm_L2", "wide"))  # nothing ran
    assert (root / "results.csv").read_text() == before
    # a run from before sweep_run.json: the command in train.py's config.json is its record (its config is
    # train.py's after planning, max_iters and the LR schedule resolved: not what the sweep gave)
    os.remove(root / "prenorm_L2" / flops.SWEEP_RECORD)
    (root / "prenorm_L2" / "config.json").write_text(json.dumps({
        "command": shlex.join(["python", "train.py", *fake_train(root / "prenorm_L2")[0]]),
        "config": {"max_iters": 24, "lr_decay_iters": 24, "device": "cpu"}}))
    with pytest.raises(ConfigError, match=r"\(prenorm_L2: max_flops was 1500000000.0, now 3000000000.0\)"):
        flops.run_sweep(argv + ["--budget=3e9", "--cells=['prenorm_L2']"])
    # the same settings: the finished runs skipped, the killed one resumed
    capsys.readouterr()
    rows = flops.run_sweep(argv)
    out = capsys.readouterr().out
    assert out.count("already finished, skipped") == 2 and "have no sweep_run.json" not in out
    assert fake_train(root / "wide")[1][-1] == "--init_from=resume" and all(r["status"] == "done" for r in rows)
    # with no record at all the run is kept, and the sweep says its settings went unchecked
    os.remove(root / "prenorm_L2" / "config.json")
    capsys.readouterr()
    flops.run_sweep(argv)
    assert "note: 1 kept run(s) (prenorm_L2) have no sweep_run.json nor config.json" in capsys.readouterr().out
    # the new budget in a folder of its own: every run starts
    rows = flops.run_sweep([*argv, "--sweep_name=s3", "--budget=3e9"])
    assert [len(fake_train(tmp_path / "s3" / r["run"])) for r in rows] == [1, 1, 1]


def test_results_take_the_final_eval_of_the_last_iteration(data_dir, tmp_path, monkeypatch, fake_train):
    """results.csv's val_loss, val_se and eval_tokens come from final_eval.json when its iter is the log's
    last; a final_eval.json of another iteration (a stale one) is ignored: val_loss is the log's last eval,
    val_se and eval_tokens empty (run_result and the sweep's CSV both)."""
    monkeypatch.setattr(flops, "plot_results", lambda *args: None)
    argv = sweep_argv(tiny_train_config(data_dir, tmp_path), tmp_path)
    flops.run_sweep(argv)
    root = tmp_path / "s"
    (root / "prenorm_L1" / "final_eval.json").write_text(
        json.dumps({"iter": 4, "val_loss": 2.5, "val_se": 0.0123, "tokens": 4096}))
    (root / "prenorm_L2" / "final_eval.json").write_text(
        json.dumps({"iter": 3, "val_loss": 9.9, "val_se": 0.5, "tokens": 4096}))
    os.remove(root / "prenorm_L2" / "ckpt.pt")  # else the sweep would re-evaluate it (test above)
    assert flops.run_result(root / "prenorm_L1")["val_loss"] == 2.5
    stale = flops.run_result(root / "prenorm_L2")
    assert stale["val_loss"] == fake_log(2, 0)[0] and "val_se" not in stale and "eval_tokens" not in stale
    flops.run_sweep(argv)
    read = results_csv(root)
    assert {"val_se", "eval_tokens"} <= set(read["prenorm_L1"])
    assert (read["prenorm_L1"]["val_loss"], read["prenorm_L1"]["val_se"], read["prenorm_L1"]["eval_tokens"]) == \
        ("2.5", "0.0123", "4096")
    assert float(read["prenorm_L1"]["best_val_loss"]) == fake_log(1, 0)[1]  # the log's best: not the final eval's
    assert (float(read["prenorm_L2"]["val_loss"]), read["prenorm_L2"]["val_se"],
            read["prenorm_L2"]["eval_tokens"]) == (fake_log(2, 0)[0], "", "")
    assert "| 2.5000 |" in (root / "results.md").read_text().split("| prenorm_L1 |")[1].split("\n")[0]


def test_sweep_runs_only_the_named_cells(data_dir, tmp_path, monkeypatch, fake_train):
    """cells=[...] runs those cells alone (in the sweep's order, whatever the list's); an unknown name in
    cells, or in cell_budgets, is a one-line error naming it and listing the sweep's cells, before anything
    runs."""
    monkeypatch.setattr(flops, "plot_results", lambda *args: None)
    base = tiny_train_config(data_dir, tmp_path)
    argv = [f"--train_config={base}", f"--out_root={tmp_path}", "--sweep_name=s", "--residuals=['prenorm', 'nag']",
            "--depths=[1, 2]", "--budget=1.5e9"]
    rows = flops.run_sweep(argv + ["--cells=['nag_L2', 'prenorm_L1']"])
    assert [r["run"] for r in rows] == ["prenorm_L1", "nag_L2"] and all(r["status"] == "done" for r in rows)
    assert sorted(p.name for p in (tmp_path / "s").iterdir() if p.is_dir()) == ["nag_L2", "prenorm_L1"]
    assert list(results_csv(tmp_path / "s")) == ["prenorm_L1", "nag_L2"]
    listed = "its cells are prenorm_L1, prenorm_L2, nag_L1, nag_L2"
    for bad, key in (("--cells=['prenorm_L1', 'nag_L9']", "cells"),
                     ("--cell_budgets={'prenorm_L7': [1e9]}", "cell_budgets")):
        for budget in (["--budget=1.5e9"], ["--budget=None", "--budgets=[1e9, 2e9]"]):
            with pytest.raises(ConfigError) as e:
                flops.run_sweep([*argv[:2], "--sweep_name=bad", *argv[3:5], *budget, bad])
            msg = str(e.value)
            assert msg.startswith(f"{key} names ") and listed in msg and "\n" not in msg
            assert ("'nag_L9'" if key == "cells" else "'prenorm_L7'") in msg and "'prenorm_L1'" not in msg
    with pytest.raises(ConfigError, match=r"^cells=\[\] names no cell to run: name some of prenorm_L1, "):
        flops.run_sweep([*argv[:2], "--sweep_name=bad", *argv[3:], "--cells=[]"])
    with pytest.raises(ConfigError, match="^cell_budgets gives cells their own budgets in a sweep over budgets"):
        flops.run_sweep([*argv[:2], "--sweep_name=bad", *argv[3:], "--cell_budgets={'prenorm_L1': [1e9, 2e9]}"])
    assert not (tmp_path / "bad").exists()


def test_results_from_a_csv_test_each_cell_against_its_baseline(tmp_path, capsys):
    """flops.py results FILE.csv: results.md's tables from a results.csv alone (results/ keeps those), each
    cell against the first cell of its depth or --baseline; the numbers are stats.family_cells' over the
    table's comparisons (tests/test_stats.py), so a cell paired with the wrong baseline, or wrong losses, fails.
    Each cell's
    median s_per_iter over its baseline's (a CSV without the column: seconds / iters) ends the row."""
    losses = {"a_L2": [1.90, 1.92, 1.91], "b_L2": [1.80, 1.81, 1.83], "c_L4": [1.70, 1.78, 1.72],
              "d_L4": [1.69, 1.73, 1.70]}
    paces = {"a_L2": [0.10, 0.12, 0.11], "b_L2": [0.30, 0.22, 0.20]}  # medians 0.11 and 0.22; c, d: 10 s / 100 iters
    seconds = {"c_L4": [10.0, 10.0, 10.0], "d_L4": [24.0, 25.0, 26.0]}  # 0.1 and 0.25 s per iteration
    path = tmp_path / "results.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, flops.FIELDS)
        w.writeheader()
        for cell, vals in losses.items():
            for seed, v in enumerate(vals, 1):
                w.writerow({"run": f"{cell}_s{seed}", "cell": cell, "seed": seed, "residual": "nag",
                            "n_layer": int(cell[-1]), "mod": "", "mod_rate": 0.0, "args": "", "status": "done",
                            "iters": 100, "val_loss": v, "best_val_loss": v - 0.01,
                            "seconds": seconds.get(cell, [10.0] * 3)[seed - 1],
                            "s_per_iter": paces[cell][seed - 1] if cell in paces else ""})

    def rows(*options):
        text = flops.main(["results", str(path), *options]) or capsys.readouterr().out
        return {r[0]: r[1:] for r in ([c.strip() for c in line.split("|")[1:-1]] for line in
                                      text.split("against a baseline cell")[1].split("Every run")[0].splitlines())
                if r and r[0] in losses}
    seeded = {c: dict(enumerate(v, 1)) for c, v in losses.items()}
    family = lambda *pairs: stats.family_cells([(seeded[c], seeded[b]) for c, b in pairs])[0]  # noqa: E731
    got = rows()
    assert set(got) == {"b_L2", "d_L4"}  # a and c are the baselines of their depths
    want = family(("b_L2", "a_L2"), ("d_L4", "c_L4"))
    assert got["b_L2"] == ["a_L2", *want[0], "2.00x"]
    assert got["d_L4"] == ["c_L4", *want[1], "2.50x"]
    assert got["b_L2"][5].endswith("*") and not got["d_L4"][5].endswith("*")  # the Holm-adjusted p
    got = rows("--baseline=b_L2")
    assert set(got) == {"a_L2", "c_L4", "d_L4"}
    assert got["d_L4"] == ["b_L2", *family(("a_L2", "b_L2"), ("c_L4", "b_L2"), ("d_L4", "b_L2"))[2], "1.14x"]
    with pytest.raises(ConfigError, match="baseline='e' is not a cell"):
        flops.main(["results", str(path), "--baseline=e"])
    with pytest.raises(ConfigError, match="no results file"):
        flops.main(["results", str(tmp_path / "missing.csv")])
    # a cell from another sweep's CSV is tested against this one's cells
    other = tmp_path / "other.csv"
    rows_e = [line for line in path.read_text().splitlines()[1:] if line.startswith("b_L2_")]
    other.write_text(path.read_text().splitlines()[0] + "\n" + "\n".join(r.replace("b_L2", "e_L2") for r in rows_e) + "\n")
    text = flops.main(["results", str(path), str(other)])
    seeded["e_L2"] = seeded["b_L2"]
    want = family(("b_L2", "a_L2"), ("d_L4", "c_L4"), ("e_L2", "a_L2"))
    assert f"| e_L2 | a_L2 | {' | '.join(want[2])} |" in text


def test_sweep_needs_a_sweep_config(monkeypatch):
    """`flops.py sweep` with no config file used to start the default sweep (hours of runs): now a
    one-line error that lists the shipped sweep configs, and nothing runs."""
    started = []
    monkeypatch.setattr(flops, "run_sweep", started.append)
    for argv in (["sweep"], ["sweep", "--jobs=2"]):
        with pytest.raises(ConfigError, match="needs a sweep config") as e:
            flops.main(argv)
        assert "\n" not in str(e.value)
        assert all(f"config/{p.name}" in str(e.value) for p in (REPO / "config").glob("sweep_*.py"))
    assert started == []


def test_plan_needs_a_sweep_config_and_lists_its_own_keys(monkeypatch, capsys):
    """`flops.py plan` with no config planned the unnamed default sweep: now the one-line error `sweep` gives;
    `plan --help` listed the sweep's keys but not its own --gpu and --mfu."""
    monkeypatch.setattr(flops, "plan", lambda argv: pytest.fail("planned without a sweep config"))
    for argv in (["plan"], ["plan", "--gpu=H100"]):
        with pytest.raises(ConfigError, match="^flops.py plan needs a sweep config: python flops.py plan config/") as e:
            flops.main(argv)
        assert "\n" not in str(e.value) and "config/sweep_shakespeare_cpu.py" in str(e.value)
    monkeypatch.undo()
    with pytest.raises(SystemExit):
        flops.main(["plan", "--help"])
    keys = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    assert keys[:2] == ["gpu", "mfu"] and {"budget", "budgets", "seeds", "train_config"} <= set(keys)


def test_plan_of_a_sweep_on_the_cpu_gives_no_gpu_hours(data_dir, tmp_path, monkeypatch):
    """`flops.py plan` printed an H100's hours ("0.0 hours") for a sweep that runs on the CPU. Without --gpu the
    hours are those of the GPU the runs' device picks on this machine; on a CPU there are none, and it says why
    and how to get a GPU's; --gpu names one explicitly."""
    cfg = tmp_path / "sweep.py"
    cfg.write_text(f"train_config = {str(tiny_train_config(data_dir, tmp_path))!r}\nresiduals = ['prenorm']\n"
                   "depths = [1]\nbudget = 1e12\n")  # the tiny config's device: 'cpu'
    text = flops.main(["plan", str(cfg)])
    assert "hours" not in text.split("no hours")[0] and "TFLOP/s" not in text
    assert "no hours: its runs' device (cpu) is the CPU on this machine" in text and "--gpu=H100" in text
    assert "on one A100 (312 TFLOP/s peak bf16) at 35% MFU" in flops.main(["plan", str(cfg), "--gpu=A100"])
    # device auto: the CPU on a machine without a GPU, the GPU on one with it
    cfg.write_text(cfg.read_text() + "train_args = ['--device=auto']\n")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "no hours: its runs' device (auto) is the CPU on this machine" in flops.main(["plan", str(cfg)])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    text = flops.main(["plan", str(cfg)])
    assert "on one NVIDIA H100 80GB HBM3 (989 TFLOP/s peak bf16) at 35% MFU" in text and "no hours" not in text


def test_results_refuses_a_csv_without_runs_or_with_a_column_missing(tmp_path):
    """`flops.py results` on a header-only CSV printed tables of nothing (rc 0), and on a CSV without its
    residual column gave a traceback. Every column a results.csv has had since the first sweep is needed
    (a missing one is named); the columns added later (LATER_FIELDS) may be missing, as in the older CSVs
    in results/."""
    src = REPO / "results" / "sweep_mod_cpu.csv"
    with open(src, newline="") as f:
        header, *rows = list(csv.reader(f))
    empty = tmp_path / "empty.csv"
    empty.write_text(",".join(flops.FIELDS) + "\n")
    for verb in ("results", "multiplier", "optimizers"):
        with pytest.raises(ConfigError, match=f"^{re.escape(str(empty))} holds no runs .its header alone.") as e:
            flops.main([verb, str(empty)])
        assert "\n" not in str(e.value)
    needed = [k for k in flops.FIELDS if k not in flops.LATER_FIELDS]
    assert set(needed) <= set(header) and not set(flops.LATER_FIELDS) & set(header)
    for column in needed:
        path = tmp_path / f"no_{column}.csv"
        i = header.index(column)
        with open(path, "w", newline="") as f:
            csv.writer(f).writerows([r[:i] + r[i + 1:] for r in [header, *rows]])
        said = ("its header has no run, cell, seed and val_loss" if column in ("run", "cell", "seed", "val_loss")
                else f"it has no {column} column, which")
        with pytest.raises(ConfigError, match=f"is not a sweep's results.csv .{said} .*: pass out/<sweep>/") as e:
            flops.main(["results", str(path)])
        assert "\n" not in str(e.value)


# a stand-in for train.py that waits to be stopped: writes its pid, then on SIGINT / SIGTERM takes half a
# second (its checkpoint), writes the signal's name and exits 128 + signum, as train.py does
SLEEPY_TRAIN = r"""import os, signal, sys, time
out_dir = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--out_dir="))
def stop(signum, frame):
    time.sleep(0.5)
    open(os.path.join(out_dir, "signal.txt"), "w").write(signal.Signals(signum).name)
    sys.exit(128 + signum)
signal.signal(signal.SIGINT, stop)
signal.signal(signal.SIGTERM, stop)
open(os.path.join(out_dir, "pid"), "w").write(str(os.getpid()))
time.sleep(60)
"""


@pytest.mark.parametrize("budgets", [None, [1e9, 2e9]])
def test_sigterm_to_a_sweep_stops_its_runs(data_dir, tmp_path, capsys, monkeypatch, budgets):
    """SIGTERM to a sweep goes on to both running train.py processes, which checkpoint and exit; the sweep
    waits for them (none is left running when it exits), says how to resume and exits 143. In this
    process (no second torch import): a thread sends the signal once both runs have started. A budget
    sweep stopped in its first budget gives its own command to resume (not that budget's alone)."""
    script, config = tmp_path / "sleepy_train.py", tmp_path / "sweep_test.py"
    script.write_text(SLEEPY_TRAIN)
    monkeypatch.setattr(flops, "TRAIN_SCRIPT", str(script))
    config.write_text(f"sweep_name = 's'\nout_root = {str(tmp_path)!r}\n"
                      f"train_config = {str(tiny_train_config(data_dir, tmp_path))!r}\n"
                      f"residuals = ['prenorm']\ndepths = [1, 2]\nbudget = None\nbudgets = {budgets!r}\njobs = 2\n")
    root = tmp_path / "s" / ("b1e09" if budgets else "")
    pid_files = [root / run / "pid" for run in ("prenorm_L1", "prenorm_L2")]

    def sigterm_once_started():
        for _ in range(300):
            if all(p.exists() and p.read_text() for p in pid_files):
                return os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)

    def uncaught(signum, frame):  # a sweep that leaves SIGTERM alone would otherwise end pytest
        raise RuntimeError("the sweep did not handle SIGTERM")
    previous = signal.signal(signal.SIGTERM, uncaught)
    threading.Thread(target=sigterm_once_started, daemon=True).start()
    try:
        with pytest.raises(SystemExit) as stopped:
            flops.main(["sweep", str(config)])
        assert stopped.value.code == 128 + signal.SIGTERM
        for p in pid_files:
            assert (p.parent / "signal.txt").read_text() == "SIGTERM"  # each run got it
            with pytest.raises(ProcessLookupError):  # and is gone, not an orphan still training
                os.kill(int(p.read_text()), 0)
        assert f"Resume with the same command: python flops.py sweep {config} (finished" in capsys.readouterr().err
        assert signal.getsignal(signal.SIGTERM) is uncaught  # the sweep put back the handler it found
    finally:  # whatever failed above, leave no process of this test behind
        signal.signal(signal.SIGTERM, previous)
        for p in pid_files:
            with contextlib.suppress(ProcessLookupError, FileNotFoundError, ValueError):
                os.kill(int(p.read_text()), signal.SIGKILL)


def test_breakdown_names_the_padded_vocab_only_when_padded(data_dir, tmp_path, capsys):
    """The 65-character vocab is not padded (padding to 128 would double the head); gpt2's 50257 is, to
    50304 (model.py's rule): the breakdown prints the padded size only then."""
    quickstart = str(REPO / "config" / "shakespeare_char_cpu.py")
    flops.main([quickstart, f"--data_dir={data_dir}"])
    assert "T=64, V=65\n" in capsys.readouterr().out
    flops.main([quickstart, f"--data_dir={tmp_path}"])  # no meta.pkl: gpt2's vocab
    assert "T=64, V=50257 (padded to 50304)\n" in capsys.readouterr().out


# -----------------------------------------------------------------------------
# the docs' count and the shipped results

def test_the_docs_name_every_term_flops_py_prints():
    """docs/flops.md's count and the README's left out the hc/mhc rows that `python flops.py` prints: every
    term of every mode, and of the options that add their own (hc_dynamic, mhc_res, value_residual), is
    named in both, and docs/flops.md names the backbone's and the other modes' too."""
    docs = (REPO / "docs" / "flops.md").read_text().split("## Checked against torch")[0]
    readme = (REPO / "README.md").read_text().split("- **The count**")[1].split("- **MFU**")[0]
    configs = [dict(residual=r) for r in RESIDUALS] + [
        dict(residual="hc", hc_dynamic=True), dict(residual="mhc", mhc_res="birkhoff"),
        dict(residual="attnres", attnres_query="input"), dict(value_residual="half")]
    terms = set()
    for kw in configs:
        terms |= set(flops.forward_flops(GPTConfig(vocab_size=65, n_layer=2, n_head=2, n_embd=32, block_size=16, **kw)))
    assert {"hc_mix", "hc_read", "hc_write", "hc_dynamic", "mhc_proj", "mhc_sinkhorn", "mhc_birkhoff", "dwa",
            "mudd_mix", "value_residual"} <= terms
    for term in sorted(terms):
        assert f"`{term}`" in docs, term
    for term in sorted(terms - {"attn_proj", "attn_scores", "mlp", "head", "nag_modulator", "nag_modulator_mix",
                                "attnres_depth", "attnres_query"}):  # the README names those in words
        assert f"`{term}`" in readme, term


def test_results_reads_one_budget_of_a_budgets_csv(capsys):
    """`flops.py results` on a budgets sweep's CSV (every budget in one) refused, naming --budget; with
    --budget=B it tests the runs of that budget alone: the prenorm cell's mean is the mean of its runs at B, not
    of every budget's, and a budget the CSV lacks is a one-line error listing those it has."""
    csv_path = str(REPO / "results" / "sweep_multiplier_cpu.csv")
    with pytest.raises(ConfigError, match="add --budget=B"):
        flops.main(["results", csv_path])
    rows = flops.read_results(csv_path)
    mean = statistics.mean(r["val_loss"] for r in rows if r["cell"] == "prenorm" and r["budget"] == 2.5e12)
    assert abs(mean - statistics.mean(r["val_loss"] for r in rows if r["cell"] == "prenorm")) > 0.05
    text = flops.main(["results", csv_path, "--budget=2.5e12"])
    row = next(line for line in text.splitlines() if line.startswith("| prenorm | prenorm |"))
    assert f"| {mean:.4f} ± " in row, row
    with pytest.raises(ConfigError, match=r"no run has budget 3e\+12: the CSVs' budgets are 6.25e\+11, 1.25e\+12"):
        flops.main(["results", csv_path, "--budget=3e12"])


def test_a_results_csv_with_nothing_to_compare_says_why(capsys):
    """`flops.py results results/sweep_shakespeare_mhc_cpu.csv` alone printed an empty comparison table: every
    cell is alone at its depth. It now says so and names what to add."""
    text = flops.main(["results", str(REPO / "results" / "sweep_shakespeare_mhc_cpu.csv")])
    section = text.split("against a baseline cell")[1].split("Every run")[0]
    assert "| cell | baseline |" not in section
    assert "No comparison: every cell is the only one of its depth (2, 4, 8 layers)" in section
    assert "python flops.py results results/sweep_shakespeare_cpu.csv results/sweep_shakespeare_mhc_cpu.csv" in section


def test_the_readme_command_for_mhc_at_equal_flops_gives_its_numbers(capsys):
    """The README's mhc against prenorm at equal FLOPs, 2, 4 and 8 layers ("mhc is not better than prenorm at any
    depth (+a, +b, +c; ..."): its row names the command with every CSV (the _s45 one too, for prenorm's seeds 4 and
    5 at 4 layers), and that command prints those three differences."""
    readme = (REPO / "README.md").read_text()
    quoted = re.search(r"mhc is not better than prenorm at any depth \(([+-]0\.\d{4}), ([+-]0\.\d{4}), "
                       r"([+-]0\.\d{4});", readme)
    row = next(line for line in readme.splitlines() if quoted[0] in line)
    command = next(c for c in re.findall(r"`(python flops\.py results [^`]*)`", row) if "mhc" in c)
    assert "results/sweep_shakespeare_cpu_s45.csv" in command
    text = flops.main(["results", *[str(REPO / a) for a in command.split()[3:]]])
    rows = {r[0]: r[1:] for r in ([c.strip() for c in line.split("|")[1:-1]] for line in
                                  text.split("against a baseline cell")[1].splitlines()) if r and r[0].startswith("mhc_")}
    assert [(rows[f"mhc_L{L}"][0], f"{float(rows[f'mhc_L{L}'][1]):+.4f}") for L in (2, 4, 8)] == [
        (f"prenorm_L{L}", q) for L, q in zip((2, 4, 8), quoted.groups())], rows


@pytest.mark.parametrize("content", [b"# a Markdown page\n\nsome text, with a comma\n", b"a,b\n1,2\n",
                                     b"\xff\xfe\x00binary", b"run,cell,seed,val_loss\nr1,c,one,2.0\n"])
def test_results_refuses_a_file_that_is_not_a_results_csv(content, tmp_path):
    """flops.py results (and multiplier, optimizers: one reader) given another file: a one-line error that
    says what to pass, not a traceback from deep in the parsing."""
    path = tmp_path / "x.csv"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match="is not a sweep's results.csv .* pass out/<sweep>/results.csv"):
        flops.main(["results", str(path)])


def test_every_cpu_sweep_runs_in_fp32():
    """The committed CPU results ran in fp32, and dtype auto now picks bf16 on a CPU that computes it: every CPU
    sweep config pins --dtype=float32, so that running it again reproduces them (and its kept runs resume as
    they started)."""
    paths = sorted((REPO / "config").glob("sweep_*_cpu.py"))
    assert len(paths) >= 19
    for path in paths:
        sw = configure([str(path)], flops.SWEEP_DEFAULTS)
        assert "--dtype=float32" in sw["train_args"], path.name
        assert flops.train_config([str(REPO / sw["train_config"]), *sw["train_args"]])["dtype"] == "float32"
