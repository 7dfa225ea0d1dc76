"""Shared fixtures: the repo on sys.path, and shakespeare_char prepared once per session."""
import os
import sys
from pathlib import Path

import pytest
import torch

# Triton kernels run on CPU tensors through Triton's interpreter; it must be on before triton is
# imported (model.py imports kernels.py). On a GPU box the kernels compile for real.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# train.py's threads follow the load at its start (run_config.pick_threads), and threads change a run's last
# bits: the suite pins them to torch's count (which OMP_NUM_THREADS, when set, already is), in process and in the
# runs it starts, so that two runs of one test never differ by the load they met
os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# read now, before any test's monkeypatch can touch the environment
SHAKESPEARE_TEXT = Path(os.environ.get("TINY_SHAKESPEARE") or REPO / "data" / "shakespeare_char" / "input.txt")


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """A --data_dir holding shakespeare_char/{train,val}.bin and meta.pkl, prepared from the exact
    text in $TINY_SHAKESPEARE (else the copy shipped in the repo), never from the network."""
    if not SHAKESPEARE_TEXT.is_file():
        pytest.skip(f"no shakespeare text at {SHAKESPEARE_TEXT} (set TINY_SHAKESPEARE)")
    from data.shakespeare_char.prepare import prepare
    root = tmp_path_factory.mktemp("data")
    prepare(out_dir=str(root / "shakespeare_char"), input_path=str(SHAKESPEARE_TEXT))
    return root
