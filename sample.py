"""
Sample from a trained nanodepth model.

    python sample.py --out_dir=out-shakespeare-char-cpu
    python sample.py --out_dir=out-shakespeare-char-cpu --start="ROMEO:" --num_samples=3 --temperature=0.7
    python sample.py --out_dir=out-gpt2-owt --start=FILE:prompt.txt
    python sample.py --out_dir=out-nag-mod --kv_cache=False   # recompute the context every token (comparison)
    python sample.py --out_dir=out-nag-mod --kernels=torch    # the plain PyTorch references (a run setting)

The text is encoded and decoded with the vocabulary the checkpoint carries, whatever the dataset's
meta.pkl holds now (a checkpoint from before checkpoints carried it: that meta.pkl, or gpt2 BPE); a
checkpoint whose bytes changed on disk is refused (run_config.load_checkpoint checks its checksums).

Generation uses a per-layer KV cache by default (kv_cache=True). tokens/s goes to stderr, and for a
Mixture-of-Depths model (mod != none) so does the realised skip rate of every sublayer per new token:
for each token sampled, whether the position it was sampled from (the prompt's last token, then each
new token in turn) ran that sublayer (eval routing: a token runs sublayer l iff its score >= tau_l; a
sublayer whose tau is nan runs every token). Routing is causal, so the rate is the same with and
without the cache while the context fits in block_size: recomputing the context runs its earlier
tokens again, and those runs are not counted.

kv_cache=False gives the same text for the same seed while the prompt and the new tokens fit in
block_size: both draw one random number per token, from logits equal up to float rounding. Past
block_size the texts part, because the contexts do: a full cache restarts from the last
block_size / 2 tokens, while recomputing reads the last block_size tokens (model.generate).
"""

import contextlib
import os
import sys
import time

import torch

from configurator import ConfigError, configure
from kernels import IMPLS
from run_config import (KERNELS_ON_CPU, load_checkpoint, load_codec, model_from_checkpoint, pick_device,
                        sublayer_names)

ABOUT = ("sample.py: prints text sampled from a trained model; it needs the run's folder, --out_dir=DIR "
         "(where train.py wrote DIR/ckpt.pt)")

DEFAULTS = dict(
    out_dir="out",  # the checkpoint is out_dir/ckpt.pt
    start="\n",  # the prompt, or FILE:path to read it from a file
    num_samples=3,  # samples drawn one after another from the same prompt
    max_new_tokens=500,  # tokens generated per sample
    temperature=0.8,  # 1.0 = the model's distribution, < 1 sharper, 0 = greedy
    top_k=200,  # keep only the top_k most likely tokens (None: all)
    seed=1337,  # torch's seed: the same seed gives the same text (see kv_cache)
    device="auto",  # auto (the GPU if there is one, else the CPU), cpu, cuda, cuda:1, ...
    dtype="auto",  # auto (bf16 or fp16 autocast on a GPU, fp32 on the CPU), float32, bfloat16, float16
    kernels=None,  # None: the checkpoint's; auto | triton | torch (a run setting, as in train.py)
    compile=False,  # removed: True is an error (generation runs eagerly; see main)
    kv_cache=True,  # False: recompute the whole (cropped) context for every new token; see the docstring
)


def whole(value, least):
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def check(cfg):
    """The sampling keys: a value generate() cannot take is a one-line ConfigError that names the fix."""
    if cfg["compile"]:  # it used to compile a module that generate() never ran
        raise ConfigError("sample.py no longer takes --compile=True: generation runs eagerly (the KV-cache step "
                          "changes shape every token); drop --compile")
    for key, example in (("num_samples", 3), ("max_new_tokens", 500)):
        if not whole(cfg[key], 1):
            raise ConfigError(f"{key} must be a whole number >= 1, got {cfg[key]!r} (e.g. --{key}={example})")
    t = cfg["temperature"]
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < float("inf"):
        raise ConfigError(f"temperature must be a number >= 0 (0: greedy, 1: the model's distribution), got {t!r} "
                          f"(e.g. --temperature=0.8)")
    if cfg["top_k"] is not None and not whole(cfg["top_k"], 1):
        raise ConfigError(f"top_k must be a whole number >= 1 or None (all tokens), got {cfg['top_k']!r} "
                          f"(e.g. --top_k=200; --top_k=None keeps every token)")
    if cfg["kernels"] is not None and cfg["kernels"] not in IMPLS:
        raise ConfigError(f"unknown kernels {cfg['kernels']!r}; valid: {', '.join(IMPLS)}")


