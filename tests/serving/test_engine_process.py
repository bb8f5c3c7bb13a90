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
import time
from multiprocessing.connection import Connection
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from q3tts.core import InvalidRequest, SamplingParams, StepOutput, UnknownSequence, VoiceSpec
from q3tts.engine.config import TEST_HOOKS_ENV
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
    assert proc.frozen_objects > 50_000  # the child's start (imports, model, engine) out of its full collections
    with pytest.raises(InvalidRequest, match="unknown speaker 'nobody'"):
        proc.add(1, VoiceSpec(speaker="nobody"), None, text="hi", text_done=True)
    speaker = sorted(proc.checkpoint.config.talker.speaker_ids)[0]
    proc.add(2, VoiceSpec(speaker=speaker), SamplingParams(greedy=True, max_frames=3), text="Hello.", text_done=True)
    assert proc.has_work()
    outputs = []
    while proc.has_work():
        outputs += proc.step()
    assert [o.finished for o in outputs][-1] and sum(o.pcm.size for o in outputs) == 3 * 1920
    stats = proc.stats()
    assert stats["slots_used"] == 0
    # the child times its full collections from before the one that froze its start's objects
    assert stats["gc_full_passes"] >= 1 and stats["gc_full_pass_seconds"] > 0


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


def test_the_child_logs_each_start_phase_as_it_ends(tiny_checkpoint, capfd):  # noqa: F811
    engine = EngineProcess(str(tiny_checkpoint), CONFIG).start()
    pid = engine.pid
    try:
        engine.wait_ready()
    finally:
        engine.close()
    lines = [line for line in capfd.readouterr().err.splitlines() if f"engine process {pid}:" in line]
    phases = [line.split("start: ")[1].split(" done in ")[0] for line in lines if " start: " in line]
    assert phases == ["weights", "codec", "runner"], lines  # CPU: no graphs to capture
    assert "engine up in" in lines[-1]


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


class CountingEngine(WaitingEngine):
    """A child's engine with work for `steps` steps, each one output (its step number as seq_id; the last one
    ends sequence "x"); a sequence it does not know (any but "x" before its end) is an UnknownSequence."""

    def __init__(self, steps: int):
        super().__init__(polls=1)
        self.steps, self.made = steps, 0

    def step(self, while_waiting=None):
        super().step(while_waiting)
        self.made += 1
        last = self.made == self.steps
        return [StepOutput("x" if last else self.made, np.zeros((1, 16), np.int64), np.zeros(1920, np.float32),
                           finished=last, reason="eos" if last else None)]

    def has_work(self):
        return self.made < self.steps

    def append_text(self, seq_id, text):
        self.log.append(("append_text", seq_id))
        raise UnknownSequence(f"unknown sequence {seq_id!r}")


def test_the_child_runs_the_next_step_ahead_and_answers_the_next_step_call_with_it():
    """`serve(run_ahead=True)`: after answering a step the child runs the next one unasked (nothing else
    waiting); the next step call gets that step's answer without another step; a call the parent makes while
    the step ran ahead is answered in order; text for a sequence that ended in a step the parent has not asked
    for yet is answered quietly (the engine, which forgot it, is not asked), for any other unknown one as the
    engine answers."""
    parent, child = (Connection(s.detach()) for s in socket.socketpair())
    engine = CountingEngine(steps=3)
    thread = threading.Thread(target=serve, args=(child, engine, True))
    thread.start()
    step = [("step", (), {})]
    send(parent, (1, step))
    first = receive(parent)
    assert first[:2] == (1, "ok") and unpack_outputs(first[2][0][1])[0].seq_id == 1 and first[3]
    for _ in range(200):  # the child steps again, asked by no message
        if engine.made == 2:
            break
        threading.Event().wait(0.01)
    assert engine.made == 2
    send(parent, (2, step))
    second = receive(parent)
    assert unpack_outputs(second[2][0][1])[0].seq_id == 2 and engine.made >= 2
    send(parent, (3, step))
    third = receive(parent)
    (last,) = unpack_outputs(third[2][0][1])
    assert (last.seq_id, last.finished) == ("x", True) and engine.made == 3 and third[3] is False
    send(parent, (4, [("append_text", ("x", "more"), {}), ("append_text", ("y", "more"), {})]))
    _, kind, (ended, unknown), work = receive(parent)
    assert kind == "ok" and ended == (True, None) and not work
    assert unknown[0] is False and isinstance(unknown[1], UnknownSequence)
    assert ("append_text", "x") not in engine.log and ("append_text", "y") in engine.log
    send(parent, None)
    thread.join(10)
    assert engine.log.count("step begins") == 3


