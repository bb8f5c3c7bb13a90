"""Access to the parity oracle: the official `qwen-tts` 0.1.1 package (a test dependency).

qwen_tts imports `torchaudio.compliance.kaldi` at module level for its 25 Hz tokenizer only; PyPI has no
torchaudio for torch 2.13, so an import-only stand-in is installed first (REFERENCE_ORACLE.md).
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
import types
import warnings
from functools import lru_cache
from pathlib import Path


def _install_torchaudio_standin() -> None:
    if "torchaudio" in sys.modules:
        return
    root = types.ModuleType("torchaudio")
    compliance = types.ModuleType("torchaudio.compliance")
    kaldi = types.ModuleType("torchaudio.compliance.kaldi")
    root.compliance, compliance.kaldi = compliance, kaldi
    for module in (root, compliance, kaldi):  # transformers calls find_spec("torchaudio")
        module.__spec__ = importlib.machinery.ModuleSpec(module.__name__, None)
    sys.modules.update({"torchaudio": root, "torchaudio.compliance": compliance,
                        "torchaudio.compliance.kaldi": kaldi})


def import_qwen_tts():
    """Import and return the `qwen_tts` module (offline, quiet)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    _install_torchaudio_standin()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import qwen_tts  # noqa: PLC0415
    return qwen_tts


@lru_cache(maxsize=8)
def load_reference(path: str | Path, dtype: str = "float32"):
    """The official `Qwen3TTSModel` wrapper for a local checkpoint folder, on CPU, eager attention."""
    import torch  # noqa: PLC0415

    qwen_tts = import_qwen_tts()
    return qwen_tts.Qwen3TTSModel.from_pretrained(
        str(path), dtype=getattr(torch, dtype), attn_implementation="eager")
