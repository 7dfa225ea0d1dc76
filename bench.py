"""
Benchmarks that print figures (speed targets are checked here, not in timed tests).

    python bench.py                      # both sections, on the GPU if there is one
    python bench.py --section=kernels    # each fused kernel vs eager PyTorch and torch.compile of its reference
    python bench.py --section=model      # step time and peak memory of each residual mode, relative to prenorm
    python bench.py --section=mod        # Mixture-of-Depths step time at mod_rate 0, 0.25, 0.5
    python bench.py --section=compile    # eager vs compiled reference vs compiled custom ops, per mode
    python bench.py --section=quickstart # the quickstart command against a nanoGPT-like baseline run
    python bench.py --section=quickstart --nanogpt=DIR  # ... against nanoGPT itself, a checkout in DIR
    python bench.py --section=sample     # sampling with a KV cache: one mod=nag model, dense vs routed
    python bench.py --section=steps --sweep=config/<sweep>.py  # each cell's step time vs its baseline's
    python bench.py --section=gpu        # every GPU figure in one command (8 minutes): docs/results.md

kernels: forward and forward+backward time of each of the seven kernels (rms_norm, nag_update,
depth_attention, hc/mhc's mhc_pre_mix, sinkhorn and hc_post_mix, at n = 4 streams, and dense_mix, as dwa
and as mudd calls it), and the
achieved bandwidth: the bytes a fused kernel must move at least (each input read once, each output
written once) divided by the time. On a GPU compare it with the copy bandwidth printed first.
Every figure is a median over --reps repeats; when the repeats of a measurement spread by more than
half their median, or a forward takes 1.5x its forward+backward, a last line warns that the
machine is loaded and the figures are unreliable.
model: one training step (forward, backward, AdamW) per mode, and per option of model.py's VARIANTS
(norm_scaling, value_residual, mhc-lite, DenseFormer's dilation and period, mudd's 1 way), at the GPT-2 124M shape on a GPU
(12 layers, 768 wide, 12 heads, T = 1024, bf16, compiled), or at the quickstart shape on a CPU.
mod: a training step of nag (mod=nag) and prenorm (mod=router) at mod_rate 0, 0.25 and 0.5, at the
124M shape on a GPU or an 8-layer quickstart-width model on a CPU; the ratio to mod_rate 0 is the saving.
compile (not part of "all": it compiles 10 models): each residual mode eager, compiled with the
kernels' plain-PyTorch references (kernels=torch, which inductor fuses) and compiled with the kernels
as custom ops (kernels=triton: on a GPU the Triton kernels; on a CPU the ops run their reference);
step time, peak memory (GPU) and the bytes saved for backward, as ratios to prenorm. --backend picks
torch.compile's backend (inductor; aot_eager compiles in seconds, for a quick check).
quickstart (not part of "all": whole training runs): `python train.py config/shakespeare_char_cpu.py`
against a peer on the same recipe, both cut to --max_iters, as whole processes in --pairs interleaved pairs:
median wall and CPU times, their ratios, each run's last val loss, and the time our run takes to reach the
peer's last val loss (a third run per pair, evaluated every 25 iterations, finds the iteration; a fourth, ours
as timed, stops there). The peer:
nanoGPT itself with --nanogpt=DIR (a checkout: git clone https://github.com/karpathy/nanoGPT DIR; its data
prepared from our text, as the error says; NANOGPT_ARGS is its command), or by default
`python bench.py baseline config/shakespeare_char_cpu.py` (nanoGPT's model and loop on the same config, in
this repo; see baseline_train; ours then runs without its final eval).
sample (not part of "all"): tokens/s of generate() with the KV cache, one batch-1 sequence, for the
same mod=nag model run dense (thresholds off), with its eval routing, and with every sublayer skipped
(what a token costs that no sublayer can save: embedding, the scores, head, sampling), in --pairs
interleaved pairs; the model of --out_dir's checkpoint, or (no --out_dir) a random nag at mod_rate 0.25,
--layers deep (0: 8) and --width wide (128), whose thresholds a few training-mode forwards on random
tokens set. Prints the time saved against the skipped fraction (target: saved >= 0.8 x skipped) and
the most any routing of that skipped fraction could save, skipped x (1 - skip-all / dense).
model and compile also print the saved-activation bytes (each storage once) relative to prenorm; model (eager)
also what each step moves, counted by dispatch mode: matmul FLOPs, bytes (each op's inputs and outputs once) and
ops, each against prenorm's, and a least-squares fit of the step times on the three over the rows, which splits
each row's time into matmuls + bytes + ops (docs/kernels.md: what bounds a design's step).
steps (not part of "all"): a training step of every cell of a sweep config (--sweep), built as its runs are,
against its baseline cell, in --rounds interleaved rounds on this device: each cell's median time ratio
with a 95% bootstrap interval, and every round's times in a CSV (--steps_out) that flops.py multiplier
--step_times turns into the throughput-adjusted multiplier. For a CPU sweep run with OMP_NUM_THREADS=1,
time it so too, on idle cores.
gpu (not part of "all"; one CUDA GPU, or --dry_run=True anywhere): every GPU figure from one command,
within --max_minutes (8), in four parts: correctness (each kernel forward and backward against its
reference in fp64, fp32 and bf16, at the model's width, an odd width and 4096, no row count a multiple of
a block, per-element tolerances CHECK_TOL; and for every residual mode one compiled (fullgraph) forward
and backward with kernels=triton whose loss and gradients must equal eager kernels=torch's), bandwidth
(each kernel's GB/s against the copy's), modes (a training step of every mode at the 124M shape, bf16,
eager with the fused kernels, interleaved, then compiled for prenorm and as many modes as fit: ms/iter,
tokens/s, MFU, peak memory, ratios to prenorm) and mod (MoD at mod_rate 0.25 and 0.5 against dense), the
targets printed beside the figures. A failed check is a FAIL row and the rest runs. Each row goes to
--results (docs/results.md) and the JSON beside it (device, versions, command, raw tables) as it is
measured, both replaced atomically, so a run killed at any point leaves valid files; what the cap left
out is listed as skipped. --dry_run=True runs the same code at tiny shapes, to out/gpu-dry-run/: on a
machine without a GPU on the CPU, the kernel checks in Triton's interpreter (the timed parts on the ops'
CPU implementations). The end prints each part's seconds beside a rough plan of its GPU seconds (gpu_plan).
Ratios measured in one run are what to compare: absolute times drift on a shared machine.
"""

import contextlib
import csv
import functools
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

if not torch.cuda.is_available():  # the gpu section's dry run runs the kernels in Triton's interpreter on a CPU,
    os.environ.setdefault("TRITON_INTERPRET", "1")  # which must be on before triton is imported (by kernels)
import kernels  # noqa: E402
import flops  # noqa: E402
from configurator import ConfigError, configure  # noqa: E402
from model import GPT, GPTConfig, RESIDUALS, VARIANTS  # noqa: E402
import run_config  # noqa: E402
import stats  # noqa: E402
from run_config import REPO, pick_device  # noqa: E402

DEFAULTS = dict(
    section="all",  # all (kernels, model, mod) | kernels | model | mod | compile | quickstart | sample | steps | gpu
    device="auto",  # auto (the GPU if there is one, else the CPU), cpu, cuda, cuda:1, ...
    dtype="auto",  # auto (bf16 or fp16 on a GPU, fp32 on a CPU: the designs' CPU figures), float32, bfloat16, float16
    compile=True,  # kernels: also time torch.compile of the references; model, mod: compile the step (GPU only)
    reps=0,  # timed calls per measurement (0: 50 on a GPU, 20 on a CPU)
    batch_size=0,  # model, mod, compile, gpu: sequences per step (0: the section's own)
    pairs=3,  # quickstart, sample: interleaved pairs of runs
    max_iters=600,  # quickstart: iterations per run
    nanogpt="",  # quickstart: a nanoGPT checkout to time instead of the built-in baseline (see docs/testing.md)
    layers=0,  # model: the depth (0: 12 on a GPU, 4 on a CPU); sample: the random model's (0: 8)
    out_dir="",  # sample: a mod=nag checkpoint's out_dir ("": a random model, --layers deep, --width wide)
    tokens=500,  # sample: tokens per sample
    width=128,  # sample: the random model's width
    backend="inductor",  # compile, gpu: torch.compile's backend (aot_eager compiles in seconds, for a quick check)
    dry_run=False,  # gpu: the whole command in seconds on a CPU (tiny shapes, kernels in Triton's interpreter)
    results="",  # gpu: the figures' Markdown file, a JSON beside it ("": docs/results.md, dry run out/gpu-dry-run/)
    max_minutes=8.0,  # gpu: the wall-clock cap, checked between parts and between the items of a part
    parts="all",  # gpu: all (correctness, bandwidth, modes, mod) or a comma list of them
    compiled="all",  # gpu: modes also timed compiled, while time is left (all: COMPILE_FIRST, then the rest)
    optimizer="adamw",  # model, gpu's modes: the step's optimizer, adamw or muon (train.py's muon_* defaults)
    sweep="",  # steps: the sweep config whose cells are timed, each against its baseline cell
    rounds=20,  # steps: interleaved rounds (each times every cell once, 3 steps, the median)
    steps_out="",  # steps: the CSV of every round's times ("": out/step_times.csv); flops.py multiplier --step_times
)
# the whole-number keys and their least value (0: the section's own); max_minutes: any number > 0
COUNTS = dict(reps=0, batch_size=0, pairs=1, max_iters=1, layers=0, tokens=1, width=8, rounds=1)


LOADED_SPREAD = 0.5  # (upper - lower quartile) / median of a measurement's repeats above this: a loaded machine
UNSTEADY = []  # (how far off, what was seen) of every unsteady measurement of this run, for load_warning


