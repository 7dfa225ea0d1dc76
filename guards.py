"""What keeps a training run from being lost (train.py's guards): every failure is a one-line error that
names the fix, and no good checkpoint is ever overwritten or left half-written.

- start: out_dir must take a file before anything else happens (check_writable); one run at a time writes
  in it (OutDirLock: out_dir/.lock, held for the run's life, a dead holder's taken over); a run from scratch
  moves every file of an earlier run (RUN_FILES) into a folder of its own in out_dir, never over anything
  (set_aside_previous_run), and records its own start (write_run_record: config.json)
- resume: what argv does not set comes from the checkpoint (resumed_config); its architecture and budget
  win, argv that contradicts them is an error (resolve_model_args, check_resume_changes), and a change
  to the run's plan comes from the command line or not at all (check_resume_changes, key_sources);
  every rank's RNG comes back
- signals: SIGINT / SIGTERM only set a flag (StopSignals); the loop checkpoints at the next step
  boundary or eval batch, the best checkpoint kept aside (keep_best_checkpoint), and says how to resume
  (resume_command); a second signal (one process) exits at once, writing nothing
- bad steps: the steps count non-finite steps on the device (train.StepStats); at a read, check_bad_steps
  reports them and stops the run after max_bad_steps in a row (TrainingStopped)
- run keeping (RunKeeper): which checkpoint is on disk, and what the run says when it stops (a signal, a
  second signal, a failed save), when it is slow on a CPU, and when it ends (the summary)
- compile: ZeroGradientCheck warns, loudly, about parameters that a compiled step gives no gradient
"""

import contextlib
import errno
import fcntl
import json
import os
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import time

import torch

from configurator import ConfigError, configure
from run_config import DEFAULTS, MODEL_KEYS, RUN_KEYS, format_duration

GRAD_CHECK_STEPS = 5  # compile=True: the first log iteration this many steps into a run checks for zero gradients
RUN_FILES = ("ckpt.pt", "ckpt_best.pt", "log.jsonl", "log.jsonl.torn", "config.json", "final_eval.json")  # what a run writes in out_dir
LOCK_FILE = ".lock"  # in out_dir while a run writes there (OutDirLock); never one of RUN_FILES: it never moves
# a resume: the keys each process sets for itself (never taken from the checkpoint), the budget (never
# changed), and the plan: what the run trains, which only the command line may change
OWN_KEYS = ("init_from", "eval_only", "out_dir", "device", "dtype", "compile", "kernels", "threads", "wandb_log",
            "wandb_project", "wandb_run_name")
BUDGET_KEYS = ("max_flops", "max_seconds")
PLAN_KEYS = ("max_iters", "lr_decay_iters", "warmup_iters", "learning_rate", "min_lr", "decay_lr", "weight_decay",
             "beta1", "beta2", "grad_clip", "batch_size", "gradient_accumulation_steps", "dataset", "seed", "dropout",
             "nag_gate_lr_scale", "nag_gate_decay", "nag_alpha_warmup_tokens", "muon_lr", "muon_momentum",
             "muon_weight_decay", "muon_adjust_lr")


class TrainingStopped(RuntimeError):
    """Training cannot go on (e.g. the loss keeps being NaN); the message is one line that names the fix."""


class Interrupted(Exception):
    """SIGINT / SIGTERM stopped the run: a checkpoint was written (not by eval_only, nor at a second
    signal); the message says what was kept and how to resume."""

    def __init__(self, message, signum):
        super().__init__(message)
        self.signum = signum


# -----------------------------------------------------------------------------
# start: out_dir

def check_writable(out_dir):
    """Make out_dir if it is missing and write (and remove) a file of WRITE_TEST_BYTES in it: an out_dir that
    cannot hold the checkpoint (read-only, or on a full disk: an empty file still fits there) fails at the
    start, not at the first eval."""
    try:
        os.makedirs(out_dir, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out_dir, prefix=".write_test") as f:
            f.write(bytes(WRITE_TEST_BYTES))
            f.flush()
    except OSError as e:
        raise ConfigError(f"cannot write to out_dir {out_dir} ({e.strerror or e}); "
                          f"{write_fix(e)}use another --out_dir") from None


WRITE_TEST_BYTES = 1 << 16  # more than config.json and the lock file: a start that passes can write them


def write_fix(e):
    """'free space on its disk, or ' for an OSError of a full disk (or quota), else ''."""
    return "free space on its disk, or " if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""


