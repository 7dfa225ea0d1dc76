"""
Fused kernels for nanodepth's three memory-bound row-wise operations, one section each:

    rms_norm(x, weight=None, eps=1e-6)             y = x / rms(x) * weight
    nag_update(r, u, a) -> (r_new, log_gain)        the NAG write-back (SPEC §2, steps 1-3, 6, 7)
    depth_attention(sources, query, norm_weight)    AttnRes: softmax over depth of RMS-normed sources

Each section reads top to bottom: Triton forward kernel, Triton backward kernel, the
torch.autograd.Function that launches them, and the plain-PyTorch reference with the same
signature. The public function picks a path with `impl`:
    "auto"    Triton for CUDA tensors when triton is installed, else the reference; inside
              torch.compile also the reference, which inductor fuses into kernels of its own
              (the hand-written kernels are not yet verified under compile on a GPU)
    "triton"  always Triton (on CPU tensors this needs TRITON_INTERPRET=1, set before importing triton)
    "torch"   always the reference
All arithmetic is fp32 inside the kernels, whatever the storage dtype (fp32, bf16, fp16); outputs
are stored in the input's dtype. Every kernel handles any width d (masked to the next power of
two) and any number of rows.
"""

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: the references serve
    triton = None

IMPLS = ("auto", "torch", "triton")


def use_triton(impl, x):
    if impl == "auto":
        return triton is not None and x.is_cuda and not torch.compiler.is_compiling()
    if impl == "torch":
        return False
    if impl == "triton":
        if triton is None:
            raise RuntimeError("kernels='triton' needs the triton package: pip install triton")
        return True
    raise ValueError(f"unknown kernels impl '{impl}'; valid: {', '.join(IMPLS)}")


def upcast(x):
    """x in fp32 at least: the precision for statistics and gains (fp64 stays fp64, for tests)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _launch_shape(x):
    """(rows M, width d, the power-of-two block that covers d) of x viewed as [M, d]."""
    d = x.shape[-1]
    return x.numel() // d, d, triton.next_power_of_2(d)


def _n_programs(M, device):
    """Programs for the backward kernels that also reduce over rows (a weight gradient): a few per
    SM, each looping over rows and writing one partial sum, so the partials stay small."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
    return max(1, min(M, 4 * sms))


# -----------------------------------------------------------------------------
# 1. rms_norm

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


