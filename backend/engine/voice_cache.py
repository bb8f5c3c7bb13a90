"""`VoiceCache`: Base voices kept ready on the engine's device, least recently used first out.

A Base voice's tensors (x-vector, reference codes, the transcript's ids: `PromptBuilder.voice_tensors`) and,
for an ICL voice, the codec stream primed with its reference frames (`ModelRunner.prime_state`) depend only
on the voice and the engine: they are made once, by the `Preparer`'s worker (never on the engine thread),
and every later sequence of that voice takes them as they are (its prompt embeds from them, its codec slot
copies the primed state: `StreamingDecoder.load_states` copies, the cached state is never written).

Entries are keyed by the voice's content (a digest of the x-vector, and for ICL of the reference codes and
transcript), so a registered voice, the same arrays sent in a request and a batch file's arrays share one
entry, and a voice whose file was replaced with other content is a new entry (never served stale). The
bound is bytes on the device (`EngineConfig.voice_cache_bytes`); a voice larger than it is used uncached.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from q3tts.core import VoiceSpec
from q3tts.models.prompt import VoiceTensors


@dataclass(frozen=True)
class PreparedVoice:
    """A voice as the engine consumes it, on its device."""

    tensors: VoiceTensors
    codec_state: list[torch.Tensor] | None  # ICL: the codec stream after the reference frames

    @property
    def nbytes(self) -> int:
        arrays = [self.tensors.xvector, self.tensors.ref_codes, *(self.codec_state or ())]
        return sum(t.numel() * t.element_size() for t in arrays if t is not None)


def voice_key(voice: VoiceSpec) -> bytes | None:
    """The content key of a voice with an x-vector (None: nothing to keep, e.g. a CustomVoice speaker).
    Covers what `PreparedVoice` is made from: the x-vector, and unless x-vector only, the reference codes
    and transcript (dtype and shape included, so arrays of other types never share an entry)."""
    if not VoiceCache.keeps(voice):
        return None
    digest = hashlib.blake2b(digest_size=20)
    parts = [voice.xvector] if voice.xvector_only else [voice.xvector, voice.ref_codes]
    for arr in parts:
        arr = np.ascontiguousarray(arr) if arr is not None else np.zeros(0)
        digest.update(f"{arr.dtype.str}{arr.shape}".encode())
        digest.update(arr.data)
    digest.update(b"\0" + (b"" if voice.xvector_only else (voice.ref_text or "").encode()))
    return digest.digest()


class VoiceCache:
    """LRU of `PreparedVoice`s by content key, at most `max_bytes` of device memory (0: keeps none).
    `prepare(voice)` makes one; it runs on the preparer's worker. Thread-safe (the engine thread looks
    up, the worker inserts)."""

    def __init__(self, max_bytes: int, prepare: Callable[[VoiceSpec], PreparedVoice]):
        self.max_bytes, self.prepare = int(max_bytes), prepare
        self._entries: OrderedDict[bytes, PreparedVoice] = OrderedDict()
        self._lock = threading.Lock()
        self.nbytes = self.hits = self.misses = 0

    @staticmethod
    def keeps(voice: VoiceSpec) -> bool:
        """Whether `voice` is one this cache keeps (a Base voice with its x-vector)."""
        return voice.xvector is not None

    def get(self, voice: VoiceSpec) -> PreparedVoice | None:
        """The kept voice (a hit), or None: not kept yet (`get_or_prepare` on the worker) or not a voice
        with tensors (`voice_key` None)."""
        key = voice_key(voice)
        with self._lock:
            return None if key is None else self._take(key)

    def get_or_prepare(self, voice: VoiceSpec) -> PreparedVoice | None:
        """The kept voice, or `prepare(voice)` kept (a miss); None for a voice without tensors."""
        key = voice_key(voice)
        if key is None:
            return None
        with self._lock:
            found = self._take(key)
        if found is not None:  # prepared by an earlier job of the worker since the engine thread looked
            return found
        prepared = self.prepare(voice)
        with self._lock:
            self.misses += 1
            self._insert(key, prepared)
        return prepared

    def _take(self, key: bytes) -> PreparedVoice | None:
        found = self._entries.get(key)
        if found is not None:
            self._entries.move_to_end(key)
            self.hits += 1
        return found

    def _insert(self, key: bytes, prepared: PreparedVoice) -> None:
        size = prepared.nbytes
        if key in self._entries or size > self.max_bytes:
            return
        self._entries[key] = prepared
        self.nbytes += size
        while self.nbytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.nbytes -= evicted.nbytes

    def stats(self) -> dict[str, int]:
        """Entries and device bytes held, the byte bound, and running hit/miss totals (serving metrics)."""
        with self._lock:
            return {"voice_cache_entries": len(self._entries), "voice_cache_bytes": self.nbytes,
                    "voice_cache_capacity_bytes": self.max_bytes, "voice_cache_hits": self.hits,
                    "voice_cache_misses": self.misses}
