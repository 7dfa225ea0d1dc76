"""
Train a nanodepth GPT.

One process (GPU if there is one, else CPU):
    python train.py config/shakespeare_char_cpu.py --residual=prenorm
DDP, 8 GPUs on one node (gloo instead of NCCL when there is no GPU):
    torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2_owt.py
Resume the run in out_dir (what the command line does not set comes from its checkpoint; a larger
--max_iters trains on):
    python train.py --init_from=resume --out_dir=out-shakespeare-char-cpu
    python train.py --init_from=resume --out_dir=out-shakespeare-char-cpu --max_iters=4000 --lr_decay_iters=4000
Mixture-of-Depths (GPTConfig's keys mod, mod_rate, skip_target, ... are config keys too):
    python train.py config/shakespeare_char_cpu.py --residual=nag --mod=nag --mod_rate=0.25
    python train.py config/shakespeare_char_cpu.py --residual=sandwich --mod=skip_middle --mod_rate=0.25
A start from scratch moves an earlier run in out_dir into out_dir/run-<its start time>/. One run at a time
writes in an out_dir (out_dir/.lock); --eval_only=True evaluates the checkpoint of --init_from=resume.
Ctrl-C (SIGINT) or SIGTERM checkpoints at the next step boundary (an eval stops at its next batch) and
prints the resume command; a second one exits at once (under DDP the ranks agree on the step at log
iterations, so the stop may come up to log_interval steps later).
"""

import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import asdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from configurator import ConfigError, configure
from flops import counted_dense, mfu, train_flops_per_token
from guards import (Interrupted, RunKeeper, StopSignals, TrainingStopped, ZeroGradientCheck, check_bad_steps,
                    check_resume_changes, claim_out_dir, command_line, explicit_keys,
                    keep_best_checkpoint, key_sources, repair_torn_log, resolve_model_args, restore_rng,
                    resumed_config, rng_state, set_aside_previous_run, write_run_record)
from model import GPT, diagnose, executed_fraction
from plan import RunPlan
from run_config import (DEFAULTS, EVAL_SEED, HELP_FROM, check_same_dataset, cpu_computes_bf16, dataset_vocab, find_data,
                        format_duration, get_batch, keep_freed_memory, load_checkpoint, model_config, muon_settings,
                        pick_device, pick_threads, save_checkpoint, ThreadFollower)

POSITIVE_KEYS = ("batch_size", "gradient_accumulation_steps", "eval_interval", "log_interval", "eval_iters")
WANDB_NAMES = {"train_loss": "train/loss", "val_loss": "val/loss"}  # log.jsonl's names that wandb gets as nanoGPT's
EARLY_STEPS = 5  # a process's first timed progress line comes at most this many steps after its first step
EVAL_PROGRESS_S = 10.0  # an eval running longer prints its progress this often (seconds)
FINAL_EVAL = "final_eval.json"  # in out_dir: the run's final eval (final_eval), what flops.py reads as its val loss


# -----------------------------------------------------------------------------
# the run: the loop first, then what it calls

