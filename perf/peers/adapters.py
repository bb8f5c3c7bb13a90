"""The peers, each behind the same two calls: `generate(texts, ...) -> [audio]` (whole utterances, one batch)
and, where the peer streams, `stream(text, ...) -> iterator of audio chunks`.

- `Official`: the official implementation, qwen-tts-hf 0.1.1.post1 on transformers 5.15.1 + tokenizers 0.22.2
  (`Qwen3TTSModel`: transformers generate, static list batching, no audio streaming).
- `Faster`: faster-qwen3-tts 0.5.4 (the official model with its talker and code predictor captured in CUDA
  graphs; batch 1; streams). CUDA only.

Both load a checkpoint folder in the released layout (what `q3tts make-checkpoint` writes) and sample with
the checkpoint's generation defaults. Audio is float32 at `sample_rate`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]


def import_qwen_tts():
    """The official `qwen_tts` package. Where torchaudio is missing (the CPU CI's torch has none) it goes
    through the test oracle's import-only stand-in: the 12 Hz models never call torchaudio."""
    try:
        import torchaudio  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(ROOT))
        from tests.oracle import import_qwen_tts as with_standin  # noqa: PLC0415
        return with_standin()
    import qwen_tts  # noqa: PLC0415
    return qwen_tts


def _flat(audio) -> np.ndarray:
    return np.asarray(audio.float().cpu() if torch.is_tensor(audio) else audio, np.float32).reshape(-1)


class Official:
    """qwen-tts-hf: `Qwen3TTSModel.generate_custom_voice` on a list of texts."""
    name = "qwen-tts-hf"
    streams = False

    def __init__(self, checkpoint: str, device: str, dtype: torch.dtype):
        qwen_tts = import_qwen_tts()
        kwargs = {"device_map": device} if device.startswith("cuda") else {}
        self.model = qwen_tts.Qwen3TTSModel.from_pretrained(checkpoint, dtype=dtype, attn_implementation="sdpa",
                                                            **kwargs)
        self.sample_rate = 24000

    def generate(self, texts: list[str], speaker: str, language: str, max_frames: int) -> list[np.ndarray]:
        wavs, self.sample_rate = self.model.generate_custom_voice(
            text=texts, speaker=[speaker] * len(texts), language=[language] * len(texts), max_new_tokens=max_frames)
        return [_flat(w) for w in wavs]


class Faster:
    """faster-qwen3-tts: `FasterQwen3TTS.generate_custom_voice(_streaming)`, one text at a time."""
    name = "faster-qwen3-tts"
    streams = True

    def __init__(self, checkpoint: str, device: str, dtype: torch.dtype):
        if not (device.startswith("cuda") and torch.cuda.is_available()):
            raise SystemExit(f"faster-qwen3-tts runs only on CUDA (its CUDA graphs); device {device!r} "
                             f"(cuda available: {torch.cuda.is_available()})")
        import_qwen_tts()
        from faster_qwen3_tts import FasterQwen3TTS  # noqa: PLC0415
        self.model = FasterQwen3TTS.from_pretrained(checkpoint, device=device, dtype=dtype)
        self.model.warmup()  # captures its CUDA graphs
        self.sample_rate = self.model.sample_rate

    def generate(self, texts: list[str], speaker: str, language: str, max_frames: int) -> list[np.ndarray]:
        if len(texts) != 1:
            raise SystemExit(f"faster-qwen3-tts generates one text at a time, asked for a batch of {len(texts)}")
        wavs, self.sample_rate = self.model.generate_custom_voice(texts[0], speaker, language,
                                                                  max_new_tokens=max_frames)
        return [np.concatenate([_flat(w) for w in wavs])]

    def stream(self, text: str, speaker: str, language: str, max_frames: int, chunk_frames: int):
        for audio, self.sample_rate, _timing in self.model.generate_custom_voice_streaming(
                text, speaker, language, max_new_tokens=max_frames, chunk_size=chunk_frames):
            yield _flat(audio)


PEERS = {cls.name: cls for cls in (Official, Faster)}
