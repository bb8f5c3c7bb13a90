"""EngineProcess: the real Engine in a child process on a tiny checkpoint (CPU). Request errors come back as
themselves, a step streams audio, a child that dies is a DeviceFault, and a child that cannot start says why."""

from __future__ import annotations

import json
import os
import signal

import pytest

from q3tts.core import InvalidRequest, SamplingParams, VoiceSpec
from q3tts.serving.engine_process import DeviceFault, EngineProcess
from tests.server.conftest import tiny_checkpoint  # noqa: F401 (fixture)

CONFIG = {"device": "cpu", "dtype": "float32", "max_slots": 2}


@pytest.fixture(scope="module")
def proc(tiny_checkpoint):  # noqa: F811
    engine = EngineProcess(str(tiny_checkpoint), CONFIG).start()
    engine.wait_ready()
    yield engine
    engine.close()


def test_calls_round_trip_and_request_errors_come_back_as_themselves(proc, tiny_checkpoint):  # noqa: F811
    generation = json.loads((tiny_checkpoint / "generation_config.json").read_text())
    assert proc.default_sampling == SamplingParams.from_generation_config(generation)
    assert proc.checkpoint.config.variant == "custom_voice" and not proc.has_work()
    with pytest.raises(InvalidRequest, match="unknown speaker 'nobody'"):
        proc.add(1, VoiceSpec(speaker="nobody"), None, text="hi", text_done=True)
    speaker = sorted(proc.checkpoint.config.talker.speaker_ids)[0]
    proc.add(2, VoiceSpec(speaker=speaker), SamplingParams(greedy=True, max_frames=3), text="Hello.", text_done=True)
    assert proc.has_work()
    outputs = []
    while proc.has_work():
        outputs += proc.step()
    assert [o.finished for o in outputs][-1] and sum(o.pcm.size for o in outputs) == 3 * 1920
    assert proc.stats()["slots_used"] == 0


def test_a_dead_child_is_a_device_fault(proc):
    os.kill(proc.pid, signal.SIGKILL)
    with pytest.raises(DeviceFault, match="the engine process exited"):
        proc.step()
    assert not proc.alive()


def test_a_child_that_cannot_start_says_why(tmp_path):
    engine = EngineProcess(str(tmp_path / "missing"), CONFIG).start()
    with pytest.raises(RuntimeError, match="the engine process could not start: .*missing"):
        engine.wait_ready()
    assert not engine.alive()
