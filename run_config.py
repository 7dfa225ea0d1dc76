"""
What the scripts share about a run: train.py's keys and their defaults, the device and precision,
the data, checkpoints and logs. train.py, sample.py, tradeoff.py, flops.py, bench.py and plot.py
import this module (and model, kernels, configurator); no script imports another.
"""

import contextlib
import ctypes
import glob
import json
import math
import os
import pickle
import sys
import time
import zipfile
from collections import namedtuple
from dataclasses import fields

import numpy as np
import torch
import torch.distributed as dist

from configurator import ConfigError
from model import GPT, MODS, RESIDUALS, GPTConfig

REPO = os.path.dirname(os.path.abspath(__file__))
EVAL_SEED = 12345  # evals use the same batches every time, in every run: losses are comparable

# -----------------------------------------------------------------------------
# every key a train.py config file or --key=value may set; model keys come from GPTConfig

DEFAULTS = dict(
    # I/O
    out_dir="out",  # checkpoint (ckpt.pt) and log (log.jsonl) go here
    eval_interval=250,  # iterations between evals (each logs to log.jsonl and may save a checkpoint)
    log_interval=10,  # iterations between the printed step lines
    eval_iters=200,  # batches per split the eval losses average over
    eval_only=False,  # True, with init_from='resume': one eval of out_dir's checkpoint, logged; ckpt.pt stays as it was
    # final_eval_tokens: the same tokens for every run of a dataset and block_size; flops.py's val_loss
    final_eval_tokens=2 ** 18,  # the run's end: one eval on the val split's first this-many tokens (all of a shorter split; final_eval.json); 0: none
    always_save_checkpoint=True,  # False: save only when the val loss improves
    init_from="scratch",  # 'scratch' or 'resume'
    diagnose=False,  # log model.py's diagnose() of a fixed val batch with every eval (plot with plot.py)
    # wandb logging (nanoGPT's keys): each eval's log.jsonl numbers go to Weights & Biases too; needs pip install wandb
    wandb_log=False,  # True: each eval's numbers go to Weights & Biases too
    wandb_project="nanodepth",  # the W&B project of wandb_log
    wandb_run_name="",  # empty: the name of out_dir
    # data
    dataset="openwebtext",  # data_dir/dataset/ holds train.bin, val.bin (and meta.pkl)
    data_dir=os.path.join(REPO, "data"),  # where the datasets are
    gradient_accumulation_steps=40,  # global: divided among DDP ranks
    batch_size=12,  # per micro-step and rank
    # AdamW
    learning_rate=6e-4,  # the peak LR, after warm-up
    max_iters=600000,  # training iterations (optimizer steps)
    max_flops=None,  # a training FLOP budget (flops.py's count); when set it decides max_iters
    max_seconds=None,  # a training time budget (evals and the first step not counted); overrides max_iters
    weight_decay=1e-1,  # AdamW's, on the matrices (not on norms, gains and biases)
    beta1=0.9,  # AdamW's first-moment decay
    beta2=0.95,  # AdamW's second-moment decay
    # the optimizer: 'adamw' trains everything; 'muon' trains the hidden matrices with Muon (torch.optim.Muon)
    # and the rest with AdamW (modded-nanogpt's and nanochat's split; docs/training.md, "Muon")
    optimizer="adamw",  # 'adamw' or 'muon'
    muon_lr=0.02,  # Muon's peak LR, scheduled as learning_rate is (nanochat's matrix_lr 0.02)
    muon_momentum=0.95,  # Muon's Nesterov momentum (nanochat, modded-nanogpt: 0.95)
    muon_weight_decay=0.0,  # Muon's decoupled weight decay, times its LR (nanochat's Muon: none)
    muon_adjust_lr="original",  # 'original': LR x sqrt(max(1, rows/cols)) (Keller Jordan's, nanochat's); 'match_rms_adamw': Moonshot's 0.2 sqrt(max(rows, cols))
    # residual=nag only: nag-nanochat's training recipe (README, "Fidelity"). nag_gate_lr_scale: the reference's
    # gate LR 1e-3 is 0.05 x its Muon matrix LR (0.02), about 1x our AdamW LR (6e-4 .. 1e-3): so 1 here
    nag_gate_lr_scale=1.0,  # LR of alpha and the modulators = this x the scheduled LR (1: the reference's)
    nag_gate_decay=False,  # True: weight decay on the modulator matrices too (the reference has none; an ablation)
    nag_alpha_warmup_tokens=0,  # alpha x min(1, tokens trained / this), 0 at iteration 0; reference: 600 * 2**19 (0: off)
    grad_clip=1.0,  # 0 disables
    max_bad_steps=10,  # stop after this many consecutive steps with non-finite gradients (0 or 1: the first)
    # cosine LR schedule with linear warmup
    decay_lr=True,  # False: the LR stays at learning_rate after warm-up
    warmup_iters=2000,  # iterations of linear warm-up from 0
    lr_decay_iters=None,  # None: max_iters
    min_lr=None,  # None: learning_rate / 10
    # system
    device="auto",  # 'auto', 'cpu', 'cuda', 'cuda:1', ...: see pick_device
    dtype="auto",  # 'auto', 'float32', 'bfloat16' or 'float16': see pick_device
    compile=False,  # torch.compile the model (the Triton kernels stay visible as custom ops)
    threads=0,  # CPU: intra-op threads (0: OMP_NUM_THREADS if set, else the cores no other work keeps busy at the start)
    seed=1337,  # init and batches; DDP ranks add their rank
)
# where DEFAULTS are written: configurator's --help prints the comment on each key's line
def mode_comments():
    """--help's lines for the mode switches, from the registries (a new mode is listed by its registry line)."""
    return {"residual": "the residual mode: " + " | ".join(RESIDUALS),
            "mod": "Mixture-of-Depths: " + " | ".join(MODS)}


