"""Torch references of the talker decode kernels: the eager layer's own ops (models/layers.py),
built from the references in kernels/reference.py.

    qkv_rope_store_ref   kernels/talker_qkv.py
    decode attention     reference.paged_decode_attention_ref (kernels/talker_attention.py)
    o-proj / gate-up / down: code_predictor_reference.py (the talker reuses those GEMM kernels)
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from .reference import apply_rotary_ref, rms_norm_ref, store_kv_ref


def qkv_rope_store_ref(x: torch.Tensor, norm_weight: torch.Tensor, qkv_weight: torch.Tensor,
                       q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor,
                       cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                       slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       eps: float) -> torch.Tensor:
    """The contract of `talker_qkv.qkv_rope_store`: rows x [M, H] at positions [M] -> rotated q
    [M, NH * D]; k and v stored into the paged caches [pages, page_size, KVH, D] at slot_mapping
    [M] (< 0 skipped)."""
    rows = x.shape[0]
    num_kv, d = k_cache.shape[2], k_cache.shape[3]
    num_heads = qkv_weight.shape[0] // d - 2 * num_kv
    q, k, v = F.linear(rms_norm_ref(x, norm_weight, eps), qkv_weight).split(
        (num_heads * d, num_kv * d, num_kv * d), dim=-1)
    q = rms_norm_ref(q.reshape(rows, num_heads, d), q_norm_weight, eps)  # [M, NH, D]
    k = rms_norm_ref(k.reshape(rows, num_kv, d), k_norm_weight, eps)  # [M, KVH, D]
    q, k = apply_rotary_ref(q, k, positions, cos, sin)
    store_kv_ref(k, v.reshape(rows, num_kv, d), k_cache, v_cache, slot_mapping)
    return q.reshape(rows, num_heads * d)
