"""kernels/code_predictor_*.py vs their torch references (code_predictor_reference.py; the sampler:
models/sampling.warp_and_draw_reference), and the fused code predictor vs models/code_predictor.py.

Kernel checks at the tiny shapes (code_predictor_cases.py: poisoned outputs, counters left zero,
tolerance from the dtype), with the interpreter's default config and explicit split-K configs.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.nn import functional as F

from code_predictor_cases import (TINY, AttentionFrame, Inputs, assert_as_faithful, check_gather,
                                  check_gemms, forced_logits, row_stats)
from kernel_checks import DEVICE, kernel_module
from q3tts.checkpoint.maker import make_checkpoint, random_main_weights
from q3tts.checkpoint.presets import model_config_dict
from q3tts.config import ModelConfig
from q3tts.core import SamplingParams, VoiceSpec
from q3tts.engine.config import EngineConfig
from q3tts.engine.engine import Engine
from q3tts.models.sampling import (FULL, GREEDY, TOPK, TOPK_CAP, SamplingTensors, SubtalkerSampler, TalkerRules,
                                   apply_repetition_penalty, apply_temperature, apply_top_k_capped, block_eos,
                                   sample_talker, suppress_range, uniforms, warp_and_draw,
                                   warp_and_draw_reference)
from q3tts.models.talker import Talker

cpk = kernel_module("code_predictor")  # skips the module without triton
from q3tts.models.code_predictor_fused import FusedCodePredictor  # noqa: E402 (imports triton)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from q3tts.kernels import code_predictor_reference as R  # noqa: E402
from q3tts.kernels.code_predictor_attention import spread  # noqa: E402
from q3tts.kernels.code_predictor_sampling import _kth_largest  # noqa: E402
from q3tts.kernels.reference import rope_cos_sin  # noqa: E402
GemmConfig = cpk.GemmConfig

DTYPES = [torch.float32, torch.bfloat16]
# None: the interpreter's default; then split-K paths: 2 slices, and 4 slices of which the last is
# empty for K = 48 (slices are BLOCK_K-aligned)
CONFIGS = [None, GemmConfig(16, 32, 2, 1, 1), GemmConfig(16, 16, 4, 1, 1)]
CONFIG_IDS = ["default", "split2", "split4"]


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("rows", [1, 19])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemm_kernels_match_their_references(dtype, rows, config):
    """project, o_proj / down + residual, norm + gate_up, norm + head (one and two tokens per row);
    19 rows span two row blocks."""
    inp = Inputs(DEVICE, 1, rows, CONFIGS.index(config), dtype.itemsize)
    check_gemms(cpk, TINY, rows, dtype, inp, config)


@pytest.mark.parametrize("config", [None, GemmConfig(16, 32, 3, 1, 1)], ids=["default", "split3"])
@pytest.mark.parametrize("bsz", [1, 9])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_qkv_attention_over_a_frame(dtype, bsz, config):
    """Passes at positions (0, 1), 2, 3, 4, 5: outputs and every cache entry written match the references
    (9 rows x 2 tokens span two row blocks)."""
    inp = Inputs(DEVICE, 5, bsz, dtype.itemsize, config is None)
    AttentionFrame(cpk, TINY, bsz, dtype, inp).run_frame(config)


@pytest.mark.parametrize("config", [None, GemmConfig(16, 32, 3, 1, 1)], ids=["default", "split3"])
@pytest.mark.parametrize("bsz", [1, 19])
def test_qkv_attention_gathers_its_rows_by_id(bsz, config):
    """19 rows span two row blocks (fp32; check_gather says what)."""
    check_gather(cpk, TINY, bsz, torch.float32, Inputs(DEVICE, 41, bsz), config)


@pytest.fixture
def held_tiles(monkeypatch):
    """The GEMM launches take the held-tile path (`held_columns` as with programmatic launch on, which the
    interpreter has not): each program's whole weight tile loaded at once, one dot over it."""
    from q3tts.kernels import code_predictor_gemm as gemm
    held_columns = gemm.held_columns
    monkeypatch.setattr(gemm, "held_columns", lambda *args: held_columns(*args[:-1], True))  # pdl: the last


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_held_weight_tiles_match_the_references(dtype, config, held_tiles):
    """The held-tile path (`weights_before_wait`, `mainloop` with HOLD) of every GEMM and of the qkv +
    attention launch, 19 rows (two row blocks; split4's last K slice is empty, so its tile is all zeros)."""
    check_gemms(cpk, TINY, 19, dtype, Inputs(DEVICE, 7, 19, CONFIGS.index(config), dtype.itemsize), config)
    AttentionFrame(cpk, TINY, 9, dtype, Inputs(DEVICE, 8, 9, dtype.itemsize)).run_frame(config)