def median_noting_spread(times, what="a measurement"):
    """The median of a measurement's repeated times. Repeats whose quartiles lie further apart than
    LOADED_SPREAD of the median (other work took the cores in some of them) are noted in UNSTEADY."""
    times = sorted(times)
    median = times[len(times) // 2]
    if len(times) >= 4 and median > 0:
        spread = (times[(3 * len(times)) // 4] - times[len(times) // 4]) / median
        if spread > LOADED_SPREAD:
            UNSTEADY.append((spread, f"{what}: its repeats spread by {spread:.0%} of their median"))
    return median


def load_warning():
    """One line when some measurements were unsteady (the machine was loaded), or None."""
    if not UNSTEADY:
        return None
    worst = max(UNSTEADY, key=lambda u: u[0])[1]  # the first of the worst
    return (f"warning: the machine looks loaded: {len(UNSTEADY)} measurement(s) unsteady (worst: {worst}), so these "
            f"figures are unreliable; rerun on a quiet machine (or with more --reps)")


def timeit(fn, device, reps, warmup=3, what="a measurement"):
    """Median seconds per call of fn(), after warm-up calls (median_noting_spread notes a loaded machine)."""
    for _ in range(warmup):
        fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return median_noting_spread(times, what)


def kernel_cases(device, dtype, shape=None, sinkhorn_repeat=None):
    """(name, inputs, reference, fused kernel, bytes moved forward, bytes moved backward): the public
    function with impl="torch" (kernels.py's reference) and with impl="triton" (the custom op).
    shape: (rows, d), rows = B * T tokens (default: 16K x 768 on a GPU, 2048 x 128 on a CPU). The
    inputs are well conditioned (depth attention's scores of std about 3, as tests/test_kernels.py
    makes them), so that the gpu section can hold the kernels to fp32's tolerance on them too."""
    gpu = device.type == "cuda"
    M, d = shape or ((16 * 1024, 768) if gpu else (2048, 128))
    S = 9  # depth attention's sources
    b = torch.empty((), dtype=dtype).element_size()

    def make(*shapes, scale=1.0, shift=0.0):
        return [(shift + scale * torch.randn(s, device=device)).to(dtype).requires_grad_() for s in shapes]

    def impls(fn):
        return lambda *x: fn(*x, impl="torch"), lambda *x: fn(*x, impl="triton")

    r = torch.randn(M, d, device=device)
    r = ((r - r.mean(-1, keepdim=True)) / r.std(-1, keepdim=True)).to(dtype).requires_grad_()
    u, = make((M, d))
    a = torch.rand(M, 1, device=device, requires_grad=True)

    def fp32(*shape, scale=1.0):  # hc/mhc's per-token coefficients: fp32 whatever the stream's dtype
        return (scale * torch.randn(*shape, device=device)).requires_grad_()
    n, K, c = 4, 4 * (4 + 2), 4  # hc_streams; mhc's coefficients per token, n(n + 2); bytes of an fp32 value
    x_hc, = make((M, n, d))
    proj = (torch.randn(M, K, device=device) / d ** 0.5).to(dtype).requires_grad_()  # vec(X) phi^T, as mhc makes it
    mhc_args = [x_hc, proj, fp32(3, scale=0.01), fp32(K, scale=0.01)]
    post_args = [make((M, n, d))[0], make((M, d))[0], fp32(M, n), torch.softmax(torch.randn(M, n, n, device=device),
                                                                              -1).requires_grad_()]
    repeat = sinkhorn_repeat or GPTConfig().mhc_sinkhorn_repeat
    return [
        ("rms_norm", [*make((M, d)), *make((d,), scale=0.5, shift=1.0)], *impls(kernels.rms_norm),
         2 * M * d * b, 3 * M * d * b),
        ("nag_update", [r, u, a], *impls(kernels.nag_update), 3 * M * d * b, 5 * M * d * b),
        # the model's call: a list of sources where they lie; the backward reads them twice
        ("depth_attention", [make(*[(M, d)] * S), *make((d,), scale=3 / d ** 0.5), *make((d,), scale=0.3, shift=1.0)],
         *impls(kernels.depth_attention), (S + 1) * M * d * b, (3 * S + 1) * M * d * b),
        # reads X and its projection, writes u, h_post and the H_res logits; the backward reads X, the
        # projection and the three gradients, and writes X's and the projection's
        ("mhc_pre_mix", mhc_args, *impls(kernels.mhc_pre_mix), M * ((n * d + K + d) * b + (n + n * n) * c),
         M * ((2 * n * d + 2 * K + d) * b + (n + n * n) * c)),
        # the H_res logits (fp32) in, H out; the backward reads the logits and H's gradient, writes theirs
        ("sinkhorn", [fp32(M, n, n)], *impls(functools.partial(kernels.sinkhorn, repeat=repeat)),
         2 * M * n * n * c, 3 * M * n * n * c),
        # reads X, f and the per-token h_post, H_res, writes X'; the backward reads them and dX', writes
        # the gradients of all four
        ("hc_post_mix", post_args, *impls(kernels.hc_post_mix), M * ((2 * n * d + d) * b + (n + n * n) * c),
         M * ((3 * n * d + 2 * d) * b + 2 * (n + n * n) * c)),
        # dense_mix over S sources where they lie: dwa's weights [S] (reads the sources, writes the mix; the
        # backward reads the mix's gradient and the sources, writes their gradients), then mudd's [M, 4, S]
        # per token (4 ways out; the weights and their gradient per token too)
        ("dense_mix_dwa", [make(*[(M, d)] * S), *make((S,), scale=S ** -0.5)], *impls(kernels.dense_mix),
         (S + 1) * M * d * b, (2 * S + 1) * M * d * b),
        ("dense_mix_mudd", [make(*[(M, d)] * S), *make((M, 4, S), scale=S ** -0.5)], *impls(kernels.dense_mix),
         M * ((S + 4) * d + 4 * S) * b, M * ((2 * S + 4) * d + 8 * S) * b),
    ]


def copy_bandwidth(device, reps, nbytes=256 * 2 ** 20):
    """Bytes per second of a clone of nbytes (read once, written once): what a memory-bound kernel can reach."""
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return 2 * nbytes / timeit(lambda: x.clone(), device, reps, what="the copy")


def kernel_times(name, impl, fn, inputs, device, reps, warmup=3):
    """Median seconds of fn(*inputs) forward (no grad) and forward + backward; a forward that takes
    1.5x its forward + backward notes a loaded machine in UNSTEADY."""
    def fwd():
        with torch.no_grad():
            fn(*inputs)

    def fwd_bwd():
        out = fn(*inputs)
        out = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(out[0], torch.ones_like(out[0]))
    t_f = timeit(fwd, device, reps, warmup, what=f"{name} {impl} forward")
    t_fb = timeit(fwd_bwd, device, reps, warmup, what=f"{name} {impl} forward+backward")
    if t_f > 1.5 * t_fb:  # a forward alone cannot take much longer than forward and backward: load
        UNSTEADY.append((t_f / t_fb - 1, f"{name} {impl}: the forward alone took {t_f / t_fb:.1f}x its "
                                         f"forward+backward"))
    return t_f, t_fb


def bench_kernels(device, dtype, use_compile, reps):
    print(f"\n## kernels ({device.type}, {str(dtype).replace('torch.', '')})")
    if device.type == "cuda":
        print(f"copy bandwidth: {copy_bandwidth(device, reps) / 1e9:.0f} GB/s (clone of 256 MiB)")
    print("| kernel | impl | fwd us | fwd GB/s | fwd+bwd us | fwd+bwd GB/s | fwd+bwd vs eager |")
    print("|---|---|---|---|---|---|---|")
    for name, inputs, ref, fused, bytes_fwd, bytes_bwd in kernel_cases(device, dtype):
        impls = {"eager": ref}
        if use_compile:
            impls["compile"] = torch.compile(impls["eager"])
        if device.type == "cuda" and kernels.triton is not None:
            impls["triton"] = fused
        eager_total = None
        for impl, fn in impls.items():
            try:
                t_f, t_fb = kernel_times(name, impl, fn, inputs, device, reps)
            except Exception as e:  # e.g. no C++ compiler for inductor on this CPU
                print(f"| {name} | {impl} | failed: {type(e).__name__}: {str(e).splitlines()[0][:80]} |||||")
                continue
            eager_total = eager_total or t_fb
            print(f"| {name} | {impl} | {t_f * 1e6:.0f} | {bytes_fwd / t_f / 1e9:.1f} | {t_fb * 1e6:.0f} "
                  f"| {(bytes_fwd + bytes_bwd) / t_fb / 1e9:.1f} | {eager_total / t_fb:.2f}x |")


def train_step(config, compiled, device, autocast, B, backend, optimizer="adamw"):
    """One training step (forward, backward, the optimizer: AdamW, or Muon + AdamW as train.py's
    --optimizer=muon builds them) of a fresh GPT(config) on a fixed random batch."""
    torch.manual_seed(0)
    model = GPT(config).to(device)
    muon = run_config.muon_settings({**run_config.DEFAULTS, "optimizer": optimizer})
    opt = model.configure_optimizers(0.1, 1e-4, (0.9, 0.95), muon=muon)
    step_model = torch.compile(model, backend=backend) if compiled else model
    x = torch.randint(0, config.vocab_size, (B, config.block_size), device=device)

    def step():
        with autocast:
            _, loss = step_model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def time_steps(configs, device, dtype, use_compile, reps, B, backend="inductor", until=None, on_error=None,
               optimizer="adamw"):
    """Median seconds of one training step (forward, backward, AdamW) of each GPTConfig in
    `configs` (name -> config, or name -> (config, compile this one?)), and the peak memory (GiB,
    GPU only) of each. All are built (and compiled) first, then timed in interleaved rounds, so
    drift on a shared machine hits each alike. until(name), when given, is asked before each build:
    False leaves that config out (time has run out); on_error(name, exception), when given, is told
    of a config that fails to build or step, which is then left out (else the exception propagates)."""
    gpu = device.type == "cuda"
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    configs = {name: c if isinstance(c, tuple) else (c, use_compile) for name, c in configs.items()}
    # Every GPT shares one dynamo cache (GPT.forward's), an entry per compiled model; past recompile_limit
    # (8) a model silently runs eager. So a fresh cache per table, with room for each of its models (a
    # reset between models would drop the compiled code that the interleaved rounds still call).
    torch._dynamo.reset()
    room = torch._dynamo.config.recompile_limit + sum(compiled for _, compiled in configs.values())
    steps, mem = {}, {}
    with torch._dynamo.config.patch(recompile_limit=room):
        for name, (config, compiled) in configs.items():
            if until is not None and not until(name):
                continue
            base_mem = torch.cuda.memory_allocated() if gpu else 0
            if gpu:
                torch.cuda.reset_peak_memory_stats()
            try:
                step = train_step(config, compiled, device, autocast, B, backend, optimizer)
                timeit(step, device, 2)  # warm-up: compilation, optimizer state
            except Exception as e:  # e.g. out of memory: the other configs still run
                if on_error is None:
                    raise
                on_error(name, e)
                step = None
                if gpu:
                    torch.cuda.empty_cache()
                continue
            steps[name] = step
            mem[name] = (torch.cuda.max_memory_allocated() - base_mem) / 2 ** 30 if gpu else None
    times = {name: [] for name in steps}
    for _ in range(reps):
        for name, step in steps.items():
            times[name].append(timeit(step, device, 1, warmup=0))
    return {name: median_noting_spread(ts, f"step of {name}") for name, ts in times.items()}, mem


def saved_activation_bytes(model, idx, compiled=False, dtype=torch.float32):
    """Bytes autograd keeps for the backward of one training forward. Eager: every tensor saved
    for backward, each storage counted once (a source that several sublayers read is one storage).
    Compiled: the inputs of the backward graph that AOTAutograd's min-cut partitioner (the one
    inductor uses) makes, i.e. what the compiled forward keeps for the backward."""
    autocast = torch.autocast(idx.device.type, dtype=dtype, enabled=dtype != torch.float32)
    if not compiled:
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
            model(idx, idx)
        return sum(storages.values())
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    saved = {}

    def backward_inputs(gm, example_inputs):
        values = [n.meta.get("val") for n in gm.graph.nodes
                  if n.op == "placeholder" and not n.name.startswith("tangents")]
        saved["bytes"] = sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))
        return make_boxed_func(gm.forward)
    backend = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward), bw_compiler=backward_inputs,
                           partition_fn=min_cut_rematerialization_partition)
    torch._dynamo.reset()
    with autocast:
        _, loss = torch.compile(model, backend=backend, fullgraph=True)(idx, idx)
    loss.backward()
    torch._dynamo.reset()
    return saved["bytes"]


