"""Causal conv1d (stride 1, groups 1) of the codec decoder as an implicit GEMM, bias and residual fused.

out[b, o, t] = bias[o] + Σ_{k, i} w[o, i, k] · x[b, i, t + k·dilation] (+ residual[b, o, t])

The conv input is the causal history followed by the new samples, nothing is padded here. Either `x`
holds both, and T_out = L - (K - 1)·dilation, or (`history=`, the streaming layer's state) `x` holds the
new samples only and `history` [B, C_in, (K - 1)·dilation] the samples before them: the input is then
cat(history, x) without the copy (the kernel reads positions before the history length from `history`,
the rest from `x`; cuDNN gets the cat) and T_out = T. Both forms give the same bits, on the kernel's
path too. Products accumulate in fp32 over all taps and input channels and are rounded once, where
cuDNN (the torch reference) rounds the conv before the residual add.

Why a kernel: cuDNN's heuristics pick a non-tensor-core implicit GEMM for some of the codec's layer and
batch shapes (~1 ms per conv at batch 64 on the H200, 10x its neighbours), and the pointwise (K=1)
convs are 2-3x faster here. cuDNN is still faster for most K=7 shapes, so on CUDA `causal_conv1d`
times both once per shape inside `autotune.tuning()` (the CUDA-graph warm-up of each batch bucket)
and keeps the faster; untuned CUDA shapes run cuDNN; elsewhere (the interpreter) the kernel runs.
Under `autotune.batch_invariant()` the kernel always runs (cuDNN's algorithm, hence its arithmetic,
may change with the batch): its tiles depend on channels and length only, one batch row per program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._cast import cast, dot
from ._launch import device_guard
from .autotune import batch_invariant, choose
from .reference import causal_conv1d_ref


@triton.jit
def _tap_from_x(acc, x_row, w_ptr, o, o_ok, t, t_ok, c_in, stride_xc, stride_wo, stride_wi, stride_wk,
                k: tl.constexpr, OFFSET: tl.constexpr, BLOCK_I: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + tap k over all input channels, every input position of the tile in x (at t + OFFSET)."""
    for i0 in range(0, c_in, BLOCK_I):  # the loop the pipeliner stages
        i = i0 + tl.arange(0, BLOCK_I)
        i_ok = i < c_in
        w = tl.load(w_ptr + o[:, None] * stride_wo + i[None, :] * stride_wi + k * stride_wk,
                    mask=o_ok[:, None] & i_ok[None, :], other=0.0)  # [BLOCK_O, BLOCK_I]
        x = tl.load(x_row + i[:, None] * stride_xc + (t + OFFSET)[None, :],
                    mask=i_ok[:, None] & t_ok[None, :], other=0.0)  # [BLOCK_I, BLOCK_T]
        acc += dot(w, x, DOT_PRECISION)
    return acc


@triton.jit
def _conv1d_kernel(
    x_ptr, h_ptr, w_ptr, b_ptr, r_ptr, out_ptr,
    c_in, c_out, t_out,
    stride_xb, stride_xc, stride_hb, stride_hc, stride_wo, stride_wi, stride_wk,
    stride_rb, stride_rc, stride_ob, stride_oc,
    K: tl.constexpr, DILATION: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    HIST: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_T: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # output positions
    o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)  # output channels
    b = tl.program_id(2).to(tl.int64)
    t_ok, o_ok = t < t_out, o < c_out
    x_row = x_ptr + b * stride_xb
    # input position t + k·DILATION: with a split history (HIST > 0), positions < HIST are read from
    # h_row, the others from x at t + k·DILATION - HIST; HIST = 0: all from x
    h_row = h_ptr + b * stride_hb
    acc = tl.zeros((BLOCK_O, BLOCK_T), dtype=tl.float32)
    for k in tl.static_range(K):
        if k * DILATION < HIST:  # tap k reaches into the history, for t < HIST - k·DILATION
            if tl.program_id(0) * BLOCK_T < HIST - k * DILATION:  # this tile does: two masked loads
                for i0 in range(0, c_in, BLOCK_I):
                    i = i0 + tl.arange(0, BLOCK_I)
                    i_ok = i < c_in
                    w = tl.load(w_ptr + o[:, None] * stride_wo + i[None, :] * stride_wi + k * stride_wk,
                                mask=o_ok[:, None] & i_ok[None, :], other=0.0)  # [BLOCK_O, BLOCK_I]
                    p = t + k * DILATION - HIST  # position in x (negative: in the history)
                    in_h = p < 0
                    xh = tl.load(h_row + i[:, None] * stride_hc + (t + k * DILATION)[None, :],
                                 mask=i_ok[:, None] & (t_ok & in_h)[None, :], other=0.0)
                    xx = tl.load(x_row + i[:, None] * stride_xc + p[None, :],
                                 mask=i_ok[:, None] & (t_ok & (p >= 0))[None, :], other=0.0)
                    x = tl.where(in_h[None, :], xh, xx)  # [BLOCK_I, BLOCK_T]: the concatenated input's values
                    acc += dot(w, x, DOT_PRECISION)
            else:  # the whole tile reads x (most tiles of a long chunk)
                acc = _tap_from_x(acc, x_row, w_ptr, o, o_ok, t, t_ok, c_in, stride_xc, stride_wo, stride_wi,
                                  stride_wk, k, k * DILATION - HIST, BLOCK_I, DOT_PRECISION)
        else:
            acc = _tap_from_x(acc, x_row, w_ptr, o, o_ok, t, t_ok, c_in, stride_xc, stride_wo, stride_wi,
                              stride_wk, k, k * DILATION - HIST, BLOCK_I, DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + o, mask=o_ok, other=0.0).to(tl.float32)[:, None]
    mask = o_ok[:, None] & t_ok[None, :]
    if HAS_RESIDUAL:
        acc += tl.load(r_ptr + b * stride_rb + o[:, None] * stride_rc + t[None, :], mask=mask,
                       other=0.0).to(tl.float32)
    tl.store(out_ptr + b * stride_ob + o[:, None] * stride_oc + t[None, :],
             cast(acc, out_ptr.dtype.element_ty), mask=mask)