HELP_FROM = [(os.path.abspath(__file__), "DEFAULTS"), (os.path.join(REPO, "model.py"), "GPTConfig"),
             (os.path.join(REPO, "model.py"), "options"), mode_comments]  # each mode's options; the modes
# every GPTConfig field but vocab_size (it comes from the data), e.g. residual, mod, mod_rate, skip_target
MODEL_KEYS = [f.name for f in fields(GPTConfig) if f.name != "vocab_size"]
DEFAULTS.update({f.name: f.default for f in fields(GPTConfig) if f.name != "vocab_size"})
RUN_KEYS = ("dropout", "kernels")  # GPTConfig keys that are run settings, not architecture: resume takes them


def model_config(cfg, vocab_size):
    """The GPTConfig of a run's configuration; a bad combination is a one-line ConfigError."""
    try:
        return GPTConfig(vocab_size=vocab_size, **{k: cfg[k] for k in MODEL_KEYS})
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _number(value):
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def check_training_values(cfg, master=None):
    """The optimizer's and the LR schedule's numbers of a train.py configuration, before anything is
    built or written: a value AdamW or the schedule cannot take is a one-line ConfigError that names
    the fix. Then warnings (rank 0; master None: from $RANK) for what runs but is likely a mistake: a
    warm-up as long as the run, and kernels=triton on a CPU (a cosine that ends after the run: the plan's,
    RunPlan.warn_if_the_cosine_outlasts_the_run)."""
    def need(ok, key, what, example):
        if not ok:
            raise ConfigError(f"{key} must be {what}, got {cfg[key]!r} (e.g. --{key}={example})")
    need(_number(cfg["learning_rate"]) and cfg["learning_rate"] > 0, "learning_rate", "a number > 0", "6e-4")
    need(cfg["min_lr"] is None or (_number(cfg["min_lr"]) and cfg["min_lr"] >= 0), "min_lr",
         "a number >= 0 (None: learning_rate / 10)", "6e-5")
    for key, example in (("beta1", 0.9), ("beta2", 0.95)):
        need(_number(cfg[key]) and 0 <= cfg[key] < 1, key, "in [0, 1) (AdamW's moment decay)", example)
    need(_number(cfg["weight_decay"]) and cfg["weight_decay"] >= 0, "weight_decay", "a number >= 0 (0: none)", 0.1)
    check_muon_values(cfg, need)
    check_schedule(cfg)
    need(_number(cfg["grad_clip"]) and cfg["grad_clip"] >= 0, "grad_clip", "a number >= 0 (0: no clipping)", 1.0)
    need(isinstance(cfg["warmup_iters"], int) and not isinstance(cfg["warmup_iters"], bool)
         and cfg["warmup_iters"] >= 0, "warmup_iters", "a whole number >= 0 (0: no warm-up)", 100)
    need(cfg["lr_decay_iters"] is None or (isinstance(cfg["lr_decay_iters"], int) and cfg["lr_decay_iters"] >= 0),
         "lr_decay_iters", "a whole number >= 0 (None: max_iters)", cfg["max_iters"])
    if master is None:
        master = os.environ.get("RANK", "0") == "0"
    if not master:
        return
    budget = cfg["max_flops"] is not None or cfg["max_seconds"] is not None  # those cap the warm-up themselves
    if (cfg["init_from"] == "scratch" and not budget and isinstance(cfg["max_iters"], int)
            and 0 < cfg["max_iters"] <= cfg["warmup_iters"]):
        print(f"warning: warmup_iters {cfg['warmup_iters']} >= max_iters {cfg['max_iters']}: the whole run is "
              f"warm-up and the LR never reaches learning_rate; lower it, e.g. "
              f"--warmup_iters={math.ceil(0.1 * cfg['max_iters'])}", file=sys.stderr, flush=True)
    if cfg["kernels"] == "triton" and (cfg["device"] == "cpu" or (cfg["device"] == "auto"
                                                                  and not torch.cuda.is_available())):
        print(KERNELS_ON_CPU, file=sys.stderr, flush=True)


