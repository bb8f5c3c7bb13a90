"""Voice cloning from reference audio (Base): reference wav -> (ref_codes, x-vector), spec f.

`resolve_voice` is the one place a `VoiceSpec.ref_audio` becomes ref_codes / x-vector: `Engine.add`
runs it (for serving and `q3tts synth --requests`), and so does `q3tts synth --ref-audio`. Mirrors
the official `Qwen3TTSModel.create_voice_clone_prompt`: the audio is resampled to 24 kHz with soxr
HQ (librosa.resample's default), encoded by the codec encoder (first 16 quantizers, ceil(n/1920)
frames) and embedded by the Base checkpoint's speaker encoder (`speaker_encoder.*` weights,
`Qwen3TTS.speaker_encoder`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from q3tts.codec.audio import SAMPLE_RATE, read_wav, resample
from q3tts.core import InvalidRequest, VoiceSpec
from q3tts_client.protocol import INPUT_REF_AUDIO, INPUT_REF_SAMPLE_RATE, MAX_REF_SECONDS, REF_SAMPLE_RATES


def read_reference(path: str | Path) -> tuple[np.ndarray, int]:
    """A reference recording from a file -> (mono float32 samples [n], sample rate).
    Raises InvalidRequest naming the file when it is missing or unreadable."""
    path = Path(path)
    if not path.is_file():
        raise InvalidRequest(f"reference audio {path}: no such file")
    try:
        return read_wav(path)
    except RuntimeError as err:  # soundfile's errors (unknown format, truncated file) are RuntimeErrors
        raise InvalidRequest(f"reference audio {path}: cannot read: {err}") from err


def needs_encoding(voice: VoiceSpec) -> bool:
    """Whether `resolve_voice` would encode something: ref_audio given and ref_codes / xvector missing."""
    return voice.ref_audio is not None and (voice.xvector is None
                                            or (voice.ref_codes is None and not voice.xvector_only))


def check_reference(wav: np.ndarray, sample_rate: int) -> np.ndarray:
    """A reference recording's limits, checked before any work -> the samples as float32 [n].
    Raises InvalidRequest naming REF_AUDIO / REF_SAMPLE_RATE (limits: q3tts_client.protocol)."""
    low, high = REF_SAMPLE_RATES
    if not low <= int(sample_rate) <= high:
        raise InvalidRequest(f"input {INPUT_REF_SAMPLE_RATE}: {sample_rate} Hz is outside [{low}, {high}] Hz")
    wav = np.asarray(wav, dtype=np.float32)
    if wav.ndim != 1:
        raise InvalidRequest(f"input {INPUT_REF_AUDIO} must be mono [n], got shape {list(wav.shape)}")
    if wav.size > MAX_REF_SECONDS * int(sample_rate):
        raise InvalidRequest(f"input {INPUT_REF_AUDIO} holds {wav.size / int(sample_rate):.1f} s of audio; "
                             f"at most {MAX_REF_SECONDS} s")
    if wav.size == 0 or not np.isfinite(wav).all():
        raise InvalidRequest(f"input {INPUT_REF_AUDIO} is empty or has non-finite samples")
    return wav


def resolve_voice(voice: VoiceSpec, model, make_encoder: Callable[[], object]) -> VoiceSpec:
    """`voice` with the ref_codes / xvector it lacks encoded from its `ref_audio` (given ones are kept).

    A voice without ref_audio, or with nothing left to fill, comes back as is. `make_encoder()` gives
    the codec encoder (see `encode_reference`); it is called only when something is encoded, so a
    caller can build the encoder on first use. Raises InvalidRequest as `encode_reference` does.
    """
    if not needs_encoding(voice):
        return voice
    codes, xvector = encode_reference(model, make_encoder(), voice.ref_audio, voice.ref_sample_rate)
    return dataclasses.replace(voice, ref_codes=codes if voice.ref_codes is None else voice.ref_codes,
                               xvector=xvector if voice.xvector is None else voice.xvector)


def encode_reference(model, codec, wav: np.ndarray,
                     sample_rate: int) -> tuple[np.ndarray, np.ndarray]:
    """Encode one reference recording for Base voice cloning.

    model: a Base `Qwen3TTS` (its `.speaker_encoder` makes the x-vector, in the model's dtype and
        device).
    codec: a `CodecEncoder`, or anything with an `.encoder` that is one (`q3tts.codec.Codec`).
    wav: mono float samples [n] at `sample_rate` (any rate; resampled to 24 kHz first).
    Returns (ref_codes [F, 16] np.int64 with F = ceil(n_24k / 1920), xvector [H] np.float32).
    Raises InvalidRequest for a non-Base model or a recording `check_reference` refuses.
    """
    speaker_encoder = getattr(model, "speaker_encoder", None)
    if speaker_encoder is None:
        raise InvalidRequest(f"input {INPUT_REF_AUDIO}: reference audio needs a Base checkpoint "
                             "(it has the speaker encoder)")
    wav = check_reference(wav, sample_rate)
    wav24 = torch.from_numpy(np.ascontiguousarray(resample(wav, int(sample_rate), SAMPLE_RATE)))
    encoder = getattr(codec, "encoder", codec)
    try:
        with torch.inference_mode():
            codes = encoder.encode(wav24)  # [F, 16]
            xvector = speaker_encoder.embed(wav24)  # [H]
    except RuntimeError as exc:  # e.g. a clip shorter than the speaker encoder's reflect padding
        raise InvalidRequest(f"input {INPUT_REF_AUDIO}: a recording of {wav24.shape[0] / SAMPLE_RATE:.3f} s "
                             "could not be encoded (too short?)") from exc
    xvector = xvector.float().cpu().numpy().astype(np.float32)
    if not np.isfinite(xvector).all():  # e.g. samples far outside [-1, 1]: the encoders overflow
        raise InvalidRequest(f"input {INPUT_REF_AUDIO}: its speaker embedding is not finite (peak sample "
                             f"{float(np.abs(wav).max()):g}; float PCM lies in [-1, 1])")
    return codes.cpu().numpy().astype(np.int64), xvector
