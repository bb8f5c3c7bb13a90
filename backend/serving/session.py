"""One sequence (correlation ID) of the sequence model, and the table of live ones.

Every request gets exactly one FINAL, and only this module sends one (`Reply.end`, asserted once):
- `Session.close(reason, error)` is the only way a sequence ends: its open request (under ack_pieces: the
  next one) gets the sequence's last response, i.e. the buffered audio with FINISH_REASON, or the error;
- `Session.attach` ends a request that hands over: superseded by the sequence's next request (audio
  continues on the newest one), acknowledged at once (ack_pieces), or arriving after the sequence ended;
- `refuse` answers a request that opens no session (bad input, unknown sequence, admission) with one error.
"""

from __future__ import annotations

import functools
import math
import queue
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from q3tts_client import protocol as P
from q3tts.serving import request as R
from q3tts.serving.chunker import Chunk, Chunker
from q3tts.serving.commands import SessionOptions

# close() reasons that are errors -> their TritonError code; the others (eos, max_frames, aborted) end normally
ERROR_CODES = {"cancelled": "CANCELLED", "unavailable": "UNAVAILABLE", "error": "INTERNAL"}
DISCARD_AUDIO = ("aborted", "cancelled")  # the client asked to stop: buffered audio is not sent


class Reply:
    """One request's response stream: data responses, then one FINAL. Each response is queued (`out`) as the
    function that builds it, for its sequence's response thread, which builds it and is the only caller of
    `sender.send` (building 64 responses after a step no longer holds the engine thread)."""

    def __init__(self, sender, out: queue.Queue, key: Any = None):
        self.sender, self.out, self.key = sender, out, key
        self.done = False
        self.sent_data = False
        self.last_cancel_check = time.monotonic()  # the last is_cancelled() query

    def send(self, build: Callable[[], Any]) -> None:
        """Queue a data response; `build()` makes it on the response thread."""
        assert not self.done, "response after FINAL"
        self.sent_data = True
        self.out.put((self, build, False))

    def end(self, build: Callable[[], Any] | None = None) -> None:
        """Queue the FINAL; `build()` makes its response on the response thread (None: a FINAL flag alone)."""
        assert not self.done, "second FINAL for one request"
        self.done = True
        self.out.put((self, build, True))

    def cancelled(self) -> bool:
        return self.sender.is_cancelled()

    def check_cancelled(self, now: float, every_s: float) -> bool:
        """`cancelled()`, asked at most once per `every_s` (each query is a round trip to the server, which
        would hold up the responses queued behind it); False between queries."""
        if now - self.last_cancel_check <= every_s:
            return False
        self.last_cancel_check = now
        return self.cancelled()


def refuse(reply: Reply, code: str, message: str, metrics=None) -> None:
    """End a request that opens no session with one error naming the problem."""
    if metrics is not None:
        metrics.failed(code)
    reply.end(functools.partial(R.error_response, code, message, after_audio=reply.sent_data))


