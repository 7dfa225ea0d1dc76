"""
Post-training Mixture-of-Depths trade-off of a NAG model: val loss vs executed forward FLOPs,
with no retraining.

    python tradeoff.py --out_dir=out-nag
    python tradeoff.py --out_dir=out-nag --eval_iters=20 --batch_size=8 --skip_rates=0,0.1,0.2,0.3,0.5
    python tradeoff.py --out_dir=out-nag --out_file=plots/nag_L8    # plots/nag_L8.csv and .png

It takes out_dir/ckpt.pt of a residual=nag model, trained dense (mod=none) or with mod=nag at any
mod_rate, and rebuilds it as mod=nag with mod_rate 0: the same weights, plus the thresholds tau (a
buffer that a dense checkpoint does not have). In eval mode a token runs sublayer l iff its score
a_l = alpha_l m_l(r) >= tau_l, where a_l is the tangent of the rotation that sublayer would apply to
it (NAG's modulator: no router is needed); tau_l = nan runs every token.

Method: thresholds from quantiles of the scores on `calib_iters` val batches (drawn with another seed
than the evaluation batches); q = 0 is dense (tau = nan).
- calibration="global" (default): one threshold for every sublayer, the q-quantile of all
  sublayers' scores of a dense pass pooled. a_l is the same physical quantity everywhere (the
  tangent of a rotation of the unit direction), so a token skips exactly the sublayers that would
  turn it least, wherever they are; the realised skip rate lands near q.
- calibration="routed": per-sublayer quantiles, set in depth order during one forward pass, so
  sublayer l's quantile is taken over the scores it sees with sublayers < l already skipping; every
  sublayer then skips a fraction q of the tokens, even where every rotation is large.
- calibration="dense": per-sublayer quantiles from a dense pass (drifts from q as skips change
  the stream).
On the 8-layer CPU model of the README, global thresholds cost far less loss per FLOP saved than
per-sublayer ones (see README, "Mixture-of-Depths").

Each q is then evaluated in eval mode on the same `eval_iters` val batches (train.py's estimate_loss
batches: seed EVAL_SEED, so the q = 0 loss is the dense val loss train.py logs for the same
batch_size and eval_iters): the mean loss, the realised executed fraction of every sublayer
(model.py's executed_fraction of each forward's counts, averaged over the batches) and the executed forward FLOPs per token,
sum(flops.forward_flops(config, exec_frac).values()). A mod=nag checkpoint whose training left finite
thresholds also gets a row for its own tau ("checkpoint").

Output: a table with progress on stdout, and <out_file>.csv and <out_file>.png (val loss vs
executed forward FLOPs per token, the dense point marked); out_file defaults to out_dir/tradeoff.
"""

import contextlib
import csv
import math
import os
import sys
import time

import torch

from configurator import ConfigError, configure
from flops import forward_flops
from model import GPT, GPTConfig, executed_fraction
from run_config import (EVAL_SEED, check_same_dataset, find_data, get_batch, load_checkpoint, pick_device,
                        sublayer_names)

DEFAULTS = dict(
    out_dir="out",  # the checkpoint is out_dir/ckpt.pt
    out_file=None,  # prefix of the .csv and .png (None: out_dir/tradeoff)
    skip_rates=[0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5],  # target fractions q of skipped (token, sublayer) pairs
    eval_iters=20,  # val batches per skip rate (the same batches for every q)
    batch_size=None,  # None: the checkpoint's training batch_size
    calib_iters=4,  # val batches the thresholds are calibrated on
    calibration="global",  # global | routed | dense, or several with commas: one curve each (see the docstring)
    dataset=None,  # None: the checkpoint's
    data_dir=None,  # None: the checkpoint's
    device="auto",  # auto (the GPU if there is one, else the CPU), cpu, cuda, cuda:1, ...
    dtype="auto",  # auto: bf16 autocast on a GPU that has it, fp16 on one that has not, fp32 on the CPU
)
ABOUT = ("tradeoff.py: val loss against executed FLOPs when a trained residual=nag model skips sublayers by "
         "thresholds on its modulator, no retraining; it needs the run's folder, --out_dir=DIR (DIR/ckpt.pt, "
         "dense or --mod=nag), and its dataset")
CALIB_SEED = EVAL_SEED + 1  # calibration batches differ from the evaluation batches
CALIBRATIONS = ("global", "routed", "dense")
LABELS = {"global": "one threshold for all sublayers", "routed": "per-sublayer quantiles (routed)",
          "dense": "per-sublayer quantiles (dense pass)"}


# -----------------------------------------------------------------------------
# the model

