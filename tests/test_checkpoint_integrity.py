"""What a checkpoint verifies and carries, and real disk faults.

- Bytes overwritten inside ckpt.pt (a weight's, an optimizer moment's, the pickle's) load as other numbers
  without a word, because torch.load never checks the CRC-32s its zip writer stores: load_checkpoint checks
  them, for a resume and for sample.py alike.
- A checkpoint carries its vocabulary: a dataset prepared again, in place, from another text is refused by a
  resume, and sample.py decodes with the checkpoint's own vocabulary, with or without meta.pkl.
- A disk that fills up in the middle of a save, or before the start: torch's zip writer raises a
  RuntimeError (its own, while handling the file's OSError), not the OSError a mock would raise. The tests
  have the kernel refuse the writes for real: a small full tmpfs where mount is allowed (else skipped); a
  file-size limit everywhere (RLIMIT_FSIZE: the same short write, then the same refusal, EFBIG instead of
  ENOSPC); /dev/full (ENOSPC on every write).
"""
import errno
import io
import os
import pickle
import resource
import shutil
import struct
import subprocess
import zipfile
from contextlib import contextmanager, redirect_stderr, redirect_stdout

import pytest
import torch

import guards
import run_config
import sample
from configurator import ConfigError
from conftest import SHAKESPEARE_TEXT
from test_train import assert_one_line_error, run_train_here, tiny_args


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory):
    """A real 2-iteration train.py run on its own copy of shakespeare_char: (its data_dir, its out_dir)."""
    root = tmp_path_factory.mktemp("integrity")
    data, out = root / "data", root / "out"
    shutil.copytree(data_dir / "shakespeare_char", data / "shakespeare_char")
    r = run_train_here(tiny_args(data, out, max_iters=2, gradient_accumulation_steps=1, final_eval_tokens=0))
    assert r.returncode == 0, r.stderr[-3000:]
    return data, out


def resume_args(data, out):
    """Resume the 2-iteration run to iteration 4: its next checkpoint is saved at iteration 4."""
    return tiny_args(data, out, init_from="resume", max_iters=4, lr_decay_iters=4, gradient_accumulation_steps=1,
                     final_eval_tokens=0)


def sample_text(out_dir):
    """sample.py's greedy text for the prompt ROMEO: (its stdout)."""
    out = io.StringIO()
    with torch.random.fork_rng(), redirect_stdout(out), redirect_stderr(io.StringIO()):
        sample.main([f"--out_dir={out_dir}", "--start=ROMEO:", "--num_samples=1", "--max_new_tokens=30",
                     "--temperature=0", "--device=cpu"])
    return out.getvalue()


# -----------------------------------------------------------------------------
# 1. a checkpoint verifies what it loads

def entry_spans(path):
    """{zip entry: (offset of its bytes in the file, their length)} of a torch.save file."""
    spans = {}
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        for info in z.infolist():
            f.seek(info.header_offset)
            name_len, extra_len = struct.unpack("<HH", f.read(30)[26:30])  # the local header's lengths
            spans[info.filename] = (info.header_offset + 30 + name_len + extra_len, info.file_size)
    return spans


def entry_of(path, tensor):
    """The zip entry that holds the tensor's storage (found by its bytes)."""
    want, data = tensor.contiguous().view(torch.uint8).numpy().tobytes(), path.read_bytes()
    found = [e for e, (at, n) in entry_spans(path).items() if n == len(want) and data[at:at + n] == want]
    assert len(found) == 1, found
    return found[0]


def overwrite(path, entry, n=5120):
    """n bytes (the entry's length, when shorter) in the middle of the entry changed: the zip stays whole."""
    at, size = entry_spans(path)[entry]
    n = min(n, size)
    at += (size - n) // 2
    data = bytearray(path.read_bytes())
    data[at:at + n] = bytes((b + 1) % 256 for b in data[at:at + n])
    path.write_bytes(bytes(data))


def damaged_tensor(ckpt, where):
    if where == "a weight":  # the largest, so that 5 KB fit inside it
        return max(ckpt["model"].values(), key=lambda t: t.numel())
    return ckpt["optimizer"]["state"][0]["exp_avg"]


