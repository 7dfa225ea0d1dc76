"""
The run's plan: how many iterations a run trains, and the learning rate of each.

A budget sets the length. --max_iters as given; --max_flops (iso-FLOP) the iterations the FLOPs buy;
--max_seconds (equal time) a length re-planned at every step from the pace so far. The LR schedule
follows the length: a linear warm-up (capped at WARMUP_CAP of a budget's iterations, so that a short
budget still reaches the peak LR), then a cosine down to min_lr at lr_decay_iters. nag's alpha warm-up
is a schedule too.

No model here: a RunPlan is made from the configuration's numbers, so it can be tested from a dict.
Its decisions are written into that configuration (cfg), which the checkpoint saves and a resume reads.
"""

import math
import sys

from configurator import ConfigError

WARMUP_CAP = 0.1  # with a budget, warmup_iters is at most this fraction of its iterations (rounded up)


class RunPlan:
    """The iterations and LR of one run. cfg: train.py's configuration (max_iters, warmup_iters, lr_decay_iters,
    learning_rate, min_lr, decay_lr, max_flops, max_seconds, nag_alpha_warmup_tokens, eval_interval, init_from,
    eval_only), filled in and updated in place.
    flops_per_token: training FLOPs per token (flops.train_flops_per_token); dense_note: a note for a budget
    counted dense (MoD without a fixed capacity); resumed_cfg: the checkpoint's configuration on resume."""

    def __init__(self, cfg, tokens_per_iter, flops_per_token, resumed_cfg=None, ddp=False, dense_note="",
                 verbose=True):
        self.cfg, self.tokens_per_iter, self.flops_per_token = cfg, tokens_per_iter, flops_per_token
        self.verbose = verbose  # rank 0 says what the budget bought
        if cfg["lr_decay_iters"] is None:
            cfg["lr_decay_iters"] = cfg["max_iters"]
        if cfg["min_lr"] is None:
            cfg["min_lr"] = cfg["learning_rate"] / 10
        if cfg["max_flops"] is not None:
            self.plan_flops(dense_note)
        if cfg["max_seconds"] is not None:
            self.plan_deadline(resumed_cfg, ddp)
        elif cfg["max_flops"] is None and cfg["init_from"] == "scratch" and not cfg["eval_only"]:
            self.warn_if_the_cosine_outlasts_the_run()

    def lr(self, it):
        """The learning rate of iteration it: linear warm-up, cosine decay to min_lr at lr_decay_iters."""
        cfg = self.cfg
        if not cfg["decay_lr"]:
            return cfg["learning_rate"]
        if it < cfg["warmup_iters"]:
            return cfg["learning_rate"] * (it + 1) / (cfg["warmup_iters"] + 1)
        if it > cfg["lr_decay_iters"]:
            return cfg["min_lr"]
        ratio = (it - cfg["warmup_iters"]) / max(1, cfg["lr_decay_iters"] - cfg["warmup_iters"])
        return cfg["min_lr"] + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg["learning_rate"] - cfg["min_lr"])

    def alpha_scale(self, it):
        """nag_alpha_warmup_tokens (nag-nanochat's token-anchored warm-up): alpha's scale before iteration it,
        min(1, tokens trained / warm-up tokens): 0 at the first iteration, linear, then 1."""
        warmup_tokens = self.cfg["nag_alpha_warmup_tokens"]
        return min(1.0, it * self.tokens_per_iter / warmup_tokens) if warmup_tokens > 0 else 1.0

    def plan_flops(self, dense_note):
        """max_flops (iso-FLOP): the budget sets the iterations, and the LR schedule with them."""
        cfg = self.cfg
        follows = cfg["lr_decay_iters"] == cfg["max_iters"]
        cfg["max_iters"] = iterations_for_budget(cfg["max_flops"], self.flops_per_token, self.tokens_per_iter)
        cfg["lr_decay_iters"] = cfg["max_iters"] if follows else cfg["lr_decay_iters"]
        warmup_cap = math.ceil(WARMUP_CAP * cfg["max_iters"])  # only ever lowers the warm-up
        capped = cfg["warmup_iters"] > warmup_cap
        cfg["warmup_iters"] = min(cfg["warmup_iters"], warmup_cap)
        if self.verbose:
            print(f"max_flops {cfg['max_flops']:.3g} at {self.flops_per_token:,.0f} FLOPs/token: "
                  f"{cfg['max_iters']:,} iters, warmup_iters {cfg['warmup_iters']:,}"
                  + (f" (capped at {WARMUP_CAP:.0%} of the iters)" if capped else "")
                  + f", lr_decay_iters {cfg['lr_decay_iters']:,}" + dense_note)
        self.warn_if_the_cosine_outlasts_the_run(" (what the budget buys)")  # lr_decay_iters set apart, and longer

    def warn_if_the_cosine_outlasts_the_run(self, what=""):
        """One warning (rank 0) where the run ends before its cosine does, so its LR never reaches min_lr,
        with the fix; not where the whole run is warm-up (check_training_values says that)."""
        cfg = self.cfg
        if self.verbose and cfg["decay_lr"] and cfg["warmup_iters"] < cfg["max_iters"] < cfg["lr_decay_iters"]:
            print(f"warning: lr_decay_iters {cfg['lr_decay_iters']} > max_iters {cfg['max_iters']}{what}: the run ends before "
                  f"the cosine does, at LR {self.lr(cfg['max_iters']):.2e}, not min_lr; to decay over the run, "
                  f"--lr_decay_iters={cfg['max_iters']}", file=sys.stderr, flush=True)

    def plan_deadline(self, resumed_cfg, ddp):
        """max_seconds (equal time): at_step sets the iterations at every step boundary."""
        cfg = self.cfg
        if cfg["max_flops"] is not None:  # after the resume's merge: either may come from the checkpoint
            raise ConfigError("max_flops and max_seconds are two budgets (FLOPs, time): set one of them")
        if ddp:
            raise ConfigError("max_seconds runs in one process for now (DDP ranks would have to agree on the "
                              "deadline): drop torchrun or use --max_flops")
        self.warmup_asked = cfg["warmup_iters"]  # capped at WARMUP_CAP of each estimate, as with max_flops
        if resumed_cfg is not None:  # until this process's pace is measured: the plan the checkpoint has
            cfg["max_iters"] = cfg["lr_decay_iters"] = resumed_cfg.get("max_iters", cfg["max_iters"])
        if self.verbose:
            print(f"max_seconds {cfg['max_seconds']:g}: max_iters, lr_decay_iters and warmup_iters (at most "
                  f"{WARMUP_CAP:.0%} of the iters) follow the pace measured after the first step; the run ends "
                  f"at the first step boundary past {cfg['max_seconds']:g} s of training (evals not counted)")

    def at_step(self, iter_num, spent, timed, timed_seconds):
        """max_seconds, at the step boundary before iteration iter_num, spent seconds of training done: the run
        ends here once max_seconds are spent (max_iters = iter_num); until then max_iters is where the pace
        (timed_seconds over this process's timed steps) reaches the deadline (before a step is timed: as
        planned), never this iteration, and the LR schedule follows it: the decay completes at the deadline,
        the warm-up capped at WARMUP_CAP."""
        cfg = self.cfg
        if spent >= cfg["max_seconds"]:
            if self.verbose:
                print(f"max_seconds {cfg['max_seconds']:g} reached at iter {iter_num} ({spent:.1f} s of training)")
            cfg["max_iters"] = iter_num
            return
        if timed > 0:
            pace = timed_seconds / timed
            left = (cfg["max_seconds"] - spent) / pace if pace > 0 else 1  # a frozen clock: one step at a time
            cfg["max_iters"] = iter_num + math.ceil(left)
        cfg["max_iters"] = cfg["lr_decay_iters"] = max(cfg["max_iters"], iter_num + 1)
        cfg["warmup_iters"] = min(self.warmup_asked, math.ceil(WARMUP_CAP * cfg["max_iters"]))

    def describe(self, start, changes=()):
        """The LR schedule from iteration start on, in words: where the warm-up and the cosine end, the run's
        end. changes: a resume's (key, old, new, where) changes, for the hint on max_iters."""
        cfg = self.cfg
        end, decay_end = cfg["max_iters"], cfg["lr_decay_iters"]
        text = f"the plan from iter {start}: LR {self.lr(start):.2e}"
        if not cfg["decay_lr"]:
            return text + f" (decay_lr=False: constant) to the end at iter {end}"
        if start < cfg["warmup_iters"]:
            text += f", warm-up to {cfg['learning_rate']:.2e} at iter {cfg['warmup_iters']}"
        if start < decay_end:
            text += f", cosine down to min_lr {cfg['min_lr']:.2e} at iter {decay_end} (lr_decay_iters)"
        if end > max(start, decay_end):
            text += f", min_lr {cfg['min_lr']:.2e} from iter {max(start, decay_end)}"
        text += f"; the run ends at iter {end}"
        changed = {k for k, *_ in changes}
        if end > decay_end and "max_iters" in changed and "lr_decay_iters" not in changed:
            text += f" (to decay over the new length as well, add --lr_decay_iters={end})"
        elif end < decay_end:
            text += f", its LR {self.lr(end):.2e} there (the cosine ends later, at lr_decay_iters)"
        return text

    def evals_left(self, iter_num):
        """The evals still to run after iteration iter_num (one every eval_interval, and one at the end)."""
        cfg = self.cfg
        return (cfg["max_iters"] // cfg["eval_interval"] - iter_num // cfg["eval_interval"]
                + (cfg["max_iters"] % cfg["eval_interval"] != 0))


def iterations_for_budget(budget, flops_per_token, tokens_per_iter):
    """Iterations whose training FLOPs come nearest to the budget (so within half an iteration)."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0:
        raise ConfigError(f"a FLOP budget must be a positive number such as 3e15, got {budget!r}")
    return max(1, round(budget / (flops_per_token * tokens_per_iter)))
