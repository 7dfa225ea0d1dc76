"""
nanodepth: one GPT whose residual stream is switchable.

Read top to bottom: each name is defined before it is used. The first part is a complete GPT with the
default residual mode, prenorm: the backbone (RMSNorm, RoPE, attention, MLP, and what attention sees
beyond causality: KV caches and MoD's key biases), the residual seam and PreNorm, the config (every
mode's options written out), then GPT with its one sublayer loop and generation. A reader of the default
model can stop there. Then come the other residual modes (each one class that carries everything about
itself: the options it owns, the MoD modes it works with, the FLOPs it adds, the fused ops it uses, its
state: a tensor or a NamedTuple of its own, and its registry line), Mixture-of-Depths, and a look
inside (diagnose, routing). optim.py puts each parameter in its optimizer's group from the modes'
declarations. README.md's "The residual modes" and "Mixture-of-Depths" say what each mode is for.
"""

import itertools
import math
from dataclasses import dataclass, field, fields
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import optim
from kernels import (IMPLS, SourceStack, dense_mix, depth_attention, fp32_math, hc_post_mix, mhc_pre_mix, nag_update,
                     rms_norm, sinkhorn, upcast)


# -----------------------------------------------------------------------------
# the backbone: RMSNorm, RoPE, attention, MLP

class RMSNorm(nn.Module):
    def __init__(self, dim, impl="auto", eps=1e-6):
        super().__init__()
        self.impl, self.eps = impl, eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps, impl=self.impl)