@pytest.mark.parametrize("where", ["a weight", "an optimizer moment", "the pickle"])
def test_overwritten_bytes_are_refused_by_resume_and_sample(where, trained, tmp_path):
    data, out = trained
    out = shutil.copytree(out, tmp_path / "out")
    path = out / "ckpt.pt"
    ckpt = torch.load(path, weights_only=True)
    if where == "the pickle":
        entry = next(e for e in entry_spans(path) if e.endswith("/data.pkl"))
    else:
        entry = entry_of(path, damaged_tensor(ckpt, where))
    overwrite(path, entry)
    if where != "the pickle":  # torch itself loads the damaged tensor without a word: the check is ours
        assert not torch.equal(damaged_tensor(torch.load(path, weights_only=True), where), damaged_tensor(ckpt, where))
    damaged = path.read_bytes()
    r = run_train_here(resume_args(data, out))
    assert_one_line_error(r, f"checkpoint {path} is corrupt: its checksum does not match", entry, "--init_from=scratch")
    assert path.read_bytes() == damaged and not (out / "ckpt.pt.tmp").exists()  # neither replaced nor removed
    with pytest.raises(ConfigError, match="checksum does not match") as e:
        sample_text(out)
    assert str(path) in str(e.value) and "train the run again" in str(e.value)


def test_a_damaged_checkpoint_names_the_runs_best_model(trained, tmp_path):
    """An interrupt of a best-only run keeps the best model as ckpt_best.pt: the error names it as the copy."""
    data, out = trained
    out = shutil.copytree(out, tmp_path / "out")
    shutil.copyfile(out / "ckpt.pt", out / "ckpt_best.pt")
    overwrite(out / "ckpt.pt", entry_of(out / "ckpt.pt", damaged_tensor(torch.load(out / "ckpt.pt"), "a weight")))
    assert_one_line_error(run_train_here(resume_args(data, out)), "checksum does not match",
                          f"best model: {out / 'ckpt_best.pt'}")
    assert run_config.load_checkpoint(str(out / "ckpt_best.pt"), "cpu")["iter_num"] == 2  # that copy is whole


# -----------------------------------------------------------------------------
# 2. a checkpoint carries its vocabulary

def test_the_checkpoint_carries_the_datasets_vocabulary(trained):
    data, out = trained
    with open(data / "shakespeare_char" / "meta.pkl", "rb") as f:
        meta = pickle.load(f)
    vocab = torch.load(out / "ckpt.pt", weights_only=True)["vocab"]
    assert vocab == {"vocab_size": meta["vocab_size"], "itos": [meta["itos"][i] for i in range(meta["vocab_size"])]}


def moved(out, dest, data_dir, drop_vocab=False):
    """A copy of the run whose checkpoint names data_dir as its data (drop_vocab: and carries no vocabulary,
    as a checkpoint written before checkpoints carried one)."""
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    ckpt["config"]["data_dir"] = str(data_dir)
    if drop_vocab:
        del ckpt["vocab"]
    dest.mkdir()
    run_config.save_checkpoint(ckpt, str(dest / "ckpt.pt"))
    return dest


@pytest.fixture(scope="module")
def reprepared(trained, tmp_path_factory):
    """The trained run, whose dataset is then prepared again, in place, from another text with as many
    characters ('X' becomes '#'): the vocabulary keeps its size, and nearly every id maps to another
    character. Returns (data_dir, out_dir, the text sample.py printed before)."""
    data, out = trained
    root = tmp_path_factory.mktemp("reprepared")
    shutil.copytree(data, root / "data")
    out = moved(out, root / "out", root / "data")
    before = sample_text(out)
    text = SHAKESPEARE_TEXT.read_text(encoding="utf-8")
    assert "X" in text and "#" not in text
    (root / "other.txt").write_text(text.replace("X", "#"), encoding="utf-8")
    from data.shakespeare_char.prepare import prepare
    prepare(out_dir=str(root / "data" / "shakespeare_char"), input_path=str(root / "other.txt"))
    ckpt = torch.load(out / "ckpt.pt", weights_only=True)
    assert run_config.dataset_vocab_size(str(root / "data" / "shakespeare_char")) == ckpt["model_args"]["vocab_size"]
    return root / "data", out, before


def test_a_resume_on_a_dataset_prepared_again_with_another_vocabulary_is_refused(reprepared, tmp_path):
    data, out, _ = reprepared
    out = shutil.copytree(out, tmp_path / "out")
    before = sorted(os.listdir(out))
    assert_one_line_error(run_train_here(resume_args(data, out)),
                          "dataset shakespeare_char has another vocabulary than the checkpoint",
                          "ids map to other characters", "--init_from=scratch")
    assert sorted(os.listdir(out)) == before


def test_tradeoff_refuses_a_dataset_prepared_again_with_another_vocabulary(reprepared, tmp_path):
    """tradeoff.py evaluates the checkpoint on its dataset: re-mapped tokens would give other losses."""
    import tradeoff
    from tiny_checkpoint import make_checkpoint
    data, out, _ = reprepared
    make_checkpoint(tmp_path / "nag", data, steps=1, residual="nag")  # on the dataset as prepared now
    ckpt = torch.load(tmp_path / "nag" / "ckpt.pt", weights_only=True)
    ckpt["vocab"] = torch.load(out / "ckpt.pt", weights_only=True)["vocab"]  # trained on the first text
    run_config.save_checkpoint(ckpt, str(tmp_path / "nag" / "ckpt.pt"))
    with pytest.raises(ConfigError, match="dataset shakespeare_char has another vocabulary than the checkpoint"):
        tradeoff.main([f"--out_dir={tmp_path / 'nag'}", "--eval_iters=1", "--batch_size=2", "--device=cpu"])


