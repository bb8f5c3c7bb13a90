"""kernels/store_kv.py vs store_kv_ref (paged scatter, slot -1 skipped)."""

from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, kernel_module
from q3tts.kernels.reference import store_kv_ref

store_kv = kernel_module("store_kv")

CASES = [  # (n, num_kv_heads, head_dim, num_pages, page_size)
    (6, 8, 128, 3, 4), (5, 1, 80, 8, 1), (4, 2, 16, 2, 5), (9, 3, 64, 2, 16),
]


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "n{}_kv{}_d{}_p{}x{}".format(*c))
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32),
                                    (torch.bfloat16, torch.bfloat16),
                                    (torch.float32, torch.bfloat16)],
                         ids=["f32", "bf16", "f32_into_bf16"])
def test_store_kv_matches_reference(dtypes, case, slot_dtype):
    act_dtype, cache_dtype = dtypes
    n, kvh, d, pages, page_size = case
    torch.manual_seed(0)
    k = torch.randn(n, kvh, d, device=DEVICE).to(act_dtype)
    v = torch.randn(n, kvh, d, device=DEVICE).to(act_dtype)
    # a layer slice of a [layers, pages, page_size, KVH, D] pool, pre-filled so stray writes show
    pool = torch.randn(2, 2, pages, page_size, kvh, d, device=DEVICE).to(cache_dtype)
    k_cache, v_cache = pool[0, 1], pool[1, 1]
    slots = torch.randperm(pages * page_size, device=DEVICE)[:n]
    slots[1::3] = -1  # padding rows
    slots = slots.to(slot_dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_ref(k, v, k_ref, v_ref, slots)
    before = pool.clone()
    store_kv.store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    before[0, 1], before[1, 1] = k_ref, v_ref
    assert torch.equal(pool, before), "wrote outside the target layer"


def test_strided_inputs_and_all_padding():
    torch.manual_seed(1)
    n, kvh, d = 4, 2, 32
    kv = torch.randn(n, 2 * kvh * d + 4, device=DEVICE)
    k = kv[:, : kvh * d].view(n, kvh, d)
    v = kv[:, kvh * d: 2 * kvh * d].view(n, kvh, d)
    k_cache = torch.zeros(2, 4, kvh, d, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([7, 0, 3, 4], device=DEVICE)
    store_kv.store_kv(k, v, k_cache, v_cache, slots)
    store_kv_ref(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    store_kv.store_kv(k, v, k_cache, v_cache, torch.full((n,), -1, device=DEVICE))
    assert torch.equal(k_cache, k_ref), "slot -1 rows must be skipped"
    store_kv.store_kv(k[:0], v[:0], k_cache, v_cache, slots[:0])  # N = 0: no launch


def test_contract_violations_raise():
    k = torch.randn(2, 2, 16, device=DEVICE)
    cache = torch.zeros(2, 4, 2, 16, device=DEVICE)
    with pytest.raises(AssertionError, match="k_cache"):
        store_kv.store_kv(k, k, cache[..., :8], cache[..., :8], torch.zeros(2, dtype=torch.long))
    with pytest.raises(AssertionError, match="slot_mapping"):
        store_kv.store_kv(k, k, cache, cache, torch.zeros(3, dtype=torch.long, device=DEVICE))
