"""The engine's decode step through the OpenAI Triton kernels (the CUDA path), run on CPU by the
Triton interpreter: a batch of sequences at different positions gives the codes of the torch
reference kernels. This is what catches index-layout bugs between the engine and the kernels
(e.g. positions / slot_mapping passed as strided columns of the engine's row metadata)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from q3tts.core import SamplingParams, VoiceSpec
from q3tts.engine.config import EngineConfig
from q3tts.engine.engine import Engine

pytestmark = [
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter"),
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning"),
]

TEXTS = ["Hello there.", "A somewhat longer sentence for the second voice.", "Third one."]


def _codes(ckpt_dir, speaker) -> dict[str, list[bytes]]:
    cfg = EngineConfig(device="cpu", dtype="float32", num_pages=64, max_slots=4, max_frames=8,
                       max_prompt_tokens=128, max_text_tokens=64, graph_batch_sizes=(4,),
                       use_cuda_graphs=False)
    engine = Engine(str(ckpt_dir), cfg, with_codec=False)
    for i, text in enumerate(TEXTS):  # different prompt lengths: rows sit at different positions
        engine.add(f"s{i}", VoiceSpec(speaker=speaker), SamplingParams(greedy=True, max_frames=4),
                   text, True)
    frames: dict[str, list[bytes]] = {}
    while engine.has_work():
        for out in engine.step():
            frames.setdefault(out.seq_id, []).append(out.codes.tobytes())
    return frames


def test_triton_kernels_in_the_engine_match_the_references(tiny_ckpt_dir, speaker, monkeypatch):
    monkeypatch.setenv("Q3TTS_TRITON_ON_CPU", "0")
    want = _codes(tiny_ckpt_dir, speaker)
    monkeypatch.setenv("Q3TTS_TRITON_ON_CPU", "1")
    got = _codes(tiny_ckpt_dir, speaker)
    assert sorted(got) == sorted(want) == ["s0", "s1", "s2"]
    assert got == want


def _audio(ckpt_dir, speaker, codec_kernels: bool, codec_fusion: bool = False) -> dict[str, np.ndarray]:
    cfg = EngineConfig(device="cpu", dtype="float32", num_pages=64, max_slots=2, max_frames=4,
                       max_prompt_tokens=128, max_text_tokens=64, graph_batch_sizes=(2,),
                       use_cuda_graphs=False, codec_kernels=codec_kernels, codec_fusion=codec_fusion)
    engine = Engine(str(ckpt_dir), cfg)
    for i, text in enumerate(TEXTS[:2]):
        engine.add(f"s{i}", VoiceSpec(speaker=speaker), SamplingParams(greedy=True, max_frames=3), text, True)
    pcm: dict[str, list[np.ndarray]] = {}
    while engine.has_work():
        for out in engine.step():
            pcm.setdefault(out.seq_id, []).append(out.pcm)
    return {k: np.concatenate(v) for k, v in pcm.items()}


def test_codec_kernels_config_runs_the_codec_through_the_kernels(tiny_ckpt_dir, speaker, monkeypatch):
    """EngineConfig.codec_kernels: the same audio as the torch codec (conv/SnakeBeta kernels, interpreter).
    The reference run keeps every op in torch (fast); the codes match (see the test above), so the
    audio differs by the codec's kernels only. With EngineConfig.codec_fusion, the unfused kernels' audio."""
    monkeypatch.setenv("Q3TTS_TRITON_ON_CPU", "0")
    want = _audio(tiny_ckpt_dir, speaker, codec_kernels=False)
    monkeypatch.setenv("Q3TTS_TRITON_ON_CPU", "1")
    got = _audio(tiny_ckpt_dir, speaker, codec_kernels=True)
    assert sorted(got) == sorted(want) == ["s0", "s1"]
    for k in want:
        assert got[k].shape == want[k].shape == (3 * 1920,)
        assert np.abs(got[k] - want[k]).max() <= 1e-5
        assert not np.array_equal(got[k], want[k])  # the kernels did run: fp32 sums in another order
    fused = _audio(tiny_ckpt_dir, speaker, codec_kernels=True, codec_fusion=True)
    assert all(np.array_equal(fused[k], got[k]) for k in want), "EngineConfig.codec_fusion changed the audio"
