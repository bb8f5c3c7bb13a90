"""The codec transformer's attention for one new frame per stream, over a ring of the stream's keys.

The codec decoder's transformer (codec/decoder.py `Attention`) keeps each stream's last W = sliding_window
keys and values in a ring: position p in row p % W of k_ring / v_ring [B, W, KVH, D]. A frame at position
`pos` sees positions pos - W + 1 .. pos that exist (>= 0), which are exactly the W rows once its own key and
value sit in row pos % W. The rings may hold more streams than the call: stream b's ring is ring row
`rows[b]` (the streaming decoder's pool, read and written in place). One program per (stream, head): it loads the W rows of its kv head, takes the new
key and value for row pos % W from k / v (not from memory), softmax in fp32, one rounding of the output;
the first head of each kv group stores the new key and value into the ring. Per layer this one launch
replaces two copies of the whole window (concatenating past and new keys, and values), the mask and the
SDPA launch: at 64 streams the window is 9.3 MB per layer and per tensor.
Rows are summed in ring order, not position order, so the output differs from the reference's position-
ordered softmax by rounding only. Batch-invariant by construction (one program per row and head).
Torch reference: `reference.ring_attention_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._cast import cast
from ._launch import device_guard


@triton.jit
def _ring_attention_kernel(
    q_ptr, k_ptr, v_ptr, kr_ptr, vr_ptr, rows_ptr, pos_ptr, out_ptr, scale, stride_rows, stride_pos,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
    stride_krb, stride_krr, stride_krh, stride_vrb, stride_vrr, stride_vrh, stride_ob, stride_oh,
    WINDOW: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    kvh = h // GROUP
    ring = tl.load(rows_ptr + b * stride_rows)  # this stream's ring (int64; the engine passes strided columns)
    d = tl.arange(0, BLOCK_D)
    r = tl.arange(0, BLOCK_R)  # ring rows
    d_ok = d < HEAD_DIM
    pos = tl.load(pos_ptr + b * stride_pos)
    own = pos % WINDOW  # this frame's row
    back = ((pos - r) % WINDOW + WINDOW) % WINDOW  # row r holds position pos - back (C remainder: made >= 0)
    valid = (r < WINDOW) & (pos - back >= 0)
    k_new = tl.load(k_ptr + b * stride_kb + kvh * stride_kh + d, mask=d_ok, other=0.0)  # [BLOCK_D]
    v_new = tl.load(v_ptr + b * stride_vb + kvh * stride_vh + d, mask=d_ok, other=0.0)
    tile = valid[:, None] & d_ok[None, :]
    keys = tl.load(kr_ptr + ring * stride_krb + r[:, None] * stride_krr + kvh * stride_krh + d[None, :], mask=tile,
                   other=0.0)  # [BLOCK_R, BLOCK_D]
    vals = tl.load(vr_ptr + ring * stride_vrb + r[:, None] * stride_vrr + kvh * stride_vrh + d[None, :], mask=tile,
                   other=0.0)
    is_own = (r == own)[:, None]
    keys = tl.where(is_own, k_new[None, :], keys).to(tl.float32)
    vals = tl.where(is_own, v_new[None, :], vals).to(tl.float32)
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + d, mask=d_ok, other=0.0).to(tl.float32)
    s = tl.where(valid, tl.sum(keys * q[None, :], axis=1) * scale, float("-inf"))  # [BLOCK_R]
    p = tl.exp(s - tl.max(s, axis=0))  # the own row is always valid: the max is finite
    out = tl.sum(p[:, None] * vals, axis=0) / tl.sum(p, axis=0)  # [BLOCK_D]
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, cast(out, out_ptr.dtype.element_ty), mask=d_ok)
    if h % GROUP == 0:
        tl.store(kr_ptr + ring * stride_krb + own * stride_krr + kvh * stride_krh + d, k_new, mask=d_ok)
        tl.store(vr_ptr + ring * stride_vrb + own * stride_vrr + kvh * stride_vrh + d, v_new, mask=d_ok)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_ring: torch.Tensor, v_ring: torch.Tensor,
                   rows: torch.Tensor, pos: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of q [B, H, D] at positions pos [B] (int64) over the rings k_ring / v_ring [N, W, KVH, D]
    (stream b's ring at rows[b], int64; position p in ring row p % W) with this frame's k, v [B, KVH, D]
    written into ring row pos % W -> [B, H, D] in q.dtype. The last dims of all tensors must be contiguous;
    the rings may be strided views. Streams sharing a ring (padding rows) leave junk in it."""
    bsz, heads, head_dim = q.shape
    window, kv_heads = k_ring.shape[1], k_ring.shape[2]
    assert k.shape == v.shape == (bsz, kv_heads, head_dim) and v_ring.shape == k_ring.shape, \
        f"k, v {tuple(k.shape)}, rings {tuple(k_ring.shape)} do not fit q {tuple(q.shape)}"
    assert heads % kv_heads == 0 and pos.shape == rows.shape == (bsz,) and pos.dtype == rows.dtype == torch.int64
    assert all(t.stride(-1) == 1 for t in (q, k, v, k_ring, v_ring)), "last dims must be contiguous"
    out = torch.empty_like(q)
    if bsz:
        with device_guard(q):
            _ring_attention_kernel[(bsz, heads)](
                q, k, v, k_ring, v_ring, rows, pos, out, scale, rows.stride(0), pos.stride(0),
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                k_ring.stride(0), k_ring.stride(1), k_ring.stride(2), v_ring.stride(0), v_ring.stride(1),
                v_ring.stride(2), out.stride(0), out.stride(1),
                WINDOW=window, HEAD_DIM=head_dim, GROUP=heads // kv_heads,
                BLOCK_R=triton.next_power_of_2(window), BLOCK_D=triton.next_power_of_2(head_dim), num_warps=4,
            )
    return out
