"""Causal varlen prefill attention over packed ragged sequences (GQA), CUDA-graph safe.

The T rows of one prefill forward are the prompts of S sequences back to back: sequence i is rows
cu_seqlens[i]..cu_seqlens[i+1]-1 and each row attends to its own sequence's rows up to itself
(block-diagonal causal). Rows at or past cu_seqlens[S] are padding: nothing is read for them and
their output rows are never written. The boundaries live on the device and the launch shape depends
only on (T, NH), so one CUDA graph per token bucket serves every mix of arrivals.

Grid (NH, G): a program takes one query head and BLOCK_M consecutive rows of ONE sequence at a time: the
sequences' row blocks are numbered one sequence after the other (sequence i has cdiv(len_i, BLOCK_M) of
them, found by a vectorised search over cu_seqlens), so a block never straddles two sequences, and program g
of a head takes blocks g, g + G, g + 2G, ... up to the last one. There are at most cdiv(T, BLOCK_M) + S
blocks; G is cdiv(T, BLOCK_M) + min(S, SPARE_PROGRAMS), so a bucket holding a few prompts launches few
programs that find no block (a 61-row prompt in the 64-row bucket of a 64-sequence head: 17 per head, not
65, which filled waves of their own). The program runs an online softmax (fp32, exp2) over its sequence's
keys from the sequence's first row to its own last row, in key blocks that start at the sequence's first
row. So a row's arithmetic depends only on its own sequence (and the launch config, tuned once per head
shape): never on where its prompt sits in the pack or what the other prompts hold — the prefill is
batch-invariant. K/V come from the forward's own packed k, v (query head h reads kv head h // (NH / KVH));
any row and head strides (v is a view of the fused qkv GEMM).

Chunked prefill (`prefix`, a `PagedPrefix`): sequence 0's rows are a piece of a prompt whose first P
rows are already in the paged KV cache (P and the sequence's page table on the device, P = 0 allowed,
so a captured graph serves whole prompts and pieces alike). Its rows also attend to those P keys (all
earlier than themselves), read through the page table before the packed keys, in one online softmax.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._cast import cast, dot
from ._launch import device_guard
from .autotune import pick
from .reference import PagedPrefix

_NEG = tl.constexpr(-1.0e30)  # finite "-inf": a row's fully masked key blocks give no inf - inf
_LOG2E = 1.4426950408889634


@triton.jit
def _attend_block(q, k, v, allowed, m_i, l_i, acc, scale_log2, DOT_PRECISION: tl.constexpr):
    """One key block [BLOCK_N, BLOCK_D] into the rows' online softmax (m_i, l_i, acc); allowed
    [BLOCK_M, BLOCK_N] masks the keys each row may see."""
    s = tl.where(allowed, dot(q, tl.trans(k), DOT_PRECISION) * scale_log2, _NEG)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.where(allowed, tl.exp2(s - m_new[:, None]), 0.0)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(cast(p, v.dtype), v, DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _find_block(cu_ptr, stride_cu, num_seqs, pid, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr):
    """(sequence, its row block, number of blocks) of block `pid` < number of blocks: the sequences'
    row blocks numbered one sequence after the other (sequence i has cdiv(cu[i+1] - cu[i], BLOCK_M))."""
    seq = tl.zeros([], tl.int32)
    block = tl.zeros([], tl.int32)
    base = tl.zeros([], tl.int32)  # blocks of the sequences before this search step
    for s0 in range(0, num_seqs, BLOCK_S):
        idx = s0 + tl.arange(0, BLOCK_S)
        ok = idx < num_seqs
        lens = (tl.load(cu_ptr + (idx + 1) * stride_cu, mask=ok, other=0)
                - tl.load(cu_ptr + idx * stride_cu, mask=ok, other=0)).to(tl.int32)  # [BLOCK_S]
        blocks = (lens + BLOCK_M - 1) // BLOCK_M
        after = base + tl.cumsum(blocks, 0)  # [BLOCK_S] blocks up to and including each sequence
        mine = ok & (after - blocks <= pid) & (pid < after)
        seq += tl.sum(tl.where(mine, idx, 0), 0)
        block += tl.sum(tl.where(mine, pid - (after - blocks), 0), 0)
        base += tl.sum(blocks, 0)
    return seq, block, base


@triton.jit(do_not_specialize=["num_seqs"])
def _prefill_attention_kernel(
    # pointers
    q_ptr, k_ptr, v_ptr, cu_ptr, out_ptr,
    kc_ptr, vc_ptr, table_ptr, plen_ptr,  # sequence 0's paged prefix (read when HAS_PREFIX)
    # sizes
    num_seqs, scale_log2,
    # strides
    stride_cu,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on, stride_oh,
    stride_kcp, stride_kcs, stride_kch, stride_vcp, stride_vcs, stride_vch, stride_table,
    # meta
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,  # boundaries compared per search step (any S: the search loops)
    HAS_PREFIX: tl.constexpr, PAGE_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    head = tl.program_id(0)
    kv_head = head // GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    num_blocks = _find_block(cu_ptr, stride_cu, num_seqs, 0, BLOCK_M, BLOCK_S)[2]
    for pid in range(tl.program_id(1), num_blocks, tl.num_programs(1)):
        seq, block, _ = _find_block(cu_ptr, stride_cu, num_seqs, pid, BLOCK_M, BLOCK_S)
        lo = tl.load(cu_ptr + seq * stride_cu).to(tl.int32)  # the sequence's first row
        end = tl.load(cu_ptr + (seq + 1) * stride_cu).to(tl.int32)
        first = lo + block * BLOCK_M
        rows = first + tl.arange(0, BLOCK_M)  # [BLOCK_M]
        row_ok = rows < end
        hi = tl.minimum(first + BLOCK_M, end)  # keys past the block's last valid row are never seen

        q = tl.load(q_ptr + rows.to(tl.int64)[:, None] * stride_qn + head * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
        m_i = tl.full([BLOCK_M], _NEG, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        if HAS_PREFIX:  # sequence 0 also sees the P keys before its rows, from the cache
            p_hi = tl.where(seq == 0, tl.load(plen_ptr).to(tl.int32), 0)
            for n0 in range(0, p_hi, BLOCK_N):
                pos = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] positions in the prompt
                pos_ok = pos < p_hi
                page = tl.load(table_ptr + (pos // PAGE_SIZE) * stride_table, mask=pos_ok, other=0).to(tl.int64)
                off = pos % PAGE_SIZE
                kv_mask = pos_ok[:, None] & d_mask[None, :]
                k = tl.load(kc_ptr + (page * stride_kcp + off * stride_kcs)[:, None] + kv_head * stride_kch
                            + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
                v = tl.load(vc_ptr + (page * stride_vcp + off * stride_vcs)[:, None] + kv_head * stride_vch
                            + offs_d[None, :], mask=kv_mask, other=0.0)
                m_i, l_i, acc = _attend_block(q, k, v, row_ok[:, None] & pos_ok[None, :], m_i, l_i, acc,
                                              scale_log2, DOT_PRECISION)
        for n0 in range(lo, hi, BLOCK_N):
            keys = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N]
            key_ok = keys < hi
            kv_mask = key_ok[:, None] & d_mask[None, :]
            k = tl.load(k_ptr + keys.to(tl.int64)[:, None] * stride_kn + kv_head * stride_kh
                        + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
            v = tl.load(v_ptr + keys.to(tl.int64)[:, None] * stride_vn + kv_head * stride_vh
                        + offs_d[None, :], mask=kv_mask, other=0.0)
            allowed = (keys[None, :] <= rows[:, None]) & key_ok[None, :]  # [BLOCK_M, BLOCK_N]
            m_i, l_i, acc = _attend_block(q, k, v, allowed, m_i, l_i, acc, scale_log2, DOT_PRECISION)

        out = acc / tl.maximum(l_i, 1e-30)[:, None]  # every valid row saw at least itself
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_on + head * stride_oh + offs_d[None, :],
                 cast(out, out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_mask[None, :])


class PrefillConfig(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


_CANDIDATES = [PrefillConfig(m, n, w, s) for m, n, w in ((64, 64, 4), (128, 64, 8), (64, 32, 4),
                                                          (128, 32, 4)) for s in (2, 3)]
_INTERPRET_CONFIG = PrefillConfig(16, 16, 1, 1)  # small blocks: the tests' short prompts span several
# sequences compared per step of the block search: the default 64 slots' sampling head in one step (each step is
# a dependent round trip to memory on every program's critical path)
_BLOCK_S = 64
SPARE_PROGRAMS = 16  # programs per head beyond cdiv(T, BLOCK_M): more sequences than that loop (module doc)


def _launch(cfg: PrefillConfig, q, k, v, cu_seqlens, scale, out, prefix: PagedPrefix | None) -> None:
    rows, num_heads, head_dim = q.shape
    kc, vc, table, plen = prefix if prefix is not None else (k[None], v[None], cu_seqlens, cu_seqlens)
    seqs = cu_seqlens.shape[0] - 1
    grid = (num_heads, triton.cdiv(rows, cfg.block_m) + min(seqs, SPARE_PROGRAMS))  # blocks <= cdiv(T, BLOCK_M) + S
    _prefill_attention_kernel[grid](
        q, k, v, cu_seqlens, out,
        kc, vc, table, plen,
        seqs, scale * _LOG2E,
        cu_seqlens.stride(0),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2), table.stride(0),
        GROUP=num_heads // k.shape[1], HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_S=_BLOCK_S,
        HAS_PREFIX=prefix is not None, PAGE_SIZE=kc.shape[1] if prefix is not None else 1,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                      scale: float, out: torch.Tensor | None = None, prefix: PagedPrefix | None = None
                      ) -> torch.Tensor:
    """Causal attention within each packed sequence (GQA); `prefill_attention_ref`.

    q: [T, NH, D]; k, v: [T, KVH, D] (NH % KVH == 0, same dtype; any row/head strides, last dim
    contiguous). cu_seqlens: [S+1] int32/int64 on q's device with 0 = cu[0] <= cu[1] <= ... <=
    cu[S] <= T (not checked: no host sync); sequence i = rows cu[i]..cu[i+1]-1, rows >= cu[S] are
    padding. out: [T, NH, D] in q's dtype to write into (default: a new uninitialised tensor).
    prefix: sequence 0's earlier keys in a paged cache (`PagedPrefix`; caches in q's dtype, contiguous
    [pages, page_size, KVH, D]; its length and page ids not checked: no host sync).
    Returns out with every valid row written; padding rows keep whatever out held.
    """
    rows, num_heads, head_dim = q.shape
    assert k.dim() == 3 and v.shape == k.shape and k.shape[0] == rows and k.shape[2] == head_dim, \
        f"k {tuple(k.shape)} / v {tuple(v.shape)} must be [{rows}, KVH, {head_dim}]"
    assert num_heads % k.shape[1] == 0, f"{num_heads} q heads not a multiple of {k.shape[1]} kv heads"
    assert k.dtype == q.dtype and v.dtype == q.dtype, \
        f"q/k/v dtypes differ: {q.dtype} {k.dtype} {v.dtype}"
    assert head_dim >= 16, f"head_dim {head_dim} < 16 (tl.dot minimum)"
    assert cu_seqlens.dim() == 1 and cu_seqlens.shape[0] >= 2 and cu_seqlens.dtype in (
        torch.int32, torch.int64), f"cu_seqlens must be int32/int64 [S+1], got {cu_seqlens.dtype} " \
        f"{tuple(cu_seqlens.shape)}"
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    assert out.shape == q.shape and out.dtype == q.dtype, \
        f"out {out.dtype} {tuple(out.shape)} must be {q.dtype} {tuple(q.shape)}"
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("cu_seqlens", cu_seqlens)):
        assert t.device == q.device, f"{name} on {t.device}, q on {q.device}"
        assert name == "cu_seqlens" or t.stride(-1) == 1, f"{name}: last dim must be contiguous"
    if prefix is not None:
        _check_prefix(prefix, q, k)
    if rows == 0:
        return out
    args = (q, k, v, cu_seqlens, scale, out, prefix)
    with device_guard(q):  # the tuning launches too
        if q.is_cuda:
            key = ("prefill_attention", head_dim, num_heads // k.shape[1], q.dtype, prefix is not None)
            cfg = pick(key, _CANDIDATES, lambda c: _launch(c, *args), q.device)
        else:
            cfg = _INTERPRET_CONFIG
        _launch(cfg, *args)
    return out


def _check_prefix(prefix: PagedPrefix, q: torch.Tensor, k: torch.Tensor) -> None:
    kc, vc, table, length = prefix
    assert kc.dim() == 4 and vc.shape == kc.shape and kc.shape[2:] == k.shape[1:], \
        f"prefix caches {tuple(kc.shape)} / {tuple(vc.shape)} must be [pages, page_size, {k.shape[1]}, {k.shape[2]}]"
    assert kc.dtype == q.dtype and vc.dtype == q.dtype, f"prefix caches {kc.dtype} / {vc.dtype}, q {q.dtype}"
    assert kc.stride(-1) == 1 and vc.stride(-1) == 1, "prefix caches: last dim must be contiguous"
    assert table.dim() == 1 and length.numel() == 1, \
        f"prefix table must be [max_pages], length one value: {tuple(table.shape)}, {tuple(length.shape)}"
    for name, t in (("prefix k", kc), ("prefix v", vc), ("prefix table", table), ("prefix length", length)):
        assert t.device == q.device, f"{name} on {t.device}, q on {q.device}"
