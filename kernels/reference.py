"""Torch references for every kernel in `q3tts.kernels`: the CPU path and the tests' ground truth.

Numerics follow the official model: RMSNorm statistics in fp32, result cast to the input
dtype before the weight multiply; softmax in fp32.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch.nn import functional as F


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 dtype: torch.dtype | None = None) -> torch.Tensor:
    """RMSNorm over the last dim. x: [..., D], weight: [D] -> [..., D]: the normalised value rounded to
    `dtype` (default x.dtype), then times the weight (in promote(dtype, weight.dtype))."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(dtype or x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables for integer `positions` [...] -> cos, sin [..., head_dim] (cat(freqs, freqs) layout).

    inv_freq and the angles in fp32 exactly as the official rotary embeddings, then cast to `dtype`
    (talker, code predictor and codec all use this)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float()
    inv_freq = 1.0 / (theta ** (exponents / head_dim))  # [D/2]
    freqs = positions.float()[..., None] * inv_freq  # [..., D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [..., D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate of x [..., 2I] = gate | up -> silu(gate) * up [..., I] (eager: two roundings)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rotate_half RoPE. x: [T, H, D]; cos, sin: [T, D] (cat(freqs, freqs) layout) -> [T, H, D]."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Scatter new keys/values into a paged cache, skipping slot -1 (padding rows).

    k, v: [N, KVH, D]; k_cache, v_cache: [num_pages, page_size, KVH, D]; slot_mapping: [N] int
    (slot = page * page_size + offset).
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep].to(v_cache.dtype)


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """One query token per sequence attending over its paged context (GQA).

    q: [B, NH, D]; k_cache, v_cache: [num_pages, page_size, KVH, D]; block_tables: [B, max_pages] int
    (page ids, unused entries any valid id); context_lens: [B] int (keys visible, incl. the new one).
    Returns [B, NH, D] in q.dtype. Rows with context_len 0 return zeros.
    """
    bsz, num_heads, head_dim = q.shape
    page_size, num_kv = k_cache.shape[1], k_cache.shape[2]
    max_pages = block_tables.shape[1]
    # [B, max_pages * page_size, KVH, D]
    keys = k_cache[block_tables.long()].reshape(bsz, max_pages * page_size, num_kv, head_dim)
    values = v_cache[block_tables.long()].reshape(bsz, max_pages * page_size, num_kv, head_dim)
    group = num_heads // num_kv
    keys = keys.repeat_interleave(group, dim=2)  # [B, S, NH, D]
    values = values.repeat_interleave(group, dim=2)
    scores = torch.einsum("bhd,bshd->bhs", q.float(), keys.float()) * scale  # [B, NH, S]
    pos = torch.arange(keys.shape[1], device=q.device)
    mask = pos[None, :] < context_lens[:, None].long()  # [B, S]
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = torch.einsum("bhs,bshd->bhd", probs, values.float())
    return out.to(q.dtype)


def causal_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal GQA attention over one sequence's tokens, as the official eager attention.

    q: [N, NH, D]; k, v: [M, KVH, D] with M >= N -> [N, NH, D]. The queries are the last N of the M
    tokens (M > N: a prefill piece after M - N earlier rows), so query i sees keys 0..M-N+i. Scores and
    value product in the input dtype, softmax in fp32 with the probabilities cast back to the input dtype.
    """
    n, num_heads, _ = q.shape
    m = k.shape[0]
    group = num_heads // k.shape[1]
    keys = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [NH, M, D]
    values = v.repeat_interleave(group, dim=1).transpose(0, 1)  # [NH, M, D]
    scores = torch.matmul(q.transpose(0, 1), keys.transpose(1, 2)) * scale  # [NH, N, M]
    future = torch.ones(n, m, dtype=torch.bool, device=q.device).triu(1 + m - n)
    scores = scores.masked_fill(future, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, values).transpose(0, 1)  # [N, NH, D]


class PagedPrefix(NamedTuple):
    """Chunked prefill: the first `length` keys of packed sequence 0, already in a paged cache.

    k_cache, v_cache: [num_pages, page_size, KVH, D] (one layer); block_table: [max_pages] int, the
    sequence's page ids in order; length: [1] int (P, 0 = no prefix) on the device."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    length: torch.Tensor


def prefill_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                          scale: float, prefix: PagedPrefix | None = None) -> torch.Tensor:
    """`causal_attention_ref` within each of S sequences packed back to back (block-diagonal causal).

    q: [T, NH, D]; k, v: [T, KVH, D]; cu_seqlens: [S+1] int, sequence i = rows cu[i]..cu[i+1]-1,
    rows >= cu[S] are padding (zeros here; the kernel never writes them). prefix: sequence 0's rows
    come after P keys in a paged cache, which they also attend to. Returns [T, NH, D].
    """
    out = q.new_zeros(q.shape)
    bounds = [int(b) for b in cu_seqlens.tolist()]
    for i, (start, end) in enumerate(zip(bounds, bounds[1:])):
        keys, values = k[start:end], v[start:end]
        if i == 0 and prefix is not None and end > start:
            positions = torch.arange(int(prefix.length.reshape(())), device=q.device)
            page_size = prefix.k_cache.shape[1]
            slots = prefix.block_table.long()[positions // page_size] * page_size + positions % page_size
            keys = torch.cat((prefix.k_cache.flatten(0, 1)[slots], keys))
            values = torch.cat((prefix.v_cache.flatten(0, 1)[slots], values))
        out[start:end] = causal_attention_ref(q[start:end], keys, values, scale)
    return out


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + RMSNorm: h = x + residual in residual's dtype (x.dtype, or float32 for a
    residual stream kept in fp32) -> (rms_norm_ref of h rounded to x.dtype, h)."""
    hidden = (x + residual).to(residual.dtype)
    return rms_norm_ref(hidden, weight, eps, x.dtype), hidden


class QKNorm(NamedTuple):
    """The QK-norm before RoPE (`apply_rotary(norm=...)`): RMSNorm weights [D] of q's and k's heads, and eps."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float


