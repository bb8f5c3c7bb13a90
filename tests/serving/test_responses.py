"""The response threads: a send that waits on Triton (GIL released) holds up only the sequences of its own
thread, so the first chunks of streams that start together go out side by side; each sequence's responses
stay in order."""

from __future__ import annotations

import time

from tests.serving.conftest import FakeRequest, RecordingSender, TritonError
from tests.serving.test_glue import ScriptedEngine, core_factory, submit, wait_finals  # noqa: F401 (fixture)

SEND_S = 0.03  # what one send waits for Triton's side


class SlowSender(RecordingSender):
    def send(self, response=None, flags=0):
        time.sleep(SEND_S)
        super().send(response, flags)
        self.sent_at = getattr(self, "sent_at", []) + [time.monotonic()]


def test_first_chunks_of_a_burst_go_out_side_by_side_in_order(core_factory):  # noqa: F811
    core, _ = core_factory(ScriptedEngine(frames=3), schedule=(1,))
    reqs = [FakeRequest(k, "hi", start=True, end=True) for k in range(1, 9)]
    for r in reqs:
        r.sender = SlowSender()
    submit(core, *reqs)
    wait_finals(reqs, timeout=10)
    firsts = sorted(r.sender.sent_at[0] for r in reqs)
    # one thread: the 8th first chunk waits for 7 sends (0.21 s); loop.RESPONSE_THREADS = 4: for 1
    assert firsts[-1] - firsts[0] < 3 * SEND_S
    for r in reqs:
        frames = [resp.tensors["FIRST_FRAME"][0] for resp, _ in r.sender.sent if resp is not None
                  and "FIRST_FRAME" in resp.tensors]
        assert frames == sorted(frames) and len(r.sender.finals) == 1


BUILD_S = 0.02  # what building one response costs in this test


def test_responses_are_built_on_the_response_threads(core_factory, monkeypatch):  # noqa: F811
    """Building a response (pb tensors, TIMING) happens on its sequence's response thread, never on the engine
    thread (which only queues what to build), and every stream still gets all its audio and one clean FINAL."""
    from q3tts.serving import request as R

    real = R.audio_response
    builders = set()

    def slow(*args, **kwargs):
        builders.add(__import__("threading").current_thread().name)
        time.sleep(BUILD_S)
        return real(*args, **kwargs)

    monkeypatch.setattr(R, "audio_response", slow)
    engine = ScriptedEngine(frames=4)
    core, _ = core_factory(engine, schedule=(1,))
    reqs = [FakeRequest(k, "hi", start=True, end=True) for k in range(1, 9)]
    submit(core, *reqs)
    wait_finals(reqs, timeout=10)
    assert builders and all(name.startswith("q3tts-responses") for name in builders), builders
    for r in reqs:
        assert r.sender.error is None and len(r.sender.audio) == 4  # schedule (1,): one chunk per frame


def test_a_final_response_that_fails_to_build_still_ends_the_request(core_factory, monkeypatch):  # noqa: F811
    from q3tts.serving import request as R

    real = R.audio_response

    def broken_final(chunk, finish_reason=None, timing=None):
        if finish_reason is not None:
            raise RuntimeError("no tensor for you")
        return real(chunk, finish_reason=finish_reason, timing=timing)

    monkeypatch.setattr(R, "audio_response", broken_final)
    core, _ = core_factory(ScriptedEngine(frames=3), schedule=(1,))
    req = FakeRequest(1, "hi", start=True, end=True)
    submit(core, req)
    wait_finals([req], timeout=10)
    err = req.sender.error
    assert "its last response failed" in err.message() and err.code() == TritonError.INTERNAL
