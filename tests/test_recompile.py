"""train.py with compile=True compiles each mode once. train.main runs in this process, 20 training steps
with evals at iterations 0, 10 and 20, torch.compile given a backend that keeps Dynamo's graphs and runs
them as they are (no inductor compile on the CPU): one training graph is traced at the first step, one
eval graph (eval mode, no grad) at the first eval, and nothing after, for every residual mode, the variants
and the MoD modes of tests/test_compile.py. No recompile, no graph break. What changes every step (the LR,
nag's alpha warm-up, MoD's thresholds, skip_middle's controller) lives in tensors or outside the model: a
Python number that changes per step and is read in forward would become a guard, and recompile each step."""
import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import train
from model import RESIDUALS
from test_compile import MOD_CASES, VARIANTS, fresh_dynamo  # noqa: F401 (autouse: dynamo reset around each test)
from test_train import in_process, tiny_args  # noqa: F401

pytest.importorskip("triton")

STEPS, TOKENS = 20, 2 * 16  # tokens per iteration: batch_size x block_size, one micro-step
CASES = {**{r: dict(residual=r) for r in RESIDUALS}, **VARIANTS, **{f"mod-{c}": kw for c, kw in MOD_CASES.items()}}
for case in ("nag", "mod-nag"):  # the alpha warm-up sets a new scale before each of the first 10 iterations
    CASES[case] = dict(CASES[case], nag_alpha_warmup_tokens=STEPS // 2 * TOKENS)
CASES["mhc"] = dict(CASES["mhc"], mhc_sinkhorn_repeat=1)  # one Sinkhorn iteration traces what 20 repeat
TWO_LAYERS = ("dwa (dwa_dilation=2, dwa_period=2)", "mod-skip_middle")  # a dilation of 2; skip_middle pairs block i with block L-1-i
FINAL_EVAL = ("prenorm",)  # the final eval (its own call, once a run) compiles once too: in one case, for time


class Phases:
    """A torch.compile backend that records, for each graph Dynamo traces, the call it was traced in
    (("train", 3): the third train_step; ("eval", 1): the first estimate_loss; ("final", 1)) and whether
    grad was on, and runs the graph as it is."""

    def __init__(self, monkeypatch):
        self.phase, self.graphs, self.calls = None, [], {}
        for name, kind in (("train_step", "train"), ("estimate_loss", "eval"), ("final_eval", "final")):
            monkeypatch.setattr(train, name, self.wrap(getattr(train, name), kind))

    def wrap(self, fn, kind):
        def wrapped(*args, **kw):
            self.calls[kind] = self.calls.get(kind, 0) + 1
            self.phase = (kind, self.calls[kind])
            try:
                return fn(*args, **kw)
            finally:
                self.phase = None
        return wrapped

    def __call__(self, gm, example_inputs):
        self.graphs.append((*self.phase, torch.is_grad_enabled()))
        return gm.forward


@pytest.mark.parametrize("case", list(CASES))
def test_compiled_training_compiles_each_phase_once(case, data_dir, tmp_path, in_process, monkeypatch):  # noqa: F811
    phases = Phases(monkeypatch)
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kw: compile_(model, backend=phases, **kw))
    final = case in FINAL_EVAL
    in_process(tiny_args(data_dir, tmp_path, compile=True, max_iters=STEPS, lr_decay_iters=STEPS, warmup_iters=5,
                         eval_interval=STEPS // 2, eval_iters=1, batch_size=2, block_size=16,
                         gradient_accumulation_steps=1, n_layer=2 if case in TWO_LAYERS else 1,
                         final_eval_tokens=4 * 16 if final else 0, log_interval=STEPS, **CASES[case]))
    assert phases.calls == {"train": STEPS, "eval": 3, **({"final": 1} if final else {})}
    expected = [("eval", 1, False), ("train", 1, True)] + ([("final", 1, False)] if final else [])
    assert sorted(phases.graphs) == sorted(expected), phases.graphs
    assert counters["stats"]["unique_graphs"] == len(expected)
    assert not counters["recompiles"] and not counters["graph_break"], (counters["recompiles"], counters["graph_break"])
