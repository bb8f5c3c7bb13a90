"""A sequence's PCM cut into responses per chunk schedule (pure numpy).

Response i carries at least `schedule[min(i, len(schedule) - 1)]` frames of 80 ms (the last entry repeats):
small first chunks give a short time to first audio, larger later ones cost fewer responses.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    def __init__(self, schedule: tuple[int, ...], audio_format: str):
        self.schedule, self.audio_format = schedule, audio_format
        self._pieces: list[np.ndarray] = []
        self._buffered_frames = 0
        self.frames_sent = 0
        self.chunks_sent = 0

    def add(self, pcm: np.ndarray) -> None:
        """Buffer one engine output's PCM ([n * 1920] float32; n = 0 adds nothing)."""
        pcm = np.asarray(pcm, dtype=np.float32).reshape(-1)
        if pcm.size:
            self._pieces.append(pcm)
            self._buffered_frames += max(1, pcm.size // P.SAMPLES_PER_FRAME)

    @property
    def ready(self) -> bool:
        """Whether the buffer holds the next response's frames."""
        target = self.schedule[min(self.chunks_sent, len(self.schedule) - 1)]
        return self._buffered_frames >= target

    def take(self) -> Chunk | None:
        """Everything buffered as one chunk (None when the buffer is empty)."""
        if not self._pieces:
            return None
        output, samples = encode(np.concatenate(self._pieces), self.audio_format)
        chunk = Chunk(output, samples, self.frames_sent, self._buffered_frames)
        self.frames_sent += self._buffered_frames
        self.chunks_sent += 1
        self._pieces, self._buffered_frames = [], 0
        return chunk
