"""The faults path on CPU: a row whose sampling scores go non-finite (a NaN parameter that bypassed validation
through the engine API, or one written into its slot mid-stream) ends alone with a clear error; the other rows
of the same steps give the bits of a run without it, and the pools return to baseline."""

from __future__ import annotations

import math

import numpy as np
import pytest

from q3tts.core import SamplingParams, VoiceSpec
from q3tts.engine.config import TEST_HOOKS_ENV, EngineConfig
from q3tts.engine.faults import is_device_fault
from tests.engine.conftest import tiny_ckpt, tiny_ckpt_dir  # noqa: F401 (fixtures)
from tests.engine.test_engine import TEXT, make_engine

SAMPLED = dict(temperature=0.8, top_k=20, max_frames=12)
IDS = ("a", "b", "c")
VICTIM = "b"


def run(engine, poison=None, at_step: int = 0) -> dict:
    """Three sampled sequences; `poison(engine)` runs before step `at_step`. Returns id -> (codes, pcm,
    reason, error, outputs that finished)."""
    for i, rid in enumerate(IDS):
        engine.add(rid, VoiceSpec(speaker=speaker_name(engine)), SamplingParams(seed=10 + i, **SAMPLED), TEXT, True)
    got = {rid: ([], [], []) for rid in IDS}
    step = 0
    while engine.has_work():
        if poison is not None and step == at_step:
            poison(engine)
        for out in engine.step():
            codes, pcm, finals = got[out.seq_id]
            codes.append(out.codes)
            pcm.append(out.pcm)
            if out.finished:
                finals.append((out.reason, out.error))
        step += 1
        assert step < 200
    return {rid: (np.concatenate(c), np.concatenate(p), f) for rid, (c, p, f) in got.items()}


def speaker_name(engine) -> str:
    return sorted(engine.checkpoint.config.talker.speaker_ids)[0]


def bypass_validation(field: str):
    """Set `field` of the victim's SamplingParams to NaN after Engine.add validated it (before its prefill)."""
    def poison(engine):
        sampling = engine.scheduler.seqs[VICTIM].sampling
        object.__setattr__(sampling, field, math.nan)
    return poison


def slot_nan(column: str):
    """Write NaN into the victim's slot parameter `column` while it streams."""
    def poison(engine):
        slot = engine.scheduler.seqs[VICTIM].slot
        getattr(engine.runner.state, column)[slot] = math.nan
    return poison


@pytest.fixture(scope="module")
def baseline(tiny_ckpt):  # noqa: F811
    return run(make_engine(tiny_ckpt))


@pytest.mark.parametrize("poison, at_step, names", [
    (bypass_validation("temperature"), 0, "temperature=nan"),  # the prefill's first draw
    (bypass_validation("subtalker_temperature"), 0, "subtalker_temperature=nan"),  # the code predictor
    (slot_nan("temperature"), 4, "sampling produced non-finite scores"),  # mid-stream, talker draw
    (slot_nan("sub_temperature"), 4, "sampling produced non-finite scores"),  # mid-stream, code predictor
], ids=["prefill", "subtalker", "talker-mid-stream", "subtalker-mid-stream"])
def test_a_non_finite_row_ends_alone(tiny_ckpt, baseline, poison, at_step, names):  # noqa: F811
    engine = make_engine(tiny_ckpt)
    got = run(engine, poison, at_step)
    codes, _, finals = got[VICTIM]
    assert len(finals) == 1 and finals[0][0] == "error"
    assert "sampling produced non-finite scores" in finals[0][1] and names in finals[0][1]
    assert len(codes) <= at_step  # frames made before the fault only; none after it
    assert np.array_equal(codes, baseline[VICTIM][0][:len(codes)])
    for rid in IDS:
        if rid != VICTIM:  # untouched: the bits of the run without the fault
            assert got[rid][2] == baseline[rid][2]
            assert np.array_equal(got[rid][0], baseline[rid][0]) and np.array_equal(got[rid][1], baseline[rid][1])
    stats = engine.stats()
    assert stats["kv_pages_used"] == 0 and stats["slots_used"] == 0 and stats["active"] == 0
    engine.check_integrity()
    # the slot serves again: a new sequence on it gives the baseline's bits
    engine.add("again", VoiceSpec(speaker=speaker_name(engine)), SamplingParams(seed=11, **SAMPLED), TEXT, True)
    frames = []
    while engine.has_work():
        frames += [o.codes for o in engine.step()]
    assert np.array_equal(np.concatenate(frames), baseline[VICTIM][0])


def test_the_fault_injection_hook_is_refused_outside_tests(monkeypatch):
    monkeypatch.delenv(TEST_HOOKS_ENV, raising=False)
    with pytest.raises(ValueError, match=f"fault_injection_seed is a test hook: refused unless {TEST_HOOKS_ENV}=1"):
        EngineConfig(fault_injection_seed=1)
    monkeypatch.setenv(TEST_HOOKS_ENV, "1")
    assert EngineConfig(fault_injection_seed=1).fault_injection_seed == 1


def test_the_injected_fault_is_one_the_poison_detector_recognizes(tiny_ckpt, monkeypatch):  # noqa: F811
    monkeypatch.setenv(TEST_HOOKS_ENV, "1")
    engine = make_engine(tiny_ckpt, fault_injection_seed=77)
    engine.add("x", VoiceSpec(speaker=speaker_name(engine)), SamplingParams(seed=77, **SAMPLED), TEXT, True)
    with pytest.raises(Exception) as caught:
        while engine.has_work():
            engine.step()
    assert is_device_fault(caught.value, engine.runner.device)
    assert not is_device_fault(ValueError("index 3 is out of bounds"), engine.runner.device)
