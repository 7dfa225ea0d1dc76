"""tradeoff.py: the post-training loss-vs-executed-FLOPs curve of a NAG model (quantile thresholds
on the modulator's tangent). Tiny models (n_layer 2, n_embd 32) trained a few steps in-process."""
import csv
import math
import runpy
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

import run_config
import tradeoff
from configurator import ConfigError
from flops import forward_flops
from model import GPTConfig
from tiny_checkpoint import BLOCK, make_checkpoint

REPO = Path(__file__).resolve().parents[1]
EVAL_ITERS, BATCH = 4, 8
RATES = [0, 0.1, 0.25, 0.5]


def run(out_dir, *extra):
    return tradeoff.main([f"--out_dir={out_dir}", f"--eval_iters={EVAL_ITERS}", f"--batch_size={BATCH}",
                          f"--skip_rates={RATES}", "--device=cpu", *extra])


def read_csv(path):
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def dense(data_dir, tmp_path_factory):
    """A residual=nag model trained dense (mod=none: its checkpoint has no mod.tau) and its trade-off run."""
    out = tmp_path_factory.mktemp("tradeoff") / "nag"
    model = make_checkpoint(out, data_dir, residual="nag")
    assert "mod.tau" not in model.state_dict()
    returned = run(out)
    return out, model, returned


def test_csv_rows(dense, data_dir):
    out, model, returned = dense
    rows = read_csv(out / "tradeoff.csv")
    assert [float(r["skip_target"]) for r in rows] == RATES and all(r["calibration"] == "global" for r in rows)
    # global: one threshold for every sublayer
    assert all(len({r["tau_" + n] for n in ("attn1", "mlp1", "attn2", "mlp2")}) == 1 for r in rows)
    assert (out / "tradeoff.png").stat().st_size > 10_000

    # skip 0 is dense: the loss of the checkpoint's own (mod=none) model on train.py's eval batches
    g = torch.Generator().manual_seed(run_config.EVAL_SEED)
    val = str(data_dir / "shakespeare_char" / "val.bin")
    with torch.no_grad():
        losses = [model(*run_config.get_batch(val, BATCH, BLOCK, g, torch.device("cpu")))[1].item()
                  for _ in range(EVAL_ITERS)]
    assert float(rows[0]["val_loss"]) == pytest.approx(sum(losses) / len(losses), abs=2e-6)
    assert float(rows[0]["skip_realised"]) == 0 and float(rows[0]["flops_fraction"]) == 1
    assert all(math.isnan(float(r["tau_" + n])) for r in rows[:1] for n in ("attn1", "mlp1", "attn2", "mlp2"))

    config = GPTConfig(**{**asdict(model.config), "mod": "nag"})
    names = [k[5:] for k in rows[0] if k.startswith("exec_")]
    assert names == ["attn1", "mlp1", "attn2", "mlp2"]
    flops = []
    for r, ret in zip(rows, returned):
        frac = [float(r["exec_" + n]) for n in names]
        # executed FLOPs are flops.py's count of the realised fractions
        assert float(r["forward_flops_per_token"]) == pytest.approx(sum(forward_flops(config, frac).values()), rel=1e-5)
        assert ret["forward_flops_per_token"] == sum(forward_flops(config, ret["exec_frac"]).values())
        assert float(r["skip_realised"]) == pytest.approx(1 - sum(frac) / len(frac), abs=1e-5)
        assert abs(float(r["skip_realised"]) - float(r["skip_target"])) < 0.1, r
        flops.append(float(r["forward_flops_per_token"]))
    assert all(a > b for a, b in zip(flops, flops[1:])), flops  # strictly fewer FLOPs as more is skipped
    assert float(rows[-1]["val_loss"]) > float(rows[0]["val_loss"])  # and skipping half costs loss


def test_per_sublayer_calibrations_share_the_dense_row(dense, tmp_path):
    out, _, _ = dense
    rows = run(out, "--calibration=routed,dense", f"--out_file={tmp_path / 'both'}")
    assert (tmp_path / "both.csv").exists() and (tmp_path / "both.png").exists()
    assert [r["calibration"] for r in rows] == ["routed"] * len(RATES) + ["dense"] * len(RATES)
    first = read_csv(out / "tradeoff.csv")[0]
    for method in ("routed", "dense"):
        curve = [r for r in rows if r["calibration"] == method]
        assert curve[0]["val_loss"] == pytest.approx(float(first["val_loss"]), abs=1e-6)
        flops = [r["forward_flops_per_token"] for r in curve]
        assert all(a > b for a, b in zip(flops, flops[1:])), flops
    # routed: every sublayer skips about q of the tokens (global thresholds skip unevenly)
    for r in rows[1:len(RATES)]:
        assert all(abs((1 - f) - r["skip_target"]) < 0.15 for f in r["exec_frac"][1:]), r


def test_mod_nag_checkpoint_also_gets_its_own_thresholds(data_dir, tmp_path):
    model = make_checkpoint(tmp_path / "mod", data_dir, steps=20, residual="nag", mod="nag", mod_rate=0.5)
    rows = run(tmp_path / "mod")
    assert [r["calibration"] for r in rows] == ["global"] * len(RATES) + ["checkpoint"]
    assert rows[-1]["skip_target"] is None and rows[-1]["tau"] == model.mod.tau.tolist()
    assert 0 < rows[-1]["skip_realised"] < 1
    assert read_csv(tmp_path / "mod" / "tradeoff.csv")[-1]["skip_target"] == ""


