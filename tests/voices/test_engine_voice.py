"""A registered voice drives the engine exactly as its reference audio does, without running an encoder."""

from __future__ import annotations

import numpy as np
import pytest

from q3tts.codec.encoder import CodecEncoder
from q3tts.core import SamplingParams, VoiceSpec
from q3tts.engine.batch import BatchRequest, run_requests
from q3tts.engine.config import EngineConfig
from q3tts.engine.engine import Engine
from q3tts.models.speaker_encoder import SpeakerEncoder

from voice_fixtures import REF_SR, REF_TEXT

TEXT = "A registered voice speaks."
GREEDY = SamplingParams(greedy=True, max_frames=12)


@pytest.fixture(scope="module")
def engine(base_ckpt):
    return Engine.from_checkpoint(str(base_ckpt), EngineConfig(device="cpu", dtype="float32", max_slots=2,
                                                               use_cuda_graphs=False))


def codes_of(engine, voice: VoiceSpec) -> np.ndarray:
    result = run_requests(engine, [BatchRequest("r", TEXT, voice, GREEDY)], write=False)["r"]
    assert result.reason in ("eos", "max_frames"), result.error
    return result.codes


@pytest.mark.parametrize("xvector_only", [False, True])
def test_voice_equals_its_reference_audio(engine, store, enroller, ref_wav, monkeypatch, xvector_only):
    direct = codes_of(engine, VoiceSpec(ref_audio=ref_wav, ref_sample_rate=REF_SR,
                                        ref_text=None if xvector_only else REF_TEXT, xvector_only=xvector_only))
    store.add(enroller.enroll("judy", ref_wav, REF_SR, REF_TEXT, xvector_only=xvector_only))
    voice = store.read("judy")

    def no_encoder(*_a, **_k):
        raise AssertionError("an encoder ran for a registered voice")

    monkeypatch.setattr(CodecEncoder, "encode", no_encoder)
    monkeypatch.setattr(SpeakerEncoder, "embed", no_encoder)
    via_voice = codes_of(engine, voice.spec())
    assert direct.shape[0] > 0
    np.testing.assert_array_equal(via_voice, direct)
