"""Audio I/O and front ends: wav files (soundfile), resampling (soxr), the speaker encoder's log-mel.

Everything the engine consumes is float32 mono at 24 kHz.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
import soxr
import torch
from torch import Tensor

# the 12 Hz codec's audio rate (input/output_sample_rate of speech_tokenizer/config.json): reference
# audio is resampled to it and generated audio comes out at it. The wire states its own rate in
# q3tts_client.protocol.SAMPLE_RATE.
SAMPLE_RATE = 24000


def read_wav(path: str | Path) -> tuple[np.ndarray, int]:
    """Read an audio file -> (float32 mono samples [n], sample rate). Channels are averaged."""
    import soundfile as sf  # lazy: the serving path (and the GPU machine's client side) needs no soundfile

    audio, sr = sf.read(str(path), dtype="float32", always_2d=True)
    return audio.mean(axis=1).astype(np.float32), int(sr)


def write_wav(path: str | Path, pcm: np.ndarray | Tensor, sr: int = SAMPLE_RATE,
              subtype: str = "PCM_16") -> None:
    """Write float mono samples [n] in [-1, 1] as a wav (16-bit PCM; subtype="FLOAT" keeps them exact)."""
    import soundfile as sf  # lazy, see read_wav

    if isinstance(pcm, Tensor):
        pcm = pcm.detach().float().cpu().numpy()
    sf.write(str(path), np.asarray(pcm, dtype=np.float32).reshape(-1), sr, subtype=subtype)


def resample(audio: np.ndarray, sr_in: int, sr_out: int = SAMPLE_RATE) -> np.ndarray:
    """Resample float32 mono [n] with soxr 'HQ' (librosa.resample's default, used by the reference)."""
    if sr_in == sr_out:
        return np.asarray(audio, dtype=np.float32)
    return soxr.resample(np.asarray(audio, dtype=np.float32), sr_in, sr_out, quality="HQ").astype(np.float32)


def _hz_to_mel(f: np.ndarray) -> np.ndarray:
    """Slaney mel scale: linear below 1 kHz, logarithmic above."""
    f = np.asarray(f, dtype=np.float64)
    lin = f / (200.0 / 3)
    log_region = 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) / (np.log(6.4) / 27.0)
    return np.where(f >= 1000.0, log_region, lin)


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    lin = m * (200.0 / 3)
    log_region = 1000.0 * np.exp((np.log(6.4) / 27.0) * (m - 15.0))
    return np.where(m >= 15.0, log_region, lin)


@lru_cache(maxsize=4)
def mel_filterbank(sr: int, n_fft: int, n_mels: int, fmin: float, fmax: float) -> np.ndarray:
    """Slaney-normalised triangular mel filterbank [n_mels, 1 + n_fft/2] (float32, as librosa's)."""
    fft_freqs = np.fft.rfftfreq(n_fft, 1.0 / sr)
    mel_f = _mel_to_hz(np.linspace(_hz_to_mel(fmin), _hz_to_mel(fmax), n_mels + 2))
    fdiff = np.diff(mel_f)
    ramps = mel_f[:, None] - fft_freqs[None, :]
    lower = -ramps[:-2] / fdiff[:-1, None]
    upper = ramps[2:] / fdiff[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper)).astype(np.float32)  # rounded like librosa's
    weights *= (2.0 / (mel_f[2:] - mel_f[:-2]))[:, None]
    return weights


def mel_spectrogram(wav: Tensor, n_fft: int = 1024, n_mels: int = 128, sr: int = SAMPLE_RATE,
                    hop: int = 256, win: int = 1024, fmin: float = 0.0, fmax: float = 12000.0) -> Tensor:
    """Log-mel of the speaker encoder: wav [B, n] -> [B, n_mels, frames] float32.

    Reflect pad (n_fft - hop)/2 both sides, Hann STFT without centering, magnitude sqrt(re²+im²+1e-9),
    Slaney mel, log(clamp(·, 1e-5)).
    """
    basis = torch.from_numpy(mel_filterbank(sr, n_fft, n_mels, fmin, fmax)).to(wav.device)
    pad = (n_fft - hop) // 2
    y = torch.nn.functional.pad(wav[:, None], (pad, pad), mode="reflect")[:, 0]  # [B, n + 2·pad]
    spec = torch.stft(y, n_fft, hop_length=hop, win_length=win, window=torch.hann_window(win, device=wav.device),
                      center=False, normalized=False, onesided=True, return_complex=True)
    mag = torch.sqrt(torch.view_as_real(spec).pow(2).sum(-1) + 1e-9)  # [B, F, frames]
    return torch.log(torch.clamp(basis @ mag, min=1e-5))
