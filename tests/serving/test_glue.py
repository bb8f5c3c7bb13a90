"""The serving glue with a fake pb_utils and a scripted engine: exactly one FINAL per request on every path
(success, superseded, bad input, engine rejection, cancel, idle, engine crash, unload, shutdown)."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest

from q3tts.core import InvalidRequest, SamplingParams, StepOutput
from q3tts_client import protocol as P
from tests.serving.conftest import FINAL, FakeRequest, TritonError

from q3tts.serving import model as M  # noqa: E402  (after the fake pb_utils is installed)
from q3tts.serving.loop import EngineLoop
from q3tts.serving.metrics import ServingMetrics
from q3tts.serving.session import Reply

FRAME = 1920


class ScriptedEngine:
    """The Engine contract in miniature: one frame per step per sequence whose text is done (`eager`: from
    the start), `frames` frames each; `abort` frees at the next step (reason 'aborted')."""

    def __init__(self, frames=5, fail_step=False, eager=False, default_sampling=SamplingParams()):
        self.frames, self.fail_step, self.eager, self.default_sampling = frames, fail_step, eager, default_sampling
        self.seqs, self.aborted, self.added = {}, [], []

    def add(self, seq_id, voice, sampling, text="", text_done=False):
        if voice.speaker == "nobody":
            raise InvalidRequest("unknown speaker 'nobody'")
        if voice.speaker == "crash":
            raise RuntimeError("unexpected")
        self.added.append(sampling)
        self.seqs[seq_id] = {"done": text_done or self.eager, "made": 0, "abort": False, "text": text}

    def append_text(self, seq_id, text):
        self.seqs[seq_id]["text"] += text

    def end_text(self, seq_id):
        self.seqs[seq_id]["done"] = True

    def abort(self, seq_id):
        self.seqs[seq_id]["abort"] = True
        self.aborted.append(seq_id)

    def has_work(self):
        return any(s["done"] or s["abort"] for s in self.seqs.values())

    def step(self, while_waiting=None):
        if self.fail_step:
            raise RuntimeError("boom")
        if while_waiting is not None:  # as the engine's pipelined step, before it admits
            while_waiting(0.0)
        outs = []
        for sid, s in list(self.seqs.items()):
            if s["abort"]:
                del self.seqs[sid]
                outs.append(StepOutput(sid, np.zeros((0, 16)), np.zeros(0, np.float32), True, "aborted"))
            elif s["done"]:
                s["made"] += 1
                pcm = np.full(FRAME, s["made"], np.float32)
                fin = s["made"] >= self.frames
                outs.append(StepOutput(sid, np.zeros((1, 16)), pcm, fin, "eos" if fin else None))
                if fin:
                    del self.seqs[sid]
        time.sleep(0.001)
        return outs

    def stats(self):
        n = len(self.seqs)
        return {"active": n, "queued": 0, "kv_pages_used": n, "kv_pages_total": 8, "slots_used": n,
                "slots_total": 8}


@pytest.fixture
def core_factory():
    cores = []

    def make(engine=None, idle_s=30.0, schedule=(1, 2, 4), model_ready=lambda: True):
        engine = engine or ScriptedEngine()
        metrics = ServingMetrics(M.pb_utils, {"model": "t", "version": "1"})
        core = EngineLoop(lambda: engine, schedule, idle_s, metrics, M.log, model_ready)
        core.start()
        cores.append(core)
        return core, engine

    yield make
    for core in cores:
        if core.engine_thread.is_alive():
            core.shutdown()


def submit(core, *requests):
    for r in requests:
        core.submit(r, r.sender)


def wait_until(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.005)
    return predicate()


def wait_finals(requests, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(r.sender.finals for r in requests):
            time.sleep(0.05)  # anything sent after the FINAL would trip RecordingSender
            break
        time.sleep(0.005)
    for r in requests:
        assert len(r.sender.finals) == 1, f"request {r.corr_id}: {len(r.sender.finals)} finals"


def test_one_request_sequence_streams_growing_chunks_then_one_final(core_factory, monkeypatch):
    monkeypatch.setattr(P, "CHUNK_URGENT_S", 0.0)  # the schedule alone: the fake engine's frames come at once
    core, _ = core_factory()
    r = FakeRequest(1, "hello", start=True, end=True, SPEAKER="ryan")
    submit(core, r)
    wait_finals([r])
    assert [a.size // FRAME for a in r.sender.audio] == [1, 2, 2]  # schedule 1,2,4; 5 frames in all
    last = r.sender.sent[-1][0]
    assert last.tensors["FINISH_REASON"][0] == b"eos" and r.sender.error is None
    assert np.concatenate(r.sender.audio)[::FRAME].tolist() == [1, 2, 3, 4, 5]


def test_multi_request_sequence_supersedes_in_order(core_factory):
    core, _ = core_factory()
    reqs = [FakeRequest(2, "a ", start=True), FakeRequest(2, "b "), FakeRequest(2, "c", end=True)]
    submit(core, *reqs)
    wait_finals(reqs)
    assert reqs[0].sender.sent == [(None, 1)] and reqs[1].sender.sent == [(None, 1)]
    assert np.concatenate(reqs[2].sender.audio)[::FRAME].tolist() == [1, 2, 3, 4, 5]


def test_a_request_that_comes_while_its_sequence_ends_is_answered_after_that_step(core_factory):
    """A sequence's next request that comes during the step that ends it waits for that step's outputs (the
    engine process answers it after the step, when the engine has forgotten the sequence): one final, no
    error, all the audio. Only new sequences' STARTs join a step in flight."""
    core = None

    class EndsWhileNextComes(ScriptedEngine):  # the END request arrives while the last frame's step runs
        def step(self, while_waiting=None):
            outs = super().step()
            if any(o.finished for o in outs):
                submit(core, last)
                assert wait_until(lambda: not core.commands.empty())
                while_waiting(0.0)  # as the engine process, which answers it after this step
            return outs

    core, _ = core_factory(EndsWhileNextComes(frames=3, eager=True))
    first, last = FakeRequest(5, "a ", start=True), FakeRequest(5, "b", end=True)
    submit(core, first)
    wait_finals([first, last])
    assert last.sender.error is None and first.sender.error is None
    assert np.concatenate(first.sender.audio + last.sender.audio)[::FRAME].tolist() == [1, 2, 3]


