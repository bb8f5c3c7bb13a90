"""kernels/paged_attention.py vs paged_decode_attention_ref (split-K decode over block tables)."""

from __future__ import annotations

import importlib

import pytest
import torch

from kernel_checks import DEVICE, assert_close_3way, kernel_module
from q3tts.kernels.reference import paged_decode_attention_ref

pa = kernel_module("paged_attention")

# the interpreter evaluates tensor loop bounds through a deprecated numpy scalar conversion
pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning")


def attention_same_dtype(q, k_cache, v_cache, block_tables, context_lens, scale):
    """The eager low-precision path (HF "eager" attention): matmuls in the activation dtype,
    softmax in fp32 rounded back to it. The kernel's error budget is measured against this."""
    bsz, nh, d = q.shape
    page_size, kvh = k_cache.shape[1], k_cache.shape[2]
    keys = k_cache[block_tables.long()].reshape(bsz, -1, kvh, d).repeat_interleave(nh // kvh, 2)
    values = v_cache[block_tables.long()].reshape(bsz, -1, kvh, d).repeat_interleave(nh // kvh, 2)
    scores = torch.einsum("bhd,bshd->bhs", q, keys) * scale
    mask = torch.arange(keys.shape[1], device=q.device)[None, :] < context_lens[:, None].long()
    scores = scores.float().masked_fill(~mask[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0).to(q.dtype)
    return torch.einsum("bhs,bshd->bhd", probs, values)


def make_inputs(bsz, nh, kvh, d, page_size, max_pages, context_lens, dtype, seed=0):
    """Random caches in a [layers, pages, ...] pool (layer 1 used), shuffled block tables whose
    unused entries point at arbitrary valid pages, q as a strided view."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    num_pages = bsz * max_pages + 3
    pool = torch.randn(2, 2, num_pages, page_size, kvh, d, generator=gen).to(DEVICE, dtype)
    k_cache, v_cache = pool[0, 1], pool[1, 1]
    q = torch.randn(bsz, nh + 1, d, generator=gen).to(DEVICE, dtype)[:, 1:]  # non-contiguous
    tables = torch.randperm(num_pages, generator=gen)[: bsz * max_pages].view(bsz, max_pages)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    for b in range(bsz):  # entries past the row's last page: any valid page id
        used = (int(lens[b]) + page_size - 1) // page_size
        tables[b, used:] = torch.randint(0, num_pages, (max_pages - used,), generator=gen)
    return (q, k_cache, v_cache, tables.to(DEVICE, torch.int32).contiguous(), lens.to(DEVICE),
            d ** -0.5)


CASES = [  # (nh, kvh, head_dim, page_size, max_pages, context_lens)
    (16, 8, 128, 16, 4, [0, 1, 17, 64]),            # talker heads; empty row, partial last page
    (4, 1, 80, 4, 12, [45, 3, 48]),                 # GQA 4, head_dim 80, many splits and iterations
    (2, 2, 16, 1, 40, [40, 0, 29]),                 # page_size 1, MHA
    (6, 2, 64, 8, 3, [24]),                         # group 3 (not a power of 2), B = 1
    (8, 4, 32, 5, 7, [35, 11, 0, 0, 6]),            # page size 5 (not a power of 2), padded rows
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "h{}_kv{}_d{}_p{}x{}".format(*c[:5]))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_paged_decode_matches_reference(dtype, case):
    nh, kvh, d, page_size, max_pages, lens = case
    args = make_inputs(len(lens), nh, kvh, d, page_size, max_pages, lens, dtype)
    out = pa.paged_decode_attention(*args)
    q, k_cache, v_cache, tables, ctx, scale = args
    out_ref = paged_decode_attention_ref(q.float(), k_cache.float(), v_cache.float(), tables, ctx,
                                         scale)
    out_pt = attention_same_dtype(*args)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close_3way(out, out_pt, out_ref, dtype, f"paged decode {dtype} {case}")
    empty = ctx == 0
    assert torch.equal(out[empty], torch.zeros_like(out[empty])), "context_len 0 rows must be 0"


def test_split_count_is_static_and_bounded():
    dev = torch.device(DEVICE)
    for bsz in (1, 8, 64, 256):
        splits = pa.num_splits_for(bsz, 8, 512, 16, 64, dev)
        assert 1 <= splits <= 64
        assert splits == pa.num_splits_for(bsz, 8, 512, 16, 64, dev)
    assert pa.num_splits_for(1, 8, 1, 16, 64, dev) == 1  # one block of context: one split


def test_long_context_single_row_uses_many_splits():
    """One sequence, context spread over every split, against the fp32 reference."""
    args = make_inputs(1, 4, 2, 32, 16, 20, [311], torch.float32, seed=3)
    out = pa.paged_decode_attention(*args)
    torch.testing.assert_close(out, paged_decode_attention_ref(*args), rtol=1e-4, atol=1e-5)


def test_contract_violations_raise():
    args = list(make_inputs(2, 4, 2, 32, 4, 2, [3, 5], torch.float32))
    with pytest.raises(AssertionError, match="int32"):
        pa.paged_decode_attention(*args[:3], args[3].long(), *args[4:])
    with pytest.raises(AssertionError, match="kv heads"):
        pa.paged_decode_attention(args[0][:, :3], *args[1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_one_split_a_row_is_one_launch_with_the_merged_values(dtype, monkeypatch):
    """The code predictor's shape (one page of 16 positions a row, 8 kv heads; an empty row): one split a row, so
    one launch normalises its own result, equal to phase 1 + phase 2 over the same inputs; no merge launch."""
    q, k_cache, v_cache, tables, ctx, scale = make_inputs(4, 16, 8, 32, 16, 1, [16, 1, 0, 9], dtype)
    cfg = pa._INTERPRET_CONFIG
    grid, parts, args, meta = pa.split_launch(cfg, q, k_cache, v_cache, tables, ctx, scale)
    assert grid[2] == 1
    pa._decode_split_kernel[grid](*args, **meta)
    merged = torch.empty(q.shape, dtype=dtype, device=q.device)
    pa._decode_reduce_kernel[(q.shape[0], q.shape[1])](*parts, merged, ctx, 1, merged.stride(0), merged.stride(1),
                                                       ctx.stride(0), HEAD_DIM=meta["HEAD_DIM"],
                                                       BLOCK_D=meta["BLOCK_D"], BLOCK_S=16, BLOCK_N=cfg.block_n,
                                                       MIN_SPLIT=cfg.min_split)

    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("a merge launch with one split a row")

    monkeypatch.setattr(pa, "_decode_reduce_kernel", NoLaunch())
    out = pa.paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale)
    assert torch.equal(out, merged)
    assert torch.equal(out[2], torch.zeros_like(out[2]))  # the empty row


def poison_partials(monkeypatch) -> list:
    """Every launch's fp32 partials start as NaN, so that entries no split stored stay NaN; returns the list the
    launches' (acc, max, sum) are appended to."""
    made = []
    original = pa.partials

    def poisoned(*shape_args):
        parts = tuple(t.fill_(float("nan")) for t in original(*shape_args))
        made.append(parts)
        return parts

    monkeypatch.setattr(pa, "partials", poisoned)
    return made


@pytest.mark.skipif(DEVICE != "cpu", reason="counts the splits of the interpreter's config and 4 SMs")
@pytest.mark.parametrize("launch", ["two launches", "talker's one launch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_splits_past_the_context_store_nothing_and_are_not_merged(dtype, launch, monkeypatch):
    """A short context in a wide block table (the engine's at one row: 300 of its 10,240 keys): 160 keys over 8
    splits at one row (4 at two, 8 under the batch-invariant switch), of which a row of 21 keys uses 2 and an empty
    row none. The partials start as NaN: those past the context stay NaN (not stored) and the output, equal to the
    reference, read none of them."""
    made = poison_partials(monkeypatch)
    args = make_inputs(2, 4, 2, 32, 4, 40, [21, 0], dtype, seed=5)
    q, k_cache, v_cache, tables, ctx, scale = args
    assert pa.num_splits_for(1, 2, 40, 4, pa._INTERPRET_CONFIG.block_n, torch.device("cpu")) == 8
    if launch == "two launches":
        out = pa.paged_decode_attention(q[:1], k_cache, v_cache, tables[:1], ctx[:1], scale)
        rows = 1
    else:
        ta = kernel_module("talker_attention")
        counters = torch.zeros(2 * 2, dtype=torch.int32, device=q.device)
        out = ta.decode_attention(q, k_cache, v_cache, tables, ctx, scale, counters)
        rows = 2
    ref_args = (q[:rows], k_cache, v_cache, tables[:rows], ctx[:rows], scale)
    ref = paged_decode_attention_ref(q[:rows].float(), k_cache.float(), v_cache.float(), *ref_args[3:])
    assert_close_3way(out, attention_same_dtype(*ref_args), ref, dtype, f"{launch} {dtype}")
    (acc, top, total), = made
    splits = acc.shape[2]
    used = [2, 0][:rows]
    for b, n in enumerate(used):
        assert not top[b, :, :n].isnan().any() and not acc[b, :, :n].isnan().any()
        assert top[b, :, n:].isnan().all() and total[b, :, n:].isnan().all() and acc[b, :, n:].isnan().all()
    assert splits == pa.num_splits_for(rows, 2, 40, 4, pa._INTERPRET_CONFIG.block_n, torch.device("cpu"))
    if rows == 2:
        assert torch.equal(out[1], torch.zeros_like(out[1]))  # the empty row


@pytest.mark.skipif(DEVICE != "cpu", reason="counts the splits of the interpreter's config and 4 SMs")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_context_within_min_split_is_one_split_without_partials_or_merge(dtype, monkeypatch):
    """min_split 32 (the engine's default is 512): 3 splits a row at three rows; a row of 21 keys fits one split
    and the talker's one launch normalises it in that split's program, storing no partial (they stay NaN); a row
    of 70 keys spreads over 3 splits of 32 and merges; an empty row is zeros. The outputs equal the reference and
    are the bits of the two launches (a merge of one partial is acc / sum), and every ticket is back at 0."""
    ta = kernel_module("talker_attention")
    cfg = pa.DecodeConfig(16, 1, 1, min_split=32)
    monkeypatch.setattr(pa, "_INTERPRET_CONFIG", cfg)
    monkeypatch.setattr(ta, "_INTERPRET_CONFIG", cfg)
    made = poison_partials(monkeypatch)
    q, k_cache, v_cache, tables, ctx, scale = make_inputs(3, 4, 2, 32, 4, 40, [21, 70, 0], dtype, seed=7)
    assert pa.num_splits_for(3, 2, 40, 4, cfg.block_n, torch.device("cpu")) == 3
    counters = torch.zeros(3 * 2, dtype=torch.int32, device=q.device)
    out = ta.decode_attention(q, k_cache, v_cache, tables, ctx, scale, counters)
    (acc, top, total), = made
    assert acc[0].isnan().all() and top[0].isnan().all() and total[0].isnan().all(), "one split stored a partial"
    assert not acc[1].isnan().any() and not top[1].isnan().any(), "a split of the 70-key row stored no partial"
    assert not counters.any(), "tickets left non-zero"
    ref = paged_decode_attention_ref(q.float(), k_cache.float(), v_cache.float(), tables, ctx, scale)
    assert_close_3way(out, attention_same_dtype(q, k_cache, v_cache, tables, ctx, scale), ref, dtype,
                      f"min_split {dtype}")
    assert torch.equal(out, pa.paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale))
    assert torch.equal(out[2], torch.zeros_like(out[2]))  # the empty row


def test_min_split_holds_only_where_the_rows_fill_the_gpu(monkeypatch):
    """On 132 SMs with 8 kv heads: one row (8 programs) spreads its context over splits of one key block; 16 rows
    (128 programs) take cfg.min_split; under the batch-invariant switch every batch counts as one row."""
    monkeypatch.setattr(pa, "num_sms", lambda device: 132)
    cfg, dev = pa.DecodeConfig(64, 4, 2, min_split=512), torch.device("cpu")
    assert [pa.min_split_for(cfg, b, 8, dev) for b in (1, 8, 9, 16, 64)] == [64, 64, 512, 512, 512]
    monkeypatch.setattr(pa, "batch_invariant", lambda: True)
    assert pa.min_split_for(cfg, 64, 8, dev) == 64


def test_the_tuning_key_holds_the_table_width_and_not_the_batch():
    """The code predictor's one-page tables and the talker's wide ones share head_dim, page size, group and
    dtypes: only the table's width keeps their tuned configs apart; the batch never enters (a CUDA-graph
    sweep over batch sizes must find every key tuned)."""
    def key(bsz, pages):
        q, k_cache, _, tables, _, _ = make_inputs(bsz, 16, 8, 128, 16, pages, [1] * bsz, torch.float32)
        return pa.tuning_key("paged_decode", q, k_cache, tables)

    assert key(1, 1) == ("paged_decode", 128, 16, 2, torch.float32, torch.float32, 16)
    assert key(5, 1) == key(1, 1)
    assert key(2, 640) == ("paged_decode", 128, 16, 2, torch.float32, torch.float32, 10240) != key(2, 1)


def test_the_talkers_one_row_launch_takes_a_key_of_its_own(monkeypatch):
    """The talker's one launch: the one-row step's key is its own, 2 and 16 rows share one (the table width still
    apart); under the switch one key for every batch (its split count is batch 1's there)."""
    ta = kernel_module("talker_attention")

    def key(bsz, pages=40):
        q, k_cache, _, tables, _, _ = make_inputs(bsz, 16, 8, 128, 16, pages, [1] * bsz, torch.float32)
        return ta.talker_key(q, k_cache, tables)

    assert key(1) == ("talker_attention", 128, 16, 2, torch.float32, torch.float32, 640, "one row")
    assert key(2) == key(16) == key(1)[:-1] != key(2, 41)
    monkeypatch.setattr("q3tts.kernels.code_predictor_gemm.batch_invariant", lambda: True)  # few_rows reads it
    assert key(1) == key(16)


def test_warmup_tunes_over_a_serving_context_not_the_whole_table(monkeypatch):
    """kernels.warmup times the configs over rows of `tuning_context(width)` keys: the default talker table's
    10,240 keys are tuned at TUNING_KEYS, the code predictor's one page of 16 in full; every launch fits its
    table."""
    wu = importlib.import_module("q3tts.kernels.warmup")  # the module: q3tts.kernels.warmup is its function
    seen = []
    monkeypatch.setattr(wu, "paged_decode_attention",
                        lambda q, k, v, tables, lens, scale: seen.append((tables.shape[1], lens.tolist())))
    for page_size, max_pages in ((16, 640), (16, 1), (4, 3)):
        wu._tune_paged_attention(4, 2, 16, page_size, max_pages, (1, 3), torch.float32, torch.device("cpu"))
    assert wu.tuning_context(10240) == wu.TUNING_KEYS == 256 and wu.tuning_context(16) == 16
    assert seen == [(640, [256]), (640, [256]), (640, [256] * 3),
                    (1, [16]), (1, [16]), (1, [16] * 3), (3, [12]), (3, [12]), (3, [12] * 3)]