GPT2_SHAPE = dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50257)  # GPT-2 124M


def step_shape(title, device, dtype, use_compile, batch_size, cpu_layers, layers=0):
    """GPTConfig keys and batch size of a timed step: GPT-2 124M on a GPU, quickstart width on a CPU
    (cpu_layers deep); `layers` (--layers), when set, overrides the depth of either."""
    gpu = device.type == "cuda"
    shape = dict(GPT2_SHAPE) if gpu else dict(n_layer=cpu_layers, n_head=4, n_embd=128, block_size=64, vocab_size=65)
    if layers:
        shape["n_layer"] = layers
    B = batch_size or (8 if gpu else 12)
    print(f"\n## {title} ({device.type}, {str(dtype).replace('torch.', '')}, compile={use_compile}, B={B}, {shape})")
    return shape, B




# ops that move no data (views, and allocations whose bytes the op that fills them counts)
NO_TRAFFIC = {"view", "_unsafe_view", "as_strided", "t", "transpose", "expand", "permute", "select", "slice",
              "unsqueeze", "squeeze", "detach", "alias", "unbind", "split", "split_with_sizes", "unflatten",
              "lift_fresh", "diagonal", "view_as_real", "view_as_complex", "_reshape_alias", "empty",
              "empty_strided", "empty_like", "new_empty", "new_empty_strided"}


class Traffic(TorchDispatchMode):
    """What a step asks of the dispatcher and of memory: `ops`, the aten ops it runs (views excluded), and
    `bytes`, what they move if each op reads its inputs and writes its outputs once (every tensor it takes
    or makes counted once). A model of eager traffic: caches and fusion are not in it."""

    def __init__(self):
        super().__init__()
        self.ops, self.bytes = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ not in NO_TRAFFIC:
            self.ops += 1
            tensors = {id(t): t for t in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)}
            self.bytes += sum(t.numel() * t.element_size() for t in tensors.values())
        return out


def step_counts(step):
    """(matmul FLOPs, bytes moved, ops) of one call of step (torch's FlopCounterMode counts the matmuls and
    attention; Traffic the rest)."""
    traffic, counter = Traffic(), FlopCounterMode(display=False)
    with counter, traffic:
        step()
    return counter.get_total_flops(), traffic.bytes, traffic.ops


def fit_step_time(times, counts):
    """Least squares of step time on (matmul FLOPs, bytes moved, ops) over the rows: the seconds each costs
    here, or None with fewer than 4 rows. Each row's fitted time is then a sum of three parts, which says
    what its step is bound by."""
    names = [n for n in times if n in counts]
    if len(names) < 4:
        return None
    A = torch.tensor([counts[n] for n in names], dtype=torch.float64)
    t = torch.tensor([times[n] for n in names], dtype=torch.float64)
    return torch.linalg.lstsq(A, t.unsqueeze(-1)).solution.squeeze(-1).tolist()


def bench_model(device, dtype, use_compile, reps, batch_size, layers=0, optimizer="adamw"):
    gpu = device.type == "cuda"
    shape, B = step_shape("model step", device, dtype, use_compile, batch_size, cpu_layers=4, layers=layers)
    configs = {name: GPTConfig(**kw, **shape) for name, kw in {**{r: dict(residual=r) for r in RESIDUALS},
                                                                 **VARIANTS}.items()}
    times, mem = time_steps(configs, device, dtype, use_compile, reps, B, optimizer=optimizer)
    idx = torch.randint(0, shape["vocab_size"], (B, shape["block_size"]), device=device)
    saved, counts = {}, {}
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    for residual, config in configs.items():
        torch.manual_seed(0)
        saved[residual] = saved_activation_bytes(GPT(config).to(device), idx, dtype=dtype)
        if not use_compile and residual in times:  # what an eager step asks of memory and of the dispatcher
            step = train_step(config, False, device, autocast, B, "inductor", optimizer)
            step()  # the optimizer's state made
            counts[residual] = step_counts(step)
    print("| residual (option) | ms/step | vs prenorm | peak memory GiB | vs prenorm | saved MiB (eager) | vs prenorm |")
    print("|---|---|---|---|---|---|---|")
    for residual, t in times.items():
        mem_cols = f"{mem[residual]:.2f} | {mem[residual] / mem['prenorm']:.2f}x" if gpu else "n/a (CPU) |"
        print(f"| {residual} | {t * 1e3:.1f} | {t / times['prenorm']:.2f}x | {mem_cols} "
              f"| {saved[residual] / 2 ** 20:.1f} | {saved[residual] / saved['prenorm']:.2f}x |")
    print_step_bounds(times, counts, B * shape["block_size"])
    return times


def print_step_bounds(times, counts, tokens):
    """Each row's step against what it moves: matmul FLOPs, bytes and ops per step as ratios to prenorm's,
    then the least-squares fit of the step time on the three over the rows, and each row's time split into
    its three parts (the largest part beside prenorm's is what bounds a design's step here)."""
    if "prenorm" not in counts:
        return
    base = counts["prenorm"]
    coef = fit_step_time(times, counts)
    print(f"\nWhat each step moves (eager, one step; per token: / {tokens}) and what the time is made of:")
    if coef is not None:
        rates = [f"{1 / c / 1e9:.1f}" if c > 0 else "inf" for c in coef[:2]]
        print(f"fit over the rows: matmuls at {rates[0]} GFLOP/s, bytes at {rates[1]} GB/s, {coef[2] * 1e6:.2f} us per op")
    print("| residual (option) | matmul MFLOP/token | vs prenorm | KB moved/token | vs prenorm | ops/step | vs prenorm "
          "| ms/step | fitted ms: matmuls + bytes + ops |")
    print("|---|---|---|---|---|---|---|---|---|")
    for residual, (f, b, o) in counts.items():
        parts = " + ".join(f"{c * x * 1e3:.1f}" for c, x in zip(coef, (f, b, o))) if coef is not None else "n/a"
        print(f"| {residual} | {f / tokens / 1e6:.2f} | {f / base[0]:.2f}x | {b / tokens / 1e3:.0f} | {b / base[1]:.2f}x "
              f"| {o} | {o / base[2]:.2f}x | {times[residual] * 1e3:.1f} | {parts} |")


MOD_RUNS = [("nag", "nag"), ("prenorm", "router")]  # (residual, mod) timed at each mod_rate


def mod_configs(shape, rates, **kw):
    """{(residual, mod, mod_rate): GPTConfig} of MOD_RUNS at each rate."""
    return {(r, m, rate): GPTConfig(residual=r, mod=m, mod_rate=rate, **shape, **kw)
            for r, m in MOD_RUNS for rate in rates}


def bench_mod(device, dtype, use_compile, reps, batch_size, rates=(0.0, 0.25, 0.5)):
    """Mixture-of-Depths: step time at each mod_rate relative to the same model at mod_rate 0 (dense).
    Skipped tokens are gathered out of the matmuls, so the ratio is the real saving."""
    gpu = device.type == "cuda"
    shape, B = step_shape("Mixture-of-Depths step", device, dtype, use_compile, batch_size, cpu_layers=8)
    configs = mod_configs(shape, rates)
    times, mem = time_steps(configs, device, dtype, use_compile, reps, B)
    print("| residual | mod | mod_rate | ms/step | vs mod_rate 0 | peak memory GiB |")
    print("|---|---|---|---|---|---|")
    for (r, m, rate), t in times.items():
        dense = times[(r, m, rates[0])]
        mem_col = f"{mem[(r, m, rate)]:.2f}" if gpu else "n/a (CPU)"
        print(f"| {r} | {m} | {rate:g} | {t * 1e3:.1f} | {t / dense:.2f}x | {mem_col} |")
    return times


# -----------------------------------------------------------------------------
# quickstart: the whole `python train.py config/shakespeare_char_cpu.py` command against a baseline
# run of nanoGPT's model and loop at the same shape, batches, schedule and evals

