"""A training step reads nothing back to the host; what it counts, and a
non-finite step's skip, stay on the device until a log or eval iteration reads them.

On CPU a "sync" is an op that would wait for the GPU there: reading a value to the host (item(), bool(),
int(), float(): aten._local_scalar_dense; is_nonzero, equal; tolist()) or an op whose output shape
depends on the data (nonzero, masked_select). Loading batches is host work on host tensors (get_batch's
ix.tolist()), so the count pauses while the step draws its batches. The optimizer is fused AdamW
(configure_optimizers builds it on every device), whose step counters live with the parameters and are
never read: nothing to leave out there; under --optimizer=muon, optim.py's Muon beside it, whose skip is
a torch.where on the device.
"""
import contextlib
import itertools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import flops
import run_config
import train
from model import GPT, GPTConfig
from test_train import SaturatedGates, in_process, read_log, tiny_args  # noqa: F401

aten = torch.ops.aten
HOST_READS = {aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default, aten.equal.default,
              aten.nonzero.default, aten.masked_select.default}


class HostReads(TorchDispatchMode):
    """Counts host reads (see the module docstring) while active, by op; pause() stops counting."""

    def __init__(self):
        super().__init__()
        self.ops, self.paused = [], False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS and not self.paused:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def pause(self):
        self.paused = True
        try:
            yield
        finally:
            self.paused = False

    def __enter__(self):  # tolist() reads a CPU tensor's memory directly, below the dispatcher
        tolist, reads = torch.Tensor.tolist, self

        def counted(t):
            if not reads.paused:
                reads.ops.append("tolist")
            return tolist(t)
        self._tolist, torch.Tensor.tolist = tolist, counted
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)


def paused_batches(batches, reads):
    while True:
        with reads.pause():
            batch = next(batches)
        yield batch


@pytest.fixture
def watch_steps(monkeypatch):
    """watch_steps(before=None, after=None) -> a list that gets, per training step, the host reads inside
    train.train_step; before(kw) and after(kw, state) are called around each step with its arguments."""
    def install(before=None, after=None):
        reads_per_step, real = [], train.train_step

        def watched(*args, **kw):
            kw.update(zip(("model", "raw_model", "optimizer", "scaler", "batches", "stats"), args))
            state = before(kw) if before else None
            with HostReads() as reads:
                kw["batches"] = paused_batches(kw["batches"], reads)
                loss = real(**kw)
            reads_per_step.append(reads.ops)
            if after:
                after(kw, state)
            return loss
        monkeypatch.setattr(train, "train_step", watched)
        return reads_per_step
    return install


MODES = {
    "prenorm": dict(residual="prenorm"),
    "prenorm-fp16-noclip": dict(residual="prenorm", dtype="float16", grad_clip=0.0),
    "nag": dict(residual="nag"),
    "mod-nag": dict(residual="nag", mod="nag", mod_rate=0.25),
    "skip_middle": dict(residual="sandwich", mod="skip_middle", mod_rate=0.25),
    "hc-dynamic": dict(residual="hc", hc_dynamic=True),
    "mhc": dict(residual="mhc"),
    "muon": dict(residual="prenorm", optimizer="muon"),
    "muon-fp16": dict(residual="prenorm", optimizer="muon", dtype="float16"),  # GradScaler.unscale_ on both
}


@pytest.mark.parametrize("mode", list(MODES))
def test_a_training_step_makes_no_host_sync(mode, data_dir, tmp_path, in_process, watch_steps):
    """4 real steps of a tiny run (2 micro-steps each); the eval and the log read at iteration 0 and
    the final eval lie outside the steps. The one exception is by design: eager skip_middle gathers
    out the tokens whose gate is 0, and a gather's size is the kept count, so each gate producer's
    route reads its counts once per micro-step (its mirrored block reuses the route). Under
    torch.compile that route is padded to a static shape and reads nothing (tests/test_compile.py)."""
    steps = watch_steps()
    in_process(tiny_args(data_dir, tmp_path / "out", max_iters=4, eval_interval=100, log_interval=100,
                         **MODES[mode]))
    assert len(steps) == 4
    per_step = ["tolist"] * (2 * 1) if mode == "skip_middle" else []  # 2 micro-steps x n_layer / 2 producers
    assert steps == [per_step] * 4, steps


def _state(raw_model, optimizer):
    state = {f"model.{k}": v.clone() for k, v in raw_model.state_dict().items()}
    saved = optimizer.state_dict()
    for name, opt in (saved.items() if "state" not in saved else [("", saved)]):  # Muon + AdamW: both
        for i, s in opt["state"].items():
            state.update({f"optimizer.{name}{i}.{k}": v.clone() for k, v in s.items()})
    return state