class Trainer:
    """One training run. __init__ sets it up (setup below): processes and device, the data and the model's
    configuration (from the checkpoint on resume), the run's plan (plan.py: iterations, LR), the model and
    optimizer, out_dir; every check comes before out_dir is touched, so a start that fails leaves it as it
    was. loop() trains. The rest: evals (evaluate, final_eval), checkpoints (save), a stop by signal
    (stop_if_signalled) and the progress line (after_step). The training step itself is train_step, below
    the class; what keeps a run from being lost, and what it says when it stops, is guards.py's."""

    def __init__(self, cfg, argv):
        self.cfg, self.argv = cfg, argv
        check_run_config(cfg)
        self.ddp, self.rank, self.world, self.device, self.autocast, self.threads, self.follower = start_processes(cfg)
        self.master = self.rank == 0
        ckpt = self.find_inputs()
        self.plan_run()
        # rank 0 holds out_dir (OutDirLock) from here until run() ends; a start that fails lets it go
        self.lock = claim_out_dir(cfg["out_dir"], command_line(argv, self.world)) if self.master else None
        try:
            self.build_model(ckpt)
            self.wandb_run = start_wandb(cfg) if cfg["wandb_log"] and self.master else None
            self.open_out_dir()
        except BaseException:
            if self.lock:
                self.lock.release()
            raise

    def loop(self):
        """The training loop: each iteration takes five steps, then iter_num moves on."""
        cfg, plan = self.cfg, self.plan
        self.start_clocks()
        batches = train_batches(self.paths["train"], cfg["batch_size"], cfg["block_size"], cfg["seed"],
                                self.iter_num, self.rank * self.accum, self.accum, self.device)
        # restored when the loop ends (normally, by a signal or by NaNs)
        self.stop = StopSignals(repeat_exits=not self.ddp, abort_message=self.keeper.abort_message).install()
        while True:
            # 1. the plan for this iteration: its LR (max_seconds first re-plans the run's length), nag's alpha
            if cfg["max_seconds"] is not None:
                plan.at_step(self.iter_num, *self.clock.pace(self.iter_num))
            lr = plan.lr(self.iter_num)
            set_lr(self.optimizer, lr)
            if cfg["nag_alpha_warmup_tokens"]:  # on the device, no host read; evals see it too, as in the reference
                self.raw_model.set_warmup(plan.alpha_scale(self.iter_num))
            # 2. at an eval iteration, an eval, logged and checkpointed; at the run's end, the final eval. A
            # resume does not repeat the eval its checkpoint was saved at, unless a stop broke that one off
            is_eval = self.iter_num % cfg["eval_interval"] == 0 or self.iter_num == cfg["max_iters"]
            evaluating = cfg["eval_only"] or self.eval_due or (
                is_eval and (self.iter_num != self.clock.start_iter or self.clock.start_iter == 0))
            if evaluating:
                self.evaluate(lr)
            final = self.iter_num >= cfg["max_iters"] and cfg["final_eval_tokens"] > 0 and not cfg["eval_only"]
            if final and self.master and final_eval_due(self.cfg, self.iter_num):
                self.final_eval()
            # 3. a stop signal (one during an eval too) checkpoints and exits here; so does the run's end
            self.stop_if_signalled(at_eval=evaluating or final)
            if self.iter_num >= cfg["max_iters"] or cfg["eval_only"]:
                break
            # 4. one optimizer step: forward and backward over accum micro-batches, clip, step
            if self.grad_check:
                self.grad_check.arm(self.iter_num, cfg["log_interval"])
            t_step = time.time()
            loss = train_step(self.model, self.raw_model, self.optimizer, self.scaler, batches, self.stats,
                              accum=self.accum, autocast=self.autocast, grad_clip=cfg["grad_clip"])
            # 5. at a log iteration, the progress line
            self.after_step(loss, t_step)
            self.iter_num += 1
        self.stop.restore()
        if self.master and not cfg["eval_only"]:
            self.keeper.summary(self.iter_num, self.clock.start_iter, self.clock.evals_run,
                                time.time() - self.clock.t_loop, self.last_losses, self.best_val_loss)
        self.leave_processes()  # after rank 0's last eval and checkpoint

    def run(self):
        """Train (loop); returns the best val loss. However the loop ends (max_iters, a signal, bad steps,
        an error), the wandb run is finished, with the exit code the process gets, and its data is on disk
        before run returns or raises; then out_dir's lock is released."""
        exit_code = 1
        try:
            self.loop()
            exit_code = 0
        except Interrupted as e:
            exit_code = 128 + e.signum  # the exit code cli gives the process
            raise
        finally:
            if self.wandb_run:
                finish_wandb(self.wandb_run, exit_code)
            if self.lock:
                self.lock.release()  # the last write is done: another run may take out_dir
        return self.best_val_loss

    # --- setup

    def find_inputs(self):
        """On resume the checkpoint first: what argv does not set comes from it (resumed_config: the dataset
        too), its architecture wins (resolve_model_args). Then the data, and the model's configuration,
        checked. Returns the checkpoint (None from scratch)."""
        cfg = self.cfg
        self.keeper = RunKeeper(cfg, self.argv, self.world)  # ckpt.pt's path; saved: set by restore and save
        self.ckpt_path, self.log_path = self.keeper.ckpt_path, os.path.join(cfg["out_dir"], "log.jsonl")
        ckpt, self.ckpt_cfg = None, None
        if cfg["init_from"] == "resume":
            ckpt = load_checkpoint(self.ckpt_path, self.device)
            self.explicit, self.ckpt_cfg = explicit_keys(self.argv), ckpt["config"]
            cfg.update(resumed_config(cfg, self.ckpt_cfg, self.explicit))
            cfg.update(resolve_model_args(cfg, ckpt["model_args"], self.explicit))
        self.paths, self.vocab_size = find_data(cfg, self.master)
        self.vocab = dataset_vocab(os.path.join(cfg["data_dir"], cfg["dataset"]))  # the checkpoint carries it
        if ckpt is not None:
            check_same_dataset(ckpt, cfg, self.vocab_size, "use the dataset it was trained on (prepared from the "
                                                           "run's text), or start with --init_from=scratch")
        check_block_fits(cfg, self.paths)
        self.gptconf = model_config(cfg, self.vocab_size)
        check_nag_recipe(cfg)  # after the model keys: on resume, residual comes from the checkpoint
        # the configuration is complete (on resume with the checkpoint's): the micro-steps per rank, the seed
        if cfg["gradient_accumulation_steps"] % self.world != 0:
            raise ConfigError(f"gradient_accumulation_steps ({cfg['gradient_accumulation_steps']}) must be "
                              f"divisible by the number of processes ({self.world})")
        self.accum = cfg["gradient_accumulation_steps"] // self.world  # micro-steps per rank
        torch.manual_seed(cfg["seed"] + self.rank)  # dropout differs per rank; data order is set per batch
        return ckpt

    def plan_run(self):
        """The run's plan (plan.py): max_iters and the LR schedule, from a budget when there is one; on
        resume, the changes argv makes to the checkpoint's run, checked."""
        cfg = self.cfg
        self.micro_tokens = cfg["batch_size"] * cfg["block_size"]  # per rank and micro-step (block_size: resumed)
        self.tokens_per_iter = self.accum * self.world * self.micro_tokens
        self.flops_per_token = train_flops_per_token(self.gptconf)  # MoD at its capacity (counted_dense: dense)
        dense = (" (MoD without a fixed capacity: counted dense, an upper bound; log.jsonl has the realised FLOPs)"
                 if counted_dense(self.gptconf) else "")
        self.plan = RunPlan(cfg, self.tokens_per_iter, self.flops_per_token, self.ckpt_cfg, self.ddp, dense,
                            verbose=self.master)
        self.changes = []  # on resume: the run settings this process changes (printed by restore)
        if self.ckpt_cfg is not None:  # planned from the same inputs as the checkpoint's run: only argv differs
            sources = {k: v for k, v in key_sources(self.argv).items() if k in self.explicit}
            self.changes = check_resume_changes(cfg, self.ckpt_cfg, sources)
        self.gpu_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None  # MFU

    def build_model(self, ckpt):
        """The model, its optimizer (AdamW, or Muon + AdamW) and the fp16 grad scaler, restored from ckpt when
        resuming; then compiled and wrapped in DDP as configured. Prints the start-up line."""
        cfg, device = self.cfg, self.device
        self.raw_model = GPT(self.gptconf).to(device)
        self.optimizer = self.raw_model.configure_optimizers(cfg["weight_decay"], cfg["learning_rate"],
                                                             (cfg["beta1"], cfg["beta2"]), cfg["nag_gate_lr_scale"],
                                                             cfg["nag_gate_decay"], muon_settings(cfg))
        self.scaler = torch.amp.GradScaler(device.type, enabled=cfg["dtype"] == "float16")
        self.iter_num, self.best_val_loss, self.flops_base, self.seconds = 0, float("inf"), 0.0, 0.0
        self.eval_due = False  # the eval of iter_num was broken off by a stop: the resume runs it first
        self.last_losses = None  # the last eval's losses
        if ckpt is not None:
            self.restore(ckpt)
        self.model = self.raw_model
        if cfg["compile"]:
            if self.master:
                print("compiling the model...")
            self.model = torch.compile(self.model)
        self.grad_check = ZeroGradientCheck(self.raw_model, self.optimizer, self.iter_num) if cfg["compile"] else None
        self.eval_model = self.model  # evals run the module that trains (compiled or not), in eval mode, without DDP
        if self.ddp:
            self.model = wrap_ddp(self.model, device, self.raw_model.unused_parameters)
        if self.master:
            print_start(self.raw_model, self.optimizer, cfg, self.world, self.accum, self.tokens_per_iter, self.threads)

    def restore(self, ckpt):
        """Resume: the weights, the optimizer (as it was saved), the grad scaler, the run so far (iteration,
        best val loss, realised training FLOPs, training seconds: max_seconds goes on from them) and this
        rank's RNG."""
        self.raw_model.load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.scaler.load_state_dict(ckpt["scaler"])
        self.iter_num, self.best_val_loss = ckpt["iter_num"], ckpt["best_val_loss"]
        self.flops_base, self.seconds = ckpt["flops"], ckpt["seconds"]
        self.eval_due = ckpt.get("eval_due", False)  # a stop broke off the eval of iter_num: it runs first
        self.keeper.saved = (self.iter_num, None)
        restore_rng(ckpt["rng"], self.rank, self.world, self.device)
        if self.master:
            print(f"resuming from {self.ckpt_path} at iter {self.iter_num} (best val loss {self.best_val_loss:.4f})")
            if self.changes:
                print("this resume changes the run: " + ", ".join(
                    f"{k} {old!r} -> {new!r} ({where or 'planned'})" for k, old, new, where in self.changes))
                if self.iter_num < self.cfg["max_iters"]:
                    print(self.plan.describe(self.iter_num, self.changes))

    def open_out_dir(self):
        """After every check (a failed start leaves out_dir as it was): from scratch, the files of an
        earlier run in out_dir are moved, whole, into a folder of their own (never overwritten), and this
        run's config.json is written."""
        if self.cfg["init_from"] == "scratch" and self.master:
            set_aside_previous_run(self.cfg["out_dir"])
            write_run_record(self.cfg["out_dir"], self.cfg, self.argv, self.world)
        elif self.master:  # a resume appends to the log: not onto a line cut mid-write
            repair_torn_log(self.log_path)

    def start_clocks(self):
        """The loop's clock and step statistics, from this process's first iteration."""
        self.clock = Clock(self.seconds, self.iter_num)
        self.stats = StepStats(self.gptconf, self.micro_tokens, self.device)  # bad steps, MoD: read at log/eval
        self.flops_last = self.flops_base  # the run's training FLOPs at the last eval
        self.flops_mark = 0.0  # stats.flops (this rank's) at the last sync point: the progress line's MFU

    # --- evaluation and log.jsonl

    def evaluate(self, lr):
        """An eval iteration (rank 0 evaluates; every rank joins the collectives): the losses and what
        the run did since the last eval go to log.jsonl, and the checkpoint is saved. An eval that a stop
        signal breaks off (estimate_loss) logs and saves nothing: eval_due, the stop's checkpoint has it
        run first on resume."""
        cfg, clock = self.cfg, self.clock
        self.read_stats(self.iter_num - 1)  # waits for the steps still queued on the GPU: their time is training
        clock.before_eval()
        rngs, flops = self.all_rng_states(), self.flops_so_far()
        self.eval_due = False  # on every rank (the loop's choice to evaluate must be theirs too)
        if self.master:
            t_eval = time.time()
            losses = self.estimate_loss()
            self.eval_due = losses is None
            if losses is None:
                print(f"eval at iter {self.iter_num}: stopped by {signal.Signals(self.stop.signum).name}; "
                      f"a resume runs it first", flush=True)
            else:
                record = self.eval_record(losses, lr, flops)
                print(f"step {self.iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
                self.last_losses = losses
                improved = losses["val"] < self.best_val_loss
                self.best_val_loss = min(self.best_val_loss, losses["val"])
                if self.iter_num > 0 and not cfg["eval_only"] and (improved or cfg["always_save_checkpoint"]):
                    self.save(rngs, flops, clock.seconds, losses["val"])  # eval_only: the checkpoint it read stays
                self.log_eval(record)  # after the save: a failed save leaves no eval the resume will not have
                clock.eval_timed(time.time() - t_eval)
        clock.after_eval()
        self.flops_last, self.stats.exec_sum, self.stats.exec_n = flops, None, 0
        self.flops_mark = self.stats.flops

    def estimate_loss(self):
        """The eval's losses per split (estimate_loss below); None when a stop signal broke it off."""
        stop = getattr(self, "stop", None)
        return estimate_loss(self.eval_model, self.paths, self.cfg, self.device, self.autocast,
                             lambda: stop is not None and stop.signum, self.eval_progress)

    def eval_progress(self, done, n, spent, counts):
        """A long eval's progress line (rank 0): done of its n batches, counts says which; the first one on
        the CPU that shows a slow eval warns."""
        left = spent / done * (n - done)
        print(f"eval at iter {self.iter_num}: {counts} in {format_duration(spent)}, "
              f"about {format_duration(left)} left (Ctrl-C stops it)", flush=True)
        if self.device.type == "cpu":
            self.keeper.warn_slow_eval(spent + left, n)

    def eval_record(self, losses, lr, flops):
        """log.jsonl's record of this eval: losses, speed and MFU since the last eval, the run's FLOPs,
        MoD executed fractions, and the diagnostics (--diagnose)."""
        cfg, n = self.cfg, self.clock.iters_since
        ms = 1000 * self.clock.train_time / max(n, 1)
        record = {"iter": self.iter_num, "tokens": self.iter_num * self.tokens_per_iter,
                  "train_loss": round(losses["train"], 6), "val_loss": round(losses["val"], 6),
                  "lr": lr, "ms_per_iter": round(ms, 2),
                  "tokens_per_s": round(self.tokens_per_iter / (ms / 1000), 1) if n else None, "flops": flops}
        # MFU from the FLOPs these iterations really did (MoD: their executed fractions)
        recent = (flops - self.flops_last) / (n * self.tokens_per_iter) if n else self.flops_per_token
        record["mfu"] = mfu(recent, record["tokens_per_s"], self.gpu_name, self.world)
        if self.gptconf.mod != "none":
            record.update(executed_fractions(self.stats, losses["executed"], self.iter_num))
        if cfg["diagnose"]:
            X, _ = get_batch(self.paths["val"], cfg["batch_size"], cfg["block_size"],
                             torch.Generator().manual_seed(EVAL_SEED), self.device)
            with self.autocast:
                record["diagnostics"] = diagnose(self.raw_model, X)
        record["residual"] = cfg["residual"]  # plot.py's labels and tables
        return record

    def log_eval(self, record):
        """An eval's record: a line of log.jsonl and, with wandb_log, to wandb."""
        with open(self.log_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb_run:  # the record's numbers (lists, None and the diagnostics stay in log.jsonl)
            self.wandb_run.log({WANDB_NAMES.get(k, k): v for k, v in record.items()
                                if isinstance(v, (int, float))}, step=self.iter_num)

    def final_eval(self):
        """The run's last eval (final_eval below), into out_dir's FINAL_EVAL; a stop signal breaks it off
        (checked between batches): the resume runs it."""
        done = final_eval(self.eval_model, self.paths["val"], self.cfg, self.device, self.autocast, self.iter_num,
                          os.path.join(self.cfg["out_dir"], FINAL_EVAL), lambda: self.stop.signum, self.eval_progress)
        if not done:
            print(f"final eval at iter {self.iter_num}: stopped by {signal.Signals(self.stop.signum).name}; "
                  "a resume runs it", flush=True)

    # --- checkpoints, the device's counters, the process group

    def save(self, rngs, flops, seconds, val_loss=None):
        """ckpt.pt, atomically (a temp file renamed over it); eval_due: the eval of iter_num is still to run.
        A save broken off (a second signal) removes its temp file: ckpt.pt stays as it was, and the process
        exits as a second signal does (StopSignals.abort), whatever torch.save raised on the way out."""
        try:
            save_checkpoint({
                "model": self.raw_model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scaler": self.scaler.state_dict(), "model_args": asdict(self.gptconf),
                "iter_num": self.iter_num, "best_val_loss": self.best_val_loss, "config": self.cfg, "rng": rngs,
                "flops": flops, "seconds": seconds, "eval_due": self.eval_due, "vocab": self.vocab,
            }, self.ckpt_path)
        except BaseException as e:  # the temp file goes; a second signal, a full disk: one line (guards.py)
            stopped = self.keeper.save_broken_off(e, self.iter_num, getattr(self, "stop", None))
            if stopped is e:
                raise
            raise stopped from None
        self.keeper.saved = (self.iter_num, val_loss)
        print(f"saved checkpoint to {self.ckpt_path}")

    def all_rng_states(self):
        """Every rank's RNG state (a collective under DDP), so that resume restores each one."""
        return gather_objects(rng_state(self.device), self.ddp, self.world)

    def flops_so_far(self):
        """Training FLOPs of the run so far, counted from each micro-step's realised executed fractions
        (a collective under DDP: the sum over ranks). After read_stats()."""
        return self.flops_base + sum_over_ranks(self.stats.flops, self.ddp, self.device)

    def read_stats(self, last_iter):
        """A sync point (log and eval iterations, a checkpoint): read what the steps up to iteration
        last_iter counted on the device; too many bad steps in a row stop the run (on every DDP rank at
        once: their steps skip together), before any checkpoint is written."""
        stopped = check_bad_steps(self.stats.read(), last_iter, self.cfg["max_bad_steps"], self.ckpt_path,
                                  self.master)
        if stopped:
            self.stop.restore()
            self.leave_processes(barrier=False)
            raise stopped

    def leave_processes(self, barrier=True):
        """DDP: leave the process group (leave_process_group), the DDP wrapper let go of first."""
        if self.ddp:
            self.model = self.eval_model  # the module DDP wrapped: DDP and its reducer go
            leave_process_group(barrier)

    # --- a stop by signal, the progress line

    def stop_if_signalled(self, at_eval=False):
        """At a step boundary the state is exactly "before iteration iter_num", so a checkpoint now
        resumes bit-for-bit (data and LR depend only on iter_num); an eval that the signal broke off is
        marked due in it (eval_due). Under DDP every rank must stop at the same iteration: they agree on
        it (a tiny all_reduce, read on the host) at log iterations and after an eval (at_eval: rank 0 may
        have broken it off). eval_only writes nothing: the checkpoint it read stays as it was."""
        cfg, signum = self.cfg, self.stop.signum
        if self.ddp:
            if at_eval or self.iter_num % cfg["log_interval"] == 0:
                flag = torch.tensor([signum], device=self.device)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                signum = int(flag.item())
            else:
                signum = 0
        if not signum:
            return
        self.read_stats(self.iter_num - 1)
        rngs, flops = self.all_rng_states(), self.flops_so_far()
        if self.master and not cfg["eval_only"]:
            if not cfg["always_save_checkpoint"]:  # the interrupt checkpoint is the resume point: ckpt.pt
                keep_best_checkpoint(self.ckpt_path, cfg["out_dir"])
            self.save(rngs, flops, self.clock.trained())
        self.stop.restore()  # a repeated signal now ends the process as it would without train.py's handler
        self.leave_processes()
        message = self.keeper.interrupted(signum, self.iter_num, self.eval_due) if self.master else ""
        raise Interrupted(message, signum)

    def after_step(self, loss, t_step):
        """Timing: the process's first step is timed alone (its warm-up, kernels compiling or with
        compile=True the compilation, is not training time); at log iterations (a sync point: counters
        and the loss come to the host) the progress line."""
        cfg, clock = self.cfg, self.clock
        if clock.first_step:
            self.read_stats(self.iter_num)  # waits for the step
            self.flops_last = self.flops_so_far()  # log.jsonl's MFU leaves it out too (a collective under DDP)
            clock.warmed_up()
            self.flops_mark = self.stats.flops
            if self.master and cfg["compile"]:
                print(f"first step {clock.t_last - t_step:.1f}s (compilation): kept out of ms/iter, tok/s and the ETA")
        else:
            clock.stepped()
        self.follower.check(say=self.master)  # a CPU's threads follow the free cores (run_config.ThreadFollower)
        # the progress line at log iterations; and, until a line has shown the pace, EARLY_STEPS steps into
        # the process or at its last iteration, so that a run shorter than log_interval shows it too
        early = not clock.pace_shown and clock.log_iters and (self.iter_num - clock.start_iter >= EARLY_STEPS
                                                              or self.iter_num == cfg["max_iters"] - 1)
        if self.iter_num % cfg["log_interval"] != 0 and not early:
            return
        self.read_stats(self.iter_num)
        iters = clock.log_iters
        dt = clock.lap()  # the mean seconds per iteration since the last sync point
        # MFU from the FLOPs these iterations really did (MoD: their executed fractions)
        utilisation = (mfu((self.stats.flops - self.flops_mark) / (iters * self.accum * self.micro_tokens),
                           self.tokens_per_iter / dt, self.gpu_name, self.world) if dt else None)
        self.flops_mark = self.stats.flops
        if self.master:
            eta = clock.eta(dt, self.plan, self.iter_num, self.accum)
            print(log_line(self.iter_num, cfg["max_iters"], loss.item() * self.accum, dt, self.tokens_per_iter,
                           utilisation, self.plan.lr(self.iter_num), eta))
            if self.grad_check:
                self.grad_check.warn(self.iter_num)
            if dt and self.device.type == "cpu" and not self.keeper.warned_slow_run:
                eval_s = clock.eval_s if clock.eval_s is not None else clock.first_eval_s
                self.keeper.warn_slow_run(clock.eta(dt, self.plan, self.iter_num, self.accum, eval_s), dt, eval_s)


# -----------------------------------------------------------------------------
# the clock: training time, the pace, the ETA

class Clock:
    """The run's training seconds (the process's first step, its warm-up, and the evals are not training),
    the pace since the last sync point (a log or eval iteration: the progress line's ms/iter), and the ETA."""

    def __init__(self, seconds, iter_num):
        self.seconds = seconds  # training seconds of the run (earlier processes' too) up to t_last
        self.start_iter, self.start_seconds = iter_num, seconds  # max_seconds: the pace is this process's
        self.train_time, self.iters_since = 0.0, 0  # training time and iterations since the last eval
        self.t_last, self.log_iters = time.time(), 0  # the last sync point and the iterations since
        # the last eval's time (and its checkpoint's), for the ETA's evals to come; None until an eval after the
        # process's first (which warms up) is timed; the first's, for the slow-run warning
        self.eval_s, self.first_eval_s, self.evals_run = None, None, 0
        self.t_loop = time.time()  # the summary's time
        self.first_step = True  # the first step warms up (compiles): timed alone, outside ms/iter and tok/s
        self.pace_shown = False  # whether a progress line has shown ms/iter yet

    def trained(self):
        """Training seconds of the run up to now: to the last sync point, then the time since."""
        return self.seconds + time.time() - self.t_last

    def pace(self, iter_num):
        """For max_seconds, before iteration iter_num: (training seconds so far, this process's timed steps,
        their seconds); the process's first step, its warm-up, is not timed."""
        spent = self.trained()
        return spent, iter_num - self.start_iter - 1, spent - self.start_seconds

    def warmed_up(self):
        """After the process's first step: training time starts now."""
        self.first_step = False
        self.t_last = time.time()

    def stepped(self):
        self.iters_since += 1
        self.log_iters += 1

    def lap(self):
        """A log iteration: the mean seconds per iteration since the last sync point (None: none timed)."""
        t_now = time.time()
        dt = (t_now - self.t_last) / self.log_iters if self.log_iters else None
        self.train_time, self.seconds = self.train_time + t_now - self.t_last, self.seconds + t_now - self.t_last
        self.t_last, self.log_iters = t_now, 0
        self.pace_shown = self.pace_shown or dt is not None
        return dt

    def before_eval(self):
        """The steps since the last sync point are training time (their GPU work waited for: read_stats)."""
        dt = time.time() - self.t_last if self.iters_since else 0.0
        self.train_time, self.seconds = self.train_time + dt, self.seconds + dt

    def eval_timed(self, seconds):
        """Rank 0's eval took seconds (the process's first also warms the eval path up: no measure of the next)."""
        if self.evals_run:
            self.eval_s = seconds
        else:
            self.first_eval_s = seconds
        self.evals_run += 1

    def after_eval(self):
        self.train_time, self.iters_since = 0.0, 0
        self.t_last, self.log_iters = time.time(), 0

    def eta(self, dt, plan, iter_num, accum, eval_s=None):
        """Seconds left after iteration iter_num at dt seconds per iteration (None: no step timed yet). The
        evals left take eval_s each, by default as long as the last one; until one is timed, as long as a
        third of 2 x eval_iters training micro-steps (an eval's forward passes; a micro-step is about 3 of them)."""
        if not dt:
            return None
        cfg = plan.cfg
        if eval_s is None:
            eval_s = self.eval_s if self.eval_s is not None else dt / accum * 2 * cfg["eval_iters"] / 3
        return (cfg["max_iters"] - iter_num - 1) * dt + plan.evals_left(iter_num) * eval_s


# -----------------------------------------------------------------------------
# the training step: nothing in it reads a value back to the host (that would wait for the GPU)

class StepStats:
    """What the training steps count for the host, on the device until read() (a sync) at a log or eval
    iteration. Bad steps (non-finite loss or gradients, skipped): how many in a row now, the longest run
    and how many since the last read. MoD: each micro-step's executed tokens per sublayer (Python ints,
    or 0-d tensors where the routing decided on the device), turned at read() into the run's FLOPs and
    the mean executed fractions with the same Python float arithmetic as a per-micro-step float()."""

    def __init__(self, config, micro_tokens, device):
        self.config, self.micro_tokens = config, micro_tokens
        self.bad = torch.zeros(3, dtype=torch.int64, device=device)  # in a row, longest run, count
        self.executed = []  # since the last read, per micro-step: (tokens run per sublayer, tokens)
        self.flops = 0.0  # this rank's training FLOPs since the process started
        self.exec_sum, self.exec_n = None, 0  # executed fractions per sublayer, summed over micro-steps

    def micro_step(self, executed, tokens):
        counts = [e for e in executed if torch.is_tensor(e)]
        if counts:  # one float64 row on the device; the counts are integers, exact in float64
            executed = torch.stack([e.to(torch.float64) if torch.is_tensor(e) else
                                    torch.full((), e, dtype=torch.float64, device=counts[0].device) for e in executed])
        self.executed.append((executed, tokens))

    def step(self, found_inf):
        bad = found_inf.to(torch.int64)
        in_a_row = (self.bad[0] + 1) * bad
        self.bad = torch.stack([in_a_row, torch.maximum(self.bad[1], in_a_row), self.bad[2] + bad])

    def read(self):
        """Returns (bad steps in a row, the longest run, bad steps) since the last read; adds up FLOPs."""
        rows = [e for e, _ in self.executed if torch.is_tensor(e)]
        rows = iter(torch.stack(rows).tolist() if rows else [])
        for executed, tokens in self.executed:
            frac = executed_fraction(next(rows) if torch.is_tensor(executed) else executed, tokens)
            self.flops += train_flops_per_token(self.config, frac) * self.micro_tokens
            self.exec_sum = frac if self.exec_sum is None else [a + b for a, b in zip(self.exec_sum, frac)]
            self.exec_n += 1
        self.executed = []
        in_a_row, longest, count = self.bad.tolist()
        self.bad = torch.stack([self.bad[0], self.bad[0], torch.zeros_like(self.bad[0])])
        return in_a_row, longest, count


def train_step(model, raw_model, optimizer, scaler, batches, stats, accum, autocast, grad_clip):
    """One optimizer step over `accum` micro-batches from `batches`; returns the last micro-step's loss
    (a device tensor, divided by accum). A non-finite gradient norm (a NaN/inf loss too: its gradients
    are NaN) skips the step on the device: fused AdamW (configure_optimizers builds it on every device),
    given found_inf (the flag GradScaler hands it), leaves parameters, moments and step counts exactly as
    they were (so does optim.py's Muon, under --optimizer=muon), and the model's after_step keeps a mode's own state (skip_middle's controller: lam, mu).
    Gradients are all-reduced before the norm, so every DDP rank skips the same steps.
    stats counts a skipped step as bad, except with fp16 (the grad scaler on): there a finite loss
    whose scaled gradients overflowed is the scaler's normal business (update() lowers the scale; not
    counted, not printed), and only a non-finite loss in any micro-step (on any DDP rank: one tiny
    all_reduce per step, on the device) is a bad step."""
    ddp = isinstance(model, DDP)
    loss_bad = None  # fp16: whether any micro-step's loss was non-finite (a 0-d device tensor)
    for micro in range(accum):
        X, Y = next(batches)
        sync = contextlib.nullcontext() if (not ddp or micro == accum - 1) else model.no_sync()
        with sync:
            with autocast:
                _, loss, executed = model(X, Y, executed=True)
                loss = loss / accum
            scaler.scale(loss).backward()
        if scaler.is_enabled():
            flag = (~torch.isfinite(loss.detach())).float()
            loss_bad = flag if loss_bad is None else torch.maximum(loss_bad, flag)
        stats.micro_step(executed, X.numel())
    scaler.unscale_(optimizer)  # a no-op without fp16; the norm below must be of the true gradients
    params = [p for p in model.parameters() if p.grad is not None]
    # foreach: one op over all the gradients, on a CPU too (torch picks it by itself on a GPU only); the same sums
    if grad_clip > 0:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip, foreach=True)
    else:
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
    found_inf = (~torch.isfinite(grad_norm)).float()
    optimizer.found_inf = found_inf  # read by fused AdamW's step (and optim.py's Muon)
    optimizer.step()
    del optimizer.found_inf
    raw_model.after_step(found_inf)  # a mode's own update (DDP: its statistics pooled over the ranks inside)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if loss_bad is not None and ddp:
        dist.all_reduce(loss_bad, op=dist.ReduceOp.MAX)  # every rank counts the same bad steps
    stats.step(found_inf if loss_bad is None else loss_bad)
    return loss.detach()


# -----------------------------------------------------------------------------
# batches, the LR into the optimizer, DDP

def batch_generator(seed, iter_num, micro):
    """The training batch of (iteration, global micro-step) depends on nothing else, so a resumed run,
    or a DDP run with the same global gradient accumulation, sees exactly the same data."""
    return torch.Generator().manual_seed((seed * 1_000_003 + iter_num) * 1_009 + micro)


def train_batches(path, batch_size, block_size, seed, iter_num, first_micro, accum, device):
    """This rank's training micro-batches from iteration iter_num on, in order, drawn one ahead: batch
    i + 1 is loaded (on CUDA: its copy from pinned memory queued, non_blocking) before batch i is handed
    out, so loading overlaps the GPU work of the step. Micro-step m of a rank is global micro-step
    first_micro + m: the batches are batch_generator's, whatever the prefetch."""
    def load(it, micro):
        return get_batch(path, batch_size, block_size, batch_generator(seed, it, first_micro + micro), device)
    ahead = load(iter_num, 0)
    while True:
        for micro in range(accum):
            batch, ahead = ahead, load(*((iter_num, micro + 1) if micro + 1 < accum else (iter_num + 1, 0)))
            yield batch
        iter_num += 1


def set_lr(optimizer, lr):
    """The scheduled LR into every parameter group, times the group's lr_scale (nag_gate_lr_scale's group)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


# -----------------------------------------------------------------------------
# processes: DDP from torchrun's environment

def start_processes(cfg):
    """DDP from torchrun's environment, the device and precision, a CPU's threads: (ddp, rank, world, device,
    autocast, what the start-up line says of the threads, their ThreadFollower); cfg gets the device and
    dtype picked. A CPU run's allocator keeps the memory its steps free (keep_freed_memory)."""
    ddp = int(os.environ.get("RANK", -1)) != -1
    rank, world = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if ddp else (0, 1)
    device, cfg["dtype"], autocast = pick_device(cfg["device"], cfg["dtype"], cpu_bf16=True)
    threads = pick_threads(cfg["threads"], device)
    if ddp:
        if device.type == "cuda":
            device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}")
            torch.cuda.set_device(device)
        # before the group exists: this module's functions take group=group.WORLD as a default argument,
        # evaluated at import, and imported later (DDP imports torch._dynamo, which imports it) they would
        # hold the group for good, so that leave_process_group could not shut it down
        from torch.distributed.nn import functional  # noqa: F401
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    cfg["device"] = str(device)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    keep_freed_memory(device)
    return ddp, rank, world, device, autocast, threads, ThreadFollower(cfg["threads"], device)


