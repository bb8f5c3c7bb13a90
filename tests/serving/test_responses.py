"""The response threads: a send that waits on Triton (GIL released) holds up only the sequences of its own
thread, so the first chunks of streams that start together go out side by side; each sequence's responses
stay in order."""

from __future__ import annotations

import time

from tests.serving.conftest import FakeRequest, RecordingSender
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
