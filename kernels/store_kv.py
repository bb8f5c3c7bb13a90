"""Scatter K/V of N tokens into a paged cache by slot (page * page_size + offset); slot < 0 = skip.

Padding rows of a CUDA graph carry slot -1, so the launch shape depends only on N.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._cast import cast
from ._launch import device_guard


@triton.jit
def _store_kv_kernel(
    # pointers
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    # sizes
    page_size,
    # strides
    stride_slot,  # slot_mapping may be a strided column of the engine's row metadata
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_kc_page, stride_kc_slot, stride_kc_head,
    stride_vc_page, stride_vc_slot, stride_vc_head,
    # meta
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + n * stride_slot).to(tl.int64)
    if slot >= 0:
        heads = tl.arange(0, BLOCK_H)
        cols = tl.arange(0, BLOCK_D)
        mask = (heads < NUM_KV_HEADS)[:, None] & (cols < HEAD_DIM)[None, :]
        page = slot // page_size
        offset = slot % page_size
        k = tl.load(k_ptr + n * stride_kn + heads[:, None] * stride_kh + cols[None, :], mask=mask)
        v = tl.load(v_ptr + n * stride_vn + heads[:, None] * stride_vh + cols[None, :], mask=mask)
        kc = (k_cache_ptr + page * stride_kc_page + offset * stride_kc_slot
              + heads[:, None] * stride_kc_head + cols[None, :])
        vc = (v_cache_ptr + page * stride_vc_page + offset * stride_vc_slot
              + heads[:, None] * stride_vc_head + cols[None, :])
        tl.store(kc, cast(k, k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(vc, cast(v, v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k, v [N, KVH, D] into k_cache, v_cache [num_pages, page_size, KVH, D] at slot_mapping
    [N] (int32/int64; slot = page * page_size + offset; negative = padding row, skipped).

    Slots must be unique among the kept rows and < num_pages * page_size (not checked: no host
    sync).
    """
    n, num_kv, dim = k.shape
    assert v.shape == k.shape, f"v {tuple(v.shape)} != k {tuple(k.shape)}"
    assert k_cache.dim() == 4 and k_cache.shape[2:] == (num_kv, dim), \
        f"k_cache {tuple(k_cache.shape)} must be [num_pages, page_size, {num_kv}, {dim}]"
    assert v_cache.shape == k_cache.shape, f"v_cache {tuple(v_cache.shape)} != k_cache"
    assert slot_mapping.shape == (n,) and not slot_mapping.is_floating_point(), \
        f"slot_mapping must be int [{n}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        assert t.stride(-1) == 1, f"{name}: last dim must be contiguous"
        assert t.device == k.device, f"{name} on {t.device}, k on {k.device}"
    assert slot_mapping.device == k.device, "slot_mapping must be on k's device"
    if n == 0:
        return
    block_d = triton.next_power_of_2(dim)
    block_h = triton.next_power_of_2(num_kv)
    with device_guard(k):
        _store_kv_kernel[(n,)](
            k, v, k_cache, v_cache, slot_mapping,
            k_cache.shape[1],
            slot_mapping.stride(0),
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            NUM_KV_HEADS=num_kv, HEAD_DIM=dim, BLOCK_H=block_h, BLOCK_D=block_d,
            num_warps=4 if block_h * block_d >= 1024 else 2,
        )
