"""kernels.py's GPU path on CPU tensors, for the kernel tests (tests/test_kernels.py,
tests/test_kernels_ptx.py): inside triton_on_cpu() the nanodepth custom ops' CPU implementations
(the references) are switched off, so CPU tensors take the ops' CUDA implementations, the Triton
launchers. Run the kernels under TRITON_INTERPRET=1 (conftest.py sets it on a machine without a
GPU), or with JITFunction.run patched to record the launches (tests/test_kernels_ptx.py)."""
import contextlib

import torch

import kernels


def kernel_ops():
    """Every custom op that kernels.py defines (rms_norm, rms_norm_backward, nag_update, ...)."""
    return [op for op in vars(kernels).values() if isinstance(op, torch.library.CustomOpDef)]


@contextlib.contextmanager
def triton_on_cpu():
    """Inside: the exact GPU path (the public function with impl="triton", the custom op, its
    autograd glue, the launchers and the kernels, forward and backward) on a machine without a GPU."""
    with contextlib.ExitStack() as stack:
        for op in kernel_ops():
            stack.enter_context(op.set_kernel_enabled("cpu", False))
        yield
