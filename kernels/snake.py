"""SnakeBeta activation of the codec decoder in one pass: x + sin(x·e^α)² / (e^β + 1e-9).

x [B, C, T] (time contiguous), α and β [C] log-parameters. Computed in fp32 and rounded once; the torch
reference rounds after every elementwise op in low precision (seven kernels in bf16). The output is time-contiguous
or (`channels_last`) stored [B, T, C]: the layout the codec's convs read fastest (kernels/conv1d.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._cast import cast
from ._launch import device_guard
from .autotune import choose


@triton.jit
def snake_values(x, alpha_ptr, beta_ptr, c, c_ok):
    """SnakeBeta of x [BLOCK_C, N] (fp32) at channels c [BLOCK_C] (c_ok: in range), in fp32: the one formula of this
    kernel and of the conv kernel's epilogue (kernels/conv1d.py, `causal_conv1d(snake=)`), hence their same bits."""
    alpha = tl.exp(tl.load(alpha_ptr + c, mask=c_ok, other=0.0).to(tl.float32))
    inv_beta = 1.0 / (tl.exp(tl.load(beta_ptr + c, mask=c_ok, other=0.0).to(tl.float32)) + 1e-9)
    s = tl.sin(x * alpha[:, None])
    return x + inv_beta[:, None] * s * s


@triton.jit
def _snake_kernel(x_ptr, alpha_ptr, beta_ptr, out_ptr, channels, length, stride_xb, stride_xc, stride_ob, stride_oc,
                  stride_ot, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr):
    """Program (channel block, time block, batch row): loads along time, stores along time or channels."""
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    b = tl.program_id(2).to(tl.int64)
    c_ok = c < channels
    mask = c_ok[:, None] & (t < length)[None, :]
    x = tl.load(x_ptr + b * stride_xb + c[:, None] * stride_xc + t[None, :], mask=mask, other=0.0).to(tl.float32)
    out = snake_values(x, alpha_ptr, beta_ptr, c, c_ok)
    tl.store(out_ptr + b * stride_ob + c[:, None] * stride_oc + t[None, :] * stride_ot,
             cast(out, out_ptr.dtype.element_ty), mask=mask)


# positions a channels-last program takes (with 1024 // that channels): 8 channels, 16 bytes stored a position
# (bf16), or 32 channels, 64 bytes; timed per shape on CUDA inside `autotune.tuning()`, the first where untuned
CL_POSITIONS = (128, 32)


def snake_beta(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor, channels_last: bool = False,
               positions: int | None = None) -> torch.Tensor:
    """SnakeBeta of x [B, C, T] with per-channel log-parameters alpha, beta [C] -> [B, C, T], contiguous, or
    (`channels_last`) a view of a contiguous [B, T, C]. positions: a channels-last program's positions (one of
    `CL_POSITIONS`; None: the tuned or first one). Elementwise: every tiling gives the same bits."""
    bsz, channels, length = x.shape
    assert alpha.shape == (channels,) and beta.shape == (channels,), "alpha/beta must be [C]"
    assert x.stride(-1) == 1, "x's time dim must be contiguous"
    if channels_last:
        out = torch.empty(bsz, length, channels, dtype=x.dtype, device=x.device).transpose(1, 2)
    else:
        out = torch.empty(bsz, channels, length, dtype=x.dtype, device=x.device)

    def launch(most: int) -> None:
        # 1024 elements a program: short rows (early stages) many channels each
        block_t = triton.next_power_of_2(min(length, most))
        block_c = min(max(1, 1024 // block_t), triton.next_power_of_2(channels))
        grid = (triton.cdiv(channels, block_c), triton.cdiv(length, block_t), bsz)
        _snake_kernel[grid](x, alpha, beta, out, channels, length, x.stride(0), x.stride(1), out.stride(0),
                            out.stride(1), out.stride(2), BLOCK_C=block_c, BLOCK_T=block_t, num_warps=4)

    if out.numel():
        with device_guard(x):
            if not channels_last:
                launch(1024)
            else:  # `choose` gives the first where it does not tune (off CUDA, outside `tuning()`)
                key = ("snake", tuple(x.shape), x.dtype, "channels_last")
                launch(positions or choose(key, CL_POSITIONS, launch, x.device, default=CL_POSITIONS[0]))
    return out
