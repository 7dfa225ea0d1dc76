"""What keeps a training run from being lost (train.py's guards): every failure is a one-line error that
names the fix, and no good checkpoint is ever overwritten or left half-written.

- start: out_dir must take a file before anything else happens (check_writable); a run from scratch
  moves an earlier run's checkpoint and log aside, never over them (set_aside_previous_run)
- resume: the checkpoint's architecture and budget win, and argv that contradicts them is an error
  (explicit_keys, resolve_model_args, resume_budget, check_resumed_budget); every rank's RNG comes back
- signals: SIGINT / SIGTERM only set a flag (StopSignals); the loop checkpoints at the next step
  boundary, the best checkpoint kept aside (keep_best_checkpoint), and says how to resume (resume_command)
- bad steps: the steps count non-finite steps on the device (train.StepStats); at a read, check_bad_steps
  reports them and stops the run after max_bad_steps in a row (TrainingStopped)
- compile: ZeroGradientCheck warns, loudly, about parameters that a compiled step gives no gradient
"""

import contextlib
import os
import shlex
import shutil
import signal
import sys
import tempfile

import torch

from configurator import ConfigError, configure
from run_config import DEFAULTS, MODEL_KEYS, RUN_KEYS

GRAD_CHECK_STEPS = 5  # compile=True: the first log iteration this many steps into a run checks for zero gradients
BUDGET_KEYS = ("max_flops", "max_seconds", "max_iters", "lr_decay_iters", "warmup_iters")  # resume keeps the run's length


class TrainingStopped(RuntimeError):
    """Training cannot go on (e.g. the loss keeps being NaN); the message is one line that names the fix."""


class Interrupted(Exception):
    """SIGINT / SIGTERM: a checkpoint was written; the message says how to resume."""

    def __init__(self, message, signum):
        super().__init__(message)
        self.signum = signum


# -----------------------------------------------------------------------------
# start: out_dir

def check_writable(out_dir):
    """Make out_dir if it is missing and create (and remove) a file in it: an out_dir that cannot hold the
    checkpoint fails at the start, not at the first eval."""
    try:
        os.makedirs(out_dir, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out_dir, prefix=".write_test"):
            pass
    except OSError as e:
        raise ConfigError(f"cannot write to out_dir {out_dir} ({e.strerror or e}); use another --out_dir") from None


def set_aside_previous_run(out_dir, ckpt_path, log_path):
    """A run from scratch, after every check (a failed start leaves out_dir as it was): the files of an
    earlier run in out_dir are moved aside, never overwritten."""
    if os.path.exists(ckpt_path):
        # never silently lose a good checkpoint: keep the previous run's aside
        os.replace(ckpt_path, os.path.join(out_dir, "ckpt_prev.pt"))
        if os.path.exists(log_path):
            os.replace(log_path, os.path.join(out_dir, "log_prev.jsonl"))
        print(f"{ckpt_path} existed: moved it to ckpt_prev.pt (use --init_from=resume to continue it)")
    elif os.path.exists(log_path):
        # a log without a checkpoint: a run that stopped before its first save, or eval_only; this run
        # starts a new log instead of appending to it (there is nothing to resume it from)
        os.remove(log_path)
        print(f"{log_path} existed without a checkpoint: removed it")


# -----------------------------------------------------------------------------
# resume: the checkpoint's architecture and budget, every rank's RNG

def explicit_keys(argv):
    """The keys that argv sets, in a config file or as --key=value: configure() over defaults that are all
    None (None takes any value) leaves None exactly where argv sets nothing. So a key set to None counts
    as unset, which is what None means for every key that has it (lr_decay_iters=None: max_iters)."""
    return {k for k, v in configure(argv, dict.fromkeys(DEFAULTS)).items() if v is not None}


def resolve_model_args(cfg, ckpt_args, explicit):
    """On resume the architecture comes from the checkpoint; a key that argv sets (explicit_keys: a config
    file counts) to something else is an error, also where that is the default, rather than silently
    ignored. RUN_KEYS (dropout, kernels) come from this run's configuration instead (compile is not a
    model key: it is always this run's)."""
    args = {}
    for k in MODEL_KEYS:
        saved = ckpt_args.get(k, DEFAULTS[k])
        if k in explicit and k not in RUN_KEYS and cfg[k] != saved:
            raise ConfigError(f"the checkpoint was trained with {k}={saved!r}, not {cfg[k]!r}; "
                              f"drop --{k} or use another out_dir")
        args[k] = cfg[k] if k in RUN_KEYS else saved
    return args


def resume_budget(cfg, ckpt_cfg, explicit):
    """On resume the run's length (BUDGET_KEYS) comes from the checkpoint unless argv sets it, so a
    finished run resumed with fewer arguments does not train on. The rule: a set max_iters or
    lr_decay_iters extends (or shortens) the run or its decay, nanoGPT's way to train on; a max_flops
    budget decides max_iters again exactly as it did, and max_flops, max_seconds and warmup_iters cannot
    change (check_resumed_budget compares them with the checkpoint's after planning; with max_seconds the
    warm-up is re-planned from the pace, so it is not compared)."""
    return {k: ckpt_cfg.get(k, cfg[k]) for k in BUDGET_KEYS if k not in explicit}


def check_resumed_budget(cfg, ckpt_cfg):
    """resume_budget's rule, after planning (the plan has the same inputs, only argv differs)."""
    for k in ("max_flops", "max_seconds") + (("warmup_iters",) if cfg["max_seconds"] is None else ()):
        saved = ckpt_cfg.get(k, cfg[k])
        if cfg[k] != saved:
            raise ConfigError(f"the checkpoint's run has {k}={saved!r}, not {cfg[k]!r}: resume keeps the "
                              f"run's budget; drop --{k} or use another out_dir")


