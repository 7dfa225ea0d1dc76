"""
Sample from a trained nanodepth model.

    python sample.py --out_dir=out-shakespeare-char-cpu
    python sample.py --out_dir=out-shakespeare-char-cpu --start="ROMEO:" --num_samples=3 --temperature=0.7
    python sample.py --out_dir=out-gpt2-owt --start=FILE:prompt.txt
    python sample.py --out_dir=out-nag-mod --kv_cache=False   # recompute the context every token (comparison)
    python sample.py --out_dir=out-nag-mod --kernels=torch    # the plain PyTorch references (a run setting)

Generation uses a per-layer KV cache by default (kv_cache=True). tokens/s goes to stderr, and for a
Mixture-of-Depths model (mod != none) so does the realised skip rate of every sublayer, 1 - executed /
tokens over everything generated (eval routing: a token runs sublayer l iff its score >= tau_l; a
sublayer whose tau is nan runs every token).

kv_cache=False gives the same text for the same seed while the prompt and the new tokens fit in
block_size: both draw one random number per token, from logits equal up to float rounding. Past
block_size the texts part, because the contexts do: a full cache restarts from the last
block_size / 2 tokens, while recomputing reads the last block_size tokens (model.generate).
"""

import os
import sys
import time

import torch

from configurator import ConfigError, configure
from kernels import IMPLS
from run_config import load_checkpoint, load_codec, model_from_checkpoint, pick_device, sublayer_names

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


def main(argv):
    cfg = configure(argv, DEFAULTS, [(__file__, "DEFAULTS")])  # --help prints DEFAULTS' comments
    if cfg["compile"]:  # it used to compile a module that generate() never ran
        raise ConfigError("sample.py no longer takes --compile=True: generation runs eagerly (the KV-cache step "
                          "changes shape every token); drop --compile")
    device, cfg["dtype"], autocast = pick_device(cfg["device"], cfg["dtype"])
    torch.manual_seed(cfg["seed"])

    ckpt = load_checkpoint(os.path.join(cfg["out_dir"], "ckpt.pt"), device)
    if cfg["kernels"] is not None and cfg["kernels"] not in IMPLS:
        raise ConfigError(f"unknown kernels {cfg['kernels']!r}; valid: {', '.join(IMPLS)}")
    model = model_from_checkpoint(ckpt, device, **({"kernels": cfg["kernels"]} if cfg["kernels"] else {}))
    config = model.config
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
    executed, processed = [0.0] * config.n_sublayers, 0  # tokens run per sublayer; tokens processed
    with torch.no_grad(), autocast:
        for _ in range(cfg["num_samples"]):
            y = model.generate(x, cfg["max_new_tokens"], temperature=cfg["temperature"], top_k=cfg["top_k"],
                               kv_cache=cfg["kv_cache"])
            stats = model.generate_stats
            executed = [a + float(b) for a, b in zip(executed, stats["executed"])]
            processed += stats["tokens"]
            n_new += y.size(1) - x.size(1)
            print(decode(y[0].tolist()))
            print("---------------")
    dt = time.time() - t0
    how = "KV cache" if cfg["kv_cache"] else "no KV cache: the context recomputed per token"
    print(f"{n_new} tokens in {dt:.2f}s ({n_new / max(dt, 1e-9):.0f} tokens/s, {how})", file=sys.stderr)
    if config.mod != "none" and processed:
        print(skip_rate_line(executed, processed), file=sys.stderr)


def skip_rate_line(executed, tokens):
    """'skip rate per sublayer: attn1 0.25 mlp1 0.31 ... (mean 0.28)' from the tokens each sublayer ran."""
    rates = [1.0 - e / tokens for e in executed]
    parts = " ".join(f"{name} {r:.2f}" for name, r in zip(sublayer_names(len(rates)), rates))
    return f"skip rate per sublayer: {parts} (mean {sum(rates) / len(rates):.3f})"


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except ConfigError as e:
        sys.exit(f"error: {e}")