@pytest.mark.parametrize("mode", ["prenorm", "skip_middle", "muon"])
def test_a_bad_step_is_skipped_exactly_on_the_device(mode, data_dir, tmp_path, in_process, watch_steps,
                                                      monkeypatch, capsys):
    """Iteration 2's loss is NaN: that step leaves the parameters, every buffer (skip_middle's lam and mu)
    and the optimizer state (moments, step counts) bit-identical, makes no host sync, and is counted on
    the device; the host hears of it at the next read (here: the final eval)."""
    step_no, seen = itertools.count(), {}
    forward = GPT.forward

    def poisoned(self, idx, targets=None, executed=False):
        logits, loss, ran = forward(self, idx, targets, executed=True)
        loss = loss * float("nan") if self.training and seen["step"] == 2 else loss
        return (logits, loss, ran) if executed else (logits, loss)
    monkeypatch.setattr(GPT, "forward", poisoned)

    def before(kw):
        seen["step"] = next(step_no)
        return _state(kw["raw_model"], kw["optimizer"])

    def after(kw, state):
        if seen["step"] in (1, 2):
            seen[seen["step"]] = (state, _state(kw["raw_model"], kw["optimizer"]), kw["stats"].bad.clone())
    steps = watch_steps(before, after)
    cfg = dict(max_iters=4, eval_interval=100, log_interval=100, max_bad_steps=2, **MODES[mode])
    if mode == "skip_middle":  # gates that skip, and a controller that moves: lam, mu change after a good step
        monkeypatch.setattr(train, "GPT", SaturatedGates)
    in_process(tiny_args(data_dir, tmp_path / "out", **cfg))

    good_before, good_after, _ = seen[1]
    bad_before, bad_after, bad = seen[2]
    assert good_before.keys() == bad_after.keys()
    assert any(not torch.equal(good_before[k], good_after[k]) for k in good_before)  # a good step moves them
    for k in bad_before:
        assert torch.equal(bad_before[k], bad_after[k]), k  # the bad one leaves everything as it was
    if mode == "skip_middle":
        assert not torch.equal(good_before["model.mod.lam"], good_after["model.mod.lam"])
    assert bad.tolist() == [1, 1, 1]  # in a row, longest run, count since the last read
    if mode == "muon":  # Muon's momentum buffers are among the state left as it was
        assert sum("momentum_buffer" in k for k in bad_before) == 4 * 2  # 2 layers x q/k/v, o, fc, proj
    assert steps[2] == (["tolist"] * 2 if mode == "skip_middle" else []), steps[2]  # skip_middle: see above
    out = capsys.readouterr().out
    assert "iter 3: non-finite loss or gradients, 1 step(s) skipped since the last log (0 in a row now" in out


# -----------------------------------------------------------------------------
# the pieces: step counters, MoD accounting, prefetch, evals on the training module

def test_step_stats_count_bad_steps_on_the_device():
    stats = train.StepStats(GPTConfig(vocab_size=65, n_layer=2, n_head=2, n_embd=32, block_size=32), 128,
                            torch.device("cpu"))
    flags = [0, 1, 1, 0, 1, 1, 1, 0]
    for f in flags[:6]:
        stats.step(torch.tensor(float(f)))
    assert stats.read() == (2, 2, 4)  # in a row now, the longest run, the count
    for f in flags[6:]:
        stats.step(torch.tensor(float(f)))
    assert stats.read() == (0, 3, 1)  # a run that goes on across a read is counted whole
    assert stats.read() == (0, 0, 0)


def test_step_stats_flops_from_device_counts_equal_the_float_sums():
    """skip_middle's executed counts may be 0-d tensors: the FLOPs and fractions read from them are the
    same Python floats as from ints (counts are exact in float64), summed in the same order."""
    config = GPTConfig(vocab_size=65, n_layer=2, n_head=2, n_embd=32, block_size=32, residual="sandwich",
                       mod="skip_middle", mod_rate=0.25)
    rows = [[128, 77, 77, 128], [128, 90, 90, 128], [101, 33, 33, 101]]
    stats = train.StepStats(config, 128, torch.device("cpu"))
    for i, row in enumerate(rows):  # a mix: all ints, and ints with 0-d int64 tensors
        stats.micro_step(row if i == 0 else [e if j % 2 == 0 else torch.tensor(e) for j, e in enumerate(row)], 128)
    stats.read()
    want, exec_sum = 0.0, None
    for row in rows:
        frac = [float(e) / 128 for e in row]
        want += flops.train_flops_per_token(config, frac) * 128
        exec_sum = frac if exec_sum is None else [a + b for a, b in zip(exec_sum, frac)]
    assert stats.flops == want and stats.exec_sum == exec_sum and stats.exec_n == 3
    assert stats.executed == []


