"""Step fault isolation on CPU: an error raised by the step's device work whenever one sequence's row is in
it (engine/isolation.RowFault) ends that sequence alone with one clear error; the other rows give the bits
of a run without it, the engine's pools return to baseline and its slots serve again. The sequences and the
run loop are test_fault_rows's (three sampled sequences, VICTIM among them)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from q3tts.engine.isolation import RowFault
from tests.engine.conftest import tiny_ckpt, tiny_ckpt_dir  # noqa: F401 (fixtures)
from tests.engine.test_engine import make_engine
from tests.reliability.test_fault_rows import IDS, VICTIM, run


def faulting(*victims: str, stage: str = "decode"):
    """A `run` poison that installs a RowFault on each of `victims`; `.installed` lists them (to remove)."""
    def poison(engine):
        poison.installed += [RowFault(engine, victim, stage) for victim in victims]
    poison.installed = []
    return poison


def without(engine):
    """A `run` poison that aborts VICTIM before it starts: a run without it."""
    engine.abort(VICTIM)


@pytest.fixture(scope="module")
def with_victim(tiny_ckpt):  # noqa: F811
    return run(make_engine(tiny_ckpt))


@pytest.fixture(scope="module")
def without_victim(tiny_ckpt):  # noqa: F811
    return run(make_engine(tiny_ckpt), without, 0)


@pytest.mark.parametrize("stage, at_step, frames", [
    ("prefill", 0, 0),  # its start fails: it never makes a frame
    ("decode", 0, 0),  # the first decode step (the prefill of the same step succeeded)
    ("decode", 5, 5),  # mid-stream: the frames before the fault stand
], ids=["prefill", "first-decode", "mid-stream"])
def test_a_failing_row_ends_alone(tiny_ckpt, with_victim, without_victim, stage, at_step, frames):  # noqa: F811
    _ends_alone(make_engine(tiny_ckpt), stage, at_step, frames, with_victim, without_victim)


def test_a_failing_row_of_a_step_launched_ahead_ends_alone(tiny_ckpt, with_victim, without_victim):  # noqa: F811
    """The codec in the step, two decode steps in flight, launched ahead as a CUDA graph's are (`launches_ahead`):
    the row's error raises in the launch (on the CPU, or where a bucket has no graph, the step runs in line there)
    before anything is in flight; the step runs again synchronously, each row isolated: the same ends and bits."""
    engine = make_engine(tiny_ckpt, codec_pipeline=False, steps_in_flight=2)
    engine.launches_ahead = True
    _ends_alone(engine, "decode", 5, 5, with_victim, without_victim)


def _ends_alone(engine, stage, at_step, frames, with_victim, without_victim) -> None:
    """VICTIM's rows fail at `stage` from step `at_step`: it ends alone with one error after `frames` frames, the
    others are a run without it, the pools return to baseline and the victim's slot serves again."""
    fault = faulting(VICTIM, stage=stage)
    got = run(engine, fault, at_step)
    codes, _, finals = got[VICTIM]
    assert len(finals) == 1 and finals[0][0] == "error"
    assert f"generation failed at {stage} (frame {frames})" in finals[0][1]
    assert "RowFault" not in finals[0][1]  # the internal exception text goes to the log, not the client
    assert np.array_equal(codes, with_victim[VICTIM][0][:frames])
    for rid in IDS:
        if rid != VICTIM:  # untouched: the bits of a run without the faulty sequence
            assert got[rid][2] == without_victim[rid][2] == [("max_frames", None)]
            assert np.array_equal(got[rid][0], without_victim[rid][0])
            assert np.array_equal(got[rid][1], without_victim[rid][1])
    stats = engine.stats()
    assert stats["kv_pages_used"] == 0 and stats["slots_used"] == 0 and stats["active"] == 0
    engine.check_integrity()
    fault.installed.pop().remove()
    # the victim's slot serves again: the same requests now give the bits they give without a fault
    again = run(engine)
    assert all(np.array_equal(again[rid][0], with_victim[rid][0]) for rid in IDS)


def test_two_failing_rows_end_and_the_rest_streams(tiny_ckpt, without_victim):  # noqa: F811
    """Bisection finds every failing row: two faults in the same steps, the third row untouched."""
    engine = make_engine(tiny_ckpt)
    others = [rid for rid in IDS if rid != VICTIM]
    got = run(engine, faulting(VICTIM, others[0]), 3)
    assert got[VICTIM][2][0][0] == got[others[0]][2][0][0] == "error"
    assert np.array_equal(got[others[1]][0], without_victim[others[1]][0])
    engine.check_integrity()
    assert engine.stats()["slots_used"] == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_failed_decode_leaves_the_slot_state(tiny_ckpt, device):  # noqa: F811
    """What makes a retry exact without any undo: a decode attempt that fails (in the codec, the step's last
    fallible work) has written none of the slot state a retry reads: talker state and codec streams. On CUDA
    (eager: a graph replay runs no Python hook) also the pinned metadata of the retries after a failure."""
    engine = make_engine(tiny_ckpt, device=device, use_cuda_graphs=False)
    state, decode = engine.runner.state, engine.runner.decode
    tensors = [state.last_c0, state.past_hidden, state.rep_mask, *engine.runner.codec.pool]
    unchanged = []

    def checked(rows):
        before = [t.clone() for t in tensors]
        try:
            return decode(rows)
        except RuntimeError:
            unchanged.append(all(torch.equal(a, b) for a, b in zip(before, tensors)))
            raise

    engine.runner.decode = checked
    got = run(engine, faulting(VICTIM), 3)
    assert len(unchanged) >= 2 and all(unchanged)  # the whole batch's attempt and the victim's own
    assert got[VICTIM][2][0][0] == "error"
    assert all(got[rid][2] == [("max_frames", None)] for rid in IDS if rid != VICTIM)
