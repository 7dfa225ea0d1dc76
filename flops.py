"""
FLOP accounting, MFU and iso-FLOP sweeps (README: "FLOPs and iso-FLOP sweeps").

    python flops.py config/shakespeare_char_cpu.py --n_layer=8 --budget=3e15   # breakdown; what a budget buys
    python flops.py sweep config/sweep_shakespeare_cpu.py                     # train.py runs at one budget
    python flops.py results results/sweep_mod_cpu.csv                            # a sweep's tables again, from its CSV
    python flops.py multiplier out/<sweep>/results.csv                        # compute multipliers of a budgets sweep
    python flops.py optimizers results/sweep_muon_cpu_5e12.csv results/...csv      # AdamW against Muon, design by design

Convention. FLOPs count a multiply-add as 2 and are per token of the training sequence (T = block_size):
- attention sublayer: 2*4*d^2 (q, k, v and output projections) + 2*2*T*d (scores QK^T and the
  weighted sum AV over the *full* T x T square, as nanoGPT and PaLM do: the causal mask is not
  credited). torch's FlopCounterMode counts SDPA the same way (full square, is_causal ignored) on
  the GPU kernels; on CPU it has no formula for the CPU kernel and counts 0 (tests add one).
- MLP sublayer 2*8*d^2; LM head 2*d*V (V the padded vocab); embedding lookups are free.
- extras per mode: each residual mode and MoD mode states the FLOPs it adds beyond the backbone
  (its flops(config) in model.py: nag's modulator 2*C*d + 2*C (its channel mix) per sublayer; AttnRes 4*d per source a
  sublayer or the head mixes, mat-vecs, plus 2*d^2 per mixing point with attnres_query=input;
  hc and mhc (n streams) hc_mix, hc_read, hc_write per sublayer, hc_dynamic's coefficients, mhc's
  coefficient projection mhc_proj and its Sinkhorn steps mhc_sinkhorn (docs/flops.md has each term);
  mod=router 2*d per router and its predictor MLP, only with mod_rate > 0; skip_middle's gate
  producers 2*d for each of the first L/2 blocks). A mode that states none is an error, never a
  silent prenorm count. Norms, softmaxes, RoPE and the NAG write-back are not counted.
- Mixture-of-Depths: sublayer l runs on a fraction exec_frac[l] of the tokens, so its matmuls scale
  with exec_frac[l] and its attention scores with exec_frac[l]^2 (a compressed sequence of
  exec_frac[l] * T tokens). Scoring (modulator, router, gate producers) and depth mixing run on
  every token. Without a measured exec_frac, each MoD mode's planned_fractions(config) count: for
  mod=nag and mod=router the training capacity k / T (top-k: exactly what training runs) of every
  routed sublayer and 1 for the others; skip_middle has no fixed capacity (its gates decide), so it
  counts 1 (dense, an upper bound) unless given the measured fraction (model.py's executed_fraction), which is what
  train.py logs its cumulative FLOPs from.
  (Eval routing by thresholds keeps a different number of tokens per row; a batch is padded to the
  row that keeps most, and that padding is computed but not counted: executed fractions count
  tokens that ran.)
Training = 3 x forward (backward = 2 x forward).
"""

import collections
import csv
import glob
import json
import math
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time

import torch

from configurator import ConfigError, configure
import run_config
import stats
from model import GPT, MODS, RESIDUALS
from plan import iterations_for_budget

BACKBONE_MATMULS = ("attn_proj", "attn_scores", "mlp", "head")  # matmuls as FlopCounterMode sees them


# -----------------------------------------------------------------------------
# FLOPs and params

def modes(config):
    """The residual mode's class and, if any, the MoD mode's."""
    return [RESIDUALS[config.residual]] + ([MODS[config.mod]] if MODS[config.mod] else [])


def mode_flops(config):
    """The forward FLOPs per token the modes add, by name, from each mode's own flops(config)."""
    out = {}
    for cls in modes(config):
        if "flops" not in vars(cls):  # an inherited count would be a silent guess
            raise ValueError(f"{cls.__name__} states no FLOPs: give it its own flops(config) (model.py's "
                             f"Residual says how; return {{}} when it adds none)")
        out.update(cls.flops(config))
    return out


def matmul_parts(config):
    """The names of forward_flops' components that are matmuls (FlopCounterMode counts those)."""
    vector = {name for cls in modes(config) for name in cls.vector_flops}
    return set(BACKBONE_MATMULS) | {name for name in mode_flops(config) if name not in vector}


def counted_dense(config):
    """Whether the MoD mode has no fixed capacity, so the planned FLOPs count it dense (an upper
    bound) and only the realised FLOPs (train.py's log) are exact."""
    return config.mod != "none" and MODS[config.mod].counted_dense


def forward_flops(config, exec_frac=None):
    """Forward FLOPs per token by component (dict, see the module docstring for the convention).
    exec_frac: the executed fraction of each of the 2L sublayers (MoD), e.g. model.py's executed_fraction
    of a forward's counts; default: the MoD mode's planned_fractions (nag, router: the training capacity of the routed sublayers)."""
    d, T, n = config.n_embd, config.block_size, config.n_sublayers
    if exec_frac is None:
        f = MODS[config.mod].planned_fractions(config) if MODS[config.mod] else [1.0] * n
    else:
        f = [float(x) for x in exec_frac]
    if len(f) != n or not all(0.0 <= x <= 1.0 for x in f):
        raise ValueError(f"exec_frac must be {n} fractions in [0, 1] (one per sublayer), got {exec_frac}")
    attn, mlp = f[0::2], f[1::2]
    out = {
        "attn_proj": 2 * 4 * d * d * sum(attn),
        "attn_scores": 2 * 2 * T * d * sum(x * x for x in attn),  # compressed sequence: quadratic
        "mlp": 2 * 8 * d * d * sum(mlp),
        "head": 2 * d * config.padded_vocab_size,
    }
    if config.value_residual != "none":  # (1 - lam) v + lam v_1 in every attention sublayer after the first
        out["value_residual"] = 3 * d * sum(attn[1:])
    own = mode_flops(config)
    routed = {name for cls in modes(config) for name in cls.routed_flops}
    return {**out, **{k: v * sum(f) / n if k in routed else v for k, v in own.items()}}


def train_flops_per_token(config, exec_frac=None):
    """Forward + backward: 3 x the forward FLOPs."""
    return 3 * sum(forward_flops(config, exec_frac).values())


PARAMS = {}  # count_params by repr(config): a sweep recounts every run's params after each finished run


def count_params(config):
    """(total, non-embedding) parameters, exact: the model is built on the meta device (no memory)."""
    if repr(config) not in PARAMS:
        with torch.device("meta"):
            model = GPT(config)
        PARAMS[repr(config)] = model.get_num_params(non_embedding=False), model.get_num_params()
    return PARAMS[repr(config)]


# -----------------------------------------------------------------------------
# MFU: peak dense bf16 tensor FLOP/s (no sparsity), from each vendor datasheet.
# Matched in order against torch.cuda.get_device_name(), lower-cased: variants before their family.
PEAK_FLOPS = [
    (r"h100.*pcie", 756e12),  # H100 PCIe datasheet: 1513 TFLOPS bf16 with sparsity
    (r"h100.*nvl", 835e12),  # H100 NVL: 1671 with sparsity
    (r"h100|gh200", 989e12),  # H100 SXM: 1979 with sparsity
    (r"h200", 989e12),  # H200 SXM: same tensor cores as H100 SXM
    (r"b200", 2250e12),  # B200 (HGX): 4.5 PFLOPS with sparsity
    (r"a100", 312e12),  # A100 (PCIe and SXM)
    (r"\ba10\b", 125e12),  # A10: 250 with sparsity (not the A10G: its peak is not published by NVIDIA)
    (r"l40s", 362e12),  # L40S: 733 with sparsity
    (r"\bl4\b", 121e12),  # L4: 242 with sparsity
    (r"rtx 4090", 165e12),  # Ada whitepaper: 165.2 bf16 with fp32 accumulate (330 with sparsity)
]


def peak_flops(device_name):
    """Peak dense bf16 FLOP/s of the named GPU, or None when it is not in the table (never a guess)."""
    name = (device_name or "").lower()
    for pattern, peak in PEAK_FLOPS:
        if re.search(pattern, name):
            return peak
    return None


def mfu(flops_per_token, tokens_per_s, device_name, n_devices=1):
    """Model FLOPs utilisation: achieved training FLOP/s over the peak of n_devices such GPUs;
    None (unknown) for a device not in PEAK_FLOPS, the CPU included."""
    peak = peak_flops(device_name)
    if peak is None or not tokens_per_s:
        return None
    return flops_per_token * tokens_per_s / (peak * n_devices)


# -----------------------------------------------------------------------------
# the breakdown command

BREAKDOWN_DEFAULTS = dict(
    budget=None,  # training FLOPs: also print the tokens and iterations they buy
)


def train_config(argv, extra=None):
    """train.py's configuration from config files and --key=value (plus `extra` keys of our own)."""
    return configure(argv, {**run_config.DEFAULTS, **(extra or {})},
                     [*run_config.HELP_FROM, (__file__, "BREAKDOWN_DEFAULTS")])


NOTED = set()  # the data folders model_config has said it counts gpt2's vocab for (once each)


def model_config(cfg):
    """The GPTConfig train.py would build, with the vocab from the dataset's meta.pkl when it is there."""
    ddir = os.path.join(cfg["data_dir"], cfg["dataset"])
    vocab_size = run_config.dataset_vocab_size(ddir)
    if not os.path.exists(os.path.join(ddir, "meta.pkl")) and ddir not in NOTED:
        NOTED.add(ddir)
        print(f"note: no meta.pkl in {ddir} (prepare the data first): counting gpt2's vocab of {vocab_size}")
    return run_config.model_config(cfg, vocab_size)


def breakdown(argv):
    cfg = train_config(argv, BREAKDOWN_DEFAULTS)
    config = model_config(cfg)
    parts = forward_flops(config)
    fwd = sum(parts.values())
    tokens_per_iter = cfg["gradient_accumulation_steps"] * cfg["batch_size"] * cfg["block_size"]
    iters = None if cfg["budget"] is None else iterations_for_budget(cfg["budget"], 3 * fwd, tokens_per_iter)
    total, non_embedding = count_params(config)
    V = config.padded_vocab_size  # model.py pads to a multiple of 64 only where that adds <= 1/64 of rows
    print(f"{config.residual}: {config.n_layer} layers, d={config.n_embd}, T={config.block_size}, "
          f"V={config.vocab_size}" + (f" (padded to {V})" if V != config.vocab_size else ""))
    planned = MODS[config.mod].planned_fractions(config) if MODS[config.mod] else None
    if planned is not None and counted_dense(config):
        print(f"mod={config.mod}: counted dense (the gates decide; train.py logs the realised FLOPs)")
    elif planned is not None:
        routed = [f for f in planned if f < 1]
        print(f"mod={config.mod} at mod_rate {config.mod_rate:g}: {len(routed)} of {config.n_sublayers} sublayers run "
              f"their training capacity k/T = {min(planned):.4g} of the tokens, the others all")
    print(f"{'component':<16}{'FLOPs/token':>14}{'share':>8}")
    for name, value in parts.items():
        print(f"{name:<16}{value:>14,.0f}{value / fwd:>8.1%}")
    print(f"{'forward':<16}{fwd:>14,.0f}")
    print(f"{'train (3x)':<16}{3 * fwd:>14,.0f}")
    print(f"params: {total:,} total, {non_embedding:,} non-embedding (6N = {6 * non_embedding:,})")
    if iters is not None:
        print(f"budget {cfg['budget']:.3g} FLOPs: {cfg['budget'] / (3 * fwd):,.0f} tokens = {iters:,} iterations "
              f"of {tokens_per_iter:,} tokens ({iters * tokens_per_iter * 3 * fwd:.4g} FLOPs)")


