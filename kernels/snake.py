"""SnakeBeta activation of the codec decoder in one pass: x + sin(x·e^α)² / (e^β + 1e-9).

x [B, C, T] (time contiguous), α and β [C] log-parameters. Computed in fp32 and rounded once; the torch
reference rounds after every elementwise op in low precision (seven kernels in bf16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._cast import cast
from ._launch import device_guard


@triton.jit
def _snake_kernel(x_ptr, alpha_ptr, beta_ptr, out_ptr, n_rows, channels, length, stride_xb, stride_xc,
                  BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # b * channels + c
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < n_rows
    c = rows % channels
    x_rows = (rows // channels).to(tl.int64) * stride_xb + c * stride_xc
    mask = row_ok[:, None] & (t < length)[None, :]
    x = tl.load(x_ptr + x_rows[:, None] + t[None, :], mask=mask, other=0.0).to(tl.float32)
    alpha = tl.exp(tl.load(alpha_ptr + c, mask=row_ok, other=0.0).to(tl.float32))
    inv_beta = 1.0 / (tl.exp(tl.load(beta_ptr + c, mask=row_ok, other=0.0).to(tl.float32)) + 1e-9)
    s = tl.sin(x * alpha[:, None])
    out = x + inv_beta[:, None] * s * s
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * length + t[None, :], cast(out, out_ptr.dtype.element_ty),
             mask=mask)


def snake_beta(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """SnakeBeta of x [B, C, T] with per-channel log-parameters alpha, beta [C] -> contiguous [B, C, T]."""
    bsz, channels, length = x.shape
    assert alpha.shape == (channels,) and beta.shape == (channels,), "alpha/beta must be [C]"
    assert x.stride(-1) == 1, "x's time dim must be contiguous"
    out = torch.empty(bsz, channels, length, dtype=x.dtype, device=x.device)
    n_rows = bsz * channels
    block_t = triton.next_power_of_2(min(length, 1024))  # short rows (early stages): many per program
    block_r = max(1, 1024 // block_t)
    grid = (triton.cdiv(n_rows, block_r), triton.cdiv(length, block_t))
    if out.numel():
        with device_guard(x):
            _snake_kernel[grid](x, alpha, beta, out, n_rows, channels, length, x.stride(0), x.stride(1),
                                BLOCK_R=block_r, BLOCK_T=block_t, num_warps=4)
    return out
