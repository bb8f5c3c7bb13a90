"""`Preparer`: voices are encoded and prepared off the decode loop.

Turning a request's reference recording into ref_codes + x-vector (codec encoder, speaker encoder) takes
about as long as the recording on a CPU, far longer than a decode step, and priming a Base ICL voice's
codec stream (its reference frames decoded into a private state, `ModelRunner.prime_state`) is a decode
of the whole reference. `Engine.add` hands the preparer every voice with reference audio, and every Base
voice its `VoiceCache` does not keep yet (registered, batch-file or request arrays), once checked: one
worker thread with its own queue encodes it and prepares it on the device (kept in the cache; torch
releases the GIL inside its ops, so the engine thread keeps stepping the playing streams), while text
that arrives for the sequence, its end and its abort are kept in its `Pending` record. `Engine.step`
takes the prepared ones (`take`) and admits them like any other request, so admitting one only copies its
primed state; one whose voice could not be prepared ends with that error.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Callable, Hashable

import torch

from q3tts.core import SamplingParams, VoiceSpec

from .voice_cache import PreparedVoice

WAIT_S = 0.01  # Engine.step with nothing but preparation to do waits this long for one to finish


@dataclass
class Pending:
    """A sequence whose voice is being prepared, and what arrived for it meanwhile."""

    seq_id: Hashable
    voice: VoiceSpec
    sampling: SamplingParams
    text: list[str] = field(default_factory=list)
    text_done: bool = False
    aborted: bool = False
    result: VoiceSpec | Exception | None = None  # the resolved voice, or why it could not be
    prepared: PreparedVoice | None = None  # it on the device (`prepare`)


class Preparer:
    """`resolve(voice) -> voice` (reference audio encoded), then `prepare(resolved voice) -> PreparedVoice
    or None`, run on the worker thread, one voice at a time, in arrival order (the thread starts with the
    first job: after the engine's CUDA graphs are captured)."""

    def __init__(self, resolve: Callable[[VoiceSpec], VoiceSpec],
                 prepare: Callable[[VoiceSpec], PreparedVoice | None]) -> None:
        self.resolve, self.prepare = resolve, prepare
        self.pending: dict[Hashable, Pending] = {}  # engine thread only
        self._jobs: queue.Queue[Pending] = queue.Queue()
        self._done: queue.Queue[Pending] = queue.Queue()
        self._thread: threading.Thread | None = None

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self.pending

    def __len__(self) -> int:
        return len(self.pending)

    def submit(self, job: Pending) -> None:
        self.pending[job.seq_id] = job
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="q3tts-reference", daemon=True)
            self._thread.start()
        self._jobs.put(job)

    def cancel(self, seq_id: Hashable) -> bool:
        """Drop a pending sequence (its encoding is skipped or its result ignored); False if not pending."""
        job = self.pending.pop(seq_id, None)
        if job is not None:
            job.aborted = True
        return job is not None

    def take(self, wait_s: float = 0.0) -> list[Pending]:
        """The jobs finished since the last call (waits up to `wait_s` for the first); they are no longer
        pending. Cancelled ones are not returned."""
        done = []
        try:
            done.append(self._done.get(timeout=wait_s) if wait_s > 0 else self._done.get_nowait())
            while True:
                done.append(self._done.get_nowait())
        except queue.Empty:
            pass
        done = [job for job in done if self.pending.get(job.seq_id) is job]
        for job in done:
            del self.pending[job.seq_id]
        return done

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if not job.aborted:
                try:
                    with torch.inference_mode():
                        job.result = self.resolve(job.voice)
                        job.prepared = self.prepare(job.result)
                except Exception as exc:  # noqa: BLE001 - the engine thread reports it as the request's error
                    job.result = exc
            self._done.put(job)
