"""Paged decode attention (one query token per sequence, GQA), split-K / flash-decoding.

Phase 1, grid (B, KVH, num_splits): one program per (sequence, kv head, split) loads the GROUP
query heads that share the kv head (padded to 16 rows for tl.dot) and runs an online softmax over
its share of the row's context, writing an unnormalised partial (acc, max, sum) in fp32.
Each row's *actual* context is divided evenly among the splits in-kernel, so short and long
contexts both spread over the whole grid while the launch shape depends only on (B, max_pages); where the
rows alone fill the GPU a split takes at least `DecodeConfig.min_split` keys (`min_split_for`), so their
short contexts are one split each.
Phase 2, grid (B, NH): merges the partials (log-sum-exp) and writes the output. Splits past the row's
context (`used_splits`: a short context in a wide block table, e.g. 300 keys of the engine's 10,240 at
one row: 10 of 64 splits) store nothing and the merge reads only the used ones; a row with
context_len 0 has none and returns zeros. With one split a row (`num_splits_for`: the code
predictor's 16 positions, or few pages over many rows) one launch, grid (B, KVH), does both: each program
normalises its own result (`_decode_single_kernel`, the values phase 2 makes of one partial).
CUDA-graph safe: no host syncs, no data-dependent shapes; split counts are not specialised on.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._cast import cast, dot
from ._launch import device_guard, num_sms
from .autotune import batch_invariant, pick

_NEG = tl.constexpr(-1.0e30)  # finite "-inf": empty splits merge without inf - inf = nan
_MAX_SPLITS = 64
_LOG2E = 1.4426950408889634


@triton.jit
def split_length(ctx, num_splits, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr):
    """Keys per split of a row with ctx keys: its context spread evenly over num_splits splits, at least MIN_SPLIT
    keys each (`DecodeConfig.min_split`), in BLOCK_N-aligned chunks."""
    return tl.cdiv(tl.maximum(tl.cdiv(ctx, num_splits), MIN_SPLIT), BLOCK_N) * BLOCK_N


@triton.jit
def used_splits(context_lens_ptr, b, stride_ctx, num_splits, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr):
    """How many of row b's num_splits splits hold keys (the first ones; 0 for an empty context): the others store
    no partial and the merge reads none of theirs."""
    ctx = tl.load(context_lens_ptr + b * stride_ctx)
    return tl.cdiv(ctx, split_length(ctx, num_splits, BLOCK_N, MIN_SPLIT))


@triton.jit
def _attend_split(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, num_splits, scale_log2,
                  stride_ctx, stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                  stride_bt, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr,
                  BLOCK_G: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    """Program (row b, kv head, split)'s online softmax over its share of the row's context -> (max, sum [BLOCK_G],
    unnormalised acc [BLOCK_G, BLOCK_D] in fp32, the q heads [BLOCK_G] and which of them are real)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + b * stride_ctx)
    split_len = split_length(ctx, num_splits, BLOCK_N, MIN_SPLIT)
    start = split * split_len
    end = tl.minimum(start + split_len, ctx)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    q = cast(q, k_cache_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_G], _NEG, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    for tok0 in range(start, end, BLOCK_N):
        toks = tok0 + offs_n
        t_mask = toks < end
        page = tl.load(bt_row + toks // PAGE_SIZE, mask=t_mask, other=0).to(tl.int64)
        slot = toks % PAGE_SIZE
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + (page * stride_kp + slot * stride_ks + kvh * stride_kh)[:, None]
                    + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_cache_ptr + (page * stride_vp + slot * stride_vs + kvh * stride_vh)[:, None]
                    + offs_d[None, :], mask=kv_mask, other=0.0)
        s = dot(q, tl.trans(k), DOT_PRECISION) * scale_log2  # [BLOCK_G, BLOCK_N]
        s = tl.where(t_mask[None, :], s, _NEG)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + dot(cast(p, v.dtype), v, DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc, heads, g_mask


@triton.jit
def _normalised(acc, total):
    """The attention output from an online softmax's acc and its sum of weights (broadcast to acc): acc / sum,
    zeros where nothing was weighed (an empty context). Phase 2's merge and the one-split kernel both end here."""
    return tl.where(total > 0.0, acc / tl.maximum(total, 1e-30), 0.0)


@triton.jit
def store_partial(part_acc_ptr, part_max_ptr, part_sum_ptr, m_i, l_i, acc, heads, g_mask, num_splits,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr):
    """Program (row b, kv head, split)'s unnormalised partial (max, sum, acc of its GROUP heads) into the fp32
    partials, contiguous [B, NH, num_splits, (HEAD_DIM)]."""
    offs_d = tl.arange(0, BLOCK_D)
    num_heads = tl.num_programs(1) * GROUP
    part = (tl.program_id(0).to(tl.int64) * num_heads + heads) * num_splits + tl.program_id(2)  # [BLOCK_G]
    tl.store(part_max_ptr + part, m_i, mask=g_mask)
    tl.store(part_sum_ptr + part, l_i, mask=g_mask)
    tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc,
             mask=g_mask[:, None] & (offs_d < HEAD_DIM)[None, :])