def print_start(model, optimizer, cfg, world, accum, tokens_per_iter, threads=""):
    """The start-up line: the model, the device (on a CPU, the threads: pick_threads), the batch; the optimizer
    under Muon; fp16 on a CPU warned."""
    print(f"{model.describe()}, {model.get_num_params() / 1e6:.2f}M non-embedding params | "
          f"{cfg['device']} {cfg['dtype']}{', ' + threads if threads else ''} | "
          f"{world} process(es) x {accum} micro-steps x "
          f"{cfg['batch_size']} x {cfg['block_size']} = {tokens_per_iter:,} tokens/iter")
    if cfg["optimizer"] == "muon":
        n = sum(p.numel() for p in optimizer.muon.param_groups[0]["params"])
        print(f"optimizer: Muon (LR {cfg['muon_lr']:g}) on {n / 1e6:.2f}M params of hidden matrices, "
              f"AdamW (LR {cfg['learning_rate']:g}) on the rest")
    if cfg["device"] == "cpu" and cfg["dtype"] == "float16":
        print("WARNING: float16 on the CPU is slower than float32, by a factor that depends on the CPU (the "
              "quickstart's steps: 1.2x to 1.7x on one, 11x on one without float16 instructions); use "
              "--dtype=auto (bfloat16 on a CPU that computes it natively, float32 elsewhere)", file=sys.stderr, flush=True)
    if cfg["device"] == "cpu" and cfg["dtype"] == "bfloat16" and not cpu_computes_bf16():
        print("WARNING: this CPU has no bfloat16 instructions (AVX512-BF16): its bfloat16 matmuls are emulated, "
              "slower than float32; use --dtype=auto (float32 here)", file=sys.stderr, flush=True)