def rope_table(head_dim, max_len, base=10000.0):
    """Rotary position embedding: (cos, sin) of t * theta_j as a [max_len, head_dim/2, 2] table."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def _rotate_real(pairs, rope):
    (a, b), (cos, sin) = pairs.unbind(-1), rope.unbind(-1)
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1)


class RotateComplex(torch.autograd.Function):
    """x's feature pairs times the unit complex numbers of the rope table; the backward rotates the
    gradient back (times the conjugate): one complex multiply each way, no autograd graph of views."""

    @staticmethod
    def forward(ctx, x, rope):
        ctx.save_for_backward(rope)
        return RotateComplex.rotate(x, rope, conj=False)

    @staticmethod
    def backward(ctx, grad):
        rope, = ctx.saved_tensors
        return RotateComplex.rotate(grad, rope, conj=True), None

    @staticmethod
    def rotate(x, rope, conj):
        c, pairs = torch.view_as_complex(rope.contiguous()), upcast(x).reshape(*x.shape[:-1], -1, 2)
        if pairs.stride(-1) != 1 or pairs.storage_offset() % 2 or any(s % 2 for s in pairs.stride()[:-1]):
            pairs = pairs.contiguous()  # else q and k are viewed where c_attn wrote them: no copy
        return torch.view_as_real(torch.view_as_complex(pairs) * (c.conj() if conj else c)).flatten(-2).type_as(x)


def apply_rope(x, rope):
    """Rotate consecutive feature pairs of x [B, T, ..., hd] by rope, the table rows of the tokens'
    own positions: [T, hd/2, 2], or [B, T, hd/2, 2] when each row has its own positions (a MoD
    compressed sequence). Eager: one complex multiply (RotateComplex), several times cheaper on CPU
    than the real form. Compiled: the real form, because inductor has no code generation for complex ops."""
    rope = rope.view(*rope.shape[:-2], *([1] * (x.dim() - 3)), *rope.shape[-2:])
    if torch.compiler.is_compiling():
        return _rotate_real(x.float().reshape(*x.shape[:-1], -1, 2), rope).flatten(-2).type_as(x)
    return RotateComplex.apply(x, rope)


def attend(q, k, v, mask, dropout_p, is_causal):
    """Scaled dot-product attention (mask: additive, or None). On a CPU in fp32 for bf16 or fp16 inputs, output in
    their dtype: torch's CPU kernel runs several times slower in bf16 (its backward 4.5x at the quickstart's shape)."""
    if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16):
        with torch.autocast("cpu", enabled=False):
            return attend(q.float(), k.float(), v.float(), mask, dropout_p, is_causal).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, None if mask is None else mask.to(q.dtype), dropout_p, is_causal)


VALUE_RESIDUALS = ("none", "half", "learned")


class CausalSelfAttention(nn.Module):
    def __init__(self, config, first=False):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)
        # value_residual (ResFormer, Zhou et al., arXiv 2410.17897): the first attention sublayer hands its
        # raw values v_1 on; every later one attends with (1 - lam) v + lam v_1, lam = 1/2 (half, the
        # official code), or a learned scalar from 1/2 (learned, modded-nanogpt's records of Nov 2024)
        self.value_residual, self.first = config.value_residual, first
        if self.value_residual == "learned" and not first:
            self.value_lambda = nn.Parameter(torch.tensor(0.5))

    def forward(self, x, rope, visibility=None, v1=None):
        """x [B, T, C] in order, or a tuple of three (query, key and value inputs: a residual mode's per-way
        read). visibility (MoD and generation, see Visibility): which keys each query sees beyond causality,
        and the KV cache; None: plain causal attention. v1: the first attention sublayer's values
        (value_residual). Returns the output and v1 (the first sublayer's own values, for the others)."""
        if isinstance(x, tuple):  # a per-way read (mudd): the query, key and value inputs apart
            (B, T, C), (xq, xk, xv) = x[0].size(), x
            qk = torch.stack([F.linear(xi, w) for xi, w in zip((xq, xk), self.c_attn.weight.split(C))], 2)
            qk, v = qk.view(B, T, 2, self.n_head, C // self.n_head), F.linear(xv, self.c_attn.weight[2 * C:])
            v = v.view(B, T, 1, self.n_head, C // self.n_head)
        else:
            B, T, C = x.size()
            qk, v = self.c_attn(x).view(B, T, 3, self.n_head, C // self.n_head).split((2, 1), dim=2)
        q, k = apply_rope(qk, rope).unbind(2)  # q and k rotated together: one op instead of two
        v = v.squeeze(2)  # [B, T, nh, hd], no RoPE on values
        if self.value_residual != "none":
            if self.first:
                v1 = v
            else:
                lam = self.value_lambda.to(v.dtype) if self.value_residual == "learned" else 0.5
                v = (1 - lam) * v + lam * v1  # what the KV cache keeps, too
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, nh, T, hd]
        k, v, mask, causal = (k, v, None, True) if visibility is None else visibility.keys(k, v)
        y = attend(q, k, v, mask, self.dropout if self.training else 0.0, mask is None and causal)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y)), v1


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


# -----------------------------------------------------------------------------
# what attention sees beyond causality: a KV cache (generation), and the biases MoD puts on keys and queries

GATE_FLOOR = 1e-6  # the smallest gate a bias stands for: skip_middle's bias is log(clamp(g, GATE_FLOOR, 1)), -inf at g = 0


def attention_mask(bias, t, query_bias=None):
    """Additive mask [B, 1, t, n] for the last t of n keys as queries: causal, plus each key's bias
    [B, n] (and, if given, each query's bias [B, t] along its row). A query always sees itself: a
    token that runs the sublayer has a finite bias anyway, and padding (or a soft-path token with
    gate 0, whose output is discarded) must not get a row of -inf, whose softmax is NaN."""
    n = bias.size(1)
    q = torch.arange(n - t, n, device=bias.device)[:, None]
    k = torch.arange(n, device=bias.device)[None, :]
    mask = torch.where(k <= q, bias[:, None, :], float("-inf"))
    mask = torch.where(k == q, mask.clamp(min=math.log(GATE_FLOOR)), mask)
    if query_bias is not None:  # one constant per row: softmax cancels it (skip_middle_gate_axis=query)
        mask = mask + query_bias[:, :, None]
    return mask[:, None]


class KVCache:
    """Keys and values of the tokens that ran one attention sublayer, for generation. Under MoD the
    rows of a batch keep different tokens, so every slot has an additive bias per row: 0 for a key,
    -inf where that row did not run the token (skip_middle: the key's log-gate). unbiased: no slot
    so far was given a bias (every bias 0), so attention needs no mask beyond causality."""

    def __init__(self, size):
        self.size, self.n, self.k, self.unbiased = size, 0, None, True

    def append(self, k, v, bias):
        """Add t slots (k, v [B, nh, t, hd], bias [B, t], None: 0); return every slot so far."""
        self.unbiased = self.unbiased and bias is None
        bias = k.new_zeros(k.size(0), k.size(2), dtype=torch.float32) if bias is None else bias
        B, nh, t, hd = k.shape
        if self.k is None:
            self.k, self.v = k.new_zeros(B, nh, self.size, hd), v.new_zeros(B, nh, self.size, hd)
            self.bias = bias.new_full((B, self.size), float("-inf"))
        if self.n + t > self.size:
            raise RuntimeError(f"KV cache full ({self.size} slots): restart it")
        self.k[:, :, self.n:self.n + t], self.v[:, :, self.n:self.n + t] = k, v
        self.bias[:, self.n:self.n + t] = bias
        self.n += t
        return self.k[:, :, :self.n], self.v[:, :, :self.n], self.bias[:, :self.n]


class Visibility:
    """What attention needs beyond causality, in one argument: key_bias [B, T] is added to the scores of
    each token as a key (skip_middle's gated attention; -inf: never a key), query_bias [B, T] to those
    of each token as a query (the published skip_middle code's axis), and cache is a KVCache the T
    tokens are appended to (generation)."""

    def __init__(self, key_bias=None, query_bias=None, cache=None):
        self.key_bias, self.query_bias, self.cache = key_bias, query_bias, cache

    @staticmethod
    def of(route, cache):
        """The visibility of a sublayer that runs `route` (None: every token) with `cache`; None when
        plain causal attention is all it takes."""
        key_bias, query_bias = (None, None) if route is None else (route.key_bias, route.query_bias)
        if cache is not None and route is not None and route.valid is not None:  # padding is never a key later on
            key_bias = torch.where(route.valid.squeeze(-1), 0.0 if key_bias is None else key_bias, float("-inf"))
        if key_bias is None and query_bias is None and cache is None:
            return None
        return Visibility(key_bias, query_bias, cache)

    def keys(self, k, v):
        """(k, v, mask, causal) for queries that are the T new tokens of k, v [B, nh, T, hd]: the keys
        to attend to (the cache's, when there is one), an additive mask or None, and whether plain
        causality applies where there is no mask."""
        B, T = k.size(0), k.size(2)
        if self.cache is not None:
            k, v, bias = self.cache.append(k, v, self.key_bias)
            if self.cache.unbiased and self.query_bias is None and (T == 1 or self.cache.n == T):
                return k, v, None, T > 1  # one new token sees every cached key; a first window is plainly causal
            return k, v, attention_mask(bias, T, self.query_bias), True
        bias = self.key_bias if self.key_bias is not None else k.new_zeros(B, T, dtype=torch.float32)
        return k, v, attention_mask(bias, T, self.query_bias), True


# -----------------------------------------------------------------------------
# the residual seam: the only place where the residual modes differ

class Residual(nn.Module):
    """A residual mode: how the stream is built, what each sublayer reads, how its output is written
    back, what the LM head reads. GPT calls (l = 0..2L-1 is the sublayer; state is the stream: a tensor,
    or the mode's own NamedTuple, State):
      embed(e) -> state                        the stream from the token embedding e
      read(state, l) -> (x, carry)             x: sublayer l's input (an attention sublayer's may be its
                                               query, key and value inputs: mudd); carry: what the write
                                               needs from this read (hc, mhc: H_post, H_res; scalars: the
                                               block's residual), else None. A read leaves the state as it is
      write(state, l, out, carry) -> state     sublayer l's output written back
      head(state, lm_head) -> logits
      write_kept(state, l, out, carry, route)  MoD: the write of a sublayer that ran only route's tokens
      skip(state, l) -> state                  MoD: the same when no token ran sublayer l
    Diagnostics and tests, never the forward pass, call value(state, l) (the stream as sublayer l sees
    it, [B, T, d]; l = 2L: the head), stats(state, l) (the mode's own figures), tokens(state) (every
    per-token tensor the state keeps) and perturb(std, generator) (every parameter moved off its init).
    Config checks, flops.py, the optimizer and the tests ask it what it declares next to its code: the
    class attributes below; flops(config), the forward FLOPs per token it adds beyond the backbone (every
    registered class defines its own); check(config), its options' checks; and, read by optim.py,
    no_decay_parameters() (a class with parameters has its own), decay_parameters(), mixing_parameters(), lr_groups().
    flops() and no_decay_parameters() are read from the class's own body (vars(cls)), so a subclass states them
    even when it keeps its parent's (BlockAttnRes delegates); an instance may narrow a class declaration from its
    options (norm_scaling: scaled_init and starts_as; mhc_res=birkhoff: ops), and the readers ask the instance.
    The rules a mode keeps, each held by a generic test (tests/test_new_mode.py, tests/test_mod.py):
      - MoD: a token that skips sublayer l keeps its stream bit for bit: write_kept leaves it exactly as skip()
        leaves every token, and skip() changes nothing the state held: it may only append (attnres: a 0 output).
      - MoD: write_kept hands route.weigh() the sublayer's whole write (route.weigh(alpha * out)), so that a
        whole-block route (router, mod_layout=block) scales the block once, x + w f(x) (Eq. 1).
      - Override skip() when the state carries per-layer work (a history of outputs, a source list),
        value() and tokens() when the state is not one [B, T, d] tensor, and perturb() when a parameter
        has a valid region that its parameterisation does not keep.
    Optional hooks, no-ops here: set_warmup(scale) before each iteration, after_step(skipped) after
    each optimizer step, describe() for train.py's banner. A new mode is a subclass, one line in RESIDUALS and its options' GPTConfig fields."""
    options = {}  # the GPTConfig fields it owns: name=(its valid values), or name=None (any value)
    mods = ()  # the MoD modes it works with (besides none)
    ops = ()  # the fused custom ops (nanodepth::...) its forward uses (mhc_res=birkhoff drops its instance's Sinkhorn)
    vector_flops = ()  # the terms of flops() that are not matmuls
    routed_flops = ()  # the terms spent only on the tokens a sublayer runs (MoD scales them by the executed fraction)
    embed_std = 0.02  # the token embedding's init std
    scaled_init = True  # GPT-2's init of the sublayers' output projections, std 0.02 / sqrt(2L)
    starts_as = None  # the mode whose logits it gives at init ("prenorm"), held by a test; norm_scaling sets its own

    @staticmethod
    def check(config):
        pass

    def no_decay_parameters(self):
        return []

    def decay_parameters(self):
        return []

    def mixing_parameters(self):
        return self.no_decay_parameters()

    def lr_groups(self):
        return []

    def set_warmup(self, scale):
        pass

    def after_step(self, skipped):
        pass

    def describe(self):
        return ""

    def skip(self, state, l):
        return state

    def value(self, state, l):
        return state

    def tokens(self, state):
        return [state]

    def stats(self, state, l):
        return {}

    @torch.no_grad()
    def perturb(self, std, generator):
        """Tests: move every parameter off its init, by Gaussian noise of about std."""
        for p in self.parameters():
            p.add_(std * torch.randn(p.shape, generator=generator).to(p))


class PreNorm(Residual):
    """nanoGPT's baseline: x = x + f(RMSNorm(x)); the head reads RMSNorm(x).
    norm_scaling=True: LayerNorm Scaling (Sun et al., arXiv 2502.05795; lmsdss/LayerNorm-Scaling): both
    sublayers of layer i = 1..L read RMSNorm(x) / sqrt(i) (the head's norm is not scaled), and, as the
    paper does, the output projections get the plain init, not GPT-2's scaled one (scaled_init)."""
    options = dict(norm_scaling=None)
    mods, ops, starts_as = ("router",), ("rms_norm",), "prenorm"

    @staticmethod
    def flops(config):
        return {}  # norms are not counted (norm_scaling folds its 1/sqrt(i) into the norm's weight)

    def no_decay_parameters(self):
        return []  # norms only

    def __init__(self, config):
        super().__init__()
        self.norms = nn.ModuleList(RMSNorm(config.n_embd, config.kernels) for _ in range(config.n_sublayers))
        self.norm_f = RMSNorm(config.n_embd, config.kernels)
        scaling = config.norm_scaling  # layer i = l // 2 + 1 reads RMSNorm(x) / sqrt(i); no scaled init
        self.scales = [1.0 / math.sqrt(l // 2 + 1) for l in range(config.n_sublayers)] if scaling else None
        self.scaled_init, self.starts_as = not scaling, None if scaling else type(self).starts_as

    def embed(self, e):
        return e

    def read(self, x, l):
        if self.scales is None:
            return self.norms[l](x), None  # None: the write needs nothing from the read
        norm = self.norms[l]  # the scale on the norm's weight: the same function, no pass over x of its own
        return rms_norm(x, norm.weight * self.scales[l], norm.eps, impl=norm.impl), None

    def delta(self, l, out):
        return out

    def write(self, x, l, out, carry):
        return x + self.delta(l, out)

    def write_kept(self, x, l, out, carry, route):
        return route.scatter_add(x, route.weigh(self.delta(l, out)))

    def head(self, x, lm_head):
        return lm_head(self.norm_f(x))


# -----------------------------------------------------------------------------
# the registries of modes, and the config: every mode's options written out

RESIDUALS = {"prenorm": PreNorm}  # name -> class; each other residual mode adds its line after its class, below
MODS = {"none": None}  # Mixture-of-Depths: name -> class (none: every token runs every sublayer); the same, below


def option_owners():
    """{option: (its valid values or None for any, "residual" or "mod", the modes that declare it)}, from the
    registries as they are when called. Two modes may share an option (GPTConfig has one field for it) only
    with the same values: else a TypeError names both."""
    owners = {}
    for key, registry in (("residual", RESIDUALS), ("mod", MODS)):
        for name, cls in registry.items():
            for option, choices in getattr(cls, "options", {}).items():
                known = owners.setdefault(option, (choices, key, []))
                if (known[0], known[1]) != (choices, key):
                    raise TypeError(f"option {option!r}: {name} declares {choices!r}, {known[2][0]} declares "
                                    f"{known[0]!r}; modes that share an option declare it alike")
                known[2].append(name)
    return owners


def check_modes(config):
    """The mode switches, every mode's options, and the modes' own checks: one-line errors that name the fix."""
    if not 0.0 <= config.mod_rate < 1.0:
        raise ValueError(f"mod_rate must be in [0, 1), got {config.mod_rate}")
    if config.value_residual not in VALUE_RESIDUALS:
        raise ValueError(f"unknown value_residual {config.value_residual!r}; valid: {', '.join(VALUE_RESIDUALS)}")
    if config.value_residual != "none" and config.mod != "none":
        raise ValueError(f"value_residual={config.value_residual} needs every token to run the first attention "
                         f"sublayer, whose values the later ones mix in: use mod=none or value_residual=none")
    for key, registry in (("residual", RESIDUALS), ("mod", MODS)):
        if getattr(config, key) not in registry:
            raise ValueError(f"unknown {key} '{getattr(config, key)}'; valid: {', '.join(registry)}")
    chosen, defaults = {"residual": config.residual, "mod": config.mod}, {f.name: f.default for f in fields(config)}
    for name, (choices, key, modes) in option_owners().items():
        if name not in defaults:
            raise TypeError(f"{key}={modes[0]} declares the option {name!r}, which GPTConfig lacks: add it "
                            f"there, beside the other {key} options, with its default and a comment")
        value = getattr(config, name)
        if choices is not None and (value not in choices or type(value) is not type(choices[0])):
            raise ValueError(f"unknown {name} {value!r}; valid: {', '.join(map(str, choices))}")
        if value != defaults[name] and chosen[key] not in modes:
            raise ValueError(f"{name}={value} only applies to {key}={' or '.join(modes)}; "
                             f"remove --{name} or set --{key}={modes[-1]}")
    residual, mod = RESIDUALS[config.residual], MODS[config.mod]
    works_with = {m: [r for r, cls in RESIDUALS.items() if m in cls.mods] for m in MODS if MODS[m]}
    if mod is None and config.mod_rate > 0:
        raise ValueError(f"mod_rate={config.mod_rate} needs a mod: set " + ", ".join(
            f"--mod={m} ({' or '.join(rs)})" for m, rs in works_with.items()))
    if mod is not None and config.mod not in residual.mods:
        fix = (f"mod={' or '.join(residual.mods)}, or " if residual.mods else "") + \
            f"residual={' or '.join(works_with[config.mod])}"
        raise ValueError(f"mod={config.mod} does not work with residual={config.residual}; use {fix}")
    residual.check(config)
    if mod is not None:
        mod.check(config)


@dataclass
class GPTConfig:
    """The backbone's shape, the two mode switches, and every mode's options, each beside its default:
    GPTConfig(residual="nag", nag_head="sqrt_d") and --nag_head=sqrt_d both work. A mode declares the
    options it owns (its class's `options`); check_modes refuses one set for another mode, and a value
    outside the values its mode declares."""
    block_size: int = 1024  # context length T: tokens per training sequence, and the most a sample attends to
    vocab_size: int = 50257  # real vocab; see padded_vocab_size for the embedding and head rows
    n_layer: int = 12  # transformer blocks L: 2L sublayers (attention, MLP)
    n_head: int = 12  # attention heads; n_embd / n_head must be even (RoPE)
    n_embd: int = 768  # width d of the residual stream
    dropout: float = 0.0  # in training only (a run setting: resume may change it)
    residual: str = "prenorm"  # the residual mode: a name in RESIDUALS (--help lists them)
    mod: str = "none"  # Mixture-of-Depths: a name in MODS (--help lists them)
    mod_rate: float = 0.0  # target fraction of (token, sublayer) pairs that skip the sublayer
    kernels: str = "auto"  # auto (Triton on CUDA tensors) | triton | torch: see kernels.py
    value_residual: str = "none"  # none | half: v <- (v + v_1)/2 after the first attention (ResFormer) | learned: (1-lam) v + lam v_1, lam 0.5 at init
    # residual=prenorm (PreNorm)
    norm_scaling: bool = False  # LayerNorm Scaling: layer i's pre-norms times 1/sqrt(i), no scaled init
    # residual=nag (NAG)
    nag_channels: int = 32  # channels C of each sublayer's modulator
    nag_head: str = "cosine"  # cosine: logits e^s cos(w_v, r) (nag-nanochat's) | sqrt_d: e^(s + g_dec) W_hat r / sqrt(d)
    nag_m_floor: float = 1e-6  # the modulator's mixture is clamped >= this before ** beta (nag-nanochat's; 0: none)
    # residual=attnres and block_attnres (AttnRes, BlockAttnRes): the paper's ablations (§5.3); the defaults are its method
    attnres_query: str = "static"  # static: a learned pseudo-query per sublayer | input: projected from the stream
    attnres_weights: str = "softmax"  # softmax over depth | sigmoid: an independent gate per source
    attnres_key_norm: bool = True  # RMSNorm (learned weight) on the keys | False: raw sources as keys
    attnres_blocks: Optional[int] = None  # block_attnres: N in [1, L], blocks of ceil(L/N) layers; None: min(8, L)
    # residual=hc and mhc (HyperConnections, MHC)
    hc_streams: int = 4  # n, the residual streams (each n_embd wide)
    hc_dynamic: bool = False  # hc: False: static mixing matrices | True: plus per-token terms (the paper's DHC)
    mhc_post_mult: float = 2.0  # mhc: H_post = sigmoid(.) * this: 2.0 (the paper) | 1.0 (the official code's default)
    mhc_sinkhorn_repeat: int = 20  # mhc: Sinkhorn iterations: 20 (the paper's t_max) | 10 (the official code's default)
    mhc_res: str = "sinkhorn"  # mhc: H_res by Sinkhorn | birkhoff: mHC-lite, a softmax over the n! permutations
    # residual=dwa (DenseFormer)
    dwa_dilation: int = 1  # k, a DWA after block i mixes the X_j with j = i mod k (1: every output; the paper's default)
    dwa_period: int = 1  # p, a DWA after every p-th block only (1: after every block; the paper's default)
    dwa_decay: bool = False  # weight decay on alpha (True: the reference, whose alphas are Linear weights)
    # residual=scalars (ResidualScalars)
    scalars_init: str = "nanochat"  # lam, beta from nanochat's depth ramps | modded: 1 and 0
    scalars_lr_scale: float = 0.01  # the multipliers lam at this times the run's LR (nanochat: 0.01)
    # residual=mudd (MUDD)
    mudd_ways: int = 4  # 4: query, key, value and residual ways (the paper's) | 1: the residual way only
    # mod=router (RouterMoD; Raposo et al., arXiv 2404.02258)
    mod_layout: str = "block"  # block: attention + MLP share a route (Eq. 1) | sublayer: each routes alone
    mod_every: int = 1  # route every k-th block (blocks 0, k, 2k, ..), the others dense; mod_rate stays overall
    router_weight: str = "raw"  # kept writes scaled by the raw score r (Eq. 1) | sigmoid(r)
    mod_inference: str = "predictor"  # eval routing: predictor (the paper's MLP) | threshold (score >= tau)
    # mod=skip_middle (SkipMiddle)
    skip_target: Optional[float] = None  # the innermost gate's mean target; None: 1 - 2 mod_rate
    skip_middle_gate_axis: str = "key"  # where log(g) enters attention: key (the paper's description: g = 0 tokens are no keys, gathered out) | query (the published code: a row bias softmax cancels; every token runs, masked)

    def __post_init__(self):
        # one-line errors that name the fix; called again by GPT() after any field edits
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if (self.n_embd // self.n_head) % 2 != 0:
            raise ValueError(f"head size n_embd/n_head = {self.n_embd // self.n_head} must be even for RoPE")
        if self.kernels not in IMPLS:
            raise ValueError(f"unknown kernels '{self.kernels}'; valid: {', '.join(IMPLS)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        check_modes(self)  # mod_rate, value_residual, the modes and their options

    @property
    def n_sublayers(self):
        return 2 * self.n_layer

    @property
    def padded_vocab_size(self):
        """The rows of the embedding and the head: a multiple of 64 (faster matmuls on a GPU) when that
        adds at most 1/64 more rows (gpt2: 50257 -> 50304); a small vocab stays as is (65 characters:
        padding to 128 would double the head's work)."""
        padded = -(-self.vocab_size // 64) * 64
        return padded if 64 * (padded - self.vocab_size) <= self.vocab_size else self.vocab_size


# -----------------------------------------------------------------------------
# the model

@dataclass
class Context:
    """What one forward pass carries besides the stream: made in one place (GPT.new_context), read and
    filled by the sublayers and the MoD modes, and handed back to the caller (executed)."""
    tokens: int  # B * T, the tokens of the pass
    executed: list  # per sublayer: the tokens that ran it (ints; 0-d tensors where MoD counted on the device)
    pos: int = 0  # the first token's position (generation: after the tokens in the caches)
    caches: Optional[list] = None  # generation: per sublayer, a KVCache (attention) or None (MLP)
    update_tau: bool = False  # a training pass: TopKMoD moves its thresholds tau
    v1: Optional[torch.Tensor] = None  # value_residual: the first attention sublayer's values
    routes: Optional[dict] = None  # routing() asks for each sublayer's Route here
    # Mixture-of-Depths' records for the pass (the MoD modes below fill them)
    block_routes: dict = field(default_factory=dict)  # a block's route, made at its attention, reused by its MLP
    tau: Optional[list] = None  # eval: TopKMoD's thresholds, read from the device once a pass
    predictor_bce: list = field(default_factory=list)  # mod=router: each predictor's BCE, for aux_loss
    gates: list = field(default_factory=list)  # mod=skip_middle: each producer's gates g, for aux_loss
    gate_sum: Optional[torch.Tensor] = None  # mod=skip_middle: the producers' scores s summed so far


def executed_fraction(executed, tokens):
    """Per sublayer, the fraction of a pass's tokens that ran it: GPT(idx, executed=True)'s counts / idx.numel()."""
    return [float(e) / tokens for e in executed]


def _last_position(state):
    """Keep only the last token of every tensor in a stream state (a tensor, or a NamedTuple, tuple or list of them)."""
    if state is None or torch.is_tensor(state):
        return state if state is None else state[:, [-1]]
    last = [_last_position(part) for part in state]
    return state._make(last) if hasattr(state, "_make") else type(state)(last)


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        config.__post_init__()
        self.config = config
        V, d = config.padded_vocab_size, config.n_embd
        self.wte = nn.Embedding(V, d)
        self.drop = nn.Dropout(config.dropout)
        # sublayers l = 0..2L-1 alternate attention and MLP: block i is sublayers 2i and 2i + 1 (the README
        # and diagnose number them 1..2L)
        self.sublayers = nn.ModuleList(
            CausalSelfAttention(config, first=l == 0) if l % 2 == 0 else MLP(config) for l in range(config.n_sublayers))
        self.stream = RESIDUALS[config.residual](config)
        self.mod = MODS[config.mod](config) if MODS[config.mod] else None
        # whether a training step may leave some parameters without a gradient (DDP must be told)
        self.unused_parameters = self.mod is not None and self.mod.unused_parameters
        self.lm_head = nn.Linear(d, V, bias=False)
        self.register_buffer("rope", rope_table(d // config.n_head, config.block_size), persistent=False)
        self.apply(self._init_weights)
        # scaled init of each sublayer's output projection (GPT-2 / nanoGPT), unless the mode drops it
        for name, p in self.named_parameters():
            if self.stream.scaled_init and name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(config.n_sublayers))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=self.stream.embed_std)

    def get_num_params(self, non_embedding=True):
        """Parameter count. The token embedding is a lookup (no FLOPs), so non_embedding leaves
        it out; the untied LM head is a real matmul and stays in."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wte.weight.numel() if non_embedding else n

    def forward(self, idx, targets=None, executed=False):
        """nanoGPT's: (logits, loss); without targets, only the last position's logits and loss None.
        executed=True: (logits, loss, executed), the tokens that ran each sublayer (MoD: see executed_fraction)."""
        B, T = idx.size()
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        ctx = self.new_context(B * T, update_tau=self.training)
        state = self.stream_through(self.drop(self.wte(idx)), ctx)
        if targets is None:  # inference: only the last position's logits are needed
            state = _last_position(state)
        logits = self.stream.head(state, self.lm_head)[..., :self.config.vocab_size]
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-1)
            aux = self.mod.aux_loss(ctx) if self.training and self.mod is not None else None
            if aux is not None:  # skip_middle's sparsity penalty; the router predictors' BCE (value 0)
                loss = loss + aux
        return (logits, loss, ctx.executed) if executed else (logits, loss)

    def new_context(self, tokens, update_tau=False, pos=0, caches=None):
        """The Context of a forward pass over `tokens` tokens (the only place one is made)."""
        return Context(tokens, [tokens] * len(self.sublayers), pos=pos, caches=caches, update_tau=update_tau)

    def stream_through(self, e, ctx, look=None):
        """The forward's one loop: the stream from the token embeddings e [B, T, d] through each block, its
        attention and then its MLP. look(l, state), if given, sees the stream before each sublayer l and,
        with l = 2L, before the head (diagnose and routing look inside this way)."""
        state = self.stream.embed(e)
        for block in range(self.config.n_layer):
            for l in (2 * block, 2 * block + 1):  # the block's attention, then its MLP
                if look is not None:
                    look(l, state)
                state = self.sublayer(state, l, ctx)
        if look is not None:
            look(2 * self.config.n_layer, state)
        return state

    def sublayer(self, state, l, ctx):
        """Sublayer l on what the residual mode reads for it, on the tokens the MoD mode routes to it (all
        of them without MoD), its output written back with what the write needs from the read (carry). The
        MLP takes x alone; attention takes the RoPE rows of x's positions, under MoD or with KV caches the
        Visibility of its keys, and v1 (value_residual)."""
        x, carry = self.stream.read(state, l)
        route = self.mod.route(self.stream, state, x, l, ctx) if self.mod is not None else None
        if ctx.routes is not None:  # routing() records them
            ctx.routes[l] = route
        if route is not None:
            ctx.executed[l] = route.executed
            if route.idx is not None and route.idx.size(1) == 0:
                return self.stream.skip(state, l)  # nobody runs this sublayer
            x = route.gather(x)
        if l % 2:
            out = self.sublayers[l](x)
        else:
            T = (x[0] if isinstance(x, tuple) else x).size(1)  # a per-way read is a tuple (mudd)
            pos = ctx.pos
            rope = self.rope[pos:pos + T] if route is None or route.idx is None else self.rope[pos + route.idx]
            cache = ctx.caches[l] if ctx.caches else None
            out, ctx.v1 = self.sublayers[l](x, rope, Visibility.of(route, cache), ctx.v1)
        if route is None:
            return self.stream.write(state, l, out, carry)
        return self.stream.write_kept(state, l, out, carry, route)

    def configure_optimizers(self, weight_decay, learning_rate, betas, gate_lr_scale=1.0, gate_decay=False, muon=None):
        """nanoGPT's: the optimizer; optim.py puts each parameter in its group, from the modes' declarations."""
        return optim.configure_optimizers(self, weight_decay, learning_rate, betas, gate_lr_scale, gate_decay, muon)

    @torch.no_grad()
    def after_step(self, skipped=None):
        """Call after each optimiser step. skipped: a 0-d device tensor, > 0 when the step was skipped (non-finite
        gradients): a mode's own update (skip_middle's controller, DDP-pooled inside) then keeps its state."""
        self.stream.after_step(skipped)
        if self.mod is not None:
            self.mod.after_step(skipped)

    def set_warmup(self, scale):
        """A mode's warm-up scale in [0, 1], set before each iteration (nag: alpha's token warm-up)."""
        self.stream.set_warmup(scale)

    def describe(self):
        """One line: the modes and the shape, for train.py's banner."""
        c, mod = self.config, f" + mod={self.config.mod} at mod_rate {self.config.mod_rate:g}"
        return f"{c.residual}{mod if c.mod != 'none' else ''}: {c.n_layer} layers{self.stream.describe()}, {c.n_embd} wide"

    def cached_step(self, idx, caches, pos):
        """The logits of the last of the tokens idx [B, t] at positions pos.., which are appended to the
        caches; and the tokens that ran each sublayer."""
        ctx = self.new_context(idx.numel(), pos=pos, caches=caches)
        state = self.stream_through(self.wte(idx), ctx)
        return self.stream.head(_last_position(state), self.lm_head)[..., :self.config.vocab_size], ctx.executed

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, kv_cache=True, stats=False):
        """nanoGPT's: max_new_tokens sampled after idx (LongTensor [B, T]). With kv_cache, each new token runs
        alone through the sublayers it is routed to, against caches that hold only the tokens each attention
        sublayer ran; when a cache fills up (block_size positions) it restarts from the last block_size / 2
        tokens. Without it, every step recomputes the context cropped to block_size. stats=True: returns
        (idx, {"executed": per sublayer the tokens that ran it, "tokens": the tokens run}) instead."""
        size = self.config.block_size
        executed, n = [0] * len(self.sublayers), 0
        caches, pos = None, 0
        for _ in range(max_new_tokens):
            if not kv_cache:
                idx_cond = idx if idx.size(1) <= size else idx[:, -size:]
                logits, _, ran = self(idx_cond, executed=True)
                step = idx_cond.numel()
            elif caches is None or pos == size:
                window = idx[:, -(size if caches is None else size // 2):]
                caches = [KVCache(size) if l % 2 == 0 else None for l in range(len(self.sublayers))]
                (logits, ran), pos, step = self.cached_step(window, caches, 0), window.size(1), window.numel()
            else:
                (logits, ran), pos, step = self.cached_step(idx[:, -1:], caches, pos), pos + 1, idx.size(0)
            executed, n = [a + float(b) for a, b in zip(executed, ran)], n + step
            logits = logits[:, -1, :]
            if temperature == 0:
                idx_next = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                    logits[logits < v[:, [-1]]] = -float("inf")
                idx_next = torch.multinomial(F.softmax(logits.float(), dim=-1), num_samples=1)
            idx = torch.cat((idx, idx_next), dim=1)
        return (idx, {"executed": executed, "tokens": n}) if stats else idx


# -----------------------------------------------------------------------------
# the other residual modes

class Sandwich(PreNorm):
    """peri-LN: the embedding and every sublayer output are normalised too:
    x0 = RMSNorm(e); x = x + RMSNorm_post(f(RMSNorm_pre(x)))."""
    options, mods, starts_as = {}, ("router", "skip_middle"), None  # no norm_scaling: prenorm's alone

    @staticmethod
    def flops(config):
        return {}  # norms are not counted

    def no_decay_parameters(self):
        return []  # norms only

    def __init__(self, config):
        super().__init__(config)
        self.norm_embed = RMSNorm(config.n_embd, config.kernels)
        self.post_norms = nn.ModuleList(RMSNorm(config.n_embd, config.kernels) for _ in range(config.n_sublayers))

    def embed(self, e):
        return self.norm_embed(e)

    def delta(self, l, out):
        return self.post_norms[l](out)


class Modulator(nn.Module):
    """m(r) = max(p, floor) ** beta with p = sum_i softmax(c)_i sigmoid(<r, w_i> + b_i), in [0, 1]: how far
    a sublayer may rotate each token. The floor (nag_m_floor, 1e-6 as in nag-nanochat) keeps the
    gradient of p ** beta finite where a sigmoid underflows to p = 0 (beta < 1: infinite, NaN)."""

    def __init__(self, dim, channels, floor=1e-6):
        super().__init__()
        self.floor = floor
        self.proj = nn.Linear(dim, channels)  # weight ~ N(0, 0.02) by the GPT init
        nn.init.zeros_(self.proj.bias)
        self.mix = nn.Parameter(torch.zeros(channels))  # c
        self.beta_raw = nn.Parameter(torch.tensor(math.log(math.e - 1)))  # softplus(beta_raw) = 1

    def mixture(self, r):
        """p [..., 1], clamped at the floor."""
        p = torch.sigmoid(upcast(self.proj(r))) @ torch.softmax(upcast(self.mix), dim=0)
        return (p.clamp_min(self.floor) if self.floor > 0 else p).unsqueeze(-1)

    def forward(self, r):
        return self.mixture(r) ** F.softplus(upcast(self.beta_raw))


class NAG(Residual):
    """Norm-agnostic residual: the stream is a unit-RMS direction r and a log-norm s per token
    (x = e^s r). Sublayers only rotate r, by arctan(a) with a = alpha_l m_l(r); s only grows."""

    class State(NamedTuple):
        direction: torch.Tensor  # r [..., d], unit RMS
        log_norm: torch.Tensor  # s [..., 1], fp32: the stream is e^s r

    options = dict(nag_channels=None, nag_head=("cosine", "sqrt_d"), nag_m_floor=None)
    mods, ops = ("nag",), ("nag_update",)
    vector_flops = ("nag_modulator_mix",)
    embed_std = 1.0  # so e^s starts near 1; with 0.02 the logits would start 50x too small
    floor_at, dead_below = 1e-6, 0.05  # diagnostics, nag-nanochat's gate health: p at the floor; mean |a| of a dead branch

    @staticmethod
    def flops(config):
        C, n = config.nag_channels, config.n_sublayers
        # the projection r -> C logits (a matmul), and the mix p = sum_i softmax(c)_i sigmoid(.)_i (a mat-vec)
        return {"nag_modulator": 2 * C * config.n_embd * n, "nag_modulator_mix": 2 * C * n}

    @staticmethod
    def check(config):
        if config.nag_channels < 1:
            raise ValueError(f"nag_channels must be >= 1, got {config.nag_channels}")
        if not 0.0 <= config.nag_m_floor < 1.0:
            raise ValueError(f"nag_m_floor must be in [0, 1), got {config.nag_m_floor}")

    def __init__(self, config):
        super().__init__()
        n, d = config.n_sublayers, config.n_embd
        self.alpha = nn.Parameter(torch.tensor([1 / math.sqrt(l) for l in range(1, n + 1)]))
        self.modulators = nn.ModuleList(Modulator(d, config.nag_channels, config.nag_m_floor) for _ in range(n))
        self.g_enc = nn.Parameter(torch.zeros(()))
        # nag_head: cosine divides <W_hat r> by d (norms sqrt(d) each) and has no g_dec; sqrt_d learns g_dec
        if config.nag_head == "sqrt_d":
            self.g_dec = nn.Parameter(torch.zeros(()))
        else:
            self.register_buffer("g_dec", torch.zeros(()), persistent=False)
        self.head_divisor = math.sqrt(d) if config.nag_head == "sqrt_d" else d
        # alpha warm-up (set_warmup, from train.py's nag_alpha_warmup_tokens): a = scale alpha_l m_l
        self.register_buffer("alpha_scale", torch.ones(()), persistent=False)
        self.impl = config.kernels

    def no_decay_parameters(self):
        return list(self.modulators.parameters())  # as nag-nanochat's gate group

    def gate_parameters(self):
        """nag-nanochat's gate group (nag_gate_lr_scale): alpha and every modulator's w, b, c, beta."""
        return [self.alpha, *self.modulators.parameters()]

    def set_warmup(self, scale):
        self.alpha_scale.fill_(scale)  # on the device, no host read

    def embed(self, e):
        e = upcast(e)
        e = e - e.mean(-1, keepdim=True)  # mean-centred rows
        rms = e.square().mean(-1, keepdim=True).sqrt()
        return self.State(e / rms, torch.log(rms) + self.g_enc)

    def read(self, state, l):
        return state.direction, None  # sublayers read r, already unit RMS

    def tangent(self, r, l):
        return self.alpha[l] * self.alpha_scale * self.modulators[l](r)

    def write(self, state, l, out, carry):
        r, s = state.direction, state.log_norm
        r, log_gain = nag_update(r, out, self.tangent(r, l), impl=self.impl)
        return self.State(r, s + log_gain)

    def write_kept(self, state, l, out, carry, route):
        """mod=nag: route.score is the tangent a of the kept tokens (it carries m's gradient). NAGMoD.score sets
        it; nag works with no other MoD mode (mods), so no route reaches here without it."""
        r, s = state.direction, state.log_norm
        r_k, s_k = route.gather(r), route.gather(s)
        r_new, log_gain = nag_update(r_k, out, route.score, impl=self.impl)
        return self.State(route.scatter(r, route.keep(r_new, r_k)), route.scatter(s, route.keep(s_k + log_gain, s_k)))

    def head(self, state, lm_head):
        w = lm_head.weight
        w = w - w.mean(-1, keepdim=True)
        w = w * torch.rsqrt(w.square().mean(-1, keepdim=True) + 1e-6)  # unit-RMS rows, not in place
        return torch.exp(state.log_norm + self.g_dec) * F.linear(state.direction, w) / self.head_divisor

    def value(self, state, l):
        return torch.exp(state.log_norm) * state.direction

    def tokens(self, state):
        return [state.direction, state.log_norm]

    def stats(self, state, l):
        if l >= len(self.modulators):
            return {}
        r, mod = state.direction, self.modulators[l]
        m, a = mod(r), self.tangent(r, l)
        gain = a.abs().mean().item()
        # gate health as nag-nanochat logs it: floor = the fraction of tokens whose mixture p is at the
        # floor (<= 1e-6); dead = 1 when the branch's mean |a| (warm-up included) is below 0.05
        floor = (mod.mixture(r) <= max(self.floor_at, mod.floor)).float().mean().item()
        return {"alpha": self.alpha[l].item(), "m": m.mean().item(), "angle": torch.atan(a).mean().item(),
                "gain": gain, "floor": floor, "dead": float(gain < self.dead_below)}


class AttnRes(Residual):
    """Attention Residuals (Kimi Team 2026): each sublayer reads an attention over depth instead of
    a running sum. The sources are b_0 = the embedding (never summed into a block), then one per
    block: b_n, the sum of the raw outputs of block n's sublayers. attnres: every sublayer is a block
    (BlockAttnRes: blocks of whole layers). Sublayer l reads h_l = sum_i alpha_i v_i over the finished
    blocks and the running partial sum of its own block, alpha = softmax_i(<q_l, RMSNorm_l(v_i)>),
    through its own pre-norm; the head mixes all blocks with one more query, then RMSNorm. The
    ablations of the paper's §5.3 swap one piece:
      attnres_query="input":     q_l = W_l RMSNorm(latest source) (the partial sum, or the block just
                                 finished), W_l [d, d] init 0; the RMSNorm (no weight) is our choice
      attnres_weights="sigmoid": alpha_i = sigmoid(<q_l, k_i>), independent gates (0.5 each at init)
      attnres_key_norm=False:    k_i = v_i, no RMSNorm
    The default is one fused kernel (kernels.depth_attention); the ablations take a plain path that
    stacks the sources, the O(L^2 d) copy that the kernel avoids."""

    class State(NamedTuple):
        blocks: SourceStack  # the finished sources: b_0 = the embedding, then one per finished block
        partial: Optional[torch.Tensor]  # the running sum of the current block's outputs (None: none yet)

    options = dict(  # the paper's ablations (§5.3)
        attnres_query=("static", "input"), attnres_weights=("softmax", "sigmoid"), attnres_key_norm=(True, False))
    mods, ops = ("router",), ("rms_norm", "depth_attention")
    vector_flops = ("attnres_depth",)  # mat-vecs and broadcasts, not matmuls

    @classmethod
    def block_ends(cls, config):
        """Per sublayer, whether it closes a block, i.e. its block becomes a finished source."""
        return (True,) * config.n_sublayers

    @classmethod
    def source_counts(cls, config):
        """How many sources each sublayer 0..2L-1, then the head, mixes (sublayer 0: none, it reads
        the embedding as is): the finished blocks (b_0 = embedding) plus the running partial sum."""
        finished, partial, counts = 1, False, []
        for l, ends in enumerate(cls.block_ends(config)):
            counts.append(0 if l == 0 else finished + partial)
            partial = not ends
            finished += ends
        return counts + [finished]

    @classmethod
    def flops(cls, config):
        d = config.n_embd  # 2d for the scores, 2d for the weighted sum, per source mixed
        out = {"attnres_depth": 4 * d * sum(cls.source_counts(config))}
        if config.attnres_query == "input":  # W_l RMSNorm(latest source): sublayers 1..2L-1 and the head
            out["attnres_query"] = 2 * d * d * config.n_sublayers
        return out

    def __init__(self, config):
        super().__init__()
        n, d = config.n_sublayers, config.n_embd
        self.ends = type(self).block_ends(config)
        self.static_query, self.key_norm = config.attnres_query == "static", config.attnres_key_norm
        self.sigmoid = config.attnres_weights == "sigmoid"
        self.fused = self.static_query and not self.sigmoid and self.key_norm
        # per mixing point (sublayers 1..2L-1 and the head, index l-1; sublayer 0 has only the embedding
        # to read): a query, init 0 so that every source starts with the same weight, and the key
        # RMSNorm's learned weight (applied inside depth_attention, so a plain parameter)
        if self.static_query:
            self.queries = nn.ParameterList(nn.Parameter(torch.zeros(d)) for _ in range(n))
        else:
            self.query_projs = nn.ParameterList(nn.Parameter(torch.zeros(d, d)) for _ in range(n))
        if self.key_norm:
            self.key_norm_weights = nn.ParameterList(nn.Parameter(torch.ones(d)) for _ in range(n))
        self.norms = nn.ModuleList(RMSNorm(d, config.kernels) for _ in range(n))
        self.norm_f = RMSNorm(d, config.kernels)
        self.impl, self.config = config.kernels, config

    def no_decay_parameters(self):
        return []  # queries and norm weights are vectors

    def decay_parameters(self):
        return [] if self.static_query else list(self.query_projs)  # W_l, a projection

    def embed(self, e):
        # every source in the compute dtype (bf16 under autocast), so none is promoted to fp32
        if torch.is_autocast_enabled(e.device.type):
            e = e.to(torch.get_autocast_dtype(e.device.type))
        return self.State(SourceStack.start(e, 1 + sum(self.ends), self.impl), None)

    def sources(self, state):
        """The list of sources a sublayer mixes. Each tensor is written once and read where it lies
        (depth_attention takes the list): re-stacking them at every sublayer would copy and save
        O(L^2 d) per token."""
        return list(state.blocks) if state.partial is None else [*state.blocks, state.partial]

    def tokens(self, state):
        return self.sources(state)  # a write adds to the partial sum or starts one; finished blocks stay

    def query(self, sources, l):
        """q_l: the pseudo-query [d], or (attnres_query="input") W_l RMSNorm(latest source) [..., d]."""
        if self.static_query:
            return upcast(self.queries[l - 1])
        return F.linear(rms_norm(upcast(sources[-1]), impl=self.impl), self.query_projs[l - 1])

    def weights(self, sources, l):
        """alpha_i of sublayer l (l = 2L: the head), fp32 [S, ...]: the plain path."""
        v = upcast(torch.stack(sources))
        with fp32_math(v):
            k = rms_norm(v, self.key_norm_weights[l - 1], impl=self.impl) if self.key_norm else v
            scores = (k * self.query(sources, l)).sum(-1)
            return torch.sigmoid(scores) if self.sigmoid else torch.softmax(scores, dim=0)

    def depth_mix(self, state, l):
        """h_l, the depth mix sublayer l reads (sublayer 0: the embedding, its only source; l = 2L: the head)."""
        sources = self.sources(state)
        if l == 0:
            return sources[0]
        if self.fused:  # the finished blocks alone: their stack, whose reference reads them as one buffer
            mixed = state.blocks if state.partial is None else sources
            return depth_attention(mixed, self.queries[l - 1], self.key_norm_weights[l - 1], impl=self.impl)
        alpha = self.weights(sources, l).unsqueeze(-1)
        return sum(a * v for a, v in zip(alpha, sources)).type_as(sources[0])

    def read(self, state, l):
        return self.norms[l](self.depth_mix(state, l)), None

    def write(self, state, l, out, carry):
        partial = out if state.partial is None else state.partial + out
        if self.ends[l]:
            return self.State(state.blocks.append(partial), None)
        return self.State(state.blocks, partial)

    def write_kept(self, state, l, out, carry, route):
        # a skipped token's output is 0: it adds nothing to its block's sum
        e = state.blocks[0]
        return self.write(state, l, route.scatter(out.new_zeros(*e.shape[:2], out.size(-1)), route.weigh(out)), carry)

    def skip(self, state, l):
        # still a write: every token gets a 0 source (as write_kept gives skipped tokens), so the
        # sources and block boundaries stay those of a pass in which some token ran sublayer l
        return self.write(state, l, torch.zeros_like(state.blocks[0]), None)

    def head(self, state, lm_head):
        return lm_head(self.norm_f(self.depth_mix(state, len(self.norms))))

    def value(self, state, l):
        return self.depth_mix(state, l)  # the stream a sublayer reads is its depth mix

    def stats(self, state, l):
        if l == 0:
            return {}
        weights = self.weights(self.sources(state), l)
        return {"depth_weights": weights.float().flatten(1).mean(1).tolist()}


class BlockAttnRes(AttnRes):
    """Block AttnRes: the sources are blocks of k = ceil(L / N) whole layers, N = attnres_blocks.
    Boundaries fall before every k-th layer, as the reference's `layer % k == 0`; the last block keeps
    the layers that remain, so it may be shorter, and a boundary never splits a layer's attention from
    its MLP. N blocks when N divides L, maybe fewer otherwise (L = 12, N = 8: k = 2, 6 blocks)."""
    options = dict(attnres_blocks=None, **AttnRes.options)

    @classmethod
    def flops(cls, config):
        return super().flops(config)  # AttnRes's terms, over this partition's sources

    def no_decay_parameters(self):
        return super().no_decay_parameters()  # AttnRes's

    @staticmethod
    def check(config):
        N = config.attnres_blocks
        if N is not None and not (type(N) is int and 1 <= N <= config.n_layer):
            raise ValueError(f"attnres_blocks must be an integer in [1, n_layer = {config.n_layer}] (blocks are whole "
                             f"layers; None for min(8, n_layer)), got {N!r}")

    @staticmethod
    def layers_per_block(config):
        return -(-config.n_layer // (config.attnres_blocks or min(8, config.n_layer)))

    @classmethod
    def block_ends(cls, config):
        k = cls.layers_per_block(config)
        return tuple(l % 2 == 1 and ((l // 2 + 1) % k == 0 or l // 2 + 1 == config.n_layer)
                     for l in range(config.n_sublayers))

    def describe(self):
        return f" in {sum(self.ends)} blocks of {self.layers_per_block(self.config)} layer(s)"


class HyperConnections(Residual):
    """Hyper-connections (Zhu et al., arXiv 2409.19606, Algorithm 2 of App. J): the stream is n copies
    X [..., n, d] (hc_streams); the embedding is copied into each. Sublayer l reads u = sum_m A_m[m] X_m
    through its own pre-norm, as prenorm's sublayers do, and writes X'_j = sum_m A_r[m, j] X_m + B[j] f(u).
    The head reads the sum of the streams through the final norm. Static (the default): A_m, A_r, B
    are learned per sublayer, init A_m = one-hot at stream l mod n, A_r = I, B = 1: every stream then
    equals prenorm's stream, and the logits equal prenorm's. hc_dynamic=True adds per-token terms
    from the normed streams X_bar = RMSNorm(X) (the paper's LayerNorm; RMSNorm as everywhere here):
    A_m += s_a tanh(X_bar W_m), A_r += s_a tanh(X_bar W_r), B += s_b tanh(X_bar W_b), W = 0 and
    s_a = s_b = 0.01 at init. MHC below constrains the same read and write.
    The state is X. read() computes sublayer l's coefficients from X (pre_mix) and hands H_post and
    H_res to the write as its carry."""
    options = dict(hc_streams=None, hc_dynamic=None)
    mods, ops, starts_as = ("router",), ("rms_norm", "hc_post_mix"), "prenorm"
    vector_flops = ("hc_read", "hc_write")
    routed_flops = ("hc_mix", "hc_write")  # under MoD a skipped token's streams are neither mixed nor written

    @staticmethod
    def check(config):
        if not (type(config.hc_streams) is int and config.hc_streams >= 1):
            raise ValueError(f"hc_streams must be an integer >= 1, got {config.hc_streams!r}")
        if config.hc_dynamic not in (True, False):
            raise ValueError(f"hc_dynamic must be True or False, got {config.hc_dynamic!r}")

    @staticmethod
    def flops(config):
        n, d, L = config.hc_streams, config.n_embd, config.n_sublayers
        # the H_res mix is a (small) matmul; the read's weighted sum and H_post f(u) added are not
        out = {"hc_mix": 2 * n * n * d * L, "hc_read": 2 * n * d * L, "hc_write": 2 * n * d * L}
        if config.hc_dynamic:  # X_bar [n, d] @ [W_m | W_r | W_b] [d, n + 2]
            out["hc_dynamic"] = 2 * n * d * (n + 2) * L
        return out

    def __init__(self, config):
        super().__init__()
        n, d, L = config.hc_streams, config.n_embd, config.n_sublayers
        self.n, self.impl = n, config.kernels
        self.norms = nn.ModuleList(RMSNorm(d, config.kernels) for _ in range(L))
        self.norm_f = RMSNorm(d, config.kernels)
        self.init_mixing(config)
        self.composite = None  # diagnostics: the product of the H_res so far in a diagnose() pass (stats())

    def init_mixing(self, config):
        """The parameters the coefficients come from, at the paper's init."""
        n, L = config.hc_streams, config.n_sublayers
        self.pre = nn.Parameter(F.one_hot(torch.arange(L) % n, n).float())  # A_m, per sublayer [n]
        self.res = nn.Parameter(torch.eye(n).repeat(L, 1, 1))  # A_r [n, n]
        self.post = nn.Parameter(torch.ones(L, n))  # B [n]
        self.dynamic = config.hc_dynamic
        if self.dynamic:
            self.dynamic_norms = nn.ModuleList(RMSNorm(config.n_embd, config.kernels) for _ in range(L))
            self.dynamic_proj = nn.Parameter(torch.zeros(L, n + 2, config.n_embd))  # [W_m | W_r | W_b]^T
            self.dynamic_scale = nn.Parameter(torch.full((L, 2), 0.01))  # s_a, s_b

    def no_decay_parameters(self):
        # the mixing matrices (stacked per sublayer, so 2-D and 3-D) take no weight decay
        return [self.pre, self.res, self.post] + ([self.dynamic_scale] if self.dynamic else [])

    def decay_parameters(self):
        return [self.dynamic_proj] if self.dynamic else []  # W_m, W_r, W_b: projections of the normed streams

    def describe(self):
        return f" x {self.n} streams"

    def embed(self, e):
        # the streams in the compute dtype (bf16 under autocast), as mHC's official kernels keep them:
        # n copies in fp32 would double what the stream costs in memory and traffic
        if torch.is_autocast_enabled(e.device.type):
            e = e.to(torch.get_autocast_dtype(e.device.type))
        return e.unsqueeze(-2).expand(*e.shape[:-1], self.n, e.size(-1)).contiguous()

    def pre_mix(self, X, l):
        """(u, h_post, h_res) of sublayer l: its read u = sum_m h_pre[m] X_m [..., d], and the write's
        coefficients h_post [n] and h_res [n, n] (dynamic: per token, [..., n] and [..., n, n])."""
        pre, post, res = self.pre[l], self.post[l], self.res[l]
        if self.dynamic:
            t = torch.tanh(upcast(F.linear(self.dynamic_norms[l](X), self.dynamic_proj[l])))  # [..., n, n + 2]
            s_a, s_b = self.dynamic_scale[l]
            pre, post, res = pre + s_a * t[..., 0], post + s_b * t[..., -1], res + s_a * t[..., 1:-1]
        u = (pre.to(X.dtype).unsqueeze(-1) * X).sum(-2)  # a matmul would save a transposed copy of X
        return u, post, res

    def read(self, X, l):
        u, post, res = self.pre_mix(X, l)
        return self.norms[l](u), (post, res)  # the write's coefficients: its carry

    def write(self, X, l, out, carry):
        post, res = carry
        return hc_post_mix(X, out, post, res, impl=self.impl)

    def write_kept(self, X, l, out, carry, route):
        """Router MoD: the kept tokens' streams get the whole write (mix and output); a skipped
        token's n streams stay as they are."""
        post, res = carry
        kept = route.gather(X)
        post = route.gather(post) if post.dim() > 1 else post
        res = route.gather(res) if res.dim() > 2 else res
        new = hc_post_mix(kept, route.weigh(out), post, res, impl=self.impl)
        new = route.keep(new.flatten(-2), kept.flatten(-2)).view_as(new)  # padding keeps its streams
        return route.scatter(X, new)

    def head(self, X, lm_head):
        return lm_head(self.norm_f(X.sum(-2)))

    def value(self, X, l):
        return X.mean(-2)  # the streams' mean: at hc's init, prenorm's stream

    def stats(self, X, l):
        """The streams' mean pairwise cosine ("stream_cos", 1: collapsed), and the composite H_res
        from the embedding through sublayer l (the product of the mixes so far, this sublayer's
        included; the head: all of them): its max row sum "gain_fwd" (how much a signal can grow
        going up) and max column sum "gain_bwd" (a gradient going down), |entries|, each averaged over
        tokens. mHC keeps both at 1; hc's may drift. MoD's skips are not in the product. diagnose() calls
        it for l = 0, 1, .., 2L in order; the product so far is self.composite."""
        Xf = upcast(X)
        unit = F.normalize(Xf, dim=-1)
        cos = unit @ unit.transpose(-1, -2)
        n = self.n
        out = {"stream_cos": ((cos.sum((-2, -1)) - n) / max(n * (n - 1), 1)).mean().item()}
        if l < len(self.norms):
            h_res = upcast(self.pre_mix(X, l)[2]).expand(*Xf.shape[:-2], n, n)
            prev = self.composite if l > 0 else torch.eye(n, dtype=Xf.dtype, device=Xf.device)
            self.composite = h_res.transpose(-1, -2) @ prev  # X_l+1 = H_res^T X_l + ...: maps X_0 to X_l+1
        a = self.composite.abs()
        out["gain_fwd"] = a.sum(-1).amax(-1).mean().item()
        out["gain_bwd"] = a.sum(-2).amax(-1).mean().item()
        return out


class MHC(HyperConnections):
    """Manifold-constrained hyper-connections (DeepSeek, arXiv 2512.24880), with the equations of
    the official code (deepseek-ai/TileKernels, mhc_pre / mhc_post / mhc_head). Per sublayer one
    projection of the flattened streams, proj = vec(X) phi^T [n(n+2)], RMS-normalised after the
    projection (RMSNorm over all n*d, folded: proj * rsqrt(mean(vec(X)^2) + eps)), times three scales
    (pre, post, res) plus a bias: c. H_pre = sigmoid(c_pre) + 1e-6; H_post = sigmoid(c_post) *
    mhc_post_mult; H_res = Sinkhorn(c_res), fp32 whatever the autocast, mhc_sinkhorn_repeat
    iterations: doubly stochastic, so the composite mix over depth neither grows nor vanishes.
    Read u = sum_m H_pre[m] X_m; write X'_j = H_post[j] f(u) + sum_m H_res[m, j] X_m (the official
    orientation). The head mixes the streams with a projection of its own, h = sigmoid(.) + 1e-6,
    before the final norm. Paper vs official code: the post multiplier (2 vs 1.0) and the repeats
    (20 vs 10); the defaults are the paper's (README "Fidelity").
    Init (neither source gives one): phi = 0 and scales 0.01 (as hc's dynamic part), so at init the
    coefficients are the biases: pre +2 at stream l mod n and -2 elsewhere (each sublayer reads mostly
    its own stream, as hc's one-hot), post 0 (H_post = 1 with the multiplier 2), res 2 on the
    diagonal (H_res 0.71 on it for n = 4: near the identity, not so peaked that Sinkhorn's gradient
    vanishes), head 0. The streams start equal and a doubly-stochastic H_res keeps equal streams
    equal, so at init every stream is prenorm's stream and the logits are prenorm's."""
    options = dict(hc_streams=None, mhc_post_mult=None, mhc_sinkhorn_repeat=None, mhc_res=("sinkhorn", "birkhoff"))
    ops = ("rms_norm", "mhc_pre_mix", "sinkhorn", "hc_post_mix")
    vector_flops = ("hc_read", "hc_write", "mhc_sinkhorn", "mhc_birkhoff_norm")

    @staticmethod
    def check(config):
        HyperConnections.check(config)
        if not (isinstance(config.mhc_post_mult, (int, float)) and config.mhc_post_mult > 0):
            raise ValueError(f"mhc_post_mult must be a number > 0 (2.0: the paper, 1.0: the official code), "
                             f"got {config.mhc_post_mult!r}")
        if not (type(config.mhc_sinkhorn_repeat) is int and config.mhc_sinkhorn_repeat >= 1):
            raise ValueError(f"mhc_sinkhorn_repeat must be an integer >= 1 (20: the paper, 10: the official code), "
                             f"got {config.mhc_sinkhorn_repeat!r}")
        if config.mhc_res == "birkhoff" and config.hc_streams > 6:
            raise ValueError(f"mhc_res=birkhoff takes n! = {math.factorial(config.hc_streams)} logits per sublayer "
                             f"at hc_streams={config.hc_streams}: use hc_streams <= 6 (mHC-lite's n = 4)")
        if config.mhc_res == "birkhoff" and config.mhc_sinkhorn_repeat != 20:
            raise ValueError("mhc_sinkhorn_repeat does nothing with mhc_res=birkhoff (no Sinkhorn): remove it")

    @staticmethod
    def res_size(config):
        """The coefficients of H_res per sublayer: n^2 logits for Sinkhorn, n! for birkhoff."""
        n = config.hc_streams
        return math.factorial(n) if config.mhc_res == "birkhoff" else n * n

    @classmethod
    def flops(cls, config):
        n, d, L = config.hc_streams, config.n_embd, config.n_sublayers
        K = 2 * n + cls.res_size(config)
        out = {"hc_mix": 2 * n * n * d * L, "hc_write": 2 * n * d * L,
               "hc_read": 2 * n * d * (L + 1),  # sum_m H_pre[m] X_m (fused with the coefficients), and the head's
               "mhc_proj": 2 * n * d * (K * L + n)}  # vec(X) phi^T per sublayer, and the head's
        if config.mhc_res == "birkhoff":
            out["mhc_birkhoff"] = 2 * cls.res_size(config) * n * n * L  # the weights times the n! permutation matrices (a matmul)
            out["mhc_birkhoff_norm"] = 2 * n * d * L  # the RMS of the streams its logits are scaled by
        else:  # per step of each sublayer's n x n Sinkhorn: a sum and a divide per entry
            out["mhc_sinkhorn"] = 2 * n * n * (2 * config.mhc_sinkhorn_repeat) * L
        return out

    def init_mixing(self, config):
        """phi, the scales and biases of each sublayer and of the head, at our init (class docstring).
        birkhoff: H_res's n! logits start as mHC-lite's (github.com/FFTYYY/mhc-lite): 0 for the identity
        permutation, -8 for every other (H_res 0.99 on the diagonal for n = 4). hc's dynamic terms are hc's
        own: mhc's pre_mix and parameter lists replace hc's, and never read self.dynamic."""
        n, d, L = config.hc_streams, config.n_embd, config.n_sublayers
        self.birkhoff = config.mhc_res == "birkhoff"
        K = 2 * n + self.res_size(config)
        self.phi = nn.Parameter(torch.zeros(L, K, n * d))
        self.scale = nn.Parameter(torch.full((L, 3), 0.01))
        own = F.one_hot(torch.arange(L) % n, n).float()
        if self.birkhoff:  # itertools.permutations lists the identity first
            self.ops = tuple(op for op in type(self).ops if op != "sinkhorn")
            perms = torch.tensor(list(itertools.permutations(range(n))))
            self.register_buffer("permutations", torch.eye(n)[perms].flatten(1), persistent=False)  # [n!, n^2]
            res = torch.full((L, K - 2 * n), -8.0)
            res[:, 0] = 0.0
        else:
            res = 2 * torch.eye(n).flatten().repeat(L, 1)
        self.base = nn.Parameter(torch.cat((4 * own - 2, torch.zeros(L, n), res), 1))
        self.head_phi = nn.Parameter(torch.zeros(n, n * d))
        self.head_scale = nn.Parameter(torch.full((1,), 0.01))
        self.head_base = nn.Parameter(torch.zeros(n))
        self.post_mult, self.repeat = float(config.mhc_post_mult), config.mhc_sinkhorn_repeat

    def no_decay_parameters(self):
        return [self.scale, self.base, self.head_scale, self.head_base]

    def decay_parameters(self):
        return [self.phi, self.head_phi]  # projections of the flattened streams, as any projection

    def mixing_parameters(self):
        # every coefficient of the mixes and the projections that make them stays with AdamW under Muon,
        # head_phi (2-D) as the per-sublayer phi (3-D, which torch's Muon cannot take)
        return list(self.parameters())

    def pre_mix(self, X, l):
        """(u, h_post, h_res) as hc's, from one projection of the streams."""
        proj = F.linear(X.flatten(-2), self.phi[l].to(X.dtype))
        if self.birkhoff:
            return self.birkhoff_pre_mix(X, proj, l)
        u, post, res_logits = mhc_pre_mix(X, proj, self.scale[l], self.base[l], post_mult=self.post_mult,
                                          impl=self.impl)
        return u, post, sinkhorn(res_logits, self.repeat, impl=self.impl)

    def birkhoff_pre_mix(self, X, proj, l):
        """mhc_res=birkhoff (mHC-lite, arXiv 2601.05732): H_res = sum_k softmax(c_res)_k P_k over the n!
        permutation matrices P_k, doubly stochastic exactly, no iterations; c_res = scale_res * proj_res *
        rsqrt(mean(vec(X)^2) + eps) + base_res, the same normalisation as the other coefficients. The read
        and H_post come from the fused pre-mix with no H_res columns (zeros, discarded)."""
        n = self.n
        zeros = proj.new_zeros(*proj.shape[:-1], n * n)
        u, post, _ = mhc_pre_mix(X, torch.cat((proj[..., :2 * n], zeros), -1), self.scale[l],
                                 F.pad(self.base[l, :2 * n], (0, n * n)), post_mult=self.post_mult, impl=self.impl)
        xf = upcast(X)
        with fp32_math(xf):
            rstd = torch.rsqrt(xf.square().mean((-2, -1)) + 1e-6).unsqueeze(-1)
            logits = self.scale[l, 2] * upcast(proj[..., 2 * n:]) * rstd + self.base[l, 2 * n:]
            h_res = torch.softmax(logits, -1) @ self.permutations.to(logits.dtype)
        return u, post, h_res.unflatten(-1, (n, n))

    def head(self, X, lm_head):
        n = self.n
        # the official mhc_head: the pre-mix's read with n coefficients (the rest of proj zero)
        proj = F.pad(F.linear(X.flatten(-2), self.head_phi.to(X.dtype)), (0, n * (n + 1)))
        scale = F.pad(self.head_scale, (0, 2))
        base = F.pad(self.head_base, (0, n * (n + 1)))
        u = mhc_pre_mix(X, proj, scale, base, impl=self.impl)[0]
        return lm_head(self.norm_f(u))


class DenseFormer(Residual):
    """DenseFormer (Pagliardini et al., arXiv 2402.02622; epfml/DenseFormer): a prenorm stream, and after
    block i (i = 1..L, a block is a layer: attention then MLP) a depth-weighted average (DWA) of the
    outputs so far, x <- sum_j alpha[i, j] X_j, where X_0 is the embedding and X_j the stream leaving
    block j before its own DWA. dwa_dilation k: the average after block i takes only the X_j with
    j = i mod k; dwa_period p: a DWA follows every p-th block only (the paper's k x p-DenseFormer).
    alpha [L/p, L+1], one row per DWA (row r follows block (r+1)p), starts as the identity, weight 1 on
    X_i and 0 elsewhere: the model starts as prenorm. The weights outside a row's group are never read.
    The DWA is part of a block's last write: under MoD a token that skips the MLP keeps its stream (its
    X_i is its x) and is not averaged."""

    class State(NamedTuple):
        x: torch.Tensor  # the stream
        outputs: SourceStack  # X_0 (the embedding), X_1, ..: the stream leaving each block so far, before its DWA
    options = dict(dwa_dilation=None, dwa_period=None, dwa_decay=None)
    mods, ops, starts_as = ("router",), ("rms_norm", "dense_mix"), "prenorm"
    vector_flops = ()  # the DWA is a matrix-vector product in dense_mix's reference, as FlopCounterMode sees it

    @staticmethod
    def check(config):
        for name in ("dwa_dilation", "dwa_period"):
            value = getattr(config, name)
            if not (type(value) is int and 1 <= value <= config.n_layer):
                raise ValueError(f"{name} must be an integer in [1, n_layer = {config.n_layer}] (1: the paper's "
                                 f"default), got {value!r}")
        if config.dwa_decay not in (True, False):
            raise ValueError(f"dwa_decay must be True or False, got {config.dwa_decay!r}")

    @staticmethod
    def groups(config):
        """Per block i = 1..L: the j it averages over (j = i mod k, j <= i), or None (no DWA after it)."""
        k, p = config.dwa_dilation, config.dwa_period
        return [list(range(i % k, i + 1, k)) if i % p == 0 else None for i in range(1, config.n_layer + 1)]

    @classmethod
    def flops(cls, config):
        # a multiply and an add per element of each output averaged
        return {"dwa": 2 * config.n_embd * sum(len(g) for g in cls.groups(config) if g)}

    def __init__(self, config):
        super().__init__()
        L, d, p = config.n_layer, config.n_embd, config.dwa_period
        self.norms = nn.ModuleList(RMSNorm(d, config.kernels) for _ in range(config.n_sublayers))
        self.norm_f = RMSNorm(d, config.kernels)
        self.group = self.groups(config)
        self.row = [i // p - 1 if g else None for i, g in enumerate(self.group, 1)]  # block i's row of alpha
        self.alpha = nn.Parameter(torch.zeros(L // p, L + 1))
        with torch.no_grad():
            for i, r in enumerate(self.row, 1):
                if r is not None:
                    self.alpha[r, i] = 1.0
        self.decay, self.shape = config.dwa_decay, (config.dwa_dilation, config.dwa_period)
        self.impl = config.kernels

    def no_decay_parameters(self):
        return [] if self.decay else [self.alpha]

    def decay_parameters(self):
        return [self.alpha] if self.decay else []

    def mixing_parameters(self):
        return [self.alpha]  # decayed or not, never a matrix for Muon

    def describe(self):
        k, p = self.shape
        return ", a DWA after every block" if (k, p) == (1, 1) else f", {k}x{p}-DenseFormer (dilation {k}, period {p})"

    def embed(self, e):
        if self.shape[0] > 1:  # a dilation mixes slices of the outputs, never the whole stack: no buffer
            return self.State(e, SourceStack((e,)))
        return self.State(e, SourceStack.start(e, len(self.group) + 1, self.impl))

    def read(self, state, l):
        return self.norms[l](state.x), None

    def average(self, outputs, i):
        """The DWA after block i over its group of outputs (None: block i has none)."""
        if self.group[i - 1] is None:
            return None
        group, k = self.group[i - 1], self.shape[0]
        w = self.alpha[self.row[i - 1], group[0]::k][:len(group)]  # the group's weights, a view of alpha's row
        sources = outputs if k == 1 else outputs[group[0]::k]  # k = 1: every output, the whole stack
        return dense_mix(sources, w, impl=self.impl)  # one op, no stacked copy of the outputs

    def write(self, state, l, out, carry):
        x = state.x + out
        if l % 2 == 0:
            return self.State(x, state.outputs)
        outputs = state.outputs.append(x)
        mixed = self.average(outputs, l // 2 + 1)
        return self.State(x if mixed is None else mixed, outputs)

    def write_kept(self, state, l, out, carry, route):
        x = route.scatter_add(state.x, route.weigh(out))
        if l % 2 == 0:
            return self.State(x, state.outputs)
        outputs = state.outputs.append(x)
        mixed = self.average(outputs, l // 2 + 1)
        if mixed is not None:  # a token that skipped the MLP keeps its stream
            x = torch.where(route.ran(*x.shape[:2], x.device).unsqueeze(-1), mixed, x)
        return self.State(x, outputs)

    def skip(self, state, l):
        return state if l % 2 == 0 else self.State(state.x, state.outputs.append(state.x))  # X_i is still recorded

    def head(self, state, lm_head):
        return lm_head(self.norm_f(state.x))

    def value(self, state, l):
        return state.x

    def tokens(self, state):
        return [state.x, *state.outputs]

    def stats(self, state, l):
        """Sublayer l = 2i (and the head, l = 2L) reads the DWA after block i: its weights over X_0..X_i
        ("depth_weights", 0 outside its group), as for attnres."""
        i = l // 2
        if l % 2 or i == 0 or self.group[i - 1] is None:
            return {}
        w = torch.zeros(i + 1)
        for j in self.group[i - 1]:
            w[j] = self.alpha[self.row[i - 1], j].item()
        return {"depth_weights": w.tolist()}


class ResidualScalars(PreNorm):
    """Learned residual scalars with an x0 lane (nanochat's gpt.py and dev/LOG.md of 2026-01-11, from
    modded-nanogpt's embed shortcut of Nov 2024): the stream starts as x0 = RMSNorm(e) (no weight), and
    block i = 0..L-1 takes x <- lam_i x + beta_i x0 as its residual and its attention's input, then runs as
    prenorm's: x <- x + f(RMSNorm(x)) for its attention and MLP. Init (scalars_init): nanochat's, lam_i
    from 1.15 down to 1.05 and beta_i from 0.20 down to 0.05 linearly over depth, or modded-nanogpt's
    (1, 0). The multipliers lam train at scalars_lr_scale times the run's LR (nanochat: 1/100 of
    beta's; a multiplier compounds over depth), beta at the run's LR; neither decays. The attention's
    read makes the block's residual lam_i x + beta_i x0 and hands it to the write as its carry."""

    class State(NamedTuple):
        x: torch.Tensor  # the stream
        x0: torch.Tensor  # RMSNorm(e), the lane each block mixes back in
    options = dict(scalars_init=("nanochat", "modded"), scalars_lr_scale=None)
    mods, ops, starts_as = ("router",), ("rms_norm",), None
    vector_flops = ("scalars",)

    @staticmethod
    def check(config):
        scale = config.scalars_lr_scale
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
            raise ValueError(f"scalars_lr_scale must be a number > 0 (nanochat: 0.01), got {scale!r}")

    @staticmethod
    def flops(config):
        return {"scalars": 3 * config.n_embd * config.n_layer}  # lam x + beta x0 before each block

    def no_decay_parameters(self):
        return []  # lam and beta are vectors

    def __init__(self, config):
        super().__init__(config)  # prenorm's norms
        L, self.impl = config.n_layer, config.kernels
        depth = torch.arange(L) / max(L - 1, 1)
        nanochat = config.scalars_init == "nanochat"
        self.lam = nn.Parameter(1.15 - 0.10 * depth if nanochat else torch.ones(L))
        self.beta = nn.Parameter(0.20 - 0.15 * depth if nanochat else torch.zeros(L))
        self.lr_scale = config.scalars_lr_scale

    def lr_groups(self):
        return [([self.lam], self.lr_scale)]

    def embed(self, e):
        x0 = rms_norm(e, impl=self.impl)
        return self.State(x0, x0)

    def read(self, state, l):
        x = state.x
        if l % 2:
            return self.norms[l](x), None
        i = l // 2  # the attention's read: the block's residual lam x + beta x0, the carry its write adds to
        residual = self.lam[i].to(x.dtype) * x + self.beta[i].to(x.dtype) * state.x0
        return self.norms[l](residual), residual

    def write(self, state, l, out, carry):
        return self.State((state.x if l % 2 else carry) + out, state.x0)

    def write_kept(self, state, l, out, carry, route):
        """A token that skips the attention keeps its stream: the scaling is part of that sublayer's write."""
        x = state.x
        if l % 2:
            return self.State(route.scatter_add(x, route.weigh(out)), state.x0)
        ran = route.ran(*x.shape[:2], x.device).unsqueeze(-1)
        return self.State(torch.where(ran, route.scatter_add(carry, route.weigh(out)), x), state.x0)

    def head(self, state, lm_head):
        return lm_head(self.norm_f(state.x))

    def value(self, state, l):
        return state.x

    def tokens(self, state):
        return [state.x, state.x0]

    def stats(self, state, l):
        if l % 2 or l >= len(self.norms):
            return {}
        return {"lam": self.lam[l // 2].item(), "beta": self.beta[l // 2].item()}


class MUDD(Residual):
    """MUDDFormer (Xiao et al., arXiv 2502.12170; Caiyun-AI/MUDDFormer, pytorch/muddformer/
    modeling_muddformer.py, and the init of its JAX training code): a multiway dynamic dense connection
    after every block i = 0..L-1 over the embedding X_0 and every block output so far, X_0..X_{i+1}. Its
    weights come per token from the newest output: dw = W2 GELU(W1 RMSNorm(X_{i+1})) (RMSNorm without a
    weight) plus static weights, [ways, i+2], no softmax. Each way c mixes x_c = sum_j dw[c, j] X_j: with
    mudd_ways=4 the next block's attention reads its query, key and value from three separately normed
    ways (a per-way read) and the fourth is its residual; the last block has one way, the head's input.
    mudd_ways=1 keeps the residual way only (the next block reads it as prenorm does). Inside a block it
    is prenorm: h = x_r + attn(...), X_{i+1} = h + MLP(RMSNorm(h)). The hidden width of W1 is
    (ways (i+2) // 64 + 1) * 64, four times the ways for the last block's (the released model's
    round64 and expand_last). Init (the JAX code): W1 normal with std 1/sqrt(d), W2 = 0, static weight 1
    on the newest output and 0 elsewhere: every way is X_{i+1}, the model starts as prenorm."""

    class State(NamedTuple):
        x: torch.Tensor  # the residual way x_r: what the next block adds to (after the last block, the head's input)
        outputs: SourceStack  # X_0 (the embedding), .., X_i: the outputs of the blocks so far
        qkv: Optional[tuple]  # the next attention's query, key and value ways (mudd_ways=4), else None
    options = dict(mudd_ways=(4, 1))
    mods, ops, starts_as = (), ("rms_norm", "dense_mix"), "prenorm"
    vector_flops = ()  # the mix too is a (batched) matmul in dense_mix's reference, as FlopCounterMode sees it

    @staticmethod
    def shapes(config):
        """Per block i: (ways C, sources i + 2, W1's hidden width)."""
        L, ways = config.n_layer, config.mudd_ways
        out = []
        for i in range(L):
            C = ways if i < L - 1 else 1
            hidden = C * (i + 2) * (4 if i == L - 1 else 1)
            out.append((C, i + 2, (hidden // 64 + 1) * 64))
        return out

    @classmethod
    def flops(cls, config):
        d, shapes = config.n_embd, cls.shapes(config)
        return {"mudd_proj": sum(2 * d * h + 2 * h * C * n for C, n, h in shapes),  # W1, W2 per token
                "mudd_mix": sum(2 * C * n * d for C, n, h in shapes)}  # sum_j dw[c, j] X_j per way

    def __init__(self, config):
        super().__init__()
        d, L = config.n_embd, config.n_layer
        self.norms = nn.ModuleList(RMSNorm(d, config.kernels) for _ in range(config.n_sublayers))  # the query way's
        self.norm_f = RMSNorm(d, config.kernels)
        self.ways = config.mudd_ways
        if self.ways == 4:  # blocks 1..L-1: the key and value ways' own pre-norms
            self.key_norms = nn.ModuleList(RMSNorm(d, config.kernels) for _ in range(L - 1))
            self.value_norms = nn.ModuleList(RMSNorm(d, config.kernels) for _ in range(L - 1))
        shapes = self.shapes(config)
        self.w1 = nn.ParameterList(nn.Parameter(torch.randn(h, d) / math.sqrt(d)) for C, n, h in shapes)
        self.w2 = nn.ParameterList(nn.Parameter(torch.zeros(C * n, h)) for C, n, h in shapes)
        self.static = nn.ParameterList(nn.Parameter(F.one_hot(torch.tensor(n - 1), n).float().repeat(C, 1))
                                       for C, n, h in shapes)
        self.impl = config.kernels

    def no_decay_parameters(self):
        return list(self.static)  # the static weights, as any mixing weights

    def decay_parameters(self):
        return [*self.w1, *self.w2]  # projections of the newest output

    def embed(self, e):
        return self.State(e, SourceStack.start(e, len(self.static) + 1, self.impl), None)  # X_0, one per block

    def read(self, state, l):
        if l % 2 or state.qkv is None:
            return self.norms[l](state.x), None
        i, (q, k, v) = l // 2, state.qkv
        return (self.norms[l](q), self.key_norms[i - 1](k), self.value_norms[i - 1](v)), None

    def weights(self, x, i):
        """dw [..., C, i + 2] of block i's connection, from its output x."""
        C, n = self.static[i].shape
        h = F.gelu(F.linear(rms_norm(x, impl=self.impl), self.w1[i].to(x.dtype)))
        return F.linear(h, self.w2[i].to(x.dtype)).unflatten(-1, (C, n)) + self.static[i].to(x.dtype)

    def write(self, state, l, out, carry):
        x = state.x + out
        if l % 2 == 0:
            return self.State(x, state.outputs, None)
        outputs = state.outputs.append(x)
        dw = self.weights(x, l // 2)
        ways = dense_mix(outputs, dw, impl=self.impl).unbind(-2)  # way c: sum_j dw[c, j] X_j
        *qkv, x = ways  # (query, key, value,) residual: the last way is the residual
        return self.State(x, outputs, tuple(qkv) if qkv else None)

    def head(self, state, lm_head):
        return lm_head(self.norm_f(state.x))

    def value(self, state, l):
        return state.x

    def tokens(self, state):
        return [state.x, *state.outputs, *(state.qkv or ())]

    def stats(self, state, l):
        """Sublayer l = 2i (and the head, l = 2L) reads block i-1's connection: its residual way's weights
        over X_0..X_i ("depth_weights", mean over tokens), as for attnres."""
        i = l // 2
        if l % 2 or i == 0:
            return {}
        outputs = state.outputs
        return {"depth_weights": self.weights(outputs[-1], i - 1)[..., -1, :].float().flatten(0, -2).mean(0).tolist()}


RESIDUALS.update({  # the other residual modes, one line each
    "sandwich": Sandwich,
    "nag": NAG,
    "attnres": AttnRes,
    "block_attnres": BlockAttnRes,
    "hc": HyperConnections,
    "mhc": MHC,
    "dwa": DenseFormer,
    "scalars": ResidualScalars,
    "mudd": MUDD,
})
VARIANTS = {  # the options that change what a mode computes: the tests check each as a mode of its own, bench.py times it
    "prenorm (norm_scaling)": dict(residual="prenorm", norm_scaling=True),
    "prenorm (value_residual=learned)": dict(residual="prenorm", value_residual="learned"),  # a backbone option
    "mhc (mhc_res=birkhoff)": dict(residual="mhc", mhc_res="birkhoff"),
    "dwa (dwa_dilation=2, dwa_period=2)": dict(residual="dwa", dwa_dilation=2, dwa_period=2),
    "hc (value_residual=learned)": dict(residual="hc", value_residual="learned"),
    "mudd (mudd_ways=1)": dict(residual="mudd", mudd_ways=1),
}


# -----------------------------------------------------------------------------
# Mixture-of-Depths: which tokens run each sublayer. Skipped tokens are gathered out,
# so they cost no matmul FLOPs and are not keys at that attention sublayer.
# Each MoD mode is a MoD: route(stream, state, x, l, ctx) -> Route, or None for "every token,
# unweighted" (the dense path); ctx is the pass's Context (GPT.new_context), whose MoD fields they fill.

def capacity(T, rate):
    """Tokens a top-k routed sublayer keeps out of T: k = ceil((1 - rate) T)."""
    return max(1, math.ceil(round((1.0 - rate) * T, 6)))


@dataclass
class Route:
    """The tokens that run one sublayer.
    idx [B, k]: their positions, ascending per row, so the compressed sequence keeps the original
      order and causal attention among kept tokens stays causal; None: every token.
    valid [B, k, 1]: False on padding (rows keep different counts; padding sits after a row's kept
      tokens, so causal attention never reads it, and the write-back leaves it as it was).
    weight [B, k, 1]: scales the sublayer's write (router: the score r or sigmoid(r); skip_middle: the gate).
    score [B, k, 1]: the routing score (mod=nag: the tangent a that the write-back uses).
    key_bias [B, k]: added to attention scores where these tokens are keys (skip_middle).
    query_bias [B, k]: added to attention scores where these tokens are queries (skip_middle_gate_axis=query).
    executed: how many (token) rows actually ran, for the executed fraction.
    whole_block: the route of a whole block (router, mod_layout=block), whose weight scales the block's
      write once, as in Eq. 1 (see weigh); first holds the block's first write meanwhile."""
    idx: Optional[torch.Tensor]
    executed: object
    valid: Optional[torch.Tensor] = None
    weight: Optional[torch.Tensor] = None
    score: Optional[torch.Tensor] = None
    key_bias: Optional[torch.Tensor] = None
    query_bias: Optional[torch.Tensor] = None
    whole_block: bool = False
    first: Optional[torch.Tensor] = None

    def _index(self, x):
        return self.idx.view(*self.idx.shape, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:])

    def gather(self, x):
        return x if self.idx is None else x.gather(1, self._index(x))

    def scatter(self, x, values):
        return values if self.idx is None else x.scatter(1, self._index(x), values.to(x.dtype))

    def scatter_add(self, x, values):
        return x + values if self.idx is None else x.scatter_add(1, self._index(x), values.to(x.dtype))

    def weigh(self, out):
        """The write of the kept rows: scaled by weight, 0 on padding. A whole-block route writes the
        attention's a unweighted (so the MLP reads x + a, as inside the block f) and then the MLP's
        w m + (w - 1) a: the block adds w (a + m) = w f(x), Eq. 1 of Raposo et al."""
        if self.whole_block and self.first is None:
            self.first = out if self.valid is None else torch.where(self.valid, out, 0.0)
            return self.first
        if self.weight is not None:
            w = self.weight.to(out.dtype)
            out = out * w if self.first is None else out * w + self.first * (w - 1)
        return out if self.valid is None else torch.where(self.valid, out, 0.0)

    def keep(self, new, old):
        return new if self.valid is None else torch.where(self.valid, new, old)

    def gather_score(self, score):
        return None if score is None else self.gather(score.unsqueeze(-1))

    def ran(self, B, T, device):
        """[B, T] bool: the tokens that ran the sublayer (padding excluded)."""
        if self.idx is None:
            return torch.ones(B, T, dtype=torch.bool, device=device)
        valid = torch.ones_like(self.idx, dtype=torch.bool) if self.valid is None else self.valid.squeeze(-1)
        return torch.zeros(B, T, dtype=torch.bool, device=device).scatter(1, self.idx, valid)


def topk_route(score, k):
    """Training: per row the k highest scores, in their original order. Returns (route, k-th score)."""
    top, idx = score.topk(k, dim=1, sorted=False)
    idx = idx.sort(dim=1).values
    route = Route(idx, executed=k * score.size(0))
    route.score = route.gather_score(score)
    return route, top.min(dim=1).values


def mask_route(keep, score=None):
    """Eval (and skip_middle): the tokens where keep [B, T] is True, in position order, padded to the
    row that keeps most (keep a Python bool: one token, a KV-cache step, decided on the host). How many that is depends on the data, so eager mode reads the counts (one
    host sync) and runs only max(count) tokens per row. Under torch.compile the route keeps a static
    shape instead, padded to all T tokens: one graph, no sync and no recompilation, with the same
    results (padding sits after a row's kept tokens, so causal attention never reads it, and its
    write is discarded) but without the compute saving."""
    if isinstance(keep, bool):
        if not keep:  # an empty route: the sublayer is skipped, nothing reads its score
            return Route(score.new_zeros((1, 0), dtype=torch.long), executed=0)
        route = Route(None, executed=1)
        route.score = route.gather_score(score)
        return route
    B, T = keep.shape
    if torch.compiler.is_compiling():
        kmax, padded, executed = T, True, keep.sum()
    elif B == 1:  # one row (generation): its kept positions, ascending, in one read; no padding
        idx = keep[0].nonzero().view(1, -1)
        route = Route(None if idx.size(1) == T else idx, executed=idx.size(1))
        route.score = route.gather_score(score)
        return route
    else:
        counts = keep.sum(1).tolist()
        kmax, padded, executed = max(counts), min(counts) < max(counts), sum(counts)
    if kmax == T and not padded:
        route = Route(None, executed=executed)
    else:
        # kept tokens first, each group in position order (a stable sort of "not kept")
        order = torch.sort((~keep).to(torch.uint8), dim=1, stable=True).indices[:, :kmax]
        route = Route(order, executed=executed, valid=keep.gather(1, order).unsqueeze(-1) if padded else None)
    route.score = route.gather_score(score)
    return route


def block_route(ctx, block, make):
    """The route of transformer block `block`: made by make() where the block starts, then reused by
    its MLP (and by skip_middle's mirror block). ctx.block_routes holds them for one forward."""
    routes = ctx.block_routes
    if block not in routes:
        routes[block] = make()
    return routes[block]


class MoD(nn.Module):
    """A Mixture-of-Depths mode. Besides route(), it declares what a residual mode does (options, check,
    flops, no_decay_parameters, decay_parameters, mixing_parameters; see Residual) and planned_fractions(config): per sublayer, the fraction
    of tokens that FLOP plans count (counted_dense: no fixed capacity, so dense is an upper bound)."""
    options, counted_dense, unused_parameters, vector_flops, routed_flops = {}, False, False, (), ()

    @staticmethod
    def check(config):
        pass

    @staticmethod
    def planned_fractions(config):
        return [1.0] * config.n_sublayers

    def no_decay_parameters(self):
        return []

    def decay_parameters(self):
        return []

    def mixing_parameters(self):
        return self.no_decay_parameters()

    def routing_score(self, stream, state, l, scores):
        """routing(): what sublayer l is routed on, or None."""
        return None

    def after_step(self, skipped):
        pass

    def aux_loss(self, ctx):
        return None


class TopKMoD(MoD):
    """Routing by a per-token score: in training each sequence keeps its top-k tokens per routed
    sublayer (routed(); the others run dense); in eval (causal) a token runs it when keep()
    says so: its score is >= tau, an EMA of the k-th largest training score (a buffer: saved in the
    checkpoint; tau = nan, never trained with routing, e.g. mod_rate 0: every token runs).
    unit[l]: the score (router, tau) sublayer l uses; None where sublayer l runs dense."""
    tau_decay = 0.99

    @staticmethod
    def routed(config):
        """The sublayers routed: both of every mod_every-th block (blocks 0, k, 2k, ..); the others run dense."""
        return tuple(l for l in range(config.n_sublayers) if (l // 2) % config.mod_every == 0)

    @classmethod
    def skip_fraction(cls, config):
        """The fraction of tokens each routed sublayer skips: mod_rate x (sublayers / routed sublayers), so
        the model as a whole skips mod_rate of its (token, sublayer) pairs whatever mod_every is. The
        paper's 12.5% capacity in every other block is mod_every=2, mod_rate=0.4375 (even n_layer)."""
        return config.mod_rate * config.n_sublayers / len(cls.routed(config))

    @classmethod
    def keep_fraction(cls, config):
        """Training capacity of a routed sublayer: the fraction of tokens kept, k / T."""
        return capacity(config.block_size, cls.skip_fraction(config)) / config.block_size

    @classmethod
    def planned_fractions(cls, config):
        routed, keep = cls.routed(config), cls.keep_fraction(config)
        return [keep if l in routed else 1.0 for l in range(config.n_sublayers)]

    @classmethod
    def check(cls, config):
        if isinstance(config.mod_every, bool) or not isinstance(config.mod_every, int) or config.mod_every < 1:
            raise ValueError(f"mod_every must be an integer >= 1 (route every k-th block), got {config.mod_every!r}")
        if cls.skip_fraction(config) >= 1.0:
            blocks = len(cls.routed(config)) // 2
            raise ValueError(f"mod_rate={config.mod_rate} cannot be skipped by the {blocks} of {config.n_layer} blocks "
                             f"that mod_every={config.mod_every} routes: use mod_rate < {blocks / config.n_layer:.4g} "
                             f"or a smaller mod_every")

    def __init__(self, config, per_block=False):
        super().__init__()
        self.rate = self.skip_fraction(config)  # the skipped fraction of each routed sublayer
        key = (lambda l: l // 2) if per_block else (lambda l: l)
        routed = self.routed(config)
        slots = list(dict.fromkeys(key(l) for l in routed))
        self.unit = [slots.index(key(l)) if l in routed else None for l in range(config.n_sublayers)]
        self.register_buffer("tau", torch.full((len(slots),), float("nan")))
    def route(self, stream, state, x, l, ctx):
        u = self.unit[l]
        if u is None or (self.training and self.rate == 0):
            return None  # dense: no score needed
        if not self.training and self.dense_at_eval(u, ctx):
            return None
        score = self.score(stream, state, x, l)  # [B, T], fp32
        if self.training:
            route, kth = topk_route(score, capacity(score.size(1), self.rate))
            if ctx.update_tau:
                with torch.no_grad():
                    kth = kth.mean()
                    old = self.tau[u]
                    self.tau[u] = torch.where(old.isnan(), kth, self.tau_decay * old + (1 - self.tau_decay) * kth)
            self.learn(x, u, route, ctx)
        else:
            route = mask_route(self.keep(x, u, score, ctx), score)
        return self.finish(route)

    def dense_at_eval(self, u, ctx):
        # one host read of the thresholds per forward pass (compiled: none, keep() keeps every token
        # where tau is nan, with no data-dependent branch)
        if torch.compiler.is_compiling():
            return False
        if ctx.tau is None:
            ctx.tau = self.tau.tolist()
        return math.isnan(ctx.tau[u])

    def keep(self, x, u, score, ctx):
        """Eval: score >= tau, [B, T] bool; for one token (a KV-cache step) a Python bool, from one
        read of its score. Eager mode gets here only where dense_at_eval saw that tau is not nan."""
        if torch.compiler.is_compiling():
            tau = self.tau[u]
            return (score >= tau) | tau.isnan()  # nan: never trained with routing, every token runs
        return score.item() >= ctx.tau[u] if score.numel() == 1 else score >= self.tau[u]

    def routing_score(self, stream, state, l, scores):
        """routing(): what sublayer l is routed on (None where it runs dense); scores: those so far."""
        if self.unit[l] is None:
            return None
        return self.score(stream, state, stream.read(state, l)[0], l)

    def learn(self, x, u, route, ctx):
        pass

    def finish(self, route):
        return route


class NAGMoD(TopKMoD):
    """mod=nag: router-free. The score is a_l = alpha_l m_l(r), the tangent of the rotation the
    sublayer would apply; the kept tokens' NAG write-back uses it, so m learns through it."""

    @staticmethod
    def flops(config):
        return {}  # the score is the modulator's, which NAG counts

    def score(self, stream, state, x, l):
        return stream.tangent(state.direction, l).squeeze(-1)

    def routing_score(self, stream, state, l, scores):
        return self.score(stream, state, None, l)  # every sublayer's tangent, routed or not


class RouterMoD(TopKMoD):
    """mod=router (Raposo et al., arXiv 2404.02258): score r = <w, x> from a linear router, x what the
    routed sublayer reads (already RMS-normalised). mod_layout=sublayer: a router per routed
    sublayer. mod_layout=block: one per routed block, scored on the stream entering it; the block's
    attention and MLP share its route, and the block's write is scaled once, x + r f(x) (Eq. 1; see
    Route.weigh). Kept writes are scaled by r (router_weight=raw, Eq. 1) or sigmoid(r): that is how
    the router learns. Eval routing must be causal: score >= tau (mod_inference=threshold), or the
    paper's predictor (mod_inference=predictor): per router a small MLP on the router's input with
    its gradient stopped, trained by BCE towards top-k membership; logit > 0 (p > 0.5) runs the
    token. (The paper's other option, a BCE on the router's own score, is not implemented.) tau is
    tracked either way, so a predictor model can also be evaluated with inference = "threshold".
    The paper's whole recipe (every other block at 12.5% capacity) is config/mod_router_paper.py;
    mod_every=1 is the default so that mod_rate spans [0, 1) as for the other MoD modes."""
    options = dict(mod_layout=("block", "sublayer"), mod_every=None, router_weight=("raw", "sigmoid"),
                   mod_inference=("predictor", "threshold"))

    @staticmethod
    def n_routers(config):
        """Router scores per token: one per routed sublayer (mod_layout=block: per routed block)."""
        return len(TopKMoD.routed(config)) // (2 if config.mod_layout == "block" else 1)

    @staticmethod
    def predictor_width(config):
        """mod_inference=predictor: the hidden width of each routing predictor MLP."""
        return max(8, config.n_embd // 8)

    @classmethod
    def flops(cls, config):
        if config.mod_rate == 0:  # the model never routes, in training nor in eval
            return {}
        d, n = config.n_embd, cls.n_routers(config)
        out = {"router": 2 * d * n}  # a linear score <w, x> on every token
        if config.mod_inference == "predictor":  # Linear(d, w), GELU, Linear(w, 1) per router, every token
            out["mod_predictor"] = 2 * (d + 1) * cls.predictor_width(config) * n
        return out

    def __init__(self, config):
        super().__init__(config, per_block=config.mod_layout == "block")
        self.layout, self.weighting, self.inference = config.mod_layout, config.router_weight, config.mod_inference
        d, n = config.n_embd, len(self.tau)
        self.routers = nn.ModuleList(nn.Linear(d, 1, bias=False) for _ in range(n))
        self.predictors = None
        if config.mod_inference == "predictor":
            w = self.predictor_width(config)
            self.predictors = nn.ModuleList(
                nn.Sequential(nn.Linear(d, w), nn.GELU(), nn.Linear(w, 1)) for _ in range(n))
            # the last training forward's BCE per predictor (for logs and tests)
            self.register_buffer("predictor_bce", torch.full((n,), float("nan")), persistent=False)

    def no_decay_parameters(self):
        return []  # the routers and predictors are Linear layers: they decay

    def route(self, stream, state, x, l, ctx):
        if self.layout == "sublayer":
            return super().route(stream, state, x, l, ctx)
        make = super().route
        return block_route(ctx, l // 2, lambda: make(stream, state, x, l, ctx))

    def score(self, stream, state, x, l):
        return upcast(self.routers[self.unit[l]](x)).squeeze(-1)

    def routing_score(self, stream, state, l, scores):
        if self.layout == "block" and l % 2:
            return scores[l - 1]  # the block's route, scored on the stream entering it
        return super().routing_score(stream, state, l, scores)

    def predict(self, x, u):
        """The predictor's logit that each token is in the top-k; x's gradient stops here."""
        return upcast(self.predictors[u](x.detach())).squeeze(-1)

    def dense_at_eval(self, u, ctx):
        return self.rate == 0 if self.inference == "predictor" else super().dense_at_eval(u, ctx)

    def keep(self, x, u, score, ctx):
        if self.inference != "predictor":
            return super().keep(x, u, score, ctx)
        run = self.predict(x, u) > 0
        return bool(run) if run.numel() == 1 and not torch.compiler.is_compiling() else run

    def learn(self, x, u, route, ctx):
        if self.predictors is not None:
            member = torch.zeros(x.shape[:2], device=x.device).scatter(1, route.idx, 1.0)
            bce = F.binary_cross_entropy_with_logits(self.predict(x, u), member)
            ctx.predictor_bce.append(bce)

    def finish(self, route):
        route.weight = route.score if self.weighting == "raw" else torch.sigmoid(route.score)
        route.whole_block = self.layout == "block"
        return route

    def aux_loss(self, ctx):
        """The predictors' BCE summed, as bce - bce.detach(): its gradient trains the predictors (and
        nothing else: their input is detached), its value is 0, so the loss stays the LM loss."""
        if not ctx.predictor_bce:
            return None
        bce = torch.stack(ctx.predictor_bce)
        with torch.no_grad():
            self.predictor_bce.copy_(bce)
        return (bce - bce.detach()).sum()


class SkipMiddle(MoD):
    """mod=skip_middle (Lawson & Aitchison, arXiv 2506.21103), on the sandwich residual, per transformer
    block. Blocks i < L/2 produce s_i = ReLU(<w_i, x_i> + b_i) from the stream entering them; the gate
    g_i = 1 - clamp(s_1 + .. + s_i, 0, 1) scales both sublayers of block i and of its mirror
    L-1-i, so a saturated token switches off a symmetric middle span. In attention, log g of the
    *key* is added to the scores (-inf at g = 0), so other tokens stop reading a token that
    skipped; tokens with g = 0 are gathered out and cost nothing. (skip_middle_gate_axis=query: the
    published code's query-axis bias, which softmax cancels; every token then runs, masked.)
    Sparsity, at the reference code's scale: loss += the mean over all L blocks (a mirror counts its
    gate again) of lam_i mean(g_i) + mu_i var(g_i) = the mean over the L/2 producers, with this
    micro-batch's mean and (unbiased) variance, as the reference's loss. The controller instead sees
    the step's statistics: sums of 1, g and g^2 over every training micro-batch since the last
    controller_step() (all_reduced over DDP ranks by SkipMiddle.after_step), so the pooled mean and population
    variance are exact. After each optimiser step controller_step() moves lam_i (mu_i) by
    eta (mean - target) (var - target) where they are more than 0.01 apart. Mean targets go linearly
    from 1 (outermost) to skip_target (innermost); variance targets t(1 - t). With one producer
    (L = 2) the target is skip_target: the reference's linspace(1, end, 1) gives 1 there, a gate that
    never aims to skip. Producers get no weight decay, as in the reference."""
    options = dict(skip_target=None, skip_middle_gate_axis=("key", "query"))
    counted_dense = True  # the gates decide how many tokens run: FLOP plans count dense, an upper bound
    unused_parameters = True  # DDP: a middle block whose gate is 0 on all of a rank's tokens gets no gradient there
    eta, tolerance = 1e-3, 0.01
    gather = True  # False: the soft path (every token runs, masked), which tests compare against

    @staticmethod
    def check(config):
        if config.n_layer % 2:
            raise ValueError(f"mod=skip_middle pairs block i with block L-1-i: n_layer must be even, got {config.n_layer}")
        if config.skip_target is not None and not 0.0 <= config.skip_target <= 1.0:
            raise ValueError(f"skip_target must be in [0, 1], got {config.skip_target}")

    @staticmethod
    def flops(config):
        return {"skip_gates": 2 * config.n_embd * (config.n_layer // 2)}  # s_i = ReLU(<w_i, x_i> + b_i), every token

    def __init__(self, config):
        super().__init__()
        L, d = config.n_layer, config.n_embd
        self.n_blocks, half = L, L // 2
        self.axis = config.skip_middle_gate_axis
        self.producers = nn.ModuleList(nn.Linear(d, 1) for _ in range(half))  # w ~ N(0, 0.02), b = 0
        end = 1.0 - 2.0 * config.mod_rate if config.skip_target is None else config.skip_target
        end = min(max(end, 0.0), 1.0)
        target = torch.tensor([end] if half == 1 else [1.0 + (end - 1.0) * i / (half - 1) for i in range(half)])
        self.register_buffer("target", target)
        self.register_buffer("lam", torch.zeros(half))
        self.register_buffer("mu", torch.zeros(half))
        # per producer: tokens, sum g, sum g^2 since the last controller step (float64: exact enough
        # to pool by all_reduce and take E[g^2] - E[g]^2); not state, like the statistics below
        self.register_buffer("gate_sums", torch.zeros(3, half, dtype=torch.float64), persistent=False)
        # the pooled statistics the last controller step saw (for logs and tests)
        self.register_buffer("gate_mean", torch.full((half,), float("nan")), persistent=False)
        self.register_buffer("gate_var", torch.full((half,), float("nan")), persistent=False)

    def no_decay_parameters(self):
        return list(self.parameters())

    def route(self, stream, state, x, l, ctx):
        return block_route(ctx, l // 2, lambda: self.gate_route(state, l // 2, ctx))  # the MLP reuses it

    def gate_route(self, state, block, ctx):
        gates = ctx.gates
        if block < len(self.producers):
            s = F.relu(upcast(self.producers[block](state))).squeeze(-1)
            total = s if block == 0 else ctx.gate_sum + s
            ctx.gate_sum = total
            gates.append(1.0 - total.clamp(0.0, 1.0))
        gate = min(block, self.n_blocks - 1 - block)
        if gate != block:  # block L-1-i reuses block i's gate, and so its route
            return ctx.block_routes[gate]
        g = gates[gate]
        if self.axis == "query":  # a g = 0 token is still a key for the others: it must run
            route = Route(None, executed=g.numel())
            route.weight = g.unsqueeze(-1)
            route.query_bias = torch.log(g.clamp(GATE_FLOOR, 1.0))
            return route
        route = mask_route(g > 0) if self.gather else Route(None, executed=(g > 0).sum())
        gk = route.gather(g)
        route.weight = gk.unsqueeze(-1)
        route.key_bias = torch.where(gk > 0, torch.log(gk.clamp(GATE_FLOOR, 1.0)), float("-inf"))
        return route

    def aux_loss(self, ctx):
        """mean_i (lam_i mean(g_i) + mu_i var(g_i)) over the producers, this micro-batch's statistics;
        adds its sums to gate_sums for the controller."""
        g = torch.stack([x.flatten() for x in ctx.gates])
        with torch.no_grad():
            g64 = g.detach().double()
            self.gate_sums.add_(torch.stack([torch.full_like(g64[:, 0], g.size(1)), g64.sum(1), g64.square().sum(1)]))
        return (self.lam * g.mean(1) + self.mu * g.var(1)).mean()

    @torch.no_grad()
    def after_step(self, skipped):
        """The pooled statistics of every DDP rank (one small all_reduce, on the device), then the
        controller; a skipped step keeps lam and mu."""
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(self.gate_sums)
        before = self.lam.clone(), self.mu.clone()
        self.controller_step()
        if skipped is not None:
            for coef, old in zip((self.lam, self.mu), before):
                coef.copy_(torch.where(skipped > 0, old, coef))

    @torch.no_grad()
    def controller_step(self):
        """On the device, no host read: pooled statistics from gate_sums, which start again from 0. A gap
        that is nan (no training forward since the last step: 0 / 0) moves nothing."""
        count, total, squares = self.gate_sums
        mean = total / count
        self.gate_mean.copy_(mean)
        self.gate_var.copy_(squares / count - mean.square())
        self.gate_sums.zero_()
        var_target = self.target * (1 - self.target)
        for coef, value, target in ((self.lam, self.gate_mean, self.target), (self.mu, self.gate_var, var_target)):
            gap = value - target
            coef.add_(torch.where(gap.abs() > self.tolerance, self.eta * gap, 0.0))  # nan > x is False


MODS.update({"nag": NAGMoD, "router": RouterMoD, "skip_middle": SkipMiddle})  # one entry each


# -----------------------------------------------------------------------------
# looking inside a model: what each sublayer does to the stream, and which tokens ran it

@torch.no_grad()
def diagnose(model, idx):
    """Per sublayer l (numbered 1..2L here, as in the README): the RMS of the stream entering it (nag: e^s),
    the relative size of its update ||x_{l+1} - x_l|| / ||x_l||, the fraction of tokens that ran it (MoD,
    under the model's current train or eval routing), and the mode's own figures (its stats(): nag's gate
    health, attnres's depth weights); then a row for the head. For attnres the "stream" is the depth mix a
    sublayer reads."""
    B, T = idx.shape
    ctx, stream, rows, entering = model.new_context(B * T), model.stream, [], []

    def look(l, state):  # before sublayer l (0-based), and before the head (l = 2L)
        x = stream.value(state, l).float()
        if rows:  # the update of the sublayer before
            x_in = entering.pop()
            rows[-1]["update"] = ((x - x_in).norm(dim=-1) / x_in.norm(dim=-1)).mean().item()
            rows[-1]["executed"] = float(ctx.executed[l - 1]) / (B * T)
        kind = "head" if l == len(model.sublayers) else "attn" if l % 2 == 0 else "mlp"
        rows.append({"sublayer": l + 1, "kind": kind, "rms": x.square().mean().sqrt().item(), **stream.stats(state, l)})
        entering.append(x)

    model.stream_through(model.wte(idx), ctx, look)
    if any("dead" in row for row in rows):  # nag: how many branches are dead
        rows[-1]["dead"] = sum(row.get("dead", 0.0) for row in rows[:-1])
    return rows


@torch.no_grad()
def routing(model, idx):
    """What the model's current routing (eval: thresholds or predictors) does with idx [B, T]:
    ran [2L, B, T] bool, whether each token ran each sublayer; score [2L, B, T] float, what it was
    routed on (mod=router: the router's score r; mod=nag: the tangent a = alpha_l m_l(r) of every
    sublayer), nan where a sublayer is not routed."""
    B, T = idx.shape
    n = len(model.sublayers)
    ctx = model.new_context(B * T)
    ctx.routes = {}
    score = torch.full((n, B, T), float("nan"), device=idx.device)

    def look(l, state):  # before sublayer l: what it is routed on
        s = model.mod.routing_score(model.stream, state, l, score) if model.mod is not None and l < n else None
        if s is not None:
            score[l] = s.float()

    model.stream_through(model.wte(idx), ctx, look)
    dense = Route(None, executed=B * T)
    ran = torch.stack([(ctx.routes[l] or dense).ran(B, T, idx.device) for l in range(n)])
    return ran, score