def check_schedule(cfg):
    """The cosine's numbers that run but make no schedule: a floor above the peak (the "decay" climbs), and,
    when max_iters plans the run (a FLOP or time budget plans lr_decay_iters itself) and the run outlasts its
    warm-up, a decay that ends inside the warm-up (the LR jumps from the warm-up straight to min_lr)."""
    if not cfg["decay_lr"]:
        return
    lr, floor = cfg["learning_rate"], cfg["min_lr"]
    if floor is not None and floor > lr:
        raise ConfigError(f"min_lr {floor:g} is above learning_rate {lr:g}: the cosine would climb to it; lower "
                          f"--min_lr (e.g. --min_lr={lr / 10:g}) or raise --learning_rate")
    budget = cfg["max_flops"] is not None or cfg["max_seconds"] is not None
    end, warm = cfg["lr_decay_iters"], cfg["warmup_iters"]
    if not budget and end is not None and end < warm < cfg["max_iters"]:  # a run all warm-up never jumps
        raise ConfigError(f"lr_decay_iters {end} ends inside the warm-up (warmup_iters {warm}): the LR would jump "
                          f"from the warm-up straight to min_lr; raise --lr_decay_iters (e.g. to max_iters) or "
                          f"lower --warmup_iters")


MUON_KEYS = ("muon_lr", "muon_momentum", "muon_weight_decay", "muon_adjust_lr")
MUON_ADJUST_LR = ("original", "match_rms_adamw")  # torch.optim.Muon's adjust_lr_fn


def check_muon_values(cfg, need):
    """optimizer and the muon_* keys (muon_* only with optimizer=muon: a one-line error, not a silent no-op)."""
    need(cfg["optimizer"] in ("adamw", "muon"), "optimizer", "'adamw' or 'muon'", "muon")
    if cfg["optimizer"] != "muon":
        for key in MUON_KEYS:
            if cfg[key] != DEFAULTS[key]:
                raise ConfigError(f"{key}={cfg[key]!r} only applies to optimizer=muon; add --optimizer=muon or drop it")
        return
    need(_number(cfg["muon_lr"]) and cfg["muon_lr"] > 0, "muon_lr", "a number > 0 (Muon's peak LR)", 0.02)
    need(_number(cfg["muon_momentum"]) and 0 <= cfg["muon_momentum"] < 1, "muon_momentum", "in [0, 1)", 0.95)
    need(_number(cfg["muon_weight_decay"]) and cfg["muon_weight_decay"] >= 0, "muon_weight_decay",
         "a number >= 0 (0: none)", 0.0)
    need(cfg["muon_adjust_lr"] in MUON_ADJUST_LR, "muon_adjust_lr", " or ".join(map(repr, MUON_ADJUST_LR)),
         "original")