def load_nag_model(path, device):
    """The checkpoint's model rebuilt as mod=nag, mod_rate 0 (thresholds nan: dense), eval mode.
    Returns (model, the checkpoint's tau or None, the checkpoint)."""
    ckpt = load_checkpoint(path, device, reader=True)
    args = dict(ckpt["model_args"])
    residual, mod = args.get("residual", "prenorm"), args.get("mod", "none")
    out_dir = os.path.dirname(path)
    if mod in ("router", "skip_middle"):  # trained to skip by its own router or gates: nothing to calibrate here
        raise ConfigError(f"{path} is a mod={mod} model, which routes by its own trained "
                          f"{'router' if mod == 'router' else 'gates'}: the trade-off calibrates thresholds on a "
                          f"residual=nag model's modulator instead; for this one, python sample.py "
                          f"--out_dir={out_dir} prints its skip rate" + (f" and python plot.py routing {out_dir} "
                                                                        f"draws its routing" if mod == "router" else ""))
    if residual != "nag":
        raise ConfigError(f"{path} is a residual={residual} model: the trade-off needs residual=nag, because "
                          f"the skip score is the NAG modulator's tangent a_l = alpha_l m_l(r): pass the --out_dir "
                          f"of a run trained with --residual=nag (dense, or with --mod=nag)")
    if mod not in ("none", "nag"):
        raise ConfigError(f"{path} was trained with mod={mod}; the trade-off needs mod=none or mod=nag")
    args.update(mod="nag", mod_rate=0.0, dropout=0.0)
    try:
        config = GPTConfig(**args)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"the model_args of {path} do not make a model here ({e})") from None
    model = GPT(config)
    missing, unexpected = model.load_state_dict(ckpt["model"], strict=False)
    lacking = sorted(set(missing) - {"mod.tau"})  # a dense checkpoint has no thresholds: they start nan
    if unexpected or lacking:
        raise ConfigError(f"{path} does not match a residual=nag model: missing keys {lacking}, "
                          f"unexpected keys {sorted(unexpected)} (only mod.tau may be missing)")
    trained_tau = None
    if "mod.tau" not in missing and torch.isfinite(model.mod.tau).any():
        trained_tau = model.mod.tau.detach().clone()
    model.mod.tau.fill_(float("nan"))
    return model.to(device).eval(), trained_tau, ckpt


@contextlib.contextmanager
def score_hook(model, fn):
    """Within the block, every NAGMoD.score(stream, state, x, l) call also runs fn(l, score) before
    the routing reads tau[l] (model.py is untouched: an instance attribute shadows the method)."""
    mod, original = model.mod, model.mod.score

    def score(stream, state, x, l):
        s = original(stream, state, x, l)
        fn(l, s)
        return s
    mod.score = score
    try:
        yield
    finally:
        del mod.score


def quantile(scores, q):
    """The threshold tau that skips (score < tau) the fraction of the scores nearest to q. Scores can
    tie (the first sublayer's depends on the token id alone), and tied tokens all run or all skip: of
    the two thresholds around the q-quantile's tie group, the one whose skipped fraction is nearer q."""
    s = scores.flatten().float().sort().values
    n, target = s.numel(), q * s.numel()
    tau = s[min(n - 1, int(round(target)))]
    below = int(torch.searchsorted(s, tau, right=False))  # skipped with tau
    upto = int(torch.searchsorted(s, tau, right=True))  # skipped with the next distinct value
    if upto < n and upto - target < target - below:
        tau = s[upto]
    return tau


@torch.no_grad()
def calibrate(model, X, rates, how, autocast):
    """tau [2L] for every q in rates (q = 0: all nan) from the calibration tokens X [N, T]. Sublayers
    not yet calibrated have tau = -inf: every token runs them, through the routed path, which scores."""
    n, nan, everyone = model.config.n_sublayers, float("nan"), float("-inf")
    taus = {}
    if how == "dense":
        scores = [None] * n

        def keep(l, s):
            scores[l] = s.detach()
        model.mod.tau.fill_(everyone)
        with score_hook(model, keep), autocast:
            model(X)
        for q in rates:
            taus[q] = torch.tensor([quantile(s, q).item() for s in scores]) if q > 0 else torch.full((n,), nan)
        model.mod.tau.fill_(nan)
        return taus
    if how == "global":
        scores = []
        model.mod.tau.fill_(everyone)
        with score_hook(model, lambda l, s: scores.append(s.detach().flatten())), autocast:
            model(X)
        pooled = torch.cat(scores)
        for q in rates:
            taus[q] = torch.full((n,), quantile(pooled, q).item() if q > 0 else nan)
        model.mod.tau.fill_(nan)
        return taus
    for q in rates:
        if q == 0:
            taus[q] = torch.full((n,), nan)
            continue

        def set_tau(l, s, q=q):  # before sublayer l routes: its quantile under the skips of sublayers < l
            model.mod.tau[l] = quantile(s, q)
        model.mod.tau.fill_(everyone)
        with score_hook(model, set_tau), autocast:
            model(X)
        taus[q] = model.mod.tau.detach().cpu().clone()
    model.mod.tau.fill_(nan)
    return taus


