"""PCM chunking per chunk schedule and the audio encodings (pure numpy)."""

from __future__ import annotations

import numpy as np

from q3tts_client import protocol as P
from q3tts.serving.chunker import Chunker

FRAME = P.SAMPLES_PER_FRAME


def frames(*values: float) -> list[np.ndarray]:
    return [np.full(FRAME, v, np.float32) for v in values]


def test_chunks_follow_the_schedule_and_the_last_entry_repeats():
    chunker, sizes = Chunker((1, 2, 3), "float32"), []
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