def muon_settings(cfg):
    """GPT.configure_optimizers' muon argument from a checked configuration (None: AdamW alone)."""
    if cfg["optimizer"] != "muon":
        return None
    return dict(lr=cfg["muon_lr"], momentum=cfg["muon_momentum"], weight_decay=cfg["muon_weight_decay"],
                adjust_lr_fn=cfg["muon_adjust_lr"])


KERNELS_ON_CPU = ("note: kernels=triton on the CPU runs each fused op's CPU implementation, which is the "
                  "PyTorch reference; the Triton kernels run on a GPU (on a CPU, --kernels=auto or torch)")


# -----------------------------------------------------------------------------
# device and precision: one rule for train, sample, tradeoff and bench

Precision = namedtuple("Precision", "device dtype autocast")
DTYPES = ("float32", "bfloat16", "float16")


def cpu_computes_bf16():
    """Whether this CPU multiplies bf16 natively (AVX512-BF16, which CPUs with AMX have too): there a bf16
    matmul runs 2-3x as fast as an fp32 one at the quickstart's shapes; elsewhere it is emulated, and slower."""
    return torch.cpu._is_avx512_bf16_supported()


def pick_device(device="auto", dtype="auto", cpu_bf16=False):
    """device 'auto' is the GPU if there is one, else the CPU. dtype 'auto' is bfloat16 autocast on
    a GPU that has it, float16 autocast on one that has not (train.py adds a grad scaler); on the CPU
    float32, or with cpu_bf16 (training: train.py) bfloat16 autocast where the CPU computes bf16 natively
    (cpu_computes_bf16). Sampling a token at a time stays fp32: autocast's casts cost it more than its
    matmuls save. Returns (torch.device, the dtype's name, a reusable autocast context: a no-op in fp32)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    name = device
    try:
        device = torch.device(device)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):  # torch also knows mps, xla, ...: not nanodepth
        raise ConfigError(f"unknown device {name!r}: use auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device} asked for, but torch sees no GPU: use --device=cpu (or auto)")
    if dtype == "auto" and device.type == "cuda":
        dtype = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    elif dtype == "auto":
        dtype = "bfloat16" if cpu_bf16 and cpu_computes_bf16() else "float32"
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be auto, {', '.join(DTYPES)}, got {dtype!r}")
    autocast = (contextlib.nullcontext() if dtype == "float32"
                else torch.autocast(device_type=device.type, dtype=getattr(torch, dtype)))
    return Precision(device, dtype, autocast)


def own_cores():
    """The cores this process may run on."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def core_ticks(cores):
    """(idle, total) clock ticks of these cores since boot, from /proc/stat (Linux; raises OSError elsewhere)."""
    idle = total = 0
    with open("/proc/stat") as f:
        for line in f:
            name, *ticks = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
                ticks = [int(t) for t in ticks[:8]]  # user nice system idle iowait irq softirq steal
                idle, total = idle + ticks[3] + ticks[4], total + sum(ticks)
    return idle, total


def free_cores(seconds=0.1):
    """The cores this process may run on, less the share of them other work keeps busy: their idle time over
    `seconds`. Returns (cores, free cores), free None where /proc/stat cannot be read."""
    cores = own_cores()
    try:
        idle0, total0 = core_ticks(cores)
        time.sleep(seconds)
        idle1, total1 = core_ticks(cores)
    except (OSError, ValueError, IndexError):
        return len(cores), None
    if total1 <= total0:
        return len(cores), None
    return len(cores), len(cores) * (idle1 - idle0) / (total1 - total0)


