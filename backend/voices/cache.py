"""`VoiceFiles`: name -> the `Voice` read from its file, for a serving model, least recently used first out.

This is the serving side's record of voice files (host arrays, in the Triton stub, which never touches the
device); the engine keeps each voice's tensors on its device, by content (`q3tts.engine.voice_cache`, whose
counts are the q3tts_voice_cache_* metrics). A hit costs one `os.stat` of the voice file: a file replaced or
removed by another process (a registration while serving, `q3tts voice rm`) is noticed on the next use,
never served stale. The family check runs on load, so a voice made for another checkpoint is refused
before anything reaches the engine.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict

from q3tts.voices.store import Family, UnknownVoice, Voice, VoiceStore, check_name, from_file

DEFAULT_MAX_ENTRIES = 64


class VoiceFiles:
    """LRU of at most `max_entries` voices read from `store` and checked against `family`."""

    def __init__(self, store: VoiceStore, family: Family, max_entries: int = DEFAULT_MAX_ENTRIES):
        if max_entries < 1:
            raise ValueError(f"voice cache size must be >= 1, got {max_entries}")
        self.store, self.family, self.max_entries = store, family, int(max_entries)
        self._entries: OrderedDict[str, tuple[tuple, Voice]] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def for_engine(cls, engine, voices_dir: str, max_entries: int | str | None = None) -> VoiceFiles:
        """The voice files a serving engine reads: those of `voices_dir`, checked for its checkpoint
        (`max_entries` as a model parameter may be text; empty = DEFAULT_MAX_ENTRIES)."""
        return cls(VoiceStore(voices_dir), Family.of(engine.checkpoint.config),
                   int(max_entries or DEFAULT_MAX_ENTRIES))

    def resolve(self, name: str) -> Voice:
        """The voice `name`, checked for this family; raises UnknownVoice or VoiceError."""
        name = check_name(name)
        path = self.store.path(name)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            with self._lock:
                self._entries.pop(name, None)
            raise UnknownVoice(f"voice {name!r} is not registered") from None
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        with self._lock:
            entry = self._entries.get(name)
            if entry is not None and entry[0] == stamp:
                self._entries.move_to_end(name)
                return entry[1]
        voice = from_file(path)
        self.family.check(voice)
        with self._lock:
            self._entries[name] = (stamp, voice)
            self._entries.move_to_end(name)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return voice
