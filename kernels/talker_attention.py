"""Paged decode attention in one launch: kernels/paged_attention.py's two phases joined by tickets.

Grid (B, KVH, num_splits) as paged_attention's phase 1, the same split of each row's context (`split_length`:
its keys spread over the splits, at least `DecodeConfig.min_split` each). A row whose context fits one split
(up to min_split keys: the short contexts of most utterances) is done by that split's program alone: it
normalises its result and stores the output, with no partial, no ticket and no merge. A longer row's used
splits each store an fp32 partial, take a ticket on the (row, kv head) counter, and the last of them merges the
GROUP heads' partials (`merge_splits`, the phase-2 math) and writes the output; splits past the context do
nothing. No program waits on another. The same bits as `paged_decode_attention` (the same splits, the same
merge order; a merge of one partial is acc / sum), one launch instead of two: the talker decode layer's second
launch (models/talker_fused.py).
Torch reference: `reference.paged_decode_attention_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import device_guard, programmatic_launch
from .autotune import pick
from .code_predictor_gemm import arrive, few_rows, wait_for_previous
from .paged_attention import (_CANDIDATES, _INTERPRET_CONFIG, DecodeConfig, _attend_split, _normalised,
                              check_inputs, merge_splits, split_launch, store_head, store_output,
                              store_partial, tuning_key, used_splits)

_BLOCK_S = 16  # splits merged per step (as paged_attention's phase 2)


@triton.jit(do_not_specialize=["num_splits"])
def _attention_kernel(
    # phase 1's arguments (paged_attention.split_launch)
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    part_acc_ptr, part_max_ptr, part_sum_ptr,
    num_splits, scale_log2,
    stride_ctx, stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs,
    stride_vh, stride_bt,
    # the output and the tickets
    out_ptr, cnt_ptr, stride_ob, stride_oh,
    # meta
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_S: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)  # q comes from the kernel before
    b, kvh, split = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    num_kv = tl.num_programs(1)
    used = used_splits(context_lens_ptr, b, stride_ctx, num_splits, BLOCK_N, MIN_SPLIT)
    if split < tl.maximum(used, 1):  # splits past the context have nothing to do
        m_i, l_i, acc, heads, g_mask = _attend_split(
            q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, num_splits, scale_log2, stride_ctx,
            stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_bt,
            HEAD_DIM, BLOCK_D, GROUP, BLOCK_G, PAGE_SIZE, BLOCK_N, MIN_SPLIT, DOT_PRECISION)
        if used <= 1:  # the whole context (or none) in split 0: normalised here, the bits of a merge of one partial
            store_output(out_ptr, b, heads, g_mask, _normalised(acc, l_i[:, None]), stride_ob, stride_oh,
                         HEAD_DIM, BLOCK_D)
        else:
            store_partial(part_acc_ptr, part_max_ptr, part_sum_ptr, m_i, l_i, acc, heads, g_mask, num_splits,
                          HEAD_DIM, BLOCK_D, GROUP)
            if arrive(cnt_ptr + b * num_kv + kvh, used):
                for j in tl.static_range(GROUP):
                    head = kvh * GROUP + j
                    out = merge_splits(part_acc_ptr, part_max_ptr, part_sum_ptr,
                                       b * num_kv * GROUP + head, num_splits, used, HEAD_DIM, BLOCK_D, BLOCK_S)
                    store_head(out_ptr, b, head, out, stride_ob, stride_oh, HEAD_DIM, BLOCK_D)


def _launch(cfg: DecodeConfig, q, k_cache, v_cache, block_tables, context_lens, scale, counters,
            out) -> None:
    grid, _, args, meta = split_launch(cfg, q, k_cache, v_cache, block_tables, context_lens,
                                       scale)
    pdl = programmatic_launch(q)
    _attention_kernel[grid](*args, out, counters, out.stride(0), out.stride(1), BLOCK_S=_BLOCK_S,
                            PDL=pdl, launch_pdl=pdl, **meta)


def talker_key(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor) -> tuple:
    """The `pick` key of a launch: paged_attention's (the shape class and the table's width), and whether it is
    the one-row step's (`few_rows`), which takes a config of its own (its split count follows the batch, and one
    config for both let the engine's chain tuner trade the one-row talker, +0.05 ms, for the 16-row one:
    forty-eighth session). Under `batch_invariant()` one key for every batch, as its split count."""
    return tuning_key("talker_attention", q, k_cache, block_tables) + (("one row",) if few_rows(q.shape[0]) else ())


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                     counters: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`paged_decode_attention` (same contract: q [B, NH, D], caches [num_pages, page_size, KVH,
    D], block_tables [B, max_pages] int32, context_lens [B] int32) in one launch.

    counters: int32 zeros, >= B * KVH (left zero). Returns out [B, NH, D] in q.dtype."""
    check_inputs(q, k_cache, v_cache, block_tables, context_lens)
    bsz, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[2]
    assert counters.dtype == torch.int32 and counters.numel() >= bsz * num_kv, \
        f"decode_attention: counters must be int32 zeros, >= {bsz} x {num_kv} long"
    if out is None:
        out = torch.empty(bsz, num_heads, head_dim, dtype=q.dtype, device=q.device)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1, \
        f"decode_attention: out {tuple(out.shape)}/{out.dtype} must be {tuple(q.shape)}/{q.dtype}"
    if bsz == 0:
        return out
    args = (q, k_cache, v_cache, block_tables, context_lens, scale, counters, out)
    with device_guard(q):  # the tuning launches too: q may sit on another GPU than the current one
        if q.is_cuda:
            cfg = pick(talker_key(q, k_cache, block_tables), _CANDIDATES, lambda c: _launch(c, *args), q.device)
        else:
            cfg = _INTERPRET_CONFIG
        _launch(cfg, *args)
    return out
