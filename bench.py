"""
Benchmarks that print figures (speed targets are checked here, not in timed tests).

    python bench.py                      # both sections, on the GPU if there is one
    python bench.py --section=kernels    # each fused kernel vs eager PyTorch and torch.compile of its reference
    python bench.py --section=model      # step time and peak memory of each residual mode, relative to prenorm
    python bench.py --section=mod        # Mixture-of-Depths step time at mod_rate 0, 0.25, 0.5
    python bench.py --section=compile    # eager vs compiled reference vs compiled custom ops, per mode
    python bench.py --section=quickstart # the quickstart command against a nanoGPT-like baseline run
    python bench.py --section=sample     # sampling with a KV cache: one mod=nag model, dense vs routed

kernels: forward and forward+backward time of each of the six kernels (rms_norm, nag_update,
depth_attention, and hc/mhc's mhc_pre_mix, sinkhorn and hc_post_mix, at n = 4 streams), and the
achieved bandwidth: the bytes a fused kernel must move at least (each input read once, each output
written once) divided by the time. On a GPU compare it with the copy bandwidth printed first.
Every figure is a median over --reps repeats; when the repeats of a measurement spread by more than
half their median, or a forward takes 1.5x its forward+backward, a last line warns that the
machine is loaded and the figures are unreliable.
model: one training step (forward, backward, AdamW) per mode at the GPT-2 124M shape on a GPU
(12 layers, 768 wide, 12 heads, T = 1024, bf16, compiled), or at the quickstart shape on a CPU.
mod: a training step of nag (mod=nag) and prenorm (mod=router) at mod_rate 0, 0.25 and 0.5, at the
124M shape on a GPU or an 8-layer quickstart-width model on a CPU; the ratio to mod_rate 0 is the saving.
compile (not part of "all": it compiles 10 models): each residual mode eager, compiled with the
kernels' plain-PyTorch references (kernels=torch, which inductor fuses) and compiled with the kernels
as custom ops (kernels=triton: on a GPU the Triton kernels; on a CPU the ops run their reference);
step time, peak memory (GPU) and the bytes saved for backward, as ratios to prenorm. --backend picks
torch.compile's backend (inductor; aot_eager compiles in seconds, for a quick check).
quickstart (not part of "all": whole training runs): `python train.py config/shakespeare_char_cpu.py`
against `python bench.py baseline config/shakespeare_char_cpu.py` (nanoGPT's model and loop on the
same config; see baseline_train), both cut to --max_iters, as whole processes in --pairs interleaved
pairs: median wall times, their ratio, and each run's final val loss on the same eval batches.
sample (not part of "all"): tokens/s of generate() with the KV cache, one batch-1 sequence, for the
same mod=nag model run dense (thresholds off), with its eval routing, and with every sublayer skipped
(what a token costs that no sublayer can save: embedding, the scores, head, sampling), in --pairs
interleaved pairs; the model of --out_dir's checkpoint, or (no --out_dir) a random nag at mod_rate 0.25,
--layers deep (0: 8) and --width wide (128), whose thresholds a few training-mode forwards on random
tokens set. Prints the time saved against the skipped fraction (target: saved >= 0.8 x skipped) and
the most any routing of that skipped fraction could save, skipped x (1 - skip-all / dense).
model and compile also print the saved-activation bytes (each storage once) relative to prenorm.
Ratios measured in one run are what to compare: absolute times drift on a shared machine.
"""

import functools
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels
from configurator import ConfigError, configure
from model import GPT, GPTConfig, RESIDUALS
import run_config
from run_config import REPO, pick_device

DEFAULTS = dict(
    section="all",  # all (kernels, model, mod) | kernels | model | mod | compile | quickstart | sample
    device="auto",  # auto (the GPU if there is one, else the CPU), cpu, cuda, cuda:1, ...
    dtype="auto",  # auto (bf16 or fp16 on a GPU, fp32 on the CPU), float32, bfloat16, float16
    compile=True,  # kernels: also time torch.compile of the references; model, mod: compile the step (GPU only)
    reps=0,  # timed calls per measurement (0: 50 on a GPU, 20 on a CPU)
    batch_size=0,  # model, mod, compile: sequences per step (0: the section's own)
    pairs=3,  # quickstart, sample: interleaved pairs of runs
    max_iters=600,  # quickstart: iterations per run
    layers=0,  # model: the depth (0: 12 on a GPU, 4 on a CPU); sample: the random model's (0: 8)
    out_dir="",  # sample: a mod=nag checkpoint's out_dir ("": a random model, --layers deep, --width wide)
    tokens=500,  # sample: tokens per sample
    width=128,  # sample: the random model's width
    backend="inductor",  # compile: torch.compile's backend (aot_eager compiles in seconds, for a quick check)
)


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


