"""The talker's next input after a frame's code-predictor passes, in one launch:

    out[b] = first[b] + tables[0][ids[b, 0]] + ... + tables[G-1][ids[b, G-1]]

(first = C(c0), tables = the code predictor's 15 input embeddings, ids = c1..c15), in fp32, rounded once to
the tables' dtype, in the order of torch's CUDA sum over a non-inner dim that the eager code predictor runs
(`torch.stack(rows, 1).sum(1)`, models/code_predictor.py): one thread per output, four accumulators, term i
(0 = first) added to accumulator i % 4 in turn, then ((a0 + a1) + a2) + a3; so on the GPU the fused and the
eager next input are the same bits (torch's CPU sum takes another order). Eager, that is 15 embedding
lookups, a stack and a sum, about 17 launches a step; here one, each program one row's BLOCK_H columns,
every table's row loaded at once (no dependent round trips).
The tables are separate tensors (the released weights' own), passed as one tuple argument.
Reference: code_predictor_reference.embed_sum_ref.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._cast import cast
from ._launch import device_guard

BLOCK_H = 512  # columns per program: 4 (1.7B) or 2 (0.6B) programs a row, 16 rows in flight each


@triton.jit
def _embed_sum_kernel(first_ptr, tables, ids_ptr, out_ptr, H, stride_first, stride_table, stride_ids,
                      stride_out, G: tl.constexpr, BLOCK_H: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    zero = tl.zeros([BLOCK_H], tl.float32)
    a0 = zero + tl.load(first_ptr + b * stride_first + cols, mask=mask, other=0.0).to(tl.float32)
    a1, a2, a3 = zero, zero, zero
    for g in tl.static_range(G):  # term g + 1 goes to accumulator (g + 1) % 4
        row = tl.load(ids_ptr + b * stride_ids + g).to(tl.int64)
        term = tl.load(tables[g] + row * stride_table + cols, mask=mask, other=0.0).to(tl.float32)
        if (g + 1) % 4 == 0:
            a0 += term
        elif (g + 1) % 4 == 1:
            a1 += term
        elif (g + 1) % 4 == 2:
            a2 += term
        else:
            a3 += term
    tl.store(out_ptr + b * stride_out + cols, cast(((a0 + a1) + a2) + a3, out_ptr.dtype.element_ty), mask=mask)


def embed_sum(first: torch.Tensor, tables: tuple[torch.Tensor, ...], ids: torch.Tensor,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """first [B, H] + sum over g of tables[g] [V, H] at rows ids[:, g] (ids [B, G] int, G = len(tables)) ->
    [B, H] in first.dtype, summed in fp32 in torch's CUDA order (the module docstring) and rounded once."""
    bsz, hidden = first.shape
    assert ids.shape == (bsz, len(tables)) and not ids.is_floating_point() and ids.stride(-1) == 1, \
        f"embed_sum: ids {tuple(ids.shape)}/{ids.dtype} must be int [{bsz}, {len(tables)}], last dim contiguous"
    shape = tables[0].shape
    for name, t in (("first", first), *((f"tables[{g}]", t) for g, t in enumerate(tables))):
        assert t.dtype == first.dtype and t.device == first.device and t.stride(-1) == 1, \
            f"embed_sum: {name} {t.dtype} on {t.device} (first: {first.dtype} on {first.device}), contiguous rows"
    assert shape[1] == hidden and all(t.shape == shape and t.stride() == tables[0].stride() for t in tables), \
        f"embed_sum: tables must all be [V, {hidden}] with one layout"
    if out is None:
        out = torch.empty_like(first)
    assert out.shape == first.shape and out.dtype == first.dtype and out.stride(-1) == 1, "embed_sum: bad out"
    if bsz:
        with device_guard(first):
            _embed_sum_kernel[(bsz, triton.cdiv(hidden, BLOCK_H))](
                first, tuple(tables), ids, out, hidden, first.stride(0), tables[0].stride(0), ids.stride(0),
                out.stride(0), G=len(tables), BLOCK_H=BLOCK_H)
    return out