def _unreadable_parameters(req: FakeRequest) -> FakeRequest:
    req._params = "{not json"  # anything the parser trips over, not only its own BadRequest
    return req


@pytest.mark.parametrize("req, needle", [
    (FakeRequest(3, None, start=True, end=True), "input TEXT is required"),
    (FakeRequest(3, "x", start=True, end=True, params={"bogus": 1}), "unknown request parameter 'bogus'"),
    (FakeRequest(3, "x", start=True, end=True, params={"top_p": 2.0}), "'top_p' must be in (0, 1]"),
    (FakeRequest(3, "x", start=True, end=True, params={"audio_format": "mp3"}), "audio_format"),
    (FakeRequest(3, "x", start=True, end=True, SPEAKER="nobody"), "unknown speaker 'nobody'"),
    (FakeRequest(3, "x", SPEAKER="ryan"), "can only be set on the START request"),
    (FakeRequest(3, "x"), "has no open session"),
    (FakeRequest(3, "x", start=True, end=True, REF_SAMPLE_RATE=np.zeros(0, np.int32)), "must hold one value"),
    (_unreadable_parameters(FakeRequest(3, "x", start=True, end=True)), "could not read the request's inputs"),
])
def test_bad_input_gets_exactly_one_clear_error(core_factory, req, needle):
    core, engine = core_factory()
    submit(core, req)
    wait_finals([req])
    assert len(req.sender.sent) == 1 and needle in req.sender.error.message()
    assert engine.seqs == {} and len(core.table) == 0
    assert sum(m.value for m in core.metrics.failures.values()) == 1


def test_failed_start_then_continuation_names_the_start_failure(core_factory):
    core, _ = core_factory()
    reqs = [FakeRequest(4, "x", start=True, SPEAKER="nobody"), FakeRequest(4, "y"), FakeRequest(4, "", end=True)]
    submit(core, *reqs)
    wait_finals(reqs)
    assert "its START request failed" in reqs[1].sender.error.message()
    assert reqs[2].sender.sent == [(None, 1)]  # closing it is harmless