def apply_rotary_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, norm: QKNorm | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of q [N, NH, D] and k [N, KVH, D] at positions [N], gathering rows of the cos/sin
    tables [max_pos, D]; with `norm`, of their QK-norms (`rms_norm_ref` per head). Returns (q_rot, k_rot)
    in q/k's dtypes (the norm's: promote(q.dtype, weight dtype))."""
    if norm is not None:
        q, k = rms_norm_ref(q, norm.q_weight, norm.eps), rms_norm_ref(k, norm.k_weight, norm.eps)
    pos = positions.long()
    cos_t, sin_t = cos[pos], sin[pos]  # [N, D]
    return rotary_ref(q, cos_t, sin_t).to(q.dtype), rotary_ref(k, cos_t, sin_t).to(k.dtype)


def ring_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_ring: torch.Tensor,
                       v_ring: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor, scale: float) -> torch.Tensor:
    """`ring_attention`: q [B, H, D] at positions pos [B] over the rings [N, W, KVH, D] at rows [B] (position p
    in ring row p % W) after k, v [B, KVH, D] are written into ring row pos % W (in place) -> [B, H, D];
    softmax in fp32."""
    window = k_ring.shape[1]
    k_ring[rows, pos % window] = k
    v_ring[rows, pos % window] = v
    held = pos[:, None] - (pos[:, None] - torch.arange(window, device=q.device)) % window  # [B, W] positions
    group = q.shape[1] // k.shape[1]
    keys, vals = (t[rows].repeat_interleave(group, dim=2).float() for t in (k_ring, v_ring))  # [B, W, H, D]
    scores = torch.einsum("bhd,bwhd->bhw", q.float(), keys) * scale
    scores = scores.masked_fill((held < 0)[:, None, :], float("-inf"))
    return torch.einsum("bhw,bwhd->bhd", scores.softmax(-1), vals).to(q.dtype)


def causal_conv1d_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dilation: int = 1,
                      residual: torch.Tensor | None = None) -> torch.Tensor:
    """Valid conv1d of x [B, C_in, L] (causal history included) with weight [C_out, C_in, K] and bias
    [C_out] -> [B, C_out, L - (K-1)·dilation], plus residual (that shape) when given."""
    out = torch.nn.functional.conv1d(x, weight, bias, dilation=dilation)
    return out if residual is None else residual + out


def interleave_phases(y: torch.Tensor, phases: int) -> torch.Tensor:
    """A transposed conv run as a conv, y [B, C·phases, T] (channel o·phases + r = phase r of channel o), with its
    phases interleaved in time -> [B, C, T·phases] (position t·phases + r); a copy unless phases is 1."""
    if phases == 1:
        return y
    b, c, t = y.shape
    return y.view(b, c // phases, phases, t).transpose(2, 3).reshape(b, -1, t * phases)


def rvq_sum_ref(codes: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """A residual VQ's lookups summed: codes [B, n, T], tables [n, size, dim] -> [B, T, dim], Σ_g tables[g][codes[:,
    g]] in codebook order, one torch add (rounded to the tables' dtype) per codebook after the first."""
    total = tables[0][codes[:, 0]]
    for g in range(1, tables.shape[0]):
        total = total + tables[g][codes[:, g]]
    return total


def scatter_rows_ref(dsts: Sequence[torch.Tensor], rows: torch.Tensor, srcs: Sequence[torch.Tensor]) -> None:
    """dsts[i][rows[b]] = srcs[i][b] for each pair (dsts[i] [S, ...], srcs[i] [B, ...]): one `index_copy_` a pair."""
    for dst, src in zip(dsts, srcs):
        dst.index_copy_(0, rows, src)


def snake_beta_ref(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """SnakeBeta `x + sin(x·e^α)² / (e^β + 1e-9)` of x [B, C, T], log-parameters alpha, beta [C]."""
    alpha = torch.exp(alpha[None, :, None])
    beta = torch.exp(beta[None, :, None])
    return x + (1.0 / (beta + 1e-9)) * torch.pow(torch.sin(x * alpha), 2)


# ---------------------------------------------------------------- counter-based uniforms

def to_int64(x: int) -> int:
    """Two's-complement int64 value of a 64-bit unsigned constant."""
    return x - (1 << 64) if x >= 1 << 63 else x


SPLITMIX64 = tuple(to_int64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    golden, mix1, mix2 = SPLITMIX64
    z = x + golden
    z = (z ^ _shr(z, 30)) * mix1
    z = (z ^ _shr(z, 27)) * mix2
    return z ^ _shr(z, 31)


def uniforms_ref(seeds: torch.Tensor, counters: torch.Tensor, lanes: int) -> torch.Tensor:
    """[B, lanes] float32 uniforms in [0, 1) for (seed, counter) pairs (seeds, counters: [B] int): lane l of
    row b is the top 24 bits of splitmix64(splitmix64(seed) ^ (counter * lanes + l)), times 2^-24. int64
    arithmetic wraps as uint64's does, so the bits are the unsigned hash's."""
    lane = torch.arange(lanes, dtype=torch.int64, device=seeds.device)  # [lanes]
    key = _splitmix64(seeds.long())[:, None]  # [B, 1]
    bits = _splitmix64(key ^ (counters.long()[:, None] * lanes + lane))  # [B, lanes]
    return _shr(bits, 40).float() * (1.0 / (1 << 24))
