"""bench.py runs on a CPU and prints one row per kernel, per residual mode and per MoD setting."""
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench  # noqa: E402
from configurator import ConfigError  # noqa: E402
from model import RESIDUALS  # noqa: E402


def test_bench_prints_every_kernel_and_mode(capsys):
    times = bench.main(["--section=all", "--reps=1", "--compile=False", "--batch_size=2"])
    out = capsys.readouterr().out
    assert set(RESIDUALS) <= set(times) and all(t > 0 for t in times.values())
    for name in ("rms_norm", "nag_update", "depth_attention"):
        assert f"| {name} | eager |" in out
    for residual in RESIDUALS:
        assert f"| {residual} |" in out
    # the model table: each mode's ratio is its own step time over prenorm's, and its saved activations
    # over prenorm's (attnres keeps every sublayer's output: more than prenorm)
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in out.split("## model step")[1].split("##")[0].splitlines() if line.startswith("| ")}
    for residual in RESIDUALS:
        ms, ratio, _, _, saved_mib, saved_ratio = rows[residual]
        assert ratio == f"{times[residual] / times['prenorm']:.2f}x"
        assert float(saved_ratio[:-1]) == pytest.approx(float(saved_mib) / float(rows["prenorm"][4]), abs=0.02)
    assert float(rows["attnres"][5][:-1]) > 1.0
    for residual, mod in bench.MOD_RUNS:
        assert all((residual, mod, rate) in times for rate in (0.0, 0.25, 0.5))
        assert f"| {residual} | {mod} | 0.5 |" in out


def test_bench_rejects_an_unknown_section():
    with pytest.raises(ConfigError, match="unknown section"):
        bench.main(["--section=kernel", "--reps=1"])


def test_bench_compile_prints_every_mode_and_variant(capsys):
    """--section=compile's table (aot_eager, one layer and two modes here, to stay quick): each mode in
    every variant, with saved-activation ratios to prenorm."""
    times, saved = bench.bench_compile(torch.device("cpu"), torch.float32, reps=1, batch_size=2,
                                       backend="aot_eager", layers=1, saved_layers=2,
                                       residuals=("prenorm", "attnres"))
    out = capsys.readouterr().out
    for residual in ("prenorm", "attnres"):
        for variant in bench.COMPILE_VARIANTS:
            assert times[(residual, variant)] > 0 and saved[(residual, variant)] > 0
            assert f"| {residual} | {variant} |" in out
    assert saved[("attnres", "eager")] > saved[("prenorm", "eager")]  # its sources are saved too


def test_saved_activation_bytes_count_each_storage_once():
    """Two sublayers reading one source save it once: the figure is bytes of distinct storages."""
    from model import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=8, vocab_size=65, n_layer=1, n_head=2, n_embd=16))
    idx = torch.zeros(2, 8, dtype=torch.long)
    seen = []

    def pack(t):
        seen.append(t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx, idx)
    distinct = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in seen}
    assert len(distinct) < len(seen)  # some storages are saved more than once
    assert bench.saved_activation_bytes(model, idx) == sum(distinct.values())


def test_bench_quickstart_times_both_commands(capsys):
    """--section=quickstart runs train.py and the nanoGPT-like baseline as whole processes on the
    quickstart config and prints their wall times, the ratio and each run's final val loss."""
    result = bench.bench_quickstart(pairs=1, max_iters=3)
    out = capsys.readouterr().out
    (ours, ours_loss), (base, base_loss) = result.values()
    assert ours > 0 and base > 0 and len(ours_loss) == len(base_loss) == 1
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| ") and "command" not in line]
    assert [r[0].strip() for r in rows] == list(result)
    assert rows[0][2].strip() == f"{ours / base:.2f}x" and rows[1][2].strip() == "1.00x"
    assert rows[0][3].strip() == f"{ours_loss[0]:.4f}" and rows[1][3].strip() == f"{base_loss[0]:.4f}"
    assert 3.0 < ours_loss[0] < 4.6 and 3.0 < base_loss[0] < 4.6  # near ln(65) = 4.17 after 3 iterations


def test_bench_sample_times_dense_and_routed(capsys):
    """--section=sample: the same mod=nag model sampled dense (thresholds off) and routed; the printed
    saving is 1 - routed / dense of the returned times, and the routed run skipped tokens."""
    times = bench.main(["--section=sample", "--device=cpu", "--tokens=20", "--pairs=1"])
    out = capsys.readouterr().out
    dense, routed = times[("sample", "dense")], times[("sample", "routed")]
    rows = {r[1].strip(): r[2:4] for r in (line.split("|") for line in out.splitlines()) if len(r) == 5}
    assert rows["dense (thresholds off)"][0].strip() == f"{1 / dense:.0f}"
    assert rows["mod=nag eval routing"][0].strip() == f"{1 / routed:.0f}"
    skipped = float(rows["mod=nag eval routing"][1])  # printed to 3 decimals: within 0.0005 of the value
    assert 0.05 < skipped < 0.6  # thresholds set at mod_rate 0.25 skip some tokens
    line = re.search(r"routed / dense = ([\d.]+)x: saved ([\d.]+)% for ([\d.]+)% skipped.*"
                     r"at most ([\d.]+)% at this shape.* skipped is ([\d.]+)% of a dense one", out)
    assert line, out
    ratio, saved, skipped_pct, bound, skip_all_pct = (float(g) for g in line.groups())
    skip_all = times[("sample", "skip_all")]  # what no routing can save: embedding, scores, head, sampling
    assert ratio == pytest.approx(routed / dense, abs=5e-4)
    assert saved / 100 == pytest.approx(1 - routed / dense, abs=5e-4)
    assert skipped_pct / 100 == pytest.approx(skipped, abs=1e-3)  # both rounded
    # the bound is skipped x (1 - skip_all / dense), from the unrounded skipped fraction
    assert bound / 100 == pytest.approx(skipped * (1 - skip_all / dense), abs=5e-4 + 5e-4)
    assert skip_all_pct / 100 == pytest.approx(skip_all / dense, abs=5e-4)
    assert rows["every sublayer skipped"][0].strip() == f"{1 / skip_all:.0f}"
    assert rows["every sublayer skipped"][1].strip() == "1.000"


def test_bench_sample_random_model_shape(capsys):
    """--layers and --width shape the random model; a width the 4 heads cannot split is a one-line error."""
    bench.main(["--section=sample", "--device=cpu", "--tokens=2", "--pairs=1", "--layers=2", "--width=32"])
    assert "(2 layers, 32 wide, mod=nag at mod_rate 0.25)" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="multiple of 4"):
        bench.main(["--section=sample", "--device=cpu", "--tokens=2", "--pairs=1", "--width=30"])


def test_baseline_model_is_nanogpts():
    """The baseline has nanoGPT's parameters: learned positions, LayerNorms with biases, a tied head."""
    model = bench.BaselineGPT(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128)
    d = 128
    per_block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    assert sum(p.numel() for p in model.parameters()) == 65 * d + 64 * d + 4 * per_block + 2 * d
    assert model.lm_head.weight is model.wte.weight
    torch.manual_seed(0)
    loss = model(torch.randint(0, 65, (2, 64)), torch.randint(0, 65, (2, 64)))
    assert abs(loss.item() - torch.log(torch.tensor(65.0)).item()) < 0.3  # small init: near-uniform logits
