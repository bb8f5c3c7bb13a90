"""Golden parity with the official qwen-tts 0.1.1 (fp32, CPU, greedy) on our tiny random checkpoints:
prefill embeddings within 1e-5 and identical codes for every variant, voice form and text mode."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from q3tts.engine.api import SamplingParams, VoiceSpec
from q3tts.synth import generate_codes
from reference_runner import run_reference

FRAMES = 30
TEXT = "Hello world, this is a test of the speech system."
_rng = np.random.default_rng(7)
XVECTOR = (_rng.standard_normal(64) * 0.5).astype(np.float32)
REF_CODES_SHORT = _rng.integers(0, 2048, size=(4, 16))
REF_CODES_LONG = _rng.integers(0, 2048, size=(40, 16))

# id -> (checkpoint, voice)
CASES = {
    "cv17-ryan-english": ("cv17", VoiceSpec(speaker="ryan", language="english")),
    "cv17-instruct-auto": ("cv17", VoiceSpec(speaker="Vivian", language="Auto",
                                             instruct="Speak slowly with a warm voice.")),
    "cv17-dialect-eric": ("cv17", VoiceSpec(speaker="eric", language="auto")),
    "cv06-serena-chinese": ("cv06", VoiceSpec(speaker="serena", language="chinese")),
    "cv06-instruct-dropped": ("cv06", VoiceSpec(speaker="dylan", language="auto",
                                                instruct="A deep male voice.")),
    "vd17-design": ("vd17", VoiceSpec(language="english",
                                      instruct="A young female voice, bright and energetic.")),
    "base17-icl-short-ref": ("base17", VoiceSpec(ref_codes=REF_CODES_SHORT, xvector=XVECTOR,
                                                 ref_text="Bonjour le monde, comment ça va ?",
                                                 language="french")),
    "base17-icl-long-ref": ("base17", VoiceSpec(ref_codes=REF_CODES_LONG, xvector=XVECTOR,
                                                ref_text="Hi.", language="english")),
    "base17-xvector-only": ("base17", VoiceSpec(xvector=XVECTOR, xvector_only=True)),
}
MODES = ("incremental", "whole")


def _pair(name, mode, ours, reference, reference_runs):
    ckpt, voice = CASES[name]
    voice = VoiceSpec(**{**voice.__dict__, "text_mode": mode})
    mine = ours(ckpt)
    key = (name, mode)
    if key not in reference_runs:
        reference_runs[key] = run_reference(reference(ckpt), mine.model.config.variant, TEXT, voice,
                                            mode == "whole", FRAMES)
    return mine, mine.builder.build(TEXT, voice), reference_runs[key]


@pytest.mark.oracle
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(CASES))
def test_prefill_and_codes_match_reference(name, mode, ours, reference, reference_runs):
    mine, prompt, ref = _pair(name, mode, ours, reference, reference_runs)
    assert prompt.prefill.shape == ref.prefill.shape
    assert (prompt.prefill - ref.prefill).abs().max().item() <= 1e-5
    assert prompt.trailing.shape == ref.trailing.shape
    assert (prompt.trailing - ref.trailing).abs().max().item() <= 1e-5
    codes = generate_codes(mine.model, prompt, SamplingParams(greedy=True, max_frames=FRAMES))
    assert ref.codes.shape == (FRAMES, 16)
    assert torch.equal(codes, ref.codes.cpu())


@pytest.mark.oracle
def test_reference_loads_our_keys_strictly(checkpoint_dirs, reference, ours):
    for name in checkpoint_dirs:
        ref_keys = {k for k in reference(name).model.state_dict() if not k.startswith("speech_tokenizer.")}
        assert ref_keys == set(ours(name).ckpt.weights), name