def test_cancel_aborts_in_engine_and_sends_one_cancelled_final(core_factory):
    core, engine = core_factory(engine=ScriptedEngine(frames=10_000))
    r = FakeRequest(5, "long", start=True, end=True)
    submit(core, r)
    while not r.sender.audio:
        time.sleep(0.005)
    r.sender.cancelled = True
    wait_finals([r])
    assert "cancelled" in r.sender.error.message() and engine.aborted
    assert r.sender.sent[-1][0].tensors["FINISH_REASON"][0] == b"cancelled"  # audio had started: data final
    assert wait_until(lambda: not engine.seqs, 2) and len(core.table) == 0


def test_cancel_while_waiting_for_text(core_factory):
    core, engine = core_factory()
    r = FakeRequest(6, "waiting", start=True)
    submit(core, r)
    time.sleep(0.1)
    r.sender.cancelled = True
    wait_finals([r])
    assert r.sender.error.code() == TritonError.CANCELLED and engine.aborted


def test_idle_sequence_is_collected(core_factory):
    core, engine = core_factory(idle_s=0.2)
    r = FakeRequest(7, "no end", start=True)
    submit(core, r)
    wait_finals([r])
    assert "idled out" in r.sender.error.message() and engine.aborted and len(core.table) == 0
    late = FakeRequest(7, "more")
    submit(core, late)
    wait_finals([late])
    assert "no open session" in late.sender.error.message()


def test_restart_on_live_id_fails_the_old_request_once(core_factory):
    core, _ = core_factory()
    old, new = FakeRequest(8, "a", start=True), FakeRequest(8, "b", start=True, end=True)
    submit(core, old, new)
    wait_finals([old, new])
    assert "restarted" in old.sender.error.message() and new.sender.error is None


def test_engine_crash_fails_every_live_request_once(core_factory):
    core, _ = core_factory(engine=ScriptedEngine(fail_step=True))
    reqs = [FakeRequest(9, "a", start=True, end=True), FakeRequest(10, "b", start=True)]
    submit(core, *reqs)
    wait_finals(reqs)
    assert all("the engine step failed (an internal error" in r.sender.error.message() for r in reqs)
    assert not any("boom" in r.sender.error.message() for r in reqs)  # the exception's text stays in the log
    later = FakeRequest(10, "more text")  # the open sequence's next piece is told why it is gone
    submit(core, later)
    wait_finals([later])
    assert "has no open session: it was closed: the engine step failed" in later.sender.error.message()


def test_shutdown_answers_open_requests(core_factory):
    core, _ = core_factory()
    reqs = [FakeRequest(11, "a", start=True), FakeRequest(12, "b", start=True)]
    submit(core, *reqs)
    time.sleep(0.05)
    core.shutdown()
    for r in reqs:
        assert len(r.sender.finals) == 1 and "shutting down" in r.sender.error.message()


def test_int16_and_metrics(core_factory):
    core, _ = core_factory()
    r = FakeRequest(13, "x", start=True, end=True, params={"audio_format": "int16", "chunk_schedule": "5"})
    submit(core, r)
    wait_finals([r])
    (resp, flags), = r.sender.sent
    assert flags == 1 and resp.tensors["AUDIO_INT16"].dtype == np.int16 and resp.tensors["SAMPLE_RATE"][0] == 24000
    assert core.metrics.audio_seconds.value == pytest.approx(5 * FRAME / 24000)
    assert len(core.metrics.ttfa.observed) == 1


def test_abort_request_drops_the_sequence(core_factory):
    core, engine = core_factory()
    first = FakeRequest(14, "a", start=True)
    stop = FakeRequest(14, "", end=True, params={"abort": True})
    submit(core, first, stop)
    wait_finals([first, stop])
    (resp, flags), = first.sender.sent  # ends normally: FINISH_REASON "aborted"
    assert flags == 1 and resp.tensors["FINISH_REASON"][0] == b"aborted" and stop.sender.sent == [(None, 1)]
    assert engine.aborted and len(core.table) == 0


def test_unexpected_engine_exception_is_one_internal_error_and_thread_survives(core_factory):
    core, _ = core_factory()
    bad = FakeRequest(15, "x", start=True, end=True, SPEAKER="crash")
    submit(core, bad)
    wait_finals([bad])
    assert "Start failed (an internal error" in bad.sender.error.message()
    assert "unexpected" not in bad.sender.error.message()
    good = FakeRequest(16, "x", start=True, end=True)
    submit(core, good)
    wait_finals([good])
    assert good.sender.error is None and core.engine_thread.is_alive()