def wrap_ddp(model, device, unused_parameters):
    """DDP. Rope tables are buffers: no need to broadcast them, and evals run on rank 0 alone.
    unused_parameters (GPT.unused_parameters): a step may leave some parameters without a gradient on
    a rank (skip_middle, a middle block off for every token of the rank's batch), which DDP must be
    told to expect."""
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False,
               find_unused_parameters=unused_parameters)


def gather_objects(obj, ddp, world):
    """[obj of each rank] (a collective under DDP)."""
    if not ddp:
        return [obj]
    gathered = [None] * world
    dist.all_gather_object(gathered, obj)
    return gathered


def sum_over_ranks(value, ddp, device):
    """value summed over the ranks (a collective under DDP), in float64."""
    if not ddp:
        return value
    total = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return total.item()


def leave_process_group(barrier=True):
    """Leave the process group, after a barrier where every rank gets there (a rank that leaves while rank
    0 still evaluates or checkpoints can abort gloo's teardown), and shut it down here, once the caller has
    let go of the DDP wrapper. destroy_process_group only unregisters the group: while anything else holds
    it (the DDP wrapper's reducer does) it lives on, its gloo worker threads too, past the interpreter's
    end. A worker hands a collective's result back before it lets go of the work; descheduled there on a
    loaded machine until the interpreter finalizes, it then drops the last reference to a tensor that
    Python let go of, which takes the GIL: a thread that waits for the GIL while the interpreter finalizes
    is ended with pthread_exit, and the process aborts ("terminate called without an active exception").
    With the wrapper gone (and torch.distributed.nn.functional imported before the group: start_processes)
    destroy_process_group drops the last reference: the group is destroyed here, with the GIL released,
    and its threads finish what they hold and are joined."""
    if barrier:
        dist.barrier()
    dist.destroy_process_group()