@pytest.fixture(scope="module")
def flows(tiny_checkpoint):  # noqa: F811
    """Three engine processes: run_ahead off, on, and with two decode steps in flight (pipelined codec)."""
    configs = [{"run_ahead": False}, {"run_ahead": True}, {"codec_pipeline": True, "steps_in_flight": 2}]
    engines = [EngineProcess(str(tiny_checkpoint), {**CONFIG, **config}).start() for config in configs]
    for engine in engines:
        engine.wait_ready()
    yield engines
    for engine in engines:
        engine.close()


def _stream(engine, seq_id, speaker, pieces: list[str], sampling: SamplingParams) -> list[StepOutput]:
    """One sequence through an EngineProcess, its text in pieces (one per step, then the end)."""
    engine.add(seq_id, VoiceSpec(speaker=speaker), sampling, text=pieces[0], text_done=len(pieces) == 1)
    outputs, rest = [], list(pieces[1:])
    while engine.has_work():
        outputs += engine.step()
        if rest:
            engine.append_text(seq_id, rest.pop(0))
            if not rest:
                engine.end_text(seq_id)
    return outputs


def test_a_child_that_runs_ahead_gives_the_same_audio(flows):
    """run_ahead and steps_in_flight change when the steps run, not what they make: a sequence fed in pieces
    between steps (with the child ahead, or a step in flight, its text and end come while a step runs) gives
    the same codes and PCM, bit for bit."""
    speaker = sorted(flows[0].checkpoint.config.talker.speaker_ids)[0]
    sampling = SamplingParams(seed=7, max_frames=12)
    pieces = ["Hello there, ", "this text ", "comes in ", "pieces."]
    runs = [_stream(engine, "pieces", speaker, pieces, sampling) for engine in flows]
    (codes, pcm), *others = ((np.concatenate([o.codes for o in run]), np.concatenate([o.pcm for o in run]))
                             for run in runs)
    assert len(codes) > 1 and all(run[-1].finished for run in runs)
    for other_codes, other_pcm in others:
        assert np.array_equal(codes, other_codes) and np.array_equal(pcm, other_pcm)


def test_a_device_fault_in_a_step_run_ahead_answers_the_next_call(tiny_checkpoint, monkeypatch):  # noqa: F811
    """The fault of a step that ran ahead reaches the parent with its next call of any kind (here `stats`):
    a DeviceFault, and the child is gone."""
    monkeypatch.setenv(TEST_HOOKS_ENV, "1")
    engine = EngineProcess(str(tiny_checkpoint), {**CONFIG, "run_ahead": True, "fault_injection_seed": 13}).start()
    engine.wait_ready()
    speaker = sorted(engine.checkpoint.config.talker.speaker_ids)[0]
    engine.add("fine", VoiceSpec(speaker=speaker), SamplingParams(seed=1, max_frames=50), text="Hi.", text_done=True)
    engine.step()
    time.sleep(1.0)  # the child ran the next step ahead and holds its answer
    engine.add("faulty", VoiceSpec(speaker=speaker), SamplingParams(seed=13), text="Hi.", text_done=True)
    engine.step()  # that answer; the child then runs ahead the step that starts the faulty sequence
    time.sleep(1.0)
    with pytest.raises(DeviceFault):
        engine.stats()
    assert not engine.alive()