def test_ack_pieces_answers_each_piece_at_once_and_streams_on_end(core_factory):
    core, _ = core_factory()
    first = FakeRequest(17, "a ", start=True, params={"ack_pieces": True})
    submit(core, first)
    wait_finals([first])
    mid = FakeRequest(17, "b ")
    submit(core, mid)
    wait_finals([mid])
    last = FakeRequest(17, "c", end=True)
    submit(core, last)
    wait_finals([last])
    assert first.sender.sent == [(None, 1)] and mid.sender.sent == [(None, 1)]
    assert np.concatenate(last.sender.audio)[::FRAME].tolist() == [1, 2, 3, 4, 5]


def test_step_counters_are_sent_as_increments():
    """Engine.stats() totals reach Triton's counters as the increments since the last tick, never negative."""
    metrics = ServingMetrics(M.pb_utils, {"model": "t", "version": "1"})
    metrics.update({"prefill_seconds": 0.5, "prefill_steps": 2, "decode_steps": 10}, open_sessions=0)
    metrics.update({"prefill_seconds": 0.75, "prefill_steps": 2, "decode_steps": 13}, open_sessions=0)
    c = metrics.counters
    assert c["q3tts_prefill_seconds_total"].value == pytest.approx(0.75)
    assert c["q3tts_prefill_steps_total"].value == 2 and c["q3tts_decode_steps_total"].value == 13
    assert c["q3tts_queue_wait_seconds_total"].value == 0


class _InnerResponse:
    def __init__(self, tensors):
        self.tensors = tensors

    def has_error(self):
        return False

    def output_tensors(self):
        return self.tensors


def test_oneshot_relay_client_gone_mid_stream(monkeypatch):
    """The client's stream breaks while audio is relayed: the relay aborts the inner sequence, still drains
    the inner stream to its end (an undrained BLS iterator blocks unloading) and sends one FINAL."""
    import asyncio

    from tests.serving.conftest import Tensor

    chunks = [_InnerResponse([Tensor("AUDIO", np.zeros(4, np.float32))]) for _ in range(3)]
    inner = iter(chunks + [_InnerResponse([])])

    class FakeInner:
        def __init__(self, **kwargs):
            pass

        async def async_exec(self, decoupled):
            return inner

    monkeypatch.setattr(M.pb_utils, "InferenceRequest", FakeInner, raising=False)
    model = M.OneShotModel()
    model.initialize({"model_config": "{}"})
    aborted = []
    monkeypatch.setattr(model, "_abort_inner", aborted.append)
    request = FakeRequest(0, text="hi", start=True, end=True)
    sends = []

    def send(response=None, flags=0):
        if response is not None and response.tensors and sends:
            raise RuntimeError("stream closed by the client")
        sends.append((response, flags))

    request.sender.send = send
    asyncio.run(model._relay(request))
    assert next(inner, None) is None  # drained
    assert len(aborted) == 1
    assert [f for _, f in sends].count(FINAL) == 1 and sends[-1][1] == FINAL


def test_sampling_defaults_come_from_the_engine_and_requests_override_them(core_factory):
    """The checkpoint's generation config (engine.default_sampling) is the base; request parameters replace
    single fields of it."""
    defaults = SamplingParams(temperature=0.5, top_k=7, repetition_penalty=1.2, max_frames=100)
    core, engine = core_factory(engine=ScriptedEngine(default_sampling=defaults))
    r = FakeRequest(18, "x", start=True, end=True, params={"top_k": 3, "seed": 9})
    submit(core, r)
    wait_finals([r])
    (sampling,) = engine.added
    assert (sampling.temperature, sampling.top_k, sampling.repetition_penalty, sampling.max_frames, sampling.seed) \
        == (0.5, 3, 1.2, 100, 9)


def test_unload_closes_open_sequences_at_once_and_refuses_new_ones(core_factory):
    """Once Triton reports the model not ready (an unload began), every open request ends with one clear
    error instead of holding the unload, and new sequences are refused. Not ready while loading is no unload."""
    ready = {"value": False}
    core, engine = core_factory(model_ready=lambda: ready["value"])
    waiting = FakeRequest(19, "waiting for more text", start=True)
    submit(core, waiting)
    time.sleep(0.5)  # two ticks while 'loading': nothing happens
    assert not waiting.sender.sent and len(core.table) == 1
    ready["value"] = True
    time.sleep(0.3)
    ready["value"] = False
    wait_finals([waiting])
    assert waiting.sender.error.code() == TritonError.UNAVAILABLE
    assert "the server is shutting down" in waiting.sender.error.message() and engine.aborted
    late = FakeRequest(20, "x", start=True, end=True)
    submit(core, late)
    wait_finals([late])
    assert "the server is shutting down" in late.sender.error.message() and len(core.table) == 0