# -----------------------------------------------------------------------------
# evals: the losses of each eval iteration, and the run's final eval

def executed_fractions(stats, eval_fraction, iter_num):
    """MoD's executed fraction per sublayer, log.jsonl's exec_train and exec_eval (None: none yet), their
    means printed: the mean over the training micro-steps since the last eval, and eval routing
    (thresholds tau) on the last val batch (estimate_loss's "executed")."""
    fracs = {"train": [x / stats.exec_n for x in stats.exec_sum] if stats.exec_n else None, "eval": eval_fraction}
    print(f"step {iter_num}: executed fraction (mean over sublayers) " + ", ".join(
        f"{k} {sum(frac) / len(frac):.3f}" for k, frac in fracs.items() if frac is not None))
    return {f"exec_{k}": None if frac is None else [round(x, 4) for x in frac] for k, frac in fracs.items()}


def eval_loop(model, n, batch, use, autocast, stopped, progress, counts):
    """What estimate_loss and final_eval share: n batches (X, Y) = batch(k) through the model in eval mode (no
    dropout: an eval depends on the weights alone, not on the RNG; the mode is restored after), under autocast.
    Returns [use(X, Y, logits, loss, executed) for each batch], or None when stopped() (a stop signal, checked
    between batches) broke it off: an eval (an hour for a GPU-sized model on a CPU) never holds a stop up by
    more than a batch. An eval running longer than EVAL_PROGRESS_S calls progress(done, n, seconds,
    counts(done)) that often."""
    t_start = t_shown = time.time()
    training = model.training
    model.eval()
    out = []
    try:
        for k in range(n):
            if stopped():
                return None
            X, Y = batch(k)
            with autocast:
                logits, loss, executed = model(X, Y, executed=True)
            out.append(use(X, Y, logits, loss, executed))
            now = time.time()
            if now - t_shown >= EVAL_PROGRESS_S and k + 1 < n:
                t_shown = now
                progress(k + 1, n, now - t_start, counts(k + 1))
    finally:
        model.train(training)
    return out


