"""The engine passes index vectors (positions, slot_mapping, context_lens) as strided columns of its
per-row metadata tensor [B, cols]: every kernel must read them through their stride.
(Found on the H200: kernels that assumed contiguous indices read the neighbouring columns.)"""

from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, kernel_module
from q3tts.kernels.reference import apply_rotary_ref, paged_decode_attention_ref, store_kv_ref
from test_paged_attention_kernel import make_inputs

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning")

COLS = 5  # like the engine's meta rows: slot, position, slot_mapping, context_len, frame


def column(values: torch.Tensor, col: int, dtype: torch.dtype) -> torch.Tensor:
    """`values` [N] as column `col` of a [N, COLS] tensor whose other columns hold large junk."""
    meta = torch.full((values.shape[0], COLS), 10_000_000, dtype=dtype, device=DEVICE)
    meta[:, col] = values.to(dtype)
    view = meta[:, col]
    assert view.stride(0) == COLS
    return view


def test_store_kv_reads_strided_slot_mapping():
    torch.manual_seed(0)
    n, kvh, d, pages, page_size = 5, 2, 16, 4, 4
    k, v = torch.randn(n, kvh, d, device=DEVICE), torch.randn(n, kvh, d, device=DEVICE)
    k_cache = torch.randn(pages, page_size, kvh, d, device=DEVICE)
    v_cache = torch.randn_like(k_cache)
    slots = torch.tensor([3, -1, 9, 0, 14], device=DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_ref(k, v, k_ref, v_ref, slots)
    kernel_module("store_kv").store_kv(k, v, k_cache, v_cache, column(slots, 2, torch.int64))
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_rotary_reads_strided_positions():
    torch.manual_seed(0)
    n, nh, kvh, d, max_pos = 4, 4, 2, 16, 11
    q, k = torch.randn(n, nh, d, device=DEVICE), torch.randn(n, kvh, d, device=DEVICE)
    cos, sin = torch.randn(max_pos, d, device=DEVICE), torch.randn(max_pos, d, device=DEVICE)
    pos = torch.tensor([7, 0, 10, 3], device=DEVICE)
    want = apply_rotary_ref(q, k, pos, cos, sin)
    got = kernel_module("rotary").apply_rotary(q, k, column(pos, 1, torch.int64), cos, sin)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_paged_attention_reads_strided_context_lens():
    q, k_cache, v_cache, tables, lens, scale = make_inputs(3, 4, 2, 16, 4, 3, [5, 12, 1],
                                                           torch.float32)
    want = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, scale)
    got = kernel_module("paged_attention").paged_decode_attention(
        q, k_cache, v_cache, tables, column(lens, 3, torch.int32), scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