# -----------------------------------------------------------------------------
# iso-FLOP sweeps: train.py runs, jobs at a time, each in out_root/sweep_name/<run>

SWEEP_DEFAULTS = dict(
    sweep_name="sweep",  # the runs go to out_root/sweep_name/<run>, with results.csv, .md and .png
    out_root="out",  # see sweep_name
    train_config="config/shakespeare_char_cpu.py",  # every run starts from this train.py config
    train_args=[],  # and these --key=value, then the sweep's own
    budget=1e14,  # training FLOPs per run (train.py --max_flops; a run's own max_flops wins); None: max_iters
    budget_seconds=None,  # instead: seconds of training per run (train.py --max_seconds); set with budget: an error;
    #                       a list [60, 120, 240]: a budget axis in time, as budgets is in FLOPs
    budgets=None,  # instead of budget: a list of training FLOPs [1e13, 3e13, 1e14, 3e14], a budget axis; each
    #              budget's runs in out_root/sweep_name/b<budget>/<run>, and one results.csv with a budget column
    depths=[2, 4, 8],  # n_layer of the grid's cells
    residuals=["prenorm", "nag", "block_attnres"],  # a dense run per residual and depth
    mod_runs=[],  # extra (residual, mod, mod_rate) runs at every depth, e.g. ("nag", "nag", 0.25)
    runs=[],  # extra cells (name, {train.py key: value}): ablations and shapes the grid above does not make,
    #           e.g. ("nag_L16_sqrt_d", {"residual": "nag", "n_layer": 16, "nag_head": "sqrt_d"})
    seeds=[],  # [] one run per cell with the train config's seed; [1, 2, 3] one run per seed, <cell>_s<seed>
    cells=None,  # None: every cell; a list of cell names: only these run (the sweep's other cells are left out)
    cell_budgets={},  # {cell: [FLOPs, ...]}: a cell's own budgets instead of budgets (the baseline's, wider than
    #                 the designs', so that every design's loss is read inside the baseline's measured range)
    jobs=1,  # train.py processes at a time (on CPU with OMP_NUM_THREADS=1: one per core)
    baseline=None,  # results.md tests every cell against this cell (paired t on shared seeds, else Welch); None:
    #               its depth's prenorm cell, else first
)
FIELDS = ["run", "cell", "seed", "residual", "n_layer", "mod", "mod_rate", "args", "status", "iters", "tokens",
          "flops", "params", "train_flops_per_token", "exec_train", "exec_eval", "eval_flops_per_token", "val_loss",
          "val_se", "eval_tokens", "best_val_loss", "seconds", "s_per_iter", "budget", "device", "optimizer"]
LATER_FIELDS = ("val_se", "eval_tokens", "s_per_iter", "budget", "device", "optimizer")  # a results.csv from before
#                                                                                     them lacks these, and loads
GRID_KEYS = ("residual", "n_layer", "mod", "mod_rate", "seed")  # own columns; a cell's other keys go in `args`
HERE = os.path.dirname(os.path.abspath(__file__))  # train.py runs here
TRAIN_SCRIPT = "train.py"  # what each run launches, from HERE (tests swap in a fake)


def sweep_cells(sw):
    """(cell name, {train.py key: value}) of every cell: the dense grid, each mod_run at every depth,
    then the named runs."""
    cells = [(f"{r}_L{L}", {"residual": r, "n_layer": L}) for r in sw["residuals"] for L in sw["depths"]]
    for item in sw["mod_runs"]:
        if not (isinstance(item, (tuple, list)) and len(item) == 3):
            raise ConfigError(f"each entry of mod_runs must be (residual, mod, mod_rate), e.g. ('nag', 'nag', 0.25), "
                              f"got {item!r}")
    for r, mod, rate in sw["mod_runs"]:
        cells += [(f"{r}_L{L}_{mod}{rate}", {"residual": r, "n_layer": L, "mod": mod, "mod_rate": rate})
                  for L in sw["depths"]]
    for item in sw["runs"]:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], dict)):
            raise ConfigError(f"each entry of runs must be (name, {{key: value}}), got {item!r}")
        cells.append(item)
    names = [name for name, _ in cells]
    if len(set(names)) != len(names):
        raise ConfigError(f"two cells share a name in {names}: give each run in `runs` its own name")
    if sw["cells"] is not None and not sw["cells"]:
        raise ConfigError(f"cells=[] names no cell to run: name some of {', '.join(names)} (or leave cells out: all)")
    for key, named in (("cells", sw["cells"] or []), ("cell_budgets", sw["cell_budgets"])):
        unknown = [c for c in named if c not in names]
        if unknown:
            raise ConfigError(f"{key} names {', '.join(map(repr, unknown))}, not a cell of this sweep: its cells are "
                              f"{', '.join(names)}")
    return cells if sw["cells"] is None else [c for c in cells if c[0] in sw["cells"]]


def sweep_runs(sw):
    """Every run as (run name, cell name, overrides): each cell once per seed, seed by seed (so an
    interrupted sweep has every cell at its first seeds)."""
    if any(isinstance(s, bool) or not isinstance(s, int) for s in sw["seeds"]) or len(set(sw["seeds"])) < len(sw["seeds"]):
        raise ConfigError(f"seeds must be distinct integers such as [1, 2, 3], got {sw['seeds']!r}")
    cells = sweep_cells(sw)
    if not sw["seeds"]:
        return [(cell, cell, dict(overrides)) for cell, overrides in cells]
    return [(run_config.seed_run(cell, s), cell, {**overrides, "seed": s}) for s in sw["seeds"] for cell, overrides in cells]


def override_args(overrides):
    """train.py's --key=value for a run's overrides (repr: the configurator reads them back exactly)."""
    return [f"--{k}={v!r}" for k, v in overrides.items()]


def budget_args(sw):
    """train.py's budget for every run of a one-budget sweep (a cell's own max_flops, after it, wins)."""
    return ([f"--max_seconds={sw['budget_seconds']}"] if sw["budget_seconds"] is not None else
            [] if sw["budget"] is None else [f"--max_flops={sw['budget']}"])


SWEEP_RECORD = "sweep_run.json"  # in each run's folder: the train.py configuration the sweep started it with


def run_settings(cfg):
    """What defines a run: its whole train.py configuration as the sweep launches it (budget, train_config,
    train_args, the cell's keys), as JSON reads it back; out_dir is the folder itself."""
    return {k: v for k, v in json.loads(json.dumps(cfg, default=str)).items() if k != "out_dir"}


def write_sweep_record(out_dir, cfg):
    """The run's SWEEP_RECORD (atomic): what recorded_settings reads back when the sweep runs again."""
    with open(os.path.join(out_dir, SWEEP_RECORD + ".tmp"), "w") as f:
        json.dump({"config": run_settings(cfg)}, f, indent=1)
        f.write("\n")
    os.replace(os.path.join(out_dir, SWEEP_RECORD + ".tmp"), os.path.join(out_dir, SWEEP_RECORD))


def recorded_settings(out_dir):
    """What the run in out_dir was started with: its SWEEP_RECORD, else (a run started before sweeps wrote one)
    the command line of train.py's config.json, resolved as run_settings; None when neither is there."""
    path = os.path.join(out_dir, SWEEP_RECORD)
    if not os.path.exists(path):
        path = os.path.join(out_dir, "config.json")  # its config is train.py's after planning: its command is ours
        if not os.path.exists(path):
            return None
    try:
        with open(path) as f:
            record = json.load(f)
        if path.endswith(SWEEP_RECORD):
            return record["config"]
        args = shlex.split(record["command"])
        args = [a for a in args[args.index("train.py") + 1:] if not a.startswith(("--out_dir=", "--init_from="))]
        return run_settings(train_config(args))
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError(f"{path} is not readable, so what this run was started with is unknown: move its folder "
                          f"{out_dir} away to run it again") from None


def changed_settings(out_dir, cfg):
    """{key: (as the run was started, as this sweep would run it)} for every key both know that differs;
    None when the run's folder has no record."""
    recorded = recorded_settings(out_dir)
    if recorded is None:
        return None
    now = run_settings(cfg)
    return {k: (recorded[k], now[k]) for k in recorded if k in now and recorded[k] != now[k]}


def check_kept_runs(root, runs, cfgs):
    """Before anything runs: every run this sweep would keep (finished: skipped or re-evaluated) or continue
    (a checkpoint: resumed) must have been started with the settings this sweep gives it, else its cells
    would mix two budgets or configurations under one title. A one-line error names the runs, the settings
    and the fix. Returns the kept runs that have no record (their settings cannot be checked)."""
    changed, unrecorded = {}, []
    for name, _, _ in runs:
        out_dir = os.path.join(root, name)
        if not any(os.path.exists(os.path.join(out_dir, f)) for f in ("done", "ckpt.pt")):
            continue  # nothing of it is kept: it starts from scratch
        diff = changed_settings(out_dir, cfgs[name])
        if diff is None:
            unrecorded.append(name)
        elif diff:
            changed[name] = diff
    if changed:
        keys = {}
        for diff in changed.values():
            for k, v in diff.items():
                keys.setdefault(k, v)
        names = list(changed)
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        what = "; ".join(f"{k} was {old!r}, now {new!r}" for k, (old, new) in keys.items())
        raise ConfigError(f"{root} holds {len(names)} run(s) started with other settings than this sweep gives them "
                          f"({shown}: {what}); a sweep never mixes them. Give the new settings their own folder "
                          f"(another --sweep_name or --out_root), or the old settings back to resume these runs")
    return unrecorded


def run_result(out_dir):
    """The row a finished run contributes, from its log.jsonl (None when it has not finished)."""
    if not os.path.exists(os.path.join(out_dir, "done")):
        return None
    recs = run_config.load_log(out_dir)
    last = recs[-1]
    with open(os.path.join(out_dir, "done")) as f:
        seconds = float(f.read().strip() or "nan")
    row = {"status": "done", "iters": last["iter"], "tokens": last["tokens"], "flops": last.get("flops"),
           "val_loss": last["val_loss"], "best_val_loss": min(r["val_loss"] for r in recs), "seconds": seconds,
           "exec_train": last.get("exec_train"), "exec_eval": last.get("exec_eval")}
    paces = [r["ms_per_iter"] / 1000 for r in recs if r.get("ms_per_iter")]  # each log interval's training pace
    row["s_per_iter"] = statistics.median(paces) if paces else None
    try:  # the final eval on the val split's fixed tokens (train.py's final_eval): the val loss to compare
        with open(os.path.join(out_dir, "final_eval.json")) as f:
            final = json.load(f)
    except (OSError, ValueError):
        final = None
    if final and final.get("iter") == last["iter"]:
        row.update(val_loss=final["val_loss"], val_se=final["val_se"], eval_tokens=final["tokens"])
    if row["flops"] and row["tokens"]:  # realised: train.py counts MoD runs from their executed fractions
        row["train_flops_per_token"] = row["flops"] / row["tokens"]
    return row