class BaselineGPT(nn.Module):
    """The quickstart's baseline: nanoGPT's GPT (learned positions, LayerNorm with biases, GELU MLP,
    tied embedding and head, causal SDPA) and nothing else."""

    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd, dropout=0.0):
        super().__init__()
        self.n_head = n_head
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(
            ln_1=nn.LayerNorm(n_embd), c_attn=nn.Linear(n_embd, 3 * n_embd), c_proj=nn.Linear(n_embd, n_embd),
            ln_2=nn.LayerNorm(n_embd), c_fc=nn.Linear(n_embd, 4 * n_embd), mlp_proj=nn.Linear(4 * n_embd, n_embd),
        )) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight
        for name, p in self.named_parameters():
            if p.dim() >= 2:  # nanoGPT's init, with its scaled residual projections
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(("c_proj.weight", "mlp_proj.weight")) else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx, targets):
        B, T = idx.shape
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(T, device=idx.device)))
        for b in self.blocks:
            q, k, v = b.c_attn(b.ln_1(x)).view(B, T, 3, self.n_head, -1).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.drop(b.c_proj(y.transpose(1, 2).reshape(B, T, -1)))
            x = x + self.drop(b.mlp_proj(F.gelu(b.c_fc(b.ln_2(x)))))
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def baseline_train(argv):
    """`python bench.py baseline CONFIG [--key=value]`: train.py's run done by nanoGPT's loop on BaselineGPT:
    the same data, batches, LR schedule (the same one-line cosine), AdamW groups, gradient clipping, evals
    (the same fixed batches) and checkpoints at evals. Prints the same 'step N: ... val loss X' lines."""
    cfg = configure(argv, run_config.DEFAULTS, run_config.HELP_FROM)
    device, _, autocast = pick_device(cfg["device"], cfg["dtype"])  # as nanoGPT: fp32 on a CPU
    paths, vocab_size = run_config.find_data(cfg)
    torch.manual_seed(cfg["seed"])
    model = BaselineGPT(vocab_size, cfg["block_size"], cfg["n_layer"], cfg["n_head"], cfg["n_embd"],
                        cfg["dropout"]).to(device)
    params = [p for p in model.parameters()]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg["weight_decay"]},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=cfg["learning_rate"], betas=(cfg["beta1"], cfg["beta2"]),
                                  fused=device.type == "cuda")  # nanoGPT: fused where CUDA has it
    decay_iters = cfg["lr_decay_iters"] or cfg["max_iters"]
    min_lr = cfg["min_lr"] if cfg["min_lr"] is not None else cfg["learning_rate"] / 10
    os.makedirs(cfg["out_dir"], exist_ok=True)
    B, T, accum, best = cfg["batch_size"], cfg["block_size"], cfg["gradient_accumulation_steps"], float("inf")
    g = torch.Generator().manual_seed(cfg["seed"])
    X, Y = run_config.get_batch(paths["train"], B, T, g, device)
    for it in range(cfg["max_iters"] + 1):
        lr = cfg["learning_rate"] * (it + 1) / (cfg["warmup_iters"] + 1) if it < cfg["warmup_iters"] else \
            min_lr if it > decay_iters else min_lr + 0.5 * (1 + math.cos(math.pi * (it - cfg["warmup_iters"]) / max(
                1, decay_iters - cfg["warmup_iters"]))) * (cfg["learning_rate"] - min_lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        if it % cfg["eval_interval"] == 0 or it == cfg["max_iters"]:
            model.eval()
            losses = {}
            with torch.no_grad():
                for split in ("train", "val"):
                    ge = torch.Generator().manual_seed(run_config.EVAL_SEED)
                    with autocast:
                        losses[split] = sum(model(*run_config.get_batch(paths[split], B, T, ge, device)).item()
                                            for _ in range(cfg["eval_iters"])) / cfg["eval_iters"]
            model.train()
            print(f"step {it}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}", flush=True)
            if it > 0 and (losses["val"] < best or cfg["always_save_checkpoint"]):
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "iter_num": it},
                           os.path.join(cfg["out_dir"], "ckpt.pt"))
            best = min(best, losses["val"])
        if it == cfg["max_iters"]:
            break
        t0 = time.time()
        for _ in range(accum):
            with autocast:
                loss = model(X, Y) / accum
            X, Y = run_config.get_batch(paths["train"], B, T, g, device)  # the next batch while this one runs
            loss.backward()
        if cfg["grad_clip"]:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if it % cfg["log_interval"] == 0:
            print(f"iter {it}: loss {loss.item() * accum:.4f}, {(time.time() - t0) * 1000:.2f} ms", flush=True)


QUICKSTART = "config/shakespeare_char_cpu.py"
# nanoGPT's own train.py at the quickstart's recipe (its Shakespeare config has our LR, schedule, beta2 and
# clipping): the shape, the CPU, eager, and the evals; --max_iters, --lr_decay_iters and --out_dir are added
NANOGPT_ARGS = ["train.py", "config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--block_size=64",
                "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128", "--dropout=0.0", "--eval_interval=250",
                "--eval_iters=20"]
EVAL_LINE = re.compile(r"^step (\d+): train loss [\d.]+, val loss ([\d.]+)", re.M)  # train.py's and nanoGPT's
PROGRESS_LINE = re.compile(r"^iter (\d+)/\d+: ")  # train.py's progress line (train.log_line)


def nanogpt_checkout(path):
    """The nanoGPT checkout --nanogpt names, with its Shakespeare data prepared; a one-line error naming the
    fix otherwise."""
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(os.path.join(path, "train.py")) or \
            not os.path.isfile(os.path.join(path, "config", "train_shakespeare_char.py")):
        raise ConfigError(f"--nanogpt={path}: not a nanoGPT checkout (no train.py and config/train_shakespeare_char.py);"
                          f" get one: git clone https://github.com/karpathy/nanoGPT {path}")
    data = os.path.join(path, "data", "shakespeare_char")
    if not all(os.path.isfile(os.path.join(data, f)) for f in ("train.bin", "val.bin", "meta.pkl")):
        ours = os.path.join(REPO, "data", "shakespeare_char", "input.txt")
        raise ConfigError(f"--nanogpt={path}: its Shakespeare data is not prepared; prepare it from the same text: "
                          f"cp {ours} {data}/ && python {data}/prepare.py")
    return path


def run_timed(cmd, cwd, stop_below=None, stop_at_iter=None):
    """Run cmd (unbuffered output) to its end: (wall seconds, CPU seconds of the process, its stdout, [(seconds
    since its start, val loss, iteration)] of each eval line as it was printed). The run is stopped (killed) at
    its first eval at or below the val loss stop_below, or at its first progress line ('iter N/M: ...') of an
    iteration N >= stop_at_iter. A failed run raises with its output's end."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, evals, stopped = [], [], False
    for line in proc.stdout:
        lines.append(line)
        found, progress = EVAL_LINE.match(line), PROGRESS_LINE.match(line)
        if found:
            evals.append((time.perf_counter() - t0, float(found.group(2)), int(found.group(1))))
        stopped = (found is not None and stop_below is not None and evals[-1][1] <= stop_below) or \
            (progress is not None and stop_at_iter is not None and int(progress.group(1)) >= stop_at_iter)
        if stopped:
            proc.kill()
            break
    _, status, usage = os.wait4(proc.pid, 0)
    wall, out = time.perf_counter() - t0, "".join(lines)
    proc.stdout.close()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0 and not stopped:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{out[-2000:]}")
    return wall, usage.ru_utime + usage.ru_stime, out, evals


TO_LOSS_EVALS = 25  # the time to the peer's loss: our run with an eval every this many iterations


def cpu_name(cpuinfo="/proc/cpuinfo"):
    """The CPU's model name, as the kernel reports it (Linux), else what the platform module says: a timing's
    device is its CPU, and two machines of the same size can time a ratio differently."""
    try:
        with open(cpuinfo) as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names and names[0] else (platform.processor() or "unknown")


def device_label(device):
    """What a timing ran on, as bench prints and records it: the GPU's name, or the CPU's and its threads."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    n = torch.get_num_threads()
    return f"CPU ({cpu_name()}, {n} thread{'s' if n > 1 else ''})"


def cores_busy(seconds=1.0, stat="/proc/stat"):
    """The fraction of the CPUs' time spent busy (not idle, not waiting on I/O) over the next `seconds`, from
    the kernel's counters (Linux); None where there are none. The load average lags by minutes: a machine
    whose other work just stopped still shows it."""
    def counters():
        with open(stat) as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        return sum(ticks), ticks[3] + ticks[4]  # all, idle + iowait
    try:
        (all0, idle0), _, (all1, idle1) = counters(), time.sleep(seconds), counters()
    except (OSError, ValueError, IndexError):
        return None
    return 1 - (idle1 - idle0) / max(all1 - all0, 1)


def pair_ratios(ours, peer):
    """The line that reads interleaved pairs of wall times: each pair's ratio (ours / the peer's, the two run
    back to back), their geometric mean and its 95% t-interval over the pairs. The pairs' spread holds the drift
    between them (a machine slower for one pair slows both of its runs, and the ratio less): with one pair there
    is no interval."""
    logs = [math.log(a / b) for a, b in zip(ours, peer)]
    mean, sd = stats.mean_std(logs)
    line = f"per pair, our wall / the peer's: {' '.join(f'{math.exp(x):.2f}' for x in logs)}; geometric mean " \
           f"{math.exp(mean):.2f}x"
    if len(logs) < 2:
        return line + " (one pair: no interval)"
    (lo, hi), _ = stats.t_test(mean, sd / len(logs) ** 0.5, len(logs) - 1)
    return line + f", 95% interval {math.exp(lo):.2f}-{math.exp(hi):.2f}x (t over the {len(logs)} pairs)"


def bench_quickstart(pairs, max_iters, config=QUICKSTART, nanogpt=""):
    """Wall time of the whole train.py command (start-up, data checks, training, evals, checkpoints) against a
    peer on the same recipe, both cut to max_iters (LR schedule included), in `pairs` interleaved pairs (who goes
    first alternates): the median of each, their ratio, the CPU time's ratio, each run's last val loss. The peer:
    nanoGPT itself (nanogpt: a checkout's path; ours then runs as the README's command does, its final eval
    included), or `bench.py baseline` (nanoGPT's model and loop in this repo; ours without its final eval,
    which the baseline has not). Then, after each pair, the time to the peer's last val loss: ours again with an
    eval every TO_LOSS_EVALS iterations, stopped at its first eval at or below the pair's peer run's last val loss
    (its time, those evals included, is an upper bound), then ours as timed in the pair, stopped at that eval's
    iteration (its progress line: one step past it); the medians against the peer's median wall.
    Returns {name: (median seconds, [last val losses])}."""
    peer = "nanoGPT itself" if nanogpt else "the nanoGPT-like baseline"
    print(f"\n## quickstart: python train.py {config} --max_iters={max_iters} vs {peer}, "
          f"{pairs} interleaved pair(s), {os.cpu_count()} cores")
    run_config.find_data(configure([config], run_config.DEFAULTS))  # prepared before any timing
    cut = [f"--max_iters={max_iters}", f"--lr_decay_iters={max_iters}"]
    if nanogpt:
        checkout = nanogpt_checkout(nanogpt)
        runs = {"train.py (nanodepth prenorm)": (["train.py", config, *cut, "--device=cpu"], REPO),
                f"nanoGPT ({checkout})": ([*NANOGPT_ARGS, *cut], checkout)}
    else:
        runs = {"train.py (nanodepth prenorm)": (["train.py", config, *cut, "--final_eval_tokens=0"], REPO),
                "baseline (nanoGPT model and loop)": (["bench.py", "baseline", config, *cut], REPO)}
    ours, base = list(runs)
    walls, cpus, losses = ({name: [] for name in runs} for _ in range(3))
    reached, bound, at_iter = [], [], []  # per pair: the time to the peer's loss, its upper bound, its iteration
    busy = cores_busy()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(pairs):
            for name, (args, cwd) in (list(runs.items()) if i % 2 == 0 else list(runs.items())[::-1]):
                out_dir = os.path.join(tmp, f"{i}-{list(runs).index(name)}")
                wall, cpu, _, seen = run_timed([sys.executable, *args, f"--out_dir={out_dir}"], cwd)
                if not seen:
                    raise RuntimeError(f"{' '.join(args)} printed no eval line ('step N: ... val loss X')")
                walls[name].append(wall)
                cpus[name].append(cpu)
                losses[name].append(seen[-1][1])
            # where our run reaches the peer's loss: evaluated every TO_LOSS_EVALS iterations, to the first eval
            # at or below it (its evals and their checkpoints add time: that run's time is an upper bound)
            target = losses[base][-1]
            fine = [sys.executable, "train.py", config, *cut, f"--eval_interval={TO_LOSS_EVALS}", "--final_eval_tokens=0",
                    f"--out_dir={os.path.join(tmp, f'{i}-to-loss')}"]
            _, _, _, seen = run_timed(fine, REPO, stop_below=target)
            first = next(((t, it) for t, v, it in seen if v <= target), None)
            bound.append(first and first[0])
            at_iter.append(first and first[1])
            if first is None:
                reached.append(None)
                continue
            # the time to it: our run as timed above (its evals every 250 iterations), stopped at that iteration
            args, cwd = runs[ours]
            timed = [sys.executable, *args, f"--log_interval={TO_LOSS_EVALS}", f"--out_dir={os.path.join(tmp, f'{i}-to-iter')}"]
            reached.append(run_timed(timed, cwd, stop_at_iter=first[1])[0])
    median = {name: statistics.median(w) for name, w in walls.items()}
    print(f"the cores were {'(unknown: no /proc/stat)' if busy is None else f'{busy:.0%}'} busy in the second "
          f"before the first run (other processes; idle is near 0%)")
    print("| command | median wall s | vs the peer | median CPU s | vs the peer | last val loss |")
    print("|---|---|---|---|---|---|")
    for name in runs:
        cpu = statistics.median(cpus[name])
        print(f"| {name} | {median[name]:.1f} | {median[name] / median[base]:.2f}x | {cpu:.1f} "
              f"| {cpu / statistics.median(cpus[base]):.2f}x | {' '.join(f'{x:.4f}' for x in losses[name])} |")
    print(pair_ratios(walls[ours], walls[base]))
    if None in reached:
        print(f"time to the peer's last val loss: not reached by {reached.count(None)} of our {pairs} runs")
    else:
        t, b = statistics.median(reached), statistics.median(bound)
        print(f"time to the peer's last val loss ({statistics.median(losses[base]):.4f}): {t:.1f} s, "
              f"{t / median[base]:.2f}x the peer's wall (our run stopped at the iteration where it first reached it, "
              f"evaluated every {TO_LOSS_EVALS}: median {statistics.median(at_iter):.0f}); with those evals "
              f"at most {b:.1f} s, {b / median[base]:.2f}x")
    return {name: (median[name], losses[name]) for name in runs}