def main(argv):
    cfg = configure(argv, DEFAULTS, [(__file__, "DEFAULTS")], ABOUT)  # --help prints DEFAULTS' comments
    check(cfg)
    device, cfg["dtype"], autocast = pick_device(cfg["device"], cfg["dtype"])
    torch.manual_seed(cfg["seed"])

    ckpt = load_checkpoint(os.path.join(cfg["out_dir"], "ckpt.pt"), device, reader=True)
    model = model_from_checkpoint(ckpt, device, **({"kernels": cfg["kernels"]} if cfg["kernels"] else {}))
    config = model.config
    if config.kernels == "triton" and device.type == "cpu":
        print(KERNELS_ON_CPU, file=sys.stderr)
    encode, decode = load_codec(ckpt)

    start = cfg["start"]
    if start.startswith("FILE:"):
        try:
            with open(start[5:], "r", encoding="utf-8") as f:
                start = f.read()
        except OSError as e:
            raise ConfigError(f"cannot read the prompt file {start[5:]!r}: {e.strerror}; "
                              f"pass --start=FILE:path of a readable text file") from None
        except UnicodeDecodeError:
            raise ConfigError(f"the prompt file {start[5:]!r} is not UTF-8 text; "
                              f"pass --start=FILE:path of a UTF-8 text file") from None
    ids = encode(start)
    if not ids:
        raise ConfigError("the prompt is empty: pass --start=TEXT or --start=FILE:path")
    x = torch.tensor(ids, dtype=torch.long, device=device)[None, ...]

    t0, n_new = time.time(), 0
    ran = []  # per new token: [n_sublayers] whether the position it was sampled from ran each sublayer
    with torch.no_grad(), autocast, last_position_routing(model, x.size(0), ran):
        for _ in range(cfg["num_samples"]):
            y = model.generate(x, cfg["max_new_tokens"], temperature=cfg["temperature"], top_k=cfg["top_k"],
                               kv_cache=cfg["kv_cache"])
            n_new += y.size(1) - x.size(1)
            print(decode(y[0].tolist()))
            print("---------------")
    dt = time.time() - t0
    how = "KV cache" if cfg["kv_cache"] else "no KV cache: the context recomputed per token"
    print(f"{n_new} tokens in {dt:.2f}s ({n_new / max(dt, 1e-9):.0f} tokens/s, {how})", file=sys.stderr)
    if config.mod != "none" and ran:
        executed = [sum(float(r[l]) for r in ran) for l in range(config.n_sublayers)]
        print(skip_rate_line(executed, len(ran) * x.size(0)), file=sys.stderr)


@contextlib.contextmanager
def last_position_routing(model, batch, ran):
    """Within the block, each forward pass of the model (a generate() step, with the KV cache or without)
    records its routes, as routing() has it (an instance attribute shadows GPT.new_context; model.py is
    untouched); on leaving, `ran` gets a list per pass, per sublayer, of how many of the batch's rows ran it
    at their last position: the position whose logits the next token is sampled from."""
    made, new_context = [], model.new_context

    def recording_context(*args, **kwargs):
        ctx = new_context(*args, **kwargs)
        ctx.routes = {}
        made.append(ctx)
        return ctx
    model.new_context = recording_context
    try:
        yield
    finally:
        del model.new_context
    for ctx in made:
        T, routes = ctx.tokens // batch, ctx.routes
        ran.append([batch if routes.get(l) is None or routes[l].idx is None else
                    int(routes[l].ran(batch, T, routes[l].idx.device)[:, -1].sum()) for l in range(len(model.sublayers))])


def skip_rate_line(executed, tokens):
    """'skip rate per new token, per sublayer: attn1 0.25 mlp1 0.31 ... (mean 0.28)' from the number of
    new tokens and how many of them each sublayer ran."""
    rates = [1.0 - e / tokens for e in executed]
    parts = " ".join(f"{name} {r:.2f}" for name, r in zip(sublayer_names(len(rates)), rates))
    return f"skip rate per new token, per sublayer: {parts} (mean {sum(rates) / len(rates):.3f})"


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except ConfigError as e:
        sys.exit(f"error: {e}")