def optimizer_label(cfg):
    """The results column: "adamw", or "muon" with the muon_* keys the run set away from their defaults,
    from the run's whole configuration (a train_args --optimizer=muon shows too, not only a cell's)."""
    if cfg.get("optimizer", "adamw") != "muon":
        return "adamw"
    changed = [f"--{k}={cfg[k]!r}" for k in run_config.MUON_KEYS if cfg[k] != run_config.DEFAULTS[k]]
    return " ".join(["muon", *changed])


def run_row(run, cfg, out_dir, status):
    """A run's row: what its log says when it finished, else `status`; plus the counts from its config."""
    name, cell, overrides = run
    row = {"run": name, "cell": cell, "seed": cfg["seed"], "residual": cfg["residual"], "n_layer": cfg["n_layer"],
           "mod": "" if cfg["mod"] == "none" else cfg["mod"], "mod_rate": cfg["mod_rate"] if cfg["mod"] != "none" else 0.0,
           "args": " ".join(override_args({k: v for k, v in overrides.items() if k not in GRID_KEYS})),
           "device": cfg.get("device"), "optimizer": optimizer_label(cfg),
           **(run_result(out_dir) or {"status": status})}
    try:  # train.py prepares the data (and so the vocab) the first time
        config = model_config(cfg)
    except (ConfigError, ValueError):
        return row  # train.py reports the error itself, and the run is recorded as failed
    row["params"] = count_params(config)[1]
    row.setdefault("train_flops_per_token", train_flops_per_token(config))  # not run: the analytic count
    if config.mod == "none" or row.get("exec_eval"):  # the last eval's routing (a MoD run's last val batch)
        row["eval_flops_per_token"] = sum(forward_flops(config, row.get("exec_eval")).values())
    for k in ("exec_train", "exec_eval"):  # the mean over sublayers
        row[k] = sum(row[k]) / len(row[k]) if row.get(k) else (1.0 if config.mod == "none" else None)
    return row


def run_sweep(argv, top_argv=None):
    """A sweep (flops.py sweep's argv); top_argv: a budget sweep's own argv, which a stopped budget's resume
    line gives (the budget's argv would resume that budget alone)."""
    sw = configure(argv, SWEEP_DEFAULTS, [(__file__, "SWEEP_DEFAULTS")],
                   "flops.py sweep: train.py runs of a sweep config's cells at one budget each, then results.csv, "
                   ".md and .png; it needs a sweep config, e.g. python flops.py sweep config/sweep_shakespeare_cpu.py")
    if sw["budgets"] is not None or isinstance(sw["budget_seconds"], (list, tuple)):
        return run_budget_sweep(argv, sw)
    if sw["budget_seconds"] is not None:  # an equal-time sweep: budget's default (FLOPs) gives way, a set one clashes
        if isinstance(sw["budget_seconds"], bool) or not isinstance(sw["budget_seconds"], (int, float)) \
                or not sw["budget_seconds"] > 0:
            raise ConfigError(f"budget_seconds must be a number of seconds > 0, got {sw['budget_seconds']!r}")
        if configure(argv, dict.fromkeys(SWEEP_DEFAULTS))["budget"] is not None:
            raise ConfigError("budget (FLOPs) and budget_seconds (time) are two kinds of sweep: set one of them")
        sw["budget"] = None
    if sw["budget"] is not None:
        iterations_for_budget(sw["budget"], 1.0, 1)  # a bad budget fails here, not in every run
    if isinstance(sw["jobs"], bool) or not isinstance(sw["jobs"], int) or sw["jobs"] < 1:
        raise ConfigError(f"jobs must be a positive integer (train.py processes at a time), got {sw['jobs']!r}")
    check_baseline(sw["baseline"], [name for name, _ in sweep_cells({**sw, "cells": None})])
    if sw["cell_budgets"]:
        raise ConfigError("cell_budgets gives cells their own budgets in a sweep over budgets: set budgets = [...] too")
    root = os.path.abspath(os.path.join(sw["out_root"], sw["sweep_name"]))
    runs = sweep_runs(sw)
    base_argv = [os.path.abspath(sw["train_config"]), *sw["train_args"]]
    cwd = os.getcwd()
    os.chdir(HERE)  # relative paths in the train config (data_dir) are train.py's, from the repo
    try:  # each run's configuration as train.py gets it; bad keys fail now
        cfgs = {name: train_config([*base_argv, *budget_args(sw), *override_args(ov)]) for name, _, ov in runs}
        run_config.find_data(next(iter(cfgs.values())))  # prepared once, before jobs could race to do it
        return _sweep(sw, root, runs, base_argv, cfgs, top_argv or argv)
    finally:
        os.chdir(cwd)


def budget_tag(budget, seconds=False):
    """A budget's folder name: b1e14 (FLOPs), s120 (seconds)."""
    return ("s" if seconds else "b") + f"{budget:g}".replace("+", "")


def run_budget_sweep(argv, sw):
    """A sweep over budgets (budgets, or a list budget_seconds): the whole sweep at each budget, smallest
    first, in out_root/sweep_name/b<budget>/ (each with its own results.csv/.md/.png), then one
    out_root/sweep_name/results.csv of every run with its budget (flops.py multiplier reads it)."""
    timed = isinstance(sw["budget_seconds"], (list, tuple))
    given = dict.fromkeys(SWEEP_DEFAULTS) | configure(argv, dict.fromkeys(SWEEP_DEFAULTS))
    if sum(given[k] is not None for k in ("budget", "budgets", "budget_seconds")) != 1:
        raise ConfigError("budget, budgets (FLOPs) and budget_seconds (time) are kinds of sweep: set one of them")
    key = "budget_seconds" if timed else "budgets"
    lists = {key: sw[key], **{f"cell_budgets[{c!r}]": v for c, v in sw["cell_budgets"].items()}}
    if not isinstance(sw["cell_budgets"], dict) or timed and sw["cell_budgets"]:
        raise ConfigError("cell_budgets must be a dict {cell: [FLOPs, ...]} of a FLOP budget sweep (budgets = [...])")
    for name, values in lists.items():
        if not isinstance(values, (list, tuple)) or not values or len(set(values)) < len(values) \
                or any(isinstance(b, bool) or not isinstance(b, (int, float)) or not b > 0 for b in values):
            raise ConfigError(f"{name} must be a list of distinct numbers > 0, e.g. [1e13, 3e13, 1e14], got {values!r}")
    names = [c for c, _ in sweep_cells(sw)]  # unknown names in cell_budgets fail here
    budgets_of = {c: sw["cell_budgets"].get(c, sw[key]) for c in names}
    rows, path = [], os.path.join(os.path.abspath(os.path.join(sw["out_root"], sw["sweep_name"])), "results.csv")
    for b in sorted({b for values in budgets_of.values() for b in values}):
        one = [a for a in argv if not a.startswith(("--budgets=", "--budget_seconds=", "--budget=", "--sweep_name=",
                                                    "--cells=", "--cell_budgets="))] + ["--cell_budgets={}"]
        here = [c for c in names if b in budgets_of[c]]
        one += [f"--sweep_name={os.path.join(sw['sweep_name'], budget_tag(b, timed))}", "--budgets=None",
                f"--budget_seconds={b!r}" if timed else "--budget_seconds=None",
                *([] if timed else [f"--budget={b!r}"]),
                *([f"--cells={here!r}"] if sw["cells"] is not None or len(here) < len(names) else [])]
        rows += [{**r, "budget": b} for r in run_sweep(one, argv)]
        write_rows(path, rows)  # after each budget: a sweep cut short keeps what it ran
        print(f"the budgets so far: {path} (python flops.py multiplier {path}: the compute multipliers)", flush=True)
    return rows


def time_left(seconds, left, jobs):
    """Seconds that `left` runs take, `jobs` at a time, at the mean of the finished runs' `seconds` (the
    runs of a sweep cost about the same; a resumed one less); None before any run has finished."""
    return statistics.mean(seconds) * left / min(jobs, max(left, 1)) if seconds else None


def print_plan(sw, runs, todo, seconds, cfgs, root):
    """What the sweep is about to do, before it starts: runs, budget, where results go, how long."""
    resume = [name for name, _, _ in todo if os.path.exists(os.path.join(root, name, "ckpt.pt"))]
    shown = os.path.join(sw["out_root"], sw["sweep_name"])  # as the user gave it (we run from the repo)
    seeds = f" x {len(sw['seeds'])} seeds" if sw["seeds"] else ", one run each"
    print(f"sweep {sw['sweep_name']}: {len(runs)} runs ({len(sweep_cells(sw))} cells{seeds}), {sw['jobs']} at a "
          f"time: {len(runs) - len(todo)} finished (skipped), {len(resume)} to resume from a checkpoint, "
          f"{len(todo) - len(resume)} to start")
    if sw["budget_seconds"] is not None:
        print(f"budget: {sw['budget_seconds']:g} seconds of training per run (train.py --max_seconds)")
    elif sw["budget"] is None:
        print(f"budget: each run's max_iters ({', '.join(map(str, sorted({c['max_iters'] for c in cfgs.values()})))})")
    else:
        print(f"budget: {sw['budget']:.3g} training FLOPs per run (train.py --max_flops)")
    print(f"results: {os.path.join(shown, 'results')}.{{csv,md,png}} after every run; each run in "
          f"{os.path.join(shown, '<run>')}/ (its output in stdout.txt)")
    left = time_left(seconds, len(todo), sw["jobs"])
    print("estimated time: " + ("unknown until the first run finishes" if left is None else
          f"{left / 60:.1f} min: {len(todo)} to run at {statistics.mean(seconds):.0f} s each (the mean of the "
          f"{len(seconds)} finished here), {sw['jobs']} at a time"), flush=True)


