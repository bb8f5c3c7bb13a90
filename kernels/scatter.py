"""Rows of many tensors scattered in one launch: dsts[i][rows[b]] = srcs[i][b] for every pair i.

The streaming codec writes each stream's new states back into its pool after a frame: at the released size 21 conv
and transposed-conv histories of the model dtype and a frame counter, one `index_copy_` each (22 launches a frame; 21
of them took 75 µs of the 16-row frame's 1.47 ms on the H200, perf/results/RESULTS.md, fifty-first session). Here one
launch per dtype copies them all. Program (chunk, batch row): the chunks are BLOCK elements of one pair's row, the
pairs' chunks laid end to end (`_layout`), so a launch has as many programs a row as its pairs' rows have chunks,
none idle. Each program finds its pair among the N (unrolled, N and the layout constexpr) and copies its elements; a
copy is exact, so the pool holds the bits `index_copy_` would write (`reference.scatter_rows_ref`). The pointers are
kernel arguments (a tuple of tensors), which a CUDA graph holds as captured: no table of addresses to upload.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ._launch import device_guard

BLOCK = 2048  # elements a program copies: 4 KB of bf16


@triton.jit
def _copy_chunk(dst, src, row, b, chunk, dst_strides, src_strides, COLS: tl.constexpr, SIZE: tl.constexpr,
                BLOCK: tl.constexpr):
    """Elements chunk·BLOCK.. of batch row b of src [B, SIZE / COLS, COLS] to row `row` of dst [S, SIZE / COLS, COLS]
    (strides (row, line, column) each)."""
    e = chunk * BLOCK + tl.arange(0, BLOCK)
    ok = e < SIZE
    line, col = e // COLS, e % COLS
    v = tl.load(src + b * src_strides[0] + line * src_strides[1] + col * src_strides[2], mask=ok)
    tl.store(dst + row * dst_strides[0] + line * dst_strides[1] + col * dst_strides[2], v, mask=ok)


@triton.jit
def _scatter_kernel(dsts, srcs, rows_ptr, stride_rows, dst_strides, src_strides, COLS: tl.constexpr,
                    SIZES: tl.constexpr, FIRST: tl.constexpr, N: tl.constexpr, BLOCK: tl.constexpr):
    """Program (chunk p of all pairs' chunks, batch row b): pair i holds chunks FIRST[i]..FIRST[i + 1] - 1."""
    p = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    row = tl.load(rows_ptr + b * stride_rows).to(tl.int64)
    for i in tl.static_range(N):
        if (p >= FIRST[i]) & (p < FIRST[i + 1]):
            _copy_chunk(dsts[i], srcs[i], row, b, p - FIRST[i], dst_strides[i], src_strides[i], COLS[i], SIZES[i],
                        BLOCK)


def _as_lines(t: torch.Tensor) -> tuple[int, tuple[int, int, int]]:
    """(columns, (row, line, column) strides) of t [R, ...] read as [R, lines, columns]: its last dim the columns,
    the one before (if any) the lines; a dim of one element takes stride 0."""
    assert t.dim() <= 3, f"rows of at most 2 dims, got {tuple(t.shape[1:])}"
    shape = (*t.shape[1:],)
    cols = shape[-1] if shape else 1
    line = t.stride(-2) if len(shape) == 2 and shape[0] > 1 else 0
    col = t.stride(-1) if shape and cols > 1 else 0
    return cols, (t.stride(0), line, col)


def _layout(sizes: Sequence[int]) -> tuple[int, ...]:
    """Each pair's first chunk, then the total: the pairs' chunks end to end."""
    first = [0]
    for n in sizes:
        first.append(first[-1] + triton.cdiv(n, BLOCK))
    return tuple(first)


def scatter_rows(dsts: Sequence[torch.Tensor], rows: torch.Tensor, srcs: Sequence[torch.Tensor]) -> None:
    """dsts[i][rows[b]] = srcs[i][b] for each pair in one launch: dsts[i] [S, *shape_i], srcs[i] [B, *shape_i] (rows
    of at most 2 dims, any strides), one dtype and device for all; rows [B] int, distinct as for `index_copy_` (a
    row that repeats gets one of its sources)."""
    assert len(dsts) == len(srcs) and dsts, "one source a destination, at least one pair"
    assert all(d.shape[1:] == s.shape[1:] and s.shape[0] == rows.shape[0] for d, s in zip(dsts, srcs)), \
        "each source [B, *shape] for a destination [S, *shape], B = len(rows)"
    assert len({t.dtype for t in (*dsts, *srcs)}) == 1, "one dtype for every tensor"
    lines = [(_as_lines(d), _as_lines(s)) for d, s in zip(dsts, srcs)]
    sizes = tuple(s[0].numel() for s in srcs)
    first = _layout(sizes)
    with device_guard(rows):
        _scatter_kernel[(first[-1], rows.shape[0])](
            tuple(dsts), tuple(srcs), rows, rows.stride(0), tuple(d[1] for d, _ in lines),
            tuple(s[1] for _, s in lines),
            COLS=tuple(d[0] for d, _ in lines), SIZES=sizes, FIRST=first, N=len(dsts), BLOCK=BLOCK, num_warps=4)
