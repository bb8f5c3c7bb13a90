"""The first launch of a talker decode layer: RMSNorm -> QKV GEMM -> QK-norm -> RoPE -> K/V store
into the paged cache, in one kernel (the attention runs next, kernels/talker_attention.py).

Grid (row blocks, QKV column tiles, K slices) runs the split-K skinny GEMM of
code_predictor_gemm.py into fp32 partials (`qkv_group_partials`, shared with the code predictor's
qkv_attention); the last program of each (row block, kv head) group (its GROUP q heads, its k and
v columns, every slice) runs the epilogue for those rows: sum the partials, round to the model
dtype, QK-norm and RoPE at each row's position (cos/sin gathered from the [max_pos, D] tables),
rotated q to `out`, k and v to the row's cache slot (slot < 0: a padding row, nothing stored). A launch
of at most FEW_ROWS rows (`held_rows`: the one-row step) holds only those in its norm statistics and its
epilogue, and loads all its heads before the first store, as the code predictor's does.
Roundings are the eager layer's (models/layers.py), through the code predictor's `_norm_rope_halves`:
bf16 GEMM output, rms_norm_ref's two roundings, rotary products rounded when the tables have the
activation dtype (kernels/rotary.py). Torch reference: talker_reference.qkv_rope_store_ref.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._cast import cast
from ._launch import device_guard
from .autotune import pick
from .code_predictor_attention import (_group_heads, _store_halves, _store_heads_in_turn, qkv_candidates,
                                       qkv_group_partials, rope_halves)
from .code_predictor_gemm import (BLOCK_M, GemmConfig, check_stats, counters_needed, dot_precision,
                                  held_launch, held_rows, interpret_config, row_blocks, stats_width)


@triton.jit
def _group_epilogue(part_ptr, q_ptr, k_ptr, v_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, pos_ptr,
                    slot_ptr, m, M, rows, row_mask, g, eps, M_PAD, NP,
                    stride_q, stride_pos, stride_slot, stride_kp, stride_ks, stride_kh,
                    stride_vp, stride_vs, stride_vh, stride_cos, stride_sin,
                    DT: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_KV: tl.constexpr,
                    D: tl.constexpr, PAGE_SIZE: tl.constexpr, SPLIT: tl.constexpr,
                    ROUND: tl.constexpr, BLOCK_M: tl.constexpr, EPI_ROWS: tl.constexpr):
    GROUP: tl.constexpr = NUM_HEADS // NUM_KV
    HALF: tl.constexpr = D // 2
    if EPI_ROWS < BLOCK_M:  # a launch of at most EPI_ROWS rows: the epilogue holds only those
        rows = m * BLOCK_M + tl.arange(0, EPI_ROWS)
        row_mask = rows < M
    r64 = rows.to(tl.int64)
    pos = tl.load(pos_ptr + r64 * stride_pos, mask=row_mask, other=0).to(tl.int64)  # [R]: EPI_ROWS or BLOCK_M
    slot = tl.load(slot_ptr + r64 * stride_slot, mask=row_mask, other=-1).to(tl.int64)
    d = tl.arange(0, HALF)
    c1, c2, s1, s2 = rope_halves(cos_ptr, sin_ptr, pos, row_mask, stride_cos, stride_sin, HALF)
    keep = row_mask & (slot >= 0)
    page, offset = slot // PAGE_SIZE, slot % PAGE_SIZE  # [R] each (junk where not kept)
    k_rows = page * stride_kp + offset * stride_ks + g * stride_kh
    v_rows = page * stride_vp + offset * stride_vs + g * stride_vh
    dd = tl.arange(0, D)
    if EPI_ROWS < BLOCK_M:  # every load before the first store (`_group_heads`)
        q1, q2, k1, k2, v = _group_heads(part_ptr, rows, row_mask, g, qn_ptr, kn_ptr, c1, c2, s1, s2, eps, M_PAD,
                                         NP, DT, NUM_HEADS, NUM_KV, D, SPLIT, ROUND)
        at = r64[:, None, None] * stride_q + ((g * GROUP + tl.arange(0, GROUP)) * D)[None, :, None] + d[None, None, :]
        _store_halves(q_ptr, at, q1, q2, row_mask[:, None, None], HALF)
        _store_halves(k_ptr, k_rows[:, None, None] + d[None, None, :], k1, k2, keep[:, None, None], HALF)
    else:
        v = _store_heads_in_turn(part_ptr, q_ptr, stride_q, k_ptr, k_rows, keep[:, None], rows, row_mask, g,
                                 qn_ptr, kn_ptr, c1, c2, s1, s2, eps, M_PAD, NP, DT, NUM_HEADS, NUM_KV, D, SPLIT, ROUND)
    tl.store(v_ptr + v_rows[:, None] + dd[None, :], cast(v, DT), mask=keep[:, None])


@triton.jit(do_not_specialize=["M", "M_PAD"])
def _talker_qkv_kernel(
    # pointers
    x_ptr, nw_ptr, w_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, k_ptr, v_ptr,
    q_ptr, part_ptr, cnt_ptr, st_ptr,
    # sizes
    M, K, eps, M_PAD,
    # strides
    stride_xm, stride_w, stride_q, stride_pos, stride_slot, stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh, stride_cos, stride_sin, stride_st,
    # meta
    NUM_HEADS: tl.constexpr, NUM_KV: tl.constexpr, D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    ROUND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, EPI_ROWS: tl.constexpr,
    HOLD: tl.constexpr, STATS: tl.constexpr,
):
    rows, row_mask, _, g, last = qkv_group_partials(
        x_ptr, x_ptr, nw_ptr, w_ptr, part_ptr, cnt_ptr, st_ptr, tl.program_id(0), tl.program_id(1),
        tl.program_id(2), 0, M, K, eps, M_PAD, stride_xm, 0, stride_w, stride_st, NUM_HEADS, NUM_KV, D, BLOCK_M,
        BLOCK_N, BLOCK_K, SPLIT, DOT_PRECISION, False, EPI_ROWS, HOLD, STATS)
    NP: tl.constexpr = (NUM_HEADS + 2 * NUM_KV) * D
    if last:
        _group_epilogue(part_ptr, q_ptr, k_ptr, v_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, pos_ptr,
                        slot_ptr, tl.program_id(0), M, rows, row_mask, g, eps, M_PAD, NP,
                        stride_q, stride_pos, stride_slot, stride_kp, stride_ks, stride_kh,
                        stride_vp, stride_vs, stride_vh, stride_cos, stride_sin,
                        w_ptr.dtype.element_ty, NUM_HEADS, NUM_KV, D, PAGE_SIZE, SPLIT, ROUND, BLOCK_M,
                        EPI_ROWS)


def _launch(cfg: GemmConfig, x, norm_w, qkv_w, q_norm_w, k_norm_w, cos, sin, positions,
            slot_mapping, k_cache, v_cache, out, counters, eps, stats) -> None:
    rows, (_, page_size, num_kv, d) = x.shape[0], k_cache.shape
    m_pad = row_blocks(rows) * BLOCK_M
    part = torch.empty(cfg.split, m_pad, qkv_w.shape[0], dtype=torch.float32, device=x.device)
    _talker_qkv_kernel[(row_blocks(rows), qkv_w.shape[0] // cfg.block_n, cfg.split)](
        x, norm_w, qkv_w, q_norm_w, k_norm_w, cos, sin, positions, slot_mapping, k_cache, v_cache,
        out, part, counters, stats if stats is not None else out,
        rows, x.shape[1], eps, m_pad,
        x.stride(0), qkv_w.stride(0), out.stride(0), positions.stride(0), slot_mapping.stride(0),
        *k_cache.stride()[:3], *v_cache.stride()[:3], cos.stride(0), sin.stride(0),
        stats.stride(0) if stats is not None else 0,
        NUM_HEADS=out.shape[1] // d, NUM_KV=num_kv, D=d, PAGE_SIZE=page_size,
        ROUND=cos.dtype == x.dtype and x.dtype != torch.float32,
        BLOCK_M=BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=cfg.split,
        DOT_PRECISION=dot_precision(qkv_w.dtype), EPI_ROWS=held_rows(rows),
        STATS=0 if stats is None else stats_width(x.shape[1]),
        **held_launch(cfg, cfg.block_n, qkv_w.shape[1], x),
    )


def _check(x, qkv_weight, cos, sin, positions, slot_mapping, k_cache, v_cache, counters) -> int:
    """The contract's shape / dtype / device checks; returns the number of q heads."""
    rows, hidden = x.shape
    _, _, num_kv, d = k_cache.shape
    num_heads = qkv_weight.shape[0] // d - 2 * num_kv
    assert qkv_weight.shape == ((num_heads + 2 * num_kv) * d, hidden) and num_heads > 0 \
        and num_heads % num_kv == 0, \
        f"qkv_rope_store: qkv_weight {tuple(qkv_weight.shape)} vs cache {tuple(k_cache.shape)}"
    assert v_cache.shape == k_cache.shape and k_cache.dtype == v_cache.dtype == x.dtype \
        == qkv_weight.dtype, \
        f"qkv_rope_store: caches {tuple(k_cache.shape)}/{k_cache.dtype}, x {x.dtype}, weight " \
        f"{qkv_weight.dtype}"
    assert d >= 16 and d & (d - 1) == 0, f"qkv_rope_store: head_dim {d} must be a power of 2 >= 16"
    assert cos.shape == sin.shape and cos.dim() == 2 and cos.shape[1] == d, \
        f"qkv_rope_store: cos {tuple(cos.shape)} / sin {tuple(sin.shape)} must be [max_pos, {d}]"
    for name, ids in (("positions", positions), ("slot_mapping", slot_mapping)):
        assert ids.shape == (rows,) and not ids.is_floating_point(), \
            f"qkv_rope_store: {name} must be int [{rows}], got {ids.dtype} {tuple(ids.shape)}"
    for name, ten in (("x", x), ("qkv_weight", qkv_weight), ("cos", cos), ("sin", sin),
                      ("k_cache", k_cache), ("v_cache", v_cache), ("positions", positions),
                      ("slot_mapping", slot_mapping)):
        assert ten.stride(-1) == 1 or ten.dim() == 1, \
            f"qkv_rope_store: {name} last dim must be contiguous"
        assert ten.device == x.device, f"qkv_rope_store: {name} on {ten.device}, x on {x.device}"
    assert counters.dtype == torch.int32 and counters.numel() >= counters_needed(rows, num_kv), \
        "qkv_rope_store: counters must be int32 zeros, counters_needed(M, KVH) long"
    return num_heads


