"""What `execute()` and the response thread hand to the engine thread: one typed command per event, through a
`CommandQueue`.

The engine thread applies them in arrival order, which keeps each sequence's requests ordered. No pb_utils
here.
"""

from __future__ import annotations

import queue
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from q3tts_client import protocol as P
from q3tts.core import SamplingParams, VoiceSpec

if TYPE_CHECKING:
    from q3tts.serving.session import Reply


@dataclass(frozen=True)
class SessionOptions:
    """What a START request fixes for the whole sequence."""

    voice: VoiceSpec
    sampling: SamplingParams
    audio_format: str = "float32"
    chunk_schedule: tuple[int, ...] = P.DEFAULT_CHUNK_SCHEDULE
    ack_pieces: bool = False  # non-END requests get their FINAL at once; audio streams on the END request
    voice_name: str | None = None  # the VOICE input: a registered voice, resolved on START (`voice` keeps
    # only its language / text_mode / xvector_only)


@dataclass(frozen=True)
class Received:
    """A command made from one request: `reply` and `at` are filled in by EngineLoop.submit."""

    reply: Reply | None = field(default=None, kw_only=True)
    at: float = field(default=0.0, kw_only=True)  # time.monotonic() when execute() received it


@dataclass(frozen=True)
class Start(Received):
    """A START request: opens sequence `key` (restarting a live one) with its first text piece."""

    key: Any  # correlation ID (int or str)
    text: str
    end: bool  # START|END: the whole utterance in one request
    options: SessionOptions


@dataclass(frozen=True)
class Append(Received):
    """A later request of sequence `key`: one more text piece (`end`: the last one)."""

    key: Any
    text: str
    end: bool


@dataclass(frozen=True)
class Abort(Received):
    """A request with protocol.PARAM_ABORT: drop sequence `key` now (its open request ends 'aborted')."""

    key: Any
    end: bool


@dataclass(frozen=True)
class Refuse(Received):
    """A request the parser could not read: it gets one clear error. Its START/END flags still open or close
    the sequence in Triton, so a live session of `key` is closed and later requests are told why."""

    key: Any
    start: bool
    end: bool
    message: str


@dataclass(frozen=True)
class Cancel:
    """The response thread saw the client cancel the request answered by `reply`."""

    key: Any
    reply: Reply


@dataclass(frozen=True)
class Shutdown:
    """finalize(): close every session, then stop the engine thread."""


Command = Start | Append | Abort | Refuse | Cancel | Shutdown


class CommandQueue:
    """The engine thread's commands in arrival order, and a file (`fileno`) that is readable while some wait, so
    that the engine thread can sleep on it and on the engine process's answer at once instead of polling."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._readable, self._signal = socket.socketpair()
        for end in (self._readable, self._signal):
            end.setblocking(False)

    def put(self, cmd: Command) -> None:
        self._queue.put(cmd)
        try:
            self._signal.send(b"\0")
        except BlockingIOError:  # full of signals already: readable anyway
            pass

    def take(self, timeout_s: float = 0.0) -> list[Command]:
        """Everything queued; waits up to timeout_s for the first one when none is."""
        self._clear()  # first: a command put while this drains signals again
        cmds = []
        if timeout_s > 0:
            try:
                cmds.append(self._queue.get(timeout=timeout_s))
            except queue.Empty:
                pass
        while True:
            try:
                cmds.append(self._queue.get_nowait())
            except queue.Empty:
                return cmds

    def empty(self) -> bool:
        return self._queue.empty()

    def fileno(self) -> int:
        return self._readable.fileno()

    def close(self) -> None:
        self._readable.close()
        self._signal.close()

    def _clear(self) -> None:
        try:
            while self._readable.recv(4096):
                pass
        except BlockingIOError:
            pass