def bench_steps(sweep, rounds, out_path, device, dtype):
    """A training step (forward, backward, AdamW; the run's batch; compiled on a GPU when the runs are) of
    every cell of a sweep config, built as its runs are (the train config, the sweep's train_args, the cell's
    keys), in `rounds` interleaved
    rounds (the order reversed every other round), each cell timed as the median of 3 steps. Every
    round's time of a cell and of its baseline cell (flops.baselines: its depth's prenorm) goes to a CSV,
    out_path, which flops.py multiplier --step_times reads; printed: each cell's median ratio with a 95%
    bootstrap interval of that median. Returns {cell: [its time / its baseline's, per round]}."""
    import numpy as np
    if not sweep:
        raise ConfigError("--section=steps times a sweep config's cells: add --sweep=config/<sweep>.py")
    sw = configure([sweep], flops.SWEEP_DEFAULTS)
    cells = flops.sweep_cells(sw)
    base_argv = [os.path.abspath(sw["train_config"]), *sw["train_args"]]
    cfgs = {name: flops.train_config([*base_argv, *flops.override_args(ov)]) for name, ov in cells}
    keys = [{"cell": name, "n_layer": cfgs[name]["n_layer"], "residual": cfgs[name]["residual"],
             "mod": "" if cfgs[name]["mod"] == "none" else cfgs[name]["mod"],
             "args": " ".join(flops.override_args({k: v for k, v in ov.items() if k not in flops.GRID_KEYS}))}
            for name, ov in cells]
    base_of = flops.baselines(keys, sw["baseline"])
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    label = device_label(device)
    print(f"\n## training steps of {sweep}'s {len(cells)} cells, {rounds} interleaved rounds, on {label}")
    steps = {}
    torch._dynamo.reset()  # compiled (on a GPU, as the runs are): room in dynamo's cache for every cell's model
    with torch._dynamo.config.patch(recompile_limit=torch._dynamo.config.recompile_limit + len(cells)):
        for name, _ in cells:
            compiled = cfgs[name]["compile"] and device.type == "cuda"
            steps[name] = train_step(flops.model_config(cfgs[name]), compiled, device, autocast,
                                     cfgs[name]["batch_size"], "inductor")
            timeit(steps[name], device, 2)  # warm-up: compilation, optimizer state
        times = {name: [] for name in steps}
        for i in range(rounds):
            for name in (list(steps) if i % 2 == 0 else list(steps)[::-1]):
                times[name].append(timeit(steps[name], device, 3, warmup=0, what=f"step of {name}"))
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    ratios = {}
    with open(out_path + ".tmp", "w", newline="") as f:
        w = csv.writer(f)  # quoted where a field needs it: the device label holds a comma
        w.writerow(["cell", "baseline", "n_layer", "device", "round", "ms", "baseline_ms"])
        for name in steps:
            base = base_of[name]
            if base == name:
                continue
            for i, (t, tb) in enumerate(zip(times[name], times[base])):
                w.writerow([name, base, cfgs[name]["n_layer"], label, i, f"{t * 1e3:.4f}", f"{tb * 1e3:.4f}"])
            ratios[name] = [t / tb for t, tb in zip(times[name], times[base])]
    os.replace(out_path + ".tmp", out_path)
    rng = np.random.default_rng(0)
    print("| cell | baseline | layers | ms/step | its step time / the baseline's (median) | 95% interval |")
    print("|---|---|---|---|---|---|")
    for name, r in ratios.items():
        r = np.asarray(r)
        meds = [np.median(r[rng.integers(len(r), size=len(r))]) for _ in range(1000)]
        lo, hi = np.percentile(meds, [2.5, 97.5])
        print(f"| {name} | {base_of[name]} | {cfgs[name]['n_layer']} | {statistics.median(times[name]) * 1e3:.1f} "
              f"| {np.median(r):.3f} | {lo:.3f} - {hi:.3f} |")
    print(f"every round's times: {out_path} (python flops.py multiplier <results.csv> --step_times={out_path})")
    return ratios


SECTIONS = ("all", "kernels", "model", "mod", "compile", "quickstart", "sample", "gpu", "steps")
COMPILE_VARIANTS = {  # name: (compiled?, kernels)
    "eager": (False, "auto"),
    "compiled reference": (True, "torch"),  # inductor fuses the plain-PyTorch references
    "compiled custom ops": (True, "triton"),  # the nanodepth:: ops stay in the graph (CPU: their reference)
}


