"""
nanodepth: one GPT whose residual stream is switchable.

Read top to bottom: the config, the two sublayer kinds (attention, MLP), the residual
modes (each one answers three questions: what a sublayer reads, how its output is written
back, what the LM head reads), then the GPT that strings sublayers 1..2L through the
chosen residual mode. See SPEC.md-derived notes in README.md for the equations.
"""

import inspect
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels import IMPLS, depth_attention, depth_scores, nag_update, rms_norm, upcast


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50257  # real vocab; the embedding and head are padded to a multiple of 64
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    residual: str = "prenorm"  # prenorm | sandwich | nag | attnres | block_attnres
    attnres_blocks: Optional[int] = None  # block_attnres: number of blocks N; None: min(8, 2L)
    nag_channels: int = 32  # nag: channels C of each sublayer's modulator
    kernels: str = "auto"  # auto (Triton on CUDA tensors) | triton | torch: see kernels.py

    def __post_init__(self):
        # one-line errors that name the fix; called again by GPT() after any field edits
        if self.residual not in RESIDUALS:
            raise ValueError(f"unknown residual '{self.residual}'; valid: {', '.join(RESIDUALS)}")
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if (self.n_embd // self.n_head) % 2 != 0:
            raise ValueError(f"head size n_embd/n_head = {self.n_embd // self.n_head} must be even for RoPE")
        if self.attnres_blocks is not None and not (
                isinstance(self.attnres_blocks, int) and 1 <= self.attnres_blocks <= self.n_sublayers):
            raise ValueError(f"attnres_blocks must be an integer in [1, 2 * n_layer = {self.n_sublayers}] "
                             f"(or None for min(8, 2L)), got {self.attnres_blocks!r}")
        if self.nag_channels < 1:
            raise ValueError(f"nag_channels must be >= 1, got {self.nag_channels}")
        if self.kernels not in IMPLS:
            raise ValueError(f"unknown kernels '{self.kernels}'; valid: {', '.join(IMPLS)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def n_sublayers(self):
        return 2 * self.n_layer

    @property
    def depth_block_size(self):
        """attnres / block_attnres: consecutive sublayers per block, S = ceil(2L / N) (full AttnRes: 1)."""
        blocks = self.n_sublayers if self.residual == "attnres" else (self.attnres_blocks or min(8, self.n_sublayers))
        return -(-self.n_sublayers // blocks)

    @property
    def padded_vocab_size(self):
        return -(-self.vocab_size // 64) * 64


# -----------------------------------------------------------------------------
# building blocks

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


def apply_rope(x, rope):
    """Rotate consecutive feature pairs of x [B, T, ..., hd] by rope [T, hd/2, 2], the table rows
    of the tokens' own positions. Eager: one complex multiply, several times cheaper on CPU than
    the real form. Compiled: the real form, because inductor has no code generation for complex ops."""
    rope = rope.view(rope.shape[0], *([1] * (x.dim() - 3)), *rope.shape[1:])
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    if torch.compiler.is_compiling():
        out = _rotate_real(pairs, rope)
    else:
        out = torch.view_as_real(torch.view_as_complex(pairs) * torch.view_as_complex(rope))
    return out.flatten(-2).type_as(x)


def _rotate_real(pairs, rope):
    (a, b), (cos, sin) = pairs.unbind(-1), rope.unbind(-1)
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1)


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x, rope):
        B, T, C = x.size()
        qk, v = self.c_attn(x).view(B, T, 3, self.n_head, C // self.n_head).split((2, 1), dim=2)
        q, k = apply_rope(qk, rope).unbind(2)  # q and k rotated together: one op instead of two
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.squeeze(2).transpose(1, 2)  # [B, nh, T, hd]
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x, rope=None):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


# -----------------------------------------------------------------------------
# residual modes: the only place where the modes differ.
# Each is a module holding the mode's own parameters, with four methods:
#   embed(e)              -> state    the stream built from the token embedding
#   read(state, l)        -> tensor   what sublayer l (0-based here) takes as input
#   write(state, l, out)  -> state    how sublayer l's output goes back into the stream
#   head(state, lm_head)  -> logits
# and, for diagnostics, value(state, l) -> the stream as sublayer l sees it (l = 2L: as the head
# sees it), plus stats(state, l) -> mode-specific figures.

class PreNorm(nn.Module):
    """nanoGPT's baseline: x = x + f(RMSNorm(x)); the head reads RMSNorm(x)."""
    embed_std = 0.02

    def __init__(self, config):
        super().__init__()
        self.norms = nn.ModuleList(RMSNorm(config.n_embd, config.kernels) for _ in range(config.n_sublayers))
        self.norm_f = RMSNorm(config.n_embd, config.kernels)

    def embed(self, e):
        return e

    def read(self, x, l):
        return self.norms[l](x)

    def write(self, x, l, out):
        return x + out

    def head(self, x, lm_head):
        return lm_head(self.norm_f(x))

    def value(self, x, l):
        return x

    def stats(self, x, l):
        return {}


class Sandwich(PreNorm):
    """peri-LN: the embedding and every sublayer output are normalised too:
    x0 = RMSNorm(e); x = x + RMSNorm_post(f(RMSNorm_pre(x)))."""

    def __init__(self, config):
        super().__init__(config)
        self.norm_embed = RMSNorm(config.n_embd, config.kernels)
        self.post_norms = nn.ModuleList(RMSNorm(config.n_embd, config.kernels) for _ in range(config.n_sublayers))

    def embed(self, e):
        return self.norm_embed(e)

    def write(self, x, l, out):
        return x + self.post_norms[l](out)


class Modulator(nn.Module):
    """m(r) = (sum_i softmax(c)_i sigmoid(<r, w_i> + b_i)) ** beta, in [0, 1]: how far a sublayer may
    rotate each token."""

    def __init__(self, dim, channels):
        super().__init__()
        self.proj = nn.Linear(dim, channels)  # weight ~ N(0, 0.02) by the GPT init
        nn.init.zeros_(self.proj.bias)
        self.mix = nn.Parameter(torch.zeros(channels))  # c
        self.beta_raw = nn.Parameter(torch.tensor(math.log(math.e - 1)))  # softplus(beta_raw) = 1

    def forward(self, r):
        p = torch.sigmoid(upcast(self.proj(r))) @ torch.softmax(upcast(self.mix), dim=0)
        return p.unsqueeze(-1) ** F.softplus(upcast(self.beta_raw))


class NAG(nn.Module):
    """Norm-agnostic residual: the stream is a unit-RMS direction r and a log-norm s per token
    (x = e^s r). Sublayers only rotate r, by arctan(a) with a = alpha_l m_l(r); s only grows."""
    embed_std = 1.0  # so e^s starts near 1; with 0.02 the logits would start 50x too small

    def __init__(self, config):
        super().__init__()
        n, d = config.n_sublayers, config.n_embd
        self.alpha = nn.Parameter(torch.tensor([1 / math.sqrt(l) for l in range(1, n + 1)]))
        self.modulators = nn.ModuleList(Modulator(d, config.nag_channels) for _ in range(n))
        self.g_enc = nn.Parameter(torch.zeros(()))
        self.g_dec = nn.Parameter(torch.zeros(()))
        self.impl = config.kernels

    def embed(self, e):
        e = upcast(e)
        e = e - e.mean(-1, keepdim=True)  # mean-centred rows
        rms = e.square().mean(-1, keepdim=True).sqrt()
        return e / rms, torch.log(rms) + self.g_enc

    def read(self, state, l):
        return state[0]

    def tangent(self, r, l):
        return self.alpha[l] * self.modulators[l](r)

    def write(self, state, l, out):
        r, s = state
        r, log_gain = nag_update(r, out, self.tangent(r, l), impl=self.impl)
        return r, s + log_gain

    def head(self, state, lm_head):
        r, s = state
        w = lm_head.weight
        w = w - w.mean(-1, keepdim=True)
        w = w * torch.rsqrt(w.square().mean(-1, keepdim=True) + 1e-6)  # unit-RMS rows, not in place
        return torch.exp(s + self.g_dec) * F.linear(r, w) / math.sqrt(r.size(-1))

    def value(self, state, l):
        r, s = state
        return torch.exp(s) * r

    def stats(self, state, l):
        if l >= len(self.modulators):
            return {}
        m = self.modulators[l](state[0])
        a = self.alpha[l] * m
        return {"alpha": self.alpha[l].item(), "m": m.mean().item(), "angle": torch.atan(a).mean().item()}


class BlockAttnRes(nn.Module):
    """Attention Residuals over blocks: sublayers are grouped into blocks of S consecutive ones;
    a block's summary b_n is the sum of its sublayers' raw outputs and b_0 is the embedding.
    Sublayer l reads a softmax-over-depth mix of the finished blocks and the running partial sum
    of its own block, through its own pre-norm. One block per sublayer is full AttnRes."""
    embed_std = 0.02

    def __init__(self, config):
        super().__init__()
        n, d = config.n_sublayers, config.n_embd
        self.block_size = config.depth_block_size
        # a pseudo-query (init 0: a uniform average) and key norm for sublayers 1..2L-1 and the head
        # (index l-1); sublayer 0 has only the embedding to read, so nothing to learn there
        self.queries = nn.ParameterList(nn.Parameter(torch.zeros(d)) for _ in range(n))
        self.key_norms = nn.ModuleList(RMSNorm(d, config.kernels) for _ in range(n))
        self.norms = nn.ModuleList(RMSNorm(d, config.kernels) for _ in range(n))
        self.norm_f = RMSNorm(d, config.kernels)
        self.impl = config.kernels

    def embed(self, e):
        return [e], None  # finished blocks, partial sum of the current block

    def sources(self, state):
        blocks, partial = state
        return blocks if partial is None else blocks + [partial]

    def depth_inputs(self, state, l):
        """(sources [S, ..., d], query, key-norm weight) that sublayer l (l = 2L: the head) mixes."""
        return torch.stack(self.sources(state)), self.queries[l - 1], self.key_norms[l - 1].weight

    def value(self, state, l):
        """The depth mix sublayer l reads (sublayer 0: the embedding, its only source)."""
        if l == 0:
            return state[0][0]
        return depth_attention(*self.depth_inputs(state, l), impl=self.impl)

    def read(self, state, l):
        return self.norms[l](self.value(state, l))

    def write(self, state, l, out):
        blocks, partial = state
        partial = out if partial is None else partial + out
        if (l + 1) % self.block_size == 0 or l + 1 == len(self.norms):
            return blocks + [partial], None
        return blocks, partial

    def head(self, state, lm_head):
        return lm_head(self.norm_f(self.value(state, len(self.norms))))

    def stats(self, state, l):
        if l == 0:
            return {}
        weights = torch.softmax(depth_scores(*self.depth_inputs(state, l)), dim=0)
        return {"depth_weights": weights.float().flatten(1).mean(1).tolist()}


RESIDUALS = {
    "prenorm": PreNorm,
    "sandwich": Sandwich,
    "nag": NAG,
    "attnres": BlockAttnRes,
    "block_attnres": BlockAttnRes,
}



# -----------------------------------------------------------------------------
# the model

class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        config.__post_init__()
        self.config = config
        V, d = config.padded_vocab_size, config.n_embd
        self.wte = nn.Embedding(V, d)
        self.drop = nn.Dropout(config.dropout)
        # sublayers l = 0..2L-1 alternate attention and MLP (SPEC numbers them 1..2L)
        self.sublayers = nn.ModuleList(
            CausalSelfAttention(config) if l % 2 == 0 else MLP(config) for l in range(config.n_sublayers))
        self.stream = RESIDUALS[config.residual](config)
        self.lm_head = nn.Linear(d, V, bias=False)
        self.register_buffer("rope", rope_table(d // config.n_head, config.block_size), persistent=False)

        self.apply(self._init_weights)
        # scaled init of each sublayer's output projection (GPT-2 / nanoGPT)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(config.n_sublayers))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=self.stream.embed_std)

    def get_num_params(self, non_embedding=True):
        """Parameter count. The token embedding is a lookup (no FLOPs), so non_embedding leaves
        it out; the untied LM head is a real matmul and stays in."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.wte.weight.numel()
        return n

    def forward(self, idx, targets=None):
        B, T = idx.size()
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        rope = self.rope[:T]
        state = self.stream.embed(self.drop(self.wte(idx)))
        for l, f in enumerate(self.sublayers):
            state = self.stream.write(state, l, f(self.stream.read(state, l), rope))
        if targets is None:
            # inference: only the last position's logits are needed
            state = _last_position(state)
        logits = self.stream.head(state, self.lm_head)[..., :self.config.vocab_size]
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1),
                                   ignore_index=-1)
        return logits, loss

    @torch.no_grad()
    def diagnostics(self, idx):
        """Per sublayer l: the RMS of the stream entering it (nag: e^s), the relative size of its update
        ||x_{l+1} - x_l|| / ||x_l||, and the mode's own figures (nag: alpha, mean m, mean rotation angle;
        attnres: depth weights over its sources, averaged over tokens). For attnres the "stream" is the
        depth mix a sublayer reads."""
        T = idx.size(1)
        rope = self.rope[:T]
        state = self.stream.embed(self.wte(idx))
        rows = []
        for l, f in enumerate(self.sublayers):
            x_in = self.stream.value(state, l).float()
            row = {"sublayer": l + 1, "kind": "attn" if l % 2 == 0 else "mlp",
                   "rms": x_in.square().mean().sqrt().item()}
            row.update(self.stream.stats(state, l))
            state = self.stream.write(state, l, f(self.stream.read(state, l), rope))
            x_out = self.stream.value(state, l + 1).float()
            row["update"] = ((x_out - x_in).norm(dim=-1) / x_in.norm(dim=-1)).mean().item()
            rows.append(row)
        head = self.stream.value(state, len(self.sublayers)).float()
        rows.append({"sublayer": len(self.sublayers) + 1, "kind": "head", "rms": head.square().mean().sqrt().item(),
                     **self.stream.stats(state, len(self.sublayers))})
        return rows

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        # weight decay on matrices and embeddings (>= 2-D); none on norms, gains and scalars
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        # fused on GPU; the multi-tensor (foreach) path on CPU is ~5% faster per step for small models
        fused = device_type == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas,
                                 **({"fused": True} if fused else {"foreach": True}))

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        """Sample max_new_tokens after idx (LongTensor [B, T]); the context is cropped to block_size."""
        for _ in range(max_new_tokens):
            idx_cond = idx if idx.size(1) <= self.config.block_size else idx[:, -self.config.block_size:]
            logits, _ = self(idx_cond)
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
        return idx


def _last_position(state):
    """Keep only the last token of every tensor in a stream state (a tensor or a tuple/list of them)."""
    if state is None or torch.is_tensor(state):
        return state if state is None else state[:, [-1]]
    return type(state)(_last_position(s) for s in state)