@torch.no_grad()
def evaluate(model, batches, tau, autocast):
    """(mean val loss, executed fraction per sublayer averaged over the batches) with thresholds tau."""
    model.mod.tau.copy_(tau.to(model.mod.tau.device))
    losses, frac = [], [0.0] * model.config.n_sublayers
    for X, Y in batches:
        with autocast:
            _, loss, executed = model(X, Y, executed=True)
        losses.append(loss.item())
        frac = [a + b for a, b in zip(frac, executed_fraction(executed, X.numel()))]
    return sum(losses) / len(losses), [f / len(batches) for f in frac]


# -----------------------------------------------------------------------------
# output

def flops_unit(x):
    for scale, name in ((1e12, "TFLOPs"), (1e9, "GFLOPs"), (1e6, "MFLOPs"), (1e3, "kFLOPs")):
        if x >= scale:
            return scale, name
    return 1.0, "FLOPs"


def write_csv(path, rows, names):
    fields = ["calibration", "skip_target", "skip_realised", "val_loss", "forward_flops_per_token",
              "flops_fraction"] + [f"exec_{n}" for n in names] + [f"tau_{n}" for n in names]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(fields)
        for r in rows:
            w.writerow([r["calibration"], "" if r["skip_target"] is None else r["skip_target"],
                        f"{r['skip_realised']:.6f}", f"{r['val_loss']:.6f}", f"{r['forward_flops_per_token']:.1f}",
                        f"{r['flops_fraction']:.6f}"] + [f"{x:.6f}" for x in r["exec_frac"]]
                       + ["nan" if math.isnan(x) else f"{x:.6g}" for x in r["tau"]])


def plot(path, rows, title):
    import matplotlib
    matplotlib.use("Agg")  # files only, so it runs on a headless box
    import matplotlib.pyplot as plt

    scale, unit = flops_unit(max(r["forward_flops_per_token"] for r in rows))
    sweep = [r for r in rows if r["skip_target"] is not None]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for method in dict.fromkeys(r["calibration"] for r in sweep):
        pts = [r for r in sweep if r["calibration"] == method]
        ax.plot([r["forward_flops_per_token"] / scale for r in pts], [r["val_loss"] for r in pts],
                marker="o", label=LABELS[method])
        for r in pts:
            ax.annotate(f"{r['skip_target']:g}", (r["forward_flops_per_token"] / scale, r["val_loss"]),
                        textcoords="offset points", xytext=(4, 4), fontsize=7)
    dense = [r for r in sweep if r["skip_target"] == 0]
    if dense:
        ax.plot([dense[0]["forward_flops_per_token"] / scale], [dense[0]["val_loss"]], marker="*",
                markersize=14, linestyle="none", color="black", label="dense", zorder=3)
    for r in rows:
        if r["calibration"] == "checkpoint":
            ax.plot([r["forward_flops_per_token"] / scale], [r["val_loss"]], marker="s", linestyle="none",
                    color="tab:red", label=f"checkpoint's tau (skip {r['skip_realised']:.2f})", zorder=3)
    ax.set_xlabel(f"executed forward {unit} per token")
    ax.set_ylabel("val loss")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -----------------------------------------------------------------------------

def check(cfg):
    rates = cfg["skip_rates"]
    if not isinstance(rates, (list, tuple)) or not rates or not all(
            isinstance(q, (int, float)) and not isinstance(q, bool) and 0 <= q < 1 for q in rates):
        raise ConfigError(f"skip_rates must be a non-empty list of numbers in [0, 1), e.g. [0,0.1,0.25], got {rates!r}")
    for key in ("eval_iters", "calib_iters"):
        if not (isinstance(cfg[key], int) and cfg[key] >= 1):
            raise ConfigError(f"{key} must be an integer >= 1, got {cfg[key]!r}")
    if cfg["batch_size"] is not None and not (isinstance(cfg["batch_size"], int) and not
                                              isinstance(cfg["batch_size"], bool) and cfg["batch_size"] >= 1):
        raise ConfigError(f"batch_size must be an integer >= 1, got {cfg['batch_size']!r}")
    methods = str(cfg["calibration"]).split(",")
    if not all(m in CALIBRATIONS for m in methods) or len(set(methods)) != len(methods):
        raise ConfigError(f"calibration must be one or more of {', '.join(CALIBRATIONS)} (comma-separated), "
                          f"got {cfg['calibration']!r}")
    return sorted(set(float(q) for q in rates)), methods


