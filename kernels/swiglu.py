"""SwiGLU's gate: silu(gate) * up from the fused gate|up projection, in one pass.

The eager MLP ran it as two elementwise launches (F.silu, then the product), writing and re-reading the
silu in between. Numerics of `silu_mul_ref`: silu in fp32 rounded to the activation dtype (as eager
F.silu rounds it), then the product in fp32 rounded to the output dtype. One program per
(row, BLOCK columns): a row's result depends on nothing else in the launch (batch-invariant).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._cast import cast
from ._launch import device_guard

_BLOCK = 1024  # columns per program


@triton.jit
def silu_times(gate, up, DT: tl.constexpr):
    """silu(gate) rounded to DT, times up, in fp32 (gate, up: fp32 holding DT values): the eager SwiGLU's
    numerics, shared with the code predictor's gate_up GEMM epilogue."""
    silu = cast(gate / (1.0 + tl.exp(-gate)), DT).to(tl.float32)
    return silu * up


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)  # [BLOCK]
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0)
    y = silu_times(gate.to(tl.float32), up.to(tl.float32), gate.dtype)
    tl.store(out_ptr + row * stride_out + cols, cast(y, out_ptr.dtype.element_ty), mask=mask)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] (gate | up, last dim contiguous) -> silu(gate) * up, a new contiguous [..., I] tensor in
    x's dtype."""
    assert x.shape[-1] % 2 == 0, f"x must be [..., 2I], got {tuple(x.shape)}"
    assert x.is_floating_point() and x.stride(-1) == 1, "x: floating point, last dim contiguous"
    inter = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * inter)  # [N, 2I] (a view for the projection's contiguous output)
    out = torch.empty(rows.shape[0], inter, dtype=x.dtype, device=x.device)
    if out.numel():
        with device_guard(x):
            _silu_mul_kernel[(rows.shape[0], triton.cdiv(inter, _BLOCK))](
                rows, out, inter, rows.stride(0), out.stride(0), BLOCK=_BLOCK, num_warps=4)
    return out.view(*x.shape[:-1], inter)