def test_held_columns_hold_the_k_slice_only_under_pdl_and_the_cap():
    """K slices are BLOCK_K-aligned, the held width their next power of 2, at most HOLD_MAX elements a tile."""
    from q3tts.kernels.code_predictor_gemm import HOLD_MAX, held_columns
    assert HOLD_MAX == 32768
    assert held_columns(32, 2048, 8, 128, True) == 256  # o_proj: 8 slices of 256
    assert held_columns(32, 3072, 8, 128, True) == 512  # down: slices of 384, held 512 wide
    assert held_columns(64, 1024, 4, 128, True) == 256  # gate_up's interleaved 64-row tile
    assert held_columns(32, 6144, 8, 128, True) == 1024  # the talker's down: slices of 768, 32 x 1024 = HOLD_MAX
    assert held_columns(64, 2048, 2, 128, True) == 0  # 64 x 1024 > HOLD_MAX: streamed
    assert held_columns(32, 2048, 8, 128, False) == 0  # no PDL, nothing to hide


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_embed_sum_adds_in_order_and_rounds_once(dtype):
    """C(c0) + 15 embedding rows by id -> the rows added in fp32 in torch's CUDA order, rounded once (bit-equal
    to embed_sum_ref; a width that is not a multiple of the program's columns); within fp32 reordering of the
    eager stack-and-sum on this CPU."""
    inp = Inputs(DEVICE, 43)
    first, tables = inp.randn(3, 600, dtype=dtype), tuple(inp.randn(50, 600, dtype=dtype) for _ in range(15))
    ids = torch.randint(0, 50, (3, 15), generator=inp.gen, device=DEVICE)
    got = cpk.embed_sum(first, tables, ids, out=inp.poisoned(3, 600, dtype=dtype))
    assert torch.equal(got, R.embed_sum_ref(first, tables, ids))
    terms = torch.stack([first] + [t[ids[:, g]] for g, t in enumerate(tables)], 1).float()  # [B, 16, H]
    step = 16 * torch.finfo(torch.float32).eps * terms.abs().sum(1) + torch.finfo(dtype).eps * terms.sum(1).abs()
    assert ((got.float() - terms.sum(1).to(dtype).float()).abs() <= step).all()


@pytest.mark.parametrize("rows", [1, 19])
def test_norm_gate_up_takes_the_row_statistics_it_is_given(rows):
    """Given statistics 4x the rows' own (`row_stats`), the norm scales its rows by half where it would not: the
    gate/up activations move by a large fraction of their size (rows 1: the one-row statistics path; 19: two row
    blocks). The talker's qkv launch: test_talker_fused.py."""
    inp, s, f32 = Inputs(DEVICE, 32, rows), TINY, torch.float32
    h, nw = inp.randn(rows, s.hidden, scale=2), inp.norm_weight(s.hidden, f32)
    gate_up_w = inp.weight(2 * s.inter, s.hidden, f32)
    own, scaled = (cpk.norm_gate_up(h, nw, gate_up_w, 1e-6, inp.counters(), stats=k * row_stats(h)) for k in (1, 4))
    assert (own - scaled).abs().max() > 0.2 * own.abs().max(), "the statistics were not read"


