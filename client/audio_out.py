"""Where `q3tts-client` puts the audio: a WAV file, raw PCM on a byte stream (stdout), the speakers.

Raw PCM is the server's samples as they arrive, mono, little-endian: float32 (`f32le`) by default,
int16 (`s16le`) with `audio_format=int16`, at `protocol.SAMPLE_RATE`. Playback needs the optional
`sounddevice` package (`pip install './client[play]'`) and the PortAudio library it loads.
"""

from __future__ import annotations

from typing import BinaryIO

import numpy as np

_LITTLE_ENDIAN = {np.dtype(np.float32): "<f4", np.dtype(np.int16): "<i2"}


class PlaybackUnavailable(RuntimeError):
    """--play cannot work on this machine (sounddevice or PortAudio missing, no output device)."""


def write_wav(path: str, audio: np.ndarray, sample_rate: int) -> None:
    """Mono samples [n] as a WAV: int16 samples as 16-bit PCM, float32 ones as 32-bit float."""
    import soundfile as sf  # lazy: raw PCM and playback need no soundfile

    sf.write(path, audio, sample_rate, subtype="PCM_16" if audio.dtype == np.int16 else "FLOAT")


class RawPcm:
    """Writes each chunk's samples to `stream` as soon as it arrives (a pipe into a player)."""

    def __init__(self, stream: BinaryIO) -> None:
        self.stream = stream

    def __call__(self, audio: np.ndarray, sample_rate: int) -> None:
        self.stream.write(audio.astype(_LITTLE_ENDIAN[audio.dtype], copy=False).tobytes())
        self.stream.flush()


class Speakers:
    """Plays each chunk on the default output device as it arrives; `close()` waits for the end."""

    def __init__(self) -> None:
        try:
            import sounddevice
        except ImportError:
            raise PlaybackUnavailable("--play needs the sounddevice package: pip install './client[play]' "
                                      "(or pip install sounddevice)") from None
        except OSError as e:  # sounddevice imports, but its PortAudio library does not load
            raise PlaybackUnavailable(f"--play: sounddevice cannot load PortAudio ({e}); install the "
                                      "PortAudio library (e.g. apt-get install libportaudio2)") from None
        self._sd = sounddevice
        self._stream = None

    def __call__(self, audio: np.ndarray, sample_rate: int) -> None:
        if self._stream is None:  # opened on the first chunk: its dtype and rate are the stream's
            try:
                self._stream = self._sd.OutputStream(samplerate=sample_rate, channels=1, dtype=audio.dtype.name)
                self._stream.start()
            except self._sd.PortAudioError as e:
                raise PlaybackUnavailable(f"--play: cannot open the audio output device: {e}") from None
        self._stream.write(np.ascontiguousarray(audio).reshape(-1, 1))

    def close(self) -> None:
        """Let the queued audio play out, then release the device."""
        if self._stream is not None:
            self._stream.stop()
            self._stream.close()