@torch.no_grad()
def estimate_loss(model, paths, cfg, device, autocast, stopped, progress):
    """Mean loss on eval_iters fixed batches (seed EVAL_SEED) of each split, and "executed": the executed
    fraction per sublayer of the last val batch (None without batches); None when stopped() broke it off
    (eval_loop)."""
    iters, g = cfg["eval_iters"], {}

    def batch(k):
        split = "train" if k < iters else "val"
        if k % iters == 0:
            g[split] = torch.Generator().manual_seed(EVAL_SEED)
        return get_batch(paths[split], cfg["batch_size"], cfg["block_size"], g[split], device)

    def counts(done):
        return f"train {min(done, iters)}/{iters}, val {max(done - iters, 0)}/{iters} batches"

    runs = eval_loop(model, 2 * iters, batch, lambda X, Y, logits, loss, executed: (loss.item(), executed, X.numel()),
                     autocast, stopped, progress, counts)
    if runs is None:
        return None
    out = {split: torch.tensor([loss for loss, _, _ in part], dtype=torch.float32).mean().item()
           for split, part in (("train", runs[:iters]), ("val", runs[iters:]))}
    out["executed"] = executed_fraction(*runs[-1][1:]) if runs else None
    return out


def final_eval_due(cfg, iter_num):
    """At the run's end: whether out_dir has no final eval (FINAL_EVAL) of iter_num and final_eval_tokens."""
    try:
        with open(os.path.join(cfg["out_dir"], FINAL_EVAL)) as f:
            done = json.load(f)
        return (done.get("iter"), done.get("final_eval_tokens")) != (iter_num, cfg["final_eval_tokens"])
    except (OSError, ValueError, AttributeError):
        return True


