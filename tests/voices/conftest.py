"""Voice fixtures: a tiny random Base checkpoint (and one of the other size, another family), a reference
recording, the enroller loaded once per session, and an empty voices directory per test."""

from __future__ import annotations

import numpy as np
import pytest

from q3tts.checkpoint.maker import make_checkpoint
from q3tts.voices.enroll import Enroller
from q3tts.voices.store import VoiceStore

REF_SR = 16000  # not 24 kHz: registration resamples
REF_TEXT = "This is the reference."


@pytest.fixture(scope="session")
def base_ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("voices_ckpt") / "base-0.6b", "base", "0.6b", "tiny", 41)


@pytest.fixture(scope="session")
def ref_wav() -> np.ndarray:
    """0.6 s at 16 kHz: a modulated two-tone signal plus noise (8 codec frames at 24 kHz)."""
    t = np.arange(int(0.6 * REF_SR)) / REF_SR
    rng = np.random.default_rng(7)
    wav = (0.25 * np.sin(2 * np.pi * 220 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))
           + 0.1 * np.sin(2 * np.pi * 1375 * t) + 0.03 * rng.standard_normal(t.size))
    return wav.astype(np.float32)


@pytest.fixture(scope="session")
def enroller(base_ckpt) -> Enroller:
    return Enroller.from_checkpoint(base_ckpt)


@pytest.fixture
def store(tmp_path) -> VoiceStore:
    return VoiceStore(tmp_path / "voices")