def _sweep(sw, root, runs, base_argv, cfgs, argv):
    unrecorded = check_kept_runs(root, runs, cfgs)
    os.makedirs(root, exist_ok=True)
    status = {name: "pending" for name, _, _ in runs}
    todo, seconds = [], []  # seconds: of every finished run, for the time estimates
    for run in runs:  # the progress count: the skipped runs first, then each run as it finishes
        row = run_result(os.path.join(root, run[0]))
        if row is None:
            todo.append(run)
        elif row.get("eval_tokens") is None and cfgs[run[0]]["final_eval_tokens"] \
                and os.path.exists(os.path.join(root, run[0], "ckpt.pt")):
            todo.append(run)  # finished before the final eval existed: its resume runs that eval alone
            print(f"{run[0]}: finished without a final eval: re-evaluated from its checkpoint", flush=True)
        else:
            status[run[0]] = "done"
            seconds += [row["seconds"]] if math.isfinite(row["seconds"]) else []
            print(f"[{list(status.values()).count('done')}/{len(runs)}] {run[0]}: already finished, skipped",
                  flush=True)
    if unrecorded:
        shown = ", ".join(unrecorded[:4]) + (", ..." if len(unrecorded) > 4 else "")
        print(f"note: {len(unrecorded)} kept run(s) ({shown}) have no {SWEEP_RECORD} nor config.json: their settings "
              f"are not checked against this sweep's", flush=True)
    print_plan(sw, runs, todo, seconds, cfgs, root)
    signals = []  # SIGINT / SIGTERM only land here; the loop then stops the runs and waits for them
    previous = {s: signal.signal(s, lambda signum, frame: signals.append(signum))
                for s in (signal.SIGINT, signal.SIGTERM)}
    t0, running = time.time(), {}

    def finish(name):
        """Close a run that exited: its `done` marker (what makes a rerun skip it) and status; seconds."""
        proc, log, t = running.pop(name)
        log.close()
        dt = time.time() - t
        done = os.path.join(root, name, "done")
        if proc.returncode == 0 and not os.path.exists(done):  # a re-evaluated run keeps its training's seconds
            with open(done, "w") as f:
                f.write(f"{dt:.1f}\n")
            seconds.append(dt)
        status[name] = "done" if proc.returncode == 0 else "interrupted" if signals else "failed"
        return dt

    try:
        while (todo or running) and not signals:
            while todo and len(running) < sw["jobs"] and not signals:
                name, _, overrides = todo.pop(0)
                out_dir = os.path.join(root, name)
                # a killed run left a checkpoint: continue it rather than start over
                resume = os.path.exists(os.path.join(out_dir, "ckpt.pt"))
                cmd = [sys.executable, TRAIN_SCRIPT, *base_argv, f"--out_dir={out_dir}", *budget_args(sw),
                       *override_args(overrides), *(["--init_from=resume"] if resume else [])]
                os.makedirs(out_dir, exist_ok=True)
                if not resume:  # a resumed run's record is its start's (checked above); none: not guessed now
                    write_sweep_record(out_dir, cfgs[name])
                log = open(os.path.join(out_dir, "stdout.txt"), "a")
                running[name] = (subprocess.Popen(cmd, cwd=HERE, stdout=log, stderr=subprocess.STDOUT), log, time.time())
                status[name] = "running"
            time.sleep(0.2)
            for name in [n for n, (proc, _, _) in running.items() if proc.poll() is not None]:
                dt = finish(name)
                # after every run: a kill loses none
                rows = write_results(root, runs, cfgs, status, sw["budget"], sw["baseline"], sw["budget_seconds"])
                row = next(r for r in rows if r["run"] == name)
                loss = f", val {row['val_loss']:.4f}" if row.get("val_loss") is not None else ""
                left = len(todo) + len(running)
                eta = time_left(seconds, left, sw["jobs"])
                print(f"[{len(runs) - left}/{len(runs)}] {name}: {status[name]} in {dt:.0f}s{loss} | elapsed "
                      f"{(time.time() - t0) / 60:.1f} min, ETA " + ("unknown" if eta is None else f"{eta / 60:.1f} min"),
                      flush=True)
        if signals:  # pass it on (train.py checkpoints at its next step, exits 128 + signum) and wait: no orphans
            signame = signal.Signals(signals[0]).name
            print(f"got {signame}: passing it to the {len(running)} running runs, which checkpoint at their next "
                  f"step", file=sys.stderr, flush=True)
            for proc, _, _ in running.values():
                proc.send_signal(signals[0])
            for name in list(running):
                running[name][0].wait()
                finish(name)
            if os.path.exists(os.path.join(root, "results.csv")):  # rewritten: interrupted runs, not running
                write_results(root, runs, cfgs, status, sw["budget"], sw["baseline"], sw["budget_seconds"])
            print(f"stopped by {signame}. Resume with the same command: python flops.py sweep {shlex.join(argv)} "
                  f"(finished runs are skipped, checkpointed ones resume)", file=sys.stderr, flush=True)
            raise SystemExit(128 + signals[0])  # the shell's convention: 130 for SIGINT, 143 for SIGTERM
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return write_results(root, runs, cfgs, status, sw["budget"], sw["baseline"], sw["budget_seconds"])


def aggregate(rows):
    """One entry per cell, over its finished runs (the seeds): counts, mean and std of the losses, and the
    losses by seed ({seed: loss}, what stats.compare pairs on; a run without a seed, or a second run of a cell's
    seed, e.g. a budgets sweep's CSV, is keyed by its run name, paired with nothing)."""
    cells = {}
    for r in rows:
        cells.setdefault(r["cell"], []).append(r)
    out = []
    for cell, rs in cells.items():
        done = [r for r in rs if r["status"] == "done"]
        agg = {k: rs[0][k] for k in ("cell", "residual", "n_layer", "mod", "mod_rate", "args", "params")
               if k in rs[0]}
        losses = {}
        for i, r in enumerate(done):
            key = r["seed"] if r.get("seed") is not None and r["seed"] not in losses else r["run"]
            losses[key if key not in losses else f"{key} ({i})"] = r["val_loss"]
        agg.update(n=len(done), runs=len(rs), losses=losses)
        paces = [pace(r) for r in done if pace(r) is not None]
        agg["s_per_iter"] = statistics.median(paces) if paces else None
        for k in ("val_loss", "best_val_loss", "iters", "train_flops_per_token", "eval_flops_per_token",
                  "exec_train", "exec_eval", "seconds", "flops"):
            vals = [r[k] for r in done if r.get(k) is not None]
            agg[k], agg[k + "_std"] = stats.mean_std(vals) if vals else (None, None)
        out.append(agg)
    return out


def pace(row):
    """A run's seconds per training iteration: the median of its log's intervals, or, for a results.csv
    from before that column, its wall time (evals included) over its iterations."""
    if row.get("s_per_iter") is not None:
        return row["s_per_iter"]
    return row["seconds"] / row["iters"] if row.get("seconds") and row.get("iters") else None


def check_adjust(adjust):
    if adjust not in stats.ADJUST:
        raise ConfigError(f"adjust must be holm (Holm's step-down) or bh (Benjamini-Hochberg), got {adjust!r}")


def check_baseline(baseline, cells):
    if baseline is not None and baseline not in cells:
        raise ConfigError(f"baseline={baseline!r} is not a cell of this sweep; its cells: {', '.join(cells)}")


def baselines(cells, baseline=None):
    """{cell: the cell it is tested against}: run_config.pick_baselines, the rule of plot.py's table too:
    `baseline`, else the prenorm cell of the same depth (no MoD, no other keys), else that depth's first cell."""
    return run_config.pick_baselines([(c["cell"], c["n_layer"], c["residual"] == "prenorm" and not c.get("mod")
                                       and not c.get("args")) for c in cells], baseline)


def significance_lines(cells, baseline=None, adjust="holm"):
    """Markdown: each cell's final val loss against its baseline cell, the table's comparisons one family
    (stats.family_cells: paired on the seeds both ran, else Welch; p raw and adjusted by `adjust`)."""
    losses = {c["cell"]: c["losses"] for c in cells}
    paces = {c["cell"]: c["s_per_iter"] for c in cells}
    lines = ["", "Final val loss against a baseline cell (the sweep's `baseline`, else the prenorm cell of the "
             "same depth, else its first cell): difference of means and its 95% CI, the test (a paired t-test on "
             "the seeds both cells ran, n the shared seeds; Welch's t-test, n each cell's runs, where they share "
             "fewer than 2), p raw and adjusted, the seeds at which the observed difference would be significant at "
             "0.05 over the family's size (Bonferroni, which passes Holm and BH too) with 80% power, and the cell's "
             "median seconds per iteration over the baseline's, measured in this sweep (a results.csv without "
             "s_per_iter: wall time over iterations, evals included)."]
    pairs = {cell: base for cell, base in baselines(cells, baseline).items() if cell != base}
    if not pairs:  # one cell per depth and no baseline named: say so rather than print an empty table
        depths = sorted({c["n_layer"] for c in cells})
        return lines + ["", f"No comparison: every cell is the only one of its depth ({', '.join(map(str, depths))} "
                            f"layers), so each is its own baseline. Read this CSV together with the CSV of the cells "
                            f"to compare with (several are read as one sweep), e.g. python flops.py results "
                            f"results/sweep_shakespeare_cpu.csv results/sweep_shakespeare_mhc_cpu.csv, or name a baseline "
                            f"cell (--baseline=CELL; a sweep config's baseline)."]
    rows, m = stats.family_cells([(losses[cell], losses[base]) for cell, base in pairs.items()], adjust)
    lines[-1] += " " + stats.family_sentence(m, adjust) + "."
    lines += ["", "| cell | baseline | " + " | ".join(stats.family_header(adjust)) + " | s/iter vs baseline |",
              "|" + "---|" * 9]
    for (cell, base), row in zip(pairs.items(), rows):
        ratio = f"{paces[cell] / paces[base]:.2f}x" if paces[cell] and paces[base] else "-"
        lines.append(f"| {cell} | {base} | " + " | ".join(row) + f" | {ratio} |")
    return lines


def write_rows(path, rows):
    """rows as a results.csv at path (FIELDS' columns; a missing key or None: empty), written whole or not at all."""
    with open(path + ".tmp", "w", newline="") as f:
        w = csv.DictWriter(f, FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in FIELDS})
    os.replace(path + ".tmp", path)


def write_results(root, runs, cfgs, status, budget, baseline=None, budget_seconds=None):
    """results.csv (a row per run), results.md (results_markdown) and results.png."""
    rows = [run_row(run, cfgs[run[0]], os.path.join(root, run[0]), status[run[0]]) for run in runs]
    for r in rows:  # the budget column: FLOPs, or seconds in an equal-time sweep (flops.py multiplier reads it)
        r["budget"] = budget_seconds if budget_seconds is not None else budget
    write_rows(os.path.join(root, "results.csv"), rows)
    cells = aggregate(rows)
    with open(os.path.join(root, "results.md"), "w") as f:
        what = ("each run at its max_iters" if budget is None and budget_seconds is None else
                f"iso-FLOP sweep at {budget:.3g} training FLOPs per run" if budget_seconds is None else
                f"equal-time sweep at {budget_seconds:g} seconds of training per run (train FLOPs: what each spent)")
        f.write(results_markdown(rows, cells, what, baseline))
    if any(c["n"] for c in cells):
        plot_results(cells, budget, os.path.join(root, "results.png"))
    return rows


