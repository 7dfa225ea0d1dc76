"""
Prepare OpenWebText as nanoGPT does: download it with Hugging Face datasets, hold out 0.05% of the
documents for val, tokenize every document with tiktoken's gpt2 BPE followed by the end-of-text token,
and write all ids into uint16 train.bin (~9B tokens, ~17GB) and val.bin (~4M tokens) in shards.
Needs `pip install datasets tiktoken` and ~54GB of disk for the Hugging Face cache.
datasets and tiktoken are imported only inside the functions that need them, so the helpers are testable without.
"""
import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
DATASET = "openwebtext"
EOT = 50256  # gpt2's <|endoftext|>
NUM_SHARDS = 1024


def tokenize(text, encode, eot):
    """One document's ids followed by eot, so that documents stay separated in the flat token stream."""
    return list(encode(text)) + [eot]


def _shard_bounds(n, num_shards, index):
    """[start, end) of contiguous shard `index`: the same split as datasets' Dataset.shard(contiguous=True)."""
    div, mod = divmod(n, num_shards)
    start = div * index + min(index, mod)
    return start, start + div + (1 if index < mod else 0)


def iter_shards(token_lists, num_shards):
    """Yields num_shards contiguous, in-order shards, each as one flat int64 array of ids.
    token_lists is a sequence of id lists, or a Hugging Face Dataset with an 'ids' column."""
    for index in range(num_shards):
        if hasattr(token_lists, "shard"):  # a Dataset: let it read one shard at a time from its arrow files
            shard = token_lists.shard(num_shards=num_shards, index=index, contiguous=True).with_format("numpy")["ids"]
        else:
            start, end = _shard_bounds(len(token_lists), num_shards, index)
            shard = token_lists[start:end]
        # one int64 array per document, so empty documents or shards cannot turn the dtype into float
        yield np.concatenate([np.zeros(0, dtype=np.int64)] + [np.asarray(ids, dtype=np.int64) for ids in shard])


def _total_len(token_lists):
    if hasattr(token_lists, "shard"):
        return int(np.sum(token_lists["len"], dtype=np.uint64))  # the map stored each length: no second pass over ids
    return sum(len(ids) for ids in token_lists)


def _progress(iterable, **kwargs):
    try:
        from tqdm import tqdm  # comes with datasets; the bar is a nicety
        return tqdm(iterable, **kwargs)
    except ImportError:
        return iterable


def write_bin(token_lists, path, num_shards=NUM_SHARDS):
    """Writes every document's ids, in order, as one flat uint16 array to path; returns the token count.
    The memmap is sized first, then filled one contiguous shard at a time to bound memory."""
    total = _total_len(token_lists)
    assert total > 0, f"no tokens to write to {path}"
    num_shards = min(num_shards, len(token_lists))  # Dataset.shard() fails on empty shards: at most one per document
    tmp = f"{path}.tmp"  # renamed at the end, so a failed or killed run leaves no plausible-looking .bin
    arr = np.memmap(tmp, dtype=np.uint16, mode="w+", shape=(total,))
    try:
        idx = 0
        for ids in _progress(iter_shards(token_lists, num_shards), total=num_shards, desc=f"writing {path}"):
            if len(ids) and (ids.min() < 0 or ids.max() >= 2 ** 16):
                bad = ids[(ids < 0) | (ids >= 2 ** 16)][0]
                raise ValueError(f"token id {bad} does not fit in uint16: ids must be in [0, 65536)")
            if idx + len(ids) > total:
                raise AssertionError(f"shards hold more than the {total} tokens of the documents")
            arr[idx:idx + len(ids)] = ids
            idx += len(ids)
        if idx != total:
            raise AssertionError(f"shards held {idx} tokens, the documents {total}")
        arr.flush()
    except BaseException:
        del arr
        os.remove(tmp)
        raise
    del arr
    os.replace(tmp, path)
    return total


def load_gpt2():
    """tiktoken's gpt2 Encoding; tiktoken downloads the BPE files on first use."""
    try:
        import tiktoken
    except ImportError:
        raise RuntimeError("openwebtext needs tiktoken for the gpt2 BPE: pip install tiktoken") from None
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # tiktoken is there: what failed is fetching (or reading) its BPE files
        raise RuntimeError(f"tiktoken could not load its gpt2 BPE files ({type(e).__name__}): it downloads them "
                           "on first use, so run once with internet access, or set TIKTOKEN_CACHE_DIR to a cached "
                           "copy") from None


def split_train_val(dataset):
    """nanoGPT's split: 0.05% of the documents (~4k) for val, with a fixed seed."""
    splits = dataset.train_test_split(test_size=0.0005, seed=2357, shuffle=True)
    splits["val"] = splits.pop("test")
    return splits


def tokenize_dataset(splits, enc, num_proc):
    """Maps every document to {'ids': its ids + [eot], 'len': their count}, dropping the text."""
    def process(example):
        ids = tokenize(example["text"], enc.encode_ordinary, enc.eot_token)
        return {"ids": ids, "len": len(ids)}
    return splits.map(process, remove_columns=["text"], desc="tokenizing the splits", num_proc=num_proc)


def prepare(out_dir=None, num_proc=8, num_proc_load_dataset=None, num_shards=NUM_SHARDS):
    """The whole pipeline: writes train.bin and val.bin into out_dir (default: this folder); returns token counts."""
    out_dir = out_dir or HERE
    try:
        from datasets import load_dataset
    except ImportError:
        raise ImportError("openwebtext needs Hugging Face datasets: pip install datasets") from None
    enc = load_gpt2()  # before the download, which takes hours
    assert enc.eot_token == EOT

    # ~8M documents; the download and the tokenization both benefit from several processes
    dataset = load_dataset(DATASET, num_proc=num_proc_load_dataset or num_proc)
    tokenized = tokenize_dataset(split_train_val(dataset["train"]), enc, num_proc)

    os.makedirs(out_dir, exist_ok=True)
    stats = {}
    for split, dset in tokenized.items():
        stats[f"n_{split}"] = write_bin(dset, os.path.join(out_dir, f"{split}.bin"), num_shards)
    return stats


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out_dir", help="where to write train.bin and val.bin (default: this folder)")
    parser.add_argument("--num_proc", type=int, default=8, help="processes for tokenizing (and downloading)")
    parser.add_argument("--num_shards", type=int, default=NUM_SHARDS, help="shards to write each .bin in")
    args = parser.parse_args()
    try:
        stats = prepare(out_dir=args.out_dir, num_proc=args.num_proc, num_shards=args.num_shards)
    except (ImportError, RuntimeError) as e:
        sys.exit(f"error: {e}")
    for split in ("train", "val"):
        print(f"{split}.bin has {stats[f'n_{split}']:,} tokens")
    # to read the bin files later, e.g. with numpy:
    # m = np.memmap('train.bin', dtype=np.uint16, mode='r')