@pytest.mark.parametrize("switched", [False, True], ids=["default", "batch_invariant"])
def test_a_rows_attention_alone_is_its_attention_among_others(switched, switch):
    """A one-row launch attends in one round of loads (`_attend_few`; checked against the references by
    test_qkv_attention_over_a_frame at bsz 1); a one-token launch of more rows runs that same one-row epilogue in
    its row programs (`spread`), a first pass (two tokens a row) the chunked epilogue over the row block. So a row
    alone is bit-equal to the same row among 3 (fp32, where another softmax order shows: the chunked epilogue on
    the one-token passes failed it), and under `batch_invariant()` too, where the one-row launch's first pass takes
    the chunked path and its other passes the row programs."""
    switch(switched)
    assert spread(1, 1) == switched and spread(3, 1) and not spread(3, 2)
    inp, s = Inputs(DEVICE, 31), TINY
    weights = (inp.norm_weight(s.hidden, torch.float32),
               inp.weight((s.heads + 2 * s.kv_heads) * s.head_dim, s.hidden, torch.float32),
               inp.norm_weight(s.head_dim, torch.float32), inp.norm_weight(s.head_dim, torch.float32))
    rope = rope_cos_sin(torch.arange(s.positions, device=DEVICE), s.head_dim, 1e6, torch.float32)
    caches = {b: [torch.zeros(b, s.positions, s.kv_heads, s.head_dim, device=DEVICE) for _ in range(2)]
              for b in (1, 3)}
    for pos0, t in ((0, 2), (2, 1), (3, 1), (4, 1), (5, 1)):
        x = inp.randn(3 * t, s.hidden, scale=2)  # batch row 0: rows 0..t-1
        args = (pos0, t, 1e-6, s.head_dim ** -0.5)
        alone = cpk.qkv_attention(x[:t], *weights, *rope, *caches[1], *args, inp.counters())
        among = cpk.qkv_attention(x, *weights, *rope, *caches[3], *args, inp.counters())[:t]
        assert torch.equal(alone, among), f"pass at {pos0}: max |diff| {(alone - among).abs().max():.3g}"


def test_qkv_attention_contract_violations_raise():
    inp = Inputs(DEVICE, 6)
    frame = AttentionFrame(cpk, TINY, 2, torch.float32, inp)
    x, args = inp.randn(2, TINY.hidden), (*frame.weights, *frame.rope)
    with pytest.raises(AssertionError, match="positions"):
        cpk.qkv_attention(x, *args, *frame.kernel, TINY.positions, 1, 1e-6, 0.25, inp.counters())
    with pytest.raises(AssertionError, match="caches"):
        cpk.qkv_attention(x, *args, frame.kernel[0].bfloat16(), frame.kernel[1], 0, 1, 1e-6, 0.25,
                          inp.counters())
    with pytest.raises(AssertionError, match="counters"):
        cpk.qkv_attention(x, *args, *frame.kernel, 0, 1, 1e-6, 0.25, inp.counters()[:0])


# ------------------------------------------------------------------------------------ sampling

VOCAB = 2048  # the code predictor's codebook


def _sampling(rows: list[SamplingParams], mode: str) -> SamplingTensors:
    params = SamplingTensors.subtalker(rows, DEVICE)
    assert params.mode == mode, f"test rows give mode {params.mode}, not {mode}"
    return params


def _draw(logits, params, u, faults=None) -> torch.Tensor:
    """The kernel's draw into a poisoned strided column (as the fused predictor's codes table)."""
    codes = torch.full((logits.shape[0], 15), -1, dtype=torch.int64, device=DEVICE)
    cpk.sample(logits, params.temperature, params.top_k, params.greedy, u, params.mode == TOPK,
               TOPK_CAP, out=codes[:, 3], faults=faults)
    return codes[:, 3]


def _at_cdf_step(logits: torch.Tensor, params: SamplingTensors, u: torch.Tensor) -> torch.Tensor:
    """[B] bool: u * total lies within fp32 rounding of a step of the row's CDF (float64 here)."""
    kept = apply_top_k_capped(apply_temperature(logits, params.temperature, params.greedy),
                              params.top_k, TOPK_CAP).double()
    cdf = kept.softmax(-1).cumsum(-1)  # [B, V]
    target = u.double()[:, None] * cdf[:, -1:]
    return (cdf - target).abs().min(-1).values <= 1e-5


@triton.jit
def _kth_kernel(x_ptr, valid_ptr, k_ptr, out_ptr, V: tl.constexpr, BLOCK_V: tl.constexpr):
    """out[r] = _kth_largest of row r's valid entries (the sampling kernel's threshold search alone)."""
    r = tl.program_id(0)
    idx = tl.arange(0, BLOCK_V)
    inside = idx < V
    x = tl.load(x_ptr + r * V + idx, mask=inside, other=float("-inf"))
    valid = (tl.load(valid_ptr + r * V + idx, mask=inside, other=0) != 0) & inside
    tl.store(out_ptr + r, _kth_largest(x, valid, tl.load(k_ptr + r)))