class OutDirLock:
    """One run at a time writes in out_dir. Every start that writes there (from scratch, a resume, eval_only:
    it appends its eval to log.jsonl) takes out_dir/.lock (LOCK_FILE) before it moves or writes anything, and
    holds it until the run ends. The lock is the kernel's (flock on the open file), so it ends with its
    process however that ends, kill -9 included; the file says who holds it (pid, host, start, command) and
    is removed by release(). A start that finds the lock held is a one-line ConfigError that names the
    holder and the fix; one that finds the file of a process that ended without releasing it takes it
    over and says so. Under DDP rank 0 alone takes it (the only rank that writes)."""

    def __init__(self, out_dir, command=""):
        self.path, self.fd = os.path.join(out_dir, LOCK_FILE), None
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise ConfigError(f"cannot create {self.path} ({e.strerror or e}); use another --out_dir") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = lock_holder(fd, "a run starting: no record yet")
                os.close(fd)
                raise ConfigError(f"out_dir {out_dir} is in use by another run ({holder}, {self.path}): wait for "
                                  f"it to end, or choose another --out_dir") from None
            except OSError as e:  # a file system without locks (some network mounts): run, but say so
                os.close(fd)
                print(f"WARNING: cannot lock out_dir {out_dir} ({e.strerror or e}): nothing stops another run "
                      f"from writing there at the same time", file=sys.stderr, flush=True)
                return
            # locked; but a run releasing it removes the file: if that came between open and flock, this fd
            # holds a removed file, and the next start would lock a new one: lock the file at the path
            with contextlib.suppress(OSError):
                held, there = os.fstat(fd), os.stat(self.path)
                if (held.st_dev, held.st_ino) == (there.st_dev, there.st_ino):
                    break
            os.close(fd)
        self.fd = fd
        if os.fstat(fd).st_size:  # a record, yet no lock: its process ended without releasing it
            print(f"{self.path}: the run that held it ({lock_holder(fd, 'its record unreadable')}) ended without "
                  f"releasing it (killed?); this run takes out_dir over", flush=True)
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                  "started_at": time.strftime("%Y-%m-%d %H:%M:%S"), "command": command}
        with contextlib.suppress(OSError):  # the record only informs (a full disk: the lock holds without it)
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)

    def release(self):
        """The end of the run (however it ends): the file removed, then the lock let go."""
        if self.fd is None:
            return
        with contextlib.suppress(OSError):
            held, there = os.fstat(self.fd), os.stat(self.path)
            if (held.st_dev, held.st_ino) == (there.st_dev, there.st_ino):
                os.remove(self.path)
        os.close(self.fd)
        self.fd = None


def claim_out_dir(out_dir, command):
    """The start's hold on out_dir (rank 0): writable (check_writable), then locked (OutDirLock) before
    anything in it is moved or written."""
    check_writable(out_dir)
    return OutDirLock(out_dir, command)


def lock_holder(fd, unknown):
    """Who holds (or held) a lock, from its file: 'pid N on HOST, started ...' (unknown: no record to read)."""
    try:
        record = json.loads(os.pread(fd, 65536, 0).decode())
        return f"pid {record['pid']} on {record['host']}, started {record['started_at']}"
    except (OSError, ValueError, KeyError, TypeError):
        return unknown