def results_markdown(rows, cells, what, baseline=None, adjust="holm"):
    """Mean ± std per cell, each cell against its baseline (p adjusted by `adjust`), then every run; `what`
    opens it."""
    fmt = lambda v, spec: "-" if v in (None, "") else format(v, spec)  # noqa: E731
    pm = lambda c, k: fmt(c[k], ".4f") + ("" if c[k + "_std"] is None else f" ± {c[k + '_std']:.4f}")  # noqa: E731
    seeds = sorted({r["seed"] for r in rows})
    done = [r for r in rows if r["status"] == "done"]
    periodic = sum(r.get("eval_tokens") is None for r in done)
    measure = ("the final eval on the whole val split" if not periodic else
               f"the last periodic eval (eval_iters batches) for {periodic} of the {len(done)} runs, which ran before "
               f"the final eval existed: compare these losses only with runs measured the same way")
    lines = [f"{what}; seeds {', '.join(map(str, seeds))}. "
             "Per cell: mean ± sample std (n - 1) over its finished runs; executed = the mean fraction of "
             f"tokens a sublayer ran (eval: the last eval's routing). The loss: {measure}.", "",
             "| cell | residual | layers | mod | mod_rate | args | runs done | iters | non-emb params "
             "| train FLOPs/token | eval fwd FLOPs/token | executed (train / eval) | final val loss | best val loss "
             "| s per run | s/iter (median) | train FLOPs per run |", "|" + "---|" * 17]
    for c in cells:
        lines.append(f"| {c['cell']} | {c['residual']} | {c['n_layer']} | {c['mod'] or '-'} | {c['mod_rate']:g} "
                     f"| {c['args'] or '-'} | {c['n']}/{c['runs']} | {fmt(c['iters'], ',.0f')} "
                     f"| {fmt(c.get('params'), ',')} | {fmt(c['train_flops_per_token'], '.4g')} "
                     f"| {fmt(c['eval_flops_per_token'], '.4g')} "
                     f"| {fmt(c['exec_train'], '.3f')} / {fmt(c['exec_eval'], '.3f')} "
                     f"| {pm(c, 'val_loss')} | {pm(c, 'best_val_loss')} | {fmt(c['seconds'], '.0f')} "
                     f"| {fmt(c['s_per_iter'], '.3f')} | {fmt(c['flops'], '.3g')} |")
    lines += significance_lines(cells, baseline, adjust)
    lines += ["", "Every run:", "", "| run | seed | status | iters | final val loss | best val loss | s |",
              "|" + "---|" * 7]
    for r in rows:
        lines.append(f"| {r['run']} | {r['seed']} | {r['status']} | {fmt(r.get('iters'), ',')} "
                     f"| {fmt(r.get('val_loss'), '.4f')} | {fmt(r.get('best_val_loss'), '.4f')} "
                     f"| {fmt(r.get('seconds'), '.0f')} |")
    return "\n".join(lines) + "\n"


RESULTS_DEFAULTS = dict(
    baseline=None,  # the cell every other cell is tested against; None: its depth's prenorm cell, else its first
    adjust="holm",  # the table's p adjusted for its number of comparisons: holm (family-wise error) or bh (FDR)
    budget=None,  # a budgets sweep's CSV (every budget in one): the runs of this budget alone, e.g. 2.5e12
)


def read_results(path):
    """The rows of a sweep's results.csv (or a copy of it, as in results/), typed as write_results made them."""
    if not os.path.isfile(path):
        raise ConfigError(f"no results file {path}: pass a sweep's results.csv (e.g. results/sweep_mod_cpu.csv)")
    ints = {"seed", "n_layer", "iters", "tokens", "params"}
    text = {"run", "cell", "residual", "mod", "args", "status", "device", "optimizer"}
    not_results = (f"{path} is not a sweep's results.csv (its header has no run, cell, seed and val_loss columns, "
                   f"or a row does not parse): pass out/<sweep>/results.csv or a copy in results/")
    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            if not {"run", "cell", "seed", "val_loss"} <= set(reader.fieldnames or ()):
                raise ConfigError(not_results)
            missing = [k for k in FIELDS if k not in LATER_FIELDS and k not in reader.fieldnames]
            if missing:
                raise ConfigError(f"{path} is not a sweep's results.csv (it has no {', '.join(missing)} column"
                                  f"{'s' if len(missing) > 1 else ''}, which flops.py sweep writes): pass "
                                  f"out/<sweep>/results.csv or a copy in results/")
            rows = [{k: (v if k in text else None if v in ("", None) else int(v) if k in ints else float(v))
                     for k, v in r.items() if k is not None} for r in reader]
    except ConfigError:
        raise
    except (ValueError, UnicodeDecodeError, csv.Error):
        raise ConfigError(not_results) from None
    if not rows:
        raise ConfigError(f"{path} holds no runs (its header alone): a sweep writes its results.csv after its first "
                          f"finished run; pass one that has rows")
    return rows


def csv_verb(argv, verb, defaults, name, what, takes, example):
    """A verb that reads results.csv files: (the files, its --key=value options, every row of them)."""
    files = [a for a in argv if not a.startswith("-")]
    cfg = configure([a for a in argv if a.startswith("-")], defaults, [(__file__, name)],
                    f"flops.py {verb}: {what}, e.g. python flops.py {verb} {example}")
    if not files:
        raise ConfigError(f"flops.py {verb} takes one or more {takes}, e.g. python flops.py {verb} {example}")
    return files, cfg, [r for path in files for r in read_results(path)]