def test_sample_decodes_with_the_checkpoints_own_vocabulary(reprepared):
    """The dataset's meta.pkl now maps the ids to other characters: sample.py prints the same text."""
    _, out, before = reprepared
    assert before.startswith("ROMEO:") and len(before.split("\n---")[0]) == 6 + 30
    assert sample_text(out) == before


def test_a_char_checkpoint_samples_without_its_meta_pkl(reprepared, tmp_path):
    _, out, before = reprepared
    assert sample_text(moved(out, tmp_path / "out", tmp_path / "no-data")) == before  # no meta.pkl there


def offline(monkeypatch):
    """tiktoken as it is offline: it cannot fetch an encoding's BPE files (the real one would try)."""
    import tiktoken

    def get_encoding(name):
        raise ConnectionError(f"cannot fetch the {name} BPE files")
    monkeypatch.setattr(tiktoken, "get_encoding", get_encoding)


def test_an_old_char_checkpoint_without_meta_pkl_is_one_line_error_not_a_download(trained, tmp_path, monkeypatch):
    """A checkpoint from before checkpoints carried their vocabulary, whose meta.pkl is gone: it fell back to
    gpt2 BPE (the wrong vocabulary) and failed in 4 chained tracebacks trying to download it."""
    offline(monkeypatch)
    old = moved(trained[1], tmp_path / "out", tmp_path / "no-data", drop_vocab=True)
    with pytest.raises(ConfigError, match="carries no vocabulary") as e:
        sample_text(old)
    assert str(tmp_path / "no-data" / "shakespeare_char" / "meta.pkl") in str(e.value)
    assert "python data/shakespeare_char/prepare.py" in str(e.value)


def test_an_old_char_checkpoint_still_decodes_with_its_meta_pkl(trained, tmp_path):
    data, out = trained
    assert sample_text(moved(out, tmp_path / "old", data, drop_vocab=True)) == sample_text(out)


def test_a_bpe_encoding_that_cannot_load_offline_is_a_one_line_error(trained, tmp_path, monkeypatch):
    offline(monkeypatch)
    ckpt = torch.load(trained[1] / "ckpt.pt", weights_only=True)
    ckpt["vocab"] = run_config.dataset_vocab(str(tmp_path / "openwebtext"))  # no meta.pkl: gpt2 BPE
    assert ckpt["vocab"] == {"vocab_size": 50257, "encoding": "gpt2"}
    (tmp_path / "bpe").mkdir()
    run_config.save_checkpoint(ckpt, str(tmp_path / "bpe" / "ckpt.pt"))
    with pytest.raises(ConfigError, match=r"cannot load the gpt2 BPE encoding .*\(tiktoken: ConnectionError\).*"
                                          r"TIKTOKEN_CACHE_DIR"):
        sample_text(tmp_path / "bpe")


# -----------------------------------------------------------------------------
# 3. real disk faults

@contextmanager
def file_size_limit(nbytes):
    """RLIMIT_FSIZE: the kernel cuts short, then refuses (EFBIG), a write past nbytes into any file, as a disk
    that fills up does (Python ignores the SIGXFSZ that comes with it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_save_checkpoint_raises_the_oserror_of_a_write_the_kernel_refused(tmp_path):
    """torch.save into a file whose write fails raises a RuntimeError ("unexpected pos") of its own, the
    OSError only its context: save_checkpoint raises that OSError (train.py makes it one line)."""
    obj = {"w": torch.zeros(100_000)}
    with file_size_limit(64 << 10):
        with pytest.raises(RuntimeError, match="unexpected pos") as raw, open(tmp_path / "raw.pt", "wb") as f:
            torch.save(obj, f)  # torch's own behaviour, which save_checkpoint must see through
        with pytest.raises(OSError) as e:
            run_config.save_checkpoint(obj, str(tmp_path / "ckpt.pt"))
    assert isinstance(raw.value.__context__, OSError)
    assert e.value.errno == errno.EFBIG and not (tmp_path / "ckpt.pt").exists()


def test_save_checkpoint_into_dev_full_raises_enospc_and_keeps_the_checkpoint(tmp_path):
    """/dev/full refuses every write with ENOSPC: the temp file's writes go there (a symlink)."""
    run_config.save_checkpoint({"w": torch.ones(4)}, str(tmp_path / "ckpt.pt"))
    before = (tmp_path / "ckpt.pt").read_bytes()
    os.symlink("/dev/full", tmp_path / "ckpt.pt.tmp")
    with pytest.raises(OSError) as e:
        run_config.save_checkpoint({"w": torch.zeros(100_000)}, str(tmp_path / "ckpt.pt"))
    assert e.value.errno == errno.ENOSPC and (tmp_path / "ckpt.pt").read_bytes() == before