def test_kth_largest_is_torch_topks_kth_value():
    """The radix select's threshold over the valid entries of a row, k = 1 / 2 / 7 / 64 / all of them:
    negatives, a run of ties across the k-th place, -inf entries, +-0 and a row with one valid entry."""
    inp = Inputs(DEVICE, 21)
    x = inp.randn(12, VOCAB, scale=4)
    valid = torch.rand(12, VOCAB, generator=inp.gen, device=DEVICE) < 0.7
    x[1, 100:110] = 2.5  # ties straddle the 7th place
    x[1, :100] = -1.0
    x[2, ::3] = float("-inf")
    x[3, :50], x[3, 50:100] = 0.0, -0.0
    valid[4] = False
    valid[4, 17] = True  # one valid entry
    valid[5] = True
    ks = torch.tensor([1, 7, 7, 64, 1, VOCAB, 2, 64, 7, 1, 2, 64], device=DEVICE)
    out = torch.empty(12, device=DEVICE)
    _kth_kernel[(12,)](x, valid.to(torch.int8), ks, out, V=VOCAB, BLOCK_V=triton.next_power_of_2(VOCAB))
    want = torch.stack([row[ok].topk(int(k)).values[-1] for row, ok, k in zip(x, valid, ks)])
    assert torch.equal(out, want), (out, want)


def test_sample_greedy_mode_is_argmax_with_first_index_ties():
    inp = Inputs(DEVICE, 7)
    logits = inp.randn(33, VOCAB, scale=3)
    logits[0, [5, 700]] = logits[0].max() + 1  # tie: the first index wins
    params = _sampling([SamplingParams(greedy=True)] * 33, GREEDY)
    u = torch.rand(33, 16, generator=inp.gen, device=DEVICE)[:, 2]
    got = _draw(logits, params, u)
    assert got[0] == 5
    assert torch.equal(got, warp_and_draw_reference(logits, params, u))


def test_sample_topk_mode_draws_what_warp_and_draw_draws():
    """Mixed rows (greedy, k = 1 / 7 / 50 / 64, temperatures, a tie at the k-th value): the same ids
    as the reference, except where u lands within fp32 rounding of a CDF step."""
    inp = Inputs(DEVICE, 8)
    rows = [SamplingParams(subtalker_top_k=k, subtalker_temperature=t, greedy=g)
            for k, t, g in [(1, 0.9, False), (7, 0.5, False), (50, 0.9, False), (64, 1.3, False),
                            (50, 0.9, True)] * 13]
    logits = inp.randn(len(rows), VOCAB, scale=3)
    logits[1, :7] = logits[1].max() + 1  # seven ties at the top: k = 7 keeps exactly them
    logits[1, 7] = logits[1, 0]
    params = _sampling(rows, TOPK)
    u = torch.rand(len(rows), generator=inp.gen, device=DEVICE)
    got, want = _draw(logits, params, u), warp_and_draw_reference(logits, params, u)
    differ = got != want
    assert not (differ & ~_at_cdf_step(logits, params, u)).any(), \
        f"rows {differ.nonzero().flatten().tolist()} drew {got[differ]} not {want[differ]}"
    assert differ.sum() <= 1


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's switch: a GPU always runs the single reductions")
@pytest.mark.parametrize("mode", [GREEDY, TOPK])
def test_single_reductions_draw_what_the_interpreters_reductions_draw(mode, monkeypatch):
    """The GPU's reductions of several values at once (`_ONE_REDUCTION`: a row's argmax, maximum and NaN count;
    the CDF's total and the last id of non-zero probability), which the interpreter runs lane by lane, here at
    a 64-wide row: the same ids and faults as its one reduction per value, over rows with the best score tied
    (first index wins), +-0 on top, NaN / +inf / all -inf, a NaN temperature, and k from 1 to the whole row."""
    cps = kernel_module("code_predictor_sampling")
    inp = Inputs(DEVICE, 13, mode == TOPK)
    vocab, n = 64, 12
    logits = inp.randn(n, vocab, scale=3)
    logits[0, [9, 40]] = logits[0].max() + 1  # tie on top: the first index
    logits[1, [2, 7]] = 0.0
    logits[1, 5] = -0.0
    logits[1, 8:] = -1.0  # +-0 on top
    logits[2, 3], logits[3, 5], logits[4] = float("nan"), float("inf"), float("-inf")
    logits[5, ::2] = float("-inf")
    rows = [SamplingParams(greedy=mode == GREEDY or g, subtalker_top_k=k, subtalker_temperature=t)
            for k, t, g in [(1, 0.9, True), (7, 0.5, True), (50, 0.9, False), (64, 1.3, False), (7, 0.9, False),
                            (3, 0.7, False), (64, float("nan"), False), (5, 1.0, False), (1, 0.8, False),
                            (60, 0.6, False), (2, 2.0, False), (9, 0.9, True)]]
    params = _sampling(rows, mode)
    u = torch.rand(n, generator=inp.gen, device=DEVICE)
    draws = []
    for single in (False, True):
        monkeypatch.setattr(cps, "_ONE_REDUCTION", tl.constexpr(single))
        faults = torch.zeros(n, dtype=torch.bool, device=DEVICE)
        draws.append((_draw(logits, params, u, faults), faults))
    (got, got_faults), (want, want_faults) = draws[1], draws[0]
    assert torch.equal(got, want) and torch.equal(got_faults, want_faults), (got, want, got_faults, want_faults)
    assert got[0] == 9 and got_faults[2:5].all() and not got_faults[:2].any()
    assert len(set(got.tolist())) > 4  # rows draw apart


