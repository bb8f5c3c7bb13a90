"""rotate_half RoPE on q [N, NH, D] and k [N, KVH, D], cos/sin gathered in-kernel by position; optionally after
the QK-norm (RMSNorm over head_dim) of each head, in the same launch.

The tables are [max_pos, D] in the cat(freqs, freqs) layout of `rotary_ref`; reading them by
`positions` inside the kernel keeps the launch graph-safe (no host-side indexing). When the table
dtype equals the activation dtype, each product is rounded to that dtype before the add, exactly as
the eager bf16 `x * cos + rotate_half(x) * sin` does (the official model applies rotary in the model
dtype).

With `norm` (q and k weights [D], eps) each head is first normalised as `rms_norm_ref` does (fp32 statistics,
the normalised value rounded to the activation dtype, then times the weight, rounded again), so the model's
q-norm, k-norm and RoPE are one launch instead of three.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._cast import cast
from ._launch import device_guard
from .reference import QKNorm
from .rmsnorm import normalized


@triton.jit
def _rotate_heads(src_ptr, dst_ptr, w_ptr, eps, c1, c2, s1, s2, heads, cols, mask, stride_h,
                  HALF: tl.constexpr, ROUND: tl.constexpr, NORM: tl.constexpr):
    offs = heads[:, None] * stride_h + cols[None, :]
    x1 = tl.load(src_ptr + offs, mask=mask, other=0.0)  # [BLOCK_H, BLOCK_HALF] each half of every head
    x2 = tl.load(src_ptr + offs + HALF, mask=mask, other=0.0)
    if NORM:  # QK-norm first: RMSNorm over the head's two halves
        x1, x2 = _norm_halves(x1, x2, w_ptr, eps, cols, HALF)
    a1 = x1.to(tl.float32) * c1
    b1 = x2.to(tl.float32) * s1
    a2 = x2.to(tl.float32) * c2
    b2 = x1.to(tl.float32) * s2
    if ROUND:  # round each product to the activation dtype, like eager low-precision math
        a1 = cast(a1, x1.dtype).to(tl.float32)
        b1 = cast(b1, x1.dtype).to(tl.float32)
        a2 = cast(a2, x1.dtype).to(tl.float32)
        b2 = cast(b2, x1.dtype).to(tl.float32)
    ty = dst_ptr.dtype.element_ty
    tl.store(dst_ptr + offs, cast(a1 - b1, ty), mask=mask)
    tl.store(dst_ptr + offs + HALF, cast(a2 + b2, ty), mask=mask)


@triton.jit
def _norm_halves(x1, x2, w_ptr, eps, cols, HALF: tl.constexpr):
    """RMSNorm of the heads whose halves are x1, x2 [BLOCK_H, BLOCK_HALF] (masked columns 0) by the weight
    [2 HALF]: `rms_norm_ref`'s roundings, in x1's dtype."""
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    sum_sq = tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)  # [BLOCK_H]
    cmask = cols < HALF
    w1 = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + HALF + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    n1 = normalized(f1, sum_sq, w1, eps, 2 * HALF, x1.dtype)
    n2 = normalized(f2, sum_sq, w2, eps, 2 * HALF, x1.dtype)
    return cast(n1, x1.dtype), cast(n2, x1.dtype)


@triton.jit
def _rotary_kernel(
    # pointers
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr,
    eps,
    # strides
    stride_pos,  # positions may be a strided column of the engine's row metadata
    stride_qn, stride_qh, stride_kn, stride_kh,
    stride_qon, stride_qoh, stride_kon, stride_koh,
    stride_cos, stride_sin,
    # meta
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
    ROUND: tl.constexpr, NORM: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + n * stride_pos).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    cmask = cols < HALF
    c1 = tl.load(cos_ptr + pos * stride_cos + cols, mask=cmask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + pos * stride_cos + HALF + cols, mask=cmask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + pos * stride_sin + cols, mask=cmask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + pos * stride_sin + HALF + cols, mask=cmask, other=0.0).to(tl.float32)
    c1, c2, s1, s2 = c1[None, :], c2[None, :], s1[None, :], s2[None, :]
    hq = tl.arange(0, BLOCK_HQ)
    _rotate_heads(q_ptr + n * stride_qn, q_out_ptr + n * stride_qon, qw_ptr, eps, c1, c2, s1, s2, hq, cols,
                  (hq < NUM_Q_HEADS)[:, None] & cmask[None, :], stride_qh, HALF, ROUND, NORM)
    # NOTE: in place, src and dst strides are equal (the wrapper passes the same tensor)
    hk = tl.arange(0, BLOCK_HK)
    _rotate_heads(k_ptr + n * stride_kn, k_out_ptr + n * stride_kon, kw_ptr, eps, c1, c2, s1, s2, hk, cols,
                  (hk < NUM_K_HEADS)[:, None] & cmask[None, :], stride_kh, HALF, ROUND, NORM)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, inplace: bool = False, norm: QKNorm | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """rotate_half RoPE of q [N, NH, D] and k [N, KVH, D] at positions [N] (int), after their QK-norm
    when `norm` is given (weights [D] in q's dtype).

    cos, sin: [max_pos, D] tables (cat(freqs, freqs) layout, any float dtype, last dim
    contiguous). Returns (q_rot, k_rot) in q/k's dtypes: new contiguous tensors, or q and k
    themselves when inplace.
    """
    n, num_q, dim = q.shape
    assert k.dim() == 3 and k.shape[0] == n and k.shape[2] == dim, \
        f"k {tuple(k.shape)} does not match q {tuple(q.shape)}"
    assert k.dtype == q.dtype, f"k dtype {k.dtype} != q dtype {q.dtype}"
    assert dim % 2 == 0, f"head_dim {dim} must be even"
    assert positions.shape == (n,) and not positions.is_floating_point(), \
        f"positions must be int [{n}], got {positions.dtype} {tuple(positions.shape)}"
    assert cos.shape == sin.shape and cos.dim() == 2 and cos.shape[1] == dim, \
        f"cos/sin tables must be [max_pos, {dim}], got {tuple(cos.shape)}/{tuple(sin.shape)}"
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        assert t.stride(-1) == 1, f"{name}: last dim must be contiguous"
        assert t.device == q.device, f"{name} on {t.device}, q on {q.device}"
    if norm is not None:
        for name, w in (("q norm weight", norm.q_weight), ("k norm weight", norm.k_weight)):
            assert w.shape == (dim,) and w.dtype == q.dtype and w.device == q.device and w.stride(0) == 1, \
                f"{name}: {w.dtype} {tuple(w.shape)} on {w.device}, must be contiguous {q.dtype} [{dim}] on {q.device}"
    q_out = q if inplace else torch.empty_like(q, memory_format=torch.contiguous_format)
    k_out = k if inplace else torch.empty_like(k, memory_format=torch.contiguous_format)
    if n == 0:
        return q_out, k_out
    half = dim // 2
    # exact eager parity needs products rounded to the table/activation dtype when they agree
    round_products = q.dtype == cos.dtype and q.dtype != torch.float32
    num_warps = 4 if num_q * half >= 1024 else 2
    with device_guard(q):
        _rotary_kernel[(n,)](
            q, k, q_out, k_out, positions, cos, sin,
            *((norm.q_weight, norm.k_weight, norm.eps) if norm is not None else (cos, cos, 0.0)),
            positions.stride(0),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
            cos.stride(0), sin.stride(0),
            NUM_Q_HEADS=num_q, NUM_K_HEADS=k.shape[1], HALF=half,
            BLOCK_HQ=triton.next_power_of_2(num_q), BLOCK_HK=triton.next_power_of_2(k.shape[1]),
            BLOCK_HALF=triton.next_power_of_2(half), ROUND=round_products, NORM=norm is not None,
            num_warps=num_warps,
        )
    return q_out, k_out