def kernel_cases(device, dtype):
    """(name, inputs, reference, fused kernel, bytes moved forward, bytes moved backward): the public
    function with impl="torch" (kernels.py's reference) and with impl="triton" (the custom op)."""
    gpu = device.type == "cuda"
    M, d, S = (16 * 1024, 768, 9) if gpu else (2048, 128, 9)  # rows = B * T tokens; S sources
    b = torch.empty((), dtype=dtype).element_size()

    def make(*shapes):
        return [torch.randn(s, device=device, dtype=dtype).requires_grad_() for s in shapes]

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
    return [
        ("rms_norm", make((M, d), (d,)), *impls(kernels.rms_norm), 2 * M * d * b, 3 * M * d * b),
        ("nag_update", [r, u, a], *impls(kernels.nag_update), 3 * M * d * b, 5 * M * d * b),
        # the model's call: a list of sources where they lie; the backward reads them twice
        ("depth_attention", [make(*[(M, d)] * S), *make((d,), (d,))], *impls(kernels.depth_attention),
         (S + 1) * M * d * b, (3 * S + 1) * M * d * b),
        # reads X and its projection, writes u, h_post and the H_res logits; the backward reads X, the
        # projection and the three gradients, and writes X's and the projection's
        ("mhc_pre_mix", mhc_args, *impls(kernels.mhc_pre_mix), M * ((n * d + K + d) * b + (n + n * n) * c),
         M * ((2 * n * d + 2 * K + d) * b + (n + n * n) * c)),
        # the H_res logits (fp32) in, H out; the backward reads the logits and H's gradient, writes theirs
        ("sinkhorn", [fp32(M, n, n)], *impls(functools.partial(kernels.sinkhorn, repeat=GPTConfig().mhc_sinkhorn_repeat)),
         2 * M * n * n * c, 3 * M * n * n * c),
        # reads X, f and the per-token h_post, H_res, writes X'; the backward reads them and dX', writes
        # the gradients of all four
        ("hc_post_mix", post_args, *impls(kernels.hc_post_mix), M * ((2 * n * d + d) * b + (n + n * n) * c),
         M * ((3 * n * d + 2 * d) * b + 2 * (n + n * n) * c)),
    ]


def bench_kernels(device, dtype, use_compile, reps):
    print(f"\n## kernels ({device.type}, {str(dtype).replace('torch.', '')})")
    if device.type == "cuda":
        x = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=device)
        t = timeit(lambda: x.clone(), device, reps)
        print(f"copy bandwidth: {2 * x.numel() / t / 1e9:.0f} GB/s (clone of 256 MiB)")
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
            def fwd():
                with torch.no_grad():
                    fn(*inputs)

            def fwd_bwd():
                out = fn(*inputs)
                out = out if isinstance(out, tuple) else (out,)
                torch.autograd.backward(out[0], torch.ones_like(out[0]))
            try:
                t_f, t_fb = (timeit(fwd, device, reps, what=f"{name} {impl} forward"),
                             timeit(fwd_bwd, device, reps, what=f"{name} {impl} forward+backward"))
            except Exception as e:  # e.g. no C++ compiler for inductor on this CPU
                print(f"| {name} | {impl} | failed: {type(e).__name__}: {str(e).splitlines()[0][:80]} |||||")
                continue
            if t_f > 1.5 * t_fb:  # a forward alone cannot take much longer than forward and backward: load
                UNSTEADY.append((t_f / t_fb - 1, f"{name} {impl}: the forward alone took {t_f / t_fb:.1f}x its "
                                                 f"forward+backward"))
            eager_total = eager_total or t_fb
            print(f"| {name} | {impl} | {t_f * 1e6:.0f} | {bytes_fwd / t_f / 1e9:.1f} | {t_fb * 1e6:.0f} "
                  f"| {(bytes_fwd + bytes_bwd) / t_fb / 1e9:.1f} | {eager_total / t_fb:.2f}x |")


