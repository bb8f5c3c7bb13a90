"""SnakeBeta activation of the codec decoder in one pass: x + sin(x·e^α)² / (e^β + 1e-9).

x [B, C, T] (time contiguous), α and β [C] log-parameters. Computed in fp32 and rounded once; the torch
reference rounds after every elementwise op in low precision (seven kernels in bf16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._cast import cast
from .autotune import device_guard


@triton.jit
def _snake_kernel(x_ptr, alpha_ptr, beta_ptr, out_ptr, channels, length, stride_xb, stride_xc,
                  BLOCK_T: tl.constexpr):
    row = tl.program_id(0)  # b * channels + c (grid dim 0: up to 2^31 rows)
    c = row % channels
    x_row = (row // channels).to(tl.int64) * stride_xb + c * stride_xc
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask = t < length
    x = tl.load(x_ptr + x_row + t, mask=mask, other=0.0).to(tl.float32)
    alpha = tl.exp(tl.load(alpha_ptr + c).to(tl.float32))
    inv_beta = 1.0 / (tl.exp(tl.load(beta_ptr + c).to(tl.float32)) + 1e-9)
    s = tl.sin(x * alpha)
    tl.store(out_ptr + row.to(tl.int64) * length + t, cast(x + inv_beta * s * s, out_ptr.dtype.element_ty),
             mask=mask)


def snake_beta(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """SnakeBeta of x [B, C, T] with per-channel log-parameters alpha, beta [C] -> contiguous [B, C, T]."""
    bsz, channels, length = x.shape
    assert alpha.shape == (channels,) and beta.shape == (channels,), "alpha/beta must be [C]"
    assert x.stride(-1) == 1, "x's time dim must be contiguous"
    out = torch.empty(bsz, channels, length, dtype=x.dtype, device=x.device)
    block_t = min(1024, max(16, triton.next_power_of_2(length)))
    grid = (bsz * channels, triton.cdiv(length, block_t))
    if out.numel():
        with device_guard(x):
            _snake_kernel[grid](x, alpha, beta, out, channels, length, x.stride(0), x.stride(1),
                                BLOCK_T=block_t, num_warps=4 if block_t >= 512 else 1)
    return out