def bench_compile(device, dtype, reps, batch_size, backend="inductor", layers=4, saved_layers=16,
                  residuals=tuple(RESIDUALS)):
    """Each residual mode eager, compiled with the kernels' references fused by inductor, and compiled
    with the kernels as custom ops: step time, peak memory (GPU) and saved-activation bytes, each as
    a ratio to prenorm in the same variant. On a CPU the saved bytes are taken at 16 layers, where
    AttnRes's O(L) sources matter (the target: at most 1.5x prenorm's); on a GPU at the 124M shape."""
    gpu = device.type == "cuda"
    shape, B = step_shape("compile", device, dtype, True, batch_size, cpu_layers=layers)
    configs = {(r, v): (GPTConfig(residual=r, kernels=k, **shape), c)
               for r in residuals for v, (c, k) in COMPILE_VARIANTS.items()}
    times, mem = time_steps(configs, device, dtype, True, reps, B, backend=backend)
    deep = dict(shape, n_layer=saved_layers) if not gpu else shape
    idx = torch.randint(0, deep["vocab_size"], (min(B, 4), deep["block_size"]), device=device)
    saved = {}
    for (r, v), (config, compiled) in configs.items():
        torch.manual_seed(0)
        model = GPT(GPTConfig(residual=r, kernels=config.kernels, **deep)).to(device)
        saved[(r, v)] = saved_activation_bytes(model, idx, compiled, dtype)
    print(f"saved activations at {deep['n_layer']} layers, B={idx.size(0)}, T={deep['block_size']}, "
          f"d={deep['n_embd']}; step times at {shape['n_layer']} layers, B={B}")
    print("| residual | variant | ms/step | vs prenorm | vs eager | peak memory GiB | vs prenorm | saved MiB | vs prenorm |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (r, v), t in times.items():
        base, eager = times[("prenorm", v)], times[(r, "eager")]
        mem_cols = (f"{mem[(r, v)]:.2f} | {mem[(r, v)] / mem[('prenorm', v)]:.2f}x" if gpu else "n/a (CPU) |")
        print(f"| {r} | {v} | {t * 1e3:.1f} | {t / base:.2f}x | {t / eager:.2f}x | {mem_cols} "
              f"| {saved[(r, v)] / 2 ** 20:.1f} | {saved[(r, v)] / saved[('prenorm', v)]:.2f}x |")
    return times, saved


# -----------------------------------------------------------------------------
# sample: generation speed of one mod=nag model, dense against routed

def sample_model(out_dir, device, layers=8, width=128):
    """The mod=nag model to sample: out_dir's checkpoint, or a random one with thresholds set."""
    if out_dir:
        model = run_config.model_from_checkpoint(
            run_config.load_checkpoint(os.path.join(out_dir, "ckpt.pt"), device, reader=True), device)
        if model.config.mod != "nag" or not torch.isfinite(model.mod.tau).all():
            raise ConfigError(f"{out_dir} is not a mod=nag model trained with routing (mod={model.config.mod}); "
                              f"pass the out_dir of a --mod=nag --mod_rate=0.25 run")
        return model
    if width % 4 or width < 8:
        raise ConfigError(f"--width={width}: the random model has 4 heads, so give a multiple of 4, >= 8")
    torch.manual_seed(0)
    model = GPT(GPTConfig(residual="nag", mod="nag", mod_rate=0.25, n_layer=layers, n_head=4, n_embd=width,
                          block_size=64, vocab_size=65)).to(device)
    with torch.no_grad():  # training-mode forwards: top-k routing updates the thresholds tau (an EMA)
        for _ in range(20):
            model(torch.randint(0, 65, (12, 64), device=device))
    return model.eval()


def time_generate(model, tokens, device, dtype):
    """Seconds of one generate() of `tokens` tokens after a one-token prompt, batch 1, with the KV
    cache, and generate()'s stats (the tokens that ran each sublayer)."""
    torch.manual_seed(1)
    prompt = torch.zeros((1, 1), dtype=torch.long, device=device)
    t0 = time.perf_counter()
    with torch.autocast(device.type, dtype, enabled=dtype != torch.float32):
        _, stats = model.generate(prompt, tokens, kv_cache=True, stats=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, stats


def bench_sample(device, dtype, out_dir, tokens, pairs, layers=0, width=128):
    model = sample_model(out_dir, device, layers or 8, width)
    tau = model.mod.tau.clone()
    variants = {"dense": torch.full_like(tau, float("nan")),  # nan: every token runs
                "routed": tau, "skip_all": torch.full_like(tau, float("inf"))}  # no score reaches inf
    c = model.config
    print(f"\n## Sampling with a KV cache: {out_dir or 'a random model, thresholds set on random tokens'} "
          f"({c.n_layer} layers, {c.n_embd} wide, mod=nag at mod_rate {c.mod_rate:g}), {tokens} tokens per "
          f"sample, batch 1, {pairs} interleaved triples")
    times, skipped = {name: [] for name in variants}, {name: [] for name in variants}
    for _ in range(pairs):
        for name, t in variants.items():
            model.mod.tau.copy_(t)
            seconds, stats = time_generate(model, tokens, device, dtype)
            times[name].append(seconds)
            skipped[name].append(1 - sum(stats["executed"]) / (len(stats["executed"]) * stats["tokens"]))
    model.mod.tau.copy_(tau)
    t = {name: statistics.median(v) for name, v in times.items()}
    skip = {name: statistics.mean(v) for name, v in skipped.items()}
    saved, bound = 1 - t["routed"] / t["dense"], skip["routed"] * (1 - t["skip_all"] / t["dense"])
    print("| routing | tokens/s | skipped (realised) |")
    print("|---|---|---|")
    for name, label in (("dense", "dense (thresholds off)"), ("routed", "mod=nag eval routing"),
                        ("skip_all", "every sublayer skipped")):
        print(f"| {label} | {tokens / t[name]:.0f} | {skip[name]:.3f} |")
    print(f"time per token routed / dense = {t['routed'] / t['dense']:.3f}x: saved {saved:.1%} for {skip['routed']:.1%} "
          f"skipped (target: saved >= 0.8 x skipped = {0.8 * skip['routed']:.1%}: "
          f"{'met' if saved >= 0.8 * skip['routed'] else 'not met'}); at most {bound:.1%} at this shape: a token's "
          f"cost with every sublayer skipped is {t['skip_all'] / t['dense']:.1%} of a dense one")
    return {("sample", name): v / tokens for name, v in t.items()}


# -----------------------------------------------------------------------------
# gpu: every GPU figure from one command, each written down as soon as it is measured

GPU_PARTS = {  # part: its share of --max_minutes (the shares of the parts run add up to the cap)
    "correctness": 3.5,  # each kernel forward and backward against its reference, fp32, bf16; a compiled step per mode
    "bandwidth": 0.5,  # each kernel's GB/s against the copy bandwidth
    "modes": 3.0,  # step cost of every residual mode at the 124M shape, eager and compiled, as ratios to prenorm
    "mod": 1.0,  # Mixture-of-Depths: step time at mod_rate 0.25 and 0.5 against dense
}
GPU_SHAPES = dict(  # on a GPU
    # (rows, d): the model's width, a masked odd width, the widest rows; no row count a multiple of 64 (a block)
    checks=[(8191, 768), (1003, 65), (67, 4096)],
    check_model=dict(n_layer=2, n_head=4, n_embd=96, block_size=64, vocab_size=512), check_batch=2,  # 96: masked
    sinkhorn_repeat=None,  # the model's default (20 iterations)
    bandwidth=(16 * 1024, 768), copy_bytes=256 * 2 ** 20,
    steps=GPT2_SHAPE, batch=8,
)
DRY_SHAPES = dict(  # --dry_run=True: tiny, for a CPU and Triton's interpreter (one Python program per row)
    checks=[(5, 24)],
    check_model=dict(n_layer=2, n_head=2, n_embd=24, block_size=4, vocab_size=65), check_batch=1,  # 2: dwa's dilation 2
    sinkhorn_repeat=3,  # the interpreter runs each iteration in Python
    bandwidth=(64, 32), copy_bytes=2 ** 20,
    steps=dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=65), batch=2,
)
CHECK_TOL = {torch.float32: 2e-4, torch.bfloat16: 3e-2}  # per element, by the storage dtype of the tensor compared:
# |x - ref| <= tol * (scale + |ref|), scale the RMS of ref's row (or of the whole tensor for vectors and per-row
# scalars), ref in fp64 on the same rounded inputs; tests/test_kernels.py's bounds (fp32: sums of up to 4096 terms
# that cancel; bf16: 4 units in the last place of 8 significant bits). A dropped term or eps is off by far more.
MODEL_TOL = 1e-3  # a compiled fp32 step (kernels=triton) against eager kernels=torch: the same sums, in another order
FIRST_COMPILE_S = 60  # a guess at inductor's compile of the 124M model (forward and backward), until one is timed
STEP_TARGETS = {"nag": 1.02, "block_attnres": 1.03, "attnres": 1.10, "mhc": 1.10}  # step time / prenorm's, at most
COMPILE_FIRST = ("prenorm", "nag", "block_attnres", "attnres", "mhc")  # the modes with targets compile first
TARGETS = dict(bandwidth=0.85, mfu=0.50, mod=0.80)  # of the copy bandwidth; prenorm compiled; mod_rate 0.25 / dense
GPU_COLUMNS = {  # part: (key, header, format) of its table
    "correctness": [("check", "check", "{}"), ("dtype", "dtype", "{}"), ("shape", "shape", "{}"),
                    ("result", "result", "{}"), ("error", "worst error", "{:.2e}"), ("tol", "tolerance", "{:.0e}"),
                    ("where", "where", "{}")],
    "bandwidth": [("kernel", "kernel", "{}"), ("shape", "shape", "{}"), ("fwd_us", "fwd us", "{:.1f}"),
                  ("fwd_gbs", "fwd GB/s", "{:.4g}"), ("fwd_bwd_us", "fwd+bwd us", "{:.1f}"),
                  ("fwd_bwd_gbs", "fwd+bwd GB/s", "{:.4g}"), ("of_copy", "of copy (fwd, fwd+bwd)", "{}"),
                  ("target", "target", "{}")],
    "modes": [("residual", "residual", "{}"), ("variant", "variant", "{}"), ("ms", "ms/iter", "{:.2f}"),
              ("vs_prenorm", "vs prenorm", "{:.3f}x"), ("tokens_s", "tokens/s", "{:,.0f}"), ("mfu", "MFU", "{:.1%}"),
              ("memory_gib", "peak memory GiB", "{:.2f}"), ("memory_vs_prenorm", "vs prenorm", "{:.2f}x"),
              ("target", "target", "{}")],
    "mod": [("residual", "residual", "{}"), ("mod", "mod", "{}"), ("mod_rate", "mod_rate", "{:g}"),
            ("ms", "ms/iter", "{:.2f}"), ("vs_dense", "vs dense", "{:.3f}x"), ("tokens_s", "tokens/s", "{:,.0f}"),
            ("memory_gib", "peak memory GiB", "{:.2f}"), ("target", "target", "{}")],
}


GPU_GUESS_S = dict(  # rough seconds per item on one H100-class GPU, for the plan printed beside each part's time
    kernel_check=1.0,  # Triton compiles a kernel's forward and backward once per dtype and width (~1 s), then ms
    model_check=15.0,  # inductor compiles a 2-layer model's forward and backward (16 cores), then one step
    kernel_timing=2.0,  # a bf16 launch shape per kernel, reps x (forward, forward + backward)
    eager_step=3.0,  # build a 124M model, warm-up, its share of the interleaved rounds
    compiled_step=FIRST_COMPILE_S,
)


def gpu_plan(parts, compiled):
    """Rough seconds each part takes on a GPU: its items (GPU_SHAPES, the modes) times GPU_GUESS_S. The dry
    run's seconds do not scale to a GPU's (Triton's interpreter dominates them; compiles and JIT dominate a
    GPU's), so the plan counts what each part does instead; the JSON keeps each check's measured seconds."""
    g, n_modes, n_mod = GPU_GUESS_S, len(RESIDUALS) + len(VARIANTS), len(MOD_RUNS) * 3
    plan = dict(correctness=6 * 2 * len(GPU_SHAPES["checks"]) * g["kernel_check"] + n_modes * g["model_check"],
                bandwidth=6 * g["kernel_timing"], modes=n_modes * g["eager_step"] + len(compiled) * g["compiled_step"],
                mod=n_mod * g["eager_step"])
    return {p: plan[p] for p in parts}


def atomic_write(path, text):
    """Write text to path through a temp file and os.replace: a reader (or a killed run) sees the old file or the
    new one, never a part of one."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def table_cell(value, fmt):
    return "n/a" if value is None else fmt.format(value)


class GPURun:
    """The gpu section's record and clock. Rows by part, each part's seconds, what did not run: every change
    rewrites the Markdown file and the JSON beside it, so a run killed at any point leaves both valid, with
    what it had measured. The cap: a part starts only while the run is inside --max_minutes (the first part
    always starts), and an item of a part (a check, a kernel, a model) only while the run is inside the
    shares of GPU_PARTS up to this part, so one slow part does not eat the next ones' time (a part's first
    item always runs). What did not run is listed as skipped."""

    def __init__(self, path, meta, parts, max_minutes):
        self.md_path, self.json_path = path, os.path.splitext(path)[0] + ".json"
        self.t0, self.cap = time.perf_counter(), 60 * max_minutes
        total, so_far, self.ends = sum(GPU_PARTS[p] for p in parts), 0.0, {}
        for p in parts:
            so_far += GPU_PARTS[p]
            self.ends[p] = self.cap * so_far / total
        self.data = dict(meta=meta, status="running", pending=list(parts), skipped=[], parts={})
        self.part, self.first = None, True
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.write()

    def elapsed(self):
        return time.perf_counter() - self.t0

    def run_part(self, part, fn, *args):
        """fn(self, *args) as the part `part`, unless the cap has been reached; an exception that escapes
        it is printed in one line and recorded, and the next part runs."""
        self.data["pending"].remove(part)
        if self.data["parts"] and self.elapsed() >= self.cap:
            self.data["skipped"].append(f"{part} (the {self.cap / 60:g}-minute cap was reached)")
            print(f"\n## {part}: skipped, the {self.cap / 60:g}-minute cap was reached", flush=True)
            return self.write()
        self.part, self.first, self.item_start, t = part, True, None, time.perf_counter()
        self.data["parts"][part] = dict(seconds=None, rows=[])
        print(f"\n## {part}")
        print("| " + " | ".join(h for _, h, _ in GPU_COLUMNS[part]) + " |")
        print("|" + "---|" * len(GPU_COLUMNS[part]), flush=True)
        try:
            fn(self, *args)
        except Exception as e:  # a bug in the part itself: the parts after it still run
            self.data["parts"][part]["error"] = one_line(e)
            print(f"{part} stopped: {one_line(e)}", flush=True)
        self.data["parts"][part]["seconds"] = time.perf_counter() - t
        self.write()

    def more(self, item, reserve=0.0):
        """Whether to run the next item of this part: its first, or one that would end within this part's
        end if it took as long as the item before it, plus `reserve` seconds; else it is recorded as skipped."""
        now = self.elapsed()
        last = now - self.item_start if self.item_start is not None else 0.0
        if self.first or now + last + reserve < self.ends[self.part]:
            self.first, self.item_start = False, now
            return True
        self.data["skipped"].append(f"{self.part}: {item} (the part's time ran out)")
        self.write()
        return False

    def add(self, row):
        """One row of this part's table: printed, and written to both files."""
        self.data["parts"][self.part]["rows"].append(row)
        print("| " + " | ".join(table_cell(row.get(k), f) for k, _, f in GPU_COLUMNS[self.part]) + " |", flush=True)
        self.write()

    def finish(self):
        self.data["status"] = "finished"
        self.data["seconds"] = self.elapsed()
        self.write()
        print(f"\n{len(self.data['skipped'])} skipped; figures in {self.md_path} and {self.json_path}")
        print("| part | seconds here | GPU plan s (rough, gpu_plan) | its share of the cap s |\n|---|---|---|---|")
        starts = [0.0, *self.ends.values()]
        for (part, end), start in zip(self.ends.items(), starts):
            took = self.data["parts"].get(part, {}).get("seconds")
            took = "skipped" if took is None else f"{took:.1f}"
            print(f"| {part} | {took} | {self.data['meta']['plan_s'][part]:.0f} | {end - start:.0f} |")

    def write(self):
        atomic_write(self.json_path, json.dumps(self.data, indent=1, allow_nan=False) + "\n")
        atomic_write(self.md_path, self.markdown())

    def markdown(self):
        m, d = self.data["meta"], self.data
        lines = ["# GPU figures", "",
                 f"`{m['command']}` on {m['device']}: torch {m['torch']}, triton {m['triton']}, CUDA {m['cuda']}, "
                 f"Python {m['python']}; commit {m['commit']}; started {m['started']} (cap {m['max_minutes']:g} min).",
                 ""]
        if m["dry_run"]:
            lines += ["**Dry run**: tiny shapes, the kernels checked in Triton's interpreter on a CPU: these figures "
                      "test the command, not a GPU.", ""]
        status = (f"finished in {d['seconds'] / 60:.1f} min" if d["status"] == "finished" else
                  "running, or cut short while running" + (f" (not started: {', '.join(d['pending'])})"
                                                           if d["pending"] else ""))
        skipped = f"Skipped ({len(d['skipped'])}):" if d["skipped"] else "Skipped: nothing."
        lines += [f"Status: {status}. {skipped}", ""]
        lines += [f"- {s}" for s in d["skipped"]] + ([""] if d["skipped"] else [])
        for part, p in d["parts"].items():
            cols = GPU_COLUMNS[part]
            took = "running, or cut short" if p["seconds"] is None else f"{p['seconds']:.0f} s"
            lines += [f"## {part} ({took}; a GPU's rough plan: {m['plan_s'][part]:.0f} s)", "",
                      "| " + " | ".join(h for _, h, _ in cols) + " |", "|" + "---|" * len(cols)]
            lines += ["| " + " | ".join(table_cell(r.get(k), f) for k, _, f in cols) + " |" for r in p["rows"]]
            if "error" in p:
                lines.append(f"\nThe part stopped: {p['error']}")
            lines.append("")
        return "\n".join(lines)


