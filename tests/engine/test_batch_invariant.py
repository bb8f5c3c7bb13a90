"""EngineConfig.batch_invariant: a row's codes and PCM independent of the batch it ran in.

CPU: the config field, the one linear dispatch point (`models.layers.linear`) reached by every linear
layer of the talker, code predictor and codec, the codec's row-independent paths computing the same
function as torch's, and identical greedy requests served together bit-equal to one alone (on the CPU
this may hold anyway: it guards the plumbing). GPU: the same at 16 requests with the switch on (issue
11 item 4), and the SNR between them with it off, recorded."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from q3tts import kernels
from q3tts.codec.decoder import CodecDecoder
from q3tts.core import SamplingParams, VoiceSpec
from q3tts.engine.config import EngineConfig
from q3tts.engine.engine import Engine
from q3tts.models.attention import PagedKVCache, PrefillContext

TEXT = "Hello there, this is one sentence spoken again and again."
CPU = EngineConfig(device="cpu", dtype="float32", num_pages=96, max_slots=4, max_frames=4, max_prompt_tokens=128,
                   max_text_tokens=64, graph_batch_sizes=(1, 2, 4), use_cuda_graphs=False, batch_invariant=True)


# --- the config field ---------------------------------------------------------------------------

def test_config_field():
    assert EngineConfig().batch_invariant is False
    cfg = EngineConfig.from_dict({"batch_invariant": True, "max_slots": 48, "fused_code_predictor": 8})
    assert cfg.batch_invariant is True and cfg.max_slots == 48
    assert cfg.fused_code_predictor_batch == 64  # every bucket: the first >= 48 slots
    assert dataclasses.replace(cfg, batch_invariant=False).fused_code_predictor_batch == 8
    with pytest.raises(ValueError, match="batch_invariant must be true or false"):
        EngineConfig(batch_invariant=1)


# --- the dispatch point -------------------------------------------------------------------------

def _count_linear(monkeypatch) -> dict[str, int]:
    """Calls of kernels.linear and of F.linear (kernels.linear's CPU path included)."""
    calls = {"kernels": 0, "F": 0}
    kernel_linear, torch_linear = kernels.linear, F.linear

    def via_kernels(*a, **kw):
        calls["kernels"] += 1
        return kernel_linear(*a, **kw)

    def via_torch(*a, **kw):
        calls["F"] += 1
        return torch_linear(*a, **kw)

    monkeypatch.setattr(kernels, "linear", via_kernels)
    monkeypatch.setattr(F, "linear", via_torch)
    return calls


def test_the_dispatch_point_takes_a_transposed_view(monkeypatch, switch):
    """The codec transformer's input is [B, T, C] as a transposed view of [B, C, T]: for one row its [M, K]
    reshape is a view whose last dim is not contiguous, which the GEMM kernel refuses (the GPU run of
    test_engine_graph_prefill_base_icl, a Base voice primed after an engine left the switch on)."""
    from q3tts.models.layers import linear

    monkeypatch.setenv("Q3TTS_TRITON_ON_CPU", "1")  # the kernel through the interpreter off CUDA
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 32, 3, generator=g).to(dev).transpose(1, 2)  # [1, T=3, K=32], stride(-1) == 3
    w, b = torch.randn(16, 32, generator=g).to(dev), torch.randn(16, generator=g).to(dev)
    switch(True)
    torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def _codec(ckpt) -> CodecDecoder:
    return CodecDecoder.from_weights(ckpt.codec_config, ckpt.codec_weights)


def test_every_linear_layer_goes_through_kernels_linear(tiny_ckpt, monkeypatch, switch):
    from q3tts.models.tts_model import Qwen3TTS

    talker = Qwen3TTS.from_checkpoint(tiny_ckpt).talker.eval()
    codec = _codec(tiny_ckpt)
    ids = torch.tensor([3, 5, 7])
    codes = torch.randint(0, 64, (2, 16, 3), generator=torch.Generator().manual_seed(0))

    def run():
        with torch.no_grad():
            x = talker.embed_text(ids)  # [3, H]: text projection, 2 linears
            cache_rows = torch.arange(3)
            lc = talker.cfg.layers
            cache = PagedKVCache(lc.num_layers, 1, 4, lc.num_kv_heads, lc.head_dim, torch.float32)
            hidden = talker(x, cache_rows, PrefillContext(cache, cache_rows, talker.attn_scale))  # 4 per layer
            logits = talker.logits(hidden)  # 1
            pcm = codec.decode(codes)
        return logits, pcm

    calls = _count_linear(monkeypatch)
    switch(False)
    want = run()
    assert calls["kernels"] == 0
    dcfg = tiny_ckpt.codec_config.decoder
    # talker: text projection, 4 per layer, head; codec: RVQ, proj, 4 per layer (q|k|v as one GEMM, o,
    # gate|up, down), ConvNeXt
    expected = (2 + 4 * talker.cfg.layers.num_layers + 1
                + 2 + 2 + 4 * dcfg.num_layers + 2 * len(dcfg.upsampling_ratios))
    calls.update(kernels=0, F=0)
    switch(True)
    got = run()
    assert calls["kernels"] == expected and calls["F"] == expected  # no layer around the dispatch point
    # the codec's row-independent paths (transposed convs as convs, depthwise multiply-adds) compute torch's
    # function: fp32 agreement to rounding
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-5)