def test_a_moment_of_not_ready_is_no_unload(core_factory):
    """Triton's model readiness includes every instance's health, so another instance's device fault makes it
    False for a moment: only UNLOAD_CONFIRM_S of not ready in a row is an unload."""
    ready = {"value": True}
    core, engine = core_factory(model_ready=lambda: ready["value"])
    waiting = FakeRequest(30, "waiting for more text", start=True)
    submit(core, waiting)
    time.sleep(0.5)
    ready["value"] = False
    time.sleep(0.6)  # three ticks, well under UNLOAD_CONFIRM_S
    ready["value"] = True
    time.sleep(0.5)
    assert not waiting.sender.sent and len(core.table) == 1 and not core.draining

def test_engine_finish_while_no_request_is_open_goes_out_on_the_end_request(core_factory):
    """ack_pieces: the engine ends the sequence (eager frames) between requests; its audio and FINISH_REASON
    wait for the END request."""
    core, engine = core_factory(engine=ScriptedEngine(eager=True))
    first = FakeRequest(21, "a ", start=True, params={"ack_pieces": True})
    submit(core, first)
    wait_finals([first])
    assert wait_until(lambda: not engine.seqs)  # finished in the engine, nothing sent yet
    last = FakeRequest(21, "", end=True)
    submit(core, last)
    wait_finals([last])
    assert first.sender.sent == [(None, 1)]
    assert np.concatenate(last.sender.audio)[::FRAME].tolist() == [1, 2, 3, 4, 5]
    assert last.sender.sent[-1][0].tensors["FINISH_REASON"][0] == b"eos" and len(core.table) == 0


def test_pieces_after_the_engine_finished_get_empty_finals(core_factory):
    core, engine = core_factory(engine=ScriptedEngine(eager=True))
    first = FakeRequest(22, "a ", start=True)
    submit(core, first)
    wait_finals([first])
    assert first.sender.sent[-1][0].tensors["FINISH_REASON"][0] == b"eos"
    more, last = FakeRequest(22, "b "), FakeRequest(22, "c", end=True)
    submit(core, more, last)
    wait_finals([more, last])
    assert more.sender.sent == [(None, 1)] and last.sender.sent == [(None, 1)] and len(core.table) == 0



def test_first_frames_audio_is_queued_before_the_other_streams_of_its_step(core_factory, monkeypatch):
    """A step that makes a new stream's first frame beside playing streams' frames queues the first audio
    response ahead of theirs (their listeners have buffered audio; the new stream's listener has none)."""
    monkeypatch.setattr(P, "CHUNK_URGENT_S", 0.0)
    queued = []  # "step" at each engine step, then the key of each data response queued

    class FirstFrameStats(ScriptedEngine):  # the engine's contract: stats on a sequence's first frame only
        def step(self, while_waiting=None):
            queued.append("step")
            first = lambda o: o.pcm[:1].tolist() == [1]  # noqa: E731 - frame n's PCM holds n
            return [replace(o, stats={"first_frame": 1.0}) if first(o) else o
                    for o in super().step(while_waiting)]

    send = Reply.send
    monkeypatch.setattr(Reply, "send", lambda reply, build: queued.append(reply.key) or send(reply, build))
    core, _ = core_factory(FirstFrameStats(frames=200), schedule=(1, 1, 1))  # every frame sent at once
    playing = [FakeRequest(i, "hello", start=True, end=True, SPEAKER="ryan") for i in (1, 2, 3)]
    submit(core, *playing)
    assert wait_until(lambda: queued.count(1) >= 2)
    late = FakeRequest(9, "hello", start=True, end=True, SPEAKER="ryan")
    submit(core, late)
    wait_finals([*playing, late])
    at = queued.index(9)
    assert queued[at - 1] == "step" and sorted(queued[at + 1:at + 4]) == [1, 2, 3], queued[at - 5:at + 5]
