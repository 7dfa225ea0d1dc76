"""
Fused kernels for nanodepth's memory-bound row-wise operations, one section each (the three
hyper-connection ops share section 4-6):

    rms_norm(x, weight=None, eps=1e-6)                 y = x / rms(x) * weight
    nag_update(r, u, a, eps=1e-6) -> (r_new, log_gain)  the NAG write-back (model.py's NAG.write)
    depth_attention(sources, query, norm_weight, eps=1e-6) -> mix
                                                       AttnRes: softmax over depth of RMS-normed sources
    mhc_pre_mix(x, proj, scale, base, ...) -> (u, h_post, res_logits)
                                                       mHC's coefficients from the n streams, and the read
    sinkhorn(logits, repeat=10, eps=1e-6) -> H          Sinkhorn-Knopp, every iteration in one kernel
    hc_post_mix(x, out, h_post, h_res) -> X'            the hyper-connection write:
                                                       X'_j = sum_m h_res[m, j] X_m + h_post[j] out
    dense_mix(sources, weights) -> out                 DenseFormer's DWA and MUDDFormer's ways: weights [S]:
                                                       out = sum_s w[s] x_s [..., d]; weights [..., C, S]:
                                                       out [..., C, d], out_c = sum_s w[c, s] x_s

Each section reads top to bottom: the public function (what model.py calls); the plain-PyTorch reference
(the forward and backward functions, the autograd glue both paths share, and the autograd.Function of the
impl="torch" path); then the Triton side: the forward and backward kernels and their launchers, the custom op
that wraps them, its fake, the shared glue registered as its autograd, and the reference registered as its
CPU implementation.

One reference per kernel: a forward and a backward function in plain PyTorch with the launchers'
signatures and outputs (rms_norm_fwd_torch and rms_norm_bwd_torch, ...), the kernels' arithmetic
written with tensor ops. They are the custom op's CPU implementation; wrapped in the section's
autograd.Function (RMSNormTorch, NAGUpdateTorch, DepthAttentionTorch, MHCPreMixTorch, SinkhornTorch,
HCPostMixTorch, DenseMixTorch) they are the impl="torch" path; and tests/test_kernels.py measures the Triton
kernels against them.

Custom ops. Each kernel is a PyTorch custom op (`torch.ops.nanodepth.rms_norm`, `.nag_update`,
`.depth_attention`, `.mhc_pre_mix`, `.sinkhorn`, `.hc_post_mix`, `.dense_mix`), and so is its backward
(`.rms_norm_backward`, ...), registered with `torch.library.custom_op` + `register_fake` +
`register_autograd`. torch.compile sees one opaque
node per op in the forward graph and one in the backward graph, instead of tracing into (or
falling back around) a Python launcher. An op's CUDA implementation launches the Triton kernel;
its CPU implementation is the reference, so the ops run, and are tested, anywhere.

The public functions pick a path with `impl` (GPTConfig.kernels):
    "torch"   the reference, through its autograd.Function. Under torch.compile this is what
              inductor traces and fuses.
    "triton"  always the custom op: CUDA tensors run the Triton kernels, CPU tensors the op's CPU
              implementation (the reference). Needs the triton package.
    "auto"    the custom op for CUDA tensors when triton is installed, in eager mode and under
              torch.compile alike; else "torch".
A benchmark compares the hand-written kernels with inductor's fusion of the reference by running
kernels="triton" against kernels="torch" (both compiled); there is no separate switch for that.

Tests run the Triton kernels on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1, set
before triton is imported): by calling a launcher (rms_norm_fwd_triton, ...) directly, or with the
ops' CPU implementations switched off (triton_on_cpu()), so that the whole GPU path (op,
autograd glue, launchers, kernels) runs on CPU.

All arithmetic is fp32 inside the kernels, whatever the storage dtype (fp32, bf16, fp16); outputs
are stored in the input's dtype, per-row statistics in fp32. Every kernel handles any width d
(masked to the next power of two), any number of rows and non-contiguous inputs (copied).
"""

import contextlib
import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: the references serve
    triton = None

IMPLS = ("auto", "torch", "triton")


def use_triton(impl, x):
    """Whether the public functions take the custom op (True) or the reference (False) for x."""
    if impl == "auto":
        return triton is not None and x.is_cuda
    if impl == "torch":
        return False
    if impl == "triton":
        if triton is None:
            raise RuntimeError("kernels='triton' needs the triton package: pip install triton")
        return True
    raise ValueError(f"unknown kernels impl '{impl}'; valid: {', '.join(IMPLS)}")


def custom_ops():
    """Every custom op this file defines (rms_norm, rms_norm_backward, nag_update, ...)."""
    return [op for op in globals().values() if isinstance(op, torch.library.CustomOpDef)]


@contextlib.contextmanager
def triton_on_cpu():
    """Inside: CPU tensors take the custom ops' GPU implementations too (the launchers and the kernels,
    forward and backward), with the ops' CPU implementations (the references) switched off: the exact GPU
    path on a machine without a GPU, run by Triton's interpreter (TRITON_INTERPRET=1 before triton is
    imported). For the kernel tests and bench.py's dry run; ops defined later in this file are covered."""
    with contextlib.ExitStack() as stack:
        for op in custom_ops():
            stack.enter_context(op.set_kernel_enabled("cpu", False))
        yield


def upcast(x):
    """x in fp32 at least: the precision for statistics and gains (fp64 stays fp64, for tests)."""
    return x.to(acc_dtype(x))


def acc_dtype(x):
    return torch.promote_types(x.dtype, torch.float32)


def cast(t, dtype):
    """t in dtype: t itself when it already is, never a no-op t.to(dtype) / t.type_as(x).
    An autograd.Function's forward must return a tensor that a plain out-of-place op made: under
    torch 2.11's Dynamo, a forward whose output is an alias (a no-op .to or .contiguous()) or was
    updated in place (an addcmul_ into it) loses its backward, and every input's gradient comes back
    zero (torch 2.13 is right). tests/test_compile.py::test_compiled_equals_eager pins it; .ci/compat runs it on 2.11."""
    return t if t.dtype == dtype else t.to(dtype)


def fp32_math(x):
    """Autocast off inside a reference: its statistics and matvecs stay in fp32 under bf16 autocast. Where
    autocast is off already, a no-op context: entering torch.autocast costs more than a small op (2% of a
    CPU quickstart step)."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.autocast(x.device.type, enabled=False)
    return contextlib.nullcontext()


def _launch_shape(x):
    """(rows M, width d, the power-of-two block that covers d) of x viewed as [M, d]."""
    d = x.shape[-1]
    return x.numel() // d, d, triton.next_power_of_2(d)


def custom_op(name, launcher):
    """The op nanodepth::name, whose CUDA implementation is the Triton launcher. Its fake
    implementation and autograd are registered beside it, its CPU implementation (the reference,
    `@op.register_kernel("cpu")`) below it, in the kernel's section."""
    return torch.library.custom_op(f"nanodepth::{name}", launcher, mutates_args=(), device_types="cuda")


