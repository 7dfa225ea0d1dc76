"""
Fused kernels for nanodepth's three memory-bound row-wise operations, one section each:

    rms_norm(x, weight=None, eps=1e-6)                 y = x / rms(x) * weight
    nag_update(r, u, a, eps=1e-6) -> (r_new, log_gain)  the NAG write-back (model.py's NAG.write)
    depth_attention(sources, query, norm_weight, eps=1e-6) -> mix
                                                       AttnRes: softmax over depth of RMS-normed sources

Each section reads top to bottom, in the order of Triton's fused layer-norm tutorial: the Triton
forward kernel, the Triton backward kernel and their launchers; the custom op that wraps them; the
plain-PyTorch reference beside it; the public function.

One reference per kernel: a forward and a backward function in plain PyTorch with the launchers'
signatures and outputs (rms_norm_fwd_torch and rms_norm_bwd_torch, ...), the kernels' arithmetic
written with tensor ops. They are the custom op's CPU implementation; wrapped in the section's
autograd.Function (RMSNormTorch, NAGUpdateTorch, DepthAttentionTorch) they are the impl="torch"
path; and tests/test_kernels.py measures the Triton kernels against them.

Custom ops. Each kernel is a PyTorch custom op (`torch.ops.nanodepth.rms_norm`, `.nag_update`,
`.depth_attention`), and so is its backward (`.rms_norm_backward`, ...), registered with
`torch.library.custom_op` + `register_fake` + `register_autograd`. torch.compile sees one opaque
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
ops' CPU implementations switched off (tests/triton_cpu.py), so that the whole GPU path (op,
autograd glue, launchers, kernels) runs on CPU.

All arithmetic is fp32 inside the kernels, whatever the storage dtype (fp32, bf16, fp16); outputs
are stored in the input's dtype, per-row statistics in fp32. Every kernel handles any width d
(masked to the next power of two), any number of rows and non-contiguous inputs (copied).
"""

from typing import Optional

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
    """Autocast off inside a reference: its statistics and matvecs stay in fp32 under bf16 autocast."""
    return torch.autocast(x.device.type, enabled=False)


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


# -----------------------------------------------------------------------------
# 1. rms_norm: x [..., d], weight [d] or None -> y [..., d];  rstd = 1 / sqrt(mean(x^2) + eps) per row

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
    x, weight, rstd = ctx.saved_tensors
    dx, dw = rms_norm_backward_op(dy, x, weight, rstd)
    return dx, dw if weight is not None else None, None


rms_norm_op.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup)


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


@rms_norm_op.register_kernel("cpu")
def rms_norm_fwd_torch(x: Tensor, weight: Optional[Tensor], eps: float) -> tuple[Tensor, Tensor]:
    """(y like x, contiguous; rstd [..., 1] fp32): y is x / rms(x) * weight in fp32, rounded once to
    x's dtype, as the kernel stores it (a bf16 x and an fp32 weight give bf16)."""
    with fp32_math(x):
        xf = upcast(x.contiguous())
        rstd = _rms_stats(xf, eps)
        y = xf * rstd
        return cast(y * weight if weight is not None else y, x.dtype), rstd


@rms_norm_backward_op.register_kernel("cpu")
def rms_norm_bwd_torch(dy: Tensor, x: Tensor, weight: Optional[Tensor], rstd: Tensor) -> tuple[Tensor, Tensor]:
    """(dx like x; dw like weight, or an empty tensor without one), from x and the saved rstd."""
    with fp32_math(x):
        x_hat = upcast(x.contiguous()) * rstd
        g = upcast(dy.contiguous())
        dw = (g * x_hat).flatten(0, -2).sum(0).to(weight.dtype) if weight is not None else rstd.new_empty(0)
        if weight is not None:
            g = g * weight
        return _rms_norm_grad_x(g, x_hat, rstd).to(x.dtype), dw