@torch.no_grad()
def final_eval(model, val_path, cfg, device, autocast, iter_num, path, stopped, progress):
    """The run's last eval, on the val split's first final_eval_tokens tokens (all of a shorter split; at
    least one window), in consecutive windows of block_size, batch_size at a time (whole batches: a compiled
    model sees one shape): the same tokens for every run of a dataset and block_size, so that runs differ by
    their models and not by the batches drawn. path (written atomically) gets the mean loss and its standard
    error over the windows. In eval mode, as estimate_loss. Returns False when stopped() broke it off (checked
    between batches)."""
    T = cfg["block_size"]
    data = np.memmap(val_path, dtype=np.uint16, mode="r")
    windows = max(min(cfg["final_eval_tokens"], len(data) - 1) // T, 1)
    B = min(cfg["batch_size"], windows)
    n, t_start = windows // B, time.time()

    def batch(k):
        rows = [data[i * T:(i + 1) * T + 1].astype(np.int64) for i in range(k * B, (k + 1) * B)]
        xy = torch.from_numpy(np.stack(rows)).to(device)
        return xy[:, :-1], xy[:, 1:]

    def window_losses(X, Y, logits, loss, executed):
        loss = F.cross_entropy(logits.float().flatten(0, 1), Y.flatten(), reduction="none")
        return loss.view(B, T).mean(1).cpu()

    losses = eval_loop(model, n, batch, window_losses, autocast, stopped, progress,
                       lambda done: f"{done}/{n} batches of the final eval")
    if losses is None:
        return False
    per_window = torch.cat(losses).double()
    mean, se = per_window.mean().item(), (per_window.std().item() / len(per_window) ** 0.5 if n * B > 1 else 0.0)
    record = {"iter": iter_num, "val_loss": round(mean, 6), "val_se": round(se, 6),
              "tokens": n * B * T, "windows": n * B, "block_size": T, "dataset": cfg["dataset"],
              "final_eval_tokens": cfg["final_eval_tokens"]}
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)
    print(f"final eval at iter {iter_num}: loss {mean:.4f} (standard error {se:.4f}) on the val split's "
          f"first {n * B * T:,} tokens ({n * B} windows of {T}) in {format_duration(time.time() - t_start)}; "
          f"{path}", flush=True)
    return True