def time_steps(configs, device, dtype, use_compile, reps, B, backend="inductor"):
    """Median seconds of one training step (forward, backward, AdamW) of each GPTConfig in
    `configs` (name -> config, or name -> (config, compile this one?)), and the peak memory (GiB,
    GPU only) of each. All are built (and compiled) first, then timed in interleaved rounds, so
    drift on a shared machine hits each alike."""
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
            base_mem = torch.cuda.memory_allocated() if gpu else 0
            if gpu:
                torch.cuda.reset_peak_memory_stats()
            torch.manual_seed(0)
            model = GPT(config).to(device)
            opt = model.configure_optimizers(0.1, 1e-4, (0.9, 0.95))
            step_model = torch.compile(model, backend=backend) if compiled else model
            x = torch.randint(0, config.vocab_size, (B, config.block_size), device=device)

            def step(step_model=step_model, opt=opt, x=x):
                with autocast:
                    _, loss = step_model(x, x)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            timeit(step, device, 2)  # warm-up: compilation, optimizer state
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


def step_shape(title, device, dtype, use_compile, batch_size, cpu_layers, layers=0):
    """GPTConfig keys and batch size of a timed step: GPT-2 124M on a GPU, quickstart width on a CPU
    (cpu_layers deep); `layers` (--layers), when set, overrides the depth of either."""
    gpu = device.type == "cuda"
    shape = dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50257) if gpu else \
        dict(n_layer=cpu_layers, n_head=4, n_embd=128, block_size=64, vocab_size=65)
    if layers:
        shape["n_layer"] = layers
    B = batch_size or (8 if gpu else 12)
    print(f"\n## {title} ({device.type}, {str(dtype).replace('torch.', '')}, compile={use_compile}, B={B}, {shape})")
    return shape, B


def bench_model(device, dtype, use_compile, reps, batch_size, layers=0):
    gpu = device.type == "cuda"
    shape, B = step_shape("model step", device, dtype, use_compile, batch_size, cpu_layers=4, layers=layers)
    configs = {r: GPTConfig(residual=r, **shape) for r in RESIDUALS}
    times, mem = time_steps(configs, device, dtype, use_compile, reps, B)
    idx = torch.randint(0, shape["vocab_size"], (B, shape["block_size"]), device=device)
    saved = {}
    for residual, config in configs.items():
        torch.manual_seed(0)
        saved[residual] = saved_activation_bytes(GPT(config).to(device), idx, dtype=dtype)
    print("| residual | ms/step | vs prenorm | peak memory GiB | vs prenorm | saved MiB (eager) | vs prenorm |")
    print("|---|---|---|---|---|---|---|")
    for residual, t in times.items():
        mem_cols = f"{mem[residual]:.2f} | {mem[residual] / mem['prenorm']:.2f}x" if gpu else "n/a (CPU) |"
        print(f"| {residual} | {t * 1e3:.1f} | {t / times['prenorm']:.2f}x | {mem_cols} "
              f"| {saved[residual] / 2 ** 20:.1f} | {saved[residual] / saved['prenorm']:.2f}x |")
    return times


MOD_RUNS = [("nag", "nag"), ("prenorm", "router")]  # (residual, mod) timed at each mod_rate


def bench_mod(device, dtype, use_compile, reps, batch_size, rates=(0.0, 0.25, 0.5)):
    """Mixture-of-Depths: step time at each mod_rate relative to the same model at mod_rate 0 (dense).
    Skipped tokens are gathered out of the matmuls, so the ratio is the real saving."""
    gpu = device.type == "cuda"
    shape, B = step_shape("Mixture-of-Depths step", device, dtype, use_compile, batch_size, cpu_layers=8)
    configs = {(r, m, rate): GPTConfig(residual=r, mod=m, mod_rate=rate, **shape)
               for r, m in MOD_RUNS for rate in rates}
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
    device, _, autocast = pick_device(cfg["device"], cfg["dtype"])
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


