"""The skinny GEMMs' row-class configs (BLOCK_M 32 / 64), the batch-invariant switch, and the plain
`linear` (kernels/code_predictor_linear.py) at tiny shapes through the interpreter on CPU.

Kernel checks as test_code_predictor_kernels.py (poisoned outputs, counters left zero, tolerance
from the dtype: kernel_checks.assert_close_3way); the config selection is checked in pure Python, with a
tuned row class planted in the tuning cache (no device timing on CPU).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from code_predictor_cases import TINY, Inputs, check_gemms
from kernel_checks import DEVICE, assert_close_3way, kernel_module

cpl = kernel_module("code_predictor_linear")  # skips the module without triton
from q3tts.kernels import autotune, code_predictor as cpk, paged_attention  # noqa: E402
from q3tts.kernels.code_predictor_gemm import (ROW_CLASSES, GemmConfig, candidates,  # noqa: E402
                                               counters_needed, row_class)

DTYPES = [torch.float32, torch.bfloat16]


# --------------------------------------------------------------------- BLOCK_M 32 / 64 configs

@pytest.mark.parametrize("config, rows", [
    (GemmConfig(16, 32, 2, 1, 1, 32), 40),  # 2 row blocks of 32, the second ragged; 2 K slices
    (GemmConfig(16, 16, 4, 1, 1, 64), 70),  # 2 blocks of 64; 4 slices, the last one empty (K 48)
    (GemmConfig(16, 64, 1, 1, 1, 64), 5),   # one ragged block of 64, one slice
], ids=["bm32-split2", "bm64-split4", "bm64-split1"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemm_kernels_with_wide_row_blocks(dtype, config, rows):
    """project (given and by id), o_proj / down + residual, norm + gate_up, norm + head (one and
    two tokens per row) with BLOCK_M 32 / 64."""
    inp = Inputs(DEVICE, 11, rows, config.block_m, dtype.itemsize)
    check_gemms(cpk, TINY, rows, dtype, inp, config)


# ------------------------------------------------------------------------- config selection

def _select(weight: torch.Tensor, rows: int) -> GemmConfig:
    def never(cfg, m):
        raise AssertionError("no launch may time on CPU")
    return cpl.select_config("cp_linear_residual", weight, weight.shape[0], rows, never)


def test_row_classes_round_up_to_a_power_of_2_within_16_256():
    assert [row_class(r) for r in (1, 16, 17, 33, 64, 65, 256, 5000)] == \
        [16, 16, 32, 64, 64, 128, 256, 256]


@pytest.mark.parametrize("rows", ROW_CLASSES)
def test_candidates_per_row_class(rows):
    """At most 5 per class (plus the class-16 config in select_config), rows per program within the
    class, K slices whole BLOCK_K steps; split_k=False keeps one slice."""
    fits = lambda bn: 1024 // bn  # noqa: E731
    cands = candidates(fits, 2048, torch.device("cpu"), rows)
    assert 1 <= len(cands) <= 5 and len(set(cands)) == len(cands)
    assert {c.block_m for c in cands} == ({16} if rows == 16 else {32} if rows == 32 else {32, 64})
    assert all(2048 % (c.split * c.block_k) == 0 for c in cands)
    assert all(c.split == 1 for c in candidates(fits, 2048, torch.device("cpu"), rows, False))


def test_a_weight_only_16_wide_tiles_fit_keeps_the_class_16_config():
    """N = 48 (a tiny checkpoint's width): no 32 / 64 tile fits, so a larger class has no candidate of its
    own and select_config keeps the class-16 config (it used to assert)."""
    fits = lambda bn: 48 // bn if 48 % bn == 0 else None  # noqa: E731
    assert candidates(fits, 256, torch.device("cpu"), 64) == []
    assert {c.block_n for c in candidates(fits, 256, torch.device("cpu"), 16)} == {16}
    with pytest.raises(AssertionError, match="no block size fits"):
        candidates(lambda bn: None, 256, torch.device("cpu"), 16)


def test_batch_invariant_switch_picks_one_config_for_every_batch(monkeypatch):
    """Row class 64 tuned (planted in the cache): off, 64 rows take it and 3 rows the class-16
    config; under the switch both take the class-16 config, and tuning_key no longer sees M."""
    weight = torch.empty(1024, 2048)
    wide = GemmConfig(64, 128, 1, 8, 3, 64)
    key64 = cpl.tuning_key("cp_linear_residual", weight, 1024, 64)
    monkeypatch.setitem(autotune._BEST, key64, wide)
    base = _select(weight, 3)
    assert base.block_m == 16 and _select(weight, 64) == wide
    autotune.set_batch_invariant(True)
    try:
        assert autotune.batch_invariant()
        assert _select(weight, 64) == base and _select(weight, 3) == base
        assert cpl.tuning_key("cp_linear_residual", weight, 1024, 3) == \
            cpl.tuning_key("cp_linear_residual", weight, 1024, 64)
    finally:
        autotune.set_batch_invariant(False)
    assert _select(weight, 64) == wide


def test_paged_attention_split_count_under_the_switch(invariant):
    """Batch 1's split count for every batch under the switch (off, it shrinks with the batch)."""
    args = (8, 64, 16, 64, torch.device("cpu"))  # KVH, max_pages, page size, BLOCK_N
    assert paged_attention.num_splits_for(64, *args) == paged_attention.num_splits_for(1, *args)
    autotune.set_batch_invariant(False)
    assert paged_attention.num_splits_for(64, *args) < paged_attention.num_splits_for(1, *args)


# ------------------------------------------------------------------------------------ linear

@pytest.mark.parametrize("config", [None, GemmConfig(32, 16, 1, 1, 1, 64)], ids=["default", "bm64"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_matches_f_linear(dtype, bias, config):
    """37 rows (3 blocks of 16, one ragged of 64), K 48 not a multiple of BLOCK_K 32 / 64."""
    inp = Inputs(DEVICE, 12, dtype.itemsize, bias)
    x, w = inp.randn(37, 48, dtype=dtype), inp.weight(64, 48, dtype)
    b = inp.randn(64, scale=0.5, dtype=dtype) if bias else None
    out = cpl.linear(x, w, b, out=inp.poisoned(37, 64, dtype=dtype), config=config)
    want32 = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert out.dtype == dtype
    assert_close_3way(out, F.linear(x, w, b), want32, dtype, f"linear (bias={bias})")


def test_linear_strided_rows_and_the_package_entry(monkeypatch):
    """x rows with a stride (a column slice); q3tts.kernels.linear off the kernels is F.linear."""
    import q3tts.kernels as kernels

    inp = Inputs(DEVICE, 13)
    x, w, b = inp.randn(9, 96)[:, 16:64], inp.weight(32, 48, torch.float32), inp.randn(32)
    want = F.linear(x, w, b)
    assert_close_3way(cpl.linear(x, w, b), want, want, torch.float32, "strided rows")
    monkeypatch.setenv("Q3TTS_KERNELS", "torch")
    assert torch.equal(kernels.linear(x, w, b), want)


def test_linear_contract_violations_raise():
    inp = Inputs(DEVICE, 14)
    x, w = inp.randn(4, 48), inp.weight(64, 48, torch.float32)
    with pytest.raises(AssertionError, match="not \\[M, K\\]"):
        cpl.linear(x[:, :40], w)
    with pytest.raises(AssertionError, match="multiple of 16"):
        cpl.linear(x, w[:40])
    with pytest.raises(AssertionError, match="bias"):
        cpl.linear(x, w, inp.randn(63))
    with pytest.raises(AssertionError, match="one K slice"):
        cpl.linear(x, w, config=GemmConfig(16, 16, 2, 1, 1))


def test_counters_needed_follows_block_m():
    assert counters_needed(64, 10, 64) == 10 and counters_needed(64, 10) == 40
