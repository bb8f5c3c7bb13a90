"""Causal conv1d (stride 1, groups 1) of the codec decoder as an implicit GEMM, bias and residual fused.

out[b, o, t] = bias[o] + Σ_{k, i} w[o, i, k] · x[b, i, t + k·dilation] (+ residual[b, o, t])

The conv input is the causal history followed by the new samples, nothing is padded here. Either `x`
holds both, and T_out = L - (K - 1)·dilation, or (`history=`, the streaming layer's state) `x` holds the
new samples only and `history` [B, C_in, (K - 1)·dilation] the samples before them: the input is then
cat(history, x) without the copy (the kernels read positions before the history length from `history`,
the rest from `x`; cuDNN gets the cat) and T_out = T. Both forms give the same bits, on the kernels'
paths too. Products accumulate in fp32 over all taps and input channels (taps outer, channels inner) and
are rounded once, where cuDNN (the torch reference) rounds the conv before the residual add.

Two tilings of the GEMM [C_out, K·C_in] x [K·C_in, columns]:
- rows (`_conv1d_kernel`, impl "triton" or a `RowTiles`): one batch row per program, columns = the row's
  output positions, tiles set by channels and length only, so a row's result does not depend on the batch.
- flat (`_conv1d_flat_kernel`, impl a `FlatTiles`): columns = (batch row, output position) flattened,
  col = b·T_out + t, so one tile spans several batch rows when T_out is small. A streamed frame's
  early layers have T_out = 1..32: there the row tiling leaves most of a 16+ wide tile empty (T_out = 4:
  75%) and reads the whole weight once per batch row (22 MB for 1024->1536 k7). Its reduction is one
  loop over (tap, channel block): the pipeliner stages the weight tiles across taps, and each step loads
  the next step's x tile before its own dot. With the same BLOCK_I it adds the same products in the same
  order as the row tiling, hence the same bits.

- channels-last (`_conv1d_cl_kernel`, impl a `ChannelsLastTiles`, or "triton" for a channels-last call): x and
  history stored channels-last (x [B, C_in, L] a view with stride(1) == 1, as `snake_beta(channels_last=True)`
  writes it; the streaming convs keep their histories that way), columns flattened as in the flat tiling. Tap
  k reads whole channel rows at t + k·dilation, each starting at a multiple of the row stride: aligned,
  vectorized loads the pipeliner copies asynchronously. Time-contiguous x puts tap k's loads 2·k·dilation
  bytes off a 16-byte boundary, which neither allows; at the codec frame's k7 shapes the channels-last
  kernel is 2-4x faster than the row kernel and cuDNN, at 1 and 64 streams (H200,
  perf/results/RESULTS.md, twenty-first session). Output and residual stay time-contiguous.

Epilogue options, the same on every tiling: `snake=` stores the SnakeBeta of the rounded output (the snake
kernel's formula, `snake.snake_values`) channels-last instead of the output, `keep_conv=` both (the codec's
residual units: a unit's output is the next one's residual and, activated, its conv's input); `phases=` stores
conv channel o·phases + r at position t·phases + r of output channel o (a transposed conv's phases, interleaved).
The codec frame's 29 SnakeBetas and 4 phase interleaves were launches of their own (155 µs of the 16-row frame's
1.47 ms on the H200, perf/results/RESULTS.md, fifty-first session).

Why a kernel: cuDNN's heuristics pick a non-tensor-core implicit GEMM for some of the codec's layer and
batch shapes (~1 ms per conv at batch 64 on the H200, 10x its neighbours), and the pointwise (K=1)
convs are 2-3x faster here. On CUDA `causal_conv1d` times `candidates()` (cuDNN, row tiling configs and
at T_out = 1 two flat configs) once per shape inside `autotune.tuning()` (the
CUDA-graph warm-up of each batch bucket) and keeps the fastest; untuned CUDA shapes run cuDNN;
elsewhere (the interpreter) the row kernel runs. Under `autotune.batch_invariant()` the row kernel
always runs (cuDNN's algorithm and the flat tiles, hence the arithmetic, may change with the batch).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._cast import cast, dot
from ._launch import device_guard
from .autotune import batch_invariant, choose
from .reference import causal_conv1d_ref, interleave_phases
from .snake import snake_beta, snake_values


@triton.jit
def _w_tile(w_ptr, o, o_ok, i, i_ok, k, stride_wo, stride_wi, stride_wk):
    """[BLOCK_O, BLOCK_I] weights of tap k: output channels o, input channels i."""
    return tl.load(w_ptr + o[:, None] * stride_wo + i[None, :] * stride_wi + k * stride_wk,
                   mask=o_ok[:, None] & i_ok[None, :], other=0.0)


@triton.jit
def _x_tile(x_cols, h_cols, t, n_ok, i, i_ok, stride_xc, stride_hc, shift, HIST: tl.constexpr,
            SPLIT: tl.constexpr):
    """[BLOCK_I, BLOCK_N] conv input cat(history, x) at input channels i, positions t + shift of the columns.
    x_cols / h_cols [BLOCK_N]: each column's batch row of x / history, advanced by its t. SPLIT: some
    columns may read the history (positions < HIST); otherwise all read x at t + shift - HIST."""
    mask = i_ok[:, None] & n_ok[None, :]
    x_at = x_cols[None, :] + i[:, None] * stride_xc + (shift - HIST)
    if SPLIT:
        # two masked loads, each over contiguous addresses (vectorized; one load of selected addresses is a gather)
        in_h = (t + shift < HIST)[None, :]
        xh = tl.load(h_cols[None, :] + i[:, None] * stride_hc + shift, mask=mask & in_h, other=0.0)
        return tl.where(in_h, xh, tl.load(x_at, mask=mask & ~in_h, other=0.0))
    else:
        return tl.load(x_at, mask=mask, other=0.0)


@triton.jit
def _tap(acc, x_cols, h_cols, w_ptr, o, o_ok, t, t_ok, c_in, stride_xc, stride_hc, stride_wo, stride_wi,
         stride_wk, k: tl.constexpr, DILATION: tl.constexpr, HIST: tl.constexpr, SPLIT: tl.constexpr,
         BLOCK_I: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + tap k over all input channels (the row kernel's loop, one per tap)."""
    for i0 in range(0, c_in, BLOCK_I):  # the loop the pipeliner stages
        i = i0 + tl.arange(0, BLOCK_I)
        i_ok = i < c_in
        w = _w_tile(w_ptr, o, o_ok, i, i_ok, k, stride_wo, stride_wi, stride_wk)  # [BLOCK_O, BLOCK_I]
        x = _x_tile(x_cols, h_cols, t, t_ok, i, i_ok, stride_xc, stride_hc, k * DILATION, HIST,
                    SPLIT)  # [BLOCK_I, BLOCK_T]
        acc += dot(w, x, DOT_PRECISION)
    return acc


