"""Skinny-GEMM building blocks of the code-predictor kernels: out[M, N] = X[M, K] @ W[N, K]^T.

The code predictor runs at M = batch (1..256) rows, so every GEMM is weight-bandwidth bound. One
program owns BLOCK_M rows x BLOCK_N weight rows x one of SPLIT slices of K (grid: row blocks
fastest, so the programs that share a weight tile run together and re-read it from L2). With
SPLIT > 1 each program stores an fp32 partial and takes a ticket; the last program of a unit (a
column tile, or a kv-head group for attention) sums the partials in split order 0..SPLIT-1 and runs
the epilogue. No GEMM program waits on another, so any grid is safe (the interpreter runs programs one
by one); the sums never depend on which program arrived last or on M. (The code predictor's qkv launch of several
rows adds programs that wait for their group's tickets, after the GEMM programs: code_predictor_attention.spread.)

Launch configs (code_predictor_linear.select_config): with `autotune.batch_invariant()` on, BLOCK_M
16 and a config chosen per weight shape (never per M), so a row's arithmetic does not depend on how
many rows share the call. Off (the default), batches of 17+ rows take the config tuned for their
row class (rows rounded up to a power of 2, ROW_CLASSES), BLOCK_M up to 64: one weight tile feeds
more rows (fewer L2 re-reads, wgmma-sized dots) at the price of per-class split counts and tiles; a
launch of one row takes its own BLOCK_M 16 config (class 1).
Prologues: rows of X as they are, or RMS-normalised (fp32 statistics over the whole row, rounded like
`rms_norm_ref`); the rows are X's, or a table's gathered by id (`row_offsets`: the code predictor's qkv
launch gathers and normalises).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._cast import _INTERPRET, cast, dot
from ._launch import num_sms, programmatic_launch
from .autotune import batch_invariant

BLOCK_M = 16  # rows per program of the batch-invariant configs: the smallest tl.dot M
FEW_ROWS = 1  # a launch of at most this many rows holds only them in its prologue and epilogue (`held_rows`)
MIN_BLOCK_N = 16
HOLD_MAX = 32768  # weight elements a program may hold in registers across a PDL wait (`held_columns`)
ROW_CLASSES = (16, 32, 64, 128, 256)  # rows rounded up to a power of 2, capped; one tuning each
PLAIN, GATHER, NORM = 0, 1, 2  # prologues: X rows / table rows by id / RMSNorm(X rows)
STAT_COLS = 16  # columns of one partial sum of squares in a row-statistics buffer (`store_stats`)
_STAT_COLS = tl.constexpr(STAT_COLS)


class GemmConfig(NamedTuple):
    block_n: int
    block_k: int
    split: int  # slices of K; > 1 sums fp32 partials in the last program of a unit
    num_warps: int
    num_stages: int
    block_m: int = BLOCK_M  # rows per program (16, 32 or 64)


def interpret_config(cols: int) -> GemmConfig:
    """The CPU interpreter's config: few programs (its cost is per program and per nested jit call,
    not per element): the widest power-of-2 tile <= 512 that divides `cols`, one K slice (the tests
    pass split configs explicitly)."""
    block_n = MIN_BLOCK_N
    while cols % (2 * block_n) == 0 and 2 * block_n <= 512:
        block_n *= 2
    return GemmConfig(block_n, 64, 1, 1, 1)


def row_blocks(rows: int, block_m: int = BLOCK_M) -> int:
    return triton.cdiv(rows, block_m)


def held_rows(rows: int, block_m: int = BLOCK_M) -> int:
    """Rows a launch's norm statistics, qkv epilogue and attention step hold at once: a launch of at most
    FEW_ROWS rows (the 1-row step) holds them all, so its row norm reads the row in one round of loads, its
    epilogue loads every head's sums before its first store and its attention every cached position in one
    round; others the program's block_m rows, chunk by chunk and head by head (2 rows at FEW_ROWS 2 spilled
    registers in one sm_90 qkv config). Under `batch_invariant()` always block_m (one arithmetic whatever the
    batch)."""
    return rows if rows <= FEW_ROWS and not batch_invariant() else block_m


def few_rows(rows: int) -> bool:
    """Whether a launch of `rows` rows holds only them (`held_rows` below BLOCK_M: the one-row step's kernels,
    compiled apart from the row blocks'). Such launches take tuning keys of their own (code_predictor_linear's row
    class FEW_ROWS, the talker attention's key), so the engine's chain tuner need not trade the one-row step against
    the 16-row one. Never under `batch_invariant()`."""
    return held_rows(rows) < BLOCK_M


def counters_needed(rows: int, units_per_block: int, block_m: int = BLOCK_M) -> int:
    """Tickets one launch uses: one per (row block, unit). The default BLOCK_M, the smallest,
    gives the most: enough for any config."""
    return row_blocks(rows, block_m) * units_per_block


def row_class(rows: int) -> int:
    """The row class of `rows` rows: rows rounded up to a power of 2 within ROW_CLASSES."""
    return min(max(triton.next_power_of_2(rows), ROW_CLASSES[0]), ROW_CLASSES[-1])


def _split(programs: int, k: int, block_k: int, device: torch.device, split_k: bool) -> int:
    """K slices for `programs` output tiles: about two programs per SM, slices of whole BLOCK_K
    steps (no empty or ragged slice); 1 without split_k."""
    split = 1
    while split_k and programs * split < 2 * num_sms(device) and k % (2 * split * block_k) == 0:
        split *= 2
    return split


def candidates(n_tiles_per_block_n, k: int, device: torch.device, rows: int = BLOCK_M,
               split_k: bool = True) -> list[GemmConfig]:
    """Launch configs to time for row class `rows` (at most 5: compiling each costs seconds), the
    heuristic first (used untuned).

    n_tiles_per_block_n(bn) -> column tiles for weight-row tile bn (None when bn does not fit).
    Class 16 (one row block, the batch-invariant configs): BLOCK_M 16, weight-row tiles 32 / 16 /
    64 and the heuristic's tile with half the slices. Larger classes: BLOCK_M 64 and 32 (up to the
    class) x tiles 32 / 64, wider tiles with more warps, or none when neither tile fits the weight
    (the class then keeps the class-16 config). The split count aims at about two programs per SM
    over all row blocks of the class; split_k=False keeps one slice (no partials)."""
    block_k = 128
    if rows <= BLOCK_M:
        tiles = [(BLOCK_M, bn) for bn in (32, 16, 64)]
    else:
        tiles = [(bm, bn) for bm in (64, 32) if bm <= rows for bn in (32, 64)]
    out = []
    for bm, bn in tiles:
        n_tiles = n_tiles_per_block_n(bn)
        if n_tiles is None:
            continue
        split = _split(row_blocks(rows, bm) * n_tiles, k, block_k, device, split_k)
        warps, stages = (8, 3) if bm * bn >= 4096 else (4, 4)
        out.append(GemmConfig(bn, block_k, split, warps, stages, bm))
        if split > 1 and len(out) == 1:  # the heuristic's tile with half the slices
            out.append(out[0]._replace(split=split // 2))
    assert out or rows > BLOCK_M, "no block size fits the weight"
    return out


def held_columns(tile_rows: int, k: int, split: int, block_k: int, pdl: bool) -> int:
    """HOLD of a GEMM launch, > 0 when it launches programmatically: with PDL switched on for it (`pdl`,
    kernels/_launch.py), the width of its K slices (`k_slice`) rounded up to a power of 2 when a program's weight
    tile [tile_rows, that width] fits HOLD_MAX elements. Its programs then load the whole tile into registers
    before the PDL wait (`weights_before_wait`), so the weight bytes are in flight while the kernel before still
    runs. Else 0: an ordinary launch, the tile streamed in BLOCK_K steps (a GEMM that waits with nothing in flight
    only holds SM slots: the L2 prefetch it once did lost on the H100)."""
    width = triton.next_power_of_2(triton.cdiv(triton.cdiv(k, split), block_k) * block_k)
    return width if pdl and tile_rows * width <= HOLD_MAX else 0


def held_launch(cfg: GemmConfig, tile_rows: int, k: int, t: torch.Tensor) -> dict:
    """The launch keywords of a GEMM kernel that takes HOLD, for config cfg, weight tiles of tile_rows rows and
    k columns, inputs on t's device: HOLD (`held_columns`; > 0 launches programmatically), the config's warps, its
    stages (1 when held: one K step, nothing to pipeline) and launch_pdl."""
    hold = held_columns(tile_rows, k, cfg.split, cfg.block_k, programmatic_launch(t))
    return dict(HOLD=hold, num_warps=cfg.num_warps, num_stages=1 if hold else cfg.num_stages, launch_pdl=hold > 0)


def stats_width(cols: int) -> int:
    """STATS of a launch that norms rows `cols` wide from (or writes) a row-statistics buffer: its cols /
    STAT_COLS partial sums a row rounded up to a power of 2."""
    assert cols % STAT_COLS == 0, f"row statistics: {cols} columns not a multiple of {STAT_COLS}"
    return triton.next_power_of_2(cols // STAT_COLS)


def row_stats_buffer(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """A row-statistics buffer for `rows` rows of `cols` columns (fp32 [rows, cols / STAT_COLS]): a residual
    launch writes it (`linear_residual`), the norms of the launches after read it."""
    assert cols % STAT_COLS == 0, f"row statistics: {cols} columns not a multiple of {STAT_COLS}"
    return torch.empty(rows, cols // STAT_COLS, dtype=torch.float32, device=device)


def check_stats(stats: torch.Tensor, rows: int, cols: int, like: torch.Tensor) -> None:
    """A row-statistics buffer for `rows` rows of `cols` columns: fp32 [>= rows, cols / STAT_COLS], rows
    contiguous, on like's device."""
    assert stats.dtype == torch.float32 and stats.dim() == 2 and stats.shape[0] >= rows \
        and stats.shape[1] == cols // STAT_COLS and stats.stride(-1) == 1 and stats.device == like.device, \
        f"row statistics: {tuple(stats.shape)}/{stats.dtype} on {stats.device}, want fp32 " \
        f"[>= {rows}, {cols // STAT_COLS}] on {like.device}"


def dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


# ------------------------------------------------------------------------------ device helpers

@triton.jit
def row_offsets(x_ptr, ids_ptr, rows, row_mask, row_step, row_first, stride_xm, stride_ids,
                PROLOGUE: tl.constexpr):
    """Element offsets [BLOCK_M] of each row's input: X row rows*row_step + row_first, or, for
    GATHER, table row ids[rows]."""
    if PROLOGUE == 1:
        ids = tl.load(ids_ptr + rows.to(tl.int64) * stride_ids, mask=row_mask, other=0)
        return ids.to(tl.int64) * stride_xm
    else:
        return (rows.to(tl.int64) * row_step + row_first) * stride_xm


@triton.jit
def row_rstd(x_ptr, x_off, row_mask, K, eps, ROWS: tl.constexpr):
    """1 / sqrt(mean(x^2) + eps) of each row [ROWS] over all K columns, in fp32, reading
    min(8192 / ROWS, 2048) columns per step (each step is a dependent round trip to L2: 2 for a 1024-wide
    row of a 16-row block, where BLOCK_K-wide steps took 8; 1 for a lone row up to 2048 wide)."""
    CHUNK: tl.constexpr = min(8192 // ROWS, 2048)
    sq = tl.zeros([ROWS], tl.float32)
    for k0 in range(0, K, CHUNK):
        ks = k0 + tl.arange(0, CHUNK)
        x = tl.load(x_ptr + x_off[:, None] + ks[None, :],
                    mask=row_mask[:, None] & (ks < K)[None, :], other=0.0).to(tl.float32)
        sq += tl.sum(x * x, 1)
    return 1.0 / tl.sqrt(sq / K + eps)


@triton.jit
def stats_rstd(st_ptr, st_rows, row_mask, K, eps, stride_st, STATS: tl.constexpr):
    """`row_rstd` of the rows st_rows [R] of a row-statistics buffer (`store_stats`: K / STAT_COLS partial
    sums of squares a row, STATS that count rounded up to a power of 2): one load of R x STATS fp32 instead of
    the rows' K columns. NOTE: .cg reads at L2: another launch wrote them. NOTE: the load is shaped as
    `row_rstd`'s ([R, CHUNK], the columns past STATS masked: no traffic), so rstd has the layout of the rows' tiles
    and the mainloop normalises them there; from an [R, STATS] load the compiler moved the normalisation into the
    dot operand's layout, which holds the tile once per warp (sm_90, 16 rows under PDL: the code predictor's qkv
    build 128 -> 253 registers, the talker's 157 -> 255)."""
    ROWS: tl.constexpr = st_rows.shape[0]
    CHUNK: tl.constexpr = max(min(8192 // ROWS, 2048), STATS)
    gs = tl.arange(0, CHUNK)
    sq = tl.load(st_ptr + st_rows.to(tl.int64)[:, None] * stride_st + gs[None, :],
                 mask=row_mask[:, None] & (gs < K // _STAT_COLS)[None, :], other=0.0, cache_modifier=".cg")
    return 1.0 / tl.sqrt(tl.sum(sq, 1) / K + eps)


@triton.jit
def store_stats(st_ptr, y, rows, row_mask, tile, stride_st, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The row statistics of output columns tile*BLOCK_N.. of rows [BLOCK_M] (where row_mask): st[row, c] = the
    sum of y^2 over columns c*STAT_COLS..(c+1)*STAT_COLS (y [BLOCK_M, BLOCK_N]: the stored values, as fp32), so a
    norm of these rows in the next launch reads K / STAT_COLS sums a row (`stats_rstd`), not the rows."""
    G: tl.constexpr = BLOCK_N // _STAT_COLS
    sq = tl.sum(tl.reshape(y * y, [BLOCK_M, G, _STAT_COLS]), 2)  # [BLOCK_M, G]
    cs = tile * G + tl.arange(0, G)
    tl.store(st_ptr + rows.to(tl.int64)[:, None] * stride_st + cs[None, :], sq, mask=row_mask[:, None])


@triton.jit
def held_rstd(x_ptr, ids_ptr, st_ptr, x_off, row_mask, m, M, K, eps, row_step, row_first, stride_xm, stride_ids,
              stride_st, ROWS_FROM: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr, STATS: tl.constexpr):
    """`row_rstd` [BLOCK_M] of row block m (rows at x_off where row_mask), or, for ROWS < BLOCK_M (`held_rows`:
    the launch's one row is the block's first), of that row alone, read again where `row_offsets` (ROWS_FROM)
    puts it, as a scalar added to every row of the block (the others are masked). STATS > 0: from the rows'
    statistics at st_ptr instead (`stats_rstd`; X row r is statistics row r). NOTE: a scalar, not a
    tl.broadcast_to of the [1] result: in sm_90 builds the broadcast kept 25-50 more registers a thread."""
    if ROWS < BLOCK_M:
        tl.static_assert(ROWS == 1, "held_rstd: a lone row or the whole block")
        rows = m * BLOCK_M + tl.arange(0, ROWS)
        held = rows < M
        if STATS > 0:
            r = stats_rstd(st_ptr, rows * row_step + row_first, held, K, eps, stride_st, STATS)
        else:
            off = row_offsets(x_ptr, ids_ptr, rows, held, row_step, row_first, stride_xm, stride_ids, ROWS_FROM)
            r = row_rstd(x_ptr, off, held, K, eps, ROWS)
        rstd = tl.zeros([BLOCK_M], tl.float32) + tl.sum(r, 0)
    elif STATS > 0:
        rows = m * BLOCK_M + tl.arange(0, BLOCK_M)
        rstd = stats_rstd(st_ptr, rows * row_step + row_first, row_mask, K, eps, stride_st, STATS)
    else:
        rstd = row_rstd(x_ptr, x_off, row_mask, K, eps, BLOCK_M)
    return rstd


@triton.jit
def k_slice(split, K, SPLIT: tl.constexpr, BLOCK_K: tl.constexpr):
    """Columns [k_lo, k_hi) of K slice `split` of SPLIT (BLOCK_K-aligned; trailing ones may be empty)."""
    per = tl.cdiv(tl.cdiv(K, SPLIT), BLOCK_K) * BLOCK_K
    k_lo = split * per
    return k_lo, tl.minimum(k_lo + per, K)


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """With PDL (kernels/_launch.py): wait until the previous kernel has finished and its writes are visible,
    then let the next one launch. Without: nothing. Call it before the first read of anything an earlier kernel
    writes. The interpreter (no PDL; its programs run one by one, in launch order) has nothing to wait for."""
    if PDL and not _INTERPRET:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def weights_before_wait(w_ptr, w_off, k_lo, k_hi, HOLD: tl.constexpr):
    """The start of a program that reads an earlier kernel's output. HOLD > 0 (`held_columns`: the launch is a
    programmatic one): its whole weight tile [N, HOLD] (rows w_off [N], columns k_lo..k_hi, zeros past k_hi)
    loaded into registers, then `wait_for_previous`; the tile is returned for `mainloop`. HOLD 0: an ordinary
    launch, nothing to wait for (returns 0)."""
    if HOLD > 0:
        ks = k_lo + tl.arange(0, HOLD)
        held = tl.load(w_ptr + w_off[:, None] + ks[None, :], mask=(ks < k_hi)[None, :], other=0.0)
        wait_for_previous(True)
    else:
        held = 0
    return held


@triton.jit
def mainloop(x_ptr, x_off, row_mask, w_ptr, w_off, k_lo, k_hi, nw_ptr, rstd, held,
             PROLOGUE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, HOLD: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] fp32 = X[rows, ks] @ W[w rows, ks]^T over columns k_lo..k_hi (`k_slice`).

    x_off [BLOCK_M], w_off [BLOCK_N]: element offsets of the rows. NORM: X is normalised on the fly
    exactly as rms_norm_ref rounds it: cast(x * rstd) then cast(that * weight).
    HOLD > 0: W's tile is `held` ([BLOCK_N, HOLD], `weights_before_wait`): one step of HOLD columns (none
    for an empty slice), one dot over them: the same fp32 accumulation, k-step by k-step, as the BLOCK_K
    steps (the dot accumulates into acc; the zero columns past k_hi add exact zeros)."""
    STEP: tl.constexpr = HOLD if HOLD > 0 else BLOCK_K
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, STEP):
        ks = k0 + tl.arange(0, STEP)
        k_mask = ks < k_hi
        x = tl.load(x_ptr + x_off[:, None] + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)
        if HOLD > 0:
            w = held
        else:
            w = tl.load(w_ptr + w_off[:, None] + ks[None, :], mask=k_mask[None, :], other=0.0)
        if PROLOGUE == 2:
            nw = tl.load(nw_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
            x = cast(x.to(tl.float32) * rstd[:, None], x.dtype)
            x = cast(x.to(tl.float32) * nw[None, :], w.dtype)
        acc += dot(x, tl.trans(w), DOT_PRECISION)
    return acc


@triton.jit
def store_partial(part_ptr, acc, split, rows, row_mask, cols, M_PAD, NP):
    """part[split, rows, cols] = acc for the rows in row_mask (part: contiguous [SPLIT, M_PAD, NP] fp32;
    rows past M are never stored, nor read by `load_sum`)."""
    offs = (split * M_PAD + rows.to(tl.int64))[:, None] * NP + cols[None, :]
    tl.store(part_ptr + offs, acc, mask=row_mask[:, None])


@triton.jit
def arrive(cnt_ptr, arrivals):
    """Take a ticket on counter `cnt_ptr`; True in the last of `arrivals` programs, which also
    resets the counter for the next launch. NOTE: the barrier orders every thread's partial stores
    before the release of the ticket (the acquire on the last program's side orders its reads
    after)."""
    tl.debug_barrier()
    ticket = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    last = ticket == arrivals - 1
    if last:
        tl.store(cnt_ptr, 0)
    tl.debug_barrier()
    return last


@triton.jit
def load_sum(part_ptr, rows, row_mask, cols, M_PAD, NP, SPLIT: tl.constexpr):
    """sum over splits 0..SPLIT-1, in that order, of part[s, rows, cols] -> fp32 [rows, cols] (0 in rows
    outside row_mask).

    NOTE: .cg reads at L2: the partials were written by other multiprocessors."""
    offs = rows.to(tl.int64)[:, None] * NP + cols[None, :]
    mask = row_mask[:, None]
    total = tl.load(part_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
    for s in tl.static_range(1, SPLIT):
        total += tl.load(part_ptr + s * M_PAD * NP + offs, mask=mask, other=0.0, cache_modifier=".cg")
    return total
