"""PCM chunking per chunk schedule and the audio encodings (pure numpy)."""

from __future__ import annotations

import numpy as np

from q3tts_client import protocol as P
from q3tts.serving.chunker import Chunker

FRAME = P.SAMPLES_PER_FRAME


def frames(*values: float) -> list[np.ndarray]:
    return [np.full(FRAME, v, np.float32) for v in values]


def test_chunks_follow_the_schedule_and_the_last_entry_repeats():
    chunker, sizes = Chunker((1, 2, 3), "float32", urgent_s=0.0), []
    for pcm in frames(*range(10)):
        chunker.add(pcm)
        if chunker.ready:
            chunk = chunker.take()
            sizes.append((chunk.first_frame, chunk.frames, chunk.samples.size // FRAME))
    assert sizes == [(0, 1, 1), (1, 2, 2), (3, 3, 3), (6, 3, 3)]
    rest = chunker.take()  # a short tail goes out when the sequence closes
    assert (rest.first_frame, rest.frames) == (9, 1) and chunker.take() is None


def test_float32_is_sent_as_is_and_int16_is_clipped_and_scaled():
    pcm = np.array([0.0, 0.5, -0.5, 1.5, -2.0] + [0.0] * (FRAME - 5), np.float32)
    f32, i16 = Chunker((1,), "float32"), Chunker((1,), "int16")
    f32.add(pcm)
    i16.add(pcm)
    a, b = f32.take(), i16.take()
    assert a.output == P.OUTPUT_AUDIO and a.samples.dtype == np.float32 and np.array_equal(a.samples, pcm)
    assert b.output == P.OUTPUT_AUDIO_INT16 and b.samples.dtype == np.int16
    assert b.samples[:5].tolist() == [0, 16383, -16383, 32767, -32767]


def test_empty_outputs_add_nothing():
    chunker = Chunker((1,), "float32")
    chunker.add(np.zeros(0, np.float32))
    assert not chunker.ready and chunker.take() is None


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_listener_about_to_run_dry_gets_what_is_buffered():
    """After the first response the listener plays in real time; a frame that arrives when less than
    urgent_s of sent audio is left goes out alone instead of waiting for the schedule's size."""
    clock, sizes = Clock(), []
    chunker = Chunker((1, 8), "float32", urgent_s=0.05, clock=clock)
    for dt, pcm in zip([0.0, 0.01, 0.015, 0.015, 0.06, 0.1, 0.08], frames(*range(7))):
        clock.now += dt
        chunker.add(pcm)
        if chunker.ready:
            sizes.append((round(clock.now - 100.0, 3), chunker.take().frames))
    # t=0: the first response (plays until 0.08); 0.01 and 0.025: 0.07 and 0.055 left, held; 0.04: 0.04 left,
    # 3 frames out (until 0.32); 0.10 and 0.20: held; 0.28: 0.04 left, 3 frames out (until 0.56)
    assert sizes == [(0.0, 1), (0.04, 3), (0.28, 3)]
    assert abs(chunker.play_end - 100.56) < 1e-9


def test_the_first_response_waits_for_its_size():
    clock = Clock()
    chunker = Chunker((3, 1), "float32", urgent_s=10.0, clock=clock)
    for pcm in frames(0, 1):
        chunker.add(pcm)
        assert not chunker.ready  # nothing sent yet: nobody is listening, however urgent
    chunker.add(frames(2)[0])
    assert chunker.ready and chunker.take().frames == 3
