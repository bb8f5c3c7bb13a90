"""The endpoint's side of Triton: one speech request = one sequence of the sequence model over gRPC.

Each sequence runs `q3tts_client.stream_client.synthesize` (the client library's streaming code) on a worker
thread with a pooled, already connected gRPC client; its `on_audio` hook hands every audio response to the
request's asyncio queue as it arrives. A request whose HTTP client goes away is aborted on the server with
the protocol's abort parameter (a START|END request with `abort=true` for the same correlation ID), so its
engine slot and KV pages are freed at the next step instead of when the audio would have ended.

Refusals carry the HTTP status the endpoint answers with. Stream errors reach a gRPC client as text only
(no status code), so `http_status` reads the server's messages, whose wording the server owns.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from q3tts_client import protocol as P
from q3tts_client.stream_client import connect, start_inputs, synthesize
from q3tts_client.voices import VoicesClient, VoicesError

# what the server says (in its error text) -> the HTTP status; first match wins, anything else is a 400
STATUS_BY_MESSAGE = (
    ("is not registered", 404), ("unknown speaker", 404),
    ("wait queue full", 429),
    ("shutting down", 503), ("unavailable", 503), ("failed to connect", 503), ("connect failed", 503),
    ("connection refused", 503), ("timed out", 503), ("socket closed", 503),
    ("internal error", 500), ("engine step failed", 500),
)
log = logging.getLogger("q3tts.openai")


def http_status(message: str) -> int:
    low = message.lower()
    return next((status for text, status in STATUS_BY_MESSAGE if text in low), 400)


class Refusal(Exception):
    """The request cannot be served: `status` is the HTTP status, the text says why."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


class SpeechStream:
    """One sequence's audio as an async iterator of int16 arrays; `close()` aborts it if unfinished."""

    _END = object()

    def __init__(self, bridge: TritonBridge, sequence_id: int):
        self.bridge, self.sequence_id = bridge, sequence_id
        self.chunks: asyncio.Queue = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.client = None  # the pooled client while the sequence runs (the abort goes on its stream)
        self.lock = threading.Lock()
        self.done = False
        self.frames = 0  # frames of the chunks taken so far (the first one included)
        self.first_audio_s: float | None = None  # synthesize called -> its first audio (Server-Timing)

    def run(self, text: str, voice: dict, params: dict) -> None:
        """The worker thread: synthesize, pushing chunks, then the outcome."""
        with self.lock:
            self.client = self.bridge.take_client()
        outcome, t0 = self._END, time.perf_counter()

        def on_audio(audio, _rate):
            if self.first_audio_s is None:
                self.first_audio_s = time.perf_counter() - t0
            self._push(audio)

        try:
            res = synthesize(self.bridge.url, [text], voice, {**params, P.PARAM_AUDIO_FORMAT: "int16"},
                             sequence_id=self.sequence_id, client=self.client, on_audio=on_audio)
            if res.error and res.finish_reason != "aborted":
                outcome = Refusal(http_status(res.error), res.error)
        except Exception as e:  # noqa: BLE001 - a broken connection is one refusal, not a crash of the app
            outcome = Refusal(503, f"the Triton server at {self.bridge.url} failed: {e}")
        finally:
            with self.lock:
                self.done = True
                self.bridge.give_client(self.client)
                self.client = None
            self._push(outcome)

    def _push(self, item) -> None:
        self.loop.call_soon_threadsafe(self.chunks.put_nowait, item)

    def __aiter__(self):
        return self

    async def __anext__(self) -> np.ndarray:
        item = await self.chunks.get()
        if item is self._END:
            raise StopAsyncIteration
        if isinstance(item, Refusal):
            raise item
        self.frames += item.size // P.SAMPLES_PER_FRAME
        return item

    def close(self) -> None:
        """Abort the sequence on the server unless it already ended (the HTTP client went away)."""
        with self.lock:
            if self.done or self.client is None:
                return
            self.client.async_stream_infer(P.MODEL, start_inputs(""), sequence_id=self.sequence_id,
                                           sequence_start=True, sequence_end=True,
                                           parameters={P.PARAM_ABORT: True}, enable_empty_final_response=True)
            self.done = True
            self.bridge.aborted += 1
        log.info("the HTTP client went away: sequence %s aborted", self.sequence_id)


class TritonBridge:
    """The Triton server at `url`: pooled gRPC clients, at most `max_streams` speech requests at once."""

    def __init__(self, url: str, max_streams: int = 64):
        self.url, self.max_streams = url, max_streams
        self.pool: queue.SimpleQueue = queue.SimpleQueue()
        self.executor = ThreadPoolExecutor(max_streams + 2, thread_name_prefix="q3tts-openai")
        self.slots = threading.BoundedSemaphore(max_streams)
        self._ids = itertools.count((os.getpid() % 100000) * 1_000_000 + 500_001)
        self._catalogue: dict | None = None
        self.aborted = 0  # sequences aborted because their HTTP client went away

    def take_client(self):
        try:
            return self.pool.get_nowait()
        except queue.Empty:
            return connect(self.url)

    def give_client(self, client) -> None:
        self.pool.put(client)

    async def speak(self, text: str, voice: dict, params: dict) -> tuple[SpeechStream, np.ndarray]:
        """Start one sequence and wait for its first audio: (the stream, the first chunk). Raises Refusal
        (429 when `max_streams` requests are already running) before anything is sent to the HTTP client."""
        if not self.slots.acquire(blocking=False):
            raise Refusal(429, f"this endpoint is already serving {self.max_streams} requests; retry later")
        stream = SpeechStream(self, next(self._ids))
        future = asyncio.get_running_loop().run_in_executor(self.executor, stream.run, text, voice, params)
        future.add_done_callback(lambda _: self.slots.release())
        try:
            first = await stream.__anext__()
        except StopAsyncIteration:
            first = np.zeros(0, np.int16)
        except BaseException:
            stream.close()
            raise
        return stream, first

    async def catalogue(self, refresh: bool = False) -> dict:
        """The server's variant, speakers and registered voices, as last read (read again with `refresh`:
        a name missing from it, GET /v1/audio/voices). A voice removed since is refused by the server."""
        if refresh or self._catalogue is None:
            self._catalogue = await asyncio.get_running_loop().run_in_executor(self.executor, self._fetch_catalogue)
        return self._catalogue

    def _fetch_catalogue(self) -> dict:
        client = self.take_client()
        try:
            return VoicesClient(self.url, client=client).catalogue()
        except VoicesError as e:
            raise Refusal(503, f"the voices of the Triton server at {self.url} cannot be read: {e}") from None
        finally:
            self.give_client(client)

    def ready(self) -> bool:
        client = self.take_client()
        try:
            return bool(client.is_model_ready(P.MODEL))
        except Exception:  # noqa: BLE001 - unreachable is not ready
            return False
        finally:
            self.give_client(client)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        while not self.pool.empty():
            self.pool.get_nowait().close()