# -----------------------------------------------------------------------------
# the progress line

def log_line(iter_num, max_iters, loss, dt, tokens_per_iter, utilisation, lr, eta):
    """'iter 40/5000: loss 2.1234, 31.20 ms/iter, 65,641 tok/s, mfu 41.2%, lr 6.00e-04, eta 2m35s'; dt (the
    mean seconds per iteration since the last sync point) and eta are None when no timed step ran yet,
    utilisation (MFU) when it is unknown (a device without a peak in flops.py, the CPU included)."""
    parts = [f"iter {iter_num}/{max_iters}: loss {loss:.4f}"]
    if dt:
        parts += [f"{dt * 1000:.2f} ms/iter", f"{tokens_per_iter / dt:,.0f} tok/s"]
    if utilisation is not None:
        parts.append(f"mfu {100 * utilisation:.1f}%")
    parts.append(f"lr {lr:.2e}")
    if eta is not None:
        parts.append(f"eta {format_duration(eta)}")
    return ", ".join(parts)


# -----------------------------------------------------------------------------
# the configuration: checked before anything touches out_dir (out_dir itself, resume: guards.py)

def check_run_config(cfg):
    """train.py's own keys, before anything else happens: one-line errors that name the fix."""
    if cfg["init_from"] not in ("scratch", "resume"):
        if str(cfg["init_from"]).startswith("gpt2"):  # nanoGPT's gpt2, gpt2-medium, gpt2-large, gpt2-xl
            raise ConfigError("pretrained GPT-2 weights don't fit nanodepth's backbone (RoPE, RMSNorm, untied head); "
                              "train from scratch (--init_from=scratch) or resume (--init_from=resume)")
        raise ConfigError(f"init_from must be 'scratch' or 'resume', got {cfg['init_from']!r}")
    if cfg["eval_only"] and cfg["init_from"] != "resume":  # from scratch it would evaluate a random init
        raise ConfigError(f"eval_only evaluates a checkpoint: add --init_from=resume (out_dir {cfg['out_dir']} "
                          f"holds the run to evaluate)")
    for key in POSITIVE_KEYS:
        if not isinstance(cfg[key], int) or cfg[key] <= 0:
            raise ConfigError(f"{key} must be a whole number > 0, got {cfg[key]!r}")
    if isinstance(cfg["final_eval_tokens"], bool) or not isinstance(cfg["final_eval_tokens"], int) \
            or cfg["final_eval_tokens"] < 0:
        raise ConfigError(f"final_eval_tokens must be a whole number >= 0 (0: no final eval), "
                          f"got {cfg['final_eval_tokens']!r}")
    if not isinstance(cfg["max_iters"], int) or cfg["max_iters"] < 0:
        raise ConfigError(f"max_iters must be a whole number >= 0, got {cfg['max_iters']!r}")
    if cfg["max_seconds"] is not None:
        seconds = cfg["max_seconds"]
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
            raise ConfigError(f"max_seconds must be a number of seconds > 0, got {cfg['max_seconds']!r}")
    from run_config import check_training_values  # AdamW's and the schedule's numbers; warnings
    check_training_values(cfg)


def check_block_fits(cfg, paths):
    """A batch needs block_size + 1 consecutive tokens of each split."""
    for split in ("train", "val"):
        n_tokens = os.path.getsize(paths[split]) // 2
        if cfg["block_size"] >= n_tokens:
            raise ConfigError(f"block_size {cfg['block_size']} does not fit the {split} split of "
                              f"{cfg['dataset']} ({n_tokens} tokens); lower --block_size")


def check_nag_recipe(cfg):
    """The nag_* keys of train.py: one-line errors that name the fix."""
    for key in ("nag_gate_lr_scale", "nag_alpha_warmup_tokens"):
        if isinstance(cfg[key], bool) or not isinstance(cfg[key], (int, float)) or not cfg[key] >= 0:
            raise ConfigError(f"{key} must be a number >= 0, got {cfg[key]!r}")
        if cfg[key] != DEFAULTS[key] and cfg["residual"] != "nag":
            raise ConfigError(f"{key}={cfg[key]} only applies to residual=nag; remove it or set --residual=nag")
    if cfg["nag_gate_decay"] and (cfg["residual"] != "nag" or cfg["nag_gate_lr_scale"] != 1.0):
        raise ConfigError("nag_gate_decay=True applies to residual=nag with nag_gate_lr_scale=1 (the gate group "
                          "has no decay); drop one of them")


def start_wandb(cfg):
    """The wandb run that each eval logs to (wandb is imported only here: wandb_log=True on rank 0)."""
    try:
        import wandb
    except ImportError:
        raise ConfigError("wandb_log=True needs wandb: pip install wandb (or drop --wandb_log)") from None
    name = cfg["wandb_run_name"] or os.path.basename(os.path.abspath(cfg["out_dir"]))
    try:
        return wandb.init(project=cfg["wandb_project"], name=name, config=cfg)
    except Exception as e:  # not logged in, no network, ...: the first line of wandb's message
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"wandb.init failed ({why}): run wandb login, set WANDB_MODE=offline "
                          f"or drop --wandb_log") from None


def finish_wandb(run, exit_code):
    """The end of the wandb run: its data on disk (offline: the .wandb file complete) when this returns.
    run.finish() alone is not enough: it only asks wandb's service process to close the run (a message it
    does not wait on), and until the service closes the run's .wandb file that file may hold its 7-byte
    header and nothing else. wandb.teardown() waits until the service has closed every run and exited
    (a later wandb.init starts a new one)."""
    import wandb
    run.finish(exit_code=exit_code)
    wandb.teardown()


def main(argv):
    return Trainer(configure(argv, DEFAULTS, HELP_FROM), argv).run()


def cli(argv):
    """The command line: a bad configuration or a stopped run is one line on stderr and a non-zero exit."""
    try:
        main(argv)
    except (ConfigError, TrainingStopped) as e:
        sys.exit(f"error: {e}")
    except Interrupted as e:
        if str(e):  # rank 0 only
            print(e, file=sys.stderr)
        sys.exit(128 + e.signum)  # the shell's convention: 130 for SIGINT, 143 for SIGTERM


if __name__ == "__main__":
    cli(sys.argv[1:])