@pytest.mark.parametrize("mode", [GREEDY, TOPK])
def test_sample_finite_guard_matches_the_reference(mode):
    """NaN / +inf scores, an all -inf row and (TOPK) NaN or zero temperatures draw id 0 and are
    or-ed into faults; a fault already set stays set."""
    inp = Inputs(DEVICE, 9, mode == TOPK)
    base = SamplingParams(greedy=mode == GREEDY)
    temps = [0.9, 0.9, 0.9, float("nan"), 0.0, 0.9, 0.9] if mode == TOPK else [0.9] * 7
    params = _sampling([dataclasses.replace(base, subtalker_temperature=t) for t in temps], mode)
    logits = inp.randn(7, VOCAB)
    logits[0, 3], logits[1, 9], logits[2] = float("nan"), float("inf"), float("-inf")
    u = torch.rand(7, generator=inp.gen, device=DEVICE)
    faults = torch.zeros(7, dtype=torch.bool, device=DEVICE)
    faults[6] = True
    want_faults = faults.clone()
    got = _draw(logits, params, u, faults)
    want = warp_and_draw_reference(logits, params, u, faults=want_faults)
    assert torch.equal(got, want) and torch.equal(faults, want_faults)
    assert faults[:5 if mode == TOPK else 3].all() and got[:3].eq(0).all() and faults[6]


