"""Codec encoder, speaker encoder and audio front end against the official implementation."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from q3tts.codec.audio import mel_filterbank, mel_spectrogram, read_wav, resample, write_wav
from q3tts.config import SpeakerEncoderConfig
from q3tts.models.speaker_encoder import SpeakerEncoder
from q3tts.checkpoint.presets import model_config_dict

TEXT_IDS = {k: i for i, k in enumerate(["im_start", "im_end", "assistant", "tts_pad", "tts_bos", "tts_eos"])}


def _test_signal(sr: int, seconds: float, seed: int = 0) -> np.ndarray:
    """A vibrato tone with harmonics, an amplitude envelope and a little noise; length not a frame multiple."""
    t = np.arange(int(sr * seconds)) / sr
    f0 = 180 + 40 * np.sin(2 * np.pi * 1.5 * t)
    phase = 2 * np.pi * np.cumsum(f0) / sr
    tone = sum(np.sin(k * phase) / k for k in (1, 2, 3, 5))
    env = 0.5 + 0.5 * np.sin(2 * np.pi * 2.0 * t) ** 2
    noise = 0.02 * np.random.default_rng(seed).standard_normal(t.shape)
    return (0.3 * env * tone + noise).astype(np.float32)


@pytest.mark.oracle
@pytest.mark.parametrize("sr", [24000, 16000])
def test_encoder_codes_match_reference(codec, ref_tokenizer, sr):
    wav = _test_signal(sr, 1.37)
    ref = ref_tokenizer.encode(wav, sr=sr).audio_codes[0]  # [T, 16]
    ours = codec.encoder.encode(torch.from_numpy(resample(wav, sr)))
    assert ours.shape == ref.shape == (-(-len(resample(wav, sr)) // 1920), 16)
    assert len(torch.unique(ours[:, 0])) > 1  # codes vary over time
    assert torch.equal(ours, ref)


def _speaker_encoder_pair(qwen_tts):
    from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSSpeakerEncoderConfig  # noqa: PLC0415
    from qwen_tts.core.models.modeling_qwen3_tts import Qwen3TTSSpeakerEncoder  # noqa: PLC0415

    cfg = model_config_dict("base", "0.6b", "tiny", TEXT_IDS, 64)["speaker_encoder_config"]
    torch.manual_seed(3)
    ours = SpeakerEncoder(SpeakerEncoderConfig.from_dict(cfg)).eval()
    ref = Qwen3TTSSpeakerEncoder(Qwen3TTSSpeakerEncoderConfig(**cfg)).eval()
    ref.load_state_dict(ours.state_dict(), strict=True)  # same names and shapes as the released keys
    return ours, ref


@pytest.mark.oracle
def test_xvector_matches_reference(qwen_tts):
    from qwen_tts.core.models.modeling_qwen3_tts import Qwen3TTSForConditionalGeneration  # noqa: PLC0415

    ours, ref = _speaker_encoder_pair(qwen_tts)
    wav = _test_signal(24000, 2.1, seed=1)
    host = types.SimpleNamespace(speaker_encoder=ref, device=torch.device("cpu"), dtype=torch.float32)
    expected = Qwen3TTSForConditionalGeneration.extract_speaker_embedding(host, wav, 24000)
    got = ours.embed(torch.from_numpy(wav))
    assert got.shape == expected.shape == (ours.config.enc_dim,)
    assert (got - expected).abs().max().item() <= 1e-5


@pytest.mark.oracle
def test_mel_front_end_matches_reference(qwen_tts):
    import librosa  # noqa: PLC0415
    from qwen_tts.core.models.modeling_qwen3_tts import mel_spectrogram as ref_mel  # noqa: PLC0415

    assert np.array_equal(mel_filterbank(24000, 1024, 128, 0.0, 12000.0),
                          librosa.filters.mel(sr=24000, n_fft=1024, n_mels=128, fmin=0, fmax=12000))
    wav = torch.from_numpy(_test_signal(24000, 0.9))[None]
    expected = ref_mel(wav, n_fft=1024, num_mels=128, sampling_rate=24000, hop_size=256, win_size=1024,
                       fmin=0, fmax=12000)
    assert torch.equal(mel_spectrogram(wav), expected)


def test_wav_roundtrip_and_resample(tmp_path):
    wav = _test_signal(16000, 0.5)
    write_wav(tmp_path / "a.wav", wav, sr=16000)
    back, sr = read_wav(tmp_path / "a.wav")
    assert sr == 16000 and back.dtype == np.float32 and np.abs(back - wav).max() <= 1 / 32768 + 1e-7
    up = resample(back, 16000)
    assert up.dtype == np.float32 and len(up) == 12000
