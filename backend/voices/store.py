"""Named voices on disk: one safetensors file per voice in a voices directory.

A voice file holds the tensors a Base request needs (`xvector` [H] float32, `ref_codes` [F, 16] int64 for
ICL voices) and, as string metadata, the reference transcript, the checkpoint family it was made for and a
sha256 of that content (checked on every read). Writes are atomic (a temp file in the same directory,
fsync, `os.replace`) under an exclusive lock on the directory, so readers in other processes (a serving
model, `q3tts voice list`) see a voice either whole or not at all, and two writers cannot both register a
name. Every refusal is one `VoiceError` naming the voice and the problem; nothing is left half-written.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save

from q3tts.core import InvalidRequest, VoiceSpec

FORMAT = "q3tts-voice/1"
SUFFIX = ".safetensors"
NAME_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
LOCK_NAME = ".lock"


class VoiceError(InvalidRequest):
    """A voice cannot be registered, read or used; the text names the voice and the problem."""


class UnknownVoice(VoiceError, KeyError):
    """No voice of that name is registered."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class VoiceExists(VoiceError):
    """A voice of that name is already registered (remove it first)."""


class VoiceStorageError(VoiceError):
    """The voices directory could not be written (full disk, permissions); nothing was left behind."""


def default_voices_dir() -> Path:
    """$Q3TTS_VOICES_DIR, else $XDG_DATA_HOME/q3tts/voices (~/.local/share/q3tts/voices)."""
    if os.environ.get("Q3TTS_VOICES_DIR"):
        return Path(os.environ["Q3TTS_VOICES_DIR"])
    data = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return data / "q3tts" / "voices"


def check_name(name: str) -> str:
    """The canonical (lower-case) voice name; raises VoiceError for anything that is not a plain name."""
    canonical = str(name).strip().lower()
    if not NAME_RE.fullmatch(canonical):
        raise VoiceError(f"voice name {name!r} is not allowed: use 1-64 letters, digits, '-' or '_', "
                         "starting with a letter or digit (no path characters)")
    return canonical


@dataclass(frozen=True)
class Family:
    """The checkpoints a voice works with: its x-vector comes from that variant/size's speaker encoder."""

    variant: str
    size: str
    xvector_dim: int

    @classmethod
    def of(cls, config) -> Family:
        """The family of a `q3tts.config.ModelConfig` (x-vector size = the talker's hidden size)."""
        return cls(config.variant, config.size, config.talker.hidden_size)

    def __str__(self) -> str:
        return f"{self.variant}-{self.size} (x-vector {self.xvector_dim})"

    def check(self, voice: Voice) -> None:
        """Raise VoiceError when `voice` was made for another checkpoint family."""
        if self.variant != "base":
            raise VoiceError(f"voice {voice.name!r}: registered voices need a Base checkpoint; this one is "
                             f"{self.variant}-{self.size}")
        if voice.family != self:
            raise VoiceError(f"voice {voice.name!r} was made for {voice.family}, not for this checkpoint's "
                             f"{self} family: register it again with this checkpoint")


@dataclass(frozen=True)
class Voice:
    """A registered voice. `ref_codes` None = x-vector only (no ICL reference)."""

    name: str
    family: Family
    xvector: np.ndarray  # [H] float32
    ref_codes: np.ndarray | None  # [F, 16] int64
    ref_text: str | None
    source: str = "audio"  # audio | design
    prompt: str | None = None  # the VoiceDesign description a design voice was rendered from
    created: int = 0  # unix seconds
    sha256: str = ""

    @property
    def xvector_only(self) -> bool:
        return self.ref_codes is None

    def spec(self, language: str = "auto", text_mode: str | None = None, xvector_only: bool = False) -> VoiceSpec:
        """The engine's VoiceSpec for this voice (nothing left to encode); `xvector_only` drops the ICL part
        of an ICL voice."""
        return VoiceSpec(language=language, ref_text=self.ref_text, ref_codes=self.ref_codes,
                         xvector=self.xvector, xvector_only=xvector_only or self.xvector_only,
                         text_mode=text_mode)

    def info(self) -> dict:
        """JSON-able description (no tensors)."""
        return {"name": self.name, "family": {"variant": self.family.variant, "size": self.family.size,
                                              "xvector_dim": self.family.xvector_dim},
                "frames": 0 if self.ref_codes is None else int(self.ref_codes.shape[0]),
                "xvector_only": self.xvector_only, "ref_text": self.ref_text, "source": self.source,
                "prompt": self.prompt, "created": self.created, "sha256": self.sha256}


def _tensors(voice: Voice) -> dict[str, np.ndarray]:
    out = {"xvector": np.ascontiguousarray(voice.xvector, dtype=np.float32)}
    if voice.ref_codes is not None:
        out["ref_codes"] = np.ascontiguousarray(voice.ref_codes, dtype=np.int64)
    return out