@triton.jit
def _cl_x_tile(x_rows, h_rows, p, n_ok, i, i_ok, stride_xt, stride_ht, HIST: tl.constexpr):
    """[BLOCK_M, BLOCK_I] channels-last conv input cat(history, x) at positions p [BLOCK_M] (one per column) and
    input channels i. x_rows / h_rows [BLOCK_M]: each column's batch row of x / history. HIST > 0: positions
    < HIST are read from the history, the others from x at p - HIST. One load whose rows start where each column's
    source says: the choice is per column, the channels stay contiguous and aligned, so the pipeliner stages it as
    it stages a load without a history (tests/kernels/test_conv1d_sm90.py). Two masked loads and a select staged
    three tiles a stage instead of two, and the same kernel read the history that way in twice the time it took
    over one tensor holding both (64 rows, the codec frame's convs, H200; perf/results/RESULTS.md, twenty-second
    session)."""
    if HIST > 0:
        row = tl.where(p < HIST, h_rows + p * stride_ht, x_rows + (p - HIST) * stride_xt)  # [BLOCK_M]
    else:
        row = x_rows + p * stride_xt
    return tl.load(row[:, None] + i[None, :], mask=n_ok[:, None] & i_ok[None, :], other=0.0)


@triton.jit
def _epilogue(acc, b_ptr, r_cols, out_cols, o, o_ok, n_ok, stride_rc, stride_oc, a_ptr, be_ptr, s_cols, stride_sc,
              stride_st, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, SNAKE: tl.constexpr, KEEP: tl.constexpr,
              PHASES: tl.constexpr):
    """Store acc [BLOCK_O, BLOCK_N] (+ bias, + residual) at conv channels o of the columns, rounded once; SNAKE:
    the SnakeBeta (log-parameters at a_ptr, be_ptr) of that rounded value, stored in the snake output instead (KEEP:
    as well). Conv channel o is output channel o // PHASES at phase o % PHASES: position t·PHASES + o % PHASES of
    the output's time (a transposed conv's phases, interleaved). r_cols / out_cols / s_cols [BLOCK_N]: each column's
    address in the residual / output / snake output at channel 0 and its first phase."""
    ch = o // PHASES  # [BLOCK_O] output channel
    ph = o - ch * PHASES  # [BLOCK_O] its phase
    if HAS_BIAS:
        acc += tl.load(b_ptr + o, mask=o_ok, other=0.0).to(tl.float32)[:, None]
    mask = o_ok[:, None] & n_ok[None, :]
    if HAS_RESIDUAL:
        acc += tl.load(r_cols[None, :] + o[:, None] * stride_rc, mask=mask, other=0.0).to(tl.float32)
    y = cast(acc, out_cols.dtype.element_ty)
    if KEEP or not SNAKE:
        tl.store(out_cols[None, :] + (ch * stride_oc + ph)[:, None], y, mask=mask)
    if SNAKE:  # from the rounded conv output, as the snake kernel reads it
        act = snake_values(y.to(tl.float32), a_ptr, be_ptr, ch, o_ok)
        tl.store(s_cols[None, :] + (ch * stride_sc + ph * stride_st)[:, None], cast(act, s_cols.dtype.element_ty),
                 mask=mask)