def _blocks(c_in: int, c_out: int, t_out: int) -> tuple[int, int, int]:
    """(BLOCK_O, BLOCK_I, BLOCK_T): tl.dot needs every block ≥ 16."""
    block_t = min(128, max(16, triton.next_power_of_2(t_out)))
    block_o = min(64, max(16, triton.next_power_of_2(c_out)))
    block_i = min(64 if block_t <= 64 else 32, max(16, triton.next_power_of_2(c_in)))
    return block_o, block_i, block_t


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dilation: int = 1,
                  residual: torch.Tensor | None = None, weight_oik: torch.Tensor | None = None,
                  impl: str | None = None, history: torch.Tensor | None = None) -> torch.Tensor:
    """Valid (unpadded) conv1d of x [B, C_in, L] (history included) with weight [C_out, C_in, K],
    bias [C_out] or None -> [B, C_out, L - (K-1)·dilation] in x.dtype, plus residual (same shape as the
    output) when given. The time dim of x (unless it has one sample), history, residual and the output
    must be contiguous.

    history: [B, C_in, (K-1)·dilation], x.dtype: the samples before x [B, C_in, T] (new samples only).
    The conv then runs over cat(history, x) -> [B, C_out, T], bit for bit what the concatenated x gives,
    but the kernel reads both in place (cuDNN gets the cat, and the tuner times it with the cat).

    weight_oik: optional copy of `weight` stored input-channel-fastest (`q3tts.kernels.conv_kernel_weight`), read
    coalesced by the kernel; cuDNN keeps using `weight`. On CUDA: the faster of kernel and cuDNN for
    shapes tuned in `autotune.tuning()`, cuDNN for the rest; the kernel under
    `autotune.batch_invariant()`. impl="triton" | "cudnn" forces one."""
    bsz, c_in, length = x.shape
    c_out, w_in, k = weight.shape
    hist = (k - 1) * dilation
    if history is not None:
        assert history.shape == (bsz, c_in, hist), \
            f"history {tuple(history.shape)} != {(bsz, c_in, hist)} (batch, input channels, (K-1)·dilation)"
        assert history.stride(-1) == 1 or hist <= 1, "history's time dim must be contiguous"
        assert history.dtype == x.dtype and history.device == x.device, \
            "history must match x's dtype and device"
        history = history if hist else None  # K = 1: nothing before x is read
    t_out = length if history is not None else length - hist
    assert w_in == c_in, f"weight takes {w_in} input channels, x has {c_in} (groups are not supported)"
    assert t_out >= 1, f"input length {length} < receptive field {hist + 1}"
    assert x.stride(-1) == 1 or length == 1, "x's time dim must be contiguous"
    assert weight.dtype == x.dtype and (bias is None or bias.dtype == x.dtype), "one dtype for x, weight, bias"
    if residual is not None:
        assert residual.shape == (bsz, c_out, t_out) and residual.stride(-1) == 1, \
            f"residual {tuple(residual.shape)} != output {(bsz, c_out, t_out)} or not contiguous in time"
    if weight_oik is not None:
        assert weight_oik.shape == weight.shape and weight_oik.dtype == weight.dtype and \
            weight_oik.device == weight.device, "weight_oik must be a copy of weight (same shape, dtype, device)"
    w_kernel = weight if weight_oik is None else weight_oik

    def launch(impl: str) -> torch.Tensor:
        if impl == "cudnn":
            full = x if history is None else torch.cat([history, x], dim=-1)
            return causal_conv1d_ref(full, weight, bias, dilation, residual)
        return _launch(x, w_kernel, bias, dilation, residual, t_out, history)

    key = ("conv1d", tuple(x.shape), tuple(weight.shape), dilation, x.dtype, bias is not None,
           residual is not None, weight_oik is not None, history is not None)
    with device_guard(x):  # the tuning launches too: x may sit on another GPU than the current one
        if impl is not None or not x.is_cuda or batch_invariant():
            return launch(impl or "triton")
        return launch(choose(key, ("triton", "cudnn"), launch, x.device, default="cudnn"))


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dilation: int,
            residual: torch.Tensor | None, t_out: int, history: torch.Tensor | None = None) -> torch.Tensor:
    bsz, c_in, _ = x.shape
    c_out, _, k = weight.shape
    out = torch.empty(bsz, c_out, t_out, dtype=x.dtype, device=x.device)
    block_o, block_i, block_t = _blocks(c_in, c_out, t_out)
    r = residual if residual is not None else out
    h = history if history is not None else x  # unread without history
    grid = (triton.cdiv(t_out, block_t), triton.cdiv(c_out, block_o), bsz)
    _conv1d_kernel[grid](
        x, h, weight, bias if bias is not None else weight, r, out,
        c_in, c_out, t_out,
        x.stride(0), x.stride(1), h.stride(0), h.stride(1), weight.stride(0), weight.stride(1), weight.stride(2),
        r.stride(0), r.stride(1), out.stride(0), out.stride(1),
        K=k, DILATION=dilation, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
        HIST=(k - 1) * dilation if history is not None else 0, BLOCK_O=block_o, BLOCK_I=block_i, BLOCK_T=block_t,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=2,
    )
    return out