def one_line(e):
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"


def finite(x):
    """x, or None when it is not a finite number (JSON has no nan)."""
    return x if x is not None and math.isfinite(x) else None


def relative_error(x, ref, per_row=True):
    """Worst |x - ref| / (scale + |ref|) over the elements, in fp64; scale is the RMS of each row of
    ref ([..., d] tensors, per_row) or of the whole tensor. inf when x has a non-finite value or a wrong shape."""
    if x is None or x.shape != ref.shape:
        return math.inf
    ref = ref.detach().double()
    err = (x.detach().double() - ref).abs()
    rowwise = per_row and ref.dim() >= 2 and ref.shape[-1] > 1
    scale = ref.square().mean(-1, keepdim=True).sqrt() if rowwise else ref.square().mean().sqrt()
    rel = (err / (scale + ref.abs()).clamp_min(1e-30)).nan_to_num(nan=math.inf)
    return rel.max().item() if rel.numel() else 0.0


def worst_of(pairs):
    """The result of a check from (where, value, reference, tolerance) tuples: the pair furthest over its
    tolerance (relative to it) decides."""
    where, err, tol = max(((w, relative_error(x, ref, per_row), tol) for w, x, ref, tol, per_row in pairs),
                          key=lambda p: p[1] / p[2])
    return dict(result="ok" if err <= tol else "FAIL", error=finite(err), tol=tol, where=where)


def as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def check_kernel(inputs, ref, fused, seed=0):
    """The fused kernel's outputs and every input's gradient against the reference in fp64, on the same
    (rounded) inputs and the same output gradients, each at the tolerance of its own storage dtype."""
    def leaves(xs, dtype=None):
        return [[leaves([t], dtype)[0] for t in x] if isinstance(x, list) else
                x.detach().to(dtype or x.dtype).requires_grad_() for x in xs]
    a, b = leaves(inputs), leaves(inputs, torch.float64)
    out_a, out_b = as_tuple(fused(*a)), as_tuple(ref(*b))
    g = torch.Generator().manual_seed(seed)
    grads = [torch.randn(o.shape, generator=g).to(o.device, o.dtype) for o in out_a]
    torch.autograd.backward(out_a, grads)
    torch.autograd.backward(out_b, [x.double() for x in grads])
    flat_a = [t for x in a for t in (x if isinstance(x, list) else [x])]
    flat_b = [t for x in b for t in (x if isinstance(x, list) else [x])]
    return worst_of([(f"output {i}", x, y, CHECK_TOL[x.dtype], True) for i, (x, y) in enumerate(zip(out_a, out_b))] +
                    [(f"grad of input {i}", x.grad, y.grad, CHECK_TOL[x.dtype], True)
                     for i, (x, y) in enumerate(zip(flat_a, flat_b))])


def check_model(kw, device, backend, B=2, seed=0):
    """The loss and every parameter's gradient of one compiled (fullgraph) training forward and backward with
    kernels=triton against eager kernels=torch: the same weights, moved off init so that every gate and
    mix matters, and the same batch, in fp32."""
    results = []
    for impl in ("triton", "torch"):
        torch.manual_seed(seed)
        model = GPT(GPTConfig(kernels=impl, **kw)).to(device)
        model.stream.perturb(0.2, torch.Generator().manual_seed(seed))
        run = torch.compile(model, backend=backend, fullgraph=True) if impl == "triton" else model
        idx = torch.randint(0, kw["vocab_size"], (B, kw["block_size"]), generator=torch.Generator().manual_seed(1))
        idx = idx.to(device)
        torch._dynamo.reset()
        _, loss = run(idx, idx)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    torch._dynamo.reset()
    (loss, grads), (loss_ref, grads_ref) = results
    return worst_of([("loss", loss, loss_ref, MODEL_TOL, False)] +
                    [(f"grad of {n}", grads[n], g, MODEL_TOL, False) for n, g in grads_ref.items() if g is not None])


def kernels_on(device):
    """The Triton kernels for tensors on `device`: on a GPU the custom ops launch them; on a CPU (the dry
    run) kernels.triton_on_cpu() sends CPU tensors to the launchers too, run in Triton's interpreter."""
    return contextlib.nullcontext() if device.type == "cuda" else kernels.triton_on_cpu()


def dtype_name(dtype):
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]


def check_row(run, row, fn):
    """Run one check: its row with the result, or FAIL and the exception's first line, and the part goes on.
    The JSON keeps each check's seconds too (the first of a kernel and dtype includes Triton's compile)."""
    t = time.perf_counter()
    try:
        row.update(fn())
    except Exception as e:
        row.update(result="FAIL", error=None, tol=None, where=one_line(e))
    run.add(dict(row, seconds=time.perf_counter() - t))


def gpu_correctness(run, device, shapes, backend):
    """Part 1: every kernel of kernels.py forward and backward against its reference at each shape, fp32 and
    bf16; then one compiled training step per residual mode (and option variant) against kernels=torch."""
    with kernels_on(device):
        for rows, d in shapes["checks"]:
            for dtype in (torch.float32, torch.bfloat16):
                for name, inputs, ref, fused, *_ in kernel_cases(device, dtype, (rows, d), shapes["sinkhorn_repeat"]):
                    if run.more(f"{name} {dtype_name(dtype)} {rows}x{d}"):
                        check_row(run, dict(check=name, dtype=dtype_name(dtype), shape=f"{rows}x{d}"),
                                  functools.partial(check_kernel, inputs, ref, fused))
        shape = shapes["check_model"]
        for name, kw in {**{r: dict(residual=r) for r in RESIDUALS}, **VARIANTS}.items():
            if kw["residual"] == "mhc" and kw.get("mhc_res", "sinkhorn") == "sinkhorn" and shapes["sinkhorn_repeat"]:
                kw = dict(kw, mhc_sinkhorn_repeat=shapes["sinkhorn_repeat"])
            if run.more(f"compiled step {name}"):
                check_row(run, dict(check=f"compiled step: {name}", dtype="fp32",
                                    shape=f"L={shape['n_layer']} d={shape['n_embd']} T={shape['block_size']}"),
                          functools.partial(check_model, {**shape, **kw}, device, backend, shapes["check_batch"]))


def gpu_bandwidth(run, device, shapes, reps):
    """Part 2: each fused kernel's achieved GB/s (bf16, the minimum bytes it must move, kernel_cases) against
    this device's copy bandwidth."""
    copy = copy_bandwidth(device, reps, shapes["copy_bytes"])
    run.add(dict(kernel="copy (clone)", shape=f"{shapes['copy_bytes'] >> 20} MiB", fwd_bwd_gbs=copy / 1e9))
    rows, d = shapes["bandwidth"]
    for name, inputs, _, fused, bytes_fwd, bytes_bwd in kernel_cases(device, torch.bfloat16, shapes["bandwidth"]):
        if not run.more(name):
            continue
        row = dict(kernel=name, shape=f"{rows}x{d}")
        try:
            t_f, t_fb = kernel_times(name, "triton", fused, inputs, device, reps)
        except Exception as e:
            run.add(dict(row, target=f"failed: {one_line(e)}"))
            continue
        of_copy = (bytes_fwd / t_f / copy, (bytes_fwd + bytes_bwd) / t_fb / copy)
        run.add(dict(row, fwd_us=t_f * 1e6, fwd_gbs=bytes_fwd / t_f / 1e9, fwd_bwd_us=t_fb * 1e6,
                     fwd_bwd_gbs=(bytes_fwd + bytes_bwd) / t_fb / 1e9, of_copy=f"{of_copy[0]:.0%}, {of_copy[1]:.0%}",
                     target=f">= {TARGETS['bandwidth']:.0%}: {met(min(of_copy), TARGETS['bandwidth'], at_most=False)}"))


