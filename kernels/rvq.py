"""A residual VQ's codebook lookups and their sum in one launch: out[b, t] = Σ_g table[g, codes[b, g, t]].

The codec's quantizer made one gather per codebook and one add per codebook after the first (16 gathers and 14
adds a frame: 30 of the frame's ~300 launches). Here one program per (position, batch row) reads its n codes and
the n rows of the stacked tables, adding in codebook order and rounding each add to the tables' dtype as torch's
add of two tensors of that dtype does (`reference.rvq_sum_ref`: the same bits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._cast import cast
from ._launch import device_guard


@triton.jit
def _row(codes, table_ptr, g, d, d_ok, size, stride_cn, stride_tn, stride_ts):
    """[BLOCK_D] fp32: codebook g's row at this program's code (a code out of range reads zeros, never outside)."""
    code = tl.load(codes + g * stride_cn).to(tl.int64)
    ok = d_ok & (code >= 0) & (code < size)
    return tl.load(table_ptr + g * stride_tn + code * stride_ts + d, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _rvq_sum_kernel(codes_ptr, table_ptr, out_ptr, size, dim, stride_cb, stride_cn, stride_ct, stride_tn,
                    stride_ts, stride_ob, stride_ot, N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (position t, batch row b): the sum of table[g, codes[b, g, t]] over the N codebooks, rounded after each
    add. The loop is unrolled (N constexpr): the N code and row loads do not wait on each other, only the adds do."""
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < dim
    codes = codes_ptr + b * stride_cb + t * stride_ct
    total = _row(codes, table_ptr, 0, d, d_ok, size, stride_cn, stride_tn, stride_ts)
    for g in tl.static_range(1, N):
        row = _row(codes, table_ptr, g, d, d_ok, size, stride_cn, stride_tn, stride_ts)
        total = cast(total + row, out_ptr.dtype.element_ty).to(tl.float32)  # rounded as a torch add rounds
    tl.store(out_ptr + b * stride_ob + t * stride_ot + d, cast(total, out_ptr.dtype.element_ty), mask=d_ok)


def rvq_sum(codes: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """codes [B, n, T] (int, 0 <= code < size) and tables [n, size, dim] (rows contiguous) -> [B, T, dim] in the
    tables' dtype: Σ_g tables[g][codes[:, g]], in codebook order, each add rounded (`reference.rvq_sum_ref`)."""
    bsz, n, length = codes.shape
    assert tables.shape[0] == n, f"{n} code rows for {tables.shape[0]} codebooks"
    assert tables.stride(-1) == 1, "each codebook row must be contiguous"
    _, size, dim = tables.shape
    out = torch.empty(bsz, length, dim, dtype=tables.dtype, device=tables.device)
    if out.numel():
        with device_guard(tables):
            _rvq_sum_kernel[(length, bsz)](codes, tables, out, size, dim, codes.stride(0), codes.stride(1),
                                           codes.stride(2), tables.stride(0), tables.stride(1), out.stride(0),
                                           out.stride(1), N=n, BLOCK_D=triton.next_power_of_2(dim), num_warps=1)
    return out