def one_budget(rows, budget):
    """The rows of a budgets sweep's CSV whose budget column is `budget` (to 1 part in 1e6)."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0:
        raise ConfigError(f"budget must be a positive number of training FLOPs (e.g. --budget=2.5e12), got {budget!r}")
    kept = [r for r in rows if r.get("budget") is not None and abs(r["budget"] - budget) <= 1e-6 * budget]
    if not kept:
        have = sorted({r["budget"] for r in rows if r.get("budget") is not None})
        raise ConfigError(f"no run has budget {budget:g}: " + (f"the CSVs' budgets are {', '.join(f'{b:g}' for b in have)}"
                          if have else "the CSVs have no budget column (a one-budget sweep: drop --budget)"))
    return kept


def results(argv):
    """python flops.py results out/<sweep>/results.csv ... [--baseline=CELL]: results.md's tables, from
    the CSVs alone (the run folders are not needed), printed. Several CSVs are read as one sweep, so a
    cell run later (a sweep of its own) is tested against the cells of an earlier one."""
    files, cfg, rows = csv_verb(argv, "results", RESULTS_DEFAULTS, "RESULTS_DEFAULTS",
                                "a sweep's tables again, from one or more results.csv (read as one sweep)",
                                "results.csv", "results/sweep_mod_cpu.csv")
    check_adjust(cfg["adjust"])
    if cfg["budget"] is not None:
        rows = one_budget(rows, cfg["budget"])
    runs = collections.Counter((r["cell"], r["seed"]) for r in rows if r["seed"] is not None and r["status"] == "done")
    twice = sorted(k for k, n in runs.items() if n > 1)
    if twice:
        raise ConfigError(f"{len(twice)} cell and seed pairs have two finished runs (e.g. {twice[0][0]} seed "
                          f"{twice[0][1]}): a CSV read twice, or a budgets sweep's CSV (every budget in one): pass "
                          f"each CSV once, add --budget=B (one budget's runs), or read it with python flops.py "
                          f"multiplier")
    cells = aggregate(rows)
    check_baseline(cfg["baseline"], [c["cell"] for c in cells])
    text = results_markdown(rows, cells, " + ".join(files), cfg["baseline"], cfg["adjust"])
    print(text, end="")
    return text


def plot_results(cells, budget, path):
    """Write to path: final val loss, mean ± std over seeds (error bars) and each seed (dots): per cell;
    against depth when the sweep has several; against mod_rate when it has MoD cells."""
    import matplotlib
    matplotlib.use("Agg")  # files only, so it runs on a headless box
    import matplotlib.pyplot as plt
    done = [c for c in cells if c["n"]]
    line = lambda c: c["residual"] + (f" {c['args']}" if c["args"] else "")  # noqa: E731
    depths = sorted({c["n_layer"] for c in done})
    with_mod = any(c["mod"] for c in done)
    panels = ["cells"] + ["depth"] * (len(depths) > 1) + ["mod"] * with_mod
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), max(4.2, 0.32 * len(done) + 1.5)),
                             squeeze=False)
    for ax, panel in zip(axes[0], panels):
        if panel == "cells":
            y = range(len(done))[::-1]
            ax.errorbar([c["val_loss"] for c in done], y, xerr=[c["val_loss_std"] or 0 for c in done], fmt="o",
                        capsize=3, label="mean ± std")
            for yi, c in zip(y, done):
                ax.plot(list(c["losses"].values()), [yi] * len(c["losses"]), ".", color="gray", alpha=0.6)
            ax.set_yticks(list(y), [c["cell"] for c in done], fontsize=8)
            ax.set_xlabel("final val loss")
            ax.set_title(f"each cell{'' if budget is None else f' at {budget:.3g} FLOPs'} "
                         "(error bars: sample std; dots: seeds)", fontsize=10)
            continue
        if panel == "depth":  # a line per residual (and args), the dense cells and each mod setting
            groups = {}
            for c in done:
                groups.setdefault(line(c) + (f" + {c['mod']} {c['mod_rate']:g}" if c["mod"] else ""), []).append(c)
            key = "n_layer"
            ax.set_xlabel("layers")
            ax.set_xscale("log", base=2)  # depths usually double
            ax.set_xticks(depths, [str(L) for L in depths])
            ax.set_title(f"val loss vs depth{'' if budget is None else f' at {budget:.3g} FLOPs'}", fontsize=10)
        else:  # the dense cells are mod_rate 0 of each residual and depth
            groups = {}
            for c in done:
                groups.setdefault(f"{line(c)} L={c['n_layer']}", []).append(c)
            groups = {k: v for k, v in groups.items() if any(c["mod"] for c in v)}
            for c in done:  # mod_rate for nag and router (top-k), what the gates skipped for skip_middle
                c["skipped"] = 1 - (c["exec_train"] if c["exec_train"] is not None else 1.0)
            key = "skipped"
            ax.set_xlabel("fraction of sublayer tokens skipped in training")
            ax.set_title("val loss vs skipped fraction", fontsize=10)
        for label, cs in groups.items():
            cs = sorted(cs, key=lambda c: c[key])
            ax.errorbar([c[key] for c in cs], [c["val_loss"] for c in cs],
                        yerr=[c["val_loss_std"] or 0 for c in cs], marker="o", capsize=3, label=label)
        ax.set_ylabel("final val loss")
    for a in axes[0]:
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)  # written after every finished run: pyplot would keep each figure alive otherwise


# -----------------------------------------------------------------------------
# what a sweep costs, before it runs

PLAN_DEFAULTS = dict(
    gpu=None,  # the GPU (PEAK_FLOPS) of the hours, e.g. H100; None: the runs' device here (a CPU: no hours); "": none
    mfu=0.35,  # the model FLOPs utilisation assumed on that GPU
    like="",  # a results.csv of runs finished on this machine: each run's hours from their seconds per training FLOP
    #           (the runs of the same residual, args and depth, else the nearest depth's), the sweep's jobs at a time
)


def plan(argv):
    """python flops.py plan config/sweep_<name>.py [--gpu=H100] [--mfu=0.35] [sweep keys]: every run of the
    sweep (its cells at their budgets, its seeds), the FLOPs they train on and evaluate with (each eval's
    batches and the final eval, forward only), and the time that is on one such GPU at that MFU. Without
    --gpu: the GPU the runs' device picks on this machine; on a CPU no hours (a GPU's peak and MFU do not
    apply)."""
    about = ("flops.py plan: what a sweep config costs in FLOPs and GPU hours, e.g. python flops.py plan "
             "config/sweep_depth_multiplier_gpu.py --gpu=H100 --mfu=0.35")
    if "--help" in argv or "-h" in argv:  # its own keys, then the sweep's
        configure(["--help"], {**PLAN_DEFAULTS, **SWEEP_DEFAULTS}, [(__file__, "PLAN_DEFAULTS"),
                                                                   (__file__, "SWEEP_DEFAULTS")], about)
    own = [a for a in argv if a.startswith(("--gpu=", "--mfu=", "--like="))]
    opts = configure(own, PLAN_DEFAULTS, [(__file__, "PLAN_DEFAULTS")], about)
    sw = configure([a for a in argv if a not in own], SWEEP_DEFAULTS, [(__file__, "SWEEP_DEFAULTS")])
    if isinstance(opts["mfu"], bool) or not isinstance(opts["mfu"], (int, float)) or not 0 < opts["mfu"] <= 1:
        raise ConfigError(f"mfu must be a fraction in (0, 1], got {opts['mfu']!r}")
    if sw["budget_seconds"] is not None:
        raise ConfigError("a sweep on a time budget (budget_seconds): its FLOPs are known only once it has run")
    if opts["gpu"] is not None and not isinstance(opts["gpu"], str):
        raise ConfigError(f"gpu must be a GPU's name such as H100 (or '' for FLOPs only), got {opts['gpu']!r}")
    on_cpu = None
    if opts["gpu"] is None:  # the device the runs pick here: train.py's rule
        devices = {configure([os.path.abspath(sw["train_config"]), *sw["train_args"], *override_args(ov)],
                             run_config.DEFAULTS)["device"] for _, ov in sweep_cells(sw)}
        picked = {run_config.pick_device(d, "float32").device for d in devices}
        if any(d.type == "cpu" for d in picked):
            on_cpu = ", ".join(sorted(devices))
            opts["gpu"] = ""
        else:
            opts["gpu"] = torch.cuda.get_device_name(next(iter(picked)))
            if peak_flops(opts["gpu"]) is None:
                raise ConfigError(f"this machine's GPU ({opts['gpu']}) is not in flops.py's PEAK_FLOPS: name one with "
                                  f"--gpu (H100, H200, B200, A100, A10, L40S, L4, RTX 4090), or --gpu='' for FLOPs only")
    peak = peak_flops(opts["gpu"]) if opts["gpu"] else None
    if opts["gpu"] and peak is None:
        raise ConfigError(f"gpu={opts['gpu']!r} is not in flops.py's PEAK_FLOPS; give one of H100, H200, B200, A100, "
                          f"A10, L40S, L4, RTX 4090 (or --gpu='' for FLOPs only)")
    seeds = max(len(sw["seeds"]), 1)
    base_argv = [os.path.abspath(sw["train_config"]), *sw["train_args"]]
    per_budget, pace, seconds = {}, seconds_per_flop(opts["like"]) if opts["like"] else None, 0.0
    for name, overrides in sweep_cells(sw):
        cfg = train_config([*base_argv, *override_args(overrides)])
        config = model_config(cfg)
        tokens = cfg["batch_size"] * cfg["block_size"] * cfg["gradient_accumulation_steps"]
        train_pt, fwd_pt = train_flops_per_token(config), sum(forward_flops(config).values())
        for b in (sw["cell_budgets"].get(name, sw["budgets"]) if sw["budgets"] else [sw["budget"]]):
            iters = iterations_for_budget(b, train_pt, tokens) if b else cfg["max_iters"]
            evals = iters // cfg["eval_interval"] + 1
            eval_tokens = evals * 2 * cfg["eval_iters"] * cfg["batch_size"] * cfg["block_size"] + cfg["final_eval_tokens"]
            runs, fl = per_budget.get(b, (0, 0.0))
            per_budget[b] = (runs + seeds, fl + seeds * (iters * tokens * train_pt + eval_tokens * fwd_pt))
            if pace:
                seconds += seeds * iters * tokens * train_pt * pace(overrides.get("residual", cfg["residual"]),
                                                                    cell_args(overrides), config.n_layer)
    hours = (lambda f: f / (peak * opts["mfu"]) / 3600) if peak else None
    lines = [f"sweep {sw['sweep_name']} ({len(sweep_cells(sw))} cells x {seeds} seed(s)): "
             f"{sum(n for n, _ in per_budget.values())} runs", "",
             "| budget | runs | FLOPs (training + evals) |" + (" hours |" if peak else ""),
             "|---|---|---|" + ("---|" if peak else "")]
    for b, (n, fl) in sorted(per_budget.items(), key=lambda t: (t[0] is None, t[0])):
        lines.append(f"| {'max_iters' if b is None else format(b, '.3g')} | {n} | {fl:.3g} |"
                     + (f" {hours(fl):.1f} |" if peak else ""))
    total = sum(fl for _, fl in per_budget.values())
    lines += ["", f"total: {total:.3g} FLOPs" + (f"; on one {opts['gpu']} ({peak / 1e12:.0f} TFLOP/s peak bf16) at "
                                                 f"{opts['mfu']:.0%} MFU: {hours(total):.1f} hours" if peak else "")]
    if pace:
        lines += [f"on this machine, from the seconds per training FLOP of the runs in {opts['like']}: "
                  f"{seconds / sw['jobs'] / 3600:.1f} hours, {sw['jobs']} at a time"]
    elif on_cpu:
        lines += [f"no hours: its runs' device ({on_cpu}) is the CPU on this machine, where a GPU's peak and MFU do "
                  f"not apply (flops.py sweep estimates the time left from its finished runs); --gpu=H100 gives "
                  f"the hours on one such GPU"]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    return text


def cell_args(overrides):
    """A cell's keys other than GRID_KEYS, as a results.csv's args column writes them."""
    return " ".join(override_args({k: v for k, v in overrides.items() if k not in GRID_KEYS}))


def seconds_per_flop(path):
    """pace(residual, args, depth): the median seconds per training FLOP of the finished runs in a results.csv
    with that residual and args at that depth, else at the nearest depth they ran (the cost per FLOP of a run
    changes with its depth), else of every run."""
    runs = [r for r in read_results(path) if r["status"] == "done" and r.get("seconds") and r.get("flops")]
    if not runs:
        raise ConfigError(f"like={path} has no finished run with its seconds and FLOPs: pass a results.csv of runs "
                          f"finished on this machine")
    rate = lambda rs: statistics.median(r["seconds"] / r["flops"] for r in rs)  # noqa: E731

    def pace(residual, args, depth):
        same = [r for r in runs if r["residual"] == residual and (r["args"] or "") == args] or runs
        nearest = min({r["n_layer"] for r in same}, key=lambda d: (abs(math.log2(d / depth)), d))
        return rate([r for r in same if r["n_layer"] == nearest])
    return pace


# -----------------------------------------------------------------------------
# compute multipliers (multiplier.py): how much compute each design is worth, from a budget sweep

MULTIPLIER_DEFAULTS = dict(
    baseline=None,  # the cell each cell is measured against; None: its depth's prenorm cell, else its first
    step_times="",  # bench.py --section=steps's CSVs, one per bench run, comma-separated: adds the throughput-
    #                 adjusted multiplier on their device (3 runs or more: the drift between runs is in its interval)
    out=None,  # the figure; None: <first csv without .csv>_multiplier.png beside it, or in out/ for a CSV in results/;
    #            with depths, the frontier figure beside it (_frontier.png)
    val_bin="",  # the val split the runs evaluated on (data/<dataset>/val.bin): the lowest loss a 0-layer model can
    #              reach on its tokens bounds the depth grid's shallow end, so a best depth of 1 below it is bracketed
)


def multiplier(argv):
    """python flops.py multiplier out/<sweep>/results.csv ... [--baseline=CELL] [--step_times=CSV]: each
    cell's compute multiplier against its baseline at equal FLOPs (multiplier.py), by budget, overall and
    by depth, the compute-optimal frontier, and with step times the throughput-adjusted figure; printed,
    and the figure beside the first CSV, or --out. A CSV in results/ is a committed result: its figure goes to
    out/ unless --out names where (results/ keeps the one committed)."""
    import multiplier as mult
    files, cfg, rows = csv_verb(argv, "multiplier", MULTIPLIER_DEFAULTS, "MULTIPLIER_DEFAULTS",
                                "compute multipliers from a budget sweep's results.csv (a sweep config with "
                                "budgets = [...])", "results.csv of a budget sweep", "out/<sweep>/results.csv")
    cells = aggregate(rows)
    check_baseline(cfg["baseline"], [c["cell"] for c in cells])
    pairs = {c: b for c, b in baselines(cells, cfg["baseline"]).items() if c != b}
    if not pairs:
        text = "No cell to compare: every cell is its own depth's baseline (--baseline=CELL names one).\n"
        print(text, end="")
        return text
    floor = None
    if cfg["val_bin"]:
        tokens = {int(float(r["eval_tokens"])) for r in rows if r.get("status") == "done" and r.get("eval_tokens")}
        if len(tokens) != 1:
            raise ConfigError(f"--val_bin needs runs that all evaluated on one number of val tokens, got "
                              f"{sorted(tokens) or 'none'}: pass the CSVs of one final eval")
        if not os.path.isfile(cfg["val_bin"]):
            raise ConfigError(f"--val_bin={cfg['val_bin']}: no such file (python data/<dataset>/prepare.py writes it)")
        floor = mult.bigram_floor(cfg["val_bin"], tokens.pop())
    text, results = mult.report(rows, pairs, cfg["step_times"], floor)
    name = os.path.splitext(files[0])[0] + "_multiplier.png"
    committed = os.path.dirname(os.path.abspath(files[0])) == os.path.join(HERE, "results")
    path = cfg["out"] or (os.path.join(HERE, "out", os.path.basename(name)) if committed else name)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    mult.plot(rows, results, path)
    text += f"\nfigure: {path}\n"
    front = mult.plot_frontier(rows, pairs, re.sub(r"_multiplier$", "", os.path.splitext(path)[0]) + "_frontier.png",
                               floor)
    if front:
        text += f"frontier figure: {front}\n"
    print(text, end="")
    return text


# -----------------------------------------------------------------------------
# AdamW against Muon: does a design's gain over prenorm survive the optimizer?

OPTIMIZER_ARGS = ("--optimizer=", "--muon_")  # the keys that say how a run was optimised, not what it trains
LR_ARG = "--learning_rate="  # and the learning rate (AdamW's; under Muon, the AdamW side's)


def arg_float(args, prefix, default=None):
    """The value of the first of a run's args that starts with prefix ("--learning_rate="), as a float; else default."""
    return next((float(a[len(prefix):]) for a in args if a.startswith(prefix)), default)