def bench_quickstart(pairs, max_iters, config=QUICKSTART):
    """Wall time of the whole train.py command (start-up, data checks, training, evals, checkpoints)
    against `bench.py baseline` on the same config, both cut to max_iters (LR schedule included), in
    `pairs` interleaved pairs (who goes first alternates); the median of each, their ratio, and each
    run's final val loss (the same eval batches). Returns {name: (median seconds, [final val losses])}."""
    print(f"\n## quickstart: python train.py {config} --max_iters={max_iters} vs the nanoGPT-like baseline, "
          f"{pairs} interleaved pair(s), {torch.get_num_threads()} threads")
    run_config.find_data(configure([config], run_config.DEFAULTS))  # prepared before any timing
    runs = {"train.py (nanodepth prenorm)": ["train.py"], "baseline (nanoGPT model and loop)": ["bench.py", "baseline"]}
    walls, losses = {name: [] for name in runs}, {name: [] for name in runs}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(pairs):
            for name, script in (list(runs.items()) if i % 2 == 0 else list(runs.items())[::-1]):
                out_dir = os.path.join(tmp, f"{len(walls[name])}-{script[0]}")
                cmd = [sys.executable, *script, config, f"--max_iters={max_iters}", f"--lr_decay_iters={max_iters}",
                       f"--out_dir={out_dir}"]
                t = time.perf_counter()
                done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
                walls[name].append(time.perf_counter() - t)
                if done.returncode != 0:
                    raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
                losses[name].append(float(re.findall(r"val loss ([0-9.]+)", done.stdout)[-1]))
    median = {name: statistics.median(w) for name, w in walls.items()}
    base = median["baseline (nanoGPT model and loop)"]
    print("| command | median wall s | vs baseline | final val loss |")
    print("|---|---|---|---|")
    for name in runs:
        print(f"| {name} | {median[name]:.1f} | {median[name] / base:.2f}x "
              f"| {' '.join(f'{x:.4f}' for x in losses[name])} |")
    return {name: (median[name], losses[name]) for name in runs}


SECTIONS = ("all", "kernels", "model", "mod", "compile", "quickstart", "sample")
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
    cache (it leaves model.generate_stats)."""
    torch.manual_seed(1)
    prompt = torch.zeros((1, 1), dtype=torch.long, device=device)
    t0 = time.perf_counter()
    with torch.autocast(device.type, dtype, enabled=dtype != torch.float32):
        model.generate(prompt, tokens, kv_cache=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


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
            times[name].append(time_generate(model, tokens, device, dtype))
            stats = model.generate_stats
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


def main(argv=None):
    """Print the tables; returns seconds per step by residual mode (model section) and by
    (residual, mod, mod_rate) (mod section), for the sections that ran."""
    cfg = configure(sys.argv[1:] if argv is None else argv, DEFAULTS, [(__file__, "DEFAULTS")])
    if cfg["section"] not in SECTIONS:
        raise ConfigError(f"unknown section '{cfg['section']}'; valid: {', '.join(SECTIONS)}")
    UNSTEADY.clear()  # this run's measurements only
    device, dtype, _ = pick_device(cfg["device"], cfg["dtype"])  # the same rule as train.py's
    dtype = getattr(torch, dtype)
    reps = cfg["reps"] or (50 if device.type == "cuda" else 20)
    print(f"torch {torch.__version__}, triton {getattr(kernels.triton, '__version__', 'not installed')}, "
          f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else f'CPU, {torch.get_num_threads()} threads'}")
    if cfg["section"] in ("all", "kernels"):
        bench_kernels(device, dtype, cfg["compile"], reps)
    use_compile = cfg["compile"] and device.type == "cuda"
    times = {}
    if cfg["section"] in ("all", "model"):
        times.update(bench_model(device, dtype, use_compile, reps, cfg["batch_size"], cfg["layers"]))
    if cfg["section"] in ("all", "mod"):
        times.update(bench_mod(device, dtype, use_compile, reps, cfg["batch_size"]))
    if cfg["section"] == "compile":  # not in "all": it compiles 10 models
        times.update(bench_compile(device, dtype, reps, cfg["batch_size"], cfg["backend"])[0])
    if cfg["section"] == "quickstart":  # not in "all": whole training runs
        times.update(bench_quickstart(cfg["pairs"], cfg["max_iters"]))
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
