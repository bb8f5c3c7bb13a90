"""Fixtures for engine tests: one tiny random CustomVoice checkpoint, loaded once; the kernels' batch-invariance
switch off for a test and restored after it."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_ckpt_dir(tmp_path_factory):
    from q3tts.checkpoint.maker import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("engine_ckpt") / "cv_tiny", "custom_voice", "1.7b",
                           "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_ckpt(tiny_ckpt_dir):
    from q3tts.checkpoint.loader import load_checkpoint

    return load_checkpoint(tiny_ckpt_dir, dtype=torch.float32)


@pytest.fixture(scope="session")
def speaker(tiny_ckpt):
    return sorted(tiny_ckpt.config.talker.speaker_ids)[0]


@pytest.fixture
def switch():
    """kernels.set_batch_invariant, off when the test starts and as it was when it ends: an engine with
    EngineConfig.batch_invariant turns the process-wide switch on and leaves it on, so a later engine without it
    would run the invariant paths."""
    from q3tts import kernels

    before = kernels.batch_invariant()
    kernels.set_batch_invariant(False)
    yield kernels.set_batch_invariant
    kernels.set_batch_invariant(before)