@dataclass
class Session:
    """A live sequence: its options, the engine sequence behind it, its open request and audio buffer."""

    key: Any
    engine_id: int
    options: SessionOptions
    started_at: float
    metrics: Any = None  # ServingMetrics (TTFA, audio seconds) or None
    reply: Reply | None = None  # the open request: audio streams on it
    ended: bool = False  # END received: Triton has closed the sequence
    outcome: tuple[str, str | None] | None = None  # (reason, error) once closed
    finished: bool = False  # the outcome was delivered: nothing more goes out
    last_request: float = 0.0
    stamps: dict[str, float] = field(default_factory=dict)  # time.monotonic() per TIMING stage (first frame)
    chunker: Chunker = field(init=False)

    def __post_init__(self) -> None:
        self.chunker = Chunker(self.options.chunk_schedule, self.options.audio_format)
        self.last_request = self.started_at

    def attach(self, reply: Reply, end: bool) -> None:
        """A request of this sequence arrived (START included): it becomes the open request and the previous
        one ends with an empty FINAL, unless ack_pieces acknowledges it at once or the sequence is over."""
        reply.key = self.key
        if self.finished or (self.options.ack_pieces and not end):
            reply.end()
            return
        if self.reply is not None:
            self.reply.end()  # superseded: audio continues on the newest request
        self.reply = reply
        if self.outcome is not None:  # it ended while no request was open (ack_pieces)
            self._deliver()
        elif self.chunker.ready:
            self._send(self.chunker.take())

    def feed(self, pcm, last: bool = False, stamps: dict[str, float] | None = None) -> None:
        """One engine output's PCM: buffered, and sent once the chunk schedule's next size is reached (the
        sequence's `last` output stays buffered for the closing response). `stamps`: the first frame's."""
        self.stamps.update(stamps or {})
        self.chunker.add(pcm)
        if self.reply is not None and self.chunker.ready and not last:
            self._send(self.chunker.take())

    def close(self, reason: str, error: str | None = None) -> None:
        """End the sequence (the first call decides). Normal reasons (eos, max_frames, aborted) send the
        buffered audio with FINISH_REASON; error reasons (ERROR_CODES) send it, unless the client asked to
        stop, then `error`. Goes out on the open request, or on the next one when none is open."""
        assert (reason in ERROR_CODES) == (error is not None), f"close({reason!r}, {error!r})"
        if self.outcome is None:
            self.outcome = (reason, error)
            if self.reply is not None:
                self._deliver()

    def _deliver(self) -> None:
        reason, error = self.outcome
        chunk = None if reason in DISCARD_AUDIO else self.chunker.take()
        reply, self.reply, self.finished = self.reply, None, True
        if error is None:
            self._observe(chunk)
            reply.end(self._builder(chunk, finish_reason=reason))
        else:
            if chunk is not None:
                self._send(chunk, reply)
            reply.end(functools.partial(R.error_response, ERROR_CODES[reason], f"sequence {self.key}: {error}",
                                        after_audio=reply.sent_data))
            if self.metrics is not None:
                self.metrics.failed(ERROR_CODES[reason])
        if self.metrics is not None:
            self.metrics.audio_seconds.increment(self.chunker.frames_sent * P.FRAME_SECONDS)

    def _send(self, chunk: Chunk, reply: Reply | None = None) -> None:
        self._observe(chunk)
        (reply or self.reply).send(self._builder(chunk))

    def _builder(self, chunk: Chunk | None, finish_reason: str | None = None) -> Callable[[], Any]:
        """The function that builds the audio response of `chunk` on the response thread (the stamps as they
        are now: the first response's TIMING)."""
        stamps = dict(self.stamps) if chunk is not None and chunk.first_frame == 0 else None
        return lambda: R.audio_response(chunk, finish_reason=finish_reason, timing=self._timing(stamps))

    def _timing(self, stamps: dict[str, float] | None) -> np.ndarray | None:
        """TIMING (protocol.TIMING_STAGES) of the sequence's first audio response (`stamps`; None: not the
        first): the arrival, then each stamp as seconds since it (NaN where one is missing; response_built =
        now, on the response thread), then the device seconds."""
        if stamps is None:
            return None
        stamps = {**stamps, "response_built": time.monotonic()}
        values = [stamps.get(name, math.nan) - (0.0 if name.endswith("_device") else self.started_at)
                  for name in P.TIMING_STAGES[1:]]
        return np.array([self.started_at, *values], np.float64)

    def _observe(self, chunk: Chunk | None) -> None:
        """Time to first audio: START received -> the first audio response queued."""
        if chunk is not None and chunk.first_frame == 0 and self.metrics is not None:
            self.metrics.ttfa.observe(time.monotonic() - self.started_at)


class SessionTable:
    """The live sessions by correlation ID and by engine id, and why recently closed IDs were closed (a late
    request of a closed sequence is told why, not 'send START first')."""

    def __init__(self) -> None:
        self._by_key: dict[Any, Session] = {}
        self._running: dict[int, Session] = {}  # engine id -> session the engine still holds
        self._why: dict[Any, tuple[str, float]] = {}  # key -> (why it was closed, when)

    def __len__(self) -> int:
        return len(self._by_key)

    def sessions(self) -> list[Session]:
        return list(self._by_key.values())

    def get(self, key) -> Session | None:
        return self._by_key.get(key)

    def running(self, engine_id: int) -> Session | None:
        return self._running.get(engine_id)

    def add(self, session: Session) -> None:
        assert session.key not in self._by_key, f"sequence {session.key} is already open"
        self._by_key[session.key] = session
        self._running[session.engine_id] = session
        self._why.pop(session.key, None)

    def is_running(self, session: Session) -> bool:
        return self._running.get(session.engine_id) is session

    def stop(self, session: Session) -> bool:
        """The engine no longer holds the session; returns whether it did until now."""
        return self._running.pop(session.engine_id, None) is not None

    def remove(self, session: Session, why: str | None = None) -> None:
        """Forget the session; `why` is what later requests of its ID are told."""
        self.stop(session)
        if self._by_key.get(session.key) is session:
            del self._by_key[session.key]
        if why is not None:
            self.note(session.key, why)

    def note(self, key, why: str) -> None:
        self._why[key] = (why, time.monotonic())

    def why(self, key) -> str | None:
        return self._why.get(key, (None, 0.0))[0]

    def forget_why(self, key) -> None:
        self._why.pop(key, None)

    def expire(self, before: float) -> None:
        """Drop the reasons recorded before `before` (Triton has expired those IDs by then)."""
        for key in [k for k, (_, t) in self._why.items() if t < before]:
            del self._why[key]