def rng_state(device):
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(rngs, rank, world, device):
    """This rank's RNG state from the checkpoint's list of every rank's (kept as seeded if the number of
    processes changed)."""
    if len(rngs) == world:
        torch.set_rng_state(rngs[rank]["torch"].cpu())
        if "cuda" in rngs[rank] and device.type == "cuda":
            torch.cuda.set_rng_state(rngs[rank]["cuda"].cpu(), device)


# -----------------------------------------------------------------------------
# signals: checkpoint at the next step boundary, say how to resume

class StopSignals:
    """While active, SIGINT and SIGTERM only set a flag: the loop checkpoints at the next step boundary
    (never inside the handler, where the model may be half-updated) and then exits."""

    def __init__(self):
        self.signum = 0

    def _handle(self, signum, frame):
        if not self.signum:
            print(f"got {signal.Signals(signum).name}: saving a checkpoint after this step, then exiting",
                  file=sys.stderr, flush=True)
        self.signum = signum  # repeats (torchrun forwards the terminal's Ctrl-C again) change nothing

    def install(self):
        self.previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def restore(self):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def keep_best_checkpoint(ckpt_path, out_dir):
    """Before an interrupt checkpoint (the resume point) goes to ckpt.pt: when only improvements are saved,
    ckpt.pt holds the best model so far; keep it as ckpt_best.pt."""
    if not os.path.exists(ckpt_path):
        return
    best_path = os.path.join(out_dir, "ckpt_best.pt")
    with contextlib.suppress(FileNotFoundError):
        os.remove(best_path)
    try:
        os.link(ckpt_path, best_path)  # a hard link: instant, and ckpt.pt stays in place
    except OSError:  # a file system without hard links
        shutil.copyfile(ckpt_path, best_path)


def resume_command(argv, out_dir, world):
    """The command line that continues this run: the same arguments, resuming from out_dir."""
    args = [a for a in argv if not a.startswith(("--init_from=", "--out_dir="))]
    args += ["--init_from=resume", f"--out_dir={out_dir}"]
    launcher = ["python"] if world == 1 else ["torchrun", "--standalone", f"--nproc_per_node={world}"]
    return shlex.join(launcher + ["train.py"] + args)


# -----------------------------------------------------------------------------
# bad steps: non-finite loss or gradients

def check_bad_steps(counts, last_iter, max_bad_steps, ckpt_path, master):
    """At a read of the steps up to iteration last_iter, counts = (bad steps in a row now, the longest
    run, bad steps since the last read): rank 0 reports them; too many in a row give the error that stops
    the run (returned, to be raised once the caller has let go of signals and processes), else None."""
    in_a_row, longest, skipped = counts
    if skipped and master:
        print(f"iter {last_iter}: non-finite loss or gradients, {skipped} step(s) skipped since the last "
              f"log ({in_a_row} in a row now, the longest run {longest}, max_bad_steps={max_bad_steps})")
    if longest < max(1, max_bad_steps):
        return None
    return TrainingStopped(f"non-finite loss or gradients for {longest} consecutive steps by iteration {last_iter}: "
                           f"stopped; the last good checkpoint {ckpt_path} is kept. "
                           f"Lower --learning_rate or --grad_clip and resume with --init_from=resume")


# -----------------------------------------------------------------------------
# compile: parameters that get no gradient

class ZeroGradientCheck:
    """compile=True: a compiled step that gives parameters an exactly zero gradient trains a model that
    does not learn, behind a plausible loss (torch 2.11's Dynamo did this to every parameter upstream of
    a norm: kernels.cast). Once, at the first log iteration at least GRAD_CHECK_STEPS steps into the run
    (at init a zero-initialised query or projection legitimately passes no gradient upstream), an
    optimizer pre-hook keeps every gradient's norm on the device; the log iteration's sync reads them
    and warns, loudly, about each parameter whose gradient was exactly zero. No other step is touched."""

    def __init__(self, model, optimizer, first_iter):
        self.names = {p: n for n, p in model.named_parameters()}
        self.due, self.armed, self.norms = first_iter + GRAD_CHECK_STEPS, False, None
        optimizer.register_step_pre_hook(self.record)

    def arm(self, iter_num, log_interval):
        self.armed = self.due is not None and iter_num >= self.due and iter_num % log_interval == 0

    def record(self, optimizer, args, kwargs):
        if self.armed:
            self.params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            self.norms = torch.stack(torch._foreach_norm([p.grad for p in self.params]))
            self.armed, self.due = False, None

    def read(self, iter_num):
        """The warning (a string) if the recorded step gave some parameter a zero gradient, else None."""
        if self.norms is None:
            return None
        zero = [self.names[p] for p, norm in zip(self.params, self.norms.tolist()) if norm == 0]
        n, self.norms, self.params = len(self.params), None, None
        if not zero:
            return None
        shown = ", ".join(zero[:6]) + (", ..." if len(zero) > 6 else "")
        return (f"WARNING: the compiled step of iteration {iter_num} gave {len(zero)} of {n} parameters an exactly "
                f"zero gradient ({shown}): they are not learning. Compare with --compile=False; this torch is "
                f"{torch.__version__} (the README's 'Tested torch versions' says which are known good)")

    def warn(self, iter_num):
        """At a log iteration (a sync point): the warning, if any, between rows of '!' on stderr."""
        warning = self.read(iter_num)
        if warning:
            print(f"{'!' * 100}\n{warning}\n{'!' * 100}", file=sys.stderr, flush=True)