@pytest.mark.parametrize("mode", [GREEDY, TOPK])
def test_sample_talker_runs_its_processors_in_the_kernel(mode, monkeypatch):
    """sample_talker where the kernels serve (one launch: the processors inside the draw) against its torch
    reference (repetition penalty, EOS blocked, control ids suppressed, then warp_and_draw_reference): rows
    with penalties above and below 1 over a random history, fewer and more than min_new_tokens frames, the
    best score on EOS and on a suppressed id, a NaN row (faults); the same ids but where u lands within fp32
    rounding of a CDF step of the processed scores."""
    cps = kernel_module("code_predictor_sampling")
    calls: list[int] = []
    kernel = cps.sample
    monkeypatch.setattr(cps, "sample", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    monkeypatch.setenv("Q3TTS_TRITON_ON_CPU", "1")
    inp = Inputs(DEVICE, 12, mode == TOPK)
    vocab, rules = 3072, TalkerRules(eos_id=2150, suppress_start=2048)
    n = 40
    rows = [SamplingParams(greedy=mode == GREEDY, top_k=k, temperature=t, repetition_penalty=p)
            for k, t, p in [(50, 0.9, 1.05), (7, 0.6, 1.3), (1, 1.0, 0.8), (64, 1.2, 1.0)] * (n // 4)]
    params = SamplingTensors.talker(rows, DEVICE)
    assert params.mode == mode
    logits = inp.randn(n, vocab, scale=3)
    logits[1, 2150] = logits[2, 2150] = logits[5, 2500] = 50.0  # EOS on top (blocked, then not); a control id
    logits[6, 100] = float("nan")
    generated = torch.rand(n, vocab, generator=inp.gen, device=DEVICE) < 0.05
    num_generated = torch.arange(n, device=DEVICE) % 3  # 0, 1 (EOS blocked), 2
    u = torch.rand(n, generator=inp.gen, device=DEVICE)
    faults, want_faults = (torch.zeros(n, dtype=torch.bool, device=DEVICE) for _ in range(2))
    got = sample_talker(logits, params, rules, generated, num_generated, u, faults)
    scores = suppress_range(block_eos(apply_repetition_penalty(logits, generated, params.repetition_penalty),
                                      num_generated, rules.eos_id, rules.min_new_tokens), rules.suppress_start,
                            rules.eos_id)
    want = warp_and_draw_reference(scores, params, u, want_faults)
    assert calls == [1]
    differ = got != want
    near_step = _at_cdf_step(scores, params, u) if mode == TOPK else torch.zeros_like(differ)
    assert not (differ & ~near_step).any(), f"rows {differ.nonzero().flatten().tolist()} differ"
    assert torch.equal(faults, want_faults) and faults[6] and got[6] == 0
    if mode == GREEDY:
        assert got[1] != 2150 and got[2] == 2150 and got[5] < 2048


def test_warp_and_draw_runs_the_kernel_where_the_kernels_serve(monkeypatch):
    """warp_and_draw sends fp32 GREEDY / TOPK draws to the sampling kernel where the kernels serve the
    logits (CUDA, or here the interpreter), writing `out` in place; FULL draws, bf16 logits and
    Q3TTS_KERNELS=torch stay with the torch reference."""
    cps = kernel_module("code_predictor_sampling")
    calls: list[str] = []
    kernel = cps.sample
    monkeypatch.setattr(cps, "sample", lambda *a, **k: calls.append("kernel") or kernel(*a, **k))
    monkeypatch.setenv("Q3TTS_TRITON_ON_CPU", "1")
    inp = Inputs(DEVICE, 11)
    logits = inp.randn(5, VOCAB, scale=3)
    u = torch.rand(5, generator=inp.gen, device=DEVICE)
    topk = _sampling([SamplingParams(subtalker_top_k=50)] * 5, TOPK)
    out = torch.full((5, 15), -1, dtype=torch.int64, device=DEVICE)
    got = warp_and_draw(logits, topk, u, out=out[:, 2])
    assert calls == ["kernel"] and got.data_ptr() == out[:, 2].data_ptr()
    assert torch.equal(out[:, 2], warp_and_draw_reference(logits, topk, u))
    warp_and_draw(logits, _sampling([SamplingParams(greedy=True)] * 5, GREEDY), u)
    assert calls == ["kernel"] * 2
    full = _sampling([SamplingParams(subtalker_top_p=0.8)] * 5, FULL)
    assert torch.equal(warp_and_draw(logits, full, u), warp_and_draw_reference(logits, full, u))
    warp_and_draw(logits.bfloat16(), topk, u)
    monkeypatch.setenv("Q3TTS_KERNELS", "torch")
    warp_and_draw(logits, topk, u)
    assert calls == ["kernel"] * 2


# ------------------------------------------------------------------- the fused code predictor

TEXT_IDS = dict(im_start=1, im_end=2, assistant=3, tts_pad=4, tts_bos=5, tts_eos=6)


def _tiny_talker(size: str) -> Talker:
    """The tiny preset's talker with the checkpoint maker's random weights, fp32."""
    config = ModelConfig.from_dict(model_config_dict("custom_voice", size, "tiny", TEXT_IDS, 100))
    weights = random_main_weights(config, seed=3, dtype=torch.float32)
    talker = Talker(config.talker)
    talker.load_state_dict({k.removeprefix("talker."): v for k, v in weights.items()})
    return talker.to(DEVICE).eval().fuse_()


@pytest.fixture
def fused_calls(monkeypatch) -> list[int]:
    """Grows by one at each FusedCodePredictor.generate call."""
    calls: list[int] = []
    fused_generate = FusedCodePredictor.generate
    monkeypatch.setattr(FusedCodePredictor, "generate",
                        lambda self, *a: calls.append(1) or fused_generate(self, *a))
    return calls


def test_fused_code_predictor_generates_the_eager_codes(fused_calls, monkeypatch):
    """fp32, the tiny 0.6B preset (no input projection: embedding rows straight in): after
    use_fused(2), generate of 2 rows runs the fused passes (Triton interpreter on CPU) and gives the eager
    passes' codes c1..c15 and next input; a greedy row, and a top-p row whose FULL-mode draws go
    through warp_and_draw with the same uniforms. With use_fused(1) the 2 rows run the eager passes."""
    talker = _tiny_talker("0.6b")
    cp = talker.code_predictor
    inp = Inputs(DEVICE, 10)
    rows = [SamplingParams(greedy=True), SamplingParams(subtalker_top_p=0.8)]
    past_hidden = inp.randn(len(rows), talker.cfg.hidden_size)
    c0 = torch.randint(0, VOCAB, (len(rows),), generator=inp.gen, device=DEVICE)
    params = SamplingTensors.subtalker(rows, DEVICE)
    u = uniforms(torch.arange(len(rows), device=DEVICE), torch.full((len(rows),), 7, device=DEVICE))
    with torch.no_grad():
        monkeypatch.setenv("Q3TTS_TRITON_ON_CPU", "0")  # the eager passes on the torch references
        want_codes, want_next = cp.generate(past_hidden, c0, SubtalkerSampler(params, u))
        monkeypatch.setenv("Q3TTS_TRITON_ON_CPU", "1")
        cp.use_fused(1)
        cp.generate(past_hidden, c0, SubtalkerSampler(params, u))
        assert fused_calls == []  # more rows than the fused batch bound: eager
        cp.use_fused(2)
        got_codes, got_next = cp.generate(past_hidden, c0, SubtalkerSampler(params, u))
    assert fused_calls == [1] and got_codes.shape == (len(rows), 15)
    assert torch.equal(got_codes, want_codes)
    # the next input: the same 16 rows, added in torch's CUDA order (embed_sum), where this CPU's torch adds
    # them in another
    tables = tuple(e.weight for e in cp.model.codec_embedding)
    e0 = cp._embed_c0(c0)
    assert torch.equal(got_next, R.embed_sum_ref(e0, tables, got_codes))
    terms = torch.stack([e0] + [t[got_codes[:, g]] for g, t in enumerate(tables)], 1)  # [B, 16, H]
    assert ((got_next - want_next).abs() <= 16 * torch.finfo(torch.float32).eps * terms.abs().sum(1)).all()


@torch.no_grad()
def test_projected_input_tables_follow_the_weights():
    """The 1.7B's later passes gather from codec_embedding[j - 1] through the projection, computed once: each row
    summed in float64 and rounded once (within fp32 rounding of the eager projection), and made again once
    load_state_dict changes the weights (not before)."""
    cp = _tiny_talker("1.7b").code_predictor
    fused, proj = FusedCodePredictor(cp), cp.small_to_mtp_projection

    def check(tables: list[torch.Tensor], j: int) -> None:
        rows = cp.model.codec_embedding[j].weight
        assert torch.equal(tables[j], F.linear(rows.double(), proj.weight.double(), proj.bias.double()).float())
        torch.testing.assert_close(tables[j], proj(rows))

    first = fused._pass_tables()
    assert len(first) == 14 and fused._pass_tables() is first  # kept
    for j in range(14):
        check(first, j)
    state = {k: v * 1.5 if k.startswith(("small_to_mtp", "model.codec_embedding.3.")) else v
             for k, v in cp.state_dict().items()}
    cp.load_state_dict(state)
    again = fused._pass_tables()
    assert again is not first and not torch.equal(again[3], first[3])
    check(again, 3)


@torch.no_grad()
def test_fused_bf16_rounds_where_the_eager_bf16_passes_round(monkeypatch):
    """bf16, the tiny 1.7B preset (input projection, every layer), 9 rows (two row blocks on pass
    0), all 15 passes teacher-forced to the same codes: the fused logits equal the eager bf16
    logits (torch references) within 1 bf16 step of the row, and are no further from the fp32 eager logits.
    A kernel that rounds where eager does not, or skips a rounding, departs by whole steps (the QK-norm's
    rounding of x * rstd skipped: 2.4 steps; on the CPU the fused passes depart by at most 0.59, most passes
    by under 0.01). On a GPU the reference itself moves: the same eager passes depart from their CPU run by 1.16
    steps on an H100 (cuBLAS's sum order, approximate exp and rsqrt), and the fused ones by 1.96, so there the
    bound is twice that distance (the kernel tests' rule: 2x the same-dtype torch error)."""
    import copy

    # the eager passes on the torch references, on the GPU too (the eager stack's Triton kernels round elsewhere:
    # its paged attention's weights are rounded before they are normalised; 1.9 steps from the references)
    monkeypatch.setenv("Q3TTS_KERNELS", "torch")
    # cuBLAS may otherwise reduce bf16 GEMMs' split-K partials in bf16: not the fp32 accumulation this compares to
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction", False)
    talker = _tiny_talker("1.7b")
    cp32 = talker.code_predictor
    cp16 = copy.deepcopy(talker).to(torch.bfloat16).code_predictor  # embed_c0 converted too
    inp = Inputs(DEVICE, 11)
    bsz = 9
    past_hidden = inp.randn(bsz, cp32.small_to_mtp_projection.in_features)
    c0 = torch.randint(0, VOCAB, (bsz,), generator=inp.gen, device=DEVICE)
    codes = torch.randint(0, VOCAB, (bsz, 15), generator=inp.gen, device=DEVICE)
    ref = forced_logits(cp32.generate, past_hidden, c0, codes)
    args = (past_hidden.bfloat16(), c0, codes)
    eager = forced_logits(cp16.generate, *args)
    fused = forced_logits(FusedCodePredictor(cp16).generate, *args)
    step = torch.finfo(torch.bfloat16).eps * eager.abs().amax(-1, keepdim=True)  # a row's bf16 step
    steps = lambda logits: ((logits.to(DEVICE) - eager).abs() / step).amax().item()  # noqa: E731
    moved = 0.0 if DEVICE == "cpu" else steps(forced_logits(
        copy.deepcopy(talker).to("cpu", torch.bfloat16).code_predictor.generate, *(a.cpu() for a in args)))
    worst = steps(fused)
    assert worst <= max(1.0, 2 * moved), \
        f"fused departs from eager bf16 by {worst:.2f} bf16 steps (the eager passes on the CPU: {moved:.2f})"
    assert_as_faithful(fused, eager, ref)


def _engine_frames(ckpt_dir, fused: bool) -> dict[str, list[list[int]]]:
    config = EngineConfig(device=DEVICE, dtype="float32", num_pages=32, max_slots=2, max_frames=8,
                          max_prompt_tokens=128, max_text_tokens=64, graph_batch_sizes=(2,),
                          use_cuda_graphs=False, fused_code_predictor=fused)
    engine = Engine(str(ckpt_dir), config, with_codec=False)
    speaker = sorted(engine.checkpoint.config.talker.speaker_ids)[0]
    for i, text in enumerate(["Hello there.", "Another one, a little longer."]):
        engine.add(f"s{i}", VoiceSpec(speaker=speaker),
                   SamplingParams(greedy=i == 0, seed=i, max_frames=2), text, True)
    frames: dict[str, list[list[int]]] = {}
    while engine.has_work():
        for out in engine.step():
            frames.setdefault(out.seq_id, []).append(out.codes.tolist())
    return frames


def test_engine_fused_code_predictor_switch(tmp_path, fused_calls, monkeypatch):
    """EngineConfig.fused_code_predictor (tiny 1.7B, with its input projection, fp32): a greedy and
    a sampled (TOPK) sequence make the same two frames as with the eager passes (frame 1's c0 comes
    from the talker fed with the fused passes' next input)."""
    for bad in ("yes", True, -1):
        with pytest.raises(ValueError, match="fused_code_predictor must be an int >= 0"):
            EngineConfig(fused_code_predictor=bad)
    ckpt_dir = make_checkpoint(tmp_path / "cv", "custom_voice", "1.7b", "tiny", seed=0)
    monkeypatch.setenv("Q3TTS_TRITON_ON_CPU", "0")
    want = _engine_frames(ckpt_dir, fused=0)
    monkeypatch.setenv("Q3TTS_TRITON_ON_CPU", "1")
    got = _engine_frames(ckpt_dir, fused=2)
    assert len(fused_calls) == 2 and sorted(got) == ["s0", "s1"]
    assert got == want
