"""The speech endpoint's response formats: 16-bit mono PCM at 24 kHz (the server's int16 audio) as bytes.

| format | bytes | sent |
|---|---|---|
| pcm | raw signed 16-bit little-endian samples (OpenAI's `pcm`) | as each audio response arrives |
| wav | a 44-byte PCM WAV header with unknown sizes (0xFFFFFFFF, the streaming convention), then pcm | as it arrives |
| flac | a FLAC file (soundfile / libsndfile) | once the audio is complete |
| mp3 | an MPEG layer III file (soundfile / libsndfile's LAME) | once the audio is complete |

FLAC and MP3 are written whole: libsndfile patches their headers (sample and frame counts) when the file is
closed, and a stream that already sent those bytes would leave decoders with wrong lengths.
"""

from __future__ import annotations

import io
import struct

import numpy as np

from q3tts_client import protocol as P

MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac", "mp3": "audio/mpeg"}
STREAMED = ("wav", "pcm")
SOUNDFILE_FORMATS = {"flac": ("FLAC", "PCM_16"), "mp3": ("MP3", "MPEG_LAYER_III")}
UNKNOWN_SIZE = 0xFFFFFFFF


def wav_header(sample_rate: int = P.SAMPLE_RATE) -> bytes:
    """RIFF/WAVE header of mono 16-bit PCM whose length is not known yet."""
    fmt = struct.pack("<HHIIHH", 1, 1, sample_rate, sample_rate * 2, 2, 16)  # PCM, mono, rate, bytes/s, align, bits
    return b"RIFF" + struct.pack("<I", UNKNOWN_SIZE) + b"WAVEfmt " + struct.pack("<I", len(fmt)) + fmt \
        + b"data" + struct.pack("<I", UNKNOWN_SIZE)


def pcm_bytes(samples: np.ndarray) -> bytes:
    """int16 samples [n] -> little-endian bytes."""
    return np.asarray(samples, dtype="<i2").tobytes()


def encode_file(fmt: str, samples: np.ndarray, sample_rate: int = P.SAMPLE_RATE) -> bytes:
    """A whole FLAC or MP3 file of int16 samples [n]."""
    import soundfile as sf

    container, subtype = SOUNDFILE_FORMATS[fmt]
    out = io.BytesIO()
    with sf.SoundFile(out, mode="w", samplerate=sample_rate, channels=1, format=container, subtype=subtype) as f:
        f.write(np.asarray(samples, dtype=np.int16))
    return out.getvalue()


def available_formats() -> tuple[str, ...]:
    """The response formats this machine can produce (MP3 needs libsndfile >= 1.1 with LAME)."""
    import soundfile as sf

    have = sf.available_formats()
    return STREAMED + tuple(f for f, (container, _) in SOUNDFILE_FORMATS.items() if container in have)