def optimizer_key(row, adamw_lr=None, recipe_lr=None):
    """(optimizer, design, depth, budget) of a results row. The optimizer is its optimizer column (see
    optimizer_label; a CSV from before that column: "muon" with the muon_* keys of its args when they set
    optimizer=muon, else "adamw", the only optimizer there was), with the learning rate where the run's args set
    one: an AdamW run at adamw_lr is "adamw", one at another LR "adamw --learning_rate=X" (optimizers_table reads
    "adamw" alone); a run whose args set none ran at recipe_lr (its train config's). The design is what the run trains
    besides: residual, MoD and every other key of its args; the budget is the sweep's (its budget column to 3
    significant digits, or, in a CSV from before that column, the FLOPs the run spent to 2: a budget's last
    iteration is never over it)."""
    args = (row.get("args") or "").split()
    optimizer = row.get("optimizer")
    if not optimizer:
        defaults = {f"--{k}={run_config.DEFAULTS[k]!r}" for k in run_config.MUON_KEYS}
        muon = [a for a in args if a.startswith("--muon_") and a not in defaults]
        optimizer = " ".join(["muon", *muon]) if "--optimizer='muon'" in args else "adamw"
    lr = arg_float(args, LR_ARG)
    if optimizer == "adamw" and (recipe_lr if lr is None else lr) != adamw_lr:
        optimizer += f" {LR_ARG}{'(the recipe)' if lr is None else f'{lr:g}'}"
    elif optimizer != "adamw" and lr is not None:
        optimizer += f" {LR_ARG}{lr:g}"
    rest = " ".join(a for a in args if not a.startswith((*OPTIMIZER_ARGS, LR_ARG)))
    design = row["residual"] + (f" {rest}" if rest else "") + (f" mod={row['mod']}@{row['mod_rate']:g}" if row.get("mod") else "")
    budget = float(f"{row['budget']:.3g}") if row.get("budget") else float(f"{row['flops']:.2g}")
    return optimizer, design, row["n_layer"], budget


def gain_change(design_muon, base_muon, design_adamw, base_adamw):
    """Whether a design's Δ to the baseline differs between the optimizers: (Δ Muon) - (Δ AdamW), each Δ
    stats.compare's of two cells ({seed: loss} each). Where both Δs are paired on the same seeds, a paired
    t-test on the per-seed (Δ Muon_s - Δ AdamW_s): a seed fixes the init and the batches under both optimizers,
    so the two Δs of one seed move together. Else the two Δs as independent estimates, with the
    Welch-Satterthwaite degrees of freedom (stats.combine; with both Δs Welch's, those of the four cells).
    Returns compare()'s dict (diff, p, test, n, ...; p None where neither Δ has spread), or None when either Δ has
    nothing to test (a cell with fewer than 2 seeds). diff > 0: a smaller gain under Muon."""
    adamw, muon = stats.compare(design_adamw, base_adamw), stats.compare(design_muon, base_muon)
    if adamw is None or muon is None:
        return None
    per_seed = lambda design, base: {s: design[s] - base[s] for s in set(design) & set(base)}  # noqa: E731
    d_muon, d_adamw = per_seed(design_muon, base_muon), per_seed(design_adamw, base_adamw)
    if adamw["test"] == muon["test"] == "paired t" and set(d_muon) == set(d_adamw):
        return stats.paired(d_muon, d_adamw)
    c = stats.combine(dict(muon, value=muon["diff"]), dict(adamw, value=adamw["diff"]), sign=-1)
    return dict(diff=c["value"], ci=c["ci"], p=c["p"], se=c["se"], df=c["df"], test="Welch-Satterthwaite",
                n=(muon["n"], adamw["n"]), significant=c["p"] is not None and c["p"] < stats.ALPHA)


def optimizer_verdict(adamw, muon, p_adamw, p_muon):
    """Whether AdamW's gain over prenorm survives Muon, from each Δ's compare() and its adjusted p (< 0.05 and
    the sign); "–" where either has nothing to test (a cell with fewer than 2 seeds, or no spread)."""
    if adamw is None or muon is None or p_adamw is None or p_muon is None:
        return stats.MISSING
    word = lambda w, p: ("gain" if w["diff"] < 0 else "worse") if p < stats.ALPHA else "n.s."  # noqa: E731
    a, m = word(adamw, p_adamw), word(muon, p_muon)
    return {("gain", "gain"): "survives", ("gain", "n.s."): "n.s. under Muon", ("gain", "worse"): "reversed",
            ("n.s.", "gain"): "only under Muon"}.get((a, m), "n.s. under both" if a == m == "n.s." else f"{a} → {m}")


def optimizer_losses(rows, adamw_lr=None, recipe_lr=None):
    """{optimizer_key: {seed: final val loss}} of the finished rows, {optimizer_key: {train FLOPs per token}}, and
    the number of runs read twice (the same key and seed in two CSVs: counted once). A row without a seed is
    keyed by its run name (paired with nothing)."""
    losses, flops_per_token, twice = {}, {}, 0
    for r in rows:
        if r["status"] != "done":
            continue
        key = optimizer_key(r, adamw_lr, recipe_lr)
        seed = r["seed"] if r.get("seed") is not None else r["run"]
        if seed in losses.get(key, {}):
            twice += 1
            continue
        losses.setdefault(key, {})[seed] = r["val_loss"]
        if r.get("train_flops_per_token") is not None:
            flops_per_token.setdefault(key, set()).add(r["train_flops_per_token"])
    return losses, flops_per_token, twice


def optimizers_table(rows, baseline="prenorm", adjust="bh", adamw_lr=None, recipe_lr=None):
    """Markdown: per depth and budget, each design's final val loss under AdamW and under Muon, its
    difference to the baseline design under the same optimizer (stats.compare: paired on shared seeds),
    whether the gain survives, the change of the difference between the optimizers (gain_change), and Muon's
    own gain over AdamW for the design. Each kind of test over every table is one family, its p adjusted by
    `adjust` (stats.ADJUST); the verdicts follow the adjusted p. A design appears where both optimizers ran it,
    AdamW at adamw_lr (optimizer_key; both None: the runs that set no LR), named in each table's heading where it
    is not the recipe's."""
    losses, flops_per_token, twice = optimizer_losses(rows, adamw_lr, recipe_lr)
    tables = []  # (depth, budget, Muon's setting, designs)
    for L, budget, muon in sorted({(L, b, o) for (o, _, L, b) in losses if o.startswith("muon")}):
        designs = [d for (o, d, l, b) in losses if o == muon and (l, b) == (L, budget)
                   and ("adamw", d, L, budget) in losses]
        if baseline in designs:
            tables.append((L, budget, muon, [baseline] + sorted(d for d in dict.fromkeys(designs) if d != baseline)))
    if not tables:
        raise ConfigError(f"no depth and budget with {baseline} under both AdamW and Muon in these CSVs: pass the "
                          f"AdamW sweeps' CSVs and the Muon sweep's together (e.g. python flops.py optimizers "
                          f"results/sweep_muon_cpu_5e12.csv results/sweep_multiplier_cpu.csv)")
    tests = {}  # (family, table index, design): compare()'s dict or None
    for i, (L, budget, muon, designs) in enumerate(tables):
        get = lambda o, d: losses[(o if o == "adamw" else muon, d, L, budget)]  # noqa: E731
        for d in designs:
            # different optimizers' runs are different experiments: Muon - AdamW is Welch's, never paired
            tests[("own", i, d)] = stats.welch(list(get("muon", d).values()), list(get("adamw", d).values()))
            if d != baseline:
                tests[("adamw", i, d)] = stats.compare(get("adamw", d), get("adamw", baseline))
                tests[("muon", i, d)] = stats.compare(get("muon", d), get("muon", baseline))
                tests[("change", i, d)] = gain_change(get("muon", d), get("muon", baseline), get("adamw", d),
                                                      get("adamw", baseline))
    adjusted, family = {}, {}
    for kind in ("adamw", "muon", "change", "own"):
        keys = [k for k in tests if k[0] == kind]
        ps = stats.ADJUST[adjust]([None if tests[k] is None else tests[k]["p"] for k in keys])
        adjusted |= dict(zip(keys, ps))
        family[kind] = sum(p is not None for p in ps)
    short = stats.ADJUST_SHORT[adjust]

    def cell(key):
        w, p = tests[key], adjusted[key]
        if w is None or p is None:
            return stats.MISSING
        say = lambda x: f"< {x[1:]}" if x.startswith("<") else f"= {x}"  # noqa: E731  (fmt_p's <1e-4)
        return (f"{w['diff']:+.4f} ({stats.describe_test(w)}; p {say(stats.fmt_p(w['p']))}, {short} "
                f"{say(stats.fmt_p(p))}{' *' if p < stats.ALPHA else ''})")

    mean = lambda v: "–" if not v else f"{stats.mean_std(v)[0]:.4f}" + (  # noqa: E731
        f" ± {stats.mean_std(v)[1]:.4f}" if len(v) > 1 else "") + f" ({len(v)})"
    lines = [f"Final val loss, mean ± std (seeds), under each optimizer; Δ vs {baseline} under the same optimizer: "
             f"a paired t-test on the seeds both cells ran (Welch's where they share fewer than 2), n in brackets; a "
             f"gain is Δ < 0 at an adjusted p < 0.05 (n.s.: not significant, neither a match nor a difference). "
             f"Δ change: Δ under Muon minus Δ under AdamW (> 0: a smaller gain under Muon): a paired t-test on the "
             f"per-seed differences of the two Δs where both are paired on the same seeds, else Welch-Satterthwaite "
             f"over the two Δs. Muon − AdamW: the design's loss under Muon minus under AdamW (Welch: different "
             f"runs). p is each test's own; {short} is p adjusted by {stats.ADJUST_NAMES[adjust]} over its family, "
             f"the same column of every table below: {family['adamw']} Δs under AdamW, {family['muon']} under Muon, "
             f"{family['change']} Δ changes, {family['own']} Muon − AdamW; * and the verdicts follow the adjusted p "
             f"(< 0.05)." + (f" {twice} run(s) read twice counted once." if twice else "")]
    for i, (L, budget, muon, designs) in enumerate(tables):
        get = lambda o, d: losses[(o if o == "adamw" else muon, d, L, budget)]  # noqa: E731
        lines += ["", f"**{L} layers, {budget:.3g} FLOPs**" + (f" (Muon: {muon[5:]})" if muon != "muon" else "")
                  + (f" (AdamW at LR {adamw_lr:g})" if adamw_lr != recipe_lr else ""), "",
                  f"| design | AdamW | Δ vs {baseline} (AdamW) | Muon | Δ vs {baseline} (Muon) | the gain | "
                  f"Δ change | Muon − AdamW |", "|" + "---|" * 8]
        notes = []
        for d in designs:
            a, m = get("adamw", d).values(), get("muon", d).values()
            if d == baseline:
                lines.append(f"| {d} | {mean(list(a))} | – | {mean(list(m))} | – | baseline | – "
                             f"| {cell(('own', i, d))} |")
            else:
                verdict = optimizer_verdict(tests[("adamw", i, d)], tests[("muon", i, d)], adjusted[("adamw", i, d)],
                                            adjusted[("muon", i, d)])
                lines.append(f"| {d} | {mean(list(a))} | {cell(('adamw', i, d))} | {mean(list(m))} | "
                             f"{cell(('muon', i, d))} | {verdict} | {cell(('change', i, d))} | {cell(('own', i, d))} |")
            fpt = {o: flops_per_token.get((o if o == "adamw" else muon, d, L, budget), set())
                   for o in ("adamw", "muon")}
            if fpt["adamw"] and fpt["muon"] and fpt["adamw"] != fpt["muon"]:
                show = lambda v: " / ".join(f"{x:,.0f}" for x in sorted(v))  # noqa: E731
                notes.append(f"note: {d}: train FLOPs per token {show(fpt['adamw'])} (AdamW runs) against "
                             f"{show(fpt['muon'])} (Muon runs): the two optimizers' runs came from different code")
        lines += [""] + notes if notes else []
    changes = [(k, tests[k], adjusted[k]) for k in tests if k[0] == "change" and tests[k] is not None]
    larger = sum(w["diff"] < 0 for _, w, _ in changes)
    smaller = sum(w["diff"] > 0 for _, w, _ in changes)
    raw = [k for k, w, _ in changes if w["p"] is not None and w["p"] < stats.ALPHA]
    survive = [k for k, _, p in changes if p is not None and p < stats.ALPHA]
    name = lambda k: f"{k[2]} at {tables[k[1]][0]} layers, {tables[k[1]][1]:.3g} FLOPs" + (  # noqa: E731
        f" (Muon: {tables[k[1]][2][5:]})" if tables[k[1]][2] != "muon" else "")
    settings = " × Muon setting" if len({t[2] for t in tables}) > 1 else ""
    lines += ["", f"Over all {len(tables)} tables (depth × budget{settings}): of the {len(changes)} design cells "
                  f"with a Δ change, the Δ is lower under Muon than under AdamW (a larger gain, or a smaller loss) in "
                  f"{larger} and higher in {smaller}; {len(raw)} change test(s) have p < 0.05, {len(survive)} of the "
                  f"{family['change']} survive {stats.ADJUST_NAMES[adjust]} (adjusted p < 0.05)"
                  + (": " + ", ".join(map(name, survive)) if survive else "") + "."]
    return "\n".join(lines) + "\n"


