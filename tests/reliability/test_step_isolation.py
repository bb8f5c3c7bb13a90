"""Step fault isolation on CPU: an error raised by the step's device work whenever one sequence's row is in
it (engine/isolation.RowFault) ends that sequence alone with one clear error; the other rows give the bits
of a run without it, the engine's pools return to baseline and its slots serve again."""

from __future__ import annotations

import numpy as np
import pytest

from q3tts.core import SamplingParams, VoiceSpec
from q3tts.engine.isolation import RowFault
from tests.engine.conftest import tiny_ckpt, tiny_ckpt_dir  # noqa: F401 (fixtures)
from tests.engine.test_engine import TEXT, make_engine

SAMPLED = dict(temperature=0.8, top_k=20, max_frames=12)
IDS = ("a", "b", "c", "d")
VICTIM = "b"


def run(engine, ids, fault_stage: str | None = None, at_step: int = 0) -> dict:
    """Sampled sequences `ids` (seed = their index in IDS); a RowFault on VICTIM from step `at_step`.
    Returns id -> (codes [F, 16], pcm, finals)."""
    speaker = sorted(engine.checkpoint.config.talker.speaker_ids)[0]
    for rid in ids:
        engine.add(rid, VoiceSpec(speaker=speaker), SamplingParams(seed=10 + IDS.index(rid), **SAMPLED), TEXT, True)
    got = {rid: ([np.zeros((0, 16), np.int64)], [np.zeros(0, np.float32)], []) for rid in ids}
    step, fault = 0, None
    while engine.has_work():
        if fault_stage is not None and step == at_step:
            fault = RowFault(engine, VICTIM, fault_stage)
        for out in engine.step():
            codes, pcm, finals = got[out.seq_id]
            codes.append(out.codes)
            pcm.append(out.pcm)
            if out.finished:
                finals.append((out.reason, out.error))
        step += 1
        assert step < 200
    if fault is not None:
        fault.remove()
    return {rid: (np.concatenate(c), np.concatenate(p), f) for rid, (c, p, f) in got.items()}


@pytest.fixture(scope="module")
def with_victim(tiny_ckpt):  # noqa: F811
    return run(make_engine(tiny_ckpt), IDS)


@pytest.fixture(scope="module")
def without_victim(tiny_ckpt):  # noqa: F811
    return run(make_engine(tiny_ckpt), [rid for rid in IDS if rid != VICTIM])


@pytest.mark.parametrize("stage, at_step, frames", [
    ("prefill", 0, 0),  # its start fails: it never makes a frame
    ("decode", 0, 0),  # the first decode step (the prefill of the same step succeeded)
    ("decode", 5, 5),  # mid-stream: the frames before the fault stand
], ids=["prefill", "first-decode", "mid-stream"])
def test_a_failing_row_ends_alone(tiny_ckpt, with_victim, without_victim, stage, at_step, frames):  # noqa: F811
    engine = make_engine(tiny_ckpt)
    got = run(engine, IDS, stage, at_step)
    codes, _, finals = got[VICTIM]
    assert len(finals) == 1 and finals[0][0] == "error"
    assert f"generation failed at {stage} (frame {frames})" in finals[0][1]
    assert "RowFault" not in finals[0][1]  # the internal exception text goes to the log, not the client
    assert np.array_equal(codes, with_victim[VICTIM][0][:frames])
    for rid in without_victim:  # untouched: the bits of a run without the faulty sequence
        assert got[rid][2] == without_victim[rid][2] == [("max_frames", None)]
        assert np.array_equal(got[rid][0], without_victim[rid][0])
        assert np.array_equal(got[rid][1], without_victim[rid][1])
    stats = engine.stats()
    assert stats["kv_pages_used"] == 0 and stats["slots_used"] == 0 and stats["active"] == 0
    engine.check_integrity()
    # the victim's slot serves again: the same request now gives the bits it gives without a fault
    got = run(engine, [VICTIM])
    assert np.array_equal(got[VICTIM][0], with_victim[VICTIM][0])


def test_two_failing_rows_end_and_the_rest_streams(tiny_ckpt, without_victim):  # noqa: F811
    """Bisection finds every failing row: two faults in one step, the other rows untouched."""
    engine = make_engine(tiny_ckpt)
    speaker = sorted(engine.checkpoint.config.talker.speaker_ids)[0]
    for rid in IDS:
        engine.add(rid, VoiceSpec(speaker=speaker), SamplingParams(seed=10 + IDS.index(rid), **SAMPLED), TEXT, True)
    engine.step()
    faults = [RowFault(engine, VICTIM), RowFault(engine, "d")]
    finals, codes = {}, {rid: [] for rid in IDS}
    while engine.has_work():
        for out in engine.step():
            codes[out.seq_id].append(out.codes)
            if out.finished:
                finals[out.seq_id] = out.reason
    for fault in reversed(faults):
        fault.remove()
    assert finals == {"a": "max_frames", "b": "error", "c": "max_frames", "d": "error"}
    for rid in ("a", "c"):
        assert np.array_equal(np.concatenate(codes[rid]), without_victim[rid][0][1:])
    engine.check_integrity()
    assert engine.stats()["slots_used"] == 0
