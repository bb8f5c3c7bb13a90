"""Session fixtures for the golden tests: tiny random checkpoints written once per session, loaded
both by our code and by the official qwen-tts 0.1.1, plus a session cache of reference runs."""

from __future__ import annotations

import pytest
import torch

import oracle
from q3tts.checkpoint.loader import load_checkpoint
from q3tts.checkpoint.maker import make_checkpoint
from q3tts.models.tts_model import Qwen3TTS
from q3tts.models.prompt import PromptBuilder

# name -> (variant, size, seed)
CHECKPOINTS = {
    "cv17": ("custom_voice", "1.7b", 11),
    "cv06": ("custom_voice", "0.6b", 12),
    "vd17": ("voice_design", "1.7b", 13),
    "base17": ("base", "1.7b", 14),
}


@pytest.fixture(scope="session")
def checkpoint_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("golden_ckpts")
    return {name: make_checkpoint(root / name, variant, size, "tiny", seed)
            for name, (variant, size, seed) in CHECKPOINTS.items()}


class Ours:
    """Our loaded model + prompt builder for one checkpoint."""

    def __init__(self, path):
        self.ckpt = load_checkpoint(path, dtype=torch.float32)
        self.model = Qwen3TTS.from_checkpoint(self.ckpt)
        self.builder = PromptBuilder(self.model, self.ckpt.tokenizer)


@pytest.fixture(scope="session")
def ours(checkpoint_dirs):
    """name -> `Ours`, loaded once per session."""
    cache: dict[str, Ours] = {}

    def get(name: str) -> Ours:
        if name not in cache:
            cache[name] = Ours(checkpoint_dirs[name])
        return cache[name]

    return get


@pytest.fixture(scope="session")
def reference(checkpoint_dirs):
    """name -> the official Qwen3TTSModel wrapper (fp32, eager, CPU), loaded once."""
    return lambda name: oracle.load_reference(str(checkpoint_dirs[name]))


@pytest.fixture(scope="session")
def reference_runs():
    """Session cache of reference results, keyed by (case, mode)."""
    return {}