class RMSNormTorch(torch.autograd.Function):
    """The reference with autograd (impl="torch"): it saves what the op saves (x, weight, rstd)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = rms_norm_fwd_torch(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_bwd_torch(dy, x, weight, rstd)
        return dx, dw if weight is not None else None, None


def rms_norm(x, weight=None, eps=1e-6, impl="auto"):
    if use_triton(impl, x):
        return rms_norm_op(x, weight, eps)[0]
    return RMSNormTorch.apply(x, weight, eps)


# -----------------------------------------------------------------------------
# 2. nag_update: r, u [..., d], a [..., 1] -> r_new [..., d], log_gain [..., 1] (fp32)
#   uc = u - mean(u);  up = uc - (<uc, r> / <r, r>) r;  v = up / sqrt(mean(up^2) + eps)
#   p = r + a v;  r1 = p / sqrt(1 + a^2);  r_new = r1 / rms(r1);  log_gain = 0.5 log1p(a^2)

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
        s = tl.sum(uc * r, axis=0) / rr
        up = uc - s * r
        inv = tl.rsqrt(tl.sum(up * up, axis=0) / d + eps)
        v = up * inv
        c = tl.rsqrt(1.0 + a * a)
        p = r + a * v
        r1 = c * p
        n = tl.rsqrt(tl.sum(r1 * r1, axis=0) / d)
        r_new = r1 * n
        # back through each step, last to first (nag_update_bwd_torch spells out the same steps)
        g_r1 = n * (g - r_new * (tl.sum(g * r_new, axis=0) / d))
        g_a = c * tl.sum(g_r1 * v, axis=0) - a * c * c * c * tl.sum(g_r1 * p, axis=0) + gl * a * c * c
        g_v = c * a * g_r1
        g_up = inv * (g_v - v * (tl.sum(g_v * v, axis=0) / d))
        gur = tl.sum(g_up * r, axis=0) / rr
        g_uc = g_up - gur * r
        g_u = tl.where(mask, g_uc - tl.sum(g_uc, axis=0) / d, 0.0)
        g_r = c * g_r1 - s * g_up - gur * (uc - 2.0 * s * r)
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
    r, u, a, eps = inputs
    ctx.save_for_backward(r, u, a)
    ctx.eps = eps


def _nag_update_backward(ctx, grad_r_new, grad_log_gain):
    r, u, a = ctx.saved_tensors
    if grad_log_gain is None:  # an output nobody used
        grad_log_gain = r.new_zeros(*r.shape[:-1], 1, dtype=acc_dtype(r))
    if grad_r_new is None:
        grad_r_new = torch.zeros_like(r)
    gr, gu, ga = nag_update_backward_op(r, u, a, grad_r_new, grad_log_gain, ctx.eps)
    return gr, gu, ga.sum_to_size(a.shape).to(a.dtype), None  # a may be broadcast over rows


nag_update_op.register_autograd(_nag_update_backward, setup_context=_nag_update_setup)


# the reference: the kernels' steps in plain PyTorch

def _nag_steps(r, u, a, eps):
    """The forward's steps in fp32 (fp64 stays fp64): (r, a, uc, rr, s, inv, v, c, p, n, r_new),
    the intermediates that the backward needs, r_new last."""
    r, u, a = upcast(r), upcast(u), upcast(a)
    uc = u - u.mean(-1, keepdim=True)  # 1. centre
    rr = (r * r).sum(-1, keepdim=True)
    s = (uc * r).sum(-1, keepdim=True) / rr
    up = uc - s * r  # 2. orthogonal to r
    inv = torch.rsqrt(up.square().mean(-1, keepdim=True) + eps)
    v = up * inv  # 3. unit RMS
    c = torch.rsqrt(1 + a * a)
    p = r + a * v
    r1 = c * p  # 6. rotate by arctan(a) ...
    n = torch.rsqrt(r1.square().mean(-1, keepdim=True))
    return r, a, uc, rr, s, inv, v, c, p, n, r1 * n  # ... and stop drift in low precision


@nag_update_op.register_kernel("cpu")
def nag_update_fwd_torch(r: Tensor, u: Tensor, a: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(r_new like r, contiguous; log_gain [..., 1] fp32)."""
    r, u = r.contiguous(), u.contiguous()
    af = upcast(a)
    r_new = _nag_steps(r, u, a, eps)[-1]
    # 7. log-gain, per row; the product is the last op, so that it is never a no-op .contiguous() (see cast)
    log_gain = 0.5 * torch.log1p(af * af).expand(*r.shape[:-1], 1).contiguous()
    return cast(r_new, r.dtype), log_gain