def met(value, bound, at_most=True):
    if value is None:
        return "n/a"
    return "met" if (value <= bound if at_most else value >= bound) else "not met"


def gpu_modes(run, device, shapes, reps, backend, compiled, optimizer="adamw"):
    """Part 3: one training step (bf16 autocast, AdamW or, with --optimizer=muon, Muon + AdamW) of every residual mode and option variant at the
    124M shape, eager with the fused kernels, interleaved in one run: ms/iter, tokens/s, MFU and peak memory,
    as ratios to prenorm. Then the same compiled, for the modes of `compiled` in order, as many as the
    part's time allows (a compile is the costly part: it is what the cap is checked before)."""
    shape, B = shapes["steps"], shapes["batch"]
    modes = {**{r: dict(residual=r) for r in RESIDUALS}, **VARIANTS}
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    eager = {}
    for variant, names in (("eager", list(modes)), ("compiled", compiled)):
        configs = {name: (GPTConfig(kernels="triton", **shape, **modes[name]), variant == "compiled") for name in names}
        built = []

        def until(name, variant=variant, built=built):  # time left for this build and the timed rounds after it
            built.append(name)
            reserve = reps * sum(eager.get(n, 0.0) for n in built)  # the rounds (a compiled step takes less)
            if variant == "compiled" and len(built) == 1 and device.type == "cuda":
                reserve += FIRST_COMPILE_S  # the item before was an eager build: no measure of a compile
            return run.more(f"{variant} {name}", reserve)

        def failed(name, e, variant=variant):
            run.add(dict(residual=name, variant=variant, target=f"failed: {one_line(e)}"))
        times, mem = time_steps(configs, device, torch.bfloat16, False, reps, B, backend, until, failed, optimizer)
        if variant == "eager":
            eager = times
        for name, t in times.items():
            base, config = times.get("prenorm"), configs[name][0]
            tokens_s = B * shape["block_size"] / t
            mfu = flops.mfu(flops.train_flops_per_token(config), tokens_s, device_name)
            ratio = t / base if base else None
            target = (f"<= {STEP_TARGETS[name]:.2f}x: {met(ratio, STEP_TARGETS[name])}" if name in STEP_TARGETS else
                      f"MFU >= {TARGETS['mfu']:.0%}: {met(mfu, TARGETS['mfu'], at_most=False)}"
                      if (name, variant) == ("prenorm", "compiled") else "")
            mem_ratio = mem[name] / mem["prenorm"] if mem.get(name) and mem.get("prenorm") else None
            run.add(dict(residual=name, variant=variant, ms=t * 1e3, vs_prenorm=ratio, tokens_s=tokens_s, mfu=mfu,
                         memory_gib=mem[name], memory_vs_prenorm=mem_ratio, target=target))
        del times, mem
        if device.type == "cuda":
            torch.cuda.empty_cache()


def gpu_mod(run, device, shapes, reps):
    """Part 4: Mixture-of-Depths, eager with the fused kernels: the step time of nag (mod=nag) and prenorm
    (mod=router) at mod_rate 0.25 and 0.5 against the same model dense (mod_rate 0), interleaved."""
    shape, B = shapes["steps"], shapes["batch"]
    configs = mod_configs(shape, (0.0, 0.25, 0.5), kernels="triton")
    times, mem = time_steps(configs, device, torch.bfloat16, False, reps, B,
                            until=lambda name: run.more(f"{name[0]} mod={name[1]} mod_rate={name[2]:g}"),
                            on_error=lambda name, e: run.add(dict(residual=name[0], mod=name[1], mod_rate=name[2],
                                                                  target=f"failed: {one_line(e)}")))
    for (r, m, rate), t in times.items():
        dense = times.get((r, m, 0.0))
        ratio = t / dense if dense else None
        run.add(dict(residual=r, mod=m, mod_rate=rate, ms=t * 1e3, vs_dense=ratio,
                     tokens_s=B * shape["block_size"] / t, memory_gib=mem[(r, m, rate)],
                     target=f"<= {TARGETS['mod']:.2f}x: {met(ratio, TARGETS['mod'])}" if rate == 0.25 else ""))


def git_commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def bench_gpu(cfg, argv):
    """--section=gpu: the four parts in order, each row written to --results (Markdown) and the JSON beside
    it as it is measured; returns the GPURun's data."""
    dry = cfg["dry_run"]
    device = pick_device(cfg["device"], "float32")[0]
    if device.type != "cuda" and not dry:
        raise ConfigError("--section=gpu needs a CUDA GPU; on a CPU run its dry run: --section=gpu --dry_run=True")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":  # --device=cpu beside a GPU
        raise ConfigError("a dry run on the CPU checks the kernels in Triton's interpreter: prefix the command "
                          "with TRITON_INTERPRET=1")
    parts = list(GPU_PARTS) if cfg["parts"] == "all" else cfg["parts"].split(",")
    if not parts or not set(parts) <= set(GPU_PARTS):
        raise ConfigError(f"--parts={cfg['parts']}: give all or a comma list of {', '.join(GPU_PARTS)}")
    compiled = ([r for r in COMPILE_FIRST if r in RESIDUALS] + [r for r in RESIDUALS if r not in COMPILE_FIRST]
                if cfg["compiled"] == "all" else [r for r in cfg["compiled"].split(",") if r])
    if not set(compiled) <= set(RESIDUALS):
        raise ConfigError(f"--compiled={cfg['compiled']}: give all or a comma list of {', '.join(RESIDUALS)}")
    shapes = dict(DRY_SHAPES if dry else GPU_SHAPES)
    shapes["batch"] = cfg["batch_size"] or shapes["batch"]
    backend = cfg["backend"] if device.type == "cuda" else "aot_eager"  # inductor on a CPU: minutes per model
    reps = cfg["reps"] or (2 if dry else 30)
    path = cfg["results"] or os.path.join(REPO, *(("out", "gpu-dry-run") if dry else ("docs",)), "results.md")
    meta = dict(device=device_label(device), torch=torch.__version__,
                triton=getattr(kernels.triton, "__version__", None), cuda=torch.version.cuda,
                python=sys.version.split()[0], command=" ".join(["python bench.py", *argv]), commit=git_commit(),
                started=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), dry_run=dry,
                max_minutes=cfg["max_minutes"], backend=backend, reps=reps, plan_s=gpu_plan(parts, compiled),
                optimizer=cfg["optimizer"])
    print(f"gpu section: {', '.join(parts)} within {cfg['max_minutes']:g} minutes, to {path}")
    run = GPURun(path, meta, parts, cfg["max_minutes"])
    jobs = dict(correctness=(gpu_correctness, device, shapes, backend), bandwidth=(gpu_bandwidth, device, shapes, reps),
                modes=(gpu_modes, device, shapes, reps, backend, compiled, cfg["optimizer"]),
                mod=(gpu_mod, device, shapes, reps))
    for part in parts:
        run.run_part(part, *jobs[part])
    run.finish()
    return run.data


def main(argv=None):
    """Print the tables; returns seconds per step by residual mode (model section) and by
    (residual, mod, mod_rate) (mod section), for the sections that ran."""
    cfg = configure(sys.argv[1:] if argv is None else argv, DEFAULTS, [(__file__, "DEFAULTS")])
    if cfg["section"] not in SECTIONS:
        raise ConfigError(f"unknown section '{cfg['section']}'; valid: {', '.join(SECTIONS)}")
    if cfg["dry_run"] and cfg["section"] != "gpu":
        raise ConfigError("--dry_run=True is the gpu section's: add --section=gpu")
    for key, least in COUNTS.items():  # before anything is built: a count below its least ends in a traceback
        if isinstance(cfg[key], bool) or not isinstance(cfg[key], int) or cfg[key] < least:
            raise ConfigError(f"--{key}={cfg[key]}: give a whole number >= {least}" + (" (0: the section's own" if
                              least == 0 else " (") + f"; default {DEFAULTS[key]})")
    if isinstance(cfg["max_minutes"], bool) or not isinstance(cfg["max_minutes"], (int, float)) \
            or not cfg["max_minutes"] > 0:
        raise ConfigError(f"--max_minutes={cfg['max_minutes']}: give a positive number of minutes")
    if cfg["optimizer"] not in ("adamw", "muon"):
        raise ConfigError(f"--optimizer={cfg['optimizer']}: give adamw or muon (the model and gpu sections' step)")
    UNSTEADY.clear()  # this run's measurements only
    if cfg["section"] == "gpu":  # not in "all": it writes docs/results.md
        data = bench_gpu(cfg, sys.argv[1:] if argv is None else argv)
        warning = load_warning()
        if warning:
            print(warning, flush=True)
        return data
    device, dtype, _ = pick_device(cfg["device"], cfg["dtype"])  # the rule of train.py's on a GPU; fp32 on a CPU
    dtype = getattr(torch, dtype)
    run_config.keep_freed_memory(device)  # a CPU's steps timed with the allocator train.py runs them with
    reps = cfg["reps"] or (50 if device.type == "cuda" else 20)
    print(f"torch {torch.__version__}, triton {getattr(kernels.triton, '__version__', 'not installed')}, "
          f"{device_label(device)}")
    if cfg["section"] in ("all", "kernels"):
        bench_kernels(device, dtype, cfg["compile"], reps)
    use_compile = cfg["compile"] and device.type == "cuda"
    times = {}
    if cfg["section"] in ("all", "model"):
        times.update(bench_model(device, dtype, use_compile, reps, cfg["batch_size"], cfg["layers"], cfg["optimizer"]))
    if cfg["section"] in ("all", "mod"):
        times.update(bench_mod(device, dtype, use_compile, reps, cfg["batch_size"]))
    if cfg["section"] == "compile":  # not in "all": it compiles 10 models
        times.update(bench_compile(device, dtype, reps, cfg["batch_size"], cfg["backend"])[0])
    if cfg["section"] == "quickstart":  # not in "all": whole training runs
        times.update(bench_quickstart(cfg["pairs"], cfg["max_iters"], nanogpt=cfg["nanogpt"]))
    if cfg["section"] == "steps":  # not in "all": a sweep config's cells
        times.update(bench_steps(cfg["sweep"], cfg["rounds"], cfg["steps_out"] or os.path.join(REPO, "out", "step_times.csv"),
                                 device, dtype))
    if cfg["section"] == "sample":  # not in "all"
        times.update(bench_sample(device, dtype, cfg["out_dir"], cfg["tokens"], cfg["pairs"], cfg["layers"],
                                   cfg["width"]))
    warning = load_warning()
    if warning:
        print(warning, flush=True)
    return times


if __name__ == "__main__":
    try:
        if sys.argv[1:2] == ["baseline"]:
            baseline_train(sys.argv[2:])
        else:
            main()
    except ConfigError as e:
        raise SystemExit(f"error: {e}")
