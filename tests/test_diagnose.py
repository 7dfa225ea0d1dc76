"""train.py --diagnose=True: the diagnostics each eval logs are those of the model being trained."""
import json

import pytest
import torch

import run_config
import train
from model import diagnose


@pytest.mark.parametrize("residual", ["nag", "hc"])
def test_diagnostics_are_the_trained_models(data_dir, tmp_path, residual):
    """A tiny run with --diagnose=True, evals at iterations 0 and 4: the last record's diagnostics equal
    those of the checkpoint saved at that eval (the trained weights) on the batch train.py diagnoses (the
    first val batch of seed EVAL_SEED), entry by entry; the first record's, taken at init, differ from them."""
    out = tmp_path / "out"
    args = dict(dataset="shakespeare_char", data_dir=data_dir, out_dir=out, device="cpu", dtype="float32",
                residual=residual, n_layer=2, n_head=2, n_embd=32, block_size=32, dropout=0.0, batch_size=4,
                gradient_accumulation_steps=1, eval_iters=1, eval_interval=4, log_interval=4, learning_rate=3e-3,
                warmup_iters=0, max_iters=4, lr_decay_iters=4, compile=False, always_save_checkpoint=True,
                diagnose=True, final_eval_tokens=1024)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng():
            train.main([f"--{k}={v}" for k, v in args.items()])
    finally:
        torch.set_num_threads(threads)
    with open(out / "log.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [r["iter"] for r in records] == [0, 4]
    ckpt = run_config.load_checkpoint(str(out / "ckpt.pt"), torch.device("cpu"))
    assert ckpt["iter_num"] == 4
    model = run_config.model_from_checkpoint(ckpt, torch.device("cpu"))
    X, _ = run_config.get_batch(str(data_dir / "shakespeare_char" / "val.bin"), args["batch_size"],
                                args["block_size"], torch.Generator().manual_seed(run_config.EVAL_SEED),
                                torch.device("cpu"))
    with torch.no_grad():
        want = json.loads(json.dumps(diagnose(model, X)))  # as log.jsonl stores them
    logged, at_init = records[-1]["diagnostics"], records[0]["diagnostics"]
    assert [set(r) for r in logged] == [set(r) for r in want]
    for got_row, want_row in zip(logged, want):
        for key, value in want_row.items():
            close = value if isinstance(value, str) else pytest.approx(value, rel=1e-6, abs=1e-9)
            same = got_row[key] == close
            assert same, f"sublayer {want_row['sublayer']} {key}: logged {got_row[key]}, the trained model's {value}"
    moved = [(r["sublayer"], k) for r0, r in zip(at_init, logged) for k, v in r.items()
             if isinstance(v, float) and abs(v - r0[k]) > 1e-3 * abs(v)]
    assert moved, "4 steps left the diagnostics as they were at init: the comparison above could not fail"
