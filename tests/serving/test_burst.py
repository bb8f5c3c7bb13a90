"""A burst of STARTs through the serving loop and the real engine process (tiny checkpoint, CPU): the adds
of one batch go to the child in one message, one bad START gets exactly its own clear error, the others
stream normally."""

from __future__ import annotations

import threading

import numpy as np

from q3tts.serving.engine_process import EngineProcess
from q3tts.serving.loop import EngineLoop
from tests.server.conftest import tiny_checkpoint  # noqa: F401 (fixture)
from tests.serving.conftest import FakeRequest, TritonError
from tests.serving.test_glue import FRAME, M, submit, wait_finals, wait_until

CONFIG = {"device": "cpu", "dtype": "float32", "max_slots": 8}


class GatedProcess(EngineProcess):
    """Records the methods of every message; `hold` makes the next message wait until `release`."""

    def __init__(self, *args):
        super().__init__(*args)
        self.messages, self.hold, self.holding, self.release = [], False, threading.Event(), threading.Event()

    def call_many(self, calls):
        if self.hold:
            self.hold = False
            self.holding.set()
            self.release.wait(30)
        self.messages.append([method for method, _, _ in calls])
        return super().call_many(calls)


def test_a_burst_of_starts_is_one_message_and_a_bad_one_fails_alone(tiny_checkpoint):  # noqa: F811
    engine = GatedProcess(str(tiny_checkpoint), CONFIG)
    core = EngineLoop(engine.start, (1, 4), 30.0, None, M.log)
    core.start()
    try:
        speaker = sorted(core.engine.checkpoint.config.talker.speaker_ids)[0]
        params = {"max_frames": 4, "greedy": True}
        engine.hold = True
        first = FakeRequest(100, "Hello.", start=True, end=True, SPEAKER=speaker, params=params)
        submit(core, first)
        assert engine.holding.wait(10)  # the engine thread waits in its first message: the burst queues up
        burst = [FakeRequest(k, f"Sentence {k}.", start=True, end=True, params=params,
                             SPEAKER="nobody" if k == 3 else speaker) for k in range(1, 9)]
        submit(core, *burst)
        engine.release.set()
        wait_finals([first, *burst], timeout=60)
        assert ["add"] * 8 in engine.messages
        bad, good = burst[2], [r for r in burst if r is not burst[2]] + [first]
        assert len(bad.sender.sent) == 1 and bad.sender.audio == []
        assert bad.sender.error.code() == TritonError.INVALID_ARG
        assert bad.sender.error.message().startswith("sequence 3: unknown speaker 'nobody'")
        for r in good:
            assert r.sender.error is None, r.sender.error.message()
            assert r.sender.sent[-1][0].tensors["FINISH_REASON"][0] in (b"eos", b"max_frames")
            assert 0 < sum(a.size for a in r.sender.audio) <= 4 * FRAME and np.isfinite(
                np.concatenate(r.sender.audio)).all()
        assert wait_until(lambda: len(core.table) == 0)
    finally:
        core.shutdown()