@triton.jit
def store_output(out_ptr, b, heads, h_mask, out, stride_ob, stride_oh, HEAD_DIM: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    """Row b's attention output of a kv head's q `heads` ([BLOCK_G], those in h_mask; out fp32 [BLOCK_G, BLOCK_D])
    in out's dtype."""
    offs_d = tl.arange(0, BLOCK_D)
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
             cast(out, out_ptr.dtype.element_ty), mask=h_mask[:, None] & (offs_d < HEAD_DIM)[None, :])


@triton.jit
def store_head(out_ptr, b, head, out, stride_ob, stride_oh, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Row b's attention output of q head `head` (out fp32 [BLOCK_D], a merge's result) in out's dtype."""
    offs_d = tl.arange(0, BLOCK_D)
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + head * stride_oh + offs_d, cast(out, out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_split_kernel(
    # pointers
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    part_acc_ptr, part_max_ptr, part_sum_ptr,
    # sizes
    num_splits, scale_log2,
    # strides
    stride_ctx,  # context_lens may be a strided column of the engine's row metadata
    stride_qb, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_bt,
    # meta
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr,  # BLOCK_G >= 16: the smallest tl.dot M
    PAGE_SIZE: tl.constexpr,  # constexpr so that token -> (page, offset) is a shift and a mask
    BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    m_i, l_i, acc, heads, g_mask = _attend_split(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, num_splits, scale_log2, stride_ctx,
        stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_bt,
        HEAD_DIM, BLOCK_D, GROUP, BLOCK_G, PAGE_SIZE, BLOCK_N, MIN_SPLIT, DOT_PRECISION)
    used = used_splits(context_lens_ptr, tl.program_id(0), stride_ctx, num_splits, BLOCK_N, MIN_SPLIT)
    if tl.program_id(2) < used:  # a split past the context stores none
        store_partial(part_acc_ptr, part_max_ptr, part_sum_ptr, m_i, l_i, acc, heads, g_mask, num_splits,
                      HEAD_DIM, BLOCK_D, GROUP)


@triton.jit
def _decode_single_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr,
    scale_log2,
    stride_ctx, stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_bt,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One split a row (grid (B, KVH)): the program normalises its own result and stores the output, the values
    phase 2 would merge from its one partial (acc / sum; 0 for an empty context), without the second launch."""
    m_i, l_i, acc, heads, g_mask = _attend_split(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, 1, scale_log2, stride_ctx,
        stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_bt,
        HEAD_DIM, BLOCK_D, GROUP, BLOCK_G, PAGE_SIZE, BLOCK_N, MIN_SPLIT, DOT_PRECISION)
    store_output(out_ptr, tl.program_id(0), heads, g_mask, _normalised(acc, l_i[:, None]), stride_ob, stride_oh,
                 HEAD_DIM, BLOCK_D)


@triton.jit
def merge_splits(part_acc_ptr, part_max_ptr, part_sum_ptr, row, num_splits, used,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """Output [BLOCK_D] fp32 of partial row `row` (= b * NH + head): its first `used` of num_splits partials
    (`used_splits`) merged (log-sum-exp), zeros when none. The bits of a merge over all num_splits with the unused
    ones empty: an empty split weighs exactly 0 and scales by exactly 1. NOTE: .cg loads read at L2, so that a
    program of the split launch itself may merge what other multiprocessors wrote (kernels/talker_attention.py)."""
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    m_run = tl.full([], _NEG, tl.float32)
    l_run = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for s0 in range(0, used, BLOCK_S):
        splits = s0 + tl.arange(0, BLOCK_S)
        s_mask = splits < used
        part = row * num_splits + splits
        m = tl.load(part_max_ptr + part, mask=s_mask, other=_NEG, cache_modifier=".cg")
        l = tl.load(part_sum_ptr + part, mask=s_mask, other=0.0, cache_modifier=".cg")
        o = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=s_mask[:, None] & d_mask[None, :], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m_run, tl.max(m, 0))
        w = tl.exp2(m - m_new)
        alpha = tl.exp2(m_run - m_new)
        l_run = l_run * alpha + tl.sum(l * w, 0)
        acc = acc * alpha + tl.sum(o * w[:, None], 0)
        m_run = m_new
    return _normalised(acc, l_run)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    # pointers
    part_acc_ptr, part_max_ptr, part_sum_ptr, out_ptr, context_lens_ptr,
    # sizes
    num_splits,
    # strides
    stride_ob, stride_oh, stride_ctx,
    # meta
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
    MIN_SPLIT: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = b.to(tl.int64) * tl.num_programs(1) + h
    used = used_splits(context_lens_ptr, b, stride_ctx, num_splits, BLOCK_N, MIN_SPLIT)
    out = merge_splits(part_acc_ptr, part_max_ptr, part_sum_ptr, row, num_splits, used, HEAD_DIM,
                       BLOCK_D, BLOCK_S)
    store_head(out_ptr, b, h, out, stride_ob, stride_oh, HEAD_DIM, BLOCK_D)


class DecodeConfig(NamedTuple):
    """A paged decode attention launch: keys per block, warps, pipeline stages, and the fewest keys a split takes
    where the rows fill the GPU (`min_split_for`; the talker's one launch runs a context of up to min_split keys in
    one split whose program normalises it: no partials, no ticket, no merge; kernels/talker_attention.py)."""
    block_n: int
    num_warps: int
    num_stages: int
    min_split: int = 512


_CANDIDATES = [DecodeConfig(n, w, s) for n in (64, 32, 128) for w in (4, 8) for s in (2, 3)]
_INTERPRET_CONFIG = DecodeConfig(16, 1, 1, 16)  # 16-key splits: the tests' short contexts span several


def num_splits_for(batch: int, num_kv_heads: int, max_pages: int, page_size: int, block_n: int,
                   device: torch.device) -> int:
    """Splits per (row, kv head): about 4 waves of programs over the SMs, at most one per BLOCK_N
    tokens of the longest possible context. Static given (B, max_pages): graph-safe. Under
    `batch_invariant()`, the count of batch 1 for every batch (it sets where a row's sums split)."""
    want = triton.cdiv(4 * num_sms(device), _programs(batch, num_kv_heads))
    return max(1, min(want, _MAX_SPLITS, triton.cdiv(max_pages * page_size, block_n)))


def min_split_for(cfg: DecodeConfig, batch: int, num_kv_heads: int, device: torch.device) -> int:
    """The fewest keys a split takes (`split_length`'s MIN_SPLIT): cfg.min_split where the (row, kv head) pairs
    alone give at least half the SMs a program, so that splitting a short context would only add partials and a
    merge; else one key block, the few rows' contexts spread over the splits (at one row on an H100 a 300-key
    context in one split took 9.4 us a layer against 8.7 spread over the splits; at 16 rows 14.9 against 15.7:
    perf/results/RESULTS.md, forty-sixth session; the rows between are not measured). Under `batch_invariant()`,
    batch 1's."""
    return cfg.min_split if 2 * _programs(batch, num_kv_heads) >= num_sms(device) else cfg.block_n


def _programs(batch: int, num_kv_heads: int) -> int:
    """(row, kv head) pairs of a launch, as the split rules count them: batch 1's under `batch_invariant()`."""
    return max(1, (1 if batch_invariant() else batch) * num_kv_heads)


def tuning_key(name: str, q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor) -> tuple:
    """The `pick` key of a paged decode attention launch: its shape class and the most keys its block tables hold
    (static per caller: the talker's sequence_pages x page_size, the code predictor's one page of 16), never the
    batch. Without the width the code predictor's 16-key contexts took the config tuned over the talker's
    thousands: a wide block's masked loads, 13.1 us a launch against 4.8 at 64 rows (H200), 75 launches a step."""
    return (name, q.shape[2], k_cache.shape[1], q.shape[1] // k_cache.shape[2], q.dtype, k_cache.dtype,
            block_tables.shape[1] * k_cache.shape[1])


def _operands(q, k_cache, v_cache, block_tables, context_lens) -> tuple[tuple, tuple]:
    """The attention kernels' input tensors and their strides, in the kernels' argument order."""
    return ((q, k_cache, v_cache, block_tables, context_lens),
            (context_lens.stride(0), q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
             v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0)))


def _meta(cfg: DecodeConfig, q, k_cache) -> dict:
    """The attention kernels' constexprs and launch options for config cfg."""
    num_heads, head_dim = q.shape[1:]
    group = num_heads // k_cache.shape[2]
    return dict(HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), GROUP=group,
                BLOCK_G=max(16, triton.next_power_of_2(group)), PAGE_SIZE=k_cache.shape[1],
                BLOCK_N=cfg.block_n, MIN_SPLIT=min_split_for(cfg, q.shape[0], k_cache.shape[2], q.device),
                DOT_PRECISION="ieee" if k_cache.dtype == torch.float32 else "tf32",
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _splits(cfg: DecodeConfig, q, k_cache, block_tables) -> int:
    return num_splits_for(q.shape[0], k_cache.shape[2], block_tables.shape[1], k_cache.shape[1], cfg.block_n,
                          q.device)


def partials(bsz: int, num_heads: int, splits: int, head_dim: int, device: torch.device
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Phase 1's fp32 partials, uninitialised: acc [B, NH, splits, D], max and sum [B, NH, splits] (a split past
    its row's context leaves its entries as they are: the merge does not read them)."""
    part_acc = torch.empty(bsz, num_heads, splits, head_dim, dtype=torch.float32, device=device)
    part_max = torch.empty(bsz, num_heads, splits, dtype=torch.float32, device=device)
    return part_acc, part_max, torch.empty_like(part_max)


def split_launch(cfg: DecodeConfig, q, k_cache, v_cache, block_tables, context_lens, scale):
    """Phase 1's grid, its fp32 partials (acc, max, sum), its positional arguments and its meta
    (constexprs and launch options) for config cfg."""
    bsz, num_heads, head_dim = q.shape
    splits = _splits(cfg, q, k_cache, block_tables)
    parts = partials(bsz, num_heads, splits, head_dim, q.device)
    inputs, strides = _operands(q, k_cache, v_cache, block_tables, context_lens)
    args = (*inputs, *parts, splits, scale * _LOG2E, *strides)
    return (bsz, k_cache.shape[2], splits), parts, args, _meta(cfg, q, k_cache)


def _launch(cfg: DecodeConfig, q, k_cache, v_cache, block_tables, context_lens, scale, out):
    if _splits(cfg, q, k_cache, block_tables) == 1:  # the code predictor's 16 positions; short contexts of many rows
        inputs, strides = _operands(q, k_cache, v_cache, block_tables, context_lens)
        _decode_single_kernel[(q.shape[0], k_cache.shape[2])](
            *inputs, out, scale * _LOG2E, *strides, out.stride(0), out.stride(1), **_meta(cfg, q, k_cache))
        return
    grid, parts, args, meta = split_launch(cfg, q, k_cache, v_cache, block_tables, context_lens,
                                           scale)
    _decode_split_kernel[grid](*args, **meta)
    block_d = meta["BLOCK_D"]
    _decode_reduce_kernel[(q.shape[0], q.shape[1])](
        *parts, out, context_lens,
        grid[2],
        out.stride(0), out.stride(1), context_lens.stride(0),
        HEAD_DIM=meta["HEAD_DIM"], BLOCK_D=block_d, BLOCK_S=16, BLOCK_N=cfg.block_n, MIN_SPLIT=meta["MIN_SPLIT"],
        num_warps=4 if block_d >= 256 else 2,
    )


def check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor) -> None:
    """The shape / dtype / device contract of `paged_decode_attention`'s inputs."""
    bsz, num_heads, head_dim = q.shape
    assert k_cache.dim() == 4 and v_cache.shape == k_cache.shape, \
        f"k_cache {tuple(k_cache.shape)} / v_cache {tuple(v_cache.shape)} must match, 4-D"
    num_kv = k_cache.shape[2]
    assert k_cache.shape[3] == head_dim, f"cache head_dim {k_cache.shape[3]} != q's {head_dim}"
    assert num_heads % num_kv == 0, f"{num_heads} q heads not a multiple of {num_kv} kv heads"
    assert k_cache.dtype == v_cache.dtype, "k_cache and v_cache dtypes differ"
    assert head_dim >= 16, f"head_dim {head_dim} < 16 (tl.dot minimum)"
    assert block_tables.dim() == 2 and block_tables.shape[0] == bsz, \
        f"block_tables {tuple(block_tables.shape)} must be [{bsz}, max_pages]"
    assert block_tables.dtype == torch.int32 and context_lens.dtype == torch.int32, \
        f"block_tables/context_lens must be int32, got {block_tables.dtype}/{context_lens.dtype}"
    assert context_lens.shape == (bsz,), f"context_lens {tuple(context_lens.shape)} != ({bsz},)"
    assert block_tables.stride(1) == 1, "block_tables rows must be contiguous"
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        assert t.stride(-1) == 1, f"{name}: last dim must be contiguous"
    for t in (k_cache, v_cache, block_tables, context_lens):
        assert t.device == q.device, f"tensor on {t.device}, q on {q.device}"


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """One query token per sequence over its paged context (GQA); `paged_decode_attention_ref`.

    q: [B, NH, D]; k_cache, v_cache: [num_pages, page_size, KVH, D] (NH % KVH == 0);
    block_tables: [B, max_pages] int32 (unused entries any valid page id);
    context_lens: [B] int32, 0 <= len <= max_pages * page_size (not checked: no host sync).
    Returns [B, NH, D] in q.dtype; rows with context_len 0 are zeros.
    """
    check_inputs(q, k_cache, v_cache, block_tables, context_lens)
    bsz, num_heads, head_dim = q.shape
    out = torch.empty(bsz, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if bsz == 0:
        return out
    args = (q, k_cache, v_cache, block_tables, context_lens, scale, out)
    with device_guard(q):  # the tuning launches too: q may sit on another GPU than the current one
        if q.is_cuda:
            cfg = pick(tuning_key("paged_decode", q, k_cache, block_tables), _CANDIDATES,
                       lambda c: _launch(c, *args), q.device)
        else:
            cfg = _INTERPRET_CONFIG
        _launch(cfg, *args)
    return out
