"""bench.py runs on a CPU and prints one row per kernel and per residual mode."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench  # noqa: E402
from model import RESIDUALS  # noqa: E402


def test_bench_prints_every_kernel_and_mode(capsys):
    times = bench.main(["--section=all", "--reps=1", "--compile=False", "--batch_size=2"])
    out = capsys.readouterr().out
    assert set(times) == set(RESIDUALS) and all(t > 0 for t in times.values())
    for name in ("rms_norm", "nag_update", "depth_attention"):
        assert f"| {name} | eager |" in out
    for residual in RESIDUALS:
        assert f"| {residual} |" in out
    assert "| prenorm |" in out and "| 1.00x |" in out
