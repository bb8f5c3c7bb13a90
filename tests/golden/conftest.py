"""Session fixtures for the golden tests: tiny random checkpoints written once per session, loaded both
by our code and by the official qwen-tts 0.1.1, plus cached reference runs."""

from __future__ import annotations

import importlib.machinery
import sys
from pathlib import Path

import pytest
import torch

from q3tts.checkpoint.loader import load_checkpoint
from q3tts.checkpoint.maker import make_checkpoint
from q3tts.models.tts_model import Qwen3TTS
from q3tts.prompt import PromptBuilder

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared `oracle` module

# name -> (variant, size, seed)
CHECKPOINTS = {
    "cv17": ("custom_voice", "1.7b", 11),
    "cv06": ("custom_voice", "0.6b", 12),
    "vd17": ("voice_design", "1.7b", 13),
    "base17": ("base", "1.7b", 14),
}


def import_official():
    """The official qwen_tts module, with a torchaudio stand-in that has a module spec."""
    import oracle  # noqa: PLC0415

    oracle._install_torchaudio_standin()
    for name in ("torchaudio", "torchaudio.compliance", "torchaudio.compliance.kaldi"):
        if getattr(sys.modules[name], "__spec__", None) is None:
            sys.modules[name].__spec__ = importlib.machinery.ModuleSpec(name, None)
    return oracle.import_qwen_tts()


@pytest.fixture(scope="session", autouse=True)
def _single_thread():
    """Tiny matrices: one intra-op thread is several times faster than two on a busy 2-core box."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


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
    cache: dict[str, Ours] = {}

    def get(name: str) -> Ours:
        if name not in cache:
            cache[name] = Ours(checkpoint_dirs[name])
        return cache[name]

    return get


@pytest.fixture(scope="session")
def reference(checkpoint_dirs):
    """name -> the official Qwen3TTSModel wrapper (fp32, eager, CPU), loaded once."""
    import oracle  # noqa: PLC0415

    import_official()
    return lambda name: oracle.load_reference(str(checkpoint_dirs[name]))


@pytest.fixture(scope="session")
def reference_runs():
    """Session cache of reference results, keyed by case id."""
    return {}