def run_started(out_dir, files):
    """When the run whose files are in out_dir started: config.json's record, else (an out_dir written
    before config.json existed) the time of its oldest file."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        with open(os.path.join(out_dir, "config.json")) as f:
            return float(json.load(f)["started"])
    return min(os.path.getmtime(os.path.join(out_dir, name)) for name in files)


def set_aside_previous_run(out_dir):
    """A run from scratch, after every check (a failed start leaves out_dir as it was): the files of an
    earlier run in out_dir (RUN_FILES: checkpoints, log, config.json) move, whole, into a new folder
    out_dir/run-YYYYmmdd-HHMMSS named by that run's start (-2, -3, ... when taken), so that every earlier
    run is kept, each a folder that sample.py (or a resume) takes as its --out_dir. Returns the folder
    (None: out_dir held no run). Anything else in out_dir stays where it is."""
    files = [name for name in RUN_FILES if os.path.isfile(os.path.join(out_dir, name))]
    if not files:
        return None
    started = time.localtime(run_started(out_dir, files))
    name = time.strftime("run-%Y%m%d-%H%M%S", started)
    folder, n = os.path.join(out_dir, name), 1
    while os.path.exists(folder):
        n += 1
        folder = os.path.join(out_dir, f"{name}-{n}")
    os.mkdir(folder)
    for f in files:
        os.replace(os.path.join(out_dir, f), os.path.join(folder, f))
    use = (f"; sample it or resume it with --out_dir={shlex.quote(folder)}" if "ckpt.pt" in files else "")
    print(f"{out_dir} held an earlier run (started {time.strftime('%Y-%m-%d %H:%M:%S', started)}): moved its "
          f"{', '.join(files)} to {folder}{use}", flush=True)
    return folder


def repair_torn_log(log_path):
    """A resume, before it appends: a log.jsonl whose last line was cut mid-write (no newline at its end)
    would have the next record glued onto it, losing that eval. The torn bytes move to log.jsonl.torn (appended
    there, so nothing is lost) and the log ends at its last whole line; says so. Returns the bytes moved."""
    if not os.path.isfile(log_path):
        return 0
    with open(log_path, "rb+") as f:
        data = f.read()
        if not data or data.endswith(b"\n"):
            return 0
        keep = data.rfind(b"\n") + 1
        with open(log_path + ".torn", "ab") as torn:
            torn.write(data[keep:] + b"\n")
        f.truncate(keep)
    print(f"{log_path}: its last line was cut mid-write ({len(data) - keep} bytes, no newline): moved to "
          f"{log_path}.torn; the log goes on from its last whole line", flush=True)
    return len(data) - keep


def write_run_record(out_dir, cfg, argv, world):
    """out_dir/config.json at a run's start from scratch: when it started (set_aside_previous_run names
    the run's folder by it), its command line and its configuration as it started (ckpt.pt holds the
    configuration as of its last save)."""
    record = {"started": time.time(), "started_at": time.strftime("%Y-%m-%d %H:%M:%S"),
              "command": command_line(argv, world), "config": cfg}
    path = os.path.join(out_dir, "config.json")
    try:  # atomic, as a checkpoint: a failed write (a full disk) leaves no torn or empty config.json
        with open(path + ".tmp", "w") as f:
            json.dump(record, f, indent=1, default=str)
            f.write("\n")
        os.replace(path + ".tmp", path)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(path + ".tmp")
        raise ConfigError(f"cannot write {path} ({e.strerror or e}); {write_fix(e)}use another --out_dir") from None


# -----------------------------------------------------------------------------
# resume: the checkpoint's architecture and budget, every rank's RNG

def explicit_keys(argv):
    """The keys that argv sets, in a config file or as --key=value: configure() over defaults that are all
    None (None takes any value) leaves None exactly where argv sets nothing. So a key set to None counts
    as unset, which is what None means for every key that has it (lr_decay_iters=None: max_iters)."""
    return {k for k, v in configure(argv, dict.fromkeys(DEFAULTS)).items() if v is not None}


def key_sources(argv):
    """{key: where argv sets it (the last that does): its '--key=value', or a config file's path}. As in
    explicit_keys, a key set to None counts as unset."""
    sources = {}
    for arg in argv:
        for k, v in configure([arg], dict.fromkeys(DEFAULTS)).items():
            if v is not None:
                sources[k] = arg
            elif arg.startswith(f"--{k}="):
                sources.pop(k, None)
    return sources


def resolve_model_args(cfg, ckpt_args, explicit):
    """On resume the architecture comes from the checkpoint; a key that argv sets (explicit_keys: a config
    file counts) to something else is an error, also where that is the default, rather than silently
    ignored. RUN_KEYS (dropout, kernels) are run settings: dropout is the checkpoint's unless argv sets it,
    kernels is always this run's (OWN_KEYS; compile is not a model key: it is always this run's)."""
    args = {}
    for k in MODEL_KEYS:
        saved = ckpt_args.get(k, DEFAULTS[k])
        if k in explicit and k not in RUN_KEYS and cfg[k] != saved:
            raise ConfigError(f"the checkpoint was trained with {k}={saved!r}, not {cfg[k]!r}; "
                              f"drop --{k} or use another out_dir")
        args[k] = cfg[k] if k in RUN_KEYS and (k in explicit or k in OWN_KEYS) else saved
    return args


def resumed_config(cfg, ckpt_cfg, explicit):
    """On resume every key that argv does not set comes from the checkpoint's run (its dataset and
    data_dir, batches, LR schedule, length and budget, evals, ...), so `train.py --init_from=resume
    --out_dir=X` alone continues the run as it was, and a finished run resumed with fewer arguments does
    not train on. Not OWN_KEYS (this process's: device, dtype, compile, kernels, wandb, ...) nor the
    model's keys (resolve_model_args). A key that an older checkpoint lacks stays as configured."""
    return {k: v for k, v in ckpt_cfg.items()
            if k in DEFAULTS and k not in explicit and k not in OWN_KEYS and k not in MODEL_KEYS}


def value_arg(key, value):
    """--key=value as a shell word, a list as a comma list."""
    return shlex.quote(f"--{key}=" + (",".join(map(str, value)) if isinstance(value, list) else str(value)))


def check_resume_changes(cfg, ckpt_cfg, sources):
    """After planning (a budget plans from the same inputs as it did), every run setting whose value
    differs from the checkpoint's run, as (key, the run's value, this one, where argv sets it: key_sources;
    None: planned). The rules:
    - the budget (BUDGET_KEYS) and warmup_iters never change (with max_seconds the warm-up, max_iters and
      lr_decay_iters follow the pace: not compared);
    - a change of the plan (PLAN_KEYS: what the run trains) comes from the command line or not at all: a
      config file that sets another value (`train.py config/x.py --init_from=resume` after a run
      shortened with --max_iters=100, the file's max_iters=2000) is refused, naming the --key=value
      that makes the change on purpose; `--max_iters=2000` extends a run, nanoGPT's way to train on;
    - the rest (eval_interval, eval_iters, ...) may change from anywhere.
    The architecture is resolve_model_args'; OWN_KEYS and the paths (out_dir, data_dir) are not compared."""
    replanned = ("max_iters", "lr_decay_iters", "warmup_iters") if cfg["max_seconds"] is not None else ()
    changes, refused = [], []
    for k in DEFAULTS:
        if (k in OWN_KEYS or k in replanned or k == "data_dir" or k not in ckpt_cfg
                or (k in MODEL_KEYS and k not in RUN_KEYS) or cfg[k] == ckpt_cfg[k]):
            continue
        saved, where = ckpt_cfg[k], sources.get(k)
        from_file = where is not None and not where.startswith("--")
        if k == "optimizer":  # its state is that optimizer's: the other could not take it
            raise ConfigError(f"the checkpoint's run trains with optimizer={saved!r}, not {cfg[k]!r}; resume with "
                              f"--optimizer={saved} or start the {cfg[k]} run in another out_dir")
        if k in BUDGET_KEYS or k == "warmup_iters":
            fix = (f"pass {value_arg(k, saved)} or resume without {where}" if from_file else
                   f"drop --{k}" if where else "resume with the run's settings")
            raise ConfigError(f"the checkpoint's run has {k}={saved!r}, not {cfg[k]!r}"
                              + (f" (set in {where})" if from_file else "")
                              + f": resume keeps the run's budget; {fix} or use another out_dir")
        (refused if from_file and k in PLAN_KEYS else changes).append((k, saved, cfg[k], where))
    if refused:
        files = " and ".join(sorted({where for *_, where in refused}))
        raise ConfigError(f"{files} would change the resumed run: "
                          + ", ".join(f"{k}={new!r} (the run has {old!r})" for k, old, new, _ in refused)
                          + "; a resume keeps the run's settings unless the command line changes them: pass "
                          + " ".join(value_arg(k, new) for k, _, new, _ in refused)
                          + f" to change them on purpose, or resume without {files} (the checkpoint has them)")
    return changes


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
    (never inside the handler, where the model may be half-updated), an eval stops at its next batch
    (Trainer.estimate_loss), and the run exits. With repeat_exits (one process) a second signal exits at
    once: the handler raises Interrupted(abort_message) wherever the run is, so nothing more is written
    (a checkpoint being saved is a temp file until its rename: ckpt.pt stays as it was). Under torchrun
    repeats change nothing: torchrun forwards the terminal's Ctrl-C to ranks that got it already (and
    kills them itself 30 s after forwarding a signal)."""

    def __init__(self, repeat_exits=False, abort_message=lambda: ""):
        self.signum, self.repeat_exits, self.abort_message = 0, repeat_exits, abort_message
        self.aborted = 0  # the second signal's number, once one has raised Interrupted

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.signum and self.repeat_exits:
            self.restore()
            self.aborted = signum
            raise Interrupted(self.abort_message(), signum)
        if not self.signum:
            print(f"got {name}: saving a checkpoint after this step (an eval stops at its next batch), then "
                  f"exiting" + (f"; {name} again exits at once, without saving" if self.repeat_exits else ""),
                  file=sys.stderr, flush=True)
        self.signum = signum

    def install(self):
        self.previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def restore(self):
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def abort(self):
        """The Interrupted of a second signal, again, for code that the handler's raise went through and
        came out as something else: torch.save's zip writer, interrupted inside a write, raises a
        RuntimeError of its own on the way out. None when no second signal came."""
        return Interrupted(self.abort_message(), self.aborted) if self.aborted else None


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


def command_line(argv, world):
    """The command line of a run with arguments argv in `world` processes."""
    launcher = ["python"] if world == 1 else ["torchrun", "--standalone", f"--nproc_per_node={world}"]
    return shlex.join(launcher + ["train.py"] + list(argv))


def resume_command(argv, out_dir, world):
    """The command line that continues this run: the same arguments, resuming from out_dir."""
    args = [a for a in argv if not a.startswith(("--init_from=", "--out_dir="))]
    return command_line(args + ["--init_from=resume", f"--out_dir={out_dir}"], world)


# -----------------------------------------------------------------------------
# run keeping: the checkpoint on disk, and what the run says when it stops, is slow, or ends

SLOW_EVAL_S, SLOW_RUN_S = 300.0, 3600.0  # on the CPU, an eval or a run estimated longer than this is warned about
CPU_CONFIG = "config/shakespeare_char_cpu.py"  # the quickstart: what the slow-run hint suggests on a CPU
SLOW_HINT = (f"a configuration sized for a GPU? On a CPU: {CPU_CONFIG}, or lower --eval_iters, "
             "--max_iters and the model (--n_layer, --n_embd). Ctrl-C stops the run with a checkpoint")
LOADED_HINT = ("other work on the cores? (this run's configuration is already the CPU one) Or lower --eval_iters, "
               "--max_iters and the model (--n_layer, --n_embd). Ctrl-C stops the run with a checkpoint")


class RunKeeper:
    """What rank 0 knows of the run's checkpoint, and the words the run ends with. saved: (iteration, val
    loss) of the checkpoint in ckpt.pt (val loss None: not known here), None while out_dir has none."""

    def __init__(self, cfg, argv, world):
        self.cfg, self.argv, self.world = cfg, argv, world
        self.ckpt_path = os.path.join(cfg["out_dir"], "ckpt.pt")
        self.saved = None
        self.warned_slow_eval = self.warned_slow_run = False

    def resume(self):
        return resume_command(self.argv, self.cfg["out_dir"], self.world)

    def kept(self):
        """'; ckpt.pt is as it was (iter N)', or '' when out_dir has no checkpoint."""
        return f"; {self.ckpt_path} is as it was (iter {self.saved[0]})" if self.saved else ""

    def abort_message(self):
        """A second signal (one process): the run exits at once, writing nothing more."""
        return ("stopped at once by a second signal: no checkpoint written for this stop" + self.kept()
                + (f". Resume with: {self.resume()}" if self.saved else ""))

    def interrupted(self, signum, iter_num, eval_due):
        """The message of a stop by signal (Interrupted), after its checkpoint (none with eval_only)."""
        name = signal.Signals(signum).name
        if self.cfg["eval_only"]:
            return f"interrupted by {name}: eval_only, nothing written" + self.kept()
        return (f"interrupted by {name} before iteration {iter_num}"
                + (" (its eval broken off: the resume runs it first)" if eval_due else "")
                + f"; checkpoint in {self.ckpt_path}. Resume with: {self.resume()}")

    def save_broken_off(self, e, iter_num, stop):
        """What a save that raised e ends with, its temp file removed (ckpt.pt stays as it was): a second
        signal (stop: StopSignals) that came inside torch.save exits as that signal, whatever torch.save
        raised on the way out (its zip writer's RuntimeError); an OSError (a full disk: save_checkpoint
        turns torch's RuntimeError back into it; a folder gone) is save_failed's one line; anything else
        is e itself."""
        with contextlib.suppress(OSError):
            os.remove(self.ckpt_path + ".tmp")
        abort = stop.abort() if stop is not None else None
        if abort and not isinstance(e, Interrupted):
            return abort
        return self.save_failed(iter_num, e) if isinstance(e, OSError) else e

    def save_failed(self, iter_num, e):
        """A full disk, a folder gone: one line, the last checkpoint kept."""
        resume = f"; free space and resume with: {self.resume()}" if self.saved else "; free space and start again"
        return TrainingStopped(f"could not write the checkpoint of iter {iter_num} ({e.strerror or e})"
                               f"{self.kept()}{resume}")

    def slow_hint(self):
        """What to do about a slow run: the CPU config, unless the command line already names it."""
        named = any(os.path.normpath(a).endswith(os.path.normpath(CPU_CONFIG)) for a in self.argv)
        return LOADED_HINT if named else SLOW_HINT

    def warn_slow_eval(self, seconds, batches):
        """On the CPU, once: an eval estimated at more than SLOW_EVAL_S."""
        if seconds > SLOW_EVAL_S and not self.warned_slow_eval:
            self.warned_slow_eval = True
            print(f"WARNING: on the CPU each eval of this run takes about {format_duration(seconds)} ({batches} "
                  f"batches of {self.cfg['batch_size']} x {self.cfg['block_size']} tokens); {self.slow_hint()}",
                  file=sys.stderr, flush=True)

    def warn_slow_run(self, left, dt, eval_s):
        """On the CPU, at the first progress line with a pace (dt s/iter): a warning when the rest of the run
        (left seconds, its evals eval_s each, None: not timed yet) takes longer than SLOW_RUN_S."""
        self.warned_slow_run = True
        if left > SLOW_RUN_S:
            evals = f", evals about {format_duration(eval_s)} each" if eval_s is not None else ""
            print(f"WARNING: on the CPU this run takes about {format_duration(left)} more at its first steps' pace "
                  f"({dt * 1000:,.0f} ms/iter{evals}, to iter {self.cfg['max_iters']}); {self.slow_hint()}",
                  file=sys.stderr, flush=True)

    def summary(self, iter_num, start_iter, evals_run, seconds, last_losses, best_val):
        """The end of the loop, on rank 0: a resume with nothing to do says the run is finished and how to
        extend it; a run that trained or evaluated gives its losses (the last eval's, None: none ran),
        iterations, time (seconds, evals included), checkpoint and the command that samples from it."""
        cfg, last_val = self.cfg, last_losses["val"] if last_losses else None
        out_dir = cfg["out_dir"]
        sample = f"python sample.py --out_dir={shlex.quote(out_dir)}"
        if iter_num == start_iter and not evals_run:
            if cfg["max_flops"] is not None or cfg["max_seconds"] is not None:
                budget = "max_flops" if cfg["max_flops"] is not None else "max_seconds"
                how = (f"Its budget ({budget}={cfg[budget]:g}) is spent and a resume keeps it: train a larger one "
                       f"in another --out_dir")
            else:
                more = 2 * max(iter_num, 1)
                how = (f"To train on, resume with a larger --max_iters (and --lr_decay_iters for the LR to decay "
                       f"over it), e.g. --max_iters={more} --lr_decay_iters={more}")
            print(f"the run in {out_dir} is finished: it is at iter {iter_num}, max_iters={cfg['max_iters']}, "
                  f"so there is nothing to train. {how}; --eval_only=True evaluates it; {sample} samples from it")
            return
        # the last "val loss" printed is the final eval's (bench.py's quickstart reads it)
        print(f"done: iter {iter_num}/{cfg['max_iters']}"
              + (f" (this process trained {iter_num - start_iter} from iter {start_iter})" if start_iter else "")
              + f" in {format_duration(seconds)} (evals included)"
              + (f"; val loss {last_val:.4f} at the end, best {best_val:.4f}" if last_val is not None else ""))
        if self.saved is None:
            print("no checkpoint written: iteration 0 (nothing trained) is not saved")
            return
        it, val = self.saved
        what = "the best model" if not cfg["always_save_checkpoint"] else "the last model"
        print(f"checkpoint: {self.ckpt_path} ({what}: iter {it}"
              + (f", val {val:.4f})" if val is not None else ")") + f"; sample from it: {sample}")


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
                f"{torch.__version__} (docs/testing.md's 'Tested torch versions' says which are known good)")

    def warn(self, iter_num):
        """At a log iteration (a sync point): the warning, if any, between rows of '!' on stderr."""
        warning = self.read(iter_num)
        if warning:
            print(f"{'!' * 100}\n{warning}\n{'!' * 100}", file=sys.stderr, flush=True)
