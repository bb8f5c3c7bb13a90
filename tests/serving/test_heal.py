"""The heal path of the serving loop with a scripted engine: a DeviceFault from the engine ends every open
request with one 'instance restarting' error, refuses new ones at once, reports not ready, starts a new
engine and is ready again once it is built; counters move. (tests/reliability/ drives the same path with the
real server and a real engine process.)"""

from __future__ import annotations

import pytest

from q3tts.serving.engine_process import DeviceFault
from q3tts.serving import loop as loop_module
from q3tts.serving.loop import RESTARTING, EngineLoop
from q3tts.serving.metrics import ServingMetrics
from tests.serving.conftest import FakeRequest, TritonError
from tests.serving.test_glue import FRAME, M, ScriptedEngine, submit, wait_finals, wait_until


class ProcessLikeEngine(ScriptedEngine):
    """ScriptedEngine with the EngineProcess lifecycle: ready when `built`, a step raises DeviceFault once
    `fault` is set, `close` is recorded."""

    def __init__(self, built=True, **kw):
        super().__init__(**kw)
        self.built, self.fault, self.closed = built, False, False

    def poll_ready(self):
        return self.built

    def wait_ready(self):
        assert self.built

    def step(self, while_waiting=None):
        if self.fault:
            raise DeviceFault("CUDA error: device-side assert triggered")
        return super().step(while_waiting)

    def close(self):
        self.closed = True


@pytest.fixture
def healing_core():
    engines = [ProcessLikeEngine(frames=10_000), ProcessLikeEngine(built=False, frames=3)]
    made = iter(engines)
    metrics = ServingMetrics(M.pb_utils, {"model": "t", "version": "1"})
    core = EngineLoop(lambda: next(made), (1,), 30.0, metrics, M.log)
    core.start()
    yield core, engines
    core.shutdown()


def gauge(core, name):
    return core.metrics.gauges[name].value


def counter(core, name):
    return core.metrics.counters[name].value


def test_device_fault_restarts_the_instance(healing_core):
    core, (first, second) = healing_core
    assert wait_until(lambda: gauge(core, "q3tts_instance_ready") == 1)
    streams = [FakeRequest(k, "hello", start=True, end=True, SPEAKER="ryan") for k in (1, 2)]
    submit(core, *streams)
    assert wait_until(lambda: all(r.sender.audio for r in streams))

    first.fault = True
    wait_finals(streams)
    for r in streams:  # one error each, after their audio, naming the restart
        assert RESTARTING in r.sender.error.message() and "device-side assert" in r.sender.error.message()
    assert first.closed and gauge(core, "q3tts_instance_ready") == 0
    assert counter(core, "q3tts_device_faults_total") == 1

    refused = FakeRequest(3, "hi", start=True, end=True, SPEAKER="ryan")
    submit(core, refused)
    wait_finals([refused])
    assert refused.sender.error.code() == TritonError.UNAVAILABLE and RESTARTING in refused.sender.error.message()
    late = FakeRequest(1, "more", end=True)  # a later request of a sequence the fault closed
    submit(core, late)
    wait_finals([late])
    assert RESTARTING in late.sender.error.message()

    second.built = True
    assert wait_until(lambda: gauge(core, "q3tts_instance_ready") == 1)
    assert counter(core, "q3tts_instance_restarts_total") == 1 and core.engine is second
    after = FakeRequest(4, "hello again", start=True, end=True, SPEAKER="ryan")
    submit(core, after)
    wait_finals([after])
    assert after.sender.error is None and sum(a.size for a in after.sender.audio) == 3 * FRAME


def test_engine_counters_continue_across_a_new_engine():
    """A new engine counts from 0: the metric counters never go back, they add what the new one counts."""
    metrics = ServingMetrics(M.pb_utils, {"model": "t", "version": "1"})
    for steps in (10, 12, 0, 3):
        metrics.update({"decode_steps": steps}, open_sessions=0)
    assert metrics.counters["q3tts_decode_steps_total"].value == 15


def test_a_replacement_that_fails_to_start_is_tried_again(monkeypatch):
    class FailsToStart(ProcessLikeEngine):
        def poll_ready(self):
            raise RuntimeError("the engine process could not start: out of memory")

    monkeypatch.setattr(loop_module, "RESPAWN_RETRY_S", 0.1)
    first, broken, good = ProcessLikeEngine(), FailsToStart(built=False), ProcessLikeEngine(frames=2)
    made = iter([first, broken, good])
    metrics = ServingMetrics(M.pb_utils, {"model": "t", "version": "1"})
    core = EngineLoop(lambda: next(made), (1,), 30.0, metrics, M.log)
    core.start()
    try:
        r = FakeRequest(1, "hello", start=True, end=True, SPEAKER="ryan")
        first.fault = True
        submit(core, r)
        wait_finals([r])
        assert RESTARTING in r.sender.error.message()
        assert wait_until(lambda: core.engine is good and core.metrics.gauges["q3tts_instance_ready"].value == 1)
        assert core.health == {"device_faults": 1, "instance_restarts": 1}
    finally:
        core.shutdown()
