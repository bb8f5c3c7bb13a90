"""A sequence's PCM cut into responses per chunk schedule (pure numpy).

Response i carries at least `schedule[min(i, len(schedule) - 1)]` frames of 80 ms (the last entry repeats):
small first chunks give a short time to first audio, larger later ones cost fewer responses. Unless the
listener would starve waiting for them: a listener that plays from the first response in real time (as
perf/bench_serve.py counts underruns) runs out of audio at `play_end`, and once that is less than
`protocol.CHUNK_URGENT_S` away whatever is buffered goes out at once. The next frame comes one decode step
later, and a step that also prefills a burst of arrivals takes tens of ms on the H200; that bound covers it
and the delivery.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from q3tts_client import protocol as P


@dataclass(frozen=True)
class Chunk:
    """One audio response's payload."""

    output: str  # protocol.OUTPUT_AUDIO (float32) or OUTPUT_AUDIO_INT16
    samples: np.ndarray  # [frames * 1920] in the session's audio format
    first_frame: int  # index of the chunk's first frame in the sequence
    frames: int


def encode(pcm: np.ndarray, audio_format: str) -> tuple[str, np.ndarray]:
    """float32 PCM in [-1, 1] -> (output tensor name, samples) in `audio_format` (protocol.AUDIO_FORMATS)."""
    if audio_format == "int16":
        return P.OUTPUT_AUDIO_INT16, (np.clip(pcm, -1.0, 1.0) * 32767.0).astype(np.int16)
    return P.OUTPUT_AUDIO, pcm


class Chunker:
    """Buffers one sequence's PCM; `take()` empties the buffer into the next chunk."""

    def __init__(self, schedule: tuple[int, ...], audio_format: str, urgent_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.schedule, self.audio_format, self.clock = schedule, audio_format, clock
        self.urgent_s = P.CHUNK_URGENT_S if urgent_s is None else urgent_s
        self._pieces: list[np.ndarray] = []
        self._buffered_frames = 0
        self.frames_sent = 0
        self.chunks_sent = 0
        self.play_end = -math.inf  # clock time the audio sent runs out, played from the first response on

    def add(self, pcm: np.ndarray) -> None:
        """Buffer one engine output's PCM ([n * 1920] float32; n = 0 adds nothing)."""
        pcm = np.asarray(pcm, dtype=np.float32).reshape(-1)
        if pcm.size:
            self._pieces.append(pcm)
            self._buffered_frames += max(1, pcm.size // P.SAMPLES_PER_FRAME)

    @property
    def ready(self) -> bool:
        """Whether the buffer holds the next response's frames, or any frame while the audio already sent
        (none before the first response) runs out within `urgent_s`."""
        target = self.schedule[min(self.chunks_sent, len(self.schedule) - 1)]
        return self._buffered_frames >= target or (
            self._buffered_frames > 0 and self.chunks_sent > 0 and self.play_end - self.clock() < self.urgent_s)

    def take(self) -> Chunk | None:
        """Everything buffered as one chunk (None when the buffer is empty)."""
        if not self._pieces:
            return None
        pcm = self._pieces[0] if len(self._pieces) == 1 else np.concatenate(self._pieces)  # one piece: no copy
        output, samples = encode(pcm, self.audio_format)
        chunk = Chunk(output, samples, self.frames_sent, self._buffered_frames)
        self.frames_sent += self._buffered_frames
        self.chunks_sent += 1
        self.play_end = max(self.play_end, self.clock()) + self._buffered_frames * P.FRAME_SECONDS
        self._pieces, self._buffered_frames = [], 0
        return chunk