def test_save_checkpoint_keeps_any_other_runtime_error(tmp_path, monkeypatch):
    """Only a failed write becomes its OSError: a RuntimeError with no OSError behind it stays itself."""
    def fails(obj, f):
        raise RuntimeError("not a write")
    monkeypatch.setattr(torch, "save", fails)
    with pytest.raises(RuntimeError, match="not a write"):
        run_config.save_checkpoint({}, str(tmp_path / "ckpt.pt"))


def assert_save_failed_in_one_line(r, out, before, reason):
    """The save at iteration 4 failed: one line, rc 1, the iteration-2 checkpoint as it was, no temp file."""
    assert r.returncode == 1
    assert_one_line_error(r, "could not write the checkpoint of iter 4", reason, "resume with")
    assert (out / "ckpt.pt").read_bytes() == before and not (out / "ckpt.pt.tmp").exists()


@pytest.mark.parametrize("refused", ["file-size limit", "/dev/full"])
def test_write_run_record_is_atomic_and_one_line(refused, tmp_path):
    """config.json is written whole or not at all: a refused write leaves neither an empty nor a torn one."""
    cfg = {"out_dir": str(tmp_path), "note": "x" * 4096}
    if refused == "/dev/full":
        os.symlink("/dev/full", tmp_path / "config.json.tmp")
        with pytest.raises(ConfigError, match="No space left on device.*free space on its disk, or use another"):
            guards.write_run_record(str(tmp_path), cfg, ["train.py"], 1)
    else:
        with file_size_limit(1024), pytest.raises(ConfigError, match="File too large"):
            guards.write_run_record(str(tmp_path), cfg, ["train.py"], 1)
    assert os.listdir(tmp_path) == []
    guards.write_run_record(str(tmp_path), cfg, ["train.py"], 1)
    assert os.listdir(tmp_path) == ["config.json"]


# a disk that fills up: the file-size limit (everywhere), and a real 4 MB tmpfs (root on Linux; skipped where
# mount is not allowed)

@contextmanager
def mounted_tmpfs(disk):
    disk.mkdir()
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True,
                           text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"cannot mount a tmpfs here ({e})")
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()})")
    try:
        yield disk
    finally:  # lazily where a file in it is still open (a failing test's): detached now, freed when closed
        if subprocess.run(["umount", str(disk)], capture_output=True, timeout=30).returncode:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True, timeout=30)


@contextmanager
def filled(disk, leave):
    """The file system of disk filled up to `leave` free bytes."""
    st = os.statvfs(disk)
    with open(disk / "filler", "wb") as f:
        f.write(bytes(max(0, st.f_bavail * st.f_frsize - leave)))
    yield


@pytest.fixture(params=["file-size limit", "tmpfs"])
def full_disk(request, tmp_path):
    """(a folder, full(leave): a context in which writes there stop `leave` bytes on, the error's reason)."""
    if request.param == "file-size limit":
        yield tmp_path, file_size_limit, "File too large"
    else:
        with mounted_tmpfs(tmp_path / "disk") as disk:
            yield disk, lambda leave: filled(disk, leave), "No space left on device"


def test_a_disk_full_in_the_middle_of_a_save_is_one_line_and_keeps_the_checkpoint(trained, full_disk):
    """A resume whose next checkpoint outgrows what the disk takes (half a checkpoint)."""
    data, out = trained
    disk, full, reason = full_disk
    out = shutil.copytree(out, disk / "out")
    before = (out / "ckpt.pt").read_bytes()
    with full(len(before) // 2):
        r = run_train_here(resume_args(data, out))
    assert_save_failed_in_one_line(r, out, before, reason)


def test_a_disk_full_at_the_start_is_one_line_and_moves_nothing(trained, full_disk):
    """Not one byte fits: the start fails before it moves the earlier run aside or writes a config.json."""
    data, out = trained
    disk, full, reason = full_disk
    out = shutil.copytree(out, disk / "out")
    before = sorted(os.listdir(out))
    config = (out / "config.json").read_bytes()
    with full(0):
        r = run_train_here(tiny_args(data, out, max_iters=4, lr_decay_iters=4))
    assert_one_line_error(r, f"cannot write to out_dir {out}", reason, "--out_dir")
    assert sorted(os.listdir(out)) == before and (out / "config.json").read_bytes() == config
