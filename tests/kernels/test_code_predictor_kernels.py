"""kernels/code_predictor_*.py vs their torch references (code_predictor_reference.py; the sampler:
models/sampling.warp_and_draw), and the fused code predictor vs models/code_predictor.py.

Tiny code-predictor shapes (the 'tiny' preset): hidden 48, intermediate 96, 4 heads / 2 kv heads of
16, 16 positions. Every output is poisoned (NaN) before the kernel writes it; every launch must leave
its ticket counters at zero. Tolerance: kernel_checks.assert_close_3way (2x the same-dtype torch
error against the fp32 reference, plus the dtype's atol).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernel_checks import DEVICE, assert_close_3way, kernel_module
from q3tts.checkpoint.maker import make_checkpoint, random_main_weights
from q3tts.checkpoint.presets import model_config_dict
from q3tts.config import ModelConfig
from q3tts.core import SamplingParams, VoiceSpec
from q3tts.engine.config import EngineConfig
from q3tts.engine.engine import Engine
from q3tts.kernels import code_predictor_reference as R
from q3tts.kernels.reference import rope_cos_sin
from q3tts.models.code_predictor_fused import FusedCodePredictor
from q3tts.models.sampling import (GREEDY, TOPK, TOPK_CAP, SamplingTensors, SubtalkerSampler,
                                   apply_temperature, apply_top_k_capped, uniforms, warp_and_draw)
from q3tts.models.talker import Talker

cpk = kernel_module("code_predictor")
GemmConfig = cpk.GemmConfig

H, I, NH, KVH, D, P, EPS = 48, 96, 4, 2, 16, 16, 1e-6
DTYPES = [torch.float32, torch.bfloat16]
# None: the interpreter's default; then split-K paths: 2 slices, and 4 slices of which the last is
# empty for K = 48 (slices are BLOCK_K-aligned)
CONFIGS = [None, GemmConfig(16, 32, 2, 1, 1), GemmConfig(16, 16, 4, 1, 1)]
CONFIG_IDS = ["default", "split2", "split4"]


def _gen(*seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(hash(seed) % (1 << 31))


def _randn(gen, *shape, scale=1.0, dtype=torch.float32) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, device=DEVICE) * scale).to(dtype)


def _weight(gen, rows, cols, dtype) -> torch.Tensor:
    return _randn(gen, rows, cols, scale=cols ** -0.5, dtype=dtype)


def _norm_weight(gen, dim, dtype) -> torch.Tensor:
    return (1 + _randn(gen, dim, scale=0.1)).to(dtype)


def _poisoned(*shape, dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def _counters() -> torch.Tensor:
    return torch.zeros(256, dtype=torch.int32, device=DEVICE)


def _f32(*ts):
    return [t.float() if t is not None and t.is_floating_point() else t for t in ts]


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("rows", [1, 19])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_project_plain_and_gathered_rows(dtype, rows, config):
    gen = _gen(1, rows, CONFIGS.index(config), DTYPES.index(dtype))
    w, b = _weight(gen, H, 64, dtype), _randn(gen, H, scale=0.02, dtype=dtype)
    x, table = _randn(gen, rows, 64, dtype=dtype), _randn(gen, 50, 64, scale=0.5, dtype=dtype)
    codes = torch.randint(0, 50, (rows, 3), generator=gen, device=DEVICE)
    ids = codes[:, 1]  # a strided column, as the fused predictor passes it
    counters = _counters()
    for args in ((x, None), (table, ids)):
        out = cpk.project(args[0], w, b, counters, ids=args[1], config=config,
                          out=_poisoned(rows, H, dtype=dtype))
        assert_close_3way(out, R.project_ref(*args[:1], w, b, args[1]),
                          R.project_ref(*_f32(args[0], w, b), args[1]), dtype, "project")
    assert not counters.any()


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("rows", [1, 19])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_residual(dtype, rows, config):
    gen = _gen(2, rows, CONFIGS.index(config), DTYPES.index(dtype))
    x, w, res = _randn(gen, rows, I, dtype=dtype), _weight(gen, H, I, dtype), \
        _randn(gen, rows, H, dtype=dtype)
    counters = _counters()
    out = cpk.linear_residual(x, w, res, counters, config=config, out=_poisoned(rows, H, dtype=dtype))
    assert_close_3way(out, R.linear_residual_ref(x, w, res),
                      R.linear_residual_ref(*_f32(x, w, res)), dtype, "linear_residual")
    assert not counters.any()


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("rows", [1, 19])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_norm_gate_up(dtype, rows, config):
    gen = _gen(3, rows, CONFIGS.index(config), DTYPES.index(dtype))
    x, nw, w = _randn(gen, rows, H, scale=3, dtype=dtype), _norm_weight(gen, H, dtype), \
        _weight(gen, 2 * I, H, dtype)
    counters = _counters()
    out = cpk.norm_gate_up(x, nw, w, EPS, counters, config=config,
                           out=_poisoned(rows, I, dtype=dtype))
    assert_close_3way(out, R.norm_gate_up_ref(x, nw, w, EPS),
                      R.norm_gate_up_ref(*_f32(x, nw, w), EPS), dtype, "norm_gate_up")
    assert not counters.any()


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("tokens", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_norm_head_takes_the_last_token_of_each_row(dtype, tokens, config):
    gen = _gen(4, tokens, CONFIGS.index(config), DTYPES.index(dtype))
    bsz, vocab = 17, 64
    x, nw, w = _randn(gen, bsz * tokens, H, dtype=dtype), _norm_weight(gen, H, dtype), \
        _weight(gen, vocab, H, dtype)
    counters = _counters()
    out = cpk.norm_head(x, nw, w, EPS, counters, tokens, config=config,
                        out=_poisoned(bsz, vocab, dtype=torch.float32))
    assert out.dtype == torch.float32
    assert_close_3way(out, R.norm_head_ref(x, nw, w, EPS, tokens),
                      R.norm_head_ref(*_f32(x, nw, w), EPS, tokens), dtype, "norm_head")
    assert not counters.any()


class _AttentionCase:
    """Inputs of one layer's qkv_attention and three caches that evolve pass by pass: the kernel's,
    the reference's in the same dtype, and the fp32 reference's. In the kernel's cache, positions no
    pass has written yet and rows past the batch hold NaN (it must never read them); the references
    read every slot of a page and mask, so theirs start at zero (as the eager cache does)."""

    def __init__(self, gen, bsz, dtype):
        self.dtype, self.bsz = dtype, bsz
        self.weights = (_norm_weight(gen, H, dtype), _weight(gen, (NH + 2 * KVH) * D, H, dtype),
                        _norm_weight(gen, D, dtype), _norm_weight(gen, D, dtype))
        self.rope = rope_cos_sin(torch.arange(P, device=DEVICE), D, 1e6, dtype)
        self.kernel = [_poisoned(bsz + 1, P, KVH, D, dtype=dtype) for _ in range(2)]
        self.ref = [torch.zeros_like(c) for c in self.kernel]
        self.ref32 = [c.float() for c in self.ref]

    def run(self, x, pos0, tokens, counters, config):
        args = (pos0, tokens, EPS, D ** -0.5)
        out = cpk.qkv_attention(x, *self.weights, *self.rope, *self.kernel, *args, counters,
                                config=config, out=_poisoned(x.shape[0], NH * D, dtype=self.dtype))
        ref = R.qkv_attention_ref(x, *self.weights, *self.rope, *self.ref, *args)
        ref32 = R.qkv_attention_ref(*_f32(x, *self.weights, *self.rope), *self.ref32, *args)
        return out, ref, ref32


@pytest.mark.parametrize("config", [None, GemmConfig(16, 32, 3, 1, 1)], ids=["default", "split3"])
@pytest.mark.parametrize("bsz", [1, 9])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_qkv_attention_over_a_frame(dtype, bsz, config):
    """Pass 0 (2 tokens per row at positions 0, 1), then passes at positions 2 and 3: outputs and
    every cache entry written match the references (9 rows x 2 tokens span two row blocks)."""
    gen = _gen(5, bsz, DTYPES.index(dtype), config is None)
    case, counters = _AttentionCase(gen, bsz, dtype), _counters()
    for pos0, tokens in ((0, 2), (2, 1), (3, 1)):
        x = _randn(gen, bsz * tokens, H, scale=2, dtype=dtype)
        out, ref, ref32 = case.run(x, pos0, tokens, counters, config)
        assert_close_3way(out, ref, ref32, dtype, f"attention at {pos0}")
        written = slice(0, pos0 + tokens)
        for got, want, want32 in zip(case.kernel, case.ref, case.ref32):
            assert_close_3way(got[:bsz, written], want[:bsz, written], want32[:bsz, written], dtype,
                              f"cache after {pos0}")
            assert got[:bsz, pos0 + tokens:].isnan().all() and got[bsz:].isnan().all()
        assert not counters.any()


def test_qkv_attention_contract_violations_raise():
    gen = _gen(6)
    case = _AttentionCase(gen, 2, torch.float32)
    x = _randn(gen, 2, H)
    with pytest.raises(AssertionError, match="positions"):
        cpk.qkv_attention(x, *case.weights, *case.rope, *case.kernel, P, 1, EPS, 0.25, _counters())
    with pytest.raises(AssertionError, match="caches"):
        cpk.qkv_attention(x, *case.weights, *case.rope, case.kernel[0].bfloat16(), case.kernel[1],
                          0, 1, EPS, 0.25, _counters())
    with pytest.raises(AssertionError, match="counters"):
        cpk.qkv_attention(x, *case.weights, *case.rope, *case.kernel, 0, 1, EPS, 0.25,
                          _counters()[:0])


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


def test_sample_greedy_mode_is_argmax_with_first_index_ties():
    gen = _gen(7)
    logits = _randn(gen, 33, VOCAB, scale=3)
    logits[0, [5, 700]] = logits[0].max() + 1  # tie: the first index wins
    params = _sampling([SamplingParams(greedy=True)] * 33, GREEDY)
    u = torch.rand(33, 16, generator=gen, device=DEVICE)[:, 2]
    got = _draw(logits, params, u)
    assert got[0] == 5
    assert torch.equal(got, warp_and_draw(logits, params, u))


def test_sample_topk_mode_draws_what_warp_and_draw_draws():
    """Mixed rows (greedy, k = 1 / 7 / 50 / 64, temperatures, a tie at the k-th value): the same ids
    as the reference, except where u lands within fp32 rounding of a CDF step."""
    gen = _gen(8)
    rows = [SamplingParams(subtalker_top_k=k, subtalker_temperature=t, greedy=g)
            for k, t, g in [(1, 0.9, False), (7, 0.5, False), (50, 0.9, False), (64, 1.3, False),
                            (50, 0.9, True)] * 13]
    logits = _randn(gen, len(rows), VOCAB, scale=3)
    logits[1, :7] = logits[1].max() + 1  # seven ties at the top: k = 7 keeps exactly them
    logits[1, 7] = logits[1, 0]
    params = _sampling(rows, TOPK)
    u = torch.rand(len(rows), generator=gen, device=DEVICE)
    got, want = _draw(logits, params, u), warp_and_draw(logits, params, u)
    differ = got != want
    assert not (differ & ~_at_cdf_step(logits, params, u)).any(), \
        f"rows {differ.nonzero().flatten().tolist()} drew {got[differ]} not {want[differ]}"
    assert differ.sum() <= 1


@pytest.mark.parametrize("mode", [GREEDY, TOPK])
def test_sample_finite_guard_matches_the_reference(mode):
    """NaN / +inf scores, an all -inf row and (TOPK) NaN or zero temperatures draw id 0 and are or-ed
    into faults; a fault already set stays set."""
    gen = _gen(9, mode == TOPK)
    base = SamplingParams(greedy=mode == GREEDY)
    temps = [0.9, 0.9, 0.9, float("nan"), 0.0, 0.9, 0.9] if mode == TOPK else [0.9] * 7
    params = _sampling([dataclasses.replace(base, subtalker_temperature=t) for t in temps], mode)
    logits = _randn(gen, 7, VOCAB)
    logits[0, 3], logits[1, 9], logits[2] = float("nan"), float("inf"), float("-inf")
    u = torch.rand(7, generator=gen, device=DEVICE)
    faults = torch.zeros(7, dtype=torch.bool, device=DEVICE)
    faults[6] = True
    want_faults = faults.clone()
    got = _draw(logits, params, u, faults)
    want = warp_and_draw(logits, params, u, faults=want_faults)
    assert torch.equal(got, want) and torch.equal(faults, want_faults)
    assert faults[:5 if mode == TOPK else 3].all() and got[:3].eq(0).all() and faults[6]


# ------------------------------------------------------------------- the fused code predictor

TEXT_IDS = dict(im_start=1, im_end=2, assistant=3, tts_pad=4, tts_bos=5, tts_eos=6)


def _tiny_talker(size: str) -> Talker:
    """The tiny preset's talker with the checkpoint maker's random weights, fp32."""
    config = ModelConfig.from_dict(model_config_dict("custom_voice", size, "tiny", TEXT_IDS, 100))
    weights = random_main_weights(config, seed=3, dtype=torch.float32)
    talker = Talker(config.talker)
    talker.load_state_dict({k.removeprefix("talker."): v for k, v in weights.items()})
    return talker.to(DEVICE).eval().fuse_()


def test_fused_code_predictor_generates_the_eager_codes(monkeypatch):
    """fp32, the tiny 0.6B preset (no input projection: embedding rows straight in): after
    use_fused(True), generate runs the fused passes (Triton interpreter on CPU) and gives the eager
    passes' codes c1..c15 and next input; a greedy row, and a top-p row whose FULL-mode draws go
    through warp_and_draw with the same uniforms."""
    talker = _tiny_talker("0.6b")
    cp = talker.code_predictor
    gen = _gen(10)
    rows = [SamplingParams(greedy=True), SamplingParams(subtalker_top_p=0.8)]
    past_hidden = _randn(gen, len(rows), talker.cfg.hidden_size)
    c0 = torch.randint(0, VOCAB, (len(rows),), generator=gen, device=DEVICE)
    params = SamplingTensors.subtalker(rows, DEVICE)
    u = uniforms(torch.arange(len(rows), device=DEVICE), torch.full((len(rows),), 7, device=DEVICE))
    calls = []
    fused_generate = FusedCodePredictor.generate
    monkeypatch.setattr(FusedCodePredictor, "generate",
                        lambda self, *a: calls.append(1) or fused_generate(self, *a))
    with torch.no_grad():
        monkeypatch.setenv("Q3TTS_TRITON_ON_CPU", "0")  # the eager passes on the torch references
        want_codes, want_next = cp.generate(past_hidden, c0, SubtalkerSampler(params, u))
        monkeypatch.setenv("Q3TTS_TRITON_ON_CPU", "1")
        cp.use_fused(True)
        got_codes, got_next = cp.generate(past_hidden, c0, SubtalkerSampler(params, u))
    assert calls == [1] and got_codes.shape == (len(rows), 15)
    assert torch.equal(got_codes, want_codes) and torch.equal(got_next, want_next)


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


def test_engine_fused_code_predictor_switch(tmp_path, monkeypatch):
    """EngineConfig.fused_code_predictor (tiny 1.7B, with its input projection, fp32): a greedy and a
    sampled (TOPK) sequence make the same two frames as with the eager passes (frame 1's c0 comes
    from the talker fed with the fused passes' next input)."""
    assert EngineConfig().fused_code_predictor is False
    with pytest.raises(ValueError, match="fused_code_predictor must be true or false"):
        EngineConfig(fused_code_predictor="yes")
    ckpt_dir = make_checkpoint(tmp_path / "cv", "custom_voice", "1.7b", "tiny", seed=0)
    monkeypatch.setenv("Q3TTS_TRITON_ON_CPU", "0")
    want = _engine_frames(ckpt_dir, fused=False)
    monkeypatch.setenv("Q3TTS_TRITON_ON_CPU", "1")
    calls = []
    fused_generate = FusedCodePredictor.generate
    monkeypatch.setattr(FusedCodePredictor, "generate",
                        lambda self, *a: calls.append(1) or fused_generate(self, *a))
    got = _engine_frames(ckpt_dir, fused=True)
    assert len(calls) == 2 and sorted(got) == ["s0", "s1"]
    assert got == want
