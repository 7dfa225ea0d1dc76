"""bench.py runs on a CPU and prints one row per kernel, per residual mode and per MoD setting."""
import sys
from pathlib import Path

import pytest

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
    assert "| prenorm |" in out and "| 1.00x |" in out
    for residual, mod in bench.MOD_RUNS:
        assert all((residual, mod, rate) in times for rate in (0.0, 0.25, 0.5))
        assert f"| {residual} | {mod} | 0.5 |" in out


def test_bench_rejects_an_unknown_section():
    with pytest.raises(ConfigError, match="unknown section"):
        bench.main(["--section=kernel", "--reps=1"])
