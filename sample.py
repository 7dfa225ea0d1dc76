"""
Sample from a trained nanodepth model.

    python sample.py --out_dir=out-shakespeare-char-cpu
    python sample.py --out_dir=out-shakespeare-char-cpu --start="ROMEO:" --num_samples=3 --temperature=0.7
    python sample.py --out_dir=out-gpt2-owt --start=FILE:prompt.txt
"""

import os
import pickle
import sys
import time

import torch

from configurator import ConfigError, configure
from model import GPT, GPTConfig
from train import load_checkpoint

DEFAULTS = dict(
    out_dir="out",  # the checkpoint is out_dir/ckpt.pt
    start="\n",  # the prompt, or FILE:path to read it from a file
    num_samples=3,
    max_new_tokens=500,
    temperature=0.8,  # 1.0 = the model's distribution, < 1 sharper, 0 = greedy
    top_k=200,  # keep only the top_k most likely tokens (None: all)
    seed=1337,
    device="auto",
    dtype="auto",
    compile=False,
)


def load_codec(ckpt):
    """encode/decode for the checkpoint's dataset: its meta.pkl (character vocab) or gpt2 BPE."""
    cfg = ckpt.get("config", {})
    meta_path = os.path.join(cfg.get("data_dir", "data"), cfg.get("dataset", ""), "meta.pkl")
    if os.path.exists(meta_path):
        with open(meta_path, "rb") as f:
            meta = pickle.load(f)
        if "stoi" in meta:
            stoi, itos = meta["stoi"], meta["itos"]

            def encode(s):
                missing = sorted(set(c for c in s if c not in stoi))
                if missing:
                    raise ConfigError(f"the prompt has characters outside the vocabulary: {missing!r}")
                return [stoi[c] for c in s]
            return encode, lambda ids: "".join(itos[i] for i in ids)
    import tiktoken
    enc = tiktoken.get_encoding("gpt2")
    return (lambda s: enc.encode(s, allowed_special={"<|endoftext|>"})), enc.decode


def main(argv):
    cfg = configure(argv, DEFAULTS)
    if cfg["device"] == "auto":
        cfg["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(cfg["device"])
    if cfg["dtype"] == "auto":
        cfg["dtype"] = "bfloat16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "float32"
    torch.manual_seed(cfg["seed"])

    ckpt = load_checkpoint(os.path.join(cfg["out_dir"], "ckpt.pt"), device)
    model = GPT(GPTConfig(**ckpt["model_args"]))
    model.load_state_dict(ckpt["model"])
    model.eval().to(device)
    if cfg["compile"]:
        model = torch.compile(model)
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

    autocast = (torch.autocast(device_type=device.type, dtype=getattr(torch, cfg["dtype"]))
                if cfg["dtype"] != "float32" else torch.autocast(device_type=device.type, enabled=False))
    t0, n_new = time.time(), 0
    with torch.no_grad(), autocast:
        for _ in range(cfg["num_samples"]):
            y = model.generate(x, cfg["max_new_tokens"], temperature=cfg["temperature"], top_k=cfg["top_k"])
            n_new += y.size(1) - x.size(1)
            print(decode(y[0].tolist()))
            print("---------------")
    dt = time.time() - t0
    print(f"{n_new} tokens in {dt:.2f}s ({n_new / dt:.0f} tokens/s)", file=sys.stderr)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except ConfigError as e:
        sys.exit(f"error: {e}")
