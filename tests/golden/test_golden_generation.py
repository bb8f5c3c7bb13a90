"""Golden parity with the official qwen-tts 0.1.1 (fp32, CPU, greedy) on our tiny random checkpoints:
prefill embeddings within 1e-5 and identical codes for every variant, voice form and text mode."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from q3tts.core import SamplingParams, VoiceSpec
from q3tts.models.generate import generate_codes
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



def _table_source(table: torch.Tensor):
    """An injected uniform source: row `counter` of a fixed [frames + 1, 16] table."""
    return lambda seeds, counters: table[counters.long()]


def test_sampled_run_with_injected_uniforms_repeats(ours):
    mine = ours("cv17")
    prompt = mine.builder.build(TEXT, CASES["cv17-ryan-english"][1])
    table = torch.rand(FRAMES + 1, 16, generator=torch.Generator().manual_seed(5))
    params = SamplingParams(max_frames=12)
    first = generate_codes(mine.model, prompt, params, _table_source(table))
    again = generate_codes(mine.model, prompt, params, _table_source(table))
    other = generate_codes(mine.model, prompt, params, _table_source(table.flip(0)))
    assert first.shape == (12, 16) and torch.equal(first, again) and not torch.equal(first, other)
    seeded = generate_codes(mine.model, prompt, SamplingParams(max_frames=12, seed=3))
    assert torch.equal(seeded, generate_codes(mine.model, prompt, SamplingParams(max_frames=12, seed=3)))


def _bias_eos(module: torch.nn.Module, eos_id: int):
    """Forward hook on a codec head adding +100 to the EOS logit."""
    def hook(_mod, _inp, out):
        bias = torch.zeros(out.shape[-1], dtype=out.dtype)
        bias[eos_id] = 100.0
        return out + bias
    return module.register_forward_hook(hook)


@pytest.mark.oracle
def test_forced_eos_ends_request_like_reference(ours, reference):
    mine = ours("cv06")
    voice = CASES["cv06-serena-chinese"][1]
    eos = mine.model.config.talker.codec_eos_id
    wrapper = reference("cv06")
    handles = [_bias_eos(mine.model.talker.codec_head, eos),
               _bias_eos(wrapper.model.talker.codec_head, eos)]
    try:
        codes = generate_codes(mine.model, mine.builder.build(TEXT, voice),
                               SamplingParams(greedy=True, max_frames=FRAMES))
        ref = run_reference(wrapper, "custom_voice", TEXT, voice, True, FRAMES)
    finally:
        for h in handles:
            h.remove()
    assert codes.shape == (2, 16)  # EOS is blocked for the first two frames only
    assert torch.equal(codes, ref.codes)