def _warps(BLOCK):
    """Warps per row program: 4 up to BLOCK 512, then more, so that each thread holds at most 64
    fp32 values of a row (at BLOCK 4096 with 4 warps the backward kernels reach ptxas's 255-register
    cap; tests/test_kernels_ptx.py fails on any spill)."""
    return min(max(BLOCK // 128, 4), 16)


def _rows(x):
    """x as a contiguous [M, d] (a copy only if x is not already contiguous)."""
    return x.reshape(-1, x.shape[-1]).contiguous()


def _n_programs(M, device):
    """Programs for the backward kernels that also reduce over rows (a weight gradient): a few per
    SM, each looping over rows and writing one partial sum, so the partials stay small."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
    return max(1, min(M, 4 * sms))


def _pointer_table(tensors, device):
    """The tensors' addresses as an int64 tensor on device: how a kernel reads (or writes) a list
    of tensors where they lie, instead of a stacked copy. (A new table every call, read on the host:
    fine for eager and torch.compile's default mode, not for capture in a CUDA graph.)"""
    ptrs = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)
    if device.type == "cuda":  # from pinned memory, so the copy does not wait for the GPU to drain
        return ptrs.pin_memory().to(device, non_blocking=True)
    return ptrs


def _aligned(tensors):
    """True when every tensor starts on a 16-byte boundary: the kernels may then use vector loads."""
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def _stacked(sources, buffered=None):
    """The sources as one fp32 [S, ..., d]: what a reference's batched ops read. `buffered` (a SourceStack's
    buffer view of them, _buffered) when given, else a copy made inside the call and never saved."""
    return torch.stack([upcast(v) for v in sources]) if buffered is None else buffered


class SourceStack(tuple):
    """The sources that depth_attention and dense_mix mix, as a model's stream appends them: a tuple of the
    source tensors (what autograd and the Triton kernels take: each source where it lies) that, where the
    reference runs eagerly (a CPU), also holds `buffer`: the same sources in fp32 in one preallocated
    [capacity, ..., d] tensor, each copied in once, when it is appended. A reference then reads all S
    sources as one contiguous [S, ..., d] view (stacked()): a few batched ops per call instead of a few per
    source (on a CPU each small op costs more in overhead than in arithmetic), and no stacked copy per call.
    A slot, once written, is never written again, so a mix may save its view for its backward (an append
    leaves the buffer's version counter as it was); appending to a stack that was already extended (a
    branch: a test that writes one state twice) copies the buffer first, and a full buffer is copied into
    one twice its size. The buffer is not autograd's: it holds the sources' values. The gradients have
    a buffer of the same shape too (`grads`, a SourceGrads): a mix's backward adds its sources' gradients
    into it, all S in a few batched ops, and each source's tensor in the tuple is the source behind a
    one-slot node (_ReadsSlot) that hands autograd its slot's sum once, after every mix that read it: one
    gradient per source instead of one per (mix, source) pair for autograd to sum. No buffers on a GPU (the
    kernels read the tuple) or under torch.compile (inductor fuses the reference's transient stack)."""

    def __new__(cls, tensors, buffer=None, filled=None, grads=None):
        stack = super().__new__(cls, tensors)
        stack.buffer, stack.filled = buffer, filled  # filled: [the buffer's slots written], shared by its stacks
        stack.grads = grads  # the SourceGrads of this buffer, shared by its stacks
        return stack

    @classmethod
    def start(cls, first, capacity, impl="auto"):
        """A stack of one source, `first`, with room for `capacity` in all."""
        if use_triton(impl, first) or torch.compiler.is_compiling():
            return cls((first,))
        buffer = torch.empty((capacity, *first.shape), dtype=acc_dtype(first), device=first.device)
        return cls((), buffer, [0], SourceGrads(buffer)).append(first)

    def append(self, v):
        """A new stack: these sources, then v (self is left as it was)."""
        if self.buffer is None:
            return SourceStack((*self, v))
        S, buffer, filled, grads, tensors = len(self), self.buffer, self.filled, self.grads, tuple(self)
        if filled[0] != S or S == len(buffer):  # a branch, or full: buffers of its own
            capacity = max(len(buffer), 2 * S, S + 1)
            buffer = torch.cat((buffer[:S], buffer.new_empty(capacity - S, *buffer.shape[1:])))
            filled, grads = [S], SourceGrads(buffer)
            # the new buffer's mixes add into the new gradient slots: each source behind a node that reads them
            tensors = tuple(_ReadsSlot.wrap(t, grads, s) for s, t in enumerate(tensors))
        # slots 0..S-1 are not touched: a mix that saved them sees its version unchanged, and may read them
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(buffer):
            buffer[S].copy_(v)
        filled[0] = S + 1
        return SourceStack((*tensors, _ReadsSlot.wrap(v, grads, S)), buffer, filled, grads)

    def stacked(self):
        """The sources as one fp32 [S, ..., d]: the buffer's filled slots (a view), or a transient stack."""
        return _stacked(self, _buffered(self))


class SourceGrads:
    """The gradients of a SourceStack's sources, in one fp32 buffer shaped as the stack's (made, zeros, at the
    first backward that adds to it): each mix's backward adds the gradients of all its S sources into
    slots(S) in place, and a source's _ReadsSlot node takes its slot's sum once every mix that read it has
    added to it (autograd runs that node after all of them), leaving the slot zero for another backward."""

    def __init__(self, like):
        self.like, self.sums = like, None

    def slots(self, S):
        """Slots 0..S-1, to add a mix's source gradients into."""
        if self.sums is None:
            self.sums = torch.zeros_like(self.like)
        return self.sums[:S]

    def take(self, s, grad, dtype):
        """Slot s's sum plus grad (the source's gradient from outside the mixes, or None), in dtype; the slot
        is left zero."""
        if self.sums is None:
            return grad
        slot = self.sums[s]
        total = (slot if grad is None else slot.add_(grad)).to(dtype, copy=True)
        slot.zero_()
        return total


class _ReadsSlot(torch.autograd.Function):
    """A source as a SourceStack hands it to the mixes: the same values (a view), whose backward returns the
    source's gradient summed in its slot (SourceGrads.take) plus any other gradient it got."""

    @staticmethod
    def forward(ctx, v, grads, s):
        ctx.set_materialize_grads(False)
        ctx.grads, ctx.s, ctx.dtype = grads, s, v.dtype
        return v.view_as(v)

    @staticmethod
    def backward(ctx, grad):
        return ctx.grads.take(ctx.s, grad, ctx.dtype), None, None

    @staticmethod
    def wrap(v, grads, s):
        """v behind a node reading slot s of grads, where a gradient can reach it (else v)."""
        return _ReadsSlot.apply(v, grads, s) if v.requires_grad and torch.is_grad_enabled() else v


def _slot_grads(sources):
    """A SourceStack's SourceGrads, where its mixes add their source gradients: when every source that needs
    a gradient reads its slot from them (None: a list, a stacked tensor, a stack without buffers, no backward
    to come, or a source appended without a gradient and needing one now: the mix then returns one per source)."""
    if not isinstance(sources, SourceStack) or sources.grads is None or not torch.is_grad_enabled():
        return None
    reads = [getattr(t.grad_fn, "grads", None) is sources.grads for t in sources if t.requires_grad]
    return sources.grads if reads and all(reads) else None


def _buffered(sources):
    """A SourceStack's sources as its buffer's filled slots (a view), or None: a list, a stacked tensor, or a
    stack without a buffer (a GPU, torch.compile)."""
    return sources.buffer[:len(sources)] if isinstance(sources, SourceStack) and sources.buffer is not None else None


# -----------------------------------------------------------------------------
# 1. rms_norm: x [..., d], weight [d] or None -> y [..., d];  rstd = 1 / sqrt(mean(x^2) + eps) per row

def rms_norm(x, weight=None, eps=1e-6, impl="auto"):
    if use_triton(impl, x):
        return rms_norm_op(x, weight, eps)[0]
    return RMSNormTorch.apply(x, weight, eps)


# the reference: the launchers' contract in plain PyTorch (autocast reaches into an op's
# implementation, hence fp32_math)

def _rms_stats(xf, eps):
    """rstd [..., 1] of fp32 rows; vector_norm squares and sums in one pass."""
    return torch.linalg.vector_norm(xf, dim=-1, keepdim=True).square_().div_(xf.shape[-1]).add_(eps).rsqrt_()


def _rms_norm_grad_x(g, x_hat, rstd):
    """d x_hat / d x = rstd * (I - x_hat x_hat^T / d) applied to g: two fused passes (vecdot,
    addcmul) and a scale, about 3x fewer elementwise passes than autograd through the forward."""
    dot = torch.linalg.vecdot(g, x_hat, dim=-1).unsqueeze(-1).div_(-x_hat.shape[-1])
    return torch.addcmul(g, x_hat, dot).mul_(rstd)


def rms_norm_fwd_torch(x: Tensor, weight: Optional[Tensor], eps: float) -> tuple[Tensor, Tensor]:
    """(y like x, contiguous; rstd [..., 1] fp32): y is x / rms(x) * weight in fp32, rounded once to
    x's dtype, as the kernel stores it (a bf16 x and an fp32 weight give bf16)."""
    with fp32_math(x):
        xf = upcast(x.contiguous())
        rstd = _rms_stats(xf, eps)
        y = xf * rstd
        return cast(y * weight if weight is not None else y, x.dtype), rstd


def rms_norm_bwd_torch(dy: Tensor, x: Tensor, weight: Optional[Tensor], rstd: Tensor) -> tuple[Tensor, Tensor]:
    """(dx like x; dw like weight, or an empty tensor without one), from x and the saved rstd."""
    with fp32_math(x):
        x_hat = upcast(x.contiguous()) * rstd
        g = upcast(dy.contiguous())
        dw = (g * x_hat).flatten(0, -2).sum(0).to(weight.dtype) if weight is not None else rstd.new_empty(0)
        if weight is not None:
            g = g * weight
        return _rms_norm_grad_x(g, x_hat, rstd).to(x.dtype), dw


def _rms_norm_grads(ctx, dy, backward):
    """The autograd glue of both paths (RMSNormTorch, and the Triton op's register_autograd): from the saved
    (x, weight, rstd), the gradients of (x, weight, eps) by `backward`, the reference's or the op's."""
    x, weight, rstd = ctx.saved_tensors
    dx, dw = backward(dy, x, weight, rstd)
    return dx, dw if weight is not None else None, None


class RMSNormTorch(torch.autograd.Function):
    """The reference with autograd (impl="torch"): it saves what the op saves (x, weight, rstd)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = rms_norm_fwd_torch(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        return _rms_norm_grads(ctx, dy, rms_norm_bwd_torch)


if triton is not None:

    @triton.jit
    def _rms_norm_fwd(X, W, Y, RSTD, d, eps, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < d
        x = tl.load(X + row * d + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / d + eps)
        y = x * rstd
        if HAS_W:
            y = y * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + row * d + cols, y.to(Y.dtype.element_ty), mask=mask)
        tl.store(RSTD + row, rstd)

    @triton.jit
    def _rms_norm_bwd(DY, X, W, RSTD, DX, DW_PART, M, d, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
        # dx = rstd * (g - x_hat * mean(g * x_hat)), g = dy * w;  dw = sum over rows of dy * x_hat
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < d
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32) if HAS_W else 1.0
        dw = tl.zeros([BLOCK], dtype=tl.float32)
        for row in range(pid, M, tl.num_programs(0)):
            off = tl.cast(row, tl.int64) * d + cols
            x = tl.load(X + off, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + off, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + row)
            x_hat = x * rstd
            g = dy * w
            dx = rstd * (g - x_hat * (tl.sum(g * x_hat, axis=0) / d))
            tl.store(DX + off, dx.to(DX.dtype.element_ty), mask=mask)
            dw += dy * x_hat
        if HAS_W:
            tl.store(DW_PART + pid * d + cols, dw, mask=mask)


def rms_norm_fwd_triton(x: Tensor, weight: Optional[Tensor], eps: float) -> tuple[Tensor, Tensor]:
    """Launch the forward kernel: (y like x, contiguous; rstd [..., 1] fp32)."""
    M, d, BLOCK = _launch_shape(x)
    x2 = _rows(x)
    y = torch.empty_like(x2)
    rstd = torch.empty(M, device=x.device, dtype=acc_dtype(x))
    w = weight.contiguous() if weight is not None else x2  # a dummy pointer when there is no weight
    _rms_norm_fwd[(M,)](x2, w, y, rstd, d, eps, HAS_W=weight is not None, BLOCK=BLOCK, num_warps=_warps(BLOCK))
    return y.view(x.shape), rstd.view(*x.shape[:-1], 1)


def rms_norm_bwd_triton(dy: Tensor, x: Tensor, weight: Optional[Tensor], rstd: Tensor) -> tuple[Tensor, Tensor]:
    """Launch the backward kernel: (dx like x; dw like weight, or an empty tensor without one)."""
    M, d, BLOCK = _launch_shape(x)
    x2 = _rows(x)
    dx = torch.empty_like(x2)
    n = _n_programs(M, x.device)
    dw_part = torch.empty(n, d, device=x.device, dtype=torch.float32)
    w = weight.contiguous() if weight is not None else x2
    _rms_norm_bwd[(n,)](_rows(dy), x2, w, rstd.contiguous(), dx, dw_part, M, d,
                        HAS_W=weight is not None, BLOCK=BLOCK, num_warps=_warps(BLOCK))
    dw = dw_part.sum(0).to(weight.dtype) if weight is not None else rstd.new_empty(0)
    return dx.view(x.shape), dw


rms_norm_op = custom_op("rms_norm", rms_norm_fwd_triton)
rms_norm_backward_op = custom_op("rms_norm_backward", rms_norm_bwd_triton)


@rms_norm_op.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape), x.new_empty(*x.shape[:-1], 1, dtype=acc_dtype(x))


@rms_norm_backward_op.register_fake
def _(dy, x, weight, rstd):
    return x.new_empty(x.shape), weight.new_empty(weight.shape) if weight is not None else rstd.new_empty(0)


def _rms_norm_setup(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.mark_non_differentiable(output[1])


def _rms_norm_backward(ctx, dy, _):
    return _rms_norm_grads(ctx, dy, rms_norm_backward_op)


rms_norm_op.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup)


rms_norm_op.register_kernel("cpu", rms_norm_fwd_torch)
rms_norm_backward_op.register_kernel("cpu", rms_norm_bwd_torch)


# -----------------------------------------------------------------------------
# 2. nag_update: r, u [..., d], a [..., 1] -> r_new [..., d], log_gain [..., 1] (fp32), in five steps:
#   (1) uc = u - mean(u);  (2) up = uc - along r, along = <uc, r> / <r, r>;  (3) v = up / sqrt(mean(up^2) + eps)
#   (4) p = r + a v, r1 = p / sqrt(1 + a^2), r_new = r1 / rms(r1);  (5) log_gain = 0.5 log1p(a^2)

def nag_update(r, u, a, eps=1e-6, impl="auto"):
    """The NAG write-back of a sublayer output u into the direction r (unit RMS) with tangent a.
    Returns the new direction and the log-gain 0.5 * log(1 + a^2) that the stream's log-norm gains."""
    if use_triton(impl, r):
        return nag_update_op(r, u, a, eps)
    return NAGUpdateTorch.apply(r, u, a, eps)


# the reference: the kernels' steps in plain PyTorch

class NAGSteps(NamedTuple):
    """The forward's intermediates that the backward needs (steps 1-4, fp32; fp64 stays fp64)."""
    r: Tensor  # the direction, upcast
    a: Tensor  # the tangent, upcast
    uc: Tensor  # 1. u centred
    rr: Tensor  # <r, r>
    along: Tensor  # uc's coefficient along r
    rstd_up: Tensor  # 1 / rms of up = uc - along r (2.)
    v: Tensor  # 3. up at unit RMS
    cos: Tensor  # cos(arctan(a)) = 1 / sqrt(1 + a^2)
    p: Tensor  # r + a v
    rstd_r1: Tensor  # 1 / rms of r1 = cos p (4.)
    r_new: Tensor  # r1 at unit RMS


def _nag_steps(r, u, a, eps):
    """The forward's steps 1-4 (NAGSteps)."""
    r, u, a = upcast(r), upcast(u), upcast(a)
    uc = u - u.mean(-1, keepdim=True)  # 1. centre
    rr = (r * r).sum(-1, keepdim=True)
    along = (uc * r).sum(-1, keepdim=True) / rr  # uc's coefficient along r
    up = uc - along * r  # 2. orthogonal to r
    rstd_up = torch.rsqrt(up.square().mean(-1, keepdim=True) + eps)
    v = up * rstd_up  # 3. unit RMS
    cos = torch.rsqrt(1 + a * a)  # cos(arctan(a)); a cos is the sine
    p = r + a * v
    r1 = cos * p  # 4. rotate by arctan(a) ...
    rstd_r1 = torch.rsqrt(r1.square().mean(-1, keepdim=True))
    return NAGSteps(r, a, uc, rr, along, rstd_up, v, cos, p, rstd_r1, r1 * rstd_r1)  # ... and stop drift in low precision


def nag_update_fwd_torch(r: Tensor, u: Tensor, a: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(r_new like r, contiguous; log_gain [..., 1] fp32)."""
    r, u = r.contiguous(), u.contiguous()
    af = upcast(a)
    r_new = _nag_steps(r, u, a, eps).r_new
    # 5. log-gain, per row; the product is the last op, so that it is never a no-op .contiguous() (see cast)
    log_gain = 0.5 * torch.log1p(af * af).expand(*r.shape[:-1], 1).contiguous()
    return cast(r_new, r.dtype), log_gain


def nag_update_bwd_torch(r: Tensor, u: Tensor, a: Tensor, grad_r_new: Tensor, grad_log_gain: Tensor,
                         eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """(grad r, grad u, grad a per row [..., 1] fp32): the backward kernel's steps."""
    s = _nag_steps(r.contiguous(), u.contiguous(), a, eps)
    rf, a, uc, rr, along, rstd_up, v, cos, p, rstd_r1, r_new = (  # by name: the same letters as the kernel's
        s.r, s.a, s.uc, s.rr, s.along, s.rstd_up, s.v, s.cos, s.p, s.rstd_r1, s.r_new)
    g, gl = upcast(grad_r_new), upcast(grad_log_gain)
    g_r1 = rstd_r1 * (g - r_new * (g * r_new).mean(-1, keepdim=True))  # through r_new = r1 / rms(r1)
    g_a = (cos * (g_r1 * v).sum(-1, keepdim=True) - a * cos ** 3 * (g_r1 * p).sum(-1, keepdim=True)
           + gl * a * cos * cos)  # through r1 = cos (r + a v) and log_gain = 0.5 log1p(a^2)
    g_v = cos * a * g_r1
    g_up = rstd_up * (g_v - v * (g_v * v).mean(-1, keepdim=True))  # through v = up / rms(up)
    gur = (g_up * rf).sum(-1, keepdim=True) / rr
    g_uc = g_up - gur * rf  # through up = uc - along r
    g_u = g_uc - g_uc.mean(-1, keepdim=True)  # through uc = u - mean(u)
    g_r = cos * g_r1 - along * g_up - gur * (uc - 2.0 * along * rf)
    return g_r.to(r.dtype), g_u.to(u.dtype), g_a.expand(*r.shape[:-1], 1).contiguous()


def _nag_update_save(ctx, r, u, a, eps):
    """The autograd glue of both paths (NAGUpdateTorch, and the Triton op's register_autograd): the backward
    keeps the inputs alone and recomputes the forward's steps."""
    ctx.save_for_backward(r, u, a)
    ctx.eps = eps


def _nag_update_grads(ctx, grad_r_new, grad_log_gain, backward):
    """The gradients of (r, u, a, eps) by `backward`, the reference's or the op's; an output nobody used has
    no gradient, and a may be broadcast over rows."""
    r, u, a = ctx.saved_tensors
    if grad_log_gain is None:
        grad_log_gain = r.new_zeros(*r.shape[:-1], 1, dtype=acc_dtype(r))
    if grad_r_new is None:
        grad_r_new = torch.zeros_like(r)
    gr, gu, ga = backward(r, u, a, grad_r_new, grad_log_gain, ctx.eps)
    return gr, gu, ga.sum_to_size(a.shape).to(a.dtype), None


class NAGUpdateTorch(torch.autograd.Function):
    """The reference with autograd (impl="torch"): it saves what the op saves (r, u, a) and
    recomputes the forward's steps in the backward, as the backward kernel does."""

    @staticmethod
    def forward(ctx, r, u, a, eps):
        _nag_update_save(ctx, r, u, a, eps)
        return nag_update_fwd_torch(r, u, a, eps)

    @staticmethod
    def backward(ctx, grad_r_new, grad_log_gain):
        return _nag_update_grads(ctx, grad_r_new, grad_log_gain, nag_update_bwd_torch)


if triton is not None:

    @triton.jit
    def _log1p(x):
        # log(1 + x) for small x >= 0: 1 + x rounds away x's low bits (log(1 + 1e-6) is 5% off in
        # fp32, log(1 + 1e-8) is 0). u = fl(1 + x) is exact to u - 1, so log(u) * x / (u - 1)
        # cancels the rounding (Goldberg's compensated log1p); where u == 1, log1p(x) = x to fp32.
        u = 1.0 + x
        return tl.where(u == 1.0, x, tl.log(u) * (x / tl.where(u == 1.0, 1.0, u - 1.0)))

    @triton.jit
    def _nag_fwd(R, U, A, R_NEW, LOG_GAIN, d, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < d
        r = tl.load(R + row * d + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + row * d + cols, mask=mask, other=0.0).to(tl.float32)
        a = tl.load(A + row).to(tl.float32)
        uc = tl.where(mask, u - tl.sum(u, axis=0) / d, 0.0)
        up = uc - (tl.sum(uc * r, axis=0) / tl.sum(r * r, axis=0)) * r
        v = up * tl.rsqrt(tl.sum(up * up, axis=0) / d + eps)
        r1 = (r + a * v) * tl.rsqrt(1.0 + a * a)
        r_new = r1 * tl.rsqrt(tl.sum(r1 * r1, axis=0) / d)
        tl.store(R_NEW + row * d + cols, r_new.to(R_NEW.dtype.element_ty), mask=mask)
        tl.store(LOG_GAIN + row, 0.5 * _log1p(a * a))

    @triton.jit
    def _nag_bwd(R, U, A, G, GL, GR, GU, GA, d, eps, BLOCK: tl.constexpr):
        # recompute the forward (reading r and u again is cheaper than storing what it made)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < d
        r = tl.load(R + row * d + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + row * d + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(G + row * d + cols, mask=mask, other=0.0).to(tl.float32)
        a = tl.load(A + row).to(tl.float32)
        gl = tl.load(GL + row).to(tl.float32)
        uc = tl.where(mask, u - tl.sum(u, axis=0) / d, 0.0)
        rr = tl.sum(r * r, axis=0)
        along = tl.sum(uc * r, axis=0) / rr
        up = uc - along * r
        rstd_up = tl.rsqrt(tl.sum(up * up, axis=0) / d + eps)
        v = up * rstd_up
        cos = tl.rsqrt(1.0 + a * a)
        p = r + a * v
        r1 = cos * p
        rstd_r1 = tl.rsqrt(tl.sum(r1 * r1, axis=0) / d)
        r_new = r1 * rstd_r1
        # back through each step, last to first (nag_update_bwd_torch spells out the same steps)
        g_r1 = rstd_r1 * (g - r_new * (tl.sum(g * r_new, axis=0) / d))
        g_a = cos * tl.sum(g_r1 * v, axis=0) - a * cos * cos * cos * tl.sum(g_r1 * p, axis=0) + gl * a * cos * cos
        g_v = cos * a * g_r1
        g_up = rstd_up * (g_v - v * (tl.sum(g_v * v, axis=0) / d))
        gur = tl.sum(g_up * r, axis=0) / rr
        g_uc = g_up - gur * r
        g_u = tl.where(mask, g_uc - tl.sum(g_uc, axis=0) / d, 0.0)
        g_r = cos * g_r1 - along * g_up - gur * (uc - 2.0 * along * r)
        tl.store(GR + row * d + cols, g_r.to(GR.dtype.element_ty), mask=mask)
        tl.store(GU + row * d + cols, g_u.to(GU.dtype.element_ty), mask=mask)
        tl.store(GA + row, g_a)


def _per_row(a, r):
    """The tangent a (broadcastable to [..., 1]) as one value per row of r, contiguous [M]."""
    return a.expand(*r.shape[:-1], 1).reshape(-1).contiguous()


def nag_update_fwd_triton(r: Tensor, u: Tensor, a: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Launch the forward kernel: (r_new like r; log_gain [..., 1] fp32)."""
    M, d, BLOCK = _launch_shape(r)
    r2 = _rows(r)
    r_new = torch.empty_like(r2)
    log_gain = torch.empty(M, device=r.device, dtype=acc_dtype(r))
    _nag_fwd[(M,)](r2, _rows(u), _per_row(a, r), r_new, log_gain, d, eps, BLOCK=BLOCK, num_warps=_warps(BLOCK))
    return r_new.view(r.shape), log_gain.view(*r.shape[:-1], 1)


def nag_update_bwd_triton(r: Tensor, u: Tensor, a: Tensor, grad_r_new: Tensor, grad_log_gain: Tensor,
                          eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """Launch the backward kernel: (grad r, grad u, grad a per row [..., 1] fp32)."""
    M, d, BLOCK = _launch_shape(r)
    r2, u2 = _rows(r), _rows(u)
    gr, gu = torch.empty_like(r2), torch.empty_like(u2)
    ga = torch.empty(M, device=r.device, dtype=acc_dtype(r))
    _nag_bwd[(M,)](r2, u2, _per_row(a, r), _rows(grad_r_new), grad_log_gain.reshape(M).contiguous(),
                   gr, gu, ga, d, eps, BLOCK=BLOCK, num_warps=_warps(BLOCK))
    return gr.view(r.shape), gu.view(r.shape), ga.view(*r.shape[:-1], 1)


nag_update_op = custom_op("nag_update", nag_update_fwd_triton)
nag_update_backward_op = custom_op("nag_update_backward", nag_update_bwd_triton)


@nag_update_op.register_fake
def _(r, u, a, eps):
    return r.new_empty(r.shape), r.new_empty(*r.shape[:-1], 1, dtype=acc_dtype(r))


@nag_update_backward_op.register_fake
def _(r, u, a, grad_r_new, grad_log_gain, eps):
    return r.new_empty(r.shape), u.new_empty(u.shape), r.new_empty(*r.shape[:-1], 1, dtype=acc_dtype(r))


def _nag_update_setup(ctx, inputs, output):
    _nag_update_save(ctx, *inputs)


def _nag_update_backward(ctx, grad_r_new, grad_log_gain):
    return _nag_update_grads(ctx, grad_r_new, grad_log_gain, nag_update_backward_op)


nag_update_op.register_autograd(_nag_update_backward, setup_context=_nag_update_setup)


nag_update_op.register_kernel("cpu", nag_update_fwd_torch)
nag_update_backward_op.register_kernel("cpu", nag_update_bwd_torch)


# -----------------------------------------------------------------------------
# 3. depth_attention: S sources [..., d] (a list, or stacked [S, ..., d]), query and norm_weight [d]
#   z_s = <query * norm_weight, v_s> / sqrt(mean(v_s^2) + eps);  w = softmax_s(z);  mix = sum_s w_s v_s
# (<q, w * v / rms(v)> = <q * w, v> / rms(v): no normalised copy of a source is ever made.)
# Memory: sublayer l mixes all l earlier sources. Stacking them would copy, and save for the
# backward, O(l d) per token at every sublayer: O(L^2 d) over the model. Here every path reads the
# sources where they lie and saves only the sources themselves (shared by all sublayers) and one
# fp32 log-sum-exp per token: O(L d). The kernels get the sources as a table of addresses.
# The forward reads each source once (an online softmax over depth); the backward reads each twice,
# first for <g, mix> (see _depth_attention_bwd), then for the gradients.

def depth_attention(sources, query, norm_weight, eps=1e-6, impl="auto"):
    """sum_s softmax_s(<query, RMSNorm(sources_s)>) sources_s: a softmax over depth per token.
    sources: a list of S >= 1 tensors [..., d] of one shape and dtype, one stacked [S, ..., d], or a
    SourceStack; query and norm_weight [d]. Returns mix [..., d] in the sources' dtype."""
    stacked, grads = _buffered(sources), _slot_grads(sources)
    sources = _source_list(sources)
    if use_triton(impl, sources[0]):
        return depth_attention_op(sources, query, norm_weight, eps)[0]
    if not torch.is_grad_enabled():
        # nothing to save for a backward: the reference's forward alone (Dynamo also failed to
        # trace the autograd.Function in the model's compiled no-grad eval; test_compiled_eval_equals_eager)
        V = _stacked(sources, stacked)
        with fp32_math(V):
            return cast(_depth_attention_ref_fwd(V, query, norm_weight, eps)[0], sources[0].dtype)
    return DepthAttentionTorch.apply(query, norm_weight, eps, stacked, grads, *sources)


# the reference: the kernels' formulas in plain PyTorch, on the sources stacked as one fp32 V [S, ..., d] (a
# SourceStack's buffer, or a transient stack), a few batched ops per call

def _source_stats(V, query, norm_weight, eps):
    """(qw, <v_s, qw> [S, ...], rho_s = 1 / rms(v_s) [S, ...]) in fp32."""
    qw = upcast(query) * upcast(norm_weight)
    rho = torch.linalg.vector_norm(V, dim=-1).square_().div_(qw.numel()).add_(eps).rsqrt_()
    return qw, V @ qw, rho


def _depth_attention_ref_fwd(V, query, norm_weight, eps):
    """(mix [..., d], lse [...], (dots, rho) [S, ...]: the statistics the backward reuses), fp32."""
    qw, dots, rho = _source_stats(V, query, norm_weight, eps)
    z = dots * rho
    lse = torch.logsumexp(z, dim=0)
    return (torch.exp(z - lse).unsqueeze(-1) * V).sum(0), lse, (dots, rho)


def _depth_attention_ref_bwd(V, query, norm_weight, stats, lse, grad_mix, into=None):
    """(grad V [S, ..., d], grad query, grad norm_weight), fp32; stats: the forward's (dots, rho). into: an
    fp32 [S, ..., d] that grad V is added to in place (and returned), instead of a new tensor."""
    qw, (dots, rho) = upcast(query) * upcast(norm_weight), stats
    w = torch.exp(dots * rho - lse)
    g = upcast(grad_mix)
    g_v = torch.linalg.vecdot(V, g)  # <g, v_s>
    gz = w * (g_v - (w * g_v).sum(0))  # through the softmax; <g, mix> = sum_s w_s <g, v_s>
    c_q = gz * rho  # dz_s / d qw = rho_s v_s, dz_s / d v_s = rho_s qw - <v_s, qw> rho_s^3 v_s / d
    c_v = c_q * dots * rho * rho / -qw.numel()
    grad_V = V * c_v.unsqueeze(-1) if into is None else into.addcmul_(V, c_v.unsqueeze(-1))
    grad_V.addcmul_(w.unsqueeze(-1), g).addcmul_(c_q.unsqueeze(-1), qw)
    dqw = (c_q.reshape(1, -1) @ V.reshape(-1, qw.numel())).squeeze(0)
    return grad_V, dqw * upcast(norm_weight), dqw * upcast(query)


def depth_attention_fwd_torch(sources: list[Tensor], query: Tensor, norm_weight: Tensor,
                              eps: float) -> tuple[Tensor, Tensor]:
    """(mix like a source, contiguous; lse [...] fp32)."""
    with fp32_math(sources[0]):
        mix, lse, _ = _depth_attention_ref_fwd(_stacked(sources), query, norm_weight, eps)
        return cast(mix, sources[0].dtype), lse


def depth_attention_bwd_torch(sources: list[Tensor], query: Tensor, norm_weight: Tensor, lse: Tensor,
                              grad_mix: Tensor, eps: float) -> tuple[list[Tensor], Tensor, Tensor]:
    """(a gradient per source, grad query, grad norm_weight): the op saves only lse, so the statistics are
    recomputed here."""
    with fp32_math(grad_mix):
        V = _stacked(sources)
        stats = _source_stats(V, query, norm_weight, eps)[1:]
        grad_V, gq, gw = _depth_attention_ref_bwd(V, query, norm_weight, stats, lse, grad_mix)
        return [g.to(v.dtype, copy=True) for g, v in zip(grad_V, sources)], gq.to(query.dtype), gw.to(norm_weight.dtype)


def _depth_attention_save(ctx, sources, query, norm_weight, lse, eps):
    """The autograd glue of both paths (DepthAttentionTorch, and the Triton op's register_autograd): the
    sources as they are, the query, the norm's weight and the forward's lse."""
    ctx.save_for_backward(query, norm_weight, lse, *sources)
    ctx.eps = eps


def _depth_attention_grads(ctx, grad_mix, backward):
    """(a gradient per source, grad query, grad norm_weight) by `backward`, the reference's or the op's."""
    query, norm_weight, lse, *sources = ctx.saved_tensors
    return backward(sources, query, norm_weight, lse, grad_mix, ctx.eps)


class DepthAttentionTorch(torch.autograd.Function):
    """The reference with autograd (impl="torch"): it saves the sources (passed one by one, so that autograd
    saves them as they are and gives each its own gradient), the query, norm_weight and lse as the op does,
    and, unlike the op, the forward's per-source statistics (dots and rho: 2 S fp32 per token), which spares
    the backward two passes over the sources. stacked: a SourceStack's buffer view of the same sources,
    saved too (one storage, shared by every mix of the stack), or None: a transient stack in each direction.
    grads: the stack's SourceGrads, or None: with it, the backward adds the source gradients into its slots
    (no gradient per source returned: each source's _ReadsSlot node hands autograd the slot's sum)."""

    @staticmethod
    def forward(ctx, query, norm_weight, eps, stacked, grads, *sources):
        V = _stacked(sources, stacked)
        with fp32_math(V):
            mix, lse, (dots, rho) = _depth_attention_ref_fwd(V, query, norm_weight, eps)
        ctx.save_for_backward(query, norm_weight, lse, dots, rho, stacked, *sources)
        ctx.grads = grads
        return cast(mix, sources[0].dtype)

    @staticmethod
    def backward(ctx, grad_mix):
        query, norm_weight, lse, dots, rho, stacked, *sources = ctx.saved_tensors
        V, into = _stacked(sources, stacked), ctx.grads and ctx.grads.slots(len(sources))
        with fp32_math(grad_mix):
            grad_V, gq, gw = _depth_attention_ref_bwd(V, query, norm_weight, (dots, rho), lse, grad_mix, into)
        # in the slots, or views of grad_V where the dtypes agree
        grads = [None] * len(sources) if into is not None else [g.to(v.dtype) for g, v in zip(grad_V, sources)]
        return gq.to(query.dtype), gw.to(norm_weight.dtype), None, None, None, *grads


def _source_list(sources, op="depth_attention"):
    """The sources as a list (a stacked tensor: its views), checked to be alike; op names the caller in errors."""
    sources = list(sources.unbind(0)) if isinstance(sources, Tensor) else list(sources)
    if not sources:
        raise ValueError(f"{op} needs at least one source")
    v = sources[0]
    for s in sources[1:]:
        if s.shape != v.shape or s.dtype != v.dtype or s.device != v.device:
            raise ValueError(f"{op}: every source must have one shape, dtype and device; got "
                             f"{tuple(v.shape)} {v.dtype} {v.device} and {tuple(s.shape)} {s.dtype} {s.device}")
    return sources


if triton is not None:

    @triton.jit
    def _source(TABLE, s, LIKE, ALIGNED: tl.constexpr):
        # entry s of the int64 address TABLE, as a pointer of LIKE's type
        ptr = tl.load(TABLE + s).to(LIKE.dtype)
        if ALIGNED:  # the launcher checked: lets the compiler use vector loads and stores
            ptr = tl.multiple_of(ptr, 16)
        return ptr

    @triton.jit
    def _depth_attention_fwd(SRC, Q, NW, MIX, LSE, S, d, eps, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
        # SRC: S addresses of [M, d] sources, MIX's dtype. One program per row, an online softmax
        # over depth: every source is read once.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < d
        off = row * d + cols
        qw = tl.load(Q + cols, mask=mask, other=0.0).to(tl.float32) * tl.load(NW + cols, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(_source(SRC, 0, MIX, ALIGNED) + off, mask=mask, other=0.0).to(tl.float32)
        z_max = tl.sum(v * qw, axis=0) * tl.rsqrt(tl.sum(v * v, axis=0) / d + eps)
        total = z_max * 0.0 + 1.0  # sum of exp(z - z_max) so far
        acc = v
        for s in range(1, S):
            v = tl.load(_source(SRC, s, MIX, ALIGNED) + off, mask=mask, other=0.0).to(tl.float32)
            z = tl.sum(v * qw, axis=0) * tl.rsqrt(tl.sum(v * v, axis=0) / d + eps)
            new_max = tl.maximum(z_max, z)
            scale, p = tl.exp(z_max - new_max), tl.exp(z - new_max)
            total = total * scale + p
            acc = acc * scale + p * v
            z_max = new_max
        tl.store(MIX + off, (acc / total).to(MIX.dtype.element_ty), mask=mask)
        tl.store(LSE + row, z_max + tl.log(total))

    @triton.jit
    def _depth_attention_bwd(SRC, DSRC, Q, NW, LSE, G, DQW_PART, S, M, d, eps,
                             ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
        # with rho_s = 1 / sqrt(mean(v_s^2) + eps) and gz_s = w_s (<g, v_s> - <g, mix>):
        #   dv_s = w_s g + gz_s (rho_s qw - <v_s, qw> rho_s^3 v_s / d);   d qw = sum_s gz_s rho_s v_s
        # The weights w_s come back from the saved lse. SRC, DSRC: tables of the addresses of the
        # S sources and of their S gradient buffers, each [M, d] in G's dtype.
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < d
        qw = tl.load(Q + cols, mask=mask, other=0.0).to(tl.float32) * tl.load(NW + cols, mask=mask, other=0.0).to(tl.float32)
        dqw = tl.zeros([BLOCK], dtype=tl.float32)
        for row in range(pid, M, tl.num_programs(0)):
            off = tl.cast(row, tl.int64) * d + cols
            g = tl.load(G + off, mask=mask, other=0.0).to(tl.float32)
            lse = tl.load(LSE + row)
            # <g, mix> = sum_s w_s <g, v_s>, from the sources: a first pass over them, not a read of
            # the stored mix. In bf16 the stored mix is rounded, and <g, v_s> - <g, mix> cancels:
            # the rounding alone moved the gradients of sources much smaller than the mix by up to
            # 50% of their scale in the tests. The second read of a row's sources mostly hits L2.
            g_mix = tl.zeros([], dtype=tl.float32)
            for s in range(0, S):
                v = tl.load(_source(SRC, s, G, ALIGNED) + off, mask=mask, other=0.0).to(tl.float32)
                z = tl.sum(v * qw, axis=0) * tl.rsqrt(tl.sum(v * v, axis=0) / d + eps)
                g_mix += tl.exp(z - lse) * tl.sum(g * v, axis=0)
            for s in range(0, S):
                v = tl.load(_source(SRC, s, G, ALIGNED) + off, mask=mask, other=0.0).to(tl.float32)
                rho = tl.rsqrt(tl.sum(v * v, axis=0) / d + eps)
                dot = tl.sum(v * qw, axis=0)
                w = tl.exp(dot * rho - lse)
                gz = w * (tl.sum(g * v, axis=0) - g_mix)
                dv = w * g + gz * (rho * qw - dot * rho * rho * rho * v / d)
                tl.store(_source(DSRC, s, G, ALIGNED) + off, dv.to(G.dtype.element_ty), mask=mask)
                dqw += gz * rho * v
        tl.store(DQW_PART + pid * d + cols, dqw, mask=mask)


def depth_attention_fwd_triton(sources: list[Tensor], query: Tensor, norm_weight: Tensor,
                               eps: float) -> tuple[Tensor, Tensor]:
    """Launch the forward kernel: (mix like a source, contiguous; lse [...] fp32)."""
    M, d, BLOCK = _launch_shape(sources[0])
    src = [_rows(v) for v in sources]  # views of the sources, unless one is not contiguous
    mix = torch.empty_like(src[0])
    lse = torch.empty(M, device=mix.device, dtype=acc_dtype(mix))
    _depth_attention_fwd[(M,)](_pointer_table(src, mix.device), query.contiguous(), norm_weight.contiguous(),
                               mix, lse, len(src), d, eps, ALIGNED=_aligned(src), BLOCK=BLOCK, num_warps=_warps(BLOCK))
    return mix.view(sources[0].shape), lse.view(sources[0].shape[:-1])


def depth_attention_bwd_triton(sources: list[Tensor], query: Tensor, norm_weight: Tensor, lse: Tensor,
                               grad_mix: Tensor, eps: float) -> tuple[list[Tensor], Tensor, Tensor]:
    """Launch the backward kernel: (a gradient per source, grad query, grad norm_weight)."""
    M, d, BLOCK = _launch_shape(sources[0])
    src = [_rows(v) for v in sources]
    g = _rows(grad_mix).to(src[0].dtype)  # the sources' dtype: the gradients are stored in it too
    grads = [torch.empty_like(v) for v in src]
    n = _n_programs(M, g.device)
    dqw_part = torch.empty(n, d, device=g.device, dtype=torch.float32)
    _depth_attention_bwd[(n,)](_pointer_table(src, g.device), _pointer_table(grads, g.device),
                               query.contiguous(), norm_weight.contiguous(), lse.contiguous(), g, dqw_part,
                               len(src), M, d, eps, ALIGNED=_aligned(src + grads), BLOCK=BLOCK, num_warps=_warps(BLOCK))
    dqw = dqw_part.sum(0)
    return ([v.view(sources[0].shape) for v in grads], (dqw * norm_weight.float()).to(query.dtype),
            (dqw * query.float()).to(norm_weight.dtype))


depth_attention_op = custom_op("depth_attention", depth_attention_fwd_triton)
depth_attention_backward_op = custom_op("depth_attention_backward", depth_attention_bwd_triton)


@depth_attention_op.register_fake
def _(sources, query, norm_weight, eps):
    v = sources[0]
    return v.new_empty(v.shape), v.new_empty(v.shape[:-1], dtype=acc_dtype(v))


@depth_attention_backward_op.register_fake
def _(sources, query, norm_weight, lse, grad_mix, eps):
    return [v.new_empty(v.shape) for v in sources], torch.empty_like(query), torch.empty_like(norm_weight)


def _depth_attention_setup(ctx, inputs, output):
    sources, query, norm_weight, eps = inputs
    _depth_attention_save(ctx, sources, query, norm_weight, output[1], eps)
    ctx.mark_non_differentiable(output[1])


def _depth_attention_backward(ctx, grad_mix, _):
    return *_depth_attention_grads(ctx, grad_mix, depth_attention_backward_op), None


depth_attention_op.register_autograd(_depth_attention_backward, setup_context=_depth_attention_setup)


depth_attention_op.register_kernel("cpu", depth_attention_fwd_torch)
depth_attention_backward_op.register_kernel("cpu", depth_attention_bwd_torch)


# -----------------------------------------------------------------------------
# 4-6. Hyper-connections (model.py's HyperConnections and MHC): n streams X [..., n, d] per token.
#   mhc_pre_mix(x, proj, scale, base) -> (u, h_post, res_logits): mHC's coefficients and its read.
#     With rstd = 1 / sqrt(mean(vec(X)^2) + norm_eps) (RMSNorm over the flattened n*d stream, folded
#     after the projection proj = vec(X) phi^T, a matmul done outside), c = proj * rstd * scale + base,
#     scale's 3 entries spread over the pre (n), post (n) and res (n*n) parts:
#       h_pre = sigmoid(c[:n]) + pre_eps;  h_post = sigmoid(c[n:2n]) * post_mult;  res_logits = c[2n:]
#       u = sum_m h_pre[m] X_m  (the read: the sublayer's input before its own norm)
#   sinkhorn(logits, repeat, eps) -> H: softmax over the last axis + eps, then column sums to 1,
#     then (repeat - 1) times rows, then columns. Always fp32.
#   hc_post_mix(x, out, h_post, h_res) -> X'_j = sum_m h_res[m, j] X_m + h_post[j] out  (the write)
# All three are memory-bound per token; the coefficients are fp32 whatever the stream's dtype.

def mhc_pre_mix(x, proj, scale, base, norm_eps=1e-6, pre_eps=1e-6, post_mult=1.0, impl="auto"):
    """mHC's coefficients and read for one sublayer. x [..., n, d] the streams; proj [..., n(n+2)] =
    vec(x) phi^T (any float dtype); scale [3]; base [n(n+2)]. Returns (u [..., d] in x's dtype,
    h_post [..., n] fp32, res_logits [..., n, n] fp32 for sinkhorn)."""
    if use_triton(impl, x):
        return mhc_pre_mix_op(x, proj, scale, base, norm_eps, pre_eps, post_mult)
    return MHCPreMixTorch.apply(x, proj, scale, base, norm_eps, pre_eps, post_mult)


def sinkhorn(logits, repeat=10, eps=1e-6, impl="auto"):
    """Sinkhorn-Knopp as in mHC's official code: logits [..., n, n] -> H [..., n, n] fp32, near
    doubly stochastic (columns exact, rows within the iterations' error), whatever the autocast."""
    if use_triton(impl, logits):
        return sinkhorn_op(logits, repeat, eps)
    return SinkhornTorch.apply(logits, repeat, eps)


def hc_post_mix(x, out, h_post, h_res, impl="auto"):
    """The hyper-connection write: X'_j = sum_m h_res[m, j] X_m + h_post[j] out. x [..., n, d];
    out [..., d]; h_post [..., n] and h_res [..., n, n], per row or shared (broadcast). Returns X' in
    x's dtype."""
    if use_triton(impl, x):
        return hc_post_mix_op(x, out, h_post, h_res)
    return HCPostMixTorch.apply(x, out, h_post, h_res)


# the references: the launchers' contracts in plain PyTorch


def _hc_scale(scale, n):
    """scale [3] spread over the n + n + n*n coefficients, fp32."""
    s = upcast(scale)
    return torch.cat((s[0].expand(n), s[1].expand(n), s[2].expand(n * n)))


def _mhc_coefficients(x, proj, scale, base, norm_eps, pre_eps, post_mult):
    """(xf, rstd [..., 1], mixes = proj * rstd [..., K], sigmoid(c[:n]), sigmoid(c[n:2n]), res logits [..., n, n])
    in fp32 (fp64 stays fp64)."""
    n = x.shape[-2]
    xf = upcast(x)
    rstd = torch.rsqrt(xf.square().mean((-2, -1)) + norm_eps).unsqueeze(-1)
    mixes = upcast(proj) * rstd
    c = mixes * _hc_scale(scale, n).to(mixes.dtype) + upcast(base)
    return (xf, rstd, mixes, torch.sigmoid(c[..., :n]), torch.sigmoid(c[..., n:2 * n]),
            c[..., 2 * n:].unflatten(-1, (n, n)))


def mhc_pre_mix_fwd_torch(x: Tensor, proj: Tensor, scale: Tensor, base: Tensor, norm_eps: float, pre_eps: float,
                          post_mult: float) -> tuple[Tensor, Tensor, Tensor]:
    """(u [..., d] in x's dtype; h_post [..., n] fp32; res_logits [..., n, n] fp32)."""
    with fp32_math(x):
        xf, rstd, mixes, sig_pre, sig_post, res = _mhc_coefficients(x, proj, scale, base, norm_eps, pre_eps, post_mult)
        u = ((sig_pre + pre_eps).unsqueeze(-1) * xf).sum(-2)
        return cast(u, x.dtype), sig_post * post_mult, res.contiguous()


def mhc_pre_mix_bwd_torch(x: Tensor, proj: Tensor, scale: Tensor, base: Tensor, grad_u: Tensor, grad_h_post: Tensor,
                          grad_res: Tensor, norm_eps: float, pre_eps: float,
                          post_mult: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(grad x, grad proj, grad scale [3], grad base [K]): the forward's steps back, last to first."""
    with fp32_math(x):
        n, d = x.shape[-2:]
        xf, rstd, mixes, sig_pre, sig_post, res = _mhc_coefficients(x, proj, scale, base, norm_eps, pre_eps, post_mult)
        gu = upcast(grad_u)
        g_pre = (xf * gu.unsqueeze(-2)).sum(-1)  # through u = sum_m h_pre[m] X_m
        g_c = torch.cat((g_pre * sig_pre * (1 - sig_pre),  # through the sigmoids
                         upcast(grad_h_post) * post_mult * sig_post * (1 - sig_post),
                         upcast(grad_res).flatten(-2)), dim=-1)
        g_mixes = g_c * _hc_scale(scale, n).to(g_c.dtype)  # through c = mixes * scale + base
        g_rstd = (g_mixes * upcast(proj)).sum(-1, keepdim=True)  # through mixes = proj * rstd
        # through rstd = (mean(X^2) + eps)^-1/2: d rstd / d X = -rstd^3 X / (n d)
        g_x = (sig_pre + pre_eps).unsqueeze(-1) * gu.unsqueeze(-2) - (g_rstd * rstd ** 3 / (n * d)).unsqueeze(-1) * xf
        parts = (g_c * mixes).reshape(-1, g_c.shape[-1])
        g_scale = torch.stack((parts[:, :n].sum(), parts[:, n:2 * n].sum(), parts[:, 2 * n:].sum()))
        return (g_x.to(x.dtype), (g_mixes * rstd).to(proj.dtype), g_scale.to(scale.dtype),
                g_c.reshape(-1, g_c.shape[-1]).sum(0).to(base.dtype))


def _mhc_pre_mix_save(ctx, x, proj, scale, base, *args):
    """The autograd glue of both paths (MHCPreMixTorch, and the Triton op's register_autograd): the inputs
    alone (x is the stream, which the projection's matmul saves too); the backward recomputes the rest."""
    ctx.save_for_backward(x, proj, scale, base)
    ctx.args = args


def _mhc_pre_mix_grads(ctx, grad_u, grad_h_post, grad_res, backward):
    """The gradients of (x, proj, scale, base, and the three floats) by `backward`, the reference's or the
    op's; an output nobody used has no gradient."""
    x, proj, scale, base = ctx.saved_tensors
    n, d = x.shape[-2:]
    if grad_u is None:
        grad_u = x.new_zeros(*x.shape[:-2], d)
    if grad_h_post is None:
        grad_h_post = x.new_zeros(x.shape[:-1], dtype=acc_dtype(x))
    if grad_res is None:
        grad_res = x.new_zeros(*x.shape[:-1], n, dtype=acc_dtype(x))
    return *backward(x, proj, scale, base, grad_u, grad_h_post, grad_res, *ctx.args), None, None, None


class MHCPreMixTorch(torch.autograd.Function):
    """The reference with autograd (impl="torch"): saves x, proj, scale and base (x is the stream,
    which the projection's matmul saves too), and recomputes the coefficients in the backward."""

    @staticmethod
    def forward(ctx, x, proj, scale, base, norm_eps, pre_eps, post_mult):
        _mhc_pre_mix_save(ctx, x, proj, scale, base, norm_eps, pre_eps, post_mult)
        return mhc_pre_mix_fwd_torch(x, proj, scale, base, *ctx.args)

    @staticmethod
    def backward(ctx, grad_u, grad_h_post, grad_res):
        return _mhc_pre_mix_grads(ctx, grad_u, grad_h_post, grad_res, mhc_pre_mix_bwd_torch)


def _sinkhorn_steps(logits, repeat, eps):
    """The forward's iterates, computed on [n, n, M] (M: the rows): the matrix axes first, so that every
    sum over an axis adds whole rows of tokens (several times faster on a CPU than sums over the last
    axes), and the rows in one contiguous axis, so that each op is a single pass with one broadcast.
    ([(z, denominator, axis), ...], each z before it is divided by its denominator, its sums over axis
    (0: columns, 1: rows) plus eps; the output). fp32 (fp64 stays fp64). eps is one 0-d tensor: a Python
    float is wrapped into a new tensor at every op, which costs more than the op at these sizes."""
    n = logits.shape[-1]
    z = torch.softmax(upcast(logits).reshape(-1, n, n).movedim(0, -1), dim=1)  # a contiguous [n, n, M]
    eps = z.new_full((), eps)
    z = z + eps
    steps = []
    for axis in (0,) + (1, 0) * (repeat - 1):
        denom = z.sum(axis, keepdim=True).add_(eps)
        steps.append((z, denom, axis))
        z = z / denom
    return steps, z


def _sinkhorn_rows(h, like):
    """An [n, n, M] iterate (or gradient) back as a contiguous tensor of like's shape [..., n, n] (a copy
    made last: the autograd.Function returns it, see cast)."""
    return h.view(*h.shape[:2], *like.shape[:-2]).movedim((0, 1), (-2, -1)).contiguous()


def sinkhorn_fwd_torch(logits: Tensor, repeat: int, eps: float) -> Tensor:
    """H [..., n, n] fp32, contiguous: columns sum to 1 (the last step), rows to 1 within the iterations' error."""
    with fp32_math(logits):
        return _sinkhorn_rows(_sinkhorn_steps(logits, repeat, eps)[1], logits)


def sinkhorn_bwd_torch(logits: Tensor, grad: Tensor, repeat: int, eps: float) -> Tensor:
    """grad logits, fp32: the iterates (and their denominators) recomputed, then each step back, last to first."""
    with fp32_math(logits):
        steps, _ = _sinkhorn_steps(logits, repeat, eps)
        n = logits.shape[-1]
        g = upcast(grad).reshape(-1, n, n).movedim(0, -1).contiguous()
        for z, denom, axis in reversed(steps):
            # y = z / denom, denom = sum_axis z + eps: dz = (g - sum_axis(g z) / denom) / denom
            g = torch.addcdiv(g, (g * z).sum(axis, keepdim=True), denom, value=-1).div_(denom)
        p = steps[0][0] - eps  # the softmax
        return _sinkhorn_rows(p * (g - (g * p).sum(1, keepdim=True)), logits)


def _sinkhorn_save(ctx, logits, repeat, eps):
    """The autograd glue of both paths (SinkhornTorch, and the Triton op's register_autograd): the logits only;
    the backward recomputes the iterates."""
    ctx.save_for_backward(logits)
    ctx.args = (repeat, eps)


def _sinkhorn_grads(ctx, grad, backward):
    """The gradients of (logits, repeat, eps) by `backward`, the reference's or the op's."""
    logits, = ctx.saved_tensors
    return backward(logits, grad, *ctx.args).to(logits.dtype), None, None


class SinkhornTorch(torch.autograd.Function):
    """The reference with autograd (impl="torch"): saves the logits only, as the fused kernel does."""

    @staticmethod
    def forward(ctx, logits, repeat, eps):
        _sinkhorn_save(ctx, logits, repeat, eps)
        return sinkhorn_fwd_torch(logits, repeat, eps)

    @staticmethod
    def backward(ctx, grad):
        return _sinkhorn_grads(ctx, grad, sinkhorn_bwd_torch)


def hc_post_mix_fwd_torch(x: Tensor, out: Tensor, h_post: Tensor, h_res: Tensor) -> Tensor:
    """X' [..., n, d] in x's dtype: X'_j = sum_m h_res[m, j] X_m + h_post[j] out, in fp32. The inputs are
    detached: torch.matmul broadcasts a shared h_res by another path (another summation order) when an
    input requires grad, and the op must give one result, eager or compiled."""
    x, out, h_post, h_res = (t.detach() for t in (x, out, h_post, h_res))
    with fp32_math(x):
        xf = upcast(x)
        mixed = torch.matmul(upcast(h_res).transpose(-1, -2), xf)
        return cast(torch.addcmul(mixed, upcast(h_post).unsqueeze(-1), upcast(out).unsqueeze(-2)), x.dtype)


def hc_post_mix_bwd_torch(x: Tensor, out: Tensor, h_post: Tensor, h_res: Tensor,
                          grad: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(grad x, grad out, grad h_post [..., n] fp32, grad h_res [..., n, n] fp32), per row (inputs detached,
    as the forward's)."""
    x, out, h_post, h_res, grad = (t.detach() for t in (x, out, h_post, h_res, grad))
    with fp32_math(x):
        g, xf, of = upcast(grad), upcast(x), upcast(out)
        g_x = torch.matmul(upcast(h_res), g)  # dX_m = sum_j h_res[m, j] dX'_j
        g_out = torch.matmul(upcast(h_post).unsqueeze(-2), g).squeeze(-2)  # sum_j h_post[j] dX'_j
        g_h_res = torch.matmul(xf, g.transpose(-1, -2))  # <X_m, dX'_j>
        g_h_post = torch.matmul(g, of.unsqueeze(-1)).squeeze(-1)  # <dX'_j, out>
        return g_x.to(x.dtype), g_out.to(out.dtype), g_h_post, g_h_res


def _sum_to(g, t):
    """A per-row gradient g summed to the shape of t (a coefficient shared by rows), in t's dtype."""
    return g.sum_to_size(t.shape).to(t.dtype)


def _hc_post_mix_grads(ctx, grad, backward):
    """The autograd glue of both paths (HCPostMixTorch, and the Triton op's register_autograd, which both save
    x, out and the coefficients): the gradients by `backward`, the reference's or the op's, per row; a
    coefficient shared by the rows gets their sum."""
    x, out, h_post, h_res = ctx.saved_tensors
    g_x, g_out, g_post, g_res = backward(x, out, h_post, h_res, grad)
    return g_x, g_out, _sum_to(g_post, h_post), _sum_to(g_res, h_res)


class HCPostMixTorch(torch.autograd.Function):
    """The reference with autograd (impl="torch"): saves x, out and the coefficients."""

    @staticmethod
    def forward(ctx, x, out, h_post, h_res):
        ctx.save_for_backward(x, out, h_post, h_res)
        return hc_post_mix_fwd_torch(x, out, h_post, h_res)

    @staticmethod
    def backward(ctx, grad):
        return _hc_post_mix_grads(ctx, grad, hc_post_mix_bwd_torch)


# The kernels: one program per token row for the two mixes (the row's n x d streams are one
# [NP, BLOCK] tile, NP and BLOCK the powers of two over n and d), and a block of ROWS matrices per
# program for Sinkhorn, whose iterations all run in registers. Each backward kernel recomputes what
# its forward computed from the saved inputs (rstd and the coefficients; Sinkhorn's iterates), so
# the ops save only their inputs.

if triton is not None:

    @triton.jit
    def _hc_tile(X, row, d, N: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr):
        # (the row's streams as an fp32 [NP, BLOCK] tile, its offsets, its mask) of X [M, N, d]
        m = tl.arange(0, NP)
        cols = tl.arange(0, BLOCK)
        off = row * N * d + m[:, None] * d + cols[None, :]
        mask = (m < N)[:, None] & (cols < d)[None, :]
        return tl.load(X + off, mask=mask, other=0.0).to(tl.float32), off, mask

    @triton.jit
    def _mhc_row(X, row, d, norm_eps, N: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr):
        # the row's streams (the [NP, BLOCK] tile, its offsets and mask), their rstd over all n*d values,
        # and the coefficients' indices: m over the n streams (mask mm), res over the n x n entries
        x, off, mask = _hc_tile(X, row, d, N, NP, BLOCK)
        rstd = tl.rsqrt(tl.sum(x * x) / (N * d) + norm_eps)
        m = tl.arange(0, NP)
        mm = m < N
        return x, off, mask, rstd, m, mm, m[:, None] * N + m[None, :], mm[:, None] & mm[None, :]

    @triton.jit
    def _mhc_part(PROJ, BASE, s, row, rstd, start, idx, mask, K):
        # one part of the coefficients (pre, post or res) at entries start + idx of the row's K:
        # (proj's entries, c = proj * rstd * s + base), 0 where masked
        p = tl.load(PROJ + row * K + start + idx, mask=mask, other=0.0).to(tl.float32)
        return p, p * rstd * s + tl.load(BASE + start + idx, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _mhc_pre_mix_fwd(X, PROJ, SCALE, BASE, U, H_POST, RES, d, norm_eps, pre_eps, post_mult,
                         N: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr):
        # the stream is read once: its rstd, then the read u = sum_m h_pre[m] X_m from the same tile
        row = tl.program_id(0).to(tl.int64)
        x, _, _, rstd, m, mm, res, res_mask = _mhc_row(X, row, d, norm_eps, N, NP, BLOCK)
        K = N * (N + 2)
        _, c_pre = _mhc_part(PROJ, BASE, tl.load(SCALE).to(tl.float32), row, rstd, 0, m, mm, K)
        _, c_post = _mhc_part(PROJ, BASE, tl.load(SCALE + 1).to(tl.float32), row, rstd, N, m, mm, K)
        _, c_res = _mhc_part(PROJ, BASE, tl.load(SCALE + 2).to(tl.float32), row, rstd, 2 * N, res, res_mask, K)
        u = tl.sum((tl.sigmoid(c_pre) + pre_eps)[:, None] * x, axis=0)  # padded streams are 0
        cols = tl.arange(0, BLOCK)
        tl.store(U + row * d + cols, u.to(U.dtype.element_ty), mask=cols < d)
        tl.store(H_POST + row * N + m, tl.sigmoid(c_post) * post_mult, mask=mm)
        tl.store(RES + row * N * N + res, c_res, mask=res_mask)

    @triton.jit
    def _mhc_pre_mix_bwd(X, PROJ, SCALE, BASE, GU, GH_POST, GRES, GX, GPROJ, GC, GS, d, norm_eps, pre_eps,
                         post_mult, N: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr):
        # the forward recomputed from x and proj, then mhc_pre_mix_bwd_torch's steps back. Per row it
        # writes the gradient of c (GC [M, K]) and the row's three terms of the scale's gradient
        # (GS [M, 3]); the launcher sums them over rows.
        row = tl.program_id(0).to(tl.int64)
        x, off, mask, rstd, m, mm, res, res_mask = _mhc_row(X, row, d, norm_eps, N, NP, BLOCK)
        K = N * (N + 2)
        s_pre = tl.load(SCALE).to(tl.float32)
        s_post = tl.load(SCALE + 1).to(tl.float32)
        s_res = tl.load(SCALE + 2).to(tl.float32)
        p_pre, c_pre = _mhc_part(PROJ, BASE, s_pre, row, rstd, 0, m, mm, K)
        p_post, c_post = _mhc_part(PROJ, BASE, s_post, row, rstd, N, m, mm, K)
        p_res, _ = _mhc_part(PROJ, BASE, s_res, row, rstd, 2 * N, res, res_mask, K)
        sig_pre, sig_post = tl.sigmoid(c_pre), tl.sigmoid(c_post)
        cols = tl.arange(0, BLOCK)
        gu = tl.load(GU + row * d + cols, mask=cols < d, other=0.0).to(tl.float32)
        gc_pre = tl.sum(x * gu[None, :], axis=1) * sig_pre * (1.0 - sig_pre)  # through u, then the sigmoid
        gc_post = (tl.load(GH_POST + row * N + m, mask=mm, other=0.0).to(tl.float32)
                   * post_mult * sig_post * (1.0 - sig_post))
        gc_res = tl.load(GRES + row * N * N + res, mask=res_mask, other=0.0).to(tl.float32)
        # through c = proj * rstd * scale + base: d rstd, then rstd = (mean(X^2) + eps)^-1/2
        g_rstd = (s_pre * tl.sum(gc_pre * p_pre) + s_post * tl.sum(gc_post * p_post)
                  + s_res * tl.sum(gc_res * p_res))
        gx = (sig_pre + pre_eps)[:, None] * gu[None, :] - (g_rstd * rstd * rstd * rstd / (N * d)) * x
        tl.store(GX + off, gx.to(GX.dtype.element_ty), mask=mask)
        gp = GPROJ + row * K
        tl.store(gp + m, (gc_pre * (s_pre * rstd)).to(GPROJ.dtype.element_ty), mask=mm)
        tl.store(gp + N + m, (gc_post * (s_post * rstd)).to(GPROJ.dtype.element_ty), mask=mm)
        tl.store(gp + 2 * N + res, (gc_res * (s_res * rstd)).to(GPROJ.dtype.element_ty), mask=res_mask)
        tl.store(GC + row * K + m, gc_pre, mask=mm)
        tl.store(GC + row * K + N + m, gc_post, mask=mm)
        tl.store(GC + row * K + 2 * N + res, gc_res, mask=res_mask)
        tl.store(GS + row * 3, rstd * tl.sum(gc_pre * p_pre))  # <g_c, mixes> per part
        tl.store(GS + row * 3 + 1, rstd * tl.sum(gc_post * p_post))
        tl.store(GS + row * 3 + 2, rstd * tl.sum(gc_res * p_res))

    @triton.jit
    def _sinkhorn_start(LOGITS, M, eps, N: tl.constexpr, NP: tl.constexpr, ROWS: tl.constexpr):
        # the program's ROWS matrices as [ROWS, NP, NP]: (offsets, mask, p = softmax over the last
        # axis, z = p + eps), both 0 where padded, so that padding never reaches a row or column sum
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        i = tl.arange(0, NP)
        off = rows[:, None, None] * (N * N) + i[None, :, None] * N + i[None, None, :]
        col_ok = (i < N)[None, None, :]
        mask = (rows < M)[:, None, None] & (i < N)[None, :, None] & col_ok
        z = tl.load(LOGITS + off, mask=mask, other=0.0).to(tl.float32)
        z = tl.where(col_ok, z, float("-inf"))  # padded rows keep finite 0s: their max is finite
        p = tl.exp(z - tl.max(z, axis=2, keep_dims=True))
        p = p / tl.sum(p, axis=2, keep_dims=True)
        return off, mask, p, tl.where(mask, p + eps, 0.0)

    @triton.jit
    def _normalize(z, AXIS: tl.constexpr, eps):
        # z / (sum over AXIS + eps): AXIS 1 makes column sums 1, AXIS 2 row sums
        return z * (1.0 / (tl.sum(z, axis=AXIS, keep_dims=True) + eps))

    @triton.jit
    def _normalize_bwd(z, g, mask, AXIS: tl.constexpr, eps):
        # back through y = z / (S + eps), S = sum over AXIS of z: dz = (g - sum(g z) / (S + eps)) / (S + eps).
        # Kept 0 where padded: there S + eps = eps, and a broadcast sum would grow by 1 / eps a step.
        inv = 1.0 / (tl.sum(z, axis=AXIS, keep_dims=True) + eps)
        return tl.where(mask, (g - tl.sum(g * z, axis=AXIS, keep_dims=True) * inv) * inv, 0.0)

    @triton.jit
    def _sinkhorn_fwd(LOGITS, H, M, repeat, eps, N: tl.constexpr, NP: tl.constexpr, ROWS: tl.constexpr):
        # every iteration in registers: the logits read once, H written once
        off, mask, _, z = _sinkhorn_start(LOGITS, M, eps, N, NP, ROWS)
        z = _normalize(z, 1, eps)
        for _ in range(1, repeat):
            z = _normalize(_normalize(z, 2, eps), 1, eps)
        tl.store(H + off, z, mask=mask)

    @triton.jit
    def _sinkhorn_bwd(LOGITS, G, DL, M, repeat, eps, N: tl.constexpr, NP: tl.constexpr, ROWS: tl.constexpr):
        # Nothing but the logits is saved: iteration k's input is recomputed from the softmax before
        # going back through its row and column steps, last iteration first. That is O(repeat^2)
        # normalisations of n x n values in registers, for no memory traffic beyond the forward's.
        off, mask, p, z0 = _sinkhorn_start(LOGITS, M, eps, N, NP, ROWS)
        g = tl.load(G + off, mask=mask, other=0.0).to(tl.float32)
        for t in range(1, repeat):
            z = _normalize(z0, 1, eps)
            for _ in range(1, repeat - t):
                z = _normalize(_normalize(z, 2, eps), 1, eps)
            # z: the input of iteration repeat - t's row step, whose output its column step reads
            g = _normalize_bwd(_normalize(z, 2, eps), g, mask, 1, eps)
            g = _normalize_bwd(z, g, mask, 2, eps)
        g = _normalize_bwd(z0, g, mask, 1, eps)  # the first column step
        dl = p * (g - tl.sum(g * p, axis=2, keep_dims=True))  # and the softmax
        tl.store(DL + off, dl.to(DL.dtype.element_ty), mask=mask)

    @triton.jit
    def _hc_post_mix_fwd(X, OUT, H_POST, H_RES, Y, d, hp_stride, hr_stride,
                         N: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr):
        # X'_j = h_post[j] out + sum_m h_res[m, j] X_m: an [NP, BLOCK] tile of the n outputs built by
        # n broadcast multiply-adds, one stream read at a time. A coefficient's row stride is 0
        # when it is shared by all rows.
        row = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, NP)
        cols = tl.arange(0, BLOCK)
        col_ok = cols < d
        out = tl.load(OUT + row * d + cols, mask=col_ok, other=0.0).to(tl.float32)
        acc = tl.load(H_POST + row * hp_stride + j, mask=j < N, other=0.0).to(tl.float32)[:, None] * out[None, :]
        for m in range(N):  # a loop: unrolled, ptxas hoisted all n loads and spilled at BLOCK 4096
            x_m = tl.load(X + (row * N + m) * d + cols, mask=col_ok, other=0.0).to(tl.float32)
            h_m = tl.load(H_RES + row * hr_stride + m * N + j, mask=j < N, other=0.0).to(tl.float32)
            acc += h_m[:, None] * x_m[None, :]
        mask = (j < N)[:, None] & col_ok[None, :]
        tl.store(Y + row * N * d + j[:, None] * d + cols[None, :], acc.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _hc_post_mix_bwd(X, OUT, H_POST, H_RES, G, GX, GOUT, GH_POST, GH_RES, d, hp_stride, hr_stride,
                         N: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr):
        # with G the [NP, BLOCK] tile of dX': d out = sum_j h_post[j] G_j, d h_post[j] = <G_j, out>,
        # then per stream m: dX_m = sum_j h_res[m, j] G_j and d h_res[m, j] = <X_m, G_j>
        row = tl.program_id(0).to(tl.int64)
        g, _, _ = _hc_tile(G, row, d, N, NP, BLOCK)
        j = tl.arange(0, NP)
        cols = tl.arange(0, BLOCK)
        col_ok = cols < d
        out = tl.load(OUT + row * d + cols, mask=col_ok, other=0.0).to(tl.float32)
        h_post = tl.load(H_POST + row * hp_stride + j, mask=j < N, other=0.0).to(tl.float32)
        tl.store(GOUT + row * d + cols, tl.sum(h_post[:, None] * g, axis=0).to(GOUT.dtype.element_ty), mask=col_ok)
        tl.store(GH_POST + row * N + j, tl.sum(g * out[None, :], axis=1), mask=j < N)
        for m in range(N):  # a loop, as in the forward
            x_m = tl.load(X + (row * N + m) * d + cols, mask=col_ok, other=0.0).to(tl.float32)
            h_m = tl.load(H_RES + row * hr_stride + m * N + j, mask=j < N, other=0.0).to(tl.float32)
            tl.store(GX + (row * N + m) * d + cols, tl.sum(h_m[:, None] * g, axis=0).to(GX.dtype.element_ty),
                     mask=col_ok)
            tl.store(GH_RES + (row * N + m) * N + j, tl.sum(g * x_m[None, :], axis=1), mask=j < N)


def _hc_shape(x):
    """(rows M, streams n, width d, NP, BLOCK: the powers of two over n and d) of x [..., n, d]."""
    n, d = x.shape[-2:]
    return x.numel() // (n * d), n, d, triton.next_power_of_2(n), triton.next_power_of_2(d)


def _streams(x):
    """x [..., n, d] as a contiguous [M, n, d] (a copy only if x is not already contiguous)."""
    return x.reshape(-1, *x.shape[-2:]).contiguous()


def _hc_coefficient(h, lead, tail):
    """A coefficient of shape [*lead, *tail] or shared by the rows (broadcast, e.g. [*tail]), as
    (an [M, prod(tail)] view or copy with unit inner stride, its row stride): a shared one stays
    one copy, read with row stride 0."""
    rows = h.expand(*lead, *tail).reshape(-1, math.prod(tail))
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    return rows, rows.stride(0)


def mhc_pre_mix_fwd_triton(x: Tensor, proj: Tensor, scale: Tensor, base: Tensor, norm_eps: float, pre_eps: float,
                           post_mult: float) -> tuple[Tensor, Tensor, Tensor]:
    """Launch the forward kernel: (u [..., d] like x; h_post [..., n] fp32; res_logits [..., n, n] fp32)."""
    M, n, d, NP, BLOCK = _hc_shape(x)
    if proj.shape != (*x.shape[:-2], n * (n + 2)) or scale.numel() != 3 or base.numel() != n * (n + 2):
        raise ValueError(f"mhc_pre_mix: for x {tuple(x.shape)} (n = {n}) proj must be {(*x.shape[:-2], n * (n + 2))}, "
                         f"scale [3] and base [{n * (n + 2)}]; got {tuple(proj.shape)}, {tuple(scale.shape)}, "
                         f"{tuple(base.shape)}")
    x2 = _streams(x)
    u = x2.new_empty(M, d)
    h_post = torch.empty(M, n, device=x.device, dtype=acc_dtype(x))
    res = torch.empty(M, n, n, device=x.device, dtype=acc_dtype(x))
    _mhc_pre_mix_fwd[(M,)](x2, _rows(proj), scale.contiguous(), base.contiguous(), u, h_post, res, d, norm_eps,
                           pre_eps, post_mult, N=n, NP=NP, BLOCK=BLOCK, num_warps=_warps(NP * BLOCK))
    lead = x.shape[:-2]
    return u.view(*lead, d), h_post.view(*lead, n), res.view(*lead, n, n)


def mhc_pre_mix_bwd_triton(x: Tensor, proj: Tensor, scale: Tensor, base: Tensor, grad_u: Tensor, grad_h_post: Tensor,
                           grad_res: Tensor, norm_eps: float, pre_eps: float,
                           post_mult: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Launch the backward kernel: (grad x, grad proj, grad scale [3], grad base [K])."""
    M, n, d, NP, BLOCK = _hc_shape(x)
    x2, proj2 = _streams(x), _rows(proj)
    gx, gproj = torch.empty_like(x2), torch.empty_like(proj2)
    gc = torch.empty(M, n * (n + 2), device=x.device, dtype=torch.float32)
    gs = torch.empty(M, 3, device=x.device, dtype=torch.float32)
    _mhc_pre_mix_bwd[(M,)](x2, proj2, scale.contiguous(), base.contiguous(), _rows(grad_u), _rows(grad_h_post),
                           grad_res.reshape(M, n * n).contiguous(), gx, gproj, gc, gs, d, norm_eps, pre_eps,
                           post_mult, N=n, NP=NP, BLOCK=BLOCK, num_warps=_warps(NP * BLOCK))
    return gx.view(x.shape), gproj.view(proj.shape), gs.sum(0).to(scale.dtype), gc.sum(0).to(base.dtype)


def _sinkhorn_launch(logits):
    """(the logits as a contiguous [M, n * n], M, n, NP, ROWS, grid): about 1024 values per program."""
    n = logits.shape[-1]
    l2 = logits.reshape(-1, n * n).contiguous()
    NP = triton.next_power_of_2(n)
    rows = max(1, 1024 // (NP * NP))
    return l2, l2.shape[0], n, NP, rows, (triton.cdiv(l2.shape[0], rows),)


def sinkhorn_fwd_triton(logits: Tensor, repeat: int, eps: float) -> Tensor:
    """Launch the forward kernel, all iterations in one: H [..., n, n] fp32."""
    l2, M, n, NP, ROWS, grid = _sinkhorn_launch(logits)
    h = torch.empty(l2.shape, device=logits.device, dtype=acc_dtype(logits))
    _sinkhorn_fwd[grid](l2, h, M, repeat, eps, N=n, NP=NP, ROWS=ROWS, num_warps=4)
    return h.view(logits.shape)


def sinkhorn_bwd_triton(logits: Tensor, grad: Tensor, repeat: int, eps: float) -> Tensor:
    """Launch the backward kernel (it recomputes the iterates): grad logits, fp32."""
    l2, M, n, NP, ROWS, grid = _sinkhorn_launch(logits)
    dl = torch.empty(l2.shape, device=logits.device, dtype=acc_dtype(logits))
    _sinkhorn_bwd[grid](l2, grad.reshape(M, n * n).contiguous(), dl, M, repeat, eps, N=n, NP=NP, ROWS=ROWS,
                        num_warps=4)
    return dl.view(logits.shape)


def hc_post_mix_fwd_triton(x: Tensor, out: Tensor, h_post: Tensor, h_res: Tensor) -> Tensor:
    """Launch the forward kernel: X' like x, contiguous."""
    M, n, d, NP, BLOCK = _hc_shape(x)
    x2 = _streams(x)
    y = torch.empty_like(x2)
    hp, hp_stride = _hc_coefficient(h_post, x.shape[:-2], (n,))
    hr, hr_stride = _hc_coefficient(h_res, x.shape[:-2], (n, n))
    _hc_post_mix_fwd[(M,)](x2, _rows(out), hp, hr, y, d, hp_stride, hr_stride, N=n, NP=NP, BLOCK=BLOCK,
                           num_warps=_warps(NP * BLOCK))
    return y.view(x.shape)


def hc_post_mix_bwd_triton(x: Tensor, out: Tensor, h_post: Tensor, h_res: Tensor,
                           grad: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Launch the backward kernel: (grad x, grad out, grad h_post [..., n] and grad h_res [..., n, n]
    per row, fp32)."""
    M, n, d, NP, BLOCK = _hc_shape(x)
    x2, out2 = _streams(x), _rows(out)
    gx, gout = torch.empty_like(x2), torch.empty_like(out2)
    g_post = torch.empty(M, n, device=x.device, dtype=acc_dtype(x))
    g_res = torch.empty(M, n, n, device=x.device, dtype=acc_dtype(x))
    hp, hp_stride = _hc_coefficient(h_post, x.shape[:-2], (n,))
    hr, hr_stride = _hc_coefficient(h_res, x.shape[:-2], (n, n))
    _hc_post_mix_bwd[(M,)](x2, out2, hp, hr, _streams(grad), gx, gout, g_post, g_res, d, hp_stride, hr_stride,
                           N=n, NP=NP, BLOCK=BLOCK, num_warps=_warps(NP * BLOCK))
    lead = x.shape[:-2]
    return gx.view(x.shape), gout.view(out.shape), g_post.view(*lead, n), g_res.view(*lead, n, n)


mhc_pre_mix_op = custom_op("mhc_pre_mix", mhc_pre_mix_fwd_triton)
mhc_pre_mix_backward_op = custom_op("mhc_pre_mix_backward", mhc_pre_mix_bwd_triton)
sinkhorn_op = custom_op("sinkhorn", sinkhorn_fwd_triton)
sinkhorn_backward_op = custom_op("sinkhorn_backward", sinkhorn_bwd_triton)
hc_post_mix_op = custom_op("hc_post_mix", hc_post_mix_fwd_triton)
hc_post_mix_backward_op = custom_op("hc_post_mix_backward", hc_post_mix_bwd_triton)


@mhc_pre_mix_op.register_fake
def _(x, proj, scale, base, norm_eps, pre_eps, post_mult):
    n, d = x.shape[-2:]
    lead = x.shape[:-2]
    return (x.new_empty(*lead, d), x.new_empty(*lead, n, dtype=acc_dtype(x)),
            x.new_empty(*lead, n, n, dtype=acc_dtype(x)))


@mhc_pre_mix_backward_op.register_fake
def _(x, proj, scale, base, grad_u, grad_h_post, grad_res, norm_eps, pre_eps, post_mult):
    return torch.empty_like(x), torch.empty_like(proj), torch.empty_like(scale), torch.empty_like(base)


@sinkhorn_op.register_fake
def _(logits, repeat, eps):
    return logits.new_empty(logits.shape, dtype=acc_dtype(logits))


@sinkhorn_backward_op.register_fake
def _(logits, grad, repeat, eps):
    return logits.new_empty(logits.shape, dtype=acc_dtype(logits))


@hc_post_mix_op.register_fake
def _(x, out, h_post, h_res):
    return x.new_empty(x.shape)


@hc_post_mix_backward_op.register_fake
def _(x, out, h_post, h_res, grad):
    n = x.shape[-2]
    return (x.new_empty(x.shape), out.new_empty(out.shape), x.new_empty(x.shape[:-1], dtype=acc_dtype(x)),
            x.new_empty(*x.shape[:-1], n, dtype=acc_dtype(x)))


def _mhc_pre_mix_setup(ctx, inputs, output):
    _mhc_pre_mix_save(ctx, *inputs)


def _mhc_pre_mix_backward(ctx, grad_u, grad_h_post, grad_res):
    return _mhc_pre_mix_grads(ctx, grad_u, grad_h_post, grad_res, mhc_pre_mix_backward_op)


def _sinkhorn_setup(ctx, inputs, output):
    _sinkhorn_save(ctx, *inputs)


def _sinkhorn_backward(ctx, grad):
    return _sinkhorn_grads(ctx, grad, sinkhorn_backward_op)


def _hc_post_mix_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _hc_post_mix_backward(ctx, grad):
    return _hc_post_mix_grads(ctx, grad, hc_post_mix_backward_op)


mhc_pre_mix_op.register_autograd(_mhc_pre_mix_backward, setup_context=_mhc_pre_mix_setup)
sinkhorn_op.register_autograd(_sinkhorn_backward, setup_context=_sinkhorn_setup)
hc_post_mix_op.register_autograd(_hc_post_mix_backward, setup_context=_hc_post_mix_setup)


mhc_pre_mix_op.register_kernel("cpu", mhc_pre_mix_fwd_torch)
mhc_pre_mix_backward_op.register_kernel("cpu", mhc_pre_mix_bwd_torch)
sinkhorn_op.register_kernel("cpu", sinkhorn_fwd_torch)
sinkhorn_backward_op.register_kernel("cpu", sinkhorn_bwd_torch)
hc_post_mix_op.register_kernel("cpu", hc_post_mix_fwd_torch)
hc_post_mix_backward_op.register_kernel("cpu", hc_post_mix_bwd_torch)


# -----------------------------------------------------------------------------
# 7. dense_mix: S sources [..., d] and weights -> their weighted sum (DenseFormer's DWA, MUDDFormer's ways)
#   weights [S] (one per source, shared by all tokens: dwa):           out [..., d]    = sum_s w[s] x_s
#   weights [..., C, S] (per token and way c: mudd's dynamic weights): out [..., C, d], out_c = sum_s w[c, s] x_s
# Backward: dx_s = sum_c w[c, s] g_c;  dw[c, s] = <g_c, x_s> (summed over tokens for shared weights).
# As depth_attention, every path reads the sources where they lie (a table of addresses, never a stacked
# copy) and saves only the sources (alive anyway, the stream's earlier outputs) and the weights: no
# product per source. Bytes moved per token, b per stored element: forward S d b read, C d b written;
# backward (S + C) d b read, S d b written, plus the weights.

def dense_mix(sources, weights, impl="auto"):
    """The weighted sum of S sources (a list of S >= 1 tensors [..., d] of one shape and dtype, one
    stacked [S, ..., d], or a SourceStack): weights [S] -> out [..., d] = sum_s w[s] x_s (one weight per
    source: DenseFormer's DWA); weights [..., C, S] -> out [..., C, d], out_c = sum_s w[c, s] x_s (per token
    and way: MUDDFormer). fp32 inside; out in the sources' dtype."""
    stacked, grads = _buffered(sources), _slot_grads(sources)
    sources = _source_list(sources, "dense_mix")
    S, v = len(sources), sources[0]
    if weights.shape[-1] != S or (weights.dim() > 1 and weights.shape[:-2] != v.shape[:-1]):
        raise ValueError(f"dense_mix: weights must be [{S}] or [..., C, {S}] with ... = {tuple(v.shape[:-1])}, "
                         f"got {tuple(weights.shape)}")
    if use_triton(impl, v):
        return dense_mix_op(sources, weights)
    if not torch.is_grad_enabled():
        V = _stacked(sources, stacked)
        with fp32_math(V):
            return cast(_dense_mix_ref_fwd(V, weights), v.dtype)
    return DenseMixTorch.apply(weights, stacked, grads, *sources)


# the reference: batched ops on the sources stacked as one fp32 V [S, ..., d] (a SourceStack's buffer, or a
# transient stack made inside the call); autograd saves the sources and the weights only.

def _dense_mix_ref_fwd(V, weights):
    """out [..., d] (weights [S]: one matrix-vector product) or [..., C, d] (weights [..., C, S]: a batched
    matmul), fp32."""
    w = upcast(weights)
    if w.dim() == 1:
        return torch.tensordot(w, V, dims=1)
    return torch.matmul(w, V.movedim(0, -2))


def _dense_mix_ref_bwd(V, weights, grad, into=None):
    """(grad V: [S, ..., d] (weights [S]) or [..., S, d] (weights [..., C, S]), grad weights), fp32. into: an
    fp32 [S, ..., d] that grad V is added to in place (and returned, [S, ..., d]), instead of a new tensor."""
    g, w = upcast(grad), upcast(weights)
    if w.dim() == 1:  # dx_s = w[s] g; dw[s] = <g, x_s> over all tokens
        w_s = w.view(-1, *(1,) * g.dim())
        return w_s * g if into is None else into.addcmul_(w_s, g), V.reshape(len(w), -1) @ g.reshape(-1)
    # dx_s = sum_c w[c, s] g_c for all s; dw[c, s] = <g_c, x_s>
    grad_V = torch.matmul(w.transpose(-1, -2), g)
    return grad_V if into is None else into.add_(grad_V.movedim(-2, 0)), torch.matmul(g, V.movedim(0, -1))


def _dense_mix_source_grads(grad_V, weights, sources, copy):
    """grad V split into a gradient per source, each in its source's dtype; copy=False: views where the dtypes
    agree."""
    per_source = grad_V.unbind(0 if weights.dim() == 1 else -2)
    return [g.to(v.dtype, copy=copy) for g, v in zip(per_source, sources)]


def dense_mix_fwd_torch(sources: list[Tensor], weights: Tensor) -> Tensor:
    """out [..., d] (weights [S]) or [..., C, d] (weights [..., C, S]) in the sources' dtype, fp32 inside."""
    with fp32_math(sources[0]):
        return cast(_dense_mix_ref_fwd(_stacked(sources), weights), sources[0].dtype)


def dense_mix_bwd_torch(sources: list[Tensor], weights: Tensor, grad: Tensor) -> tuple[list[Tensor], Tensor]:
    """(a gradient per source in its dtype, grad weights in the weights' dtype). An op's outputs may not
    alias: the source gradients are copies."""
    with fp32_math(grad):
        grad_V, gw = _dense_mix_ref_bwd(_stacked(sources), weights, grad)
        return _dense_mix_source_grads(grad_V, weights, sources, copy=True), gw.to(weights.dtype)


def _dense_mix_grads_of(ctx, grad, backward):
    """The autograd glue of the Triton op's register_autograd (which saves the weights and the sources as they
    are): (a gradient per source, grad weights) by `backward`."""
    weights, *sources = ctx.saved_tensors
    return backward(sources, weights, grad)


class DenseMixTorch(torch.autograd.Function):
    """The reference with autograd (impl="torch"): saves the weights and the sources as they are (passed
    one by one: a gradient each). stacked: a SourceStack's buffer view of the same sources, saved too (one
    storage, shared by every mix of the stack), or None: a transient stack in each direction. grads: the
    stack's SourceGrads, or None: as DepthAttentionTorch's, the source gradients go into its slots."""

    @staticmethod
    def forward(ctx, weights, stacked, grads, *sources):
        ctx.save_for_backward(weights, stacked, *sources)
        ctx.grads = grads
        V = _stacked(sources, stacked)
        with fp32_math(V):
            return cast(_dense_mix_ref_fwd(V, weights), sources[0].dtype)

    @staticmethod
    def backward(ctx, grad):
        weights, stacked, *sources = ctx.saved_tensors
        V, into = _stacked(sources, stacked), ctx.grads and ctx.grads.slots(len(sources))
        with fp32_math(grad):
            grad_V, gw = _dense_mix_ref_bwd(V, weights, grad, into)
        if into is not None:
            return gw.to(weights.dtype), None, None, *[None] * len(sources)
        return gw.to(weights.dtype), None, None, *_dense_mix_source_grads(grad_V, weights, sources, copy=False)


if triton is not None:

    @triton.jit
    def _dense_mix_fwd(SRC, W, OUT, S, C, d, w_row, ALIGNED: tl.constexpr, CBLOCK: tl.constexpr, BLOCK: tl.constexpr):
        # one program per row; OUT [M, C, d]; W [M, C, S] (w_row = C S) or [1, 1, S] shared (w_row = 0, C = 1)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ways = tl.arange(0, CBLOCK)
        mask = cols < d
        acc = tl.zeros([CBLOCK, BLOCK], dtype=tl.float32)
        for s in range(0, S):
            x = tl.load(_source(SRC, s, OUT, ALIGNED) + row * d + cols, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(W + row * w_row + ways * S + s, mask=ways < C, other=0.0).to(tl.float32)
            acc += w[:, None] * x[None, :]
        off = (row * C + ways[:, None]) * d + cols[None, :]
        tl.store(OUT + off, acc.to(OUT.dtype.element_ty), mask=(ways[:, None] < C) & mask[None, :])

    @triton.jit
    def _dense_mix_bwd(SRC, DSRC, W, G, DW, S, C, M, d, w_row,
                       ALIGNED: tl.constexpr, CBLOCK: tl.constexpr, BLOCK: tl.constexpr):
        # programs loop over rows. DW fp32: per token [M, C, S] (w_row = C S), or for shared weights
        # [programs, S] partial sums (w_row = 0), each program adding into its own row
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ways = tl.arange(0, CBLOCK)
        mask = cols < d
        wmask = ways < C
        for row in range(pid, M, tl.num_programs(0)):
            row64 = tl.cast(row, tl.int64)
            off = row64 * d + cols
            g = tl.load(G + (row64 * C + ways[:, None]) * d + cols[None, :], mask=wmask[:, None] & mask[None, :],
                        other=0.0).to(tl.float32)
            for s in range(0, S):
                x = tl.load(_source(SRC, s, G, ALIGNED) + off, mask=mask, other=0.0).to(tl.float32)
                w = tl.load(W + row64 * w_row + ways * S + s, mask=wmask, other=0.0).to(tl.float32)
                tl.store(_source(DSRC, s, G, ALIGNED) + off, tl.sum(w[:, None] * g, axis=0).to(G.dtype.element_ty),
                         mask=mask)
                dw = tl.sum(g * x[None, :], axis=1)
                if w_row == 0:
                    tl.store(DW + pid * S + s + ways, tl.load(DW + pid * S + s + ways, mask=ways < 1) + dw, mask=ways < 1)
                else:
                    tl.store(DW + row64 * w_row + ways * S + s, dw, mask=wmask)


def _dense_mix_ways(sources, weights):
    """(C ways, per token?) of weights [S] (1, False) or [..., C, S] (C, True)."""
    return (1, False) if weights.dim() == 1 else (weights.shape[-2], True)


def dense_mix_fwd_triton(sources: list[Tensor], weights: Tensor) -> Tensor:
    """Launch the forward kernel: out [..., d] (weights [S]) or [..., C, d] (weights [..., C, S]), contiguous,
    in the sources' dtype."""
    M, d, BLOCK = _launch_shape(sources[0])
    C, per_token = _dense_mix_ways(sources, weights)
    src = [_rows(v) for v in sources]
    shape = (*sources[0].shape[:-1], C, d) if per_token else sources[0].shape
    out = torch.empty(shape, device=src[0].device, dtype=src[0].dtype)
    _dense_mix_fwd[(M,)](_pointer_table(src, out.device), weights.contiguous(), out, len(src), C, d,
                         C * len(src) if per_token else 0, ALIGNED=_aligned(src),
                         CBLOCK=triton.next_power_of_2(C), BLOCK=BLOCK, num_warps=_warps(BLOCK))
    return out


def dense_mix_bwd_triton(sources: list[Tensor], weights: Tensor, grad: Tensor) -> tuple[list[Tensor], Tensor]:
    """Launch the backward kernel: (a gradient per source, grad weights in the weights' dtype)."""
    M, d, BLOCK = _launch_shape(sources[0])
    C, per_token = _dense_mix_ways(sources, weights)
    S = len(sources)
    src = [_rows(v) for v in sources]
    g = grad.contiguous().to(src[0].dtype)  # the sources' dtype: their gradients are stored in it too
    grads = [torch.empty_like(v) for v in src]
    n = M if per_token else _n_programs(M, g.device)
    dw = (torch.empty(weights.shape, device=g.device, dtype=torch.float32) if per_token
          else torch.zeros(n, S, device=g.device, dtype=torch.float32))
    _dense_mix_bwd[(n,)](_pointer_table(src, g.device), _pointer_table(grads, g.device), weights.contiguous(), g, dw,
                         S, C, M, d, C * S if per_token else 0, ALIGNED=_aligned(src + grads),
                         CBLOCK=triton.next_power_of_2(C), BLOCK=BLOCK, num_warps=_warps(BLOCK))
    return [v.view(sources[0].shape) for v in grads], (dw if per_token else dw.sum(0)).to(weights.dtype)


dense_mix_op = custom_op("dense_mix", dense_mix_fwd_triton)
dense_mix_backward_op = custom_op("dense_mix_backward", dense_mix_bwd_triton)


@dense_mix_op.register_fake
def _(sources, weights):
    v = sources[0]
    return v.new_empty((*v.shape[:-1], weights.shape[-2], v.shape[-1]) if weights.dim() > 1 else v.shape)


@dense_mix_backward_op.register_fake
def _(sources, weights, grad):
    return [v.new_empty(v.shape) for v in sources], torch.empty_like(weights)


def _dense_mix_setup(ctx, inputs, output):
    sources, weights = inputs
    ctx.save_for_backward(weights, *sources)


def _dense_mix_backward(ctx, grad):
    return _dense_mix_grads_of(ctx, grad, dense_mix_backward_op)


dense_mix_op.register_autograd(_dense_mix_backward, setup_context=_dense_mix_setup)


dense_mix_op.register_kernel("cpu", dense_mix_fwd_torch)
dense_mix_backward_op.register_kernel("cpu", dense_mix_bwd_torch)
