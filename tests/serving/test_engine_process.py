"""EngineProcess: the real Engine in a child process on a tiny checkpoint (CPU). Request errors come back as
themselves, a step streams audio, calls made while a step runs are answered, a child that dies is a DeviceFault,
and a child that cannot start says why; the child's protocol (`serve`) with a scripted engine: mid-step
answers and held messages in order."""

from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import threading
from multiprocessing.connection import Connection
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from q3tts.core import InvalidRequest, SamplingParams, StepOutput, VoiceSpec
from q3tts.serving.commands import CommandQueue, Shutdown
from q3tts.serving.engine_process import (DeviceFault, EngineProcess, WhileStepping, pack_outputs, receive, send, serve,
                                         unpack_outputs)
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


def test_a_call_made_while_a_step_runs_is_answered_and_the_step_still_is(proc):
    """The parent side: calls made from `step(while_waiting)` go out while the step's answer is not in; each
    caller gets its own answer whichever comes first, and the sequence added there runs."""
    speaker = sorted(proc.checkpoint.config.talker.speaker_ids)[0]
    proc.add("first", VoiceSpec(speaker=speaker), SamplingParams(greedy=True, max_frames=4), text="Hi.",
             text_done=True)
    commands, added = CommandQueue(), []

    def between(timeout_s):
        commands.take(timeout_s)
        added.append(proc.call_many([("add", ("second", VoiceSpec(speaker=speaker),
                                              SamplingParams(greedy=True, max_frames=2)),
                                      {"text": "Yo.", "text_done": True})]))

    commands.put(Shutdown())  # something to do: its file is readable
    outputs = proc.step(WhileStepping(between, commands))
    assert added == [[(True, None)]] and [o.seq_id for o in outputs] == ["first"]
    while proc.has_work():
        outputs += proc.step()
    ends = {o.seq_id: o.reason for o in outputs if o.finished}
    assert ends == {"first": "max_frames", "second": "max_frames"}
    commands.close()


def test_a_step_sleeps_until_its_answer_or_work_for_while_waiting(proc):
    """With a `WhileStepping`, the parent runs while_waiting only while its file is readable (a command
    queued), once per batch of commands; no polling otherwise."""
    speaker = sorted(proc.checkpoint.config.talker.speaker_ids)[0]
    proc.add("third", VoiceSpec(speaker=speaker), SamplingParams(greedy=True, max_frames=3), text="Hey.",
             text_done=True)
    commands, taken = CommandQueue(), []
    waiting = WhileStepping(lambda timeout_s: taken.append(commands.take(timeout_s)), commands)
    proc.step(waiting)
    assert taken == []
    commands.put(Shutdown())
    proc.step(waiting)
    assert taken == [[Shutdown()]]
    while proc.has_work():
        proc.step()
    commands.close()

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


class WaitingEngine:
    """A child's engine whose step waits for the device for `polls` calls of while_waiting; it logs calls."""

    runner = SimpleNamespace(device=torch.device("cpu"))

    def __init__(self, polls: int = 4):
        self.polls, self.log = polls, []

    def add(self, seq_id, *args, **kwargs):
        self.log.append(("add", seq_id))

    def step(self, while_waiting=None):
        self.log.append("step begins")
        for _ in range(self.polls):
            while_waiting(0.05)
        self.log.append("step ends")
        return []

    def has_work(self):
        return False


def test_the_child_answers_mid_step_calls_at_once_and_holds_the_rest_in_order():
    """The child side (`serve`): during a step's wait, a message of MID_STEP calls is answered at once; a
    message with another call waits for the step, and so does every message after it."""
    parent, child = (Connection(s.detach()) for s in socket.socketpair())
    engine = WaitingEngine()
    thread = threading.Thread(target=serve, args=(child, engine))
    thread.start()
    step = [("step", (), {})]
    for message in [(1, step), (2, [("add", (7,), {})]), (3, step), (4, [("add", (8,), {})]), None]:
        send(parent, message)
    answers = [receive(parent) for _ in range(4)]
    thread.join(10)
    assert [a[0] for a in answers] == [2, 1, 4, 3] and all(a[1] == "ok" for a in answers)
    assert engine.log == ["step begins", ("add", 7), "step ends", "step begins", ("add", 8), "step ends"]


def test_step_outputs_cross_the_pipe_packed_and_come_back_equal():
    """`pack_outputs` / `unpack_outputs` through pickle: each output's fields, codes and pcm as they were (dtypes
    and shapes too), for frames, an output without a frame, a first frame's stats and an error; none at all."""
    rng = np.random.default_rng(0)
    outputs = [StepOutput(("s", 1), rng.integers(0, 2048, (1, 16)), rng.random(1920, np.float32),
                          stats={"first_frame": 1.5}),
               StepOutput(2, np.zeros((0, 16), np.int64), np.zeros(0, np.float32), True, "error", "bad text"),
               StepOutput("c", rng.integers(0, 2048, (2, 16)), rng.random(2 * 1920, np.float32), True, "eos")]
    for sent in (outputs, []):
        got = unpack_outputs(pickle.loads(pickle.dumps(pack_outputs(sent), protocol=5)))
        assert len(got) == len(sent)
        for a, b in zip(got, sent):
            assert (a.seq_id, a.finished, a.reason, a.error, a.stats) == (b.seq_id, b.finished, b.reason, b.error,
                                                                          b.stats)
            for x, y in ((a.codes, b.codes), (a.pcm, b.pcm)):
                assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y)