class ThreadFollower:
    """The threads of a CPU run that pick_threads chose (threads=0, no OMP_NUM_THREADS) follow the free cores for
    the whole run, not only at its start: every CHECK_S seconds (check(), called after each step) the cores' busy
    time since the last check (/proc/stat) less this process's own CPU time is other work's share, and the count
    is set again as at the start (the free cores, rounded, at least 1, at most the cores). Work that starts after
    the run (another run, a build) would otherwise leave every op waiting for a thread whose core it took. A
    pinned count (--threads, OMP_NUM_THREADS), a GPU run, or no /proc/stat: check() never changes anything.
    check() returns the line that says a change (printed with say=True), else None."""
    CHECK_S = 5.0

    def __init__(self, threads, device):
        self.cores = own_cores()
        follows = device.type == "cpu" and not threads and not os.environ.get("OMP_NUM_THREADS")
        self.mark = self.read() if follows else None

    def read(self):
        try:
            return (time.monotonic(), time.process_time(), *core_ticks(self.cores))
        except (OSError, ValueError, IndexError):
            return None

    def check(self, say=False):
        if self.mark is None or time.monotonic() - self.mark[0] < self.CHECK_S:
            return None
        (t0, cpu0, idle0, total0), mark = self.mark, self.read()
        if mark is None or mark[3] <= total0:
            return None
        t1, cpu1, idle1, total1 = self.mark = mark
        n_cores = len(self.cores)
        busy = n_cores * (1 - (idle1 - idle0) / (total1 - total0))
        free = min(n_cores, max(0.0, n_cores - (busy - (cpu1 - cpu0) / (t1 - t0))))
        n, before = max(1, min(n_cores, int(free + 0.5))), torch.get_num_threads()
        if n == before:
            return None
        torch.set_num_threads(n)
        line = f"threads: {before} -> {n}, {free:.1f} of {n_cores} cores free over the last {t1 - t0:.0f}s " \
               f"(--threads=N pins the count)"
        if say:
            print(line, flush=True)
        return line


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def keep_freed_memory(device):
    """A CPU run: glibc's malloc keeps the memory a step frees for the next step, instead of handing each
    large buffer back to the system (trimmed, or unmapped) and faulting fresh zeroed pages in for the next
    one. A CPU step frees and allocates the same activation-sized tensors every step; on the quickstart each
    step took 400 to 1,300 page faults (a gelu backward, 0.55 ms, took 1.3 ms with its output's). Memory the
    run freed stays with the process, up to its peak. Returns whether it was done (Linux with glibc)."""
    if device.type != "cpu":
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl without mallopt)
        return False
    # buffers up to 32 MiB (glibc's most) from the heap, and the heap never trimmed below what it holds
    return bool(mallopt(M_MMAP_THRESHOLD, 32 << 20)) and bool(mallopt(M_TRIM_THRESHOLD, 2 ** 31 - 1))


def pick_threads(threads, device):
    """Set torch's intra-op threads for a CPU run; returns what the start-up line says of them ("" on a GPU).
    threads > 0 is taken as given; 0 keeps OMP_NUM_THREADS when it is set (torchrun sets 1 per process), else
    takes torch's own count (the cores), or fewer when other work keeps some cores busy at the start
    (free_cores, rounded, at least 1): a thread that waits for a core holds back every op it shares, as each
    op's threads meet at its end. Threads change a run's last bits (the order of its sums): --threads pins it."""
    if device.type != "cpu":
        return ""
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
        raise ConfigError(f"--threads={threads!r}: give a whole number >= 0 (0: the cores free at the start)")
    plural = lambda n: f"{n} thread{'s' * (n > 1)}"  # noqa: E731
    if threads:
        torch.set_num_threads(threads)
        return f"{plural(threads)} (--threads)"
    own = torch.get_num_threads()
    if os.environ.get("OMP_NUM_THREADS"):
        return f"{plural(own)} (OMP_NUM_THREADS)"
    cores, free = free_cores()
    if free is None or int(free + 0.5) >= own:
        return plural(own)
    n = max(1, int(free + 0.5))
    torch.set_num_threads(n)
    return f"{plural(n)}: {free:.1f} of {cores} cores free at the start (--threads={own} takes {own})"


# -----------------------------------------------------------------------------
# data