def test_kernel_launchers_make_no_host_sync(monkeypatch):
    """Every Triton launcher, forward and backward (the hyper-connections' and the dense mix's included: Sinkhorn's
    iteration count and a shared coefficient's row stride are host values, never read from a tensor),
    reads nothing back to the host. The launchers are called directly (inside a custom op, the
    dispatch mode would not see their torch calls) with the kernels stubbed: a launch is recorded,
    not run."""
    pytest.importorskip("triton")
    import kernels
    from test_kernels import LAUNCHED, kernel_inputs
    launched = set()

    class Stub:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            launched.add(self.name)
            return lambda *args, **kw: None

    for name in LAUNCHED:
        monkeypatch.setattr(kernels, name, Stub(name))
    x, w, r, u, a, s0, s1, s2, q, hx, proj, scale, base = (t.detach() for t in kernel_inputs(device="cpu"))
    g = torch.ones_like(x)
    with HostReads() as reads:
        _, rstd = kernels.rms_norm_fwd_triton(x, w, 1e-6)
        kernels.rms_norm_bwd_triton(g, x, w, rstd)
        kernels.nag_update_fwd_triton(r, u, a, 1e-6)
        kernels.nag_update_bwd_triton(r, u, a, g, a, 1e-6)
        _, lse = kernels.depth_attention_fwd_triton([s0, s1, s2], q, w, 1e-6)
        kernels.depth_attention_bwd_triton([s0, s1, s2], q, w, lse, g, 1e-6)
        hu, h_post, res_logits = kernels.mhc_pre_mix_fwd_triton(hx, proj, scale, base, 1e-6, 1e-6, 2.0)
        kernels.mhc_pre_mix_bwd_triton(hx, proj, scale, base, hu, h_post, res_logits, 1e-6, 1e-6, 2.0)
        h_res = kernels.sinkhorn_fwd_triton(res_logits, 20, 1e-6)
        kernels.sinkhorn_bwd_triton(res_logits, h_res, 20, 1e-6)
        for hp, hr in ((h_post, h_res), (base[:4], base[8:].view(4, 4))):  # per row (mhc), shared (hc)
            kernels.hc_post_mix_fwd_triton(hx, hu, hp, hr)
            kernels.hc_post_mix_bwd_triton(hx, hu, hp, hr, hx)
        for mix_w in (w[:3], torch.ones(*s0.shape[:-1], 2, 3)):  # shared (dwa); per token and way (mudd)
            out = kernels.dense_mix_fwd_triton([s0, s1, s2], mix_w)
            kernels.dense_mix_bwd_triton([s0, s1, s2], mix_w, torch.ones_like(out))
    assert launched == set(LAUNCHED)
    assert reads.ops == []


def test_batches_are_drawn_one_ahead_and_unchanged(data_dir, monkeypatch):
    """train_batches hands out exactly get_batch(batch_generator(seed, iter, rank micro-step)) in order,
    and has drawn batch i + 1 when it hands out batch i."""
    drawn, real = [], train.batch_generator
    monkeypatch.setattr(train, "batch_generator", lambda seed, it, micro: drawn.append((it, micro)) or real(seed, it, micro))
    path, cpu = str(data_dir / "shakespeare_char" / "train.bin"), torch.device("cpu")
    batches = train.train_batches(path, 4, 32, 1337, 5, 2, 2, cpu)  # from iteration 5; rank 1 of 2 x 2 micro-steps
    for it, micro in [(5, 2), (5, 3), (6, 2), (6, 3)]:
        x, y = next(batches)
        assert drawn[-1] == ((it, micro + 1) if micro == 2 else (it + 1, 2))  # the next one is loaded
        x0, y0 = run_config.get_batch(path, 4, 32, real(1337, it, micro), cpu)
        assert torch.equal(x, x0) and torch.equal(y, y0)


class Recorded(torch.nn.Module):
    """A stand-in for torch.compile's module: records whether each forward ran in training or eval mode."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.modes = model, []

    def forward(self, *args, **kwargs):
        self.modes.append(self.training)
        return self.inner(*args, **kwargs)


def test_evals_run_the_compiled_module(data_dir, tmp_path, in_process, monkeypatch):
    """With --compile, estimate_loss and the final eval run the module that training runs (compiled), in eval
    mode."""
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda model: compiled.append(Recorded(model)) or compiled[-1])
    in_process(tiny_args(data_dir, tmp_path / "out", max_iters=2, compile=True))
    (module,) = compiled
    assert module.modes.count(True) == 2 * 2  # 2 iterations x 2 micro-steps
    # 2 evals x 2 splits x eval_iters=2, then the final eval's 1024 tokens in batches of 4 x 32
    assert module.modes.count(False) == 2 * 2 * 2 + 1024 // (4 * 32)
    assert [r["iter"] for r in read_log(tmp_path / "out")] == [0, 2]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("mode", ["prenorm", "mod-nag"])
def test_a_training_step_makes_no_cuda_sync(mode, data_dir, tmp_path, in_process, monkeypatch):
    """On a GPU, CUDA's own check: torch.cuda.set_sync_debug_mode('error') raises on any synchronizing call
    (a value read, a blocking copy, nonzero) in the steps after the first (which sets up the optimizer
    state and may autotune kernels)."""
    real, steps = train.train_step, []

    def checked(*args, **kw):
        steps.append(len(steps))
        if len(steps) == 1:
            return real(*args, **kw)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return real(*args, **kw)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    monkeypatch.setattr(train, "train_step", checked)
    in_process(tiny_args(data_dir, tmp_path / "out", max_iters=4, eval_interval=100, log_interval=100,
                         **{**MODES[mode], "device": "cuda", "dtype": "bfloat16"}))
    assert len(steps) == 4
