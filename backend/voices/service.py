"""`VoiceService`: what the `qwen3_tts_voices` model does (client/protocol.py VOICES_*), without Triton.

One voices directory, one checkpoint: `add` encodes a reference with the checkpoint's encoders (loaded on the
first add, so a server that never registers a voice never loads them) and writes the voice atomically;
`list` returns the catalogue a front end needs (the checkpoint's variant and CustomVoice speakers, and every
registered voice); `rm` removes one. A registration is live at once: the sequence model reads voice files
through its `VoiceFiles` (voices/cache.py), which notices new, replaced and removed files.
"""

from __future__ import annotations

import json
import threading

import numpy as np

from q3tts.checkpoint.loader import resolve_path
from q3tts.config import ModelConfig
from q3tts.voices.store import UnknownVoice, VoiceError, VoiceExists, VoiceStorageError, VoiceStore
from q3tts_client import protocol as P

ERROR_CODES = {UnknownVoice: "NOT_FOUND", VoiceExists: "ALREADY_EXISTS", VoiceStorageError: "INTERNAL"}


def error_code(error: VoiceError) -> str:
    """The TritonError code name of a refusal (protocol.py lists them)."""
    return next((code for kind, code in ERROR_CODES.items() if isinstance(error, kind)), "INVALID_ARG")


class VoiceService:
    """add / list / rm over `voices_dir` for the checkpoint at `checkpoint`."""

    def __init__(self, checkpoint: str, voices_dir: str, device: str = "cpu"):
        self.checkpoint, self.device = checkpoint, device
        root = resolve_path(checkpoint)
        self.config = ModelConfig.from_dict(json.loads((root / "config.json").read_text()))
        self.store = VoiceStore(voices_dir)
        self._enroller = None
        self._lock = threading.Lock()

    def handle(self, action: str, name: str | None = None, ref_audio: np.ndarray | None = None,
               sample_rate: int = P.SAMPLE_RATE, ref_text: str | None = None, xvector_only: bool = False) -> dict:
        """One request; returns its JSON document, raises VoiceError naming the problem."""
        if action == "list":
            return self.catalogue()
        if action not in P.VOICE_ACTIONS:
            raise VoiceError(f"input {P.INPUT_ACTION} must be one of {', '.join(P.VOICE_ACTIONS)}, got {action!r}")
        if not name:
            raise VoiceError(f"input {P.INPUT_VOICE} (the voice name) is required to {action} a voice")
        if action == "rm":
            self.store.remove(name)
            return {"name": name.strip().lower(), "removed": True}
        if ref_audio is None:
            raise VoiceError(f"input {P.INPUT_REF_AUDIO} is required to add voice {name!r}")
        voice = self.enroller().enroll(name, ref_audio, sample_rate, ref_text, xvector_only)
        return self.store.add(voice).info()

    def catalogue(self) -> dict:
        c = self.config
        return {"variant": c.variant, "size": c.size, "xvector_dim": c.talker.hidden_size,
                "speakers": sorted(c.talker.speaker_ids), "voices": self.store.list()}

    def enroller(self):
        """The checkpoint's encoders, loaded once (VoiceError for a checkpoint that is not Base)."""
        from q3tts.voices.enroll import Enroller

        with self._lock:
            if self._enroller is None:
                if self.config.variant != "base":
                    raise VoiceError(f"voices are registered on a Base checkpoint; this server runs "
                                     f"{self.config.variant}-{self.config.size}")
                self._enroller = Enroller.from_checkpoint(self.checkpoint, self.device)
            return self._enroller