def find_data(cfg, master=True):
    """Paths of train.bin / val.bin and the vocab size of cfg's dataset; prepares shakespeare_char
    if it is missing (on rank 0; under DDP every rank waits at a barrier, whatever it saw)."""
    ddir = os.path.join(cfg["data_dir"], cfg["dataset"])
    paths = {split: os.path.join(ddir, f"{split}.bin") for split in ("train", "val")}
    if not all(os.path.exists(p) for p in paths.values()):
        if cfg["dataset"] != "shakespeare_char":
            if not os.path.isfile(os.path.join(REPO, "data", cfg["dataset"], "prepare.py")):  # a dataset we do not ship
                shipped = sorted(d for d in os.listdir(os.path.join(REPO, "data"))
                                 if os.path.isfile(os.path.join(REPO, "data", d, "prepare.py")))
                raise ConfigError(f"no dataset {cfg['dataset']!r}: {paths['train']} is missing and data/ has no "
                                  f"prepare.py for it; the datasets: {', '.join(shipped)} (--dataset=NAME)")
            raise ConfigError(f"missing {paths['train']} or val.bin: run "
                              f"python data/{cfg['dataset']}/prepare.py first")
        if master:
            print(f"no data in {ddir}: preparing shakespeare_char")
            from data.shakespeare_char.prepare import prepare
            prepare(out_dir=ddir)
    if dist.is_initialized():  # every rank, whatever it saw: rank 0 may be preparing the data
        dist.barrier()
    return paths, dataset_vocab_size(ddir)


def dataset_vocab_size(ddir):
    """The vocab size in the dataset's meta.pkl, else gpt2 BPE's."""
    meta_path = os.path.join(ddir, "meta.pkl")
    if not os.path.exists(meta_path):
        return 50257
    with open(meta_path, "rb") as f:
        return pickle.load(f)["vocab_size"]


def get_batch(path, batch_size, block_size, generator, device):
    # a fresh memmap per batch avoids a memory leak (numpy memmaps keep pages referenced)
    data = np.memmap(path, dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - block_size, (batch_size,), generator=generator)
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix.tolist()])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix.tolist()])
    if device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


# -----------------------------------------------------------------------------
# checkpoints and logs

def save_checkpoint(obj, path):
    """Atomic: write a temp file, flush it to disk, then rename over the old checkpoint, so a crash
    at any moment leaves either the old or the new checkpoint, never a torn one. A write the disk
    refuses (full, gone) raises the OSError the file raised (write_error)."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    except RuntimeError as e:
        cause = write_error(e)
        if cause is None:
            raise
        raise cause from None
    os.replace(tmp, path)
    if hasattr(os, "O_DIRECTORY"):  # make the rename itself survive a power cut
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_error(e):
    """The OSError behind e, or None. When its file's write fails (a full disk), torch's zip writer raises
    a RuntimeError of its own while handling that OSError ("[enforce fail at inline_container.cc] ...
    unexpected pos"): the OSError is its __context__. Any other RuntimeError has none and stays what it is."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def damaged_entry(path):
    """The first entry of a checkpoint (torch.save's zip: the pickle, each tensor's bytes, the model's and
    the optimizer's) whose bytes do not match the CRC-32 torch's zip writer stored for it, None when all
    match. torch.load never checks them: bytes overwritten on disk would load as other weights, silently.
    None too for a file that is no zip (a truncated one, which torch.load refuses; torch's legacy format).
    Reads the file once, about a tenth of torch.load's time (GPT-2 small: 0.27 s against 1.9 s)."""
    if not zipfile.is_zipfile(path):
        return None
    with zipfile.ZipFile(path) as z:
        return z.testzip()


def load_checkpoint(path, device, reader=False):
    """out_dir/ckpt.pt, its checksums checked (damaged_entry); a missing or damaged one is a one-line
    ConfigError. reader: the caller reads a trained run (sample.py, tradeoff.py, bench.py, plot.py), so the
    fix is the --out_dir of one; else it is train.py resuming, which may start over instead
    (--init_from=scratch)."""
    if not os.path.exists(path):
        kept = sorted(glob.glob(os.path.join(os.path.dirname(path), "run-*", "ckpt.pt")))  # earlier runs set aside
        if reader and kept:
            raise ConfigError(f"no checkpoint at {path}, but earlier runs there hold one: "
                              f"{', '.join(os.path.dirname(k) for k in kept[-3:])}"
                              f"{' and more' if len(kept) > 3 else ''}; pass one as --out_dir=DIR")
        if reader:
            raise ConfigError(f"no checkpoint at {path}: pass --out_dir=DIR, the folder of a trained run "
                              f"(python train.py ... --out_dir=DIR writes DIR/ckpt.pt)")
        raise ConfigError(f"no checkpoint at {path}: check --out_dir (or train with --init_from=scratch)")
    fix = "restore it from a copy or train the run again" if reader else \
        "restore it from a copy or start with --init_from=scratch"
    try:
        damaged = damaged_entry(path)
        if damaged is None:
            ckpt = torch.load(path, map_location=device, weights_only=True)
            ckpt["model"], ckpt["model_args"], ckpt["iter_num"]
    except Exception as e:
        raise ConfigError(f"checkpoint {path} is corrupt or truncated ({type(e).__name__}); {fix}") from None
    if damaged is not None:
        best = os.path.join(os.path.dirname(path), "ckpt_best.pt")  # kept by an interrupt (keep_best_checkpoint)
        if os.path.isfile(best) and not os.path.samefile(best, path):
            fix = fix.replace("from a copy", f"from a copy (this run's best model: {best})")
        raise ConfigError(f"checkpoint {path} is corrupt: its checksum does not match (its entry {damaged} "
                          f"changed on disk after it was written); {fix}")
    return ckpt


def model_from_checkpoint(ckpt, device, **overrides):
    """The checkpoint's GPT (its model_args, updated by overrides) with its weights, in eval mode on
    device. MoD checkpoints carry their thresholds (mod.tau) as a buffer."""
    try:
        model = GPT(GPTConfig(**{**ckpt["model_args"], **overrides}))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"the checkpoint's model_args do not make a model here ({e}); "
                          f"use it with the code version that trained it") from None
    model.load_state_dict(ckpt["model"])
    return model.to(device).eval()