def test_codec_convs_leave_torch_under_the_switch(tiny_ckpt, monkeypatch, switch):
    """No nn.Conv1d / nn.ConvTranspose1d module runs (cuDNN on CUDA): kernels.causal_conv1d, linear and
    the depthwise multiply-adds do, even with the decoder's use_kernels off."""
    codec = _codec(tiny_ckpt)
    codes = torch.randint(0, 64, (1, 16, 2), generator=torch.Generator().manual_seed(1))
    seen: list[str] = []
    for cls in (torch.nn.Conv1d, torch.nn.ConvTranspose1d):
        monkeypatch.setattr(cls, "forward", lambda self, x, *a, _f=cls.forward: seen.append(type(self).__name__)
                            or _f(self, x, *a))
    switch(False)
    codec.decode(codes)
    assert {"Conv1d", "ConvTranspose1d"} <= set(seen)  # the spies see torch's convs
    seen.clear()
    switch(True)
    codec.decode(codes)
    assert seen == []


# --- the engine ---------------------------------------------------------------------------------

def serve(engine: Engine, speaker: str, n: int, tag: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """n identical greedy requests added before the first step -> per request (codes [F, 16], pcm [F*1920])."""
    for i in range(n):
        engine.add(f"{tag}{i}", VoiceSpec(speaker=speaker), SamplingParams(greedy=True, seed=7), TEXT, True)
    codes: dict[str, list[np.ndarray]] = {}
    pcm: dict[str, list[np.ndarray]] = {}
    while engine.has_work():
        for out in engine.step():
            assert out.error is None, out.error
            codes.setdefault(out.seq_id, []).append(out.codes)
            pcm.setdefault(out.seq_id, []).append(out.pcm)
    assert sorted(codes) == sorted(f"{tag}{i}" for i in range(n))
    return {sid: (np.concatenate(codes[sid]), np.concatenate(pcm[sid])) for sid in codes}


def assert_bit_equal_to_alone(engine: Engine, speaker: str, n: int) -> None:
    together = serve(engine, speaker, n, "t")
    (codes, pcm), = serve(engine, speaker, 1, "a").values()
    assert codes.shape[0] >= 1 and pcm.size == codes.shape[0] * engine.runner.samples_per_frame
    for sid, (c, p) in together.items():
        assert np.array_equal(c, codes), f"{sid}: codes differ from the request alone"
        assert np.array_equal(p, pcm), f"{sid}: pcm differs from the request alone"


def per_row(op):
    """`op` called on each batch row alone: the kernels' contract under the switch (a row's result independent
    of the others) on the CPU, where kernels.linear / causal_conv1d fall back to torch (MKL / oneDNN pick their
    blocking by shape) and the Triton interpreter would take minutes per step."""

    def run(x, *args, **kwargs):
        return torch.cat([op(x[i:i + 1], *args, **kwargs) for i in range(x.shape[0])])

    return run


def test_identical_requests_together_equal_one_alone(tiny_ckpt_dir, speaker, switch, monkeypatch):
    for name in ("linear", "causal_conv1d"):
        monkeypatch.setattr(kernels, name, per_row(getattr(kernels, name)))
    switch(False)
    engine = Engine(str(tiny_ckpt_dir), CPU)
    assert kernels.batch_invariant()  # the engine turned the kernels' switch on
    cp = engine.runner.talker.code_predictor
    assert cp._fused_max_batch == CPU.max_graph_batch
    assert_bit_equal_to_alone(engine, speaker, 4)


# --- GPU ----------------------------------------------------------------------------------------

def _gpu_engine(ckpt_dir, batch_invariant: bool) -> Engine:
    """The two buckets the comparison needs (16 together, 1 alone): fewer graphs to capture."""
    cfg = EngineConfig(device="cuda", dtype="bfloat16", num_pages=512, max_slots=16, max_frames=48,
                       max_prompt_tokens=256, max_text_tokens=128, graph_batch_sizes=(1, 16),
                       batch_invariant=batch_invariant)
    return Engine(str(ckpt_dir), cfg)


@pytest.fixture(scope="module", params=["tiny", "full"])
def gpu_ckpt_dir(request, tmp_path_factory):
    """The tiny checkpoint, and the real-size 1.7B one (the tuned launch configs are per weight shape;
    about 40 s to make on the H200)."""
    from q3tts.checkpoint.maker import make_checkpoint

    scale = request.param
    return make_checkpoint(tmp_path_factory.mktemp(f"invariant_{scale}") / scale, "custom_voice", "1.7b", scale,
                           seed=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_16_identical_requests_bit_equal_to_one_alone(gpu_ckpt_dir, switch):
    switch(False)
    engine = _gpu_engine(gpu_ckpt_dir, batch_invariant=True)
    speaker = sorted(engine.checkpoint.config.talker.speaker_ids)[0]
    assert_bit_equal_to_alone(engine, speaker, 16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_batch_variance_without_the_switch(gpu_ckpt_dir, switch):
    """Records (prints) how far 16 identical requests served together land from the request alone with the
    switch off; asserts only that both runs made audio."""
    switch(False)
    engine = _gpu_engine(gpu_ckpt_dir, batch_invariant=False)
    speaker = sorted(engine.checkpoint.config.talker.speaker_ids)[0]
    together = serve(engine, speaker, 16, "t")
    (codes, pcm), = serve(engine, speaker, 1, "a").values()
    snrs, same_codes = [], 0
    for c, p in together.values():
        n = min(p.size, pcm.size)
        assert n > 0 and np.isfinite(p).all()
        noise = np.sum((p[:n].astype(np.float64) - pcm[:n]) ** 2)
        snrs.append(np.inf if noise == 0 else 10 * np.log10(np.sum(pcm[:n].astype(np.float64) ** 2) / noise))
        same_codes += c.shape == codes.shape and np.array_equal(c, codes)
    print(f"\nbatch_invariant off, {gpu_ckpt_dir.name}: 16 together vs alone: pcm SNR min {min(snrs):.1f} dB, "
          f"median {float(np.median(snrs)):.1f} dB; rows with the alone codes {same_codes}/16")
