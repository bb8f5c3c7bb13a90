"""`SamplingParams.from_generation_config`: the one reader of generation_config.json defaults."""

from __future__ import annotations

import pytest

from q3tts.checkpoint.presets import GENERATION_CONFIG as RELEASED  # what make-checkpoint writes
from q3tts.core import SamplingParams


def test_released_config_gives_the_class_defaults():
    assert SamplingParams.from_generation_config(RELEASED) == SamplingParams()
    assert SamplingParams.from_generation_config(None) == SamplingParams()


def test_config_values_then_overrides():
    gen = dict(RELEASED, temperature=0.7, subtalker_top_k=20, max_new_tokens=300)
    p = SamplingParams.from_generation_config(gen, top_k=5, seed=None, max_frames=None)
    # max_new_tokens is no default: without max_frames the engine's cap follows the text
    assert (p.temperature, p.subtalker_top_k, p.max_frames, p.top_k, p.seed) == (0.7, 20, None, 5, 0)
    assert SamplingParams.from_generation_config(gen, max_frames=12).max_frames == 12


@pytest.mark.parametrize("do_sample, sub_sample, override, talker, cp", [
    (True, True, {}, False, False),
    (False, False, {}, True, True),
    (False, True, {}, True, False),   # the reference draws the two apart
    (True, False, {}, False, True),
    (False, True, {"greedy": True}, True, True),   # a greedy override is argmax for both
    (True, True, {"greedy": True}, True, True),
    (False, False, {"greedy": False}, False, False),
    (True, True, {"greedy": True, "subtalker_greedy": False}, True, False),
])
def test_greedy_flags(do_sample, sub_sample, override, talker, cp):
    gen = dict(RELEASED, do_sample=do_sample, subtalker_dosample=sub_sample)
    p = SamplingParams.from_generation_config(gen, **override)
    assert (p.greedy, p.cp_greedy) == (talker, cp)