def content_hash(voice: Voice) -> str:
    """sha256 over the tensors (name, dtype, shape, bytes), the transcript and the family."""
    h = hashlib.sha256()
    for key, arr in sorted(_tensors(voice).items()):
        h.update(f"{key}:{arr.dtype.str}:{arr.shape}".encode())
        h.update(arr.tobytes())
    h.update(json.dumps([voice.ref_text, voice.family.variant, voice.family.size,
                         voice.family.xvector_dim]).encode())
    return h.hexdigest()


def seal(voice: Voice) -> Voice:
    """Validate the tensors and stamp the creation time and content hash."""
    xv = np.asarray(voice.xvector)
    if xv.shape != (voice.family.xvector_dim,) or not np.isfinite(xv).all():
        raise VoiceError(f"voice {voice.name!r}: x-vector must be {voice.family.xvector_dim} finite values, "
                         f"got shape {list(xv.shape)}")
    if voice.ref_codes is not None and (np.asarray(voice.ref_codes).ndim != 2 or len(voice.ref_codes) == 0):
        raise VoiceError(f"voice {voice.name!r}: reference codes must be [frames, codebooks], "
                         f"got shape {list(np.asarray(voice.ref_codes).shape)}")
    if voice.ref_codes is not None and not voice.ref_text:
        raise VoiceError(f"voice {voice.name!r}: a reference with codes needs its transcript (ref_text)")
    voice = replace(voice, name=check_name(voice.name), created=voice.created or int(time.time()))
    return replace(voice, sha256=content_hash(voice))


def to_bytes(voice: Voice) -> bytes:
    meta = {"format": FORMAT, "name": voice.name, "variant": voice.family.variant, "size": voice.family.size,
            "xvector_dim": str(voice.family.xvector_dim), "ref_text": voice.ref_text or "",
            "source": voice.source, "prompt": voice.prompt or "", "created": str(voice.created),
            "sha256": voice.sha256}
    return save(_tensors(voice), metadata=meta)


def from_file(path: Path) -> Voice:
    """Read and verify one voice file (VoiceError when it is not a readable, intact voice)."""
    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
            tensors = {key: f.get_tensor(key) for key in f.keys()}
        if meta.get("format") != FORMAT:
            raise ValueError(f"format {meta.get('format')!r} is not {FORMAT!r}")
        family = Family(meta["variant"], meta["size"], int(meta["xvector_dim"]))
        voice = Voice(path.name[:-len(SUFFIX)], family, tensors["xvector"], tensors.get("ref_codes"),
                      meta["ref_text"] or None, meta["source"], meta["prompt"] or None, int(meta["created"]),
                      meta["sha256"])
    except FileNotFoundError:
        raise UnknownVoice(f"voice {path.stem!r} is not registered") from None
    except (OSError, ValueError, KeyError) as e:
        raise VoiceError(f"voice file {path} is unreadable: {e}") from None
    if content_hash(voice) != voice.sha256:
        raise VoiceError(f"voice file {path} is corrupt: its content does not match its sha256")
    return voice


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


class VoiceStore:
    """The voices directory: `add`, `read`, `list`, `remove`. Safe across threads and processes."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def path(self, name: str) -> Path:
        return self.root / f"{check_name(name)}{SUFFIX}"

    @contextmanager
    def _locked(self):
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / LOCK_NAME, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def add(self, voice: Voice) -> Voice:
        """Register `voice` (sealed here); raises VoiceExists, VoiceStorageError or VoiceError."""
        voice = seal(voice)
        data = to_bytes(voice)
        path = self.path(voice.name)
        tmp = path.with_name(f".{voice.name}.{uuid.uuid4().hex}.tmp")
        try:
            with self._locked():
                if path.exists():
                    raise VoiceExists(f"voice {voice.name!r} is already registered in {self.root} "
                                      "(remove it first)")
                try:
                    _write_durably(tmp, data)
                    os.replace(tmp, path)
                finally:
                    tmp.unlink(missing_ok=True)
        except OSError as e:
            reason = os.strerror(e.errno) if e.errno else str(e)
            raise VoiceStorageError(f"voice {voice.name!r} could not be written to {self.root}: {reason}"
                                    + (" (the disk is full)" if e.errno == errno.ENOSPC else "")) from None
        return voice

    def read(self, name: str) -> Voice:
        return from_file(self.path(name))

    def remove(self, name: str) -> None:
        path = self.path(name)
        with self._locked():
            try:
                path.unlink()
            except FileNotFoundError:
                raise UnknownVoice(f"voice {check_name(name)!r} is not registered in {self.root}") from None

    def names(self) -> list[str]:
        return sorted(p.name[:-len(SUFFIX)] for p in self.root.glob(f"*{SUFFIX}")) if self.root.is_dir() else []

    def list(self) -> list[dict]:
        """`Voice.info()` of every registered voice; an unreadable file is listed with its error."""
        out = []
        for name in self.names():
            try:
                out.append(self.read(name).info())
            except VoiceError as e:
                out.append({"name": name, "error": str(e)})
        return out
