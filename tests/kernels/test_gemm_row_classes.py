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

from code_predictor_cases import EPS, TINY, Inputs, check_gemms
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


def _qkv_tunings(monkeypatch, rows: int, tokens: int, gather: bool = False) -> list[tuple]:
    """(key, candidates, rows launched) for each config `_tuned` asks `pick` / `choose` for, on a launch of `rows`
    rows of `tokens` tokens (TINY shapes); pick and choose time nothing here and return their first candidate."""
    cpa = kernel_module("code_predictor_attention")
    asked, launched = [], []
    monkeypatch.setattr(cpa, "_launch", lambda cfg, *args: launched.append(args[-6].shape[0]))

    def first(key, cands, launch, device, default=None):
        launch(cands[0])
        asked.append((key, list(cands), launched[-1]))
        return cands[0]

    monkeypatch.setattr(cpa, "pick", first)
    monkeypatch.setattr(cpa, "choose", first)
    s, inp = TINY, Inputs("cpu", 0)
    table = inp.randn(64 if gather else rows, s.hidden)
    weights = (inp.norm_weight(s.hidden, torch.float32),
               inp.weight((s.heads + 2 * s.kv_heads) * s.head_dim, s.hidden, torch.float32),
               inp.norm_weight(s.head_dim, torch.float32), inp.norm_weight(s.head_dim, torch.float32),
               *(inp.randn(s.positions, s.head_dim) for _ in range(2)),
               *(inp.randn(rows, s.positions, s.kv_heads, s.head_dim) for _ in range(2)))
    ids, rows_out = (inp.ids(rows, 64), inp.randn(rows, s.hidden)) if gather else (None, None)
    out = inp.randn(rows, s.heads * s.head_dim)
    cpa._tuned((table, ids, rows_out, *weights, out, inp.counters(), 0, tokens, EPS, 0.25))
    return asked


@pytest.mark.parametrize("gather", [False, True], ids=["rows", "gathered"])
def test_qkv_launches_with_row_programs_take_a_config_of_their_own(monkeypatch, gather):
    """A one-token launch over 16 rows (row programs) takes its own key, tuned on its 16 rows among the shape's
    config (first) and the candidates; the shape's config is timed on one row, as the one-row step runs it."""
    name = "cp_qkv_attention" + ("/gather" if gather else "")
    (base, base_cands, base_rows), (own, own_cands, own_rows) = _qkv_tunings(monkeypatch, 16, 1, gather)
    assert base[0] == name and own == base + ("rows",)
    assert (base_rows, own_rows) == (1, 16)
    assert own_cands[0] == base_cands[0] and sorted(map(str, own_cands)) == sorted(map(str, base_cands))


@pytest.mark.parametrize("rows, tokens, timed", [(1, 1, 1), (32, 2, 16), (4, 2, 4)])
def test_qkv_launches_without_row_programs_take_the_shapes_config(monkeypatch, rows, tokens, timed):
    """One row, or two tokens a row (the first pass): the shape's one key, timed on the launch's first row block."""
    asked = _qkv_tunings(monkeypatch, rows, tokens)
    assert [(key[0], n) for key, _, n in asked] == [("cp_qkv_attention", timed)]


def test_qkv_launches_take_one_config_under_the_switch(monkeypatch):
    """Under batch_invariant() every one-token launch runs row programs, and all of them one config: no key of
    their own, whatever the rows."""
    autotune.set_batch_invariant(True)
    try:
        for rows in (1, 16):
            assert [key for key, _, _ in _qkv_tunings(monkeypatch, rows, 1)] == \
                [("cp_qkv_attention", torch.Size([128, 48]), 2, torch.float32)]
    finally:
        autotune.set_batch_invariant(False)


def test_a_launch_of_one_row_takes_the_one_row_class(monkeypatch):
    """Class 1 tuned (planted): a launch of one row takes it, 2 and 16 rows the class-16 config; under the switch
    one row takes the class-16 config too. Untuned, one row takes the class-16 config."""
    weight = torch.empty(1024, 2048)
    base = _select(weight, 1)
    assert cpl.tuning_key("cp_linear_residual", weight, 1024, 1)[-1] == 1
    one = GemmConfig(64, 128, 4, 4, 4, 16)
    monkeypatch.setitem(autotune._BEST, cpl.tuning_key("cp_linear_residual", weight, 1024, 1), one)
    assert one != base and _select(weight, 1) == one
    assert _select(weight, 2) == base and _select(weight, 16) == base
    autotune.set_batch_invariant(True)
    try:
        assert _select(weight, 1) == base
    finally:
        autotune.set_batch_invariant(False)


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