def lr_check_table(rows, check_rows, chosen, adamw_lr=None):
    """Markdown: whether each evaluated cell ran at its best learning rate. check_rows: an LR check's runs (one
    seed each; config/sweep_lr_check_cpu.py), several LRs per design and optimizer at one depth and budget;
    rows: the evaluated cells' runs (optimizers_table's). Per design and optimizer: the loss at each LR, the
    best, the evaluated cells' LR (chosen: {optimizer: LR}) and its gap to the best, and whether that gap is
    within noise: below t(0.975, seeds - 1) x sqrt(2) x the evaluated cell's seed sd, the 95% band of a
    difference between two single runs (unpaired, so a wide band: a gap outside it is off the best). adamw_lr:
    the AdamW cells compared ran at it (optimizers_table's), not at chosen's, the recipe's."""
    losses, _, _ = optimizer_losses(rows, adamw_lr or chosen["adamw"], chosen["adamw"])
    check = {}  # (optimizer, design, depth, budget): {lr: loss}
    for r in check_rows:
        if r["status"] != "done":
            continue
        args = (r.get("args") or "").split()
        opt = "muon" if "--optimizer='muon'" in args else "adamw"
        flag = "--muon_lr=" if opt == "muon" else LR_ARG
        lr = arg_float(args, flag, chosen[opt])
        design, L, budget = optimizer_key(r)[1:]  # the LR is the optimizer's, not the design's
        check.setdefault((opt, design, L, budget), {})[lr] = r["val_loss"]
    if not check:
        raise ConfigError("--lr_check: no finished run in it (python flops.py sweep config/sweep_lr_check_cpu.py "
                          "writes one)")
    chosen = chosen | ({"adamw": adamw_lr} if adamw_lr else {})  # what the compared cells ran
    lines = ["", f"The learning rate: each design's final val loss at each LR of the check (one run each, seed "
             f"unshared with the cells), the best LR ('edge': the lowest or highest tried), the LR the evaluated "
             f"cells ran ({', '.join(f'{o} {v:g}' for o, v in chosen.items())}) and its gap to the best; within "
             f"noise: a gap below t(0.975, seeds - 1) x sqrt(2) x the evaluated cell's seed sd at this depth and "
             f"budget (two single runs, unpaired: a generous band).", "",
             "| design | optimizer | depth, budget | loss at each LR | best LR | chosen LR | gap | noise band (seeds) "
             "| verdict |", "|" + "---|" * 9]
    verdicts = []
    for (opt, design, L, budget), by_lr in sorted(check.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        best = min(by_lr, key=by_lr.get)
        edge = " (edge)" if best in (min(by_lr), max(by_lr)) and len(by_lr) > 2 else ""
        c = chosen[opt]
        evaluated = list(losses.get((opt, design, L, budget), {}).values())  # the compared cell's seeds
        sd, n = (stats.mean_std(evaluated)[1], len(evaluated)) if evaluated else (None, 0)
        band = None if not sd else stats.t_quantile(n - 1) * math.sqrt(2) * sd
        if c not in by_lr:
            gap, verdict = None, f"the chosen LR {c:g} is not in the check"
        else:
            gap = by_lr[c] - by_lr[best]
            verdict = ("the best" if c == best else "no evaluated cell: no band" if band is None else
                       "within noise" if gap <= band else "off its best LR")
        verdicts.append(verdict)
        shown = ", ".join(f"{lr:g}: {by_lr[lr]:.4f}" for lr in sorted(by_lr))
        lines.append(f"| {design} | {opt} | {L} layers, {budget:.3g} | {shown} | {best:g}{edge} | {c:g} | "
                     f"{'-' if gap is None else f'{gap:+.4f}'} | {'-' if band is None else f'{band:.4f} ({n})'} | "
                     f"{verdict} |")
    count = collections.Counter(verdicts)
    lines += ["", "Over the check: " + ", ".join(f"{n} {v}" for v, n in count.most_common()) + "."]
    return "\n".join(lines) + "\n"


OPTIMIZERS_DEFAULTS = dict(
    baseline="prenorm",  # the design each other is compared with under the same optimizer (its residual and keys)
    adjust="bh",  # each family's p adjusted for its number of tests: bh (Benjamini-Hochberg, FDR) or holm
    lr_check="",  # an LR check's results.csv (config/sweep_lr_check_cpu.py): adds whether each cell ran at its best LR
    chosen_lr="adamw=0.001,muon=0.02",  # the LRs the evaluated cells ran (config/shakespeare_char_cpu.py's
    #                                     learning_rate; config/sweep_muon_cpu.py's muon_lr)
    adamw_lr=0.0,  # > 0: compare with the AdamW runs at this learning rate (e.g. the LR check's best, which
    #                config/sweep_muon_adamw_best_lr_cpu.py's cells set); 0: chosen_lr's adamw, the recipe's
)


def optimizers(argv):
    """python flops.py optimizers results.csv ... [--baseline=DESIGN] [--adjust=bh|holm]: optimizers_table,
    printed."""
    files, cfg, rows = csv_verb(argv, "optimizers", OPTIMIZERS_DEFAULTS, "OPTIMIZERS_DEFAULTS",
                                "AdamW against Muon: each design's gain over prenorm under both, from results.csv "
                                "files of both optimizers' sweeps", "results.csv files",
                                "results/sweep_muon_cpu_5e12.csv results/sweep_multiplier_cpu.csv")
    check_adjust(cfg["adjust"])
    if not isinstance(cfg["adamw_lr"], (int, float)) or cfg["adamw_lr"] < 0:
        raise ConfigError(f"--adamw_lr={cfg['adamw_lr']!r}: give a learning rate (e.g. 0.002), or 0 for the recipe's")
    try:
        chosen = {o: float(v) for o, v in (item.split("=") for item in cfg["chosen_lr"].split(","))}
    except ValueError:
        raise ConfigError(f"--chosen_lr={cfg['chosen_lr']}: give optimizer=LR pairs, e.g. adamw=0.001,muon=0.02")
    if set(chosen) != {"adamw", "muon"}:
        raise ConfigError(f"--chosen_lr={cfg['chosen_lr']}: give both optimizers' LRs, e.g. adamw=0.001,muon=0.02")
    adamw_lr = float(cfg["adamw_lr"]) or chosen["adamw"]
    text = optimizers_table(rows, cfg["baseline"], cfg["adjust"], adamw_lr, chosen["adamw"])
    if cfg["lr_check"]:
        text += lr_check_table(rows, read_results(cfg["lr_check"]), chosen, adamw_lr)
    print(text, end="")
    return text


COMMANDS = """flops.py: FLOP counts and iso-FLOP sweeps, six commands:
    python flops.py [config/x.py ...] [--key=value ...]       FLOPs per token by component, params, what --budget buys (keys below)
    python flops.py sweep config/sweep_<name>.py [--key=value]  train.py runs at a FLOP budget (or budgets), results.csv/.md/.png (python flops.py sweep --help: its keys)
    python flops.py results out/<sweep>/results.csv ...        a sweep's tables again from its CSVs (python flops.py results --help: its keys)
    python flops.py plan config/sweep_<name>.py [--gpu=H100]  what a sweep costs: its runs, FLOPs and hours on one GPU
    python flops.py multiplier out/<sweep>/results.csv ...     compute multipliers of a budgets sweep (by budget, depth, frontier), and a figure
    python flops.py optimizers a.csv b.csv ...                 AdamW against Muon: each design's gain over prenorm under both"""


def main(argv):
    if ("--help" in argv or "-h" in argv) and argv[:1] not in (["sweep"], ["plan"], ["results"], ["multiplier"],
                                                              ["optimizers"]):
        print(COMMANDS)  # the commands; configure then lists the breakdown's keys and exits
    commands = ("sweep", "plan", "results", "multiplier", "optimizers")
    if argv and not argv[0].startswith("-") and argv[0] not in commands and "=" not in argv[0] \
            and not os.path.exists(argv[0]):
        raise ConfigError(f"'{argv[0]}' is neither a command ({', '.join(commands)}) nor a config file; "
                          f"python flops.py --help lists the commands")
    if argv[:1] == ["results"]:
        return results(argv[1:])
    if argv[:1] == ["multiplier"]:
        return multiplier(argv[1:])
    if argv[:1] == ["optimizers"]:
        return optimizers(argv[1:])
    if argv[:1] in (["plan"], ["sweep"]) and all(a.startswith("--") for a in argv[1:]) and "--help" not in argv:
        # the defaults alone: an unnamed sweep (hours of runs, or the plan of one nobody asked for)
        shipped = sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, "config", "sweep_*.py")))
        raise ConfigError(f"flops.py {argv[0]} needs a sweep config: python flops.py {argv[0]} "
                          f"config/sweep_<name>.py, one of {', '.join(shipped)}")
    if argv[:1] == ["plan"]:
        return plan(argv[1:])
    if argv[:1] == ["sweep"]:
        return run_sweep(argv[1:])
    return breakdown(argv)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except ConfigError as e:
        sys.exit(f"error: {e}")