def dataset_vocab(ddir):
    """The vocabulary of the dataset in ddir, as train.py stores it in a checkpoint: a character dataset's
    tokens in id order (meta.pkl's itos), else the name of its BPE encoding (meta.pkl's tokenizer; no
    meta.pkl: gpt2, as dataset_vocab_size has it)."""
    meta_path = os.path.join(ddir, "meta.pkl")
    if not os.path.exists(meta_path):
        return {"vocab_size": 50257, "encoding": "gpt2"}
    with open(meta_path, "rb") as f:
        meta = pickle.load(f)
    if "itos" in meta:
        return {"vocab_size": meta["vocab_size"], "itos": [meta["itos"][i] for i in range(meta["vocab_size"])]}
    return {"vocab_size": meta["vocab_size"], "encoding": meta.get("tokenizer", "gpt2")}


def vocab_difference(ckpt, ddir):
    """How the vocabulary of the dataset in ddir differs from the checkpoint's (a dataset prepared again,
    in place, from another text maps the ids to other tokens), or None: the same, or a checkpoint from
    before checkpoints carried their vocabulary."""
    carried = ckpt.get("vocab")
    if carried is None:
        return None
    now = dataset_vocab(ddir)
    if now == carried:
        return None
    if "itos" in now and "itos" in carried:
        moved = sum(a != b for a, b in zip(now["itos"], carried["itos"])) + abs(len(now["itos"]) - len(carried["itos"]))
        return f"{moved} of its {carried['vocab_size']} ids map to other characters in {ddir}/meta.pkl"
    def name(v):
        return f"the {v['encoding']} encoding" if "encoding" in v else f"{v['vocab_size']} characters"
    return f"it trained on {name(carried)}, {ddir} has {name(now)}"


def check_same_dataset(ckpt, data, vocab_size, fix):
    """A checkpoint's run (resumed, evaluated) reads the dataset it trained on (data: its dataset and data_dir):
    the same vocab_size, and the same vocabulary (a dataset prepared again, in place, from another text maps
    the same ids to other tokens). fix: what the one-line error tells the user to do."""
    if ckpt["model_args"]["vocab_size"] != vocab_size:
        raise ConfigError(f"the checkpoint has vocab_size {ckpt['model_args']['vocab_size']} but dataset "
                          f"{data['dataset']} has {vocab_size}; {fix}")
    changed = vocab_difference(ckpt, os.path.join(data["data_dir"], data["dataset"]))
    if changed:
        raise ConfigError(f"dataset {data['dataset']} has another vocabulary than the checkpoint ({changed}): it "
                          f"was prepared again since the run trained; {fix}")