def main(argv):
    """Run the trade-off; returns the rows (dicts) it wrote to the CSV."""
    cfg = configure(argv, DEFAULTS, [(__file__, "DEFAULTS")], ABOUT)  # --help prints DEFAULTS' comments
    rates, methods = check(cfg)
    device, cfg["dtype"], autocast = pick_device(cfg["device"], cfg["dtype"])

    path = os.path.join(cfg["out_dir"], "ckpt.pt")
    model, trained_tau, ckpt = load_nag_model(path, device)
    config, names = model.config, sublayer_names(model.config.n_sublayers)
    train_cfg = ckpt.get("config", {})
    data = {"dataset": cfg["dataset"] or train_cfg.get("dataset"), "data_dir": cfg["data_dir"] or train_cfg.get("data_dir")}
    if not data["dataset"] or not data["data_dir"]:
        raise ConfigError(f"{path} does not name its dataset: pass --dataset=NAME --data_dir=DIR")
    paths, vocab_size = find_data(data, master=True)
    check_same_dataset(ckpt, data, vocab_size, "pass the data it was trained on (--data_dir, --dataset)")
    T = config.block_size
    if os.path.getsize(paths["val"]) // 2 <= T:
        raise ConfigError(f"the val split of {data['dataset']} is shorter than block_size {T} + 1 tokens")
    B = cfg["batch_size"] or train_cfg.get("batch_size") or 12
    prefix = cfg["out_file"] or os.path.join(cfg["out_dir"], "tradeoff")
    prefix = prefix[:-4] if prefix.endswith((".csv", ".png")) else prefix
    if os.path.dirname(prefix):
        os.makedirs(os.path.dirname(prefix), exist_ok=True)

    g = torch.Generator().manual_seed(EVAL_SEED)
    batches = [get_batch(paths["val"], B, T, g, device) for _ in range(cfg["eval_iters"])]
    g = torch.Generator().manual_seed(CALIB_SEED)
    X_cal = torch.cat([get_batch(paths["val"], B, T, g, device)[0] for _ in range(cfg["calib_iters"])])

    dense_flops = sum(forward_flops(config, [1.0] * config.n_sublayers).values())
    scale, unit = flops_unit(dense_flops)
    print(f"{path}: residual=nag (trained mod={ckpt['model_args'].get('mod', 'none')}), {config.n_layer} layers, "
          f"d={config.n_embd}, T={T} | {device} {cfg['dtype']} | dense forward {dense_flops / scale:.4g} {unit}/token")
    t0 = time.time()
    print(f"calibrating tau ({', '.join(methods)}) on {X_cal.size(0)} val sequences for {len(rates)} skip rates...",
          flush=True)
    runs = [(m, q, tau) for m in methods for q, tau in calibrate(model, X_cal, rates, m, autocast).items()]
    print(f"evaluating {cfg['eval_iters']} x {B} x {T} val tokens per skip rate ({time.time() - t0:.1f}s so far)")
    header = f"{'calibration':>11} {'target skip':>11} {'realised':>9} {'val loss':>9} {'fwd ' + unit + '/tok':>16} {'% dense':>8}"
    print(header)
    print("-" * len(header))
    if trained_tau is not None:
        runs.append(("checkpoint", None, trained_tau))
    rows = []
    for calibration, q, tau in runs:
        loss, frac = evaluate(model, batches, tau, autocast)
        fwd = sum(forward_flops(config, frac).values())
        row = {"calibration": calibration, "skip_target": q, "skip_realised": 1.0 - sum(frac) / len(frac),
               "val_loss": loss, "forward_flops_per_token": fwd, "flops_fraction": fwd / dense_flops,
               "exec_frac": frac, "tau": tau.tolist()}
        rows.append(row)
        target = f"{q:>11.3g}" if q is not None else f"{'checkpoint':>11}"
        print(f"{calibration:>11} {target} {row['skip_realised']:>9.3f} {loss:>9.4f} {fwd / scale:>16.4g} {100 * fwd / dense_flops:>7.1f}%",
              flush=True)
    model.mod.tau.fill_(float("nan"))

    write_csv(prefix + ".csv", rows, names)
    plot(prefix + ".png", rows, f"{os.path.basename(os.path.normpath(cfg['out_dir']))}: post-training MoD "
                                f"(nag, thresholds on a = alpha m)")
    print(f"wrote {prefix}.csv and {prefix}.png ({time.time() - t0:.1f}s)")
    return rows


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except ConfigError as e:
        sys.exit(f"error: {e}")
