"""Session fixtures for engine tests: one tiny random CustomVoice checkpoint, loaded once."""

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