class RMSNormTriton(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, weight, eps):
        M, d, BLOCK = _launch_shape(x)
        x2 = x.reshape(M, d).contiguous()
        y = torch.empty_like(x2)
        rstd = torch.empty(M, device=x.device, dtype=torch.float32)
        w = weight.contiguous() if weight is not None else x2  # a dummy pointer when there is no weight
        _rms_norm_fwd[(M,)](x2, w, y, rstd, d, eps, HAS_W=weight is not None, BLOCK=BLOCK)
        ctx.save_for_backward(x2, weight, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        M, d, BLOCK = _launch_shape(x2)
        dx = torch.empty_like(x2)
        n = _n_programs(M, x2.device)
        dw_part = torch.empty(n, d, device=x2.device, dtype=torch.float32)
        w = weight if weight is not None else x2
        _rms_norm_bwd[(n,)](dy.reshape(M, d).contiguous(), x2, w, rstd, dx, dw_part, M, d,
                            HAS_W=weight is not None, BLOCK=BLOCK)
        dw = dw_part.sum(0).to(weight.dtype) if weight is not None else None
        return dx.view(dy.shape), dw, None


class RMSNormTorch(torch.autograd.Function):
    """The reference, with a hand-written backward: about 3x fewer elementwise passes than autograd
    through the forward, which matters on CPU where small models are op-bound."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = upcast(x)
        # vector_norm squares and sums in one pass; the rest works on one scalar per row
        inv = torch.linalg.vector_norm(xf, dim=-1, keepdim=True).square_().div_(x.shape[-1]).add_(eps).rsqrt_()
        x_hat = (xf * inv).type_as(x)
        ctx.save_for_backward(x_hat, weight, inv)
        return x_hat * weight if weight is not None else x_hat

    @staticmethod
    def backward(ctx, grad):
        x_hat, weight, inv = ctx.saved_tensors
        grad_weight = (grad * x_hat).flatten(0, -2).sum(0) if weight is not None else None
        g = grad * weight if weight is not None else grad
        # d x_hat / d x = inv * (I - x_hat x_hat^T / d): two fused passes (vecdot, addcmul) and a scale
        dot = torch.linalg.vecdot(g, x_hat, dim=-1).unsqueeze(-1).div_(-x_hat.shape[-1])
        grad_x = torch.addcmul(g, x_hat, dot).mul_(inv)
        return grad_x.type_as(x_hat), grad_weight, None


def rms_norm(x, weight=None, eps=1e-6, impl="auto"):
    fn = RMSNormTriton if use_triton(impl, x) else RMSNormTorch
    return fn.apply(x, weight, eps)


# -----------------------------------------------------------------------------
# 2. nag_update: r, u [..., d], a [..., 1] -> r_new [..., d], log_gain [..., 1] (fp32)
#   uc = u - mean(u);  up = uc - (<uc, r> / <r, r>) r;  v = up / sqrt(mean(up^2) + eps)
#   p = r + a v;  r1 = p / sqrt(1 + a^2);  r_new = r1 / rms(r1);  log_gain = 0.5 log(1 + a^2)

if triton is not None:

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
        tl.store(LOG_GAIN + row, 0.5 * tl.log(1.0 + a * a))

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
        # back through each step, last to first
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


class NAGUpdateTriton(torch.autograd.Function):

    @staticmethod
    def forward(ctx, r, u, a, eps):
        M, d, BLOCK = _launch_shape(r)
        r2, u2 = r.reshape(M, d).contiguous(), u.reshape(M, d).contiguous()
        a2 = a.expand(*r.shape[:-1], 1).reshape(M).contiguous()
        r_new = torch.empty_like(r2)
        log_gain = torch.empty(M, device=r.device, dtype=torch.float32)
        _nag_fwd[(M,)](r2, u2, a2, r_new, log_gain, d, eps, BLOCK=BLOCK)
        ctx.save_for_backward(r2, u2, a2)
        ctx.eps, ctx.shape, ctx.a_shape, ctx.a_dtype = eps, r.shape, a.shape, a.dtype
        return r_new.view(r.shape), log_gain.view(*r.shape[:-1], 1)

    @staticmethod
    def backward(ctx, g, gl):
        r2, u2, a2 = ctx.saved_tensors
        M, d, BLOCK = _launch_shape(r2)
        g = torch.zeros_like(r2) if g is None else g.reshape(M, d).contiguous()
        gl = torch.zeros(M, device=r2.device) if gl is None else gl.reshape(M).float().contiguous()
        gr, gu = torch.empty_like(r2), torch.empty_like(u2)
        ga = torch.empty(M, device=r2.device, dtype=torch.float32)
        _nag_bwd[(M,)](r2, u2, a2, g, gl, gr, gu, ga, d, ctx.eps, BLOCK=BLOCK)
        ga = ga.view(*ctx.shape[:-1], 1).sum_to_size(ctx.a_shape).to(ctx.a_dtype)  # a may be broadcast
        return gr.view(ctx.shape), gu.view(ctx.shape), ga, None


def nag_update_torch(r, u, a, eps=1e-6):
    """The reference: the same steps in plain PyTorch, fp32 (or fp64) inside."""
    rf, uf, af = upcast(r), upcast(u), upcast(a)
    uf = uf - uf.mean(-1, keepdim=True)  # 1. centre
    uf = uf - (uf * rf).sum(-1, keepdim=True) / (rf * rf).sum(-1, keepdim=True) * rf  # 2. orthogonal to r
    v = uf * torch.rsqrt(uf.square().mean(-1, keepdim=True) + eps)  # 3. unit RMS
    r_new = (rf + af * v) * torch.rsqrt(1 + af * af)  # 6. rotate by arctan(a) ...
    r_new = r_new * torch.rsqrt(r_new.square().mean(-1, keepdim=True))  # ... and stop drift in low precision
    return r_new.type_as(r), 0.5 * torch.log1p(af * af).expand(*r.shape[:-1], 1)  # 7. log-gain, per row


def nag_update(r, u, a, eps=1e-6, impl="auto"):
    """The NAG write-back of a sublayer output u into the direction r (unit RMS) with tangent a.
    Returns the new direction and the log-gain 0.5 * log(1 + a^2) that the log-norm s gains."""
    if use_triton(impl, r):
        return NAGUpdateTriton.apply(r, u, a, eps)
    return nag_update_torch(r, u, a, eps)


# -----------------------------------------------------------------------------
# 3. depth_attention: sources [S, ..., d], query and norm_weight [d] -> mix [..., d]
#   z_s = <query * norm_weight, v_s> / sqrt(mean(v_s^2) + eps);  w = softmax_s(z);  mix = sum_s w_s v_s
# (<q, w * v / rms(v)> = <q * w, v> / rms(v): no normalised copy of a source is ever made.)
# The forward reads every source once, with an online softmax over depth; it keeps the
# log-sum-exp per token for the backward, which reads the sources once more.

if triton is not None:

    @triton.jit
    def _depth_attention_fwd(SRC, Q, NW, MIX, LSE, S, M, d, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < d
        qw = tl.load(Q + cols, mask=mask, other=0.0).to(tl.float32) * tl.load(NW + cols, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(SRC + row * d + cols, mask=mask, other=0.0).to(tl.float32)  # source 0
        z_max = tl.sum(v * qw, axis=0) * tl.rsqrt(tl.sum(v * v, axis=0) / d + eps)
        total = z_max * 0.0 + 1.0  # sum of exp(z - z_max) so far
        acc = v
        for s in range(1, S):
            v = tl.load(SRC + (s * M + row) * d + cols, mask=mask, other=0.0).to(tl.float32)
            z = tl.sum(v * qw, axis=0) * tl.rsqrt(tl.sum(v * v, axis=0) / d + eps)
            new_max = tl.maximum(z_max, z)
            scale, p = tl.exp(z_max - new_max), tl.exp(z - new_max)
            total = total * scale + p
            acc = acc * scale + p * v
            z_max = new_max
        tl.store(MIX + row * d + cols, (acc / total).to(MIX.dtype.element_ty), mask=mask)
        tl.store(LSE + row, z_max + tl.log(total))

    @triton.jit
    def _depth_attention_bwd(SRC, Q, NW, MIX, LSE, G, DSRC, DQW_PART, S, M, d, eps, BLOCK: tl.constexpr):
        # with rho_s = 1 / sqrt(mean(v_s^2) + eps) and gz_s = w_s (<g, v_s> - <g, mix>):
        #   dv_s = w_s g + gz_s (rho_s qw - <v_s, qw> rho_s^3 v_s / d);   d qw = sum_s gz_s rho_s v_s
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < d
        qw = tl.load(Q + cols, mask=mask, other=0.0).to(tl.float32) * tl.load(NW + cols, mask=mask, other=0.0).to(tl.float32)
        dqw = tl.zeros([BLOCK], dtype=tl.float32)
        for row in range(pid, M, tl.num_programs(0)):
            row64 = tl.cast(row, tl.int64)
            g = tl.load(G + row64 * d + cols, mask=mask, other=0.0).to(tl.float32)
            mix = tl.load(MIX + row64 * d + cols, mask=mask, other=0.0).to(tl.float32)
            g_mix = tl.sum(g * mix, axis=0)
            lse = tl.load(LSE + row64)
            for s in range(0, S):
                off = (s * M + row64) * d + cols
                v = tl.load(SRC + off, mask=mask, other=0.0).to(tl.float32)
                rho = tl.rsqrt(tl.sum(v * v, axis=0) / d + eps)
                dot = tl.sum(v * qw, axis=0)
                w = tl.exp(dot * rho - lse)
                gz = w * (tl.sum(g * v, axis=0) - g_mix)
                dv = w * g + gz * (rho * qw - dot * rho * rho * rho * v / d)
                tl.store(DSRC + off, dv.to(DSRC.dtype.element_ty), mask=mask)
                dqw += gz * rho * v
        tl.store(DQW_PART + pid * d + cols, dqw, mask=mask)


class DepthAttentionTriton(torch.autograd.Function):

    @staticmethod
    def forward(ctx, sources, query, norm_weight, eps):
        S = sources.shape[0]
        M, d, BLOCK = _launch_shape(sources[0])
        src = sources.reshape(S, M, d).contiguous()
        mix = torch.empty(M, d, device=src.device, dtype=src.dtype)
        lse = torch.empty(M, device=src.device, dtype=torch.float32)
        _depth_attention_fwd[(M,)](src, query, norm_weight, mix, lse, S, M, d, eps, BLOCK=BLOCK)
        ctx.save_for_backward(src, query, norm_weight, mix, lse)
        ctx.eps, ctx.shape = eps, sources.shape
        return mix.view(sources.shape[1:])

    @staticmethod
    def backward(ctx, g):
        src, query, norm_weight, mix, lse = ctx.saved_tensors
        S, M, d = src.shape
        dsrc = torch.empty_like(src)
        n = _n_programs(M, src.device)
        dqw_part = torch.empty(n, d, device=src.device, dtype=torch.float32)
        _depth_attention_bwd[(n,)](src, query, norm_weight, mix, lse, g.reshape(M, d).contiguous(), dsrc,
                                   dqw_part, S, M, d, ctx.eps, BLOCK=triton.next_power_of_2(d))
        dqw = dqw_part.sum(0)
        return (dsrc.view(ctx.shape), (dqw * norm_weight.float()).to(query.dtype),
                (dqw * query.float()).to(norm_weight.dtype), None)


def depth_scores(sources, query, norm_weight, eps=1e-6):
    """z_s = <query, RMSNorm(v_s)>, fp32, [S, ...]; their softmax over S is the depth weights."""
    scores = upcast(sources @ (query * norm_weight).to(sources.dtype))
    return scores * torch.rsqrt(upcast(sources).square().mean(-1) + eps)


def depth_attention_torch(sources, query, norm_weight, eps=1e-6):
    """The reference: scores, softmax over depth, and the weighted sum of the raw sources."""
    weights = torch.softmax(depth_scores(sources, query, norm_weight, eps), dim=0)
    # a broadcast multiply and a sum over depth: far cheaper on CPU than einsum's tiny batched matmuls
    return (weights.unsqueeze(-1).to(sources.dtype) * sources).sum(0)


def depth_attention(sources, query, norm_weight, eps=1e-6, impl="auto"):
    """sum_s softmax_s(<query, RMSNorm(sources_s)>) sources_s: a softmax over depth per token.
    sources [S, ..., d] (S >= 1); query and norm_weight [d]."""
    if use_triton(impl, sources):
        return DepthAttentionTriton.apply(sources, query, norm_weight, eps)
    return depth_attention_torch(sources, query, norm_weight, eps)