def load_codec(ckpt):
    """encode/decode for the checkpoint's vocabulary: the one it carries (train.py stores dataset_vocab),
    else, in a checkpoint from before that, its dataset's meta.pkl as it is now (a character vocab) or gpt2
    BPE. Without either, or where tiktoken cannot load the encoding (offline), a one-line ConfigError."""
    vocab = ckpt.get("vocab")
    if vocab is None:
        cfg = ckpt.get("config", {})
        ddir = os.path.join(cfg.get("data_dir", "data"), cfg.get("dataset", ""))
        vocab = dataset_vocab(ddir)
        if "encoding" in vocab and ckpt["model_args"]["vocab_size"] < vocab["vocab_size"]:  # no meta.pkl: no BPE model
            raise ConfigError(f"the checkpoint carries no vocabulary (it predates that) and its dataset's "
                              f"{os.path.join(ddir, 'meta.pkl')} is missing: prepare the dataset it trained on "
                              f"there again (python data/{cfg.get('dataset', 'NAME')}/prepare.py)")
    if "itos" in vocab:
        itos = vocab["itos"]
        stoi = {c: i for i, c in enumerate(itos)}

        def encode(s):
            missing = sorted(set(c for c in s if c not in stoi))
            if missing:
                raise ConfigError(f"the text has characters outside the vocabulary: {missing!r}")
            return [stoi[c] for c in s]
        return encode, lambda ids: "".join(itos[i] for i in ids)
    try:
        import tiktoken
        enc = tiktoken.get_encoding(vocab["encoding"])
    except Exception as e:
        raise ConfigError(f"cannot load the {vocab['encoding']} BPE encoding the checkpoint uses (tiktoken: "
                          f"{type(e).__name__}); tiktoken downloads it once: run with internet access, or set "
                          f"TIKTOKEN_CACHE_DIR to a folder holding a cached copy") from None
    return (lambda s: enc.encode(s, allowed_special={"<|endoftext|>"})), enc.decode


def format_duration(seconds):
    """45s, 3m12s, 2h05m."""
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def seed_run(cell, seed):
    """A sweep run's name: its cell and seed (flops.py sweep names its out_dirs so)."""
    return f"{cell}_s{seed}"


def seed_cell(run):
    """The cell of a run named by seed_run, or None for any other name."""
    cell, _, seed = run.rpartition("_s")
    return cell if cell and seed.isdigit() else None


def pick_baselines(cells, baseline=None):
    """{cell: the cell it is tested against}, the one rule of flops.py's results tables and plot.py's
    table: `baseline` when one is named; else, at the cell's depth, the plain prenorm cell (residual
    prenorm, no MoD, no other keys: the reference the other modes are compared with), else the depth's
    first cell. cells: (name, depth, whether it is plain prenorm), in the table's order."""
    first = {}
    for name, depth, plain in cells:
        if depth not in first or (plain and not first[depth][1]):
            first[depth] = (name, plain)
    return {name: baseline or first[depth][0] for name, depth, _ in cells}


def load_log(out_dir):
    """The records of out_dir/log.jsonl (train.py appends one per eval), sorted by iter."""
    path = os.path.join(out_dir, "log.jsonl")
    if not os.path.isfile(path):
        raise ConfigError(f"no log at {path} (train.py writes one into its --out_dir)")
    records, skipped = {}, 0
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line.decode("utf-8"))
                r["iter"]
            except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, IndexError):
                # a line cut mid-write (a crash, a full disk): the others still count
                print(f"warning: {path} line {n} is not JSON (cut mid-write?): skipped", file=sys.stderr, flush=True)
                skipped += 1
                continue
            # a run resumed from an older checkpoint logs some iters again: the later record wins
            records[r["iter"]] = r
    if skipped and not records:  # not one record: not a log train.py wrote (JSON lines, in UTF-8)
        raise ConfigError(f"{path} is not a train.py log ({skipped} line(s), none a JSON record with its iter): "
                          f"pass the out_dir of a train.py run")
    return [records[i] for i in sorted(records)]


def sublayer_names(n_sublayers):
    """attn1 mlp1 attn2 mlp2 ...: sublayers 1..2L by kind and transformer block."""
    return [f"{'attn' if l % 2 == 0 else 'mlp'}{l // 2 + 1}" for l in range(n_sublayers)]