@nag_update_backward_op.register_kernel("cpu")
def nag_update_bwd_torch(r: Tensor, u: Tensor, a: Tensor, grad_r_new: Tensor, grad_log_gain: Tensor,
                         eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """(grad r, grad u, grad a per row [..., 1] fp32): the backward kernel's steps."""
    rf, a, uc, rr, s, inv, v, c, p, n, r_new = _nag_steps(r.contiguous(), u.contiguous(), a, eps)
    g, gl = upcast(grad_r_new), upcast(grad_log_gain)
    g_r1 = n * (g - r_new * (g * r_new).mean(-1, keepdim=True))  # through r_new = r1 / rms(r1)
    g_a = (c * (g_r1 * v).sum(-1, keepdim=True) - a * c ** 3 * (g_r1 * p).sum(-1, keepdim=True)
           + gl * a * c * c)  # through r1 = c (r + a v) and log_gain = 0.5 log1p(a^2)
    g_v = c * a * g_r1
    g_up = inv * (g_v - v * (g_v * v).mean(-1, keepdim=True))  # through v = up / rms(up)
    gur = (g_up * rf).sum(-1, keepdim=True) / rr
    g_uc = g_up - gur * rf  # through up = uc - s r
    g_u = g_uc - g_uc.mean(-1, keepdim=True)  # through uc = u - mean(u)
    g_r = c * g_r1 - s * g_up - gur * (uc - 2.0 * s * rf)
    return g_r.to(r.dtype), g_u.to(u.dtype), g_a.expand(*r.shape[:-1], 1).contiguous()


class NAGUpdateTorch(torch.autograd.Function):
    """The reference with autograd (impl="torch"): it saves what the op saves (r, u, a) and
    recomputes the forward's steps in the backward, as the backward kernel does."""

    @staticmethod
    def forward(ctx, r, u, a, eps):
        ctx.save_for_backward(r, u, a)
        ctx.eps = eps
        return nag_update_fwd_torch(r, u, a, eps)

    @staticmethod
    def backward(ctx, grad_r_new, grad_log_gain):
        r, u, a = ctx.saved_tensors
        gr, gu, ga = nag_update_bwd_torch(r, u, a, grad_r_new, grad_log_gain, ctx.eps)
        return gr, gu, ga.sum_to_size(a.shape).to(a.dtype), None  # a may be broadcast over rows


def nag_update(r, u, a, eps=1e-6, impl="auto"):
    """The NAG write-back of a sublayer output u into the direction r (unit RMS) with tangent a.
    Returns the new direction and the log-gain 0.5 * log(1 + a^2) that the log-norm s gains."""
    if use_triton(impl, r):
        return nag_update_op(r, u, a, eps)
    return NAGUpdateTorch.apply(r, u, a, eps)


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
    lse = output[1]
    ctx.save_for_backward(query, norm_weight, lse, *sources)
    ctx.eps = eps
    ctx.mark_non_differentiable(lse)


def _depth_attention_backward(ctx, grad_mix, _):
    query, norm_weight, lse, *sources = ctx.saved_tensors
    grads, gq, gw = depth_attention_backward_op(sources, query, norm_weight, lse, grad_mix, ctx.eps)
    return grads, gq, gw, None


depth_attention_op.register_autograd(_depth_attention_backward, setup_context=_depth_attention_setup)


# the reference: the kernels' formulas in plain PyTorch, one source at a time

def _source_stats(sources, query, norm_weight, eps):
    """(qw, <v_s, qw> [S, ...], rho_s = 1 / rms(v_s) [S, ...]) in fp32, one pass over each source
    for each statistic. Per source, not stacked: a stacked copy costs more than the op calls."""
    qw = upcast(query) * upcast(norm_weight)
    dots = torch.stack([upcast(v) @ qw for v in sources])
    norms = torch.stack([torch.linalg.vector_norm(v, dim=-1, dtype=qw.dtype) for v in sources])
    return qw, dots, torch.rsqrt(norms.square_().div_(qw.numel()).add_(eps))


@depth_attention_op.register_kernel("cpu")
def depth_attention_fwd_torch(sources: list[Tensor], query: Tensor, norm_weight: Tensor,
                              eps: float) -> tuple[Tensor, Tensor]:
    """(mix like a source, contiguous; lse [...] fp32)."""
    with fp32_math(sources[0]):
        sources = [v.contiguous() for v in sources]
        qw, dots, rho = _source_stats(sources, query, norm_weight, eps)
        z = dots * rho
        lse = torch.logsumexp(z, dim=0)
        w = torch.exp(z - lse).unsqueeze(-1)
        mix = sources[0] * w[0]  # fp32: the weighted sum accumulates in fp32, one source at a time
        for v, w_s in zip(sources[1:], w.unbind(0)[1:]):
            mix = torch.addcmul(mix, v, w_s)  # not in place: DepthAttentionTorch returns it (see cast)
        return cast(mix, sources[0].dtype), lse


@depth_attention_backward_op.register_kernel("cpu")
def depth_attention_bwd_torch(sources: list[Tensor], query: Tensor, norm_weight: Tensor, lse: Tensor,
                              grad_mix: Tensor, eps: float) -> tuple[list[Tensor], Tensor, Tensor]:
    """(a gradient per source, grad query, grad norm_weight)."""
    with fp32_math(grad_mix):
        sources = [v.contiguous() for v in sources]
        qw, dots, rho = _source_stats(sources, query, norm_weight, eps)
        w = torch.exp(dots * rho - lse)
        g = upcast(grad_mix.contiguous())
        g_v = torch.stack([torch.linalg.vecdot(upcast(v), g) for v in sources])  # <g, v_s>
        gz = w * (g_v - (w * g_v).sum(0))  # through the softmax; <g, mix> = sum_s w_s <g, v_s>
        c_q = gz * rho  # dz_s / d qw = rho_s v_s, dz_s / d v_s = rho_s qw - <v_s, qw> rho_s^3 v_s / d
        c_v = c_q * dots * rho * rho / -qw.numel()
        grads, dqw = [], torch.zeros_like(qw)
        for v, w_s, cq_s, cv_s in zip(sources, w.unsqueeze(-1), c_q.unsqueeze(-1), c_v.unsqueeze(-1)):
            dv = (g * w_s).addcmul_(cq_s, qw).addcmul_(v, cv_s)
            grads.append(dv.to(v.dtype))
            dqw.addmv_(upcast(v).reshape(-1, qw.numel()).T, cq_s.reshape(-1))
        return grads, (dqw * upcast(norm_weight)).to(query.dtype), (dqw * upcast(query)).to(norm_weight.dtype)


class DepthAttentionTorch(torch.autograd.Function):
    """The reference with autograd (impl="torch"): it saves what the op saves (the sources, query,
    norm_weight and lse); the sources are passed one by one so that autograd saves them as they are
    (no stacked copy) and gives each its own gradient."""

    @staticmethod
    def forward(ctx, query, norm_weight, eps, *sources):
        mix, lse = depth_attention_fwd_torch(list(sources), query, norm_weight, eps)
        ctx.save_for_backward(query, norm_weight, lse, *sources)
        ctx.eps = eps
        return mix

    @staticmethod
    def backward(ctx, grad_mix):
        query, norm_weight, lse, *sources = ctx.saved_tensors
        grads, gq, gw = depth_attention_bwd_torch(sources, query, norm_weight, lse, grad_mix, ctx.eps)
        return gq, gw, None, *grads


def _source_list(sources):
    """The sources as a list (a stacked tensor: its views), checked to be alike."""
    sources = list(sources.unbind(0)) if isinstance(sources, Tensor) else list(sources)
    if not sources:
        raise ValueError("depth_attention needs at least one source")
    v = sources[0]
    for s in sources[1:]:
        if s.shape != v.shape or s.dtype != v.dtype or s.device != v.device:
            raise ValueError(f"depth_attention: every source must have one shape, dtype and device; got "
                             f"{tuple(v.shape)} {v.dtype} {v.device} and {tuple(s.shape)} {s.dtype} {s.device}")
    return sources


def depth_attention(sources, query, norm_weight, eps=1e-6, impl="auto"):
    """sum_s softmax_s(<query, RMSNorm(sources_s)>) sources_s: a softmax over depth per token.
    sources: a list of S >= 1 tensors [..., d] of one shape and dtype, or one stacked [S, ..., d];
    query and norm_weight [d]. Returns mix [..., d] in the sources' dtype."""
    sources = _source_list(sources)
    if use_triton(impl, sources[0]):
        return depth_attention_op(sources, query, norm_weight, eps)[0]
    if not torch.is_grad_enabled():
        # nothing to save for a backward: the reference's forward alone (Dynamo also failed to
        # trace the autograd.Function in the model's compiled no-grad eval; test_compiled_eval_equals_eager)
        return depth_attention_fwd_torch(sources, query, norm_weight, eps)[0]
    return DepthAttentionTorch.apply(query, norm_weight, eps, *sources)
