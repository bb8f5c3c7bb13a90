"""RMSNorm (optionally fused with the residual add) over the last dim; also QK-norm over head_dim.

Numerics of `rms_norm_ref`: statistics in fp32, normalised value rounded to x.dtype, then
the weight multiply (rounded to the promoted dtype, as torch does). The fused residual add rounds
x + residual to the residual's dtype first: x.dtype, like the eager `hidden = hidden + residual`, or
float32 for a residual stream kept in fp32 (the normalised value is still rounded to x.dtype).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._cast import cast
from ._launch import device_guard


@triton.jit
def normalized(xf, sum_sq, w, eps, DIM: tl.constexpr, DT: tl.constexpr):
    """`rms_norm_ref`'s arithmetic on rows xf [R, C] (fp32) whose squares over their DIM features sum to
    sum_sq [R]: the normalised value rounded to DT, times the weight w [1, C] (fp32); fp32, unrounded."""
    rstd = 1.0 / tl.sqrt(sum_sq / DIM + eps)
    return cast(xf * rstd[:, None], DT).to(tl.float32) * w


@triton.jit(do_not_specialize=["n_rows"])
def _rms_norm_kernel(
    # pointers
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    # sizes
    n_rows, inner, eps,
    # strides (rows are (outer, inner) pairs so that [N, heads, D] views need no copy)
    stride_x0, stride_x1, stride_r0, stride_r1,
    # meta
    DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (cols < DIM)[None, :]
    outer = (rows // inner).to(tl.int64)
    x_offs = (outer * stride_x0 + (rows % inner) * stride_x1)[:, None] + cols[None, :]
    x = tl.load(x_ptr + x_offs, mask=mask, other=0.0)
    # out and res_out are contiguous [n_rows, DIM]
    o_offs = rows.to(tl.int64)[:, None] * DIM + cols[None, :]
    if HAS_RESIDUAL:
        r_offs = (outer * stride_r0 + (rows % inner) * stride_r1)[:, None] + cols[None, :]
        r = tl.load(res_ptr + r_offs, mask=mask, other=0.0)
        # residual sum rounded to the residual's dtype (the activation's, as the eager add does, or fp32)
        h = cast(x.to(tl.float32) + r.to(tl.float32), res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + o_offs, h, mask=mask)
        xf = h.to(tl.float32)
    else:
        xf = x.to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < DIM, other=0.0).to(tl.float32)
    y = normalized(xf, tl.sum(xf * xf, axis=1), w[None, :], eps, DIM, x_ptr.dtype.element_ty)  # fp32 statistics
    tl.store(out_ptr + o_offs, cast(y, out_ptr.dtype.element_ty), mask=mask)


def _as_3d(t: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [outer, inner, D] without a copy when the strides allow it."""
    if t.dim() == 3:
        return t
    if t.dim() == 2:
        return t.unsqueeze(1)
    return t.reshape(-1, 1, t.shape[-1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """RMSNorm over the last dim, optionally of (x + residual).

    x: [..., D] (2-D [N, D] or QK-norm [N, heads, D]; last dim contiguous); weight: [D];
    residual: None or shaped like x, in x.dtype or float32 (a residual stream kept in fp32). Returns out
    [..., D] in promote(x.dtype, weight.dtype) or, with a residual, (out, new_residual) where
    new_residual = x + residual in residual's dtype.
    """
    dim = x.shape[-1]
    assert weight.shape == (dim,), f"weight {tuple(weight.shape)} != ({dim},)"
    assert x.stride(-1) == 1 and weight.stride(-1) == 1, "last dim must be contiguous"
    assert x.is_floating_point() and weight.is_floating_point(), "float tensors only"
    assert x.device == weight.device, f"x on {x.device}, weight on {weight.device}"
    assert dim <= 16384, f"feature dim {dim} > 16384 is not supported"
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype in (x.dtype, torch.float32), \
            f"residual {tuple(residual.shape)}/{residual.dtype}: must be x's shape {tuple(x.shape)}, x's dtype or float32"
        assert residual.stride(-1) == 1, "residual last dim must be contiguous"
    x3 = _as_3d(x)
    r3 = _as_3d(residual) if residual is not None else x3
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    res_out = torch.empty(x.shape, dtype=residual.dtype, device=x.device) if residual is not None else out
    n_rows = x3.shape[0] * x3.shape[1]
    block_d = triton.next_power_of_2(dim)
    block_r = max(1, min(16, 2048 // block_d))  # several short rows (QK-norm) per program
    num_warps = 8 if block_d >= 4096 else 4 if block_d * block_r >= 1024 else 2
    grid = (triton.cdiv(n_rows, block_r),)
    if n_rows > 0:
        with device_guard(x):
            _rms_norm_kernel[grid](
                x3, r3, weight, out, res_out,
                n_rows, x3.shape[1], eps,
                x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1),
                DIM=dim, BLOCK_D=block_d, BLOCK_R=block_r, HAS_RESIDUAL=residual is not None,
                num_warps=num_warps,
            )
    return (out, res_out) if residual is not None else out
