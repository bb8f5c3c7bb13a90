"""Session fixtures for the end-to-end `q3tts synth` tests: tiny random CustomVoice / VoiceDesign /
Base checkpoints and a generated reference recording, written once per session; `synth(...)` runs
`q3tts.cli.main` in-process and returns its exit code, stdout and the float pcm it wrote (the wav
file itself is 16-bit, so waveform comparisons use the pcm handed to `write_wav`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

import q3tts.synth
from q3tts.checkpoint.maker import make_checkpoint
from q3tts.cli import main

# name -> (variant, size, seed)
CHECKPOINTS = {"cv": ("custom_voice", "1.7b", 31), "vd": ("voice_design", "1.7b", 32),
               "base": ("base", "1.7b", 33)}
REF_SR = 16000  # not 24 kHz: the resampling path is exercised


@pytest.fixture(scope="session")
def ckpt_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("e2e_ckpts")
    return {name: make_checkpoint(root / name, variant, size, "tiny", seed)
            for name, (variant, size, seed) in CHECKPOINTS.items()}


@pytest.fixture(scope="session")
def ref_wav(tmp_path_factory) -> Path:
    """0.6 s at 16 kHz (8 codec frames at 24 kHz): modulated two-tone signal + noise, 16-bit."""
    t = np.arange(int(0.6 * REF_SR)) / REF_SR
    rng = np.random.default_rng(5)
    wav = (0.25 * np.sin(2 * np.pi * 220 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))
           + 0.1 * np.sin(2 * np.pi * 1375 * t) + 0.03 * rng.standard_normal(t.size))
    path = tmp_path_factory.mktemp("e2e_ref") / "ref.wav"
    sf.write(str(path), wav.astype(np.float32), REF_SR, subtype="PCM_16")
    return path


@dataclass
class SynthRun:
    rc: int
    stdout: str
    stderr: str
    pcm: dict[str, np.ndarray]  # wav path -> the float pcm written there


@pytest.fixture
def synth(monkeypatch, capsys):
    """synth(*argv) -> SynthRun: `q3tts <argv>` in-process, capturing the pcm given to write_wav."""
    real = q3tts.synth.write_wav

    def run(*argv) -> SynthRun:
        written: dict[str, np.ndarray] = {}

        def capture(path, pcm, sr=24000):
            assert sr == 24000
            written[str(path)] = np.asarray(pcm, dtype=np.float32).copy()
            real(path, pcm, sr)

        monkeypatch.setattr(q3tts.synth, "write_wav", capture)
        capsys.readouterr()
        rc = main([str(a) for a in argv])
        out = capsys.readouterr()
        return SynthRun(rc, out.out, out.err, written)

    return run


@pytest.fixture(scope="session")
def session_cache() -> dict:
    """Results shared between tests (e.g. one full-decode run reused by the stream test)."""
    return {}