def qkv_rope_store(x: torch.Tensor, norm_weight: torch.Tensor, qkv_weight: torch.Tensor,
                   q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, eps: float,
                   counters: torch.Tensor, out: torch.Tensor | None = None,
                   config: GemmConfig | None = None, stats: torch.Tensor | None = None) -> torch.Tensor:
    """The attention inputs of a talker decode layer for rows x [M, H] (one token each).

    qkv_weight [(NH + 2 KVH) D, H] (rows q | k | v); q/k_norm_weight [D]; cos, sin [max_pos, D]
    RoPE tables; positions [M] (< max_pos, not checked: no host sync) and slot_mapping [M]
    (page * page_size + offset, < 0 = padding row: nothing stored), int, any stride;
    k_cache, v_cache [num_pages, page_size, KVH, D] (one layer's). counters: int32 zeros,
    >= counters_needed(M, KVH) (left zero). stats: x's row statistics (`code_predictor.linear_residual`'s),
    read instead of x's rows for the norm.
    Returns the rotated q [M, NH * D] in x.dtype; k and v are written to the cache.
    """
    num_heads = _check(x, qkv_weight, cos, sin, positions, slot_mapping, k_cache, v_cache,
                       counters)
    rows, hidden, d = x.shape[0], x.shape[1], k_cache.shape[3]
    if out is None:
        out = torch.empty(rows, num_heads * d, dtype=x.dtype, device=x.device)
    assert out.shape == (rows, num_heads * d) and out.stride(-1) == 1, "qkv_rope_store: bad out"
    if stats is not None:
        check_stats(stats, rows, hidden, x)
    if rows == 0:
        return out
    weights = (norm_weight, qkv_weight, q_norm_weight, k_norm_weight, cos, sin)
    with device_guard(x):
        if config is None and x.is_cuda:  # timed on the first row block (the batch-1 shape)
            key = ("talker_qkv", qkv_weight.shape, k_cache.shape[1:], qkv_weight.dtype)
            m = min(rows, BLOCK_M)
            one_block = (x[:m], *weights, positions[:m], slot_mapping[:m], k_cache, v_cache,
                         out[:m], counters, eps, stats)
            config = pick(key, qkv_candidates(qkv_weight, d),
                          lambda c: _launch(c, *one_block), x.device)
        config = config or interpret_config(d)
        assert d % config.block_n == 0, f"qkv_rope_store: block_n {config.block_n} must divide {d}"
        _launch(config, x, *weights, positions, slot_mapping, k_cache, v_cache, out, counters, eps, stats)
    return out