def test_prenorm_checkpoint_is_a_clear_one_line_error(data_dir, tmp_path, monkeypatch):
    make_checkpoint(tmp_path / "pre", data_dir, steps=1, residual="prenorm")
    with pytest.raises(ConfigError, match=r"residual=prenorm.*needs residual=nag.*modulator"):
        run(tmp_path / "pre")
    # the script itself (its __main__ block, in-process: a subprocess would import torch again for seconds)
    # exits with one line, which Python prints to stderr with status 1, and no traceback
    monkeypatch.setattr(sys, "argv", ["tradeoff.py", f"--out_dir={tmp_path / 'pre'}"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(REPO / "tradeoff.py"), run_name="__main__")
    message = e.value.code
    assert isinstance(message, str) and message.startswith("error: ") and "\n" not in message
    assert "residual=nag" in message
    assert not (tmp_path / "pre" / "tradeoff.csv").exists()


def test_state_dict_mismatch_is_an_error(data_dir, tmp_path):
    make_checkpoint(tmp_path / "bad", data_dir, steps=1, residual="nag")
    path = str(tmp_path / "bad" / "ckpt.pt")
    ckpt = torch.load(path, weights_only=True)
    ckpt["model"]["stray.weight"] = torch.zeros(1)
    del ckpt["model"]["stream.alpha"]
    torch.save(ckpt, path)
    with pytest.raises(ConfigError, match=r"missing keys \['stream.alpha'\].*unexpected keys \['stray.weight'\]"):
        run(tmp_path / "bad")


LOW_TIE = [0.1] * 6 + [0.2, 0.3, 0.4, 0.5]  # skips 0 (tau 0.1), 0.6 (0.2), 0.7, 0.8 or 0.9 (0.5)
MID_TIE = [1.0, 2.0] + [3.0] * 5 + [4.0, 5.0, 6.0]  # skips 0, 0.1, 0.2 (tau 3), 0.7 (4), 0.8, 0.9
TOP_TIE = [1.0, 2.0, 3.0, 4.0] + [5.0] * 6  # skips 0, .., 0.4 (tau 5): never all


@pytest.mark.parametrize("scores, q, tau, skipped", [
    (LOW_TIE, 0.25, 0.1, 0.0),  # the tie group's far side would skip 0.6, 0.35 away
    (LOW_TIE, 0.29, 0.1, 0.0),
    (LOW_TIE, 0.35, 0.2, 0.6),  # 0.25 away; 0 is 0.35 away
    (LOW_TIE, 0.72, 0.3, 0.7),
    (LOW_TIE, 0.78, 0.4, 0.8),
    (MID_TIE, 0.4, 3.0, 0.2),  # 0.2 away; 0.7 is 0.3 away
    (MID_TIE, 0.5, 4.0, 0.7),  # 0.2 away; 0.2 is 0.3 away
    (TOP_TIE, 0.9, 5.0, 0.4),  # the nearest that still runs someone
])
def test_quantile_with_ties_skips_the_fraction_nearest_q(scores, q, tau, skipped):
    """Tied scores all run or all skip, so only some fractions can be skipped (score < tau); quantile
    picks the threshold whose fraction is nearest q, on either side of the q-quantile's tie group.
    The answers are worked out by hand above; every other score value as tau is no nearer q."""
    s = torch.tensor(scores)[torch.randperm(10, generator=torch.Generator().manual_seed(0))].view(2, 5)
    got = tradeoff.quantile(s, q)
    assert got.item() == pytest.approx(tau) and (s < got).sum().item() / 10 == pytest.approx(skipped)
    assert all(abs((s < v).sum().item() / 10 - q) >= abs(skipped - q) - 1e-9 for v in set(scores))


@pytest.mark.parametrize("arg, needle", [("--skip_rates=[0,1]", "skip_rates"), ("--skip_rates=[]", "skip_rates"),
                                         ("--eval_iters=0", "eval_iters"), ("--calibration=uniform", "calibration")])
def test_bad_options(arg, needle, dense):
    with pytest.raises(ConfigError, match=needle):
        tradeoff.main([f"--out_dir={dense[0]}", arg])


def test_a_router_checkpoint_gets_the_fix_that_fits_it(data_dir, tmp_path):
    """A mod=router model routes by its own trained router: the error says so and points to what reads its
    routing (sample.py's skip rate, plot.py routing); it used to tell such a model to train with --mod=router."""
    make_checkpoint(tmp_path / "router", data_dir, steps=1, mod="router", mod_rate=0.5, mod_inference="threshold")
    with pytest.raises(ConfigError) as e:
        run(tmp_path / "router")
    message = str(e.value)
    assert "is a mod=router model" in message and "its own trained router" in message
    assert f"python sample.py --out_dir={tmp_path / 'router'}" in message
    assert f"python plot.py routing {tmp_path / 'router'}" in message
    assert "--mod=router" not in message and "\n" not in message


def test_a_missing_checkpoint_names_the_out_dir_to_pass(tmp_path):
    """tradeoff.py reads a trained run: no checkpoint asks for its --out_dir, not for --init_from=scratch."""
    with pytest.raises(ConfigError) as e:
        run(tmp_path)
    assert str(e.value).startswith(f"no checkpoint at {tmp_path / 'ckpt.pt'}: pass --out_dir=DIR")
    assert "init_from" not in str(e.value)