@triton.jit
def _conv1d_kernel(
    x_ptr, h_ptr, w_ptr, b_ptr, r_ptr, out_ptr, a_ptr, be_ptr, s_ptr,
    c_in, c_out, t_out,
    stride_xb, stride_xc, stride_hb, stride_hc, stride_wo, stride_wi, stride_wk,
    stride_rb, stride_rc, stride_ob, stride_oc, stride_sb, stride_sc, stride_st,
    K: tl.constexpr, DILATION: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    SNAKE: tl.constexpr, KEEP: tl.constexpr, PHASES: tl.constexpr, HIST: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_T: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """The row tiling: program (time tile, output channel tile, batch row)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # output positions
    o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)  # output channels
    b = tl.program_id(2).to(tl.int64)
    t_ok, o_ok = t < t_out, o < c_out
    x_cols = x_ptr + b * stride_xb + t  # [BLOCK_T]
    # input position t + k·DILATION: with a split history (HIST > 0), positions < HIST are read from
    # the history, the others from x at t + k·DILATION - HIST; HIST = 0: all from x
    h_cols = h_ptr + b * stride_hb + t  # [BLOCK_T]
    acc = tl.zeros((BLOCK_O, BLOCK_T), dtype=tl.float32)
    for k in tl.static_range(K):
        if k * DILATION < HIST:  # tap k reaches into the history, for t < HIST - k·DILATION
            if tl.program_id(0) * BLOCK_T < HIST - k * DILATION:  # this tile does
                acc = _tap(acc, x_cols, h_cols, w_ptr, o, o_ok, t, t_ok, c_in, stride_xc, stride_hc, stride_wo,
                           stride_wi, stride_wk, k, DILATION, HIST, True, BLOCK_I, DOT_PRECISION)
            else:  # the whole tile reads x (most tiles of a long chunk)
                acc = _tap(acc, x_cols, h_cols, w_ptr, o, o_ok, t, t_ok, c_in, stride_xc, stride_hc, stride_wo,
                           stride_wi, stride_wk, k, DILATION, HIST, False, BLOCK_I, DOT_PRECISION)
        else:
            acc = _tap(acc, x_cols, h_cols, w_ptr, o, o_ok, t, t_ok, c_in, stride_xc, stride_hc, stride_wo,
                       stride_wi, stride_wk, k, DILATION, HIST, False, BLOCK_I, DOT_PRECISION)
    _epilogue(acc, b_ptr, r_ptr + b * stride_rb + t, out_ptr + b * stride_ob + t * PHASES, o, o_ok, t_ok, stride_rc,
              stride_oc, a_ptr, be_ptr, s_ptr + b * stride_sb + t * PHASES * stride_st, stride_sc, stride_st, HAS_BIAS,
              HAS_RESIDUAL, SNAKE, KEEP, PHASES)


@triton.jit
def _step_channels(step, chunks, BLOCK_I: tl.constexpr):
    """(tap, input channels [BLOCK_I]) of reduction step `step` of the flat kernel, `chunks` channel blocks a tap."""
    k = step // chunks
    return k, (step - k * chunks) * BLOCK_I + tl.arange(0, BLOCK_I)


@triton.jit
def _flat_x_tile(x_cols, h_cols, t, n_ok, step, steps, chunks, c_in, stride_xc, stride_hc, DILATION: tl.constexpr,
                 HIST: tl.constexpr, BLOCK_I: tl.constexpr):
    """[BLOCK_I, BLOCK_N] input tile of reduction step `step` of the flat kernel; zeros from step `steps` on."""
    k, i = _step_channels(step, chunks, BLOCK_I)
    return _x_tile(x_cols, h_cols, t, n_ok, i, (i < c_in) & (step < steps), stride_xc, stride_hc, k * DILATION,
                   HIST, HIST > 0)


@triton.jit
def _flat_columns(t_out, n_cols, c_out, BLOCK_N: tl.constexpr, BLOCK_O: tl.constexpr):
    """This program's columns (b·t_out + t of n_cols = B·t_out) and output channels: (columns in range, each
    column's output position t and batch row b (int64) [BLOCK_N], output channels o and o in range [BLOCK_O])."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    row = n // t_out
    return n < n_cols, n - row * t_out, row.to(tl.int64), o, o < c_out


@triton.jit
def _conv1d_flat_kernel(
    x_ptr, h_ptr, w_ptr, b_ptr, r_ptr, out_ptr, a_ptr, be_ptr, s_ptr,
    c_in, c_out, t_out, n_cols,
    stride_xb, stride_xc, stride_hb, stride_hc, stride_wo, stride_wi, stride_wk,
    stride_rb, stride_rc, stride_ob, stride_oc, stride_sb, stride_sc, stride_st,
    K: tl.constexpr, DILATION: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    SNAKE: tl.constexpr, KEEP: tl.constexpr, PHASES: tl.constexpr, HIST: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """The flat tiling: program (column tile, output channel tile), column = b·t_out + t of n_cols = B·t_out."""
    n_ok, t, b, o, o_ok = _flat_columns(t_out, n_cols, c_out, BLOCK_N, BLOCK_O)
    x_cols = x_ptr + b * stride_xb + t  # [BLOCK_N]
    h_cols = h_ptr + b * stride_hb + t  # [BLOCK_N]
    chunks = tl.cdiv(c_in, BLOCK_I)  # input channel blocks per tap
    steps = K * chunks  # (tap, channel block), taps outer: the row kernel's order
    acc = tl.zeros((BLOCK_O, BLOCK_N), dtype=tl.float32)
    # x's loads are per element (a column's address comes from a division), too narrow for the pipeliner's
    # async copies: each step loads the next step's x tile into registers before its own dot instead
    x = _flat_x_tile(x_cols, h_cols, t, n_ok, 0, steps, chunks, c_in, stride_xc, stride_hc, DILATION, HIST,
                     BLOCK_I)  # [BLOCK_I, BLOCK_N]
    for step in range(0, steps):
        k, i = _step_channels(step, chunks, BLOCK_I)
        w = _w_tile(w_ptr, o, o_ok, i, i < c_in, k, stride_wo, stride_wi, stride_wk)  # [BLOCK_O, BLOCK_I]
        x_next = _flat_x_tile(x_cols, h_cols, t, n_ok, step + 1, steps, chunks, c_in, stride_xc, stride_hc,
                              DILATION, HIST, BLOCK_I)
        acc += dot(w, x, DOT_PRECISION)
        x = x_next
    _epilogue(acc, b_ptr, r_ptr + b * stride_rb + t, out_ptr + b * stride_ob + t * PHASES, o, o_ok, n_ok, stride_rc,
              stride_oc, a_ptr, be_ptr, s_ptr + b * stride_sb + t * PHASES * stride_st, stride_sc, stride_st, HAS_BIAS,
              HAS_RESIDUAL, SNAKE, KEEP, PHASES)


@triton.jit
def _conv1d_cl_kernel(
    x_ptr, h_ptr, w_ptr, b_ptr, r_ptr, out_ptr, a_ptr, be_ptr, s_ptr,
    c_in, c_out, t_out, n_cols,
    stride_xb, stride_xt, stride_hb, stride_ht, stride_wo, stride_wi, stride_wk,
    stride_rb, stride_rc, stride_ob, stride_oc, stride_sb, stride_sc, stride_st,
    K: tl.constexpr, DILATION: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    SNAKE: tl.constexpr, KEEP: tl.constexpr, PHASES: tl.constexpr, HIST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """The channels-last tiling: program (column tile, output channel tile), column = b·t_out + t of n_cols =
    B·t_out; x [B, L, C_in] and history [B, HIST, C_in] channels-last (channel stride 1), output time-contiguous."""
    n_ok, t, b, o, o_ok = _flat_columns(t_out, n_cols, c_out, BLOCK_M, BLOCK_O)
    x_rows, h_rows = x_ptr + b * stride_xb, h_ptr + b * stride_hb  # [BLOCK_M]
    chunks = tl.cdiv(c_in, BLOCK_I)  # input channel blocks per tap
    acc = tl.zeros((BLOCK_M, BLOCK_O), dtype=tl.float32)
    for step in range(0, K * chunks):  # (tap, channel block), taps outer: one loop the pipeliner stages
        k, i = _step_channels(step, chunks, BLOCK_I)
        i_ok = i < c_in
        x = _cl_x_tile(x_rows, h_rows, t + k * DILATION, n_ok, i, i_ok, stride_xt, stride_ht, HIST)  # [M, I]
        w = _w_tile(w_ptr, o, o_ok, i, i_ok, k, stride_wo, stride_wi, stride_wk)  # [BLOCK_O, BLOCK_I]
        acc += dot(x, tl.trans(w), DOT_PRECISION)
    _epilogue(tl.trans(acc), b_ptr, r_ptr + b * stride_rb + t, out_ptr + b * stride_ob + t * PHASES, o, o_ok, n_ok,
              stride_rc, stride_oc, a_ptr, be_ptr, s_ptr + b * stride_sb + t * PHASES * stride_st, stride_sc, stride_st,
              HAS_BIAS, HAS_RESIDUAL, SNAKE, KEEP, PHASES)


class RowTiles(NamedTuple):
    """A launch config of the row tiling (`causal_conv1d(impl=RowTiles(...))`; a tuning candidate). impl "triton"
    is the row tiling at `_blocks`' config, the batch-invariant one."""
    block_o: int  # output channels per program
    block_i: int  # input channels per reduction step
    block_t: int  # output positions per program
    num_warps: int = 4
    num_stages: int = 2

    def __str__(self) -> str:
        return f"rows o{self.block_o} i{self.block_i} t{self.block_t} w{self.num_warps} s{self.num_stages}"


class FlatTiles(NamedTuple):
    """A launch config of the flat tiling (`causal_conv1d(impl=FlatTiles(...))`; a tuning candidate)."""
    block_o: int  # output channels per program
    block_i: int  # input channels per reduction step
    block_n: int  # (batch row, position) columns per program
    num_warps: int = 4
    num_stages: int = 3

    def __str__(self) -> str:
        return f"flat o{self.block_o} i{self.block_i} n{self.block_n} w{self.num_warps} s{self.num_stages}"


class ChannelsLastTiles(NamedTuple):
    """A launch config of the channels-last tiling (`causal_conv1d(impl=ChannelsLastTiles(...))` on a channels-last
    call; a tuning candidate)."""
    block_m: int  # (batch row, position) columns per program
    block_o: int  # output channels per program
    block_i: int  # input channels per reduction step
    num_warps: int = 4
    num_stages: int = 3

    def __str__(self) -> str:
        return f"cl m{self.block_m} o{self.block_o} i{self.block_i} w{self.num_warps} s{self.num_stages}"


# the channels-last configs, each the fastest at some codec frame shape on the H200 (perf/results/RESULTS.md,
# twenty-first session): the first at every shape at one stream (the default: batch-invariant calls run it), the
# next three at 64 streams (768, 384, 96-192 channels). Those stage their tiles through the pipeliner's async
# copies, which Triton issues as cp.async.cg (cached in L2 only, whatever the load's cache modifier), so each of a
# k7 conv's taps reads its input tile from L2 again, though tap k + 1's tile is tap k's shifted by the dilation.
# The last three are not pipelined (num_stages 1): their loads are plain ld.global, cached in L1, where the next
# tap finds most of its rows (tests/kernels/test_conv1d_sm90.py checks both forms).
_CL_CONFIGS = (ChannelsLastTiles(64, 32, 64, 4, 3), ChannelsLastTiles(64, 64, 64, 4, 4),
               ChannelsLastTiles(128, 128, 64, 8, 3), ChannelsLastTiles(128, 64, 32, 4, 3),
               ChannelsLastTiles(128, 64, 32, 4, 1), ChannelsLastTiles(128, 128, 32, 8, 1),
               ChannelsLastTiles(64, 64, 32, 4, 1))


def _cl_configs(c_in: int, c_out: int) -> list[ChannelsLastTiles]:
    """`_CL_CONFIGS` with BLOCK_O and BLOCK_I clamped to the shape (distinct ones; the default first)."""
    fitted = (c._replace(block_o=_fit(c.block_o, c_out), block_i=_fit(c.block_i, c_in)) for c in _CL_CONFIGS)
    return list(dict.fromkeys(fitted))


def _blocks(c_in: int, c_out: int, t_out: int) -> RowTiles:
    """The row tiling's default (impl "triton") config: tl.dot needs every block ≥ 16."""
    block_t = min(128, max(16, triton.next_power_of_2(t_out)))
    block_o = min(64, max(16, triton.next_power_of_2(c_out)))
    block_i = min(64 if block_t <= 64 else 32, max(16, triton.next_power_of_2(c_in)))
    return RowTiles(block_o, block_i, block_t, 4, 2)


def _fit(block: int, size: int) -> int:
    """block clamped to [16, the next power of two of size]."""
    return min(block, max(16, triton.next_power_of_2(size)))


def _row_configs(c_in: int, c_out: int, t_out: int) -> list[RowTiles]:
    """Row configs beside the default, the same for every batch (the buckets share their compiles): 32 output
    channels and up to 64 positions per program (more programs: at one stream on the H200 it beat cuDNN and
    the default on every k7 shape but 384's, 1024->1536 k7 T4 39.6 us against 101.5 and 64.2), and 64 x 128
    with a deeper reduction step (BLOCK_I 64, 3 stages; at 64 streams the fastest kernel on the d3/d9 shapes
    where cuDNN is slow and on the k1 convs, 4-9 % under the default). A third, 16 output channels, won
    nothing by more than 0.2 us (perf/results/RESULTS.md, fourteenth session)."""
    block_i = _fit(64, c_in)
    configs = (RowTiles(_fit(32, c_out), block_i, _fit(64, t_out), 4, 3),
               RowTiles(_fit(64, c_out), block_i, _fit(128, t_out), 4, 3))
    return [c for c in dict.fromkeys(configs) if c != _blocks(c_in, c_out, t_out)]


def _flat_configs(c_in: int, c_out: int) -> list[FlatTiles]:
    """Two flat configs of one 64-column tile: at T_out = 1 a tile holds 64 batch rows, the weights stream
    once per column tile and the programs split the output channels (64 or 32 per program). They depend on
    the shape only, not the batch, so the batch buckets share their compiles. Blocks are clamped to the
    shape, BLOCK_I to a divisor of c_in where one fits."""
    block_i = 64 if c_in % 64 == 0 else _fit(32, c_in)
    fitted = (FlatTiles(_fit(block_o, c_out), block_i, 64, 4, 4) for block_o in (64, 32))
    return list(dict.fromkeys(fitted))  # a small c_out can make both the same


def candidates(c_in: int, c_out: int, t_out: int, channels_last: bool = False) -> tuple:
    """What `causal_conv1d` times for a shape on CUDA, the same at every batch: "cudnn", "triton" (the row
    tiling's default), the row tiling's other `RowTiles` and, at T_out = 1 (the frame's first conv, where a row
    tile is 1/16 full), the flat tiling's `FlatTiles` (configs are hashable and picklable: the tuned table is
    saved). The flat tiling lost to cuDNN or the row tiling at every T_out >= 4 of the codec's frame on the H200
    (perf/results/RESULTS.md, thirteenth session), so it is not timed there. A channels-last call: "cudnn",
    "triton" (the channels-last default) and the other `ChannelsLastTiles`."""
    if channels_last:
        return ("cudnn", "triton", *_cl_configs(c_in, c_out)[1:])
    return ("cudnn", "triton", *_row_configs(c_in, c_out, t_out),
            *(_flat_configs(c_in, c_out) if t_out == 1 else ()))


def is_channels_last(x: torch.Tensor, history: torch.Tensor | None = None) -> bool:
    """Whether a `causal_conv1d` call takes the channels-last tiling: x [B, C_in, L] (and the history, if any) with
    channel stride 1 (a time-contiguous x of one sample is both)."""
    return x.stride(1) == 1 and (history is None or history.stride(1) == 1)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dilation: int = 1,
                  residual: torch.Tensor | None = None, weight_oik: torch.Tensor | None = None,
                  impl: str | RowTiles | FlatTiles | ChannelsLastTiles | None = None,
                  history: torch.Tensor | None = None, snake: tuple[torch.Tensor, torch.Tensor] | None = None,
                  keep_conv: bool = False, phases: int = 1) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Valid (unpadded) conv1d of x [B, C_in, L] (history included) with weight [C_out, C_in, K],
    bias [C_out] or None -> [B, C_out, L - (K-1)·dilation] in x.dtype, plus residual (same shape as the
    output) when given. x and history either both time-contiguous or both channels-last (`is_channels_last`:
    the channels-last tiling); residual and the output are time-contiguous.

    history: [B, C_in, (K-1)·dilation], x.dtype: the samples before x [B, C_in, T] (new samples only).
    The conv then runs over cat(history, x) -> [B, C_out, T], bit for bit what the concatenated x gives,
    but the kernels read both in place (cuDNN gets the cat, and the tuner times it with the cat).

    weight_oik: optional copy of `weight` stored input-channel-fastest (`q3tts.kernels.conv_kernel_weight`), read
    coalesced by the kernels; cuDNN keeps using `weight`. On CUDA: the fastest of `candidates()` for
    shapes tuned in `autotune.tuning()`, cuDNN for the rest; the row kernel under
    `autotune.batch_invariant()` and off CUDA (channels-last: the channels-last default). impl="triton" (the
    row tiling's default; channels-last, the channels-last tiling's) | "cudnn" | a `RowTiles` | a `FlatTiles` |
    a `ChannelsLastTiles` (channels-last calls) forces one.

    snake: SnakeBeta log-parameters (alpha, beta) [C_out]: the call returns `snake_beta(out, alpha, beta,
    channels_last=True)` of the rounded output instead, made in the conv's epilogue (cuDNN: the snake kernel after
    it), the same bits as the two calls; keep_conv: (out, that) -- the codec's residual units, whose output is the
    next one's residual and, activated, its conv's input.

    phases: conv channel o·phases + r is phase r of output channel o (a transposed conv as a conv,
    `CausalTransConv1d.as_conv`): the output is [B, C_out / phases, T·phases], position t·phases + r, the phases
    interleaved by the epilogue's stores (cuDNN: a copy after it); snake parameters are then [C_out / phases]."""
    bsz, c_in, length = x.shape
    c_out, w_in, k = weight.shape
    hist = (k - 1) * dilation
    cl = is_channels_last(x, history)
    if history is not None:
        assert history.shape == (bsz, c_in, hist), \
            f"history {tuple(history.shape)} != {(bsz, c_in, hist)} (batch, input channels, (K-1)·dilation)"
        assert cl or history.stride(-1) == 1 or hist <= 1, "history's time dim (or channel dim) must be contiguous"
        assert history.dtype == x.dtype and history.device == x.device, \
            "history must match x's dtype and device"
        history = history if hist else None  # K = 1: nothing before x is read
    t_out = length if history is not None else length - hist
    assert w_in == c_in, f"weight takes {w_in} input channels, x has {c_in} (groups are not supported)"
    assert t_out >= 1, f"input length {length} < receptive field {hist + 1}"
    assert cl or x.stride(-1) == 1 or length == 1, "x's time dim (or channel dim) must be contiguous"
    assert weight.dtype == x.dtype and (bias is None or bias.dtype == x.dtype), "one dtype for x, weight, bias"
    assert impl is None or impl in ("triton", "cudnn") or isinstance(impl, ChannelsLastTiles if cl else
                                                                     (RowTiles, FlatTiles)), f"unknown impl {impl!r}"
    if residual is not None:
        assert residual.shape == (bsz, c_out, t_out) and residual.stride(-1) == 1, \
            f"residual {tuple(residual.shape)} != output {(bsz, c_out, t_out)} or not contiguous in time"
    assert c_out % phases == 0 and (phases == 1 or residual is None), "phases divide C_out, without a residual"
    if snake is not None:
        assert all(p.shape == (c_out // phases,) for p in snake), \
            f"snake parameters must be [{c_out // phases}] (output channels)"
    assert snake is not None or not keep_conv, "keep_conv keeps the conv output beside its snake"
    if weight_oik is not None:
        assert weight_oik.shape == weight.shape and weight_oik.dtype == weight.dtype and \
            weight_oik.device == weight.device, "weight_oik must be a copy of weight (same shape, dtype, device)"
    w_kernel = weight if weight_oik is None else weight_oik

    def launch(impl: str | RowTiles | FlatTiles) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if impl == "cudnn":
            full = x if history is None else torch.cat([history, x], dim=-1)
            out = interleave_phases(causal_conv1d_ref(full, weight, bias, dilation, residual), phases)
            if snake is None:
                return out
            act = snake_beta(out, *snake, channels_last=True)
            return (out, act) if keep_conv else act
        if impl == "triton":
            impl = _cl_configs(c_in, c_out)[0] if cl else _blocks(c_in, c_out, t_out)
        return _launch(x, w_kernel, bias, dilation, residual, t_out, history, impl, snake, keep_conv, phases)

    key = ("conv1d", tuple(x.shape), tuple(weight.shape), dilation, x.dtype, bias is not None,
           residual is not None, weight_oik is not None, history is not None) + (("channels_last",) if cl else ()) \
        + ((("snake", keep_conv),) if snake is not None else ()) + ((("phases", phases),) if phases > 1 else ())
    with device_guard(x):  # the tuning launches too: x may sit on another GPU than the current one
        if impl is not None or not x.is_cuda or batch_invariant():
            return launch(impl or "triton")
        return launch(choose(key, candidates(c_in, c_out, t_out, cl), launch, x.device, default="cudnn"))


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dilation: int,
            residual: torch.Tensor | None, t_out: int, history: torch.Tensor | None,
            tiles: RowTiles | FlatTiles | ChannelsLastTiles, snake: tuple[torch.Tensor, torch.Tensor] | None = None,
            keep_conv: bool = False, phases: int = 1) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Run the row, flat or channels-last tiling with `tiles`' config -> [B, C_out / phases, t_out · phases]; snake:
    its SnakeBeta instead, stored channels-last (keep_conv: both)."""
    bsz, c_in, _ = x.shape
    c_out, _, k = weight.shape
    shape = (bsz, c_out // phases, t_out * phases)
    act = None if snake is None else torch.empty(shape[0], shape[2], shape[1], dtype=x.dtype,
                                                 device=x.device).transpose(1, 2)
    out = torch.empty(shape, dtype=x.dtype, device=x.device) if act is None or keep_conv else act
    r = residual if residual is not None else out
    h = history if history is not None else x  # unread without history
    s = act if act is not None else out  # unwritten without a snake
    alpha, beta = snake if snake is not None else (weight, weight)  # unread without a snake
    args = (x, h, weight, bias if bias is not None else weight, r, out, alpha, beta, s, c_in, c_out, t_out)
    # the channels-last kernel takes x's and history's time strides where the others take their channel strides
    along = 2 if isinstance(tiles, ChannelsLastTiles) else 1
    strides = (x.stride(0), x.stride(along), h.stride(0), h.stride(along), weight.stride(0), weight.stride(1),
               weight.stride(2), r.stride(0), r.stride(1), out.stride(0), out.stride(1), s.stride(0), s.stride(1),
               s.stride(2))
    meta = dict(K=k, DILATION=dilation, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
                SNAKE=snake is not None, KEEP=keep_conv, PHASES=phases,
                HIST=(k - 1) * dilation if history is not None else 0,
                DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                BLOCK_O=tiles.block_o, BLOCK_I=tiles.block_i, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    if isinstance(tiles, RowTiles):
        grid = (triton.cdiv(t_out, tiles.block_t), triton.cdiv(c_out, tiles.block_o), bsz)
        _conv1d_kernel[grid](*args, *strides, **meta, BLOCK_T=tiles.block_t)
    elif isinstance(tiles, ChannelsLastTiles):
        grid = (triton.cdiv(bsz * t_out, tiles.block_m), triton.cdiv(c_out, tiles.block_o))
        _conv1d_cl_kernel[grid](*args, bsz * t_out, *strides, **meta, BLOCK_M=tiles.block_m)
    else:
        grid = (triton.cdiv(bsz * t_out, tiles.block_n), triton.cdiv(c_out, tiles.block_o))
        _conv1d_flat_kernel[grid](*args, bsz * t_out, *strides, **meta, BLOCK_N=tiles.block_n)
    if act is None:
        return out
    return (out, act) if keep_conv else act
