"""Voice fixtures: a tiny random Base checkpoint, a reference recording (tests/voice_fixtures.py), the enroller
loaded once per session, and an empty voices directory per test."""

from __future__ import annotations

import numpy as np
import pytest

from q3tts.voices.enroll import Enroller
from q3tts.voices.store import VoiceStore
from voice_fixtures import base_checkpoint, reference_wav  # tests/ is on sys.path


@pytest.fixture(scope="session")
def base_ckpt(tmp_path_factory):
    return base_checkpoint(tmp_path_factory)


@pytest.fixture(scope="session")
def ref_wav() -> np.ndarray:
    return reference_wav()


@pytest.fixture(scope="session")
def enroller(base_ckpt) -> Enroller:
    return Enroller.from_checkpoint(base_ckpt)


@pytest.fixture
def store(tmp_path) -> VoiceStore:
    return VoiceStore(tmp_path / "voices")
