"""Stream text to the Triton sequence model over gRPC and collect the audio: `synthesize()`.

The library under `q3tts-client` (client/cli.py), the server tests and perf/. No torch: tritonclient and
numpy only. One call = one sequence (correlation ID): START on the first text piece, END after the last;
audio responses are folded into a `Result` and, as they arrive, handed to `on_audio` (a file, stdout,
the speakers) and `on_chunk` (progress).
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np
import tritonclient.grpc as grpcclient

from q3tts_client import protocol as P

_seq_ids = itertools.count((os.getpid() % 100000) * 1_000_000 + 1)

OnChunk = Callable[["Result", int], None]  # (the result so far, samples received so far): progress
OnAudio = Callable[[np.ndarray, int], None]  # (one audio response's samples, sample rate), arrival order


@dataclass(frozen=True)
class Tls:
    """gRPC over TLS, as tritonclient takes it: PEM files, each optional (no root certificates = the
    system's; a private key and certificate chain = client authentication)."""

    root_certificates: str | None = None
    private_key: str | None = None
    certificate_chain: str | None = None


def connect(url: str, tls: Tls | None = None) -> grpcclient.InferenceServerClient:
    """A gRPC client of the tritonserver at `url` (host:port); over TLS when `tls` is given."""
    if tls is None:
        return grpcclient.InferenceServerClient(url)
    return grpcclient.InferenceServerClient(url, ssl=True, root_certificates=tls.root_certificates,
                                            private_key=tls.private_key,
                                            certificate_chain=tls.certificate_chain)


@dataclass
class Result:
    """One sequence's audio and how it went (TTFA: first request sent -> first audio response)."""

    sequence_id: int | str
    audio: np.ndarray  # float32 (or int16 with audio_format=int16), concatenated in FIRST_FRAME order
    sample_rate: int = P.SAMPLE_RATE
    finish_reason: str | None = None
    error: str | None = None
    ttfa_s: float | None = None
    total_s: float = 0.0
    chunks: int = 0
    finals: int = 0
    requests: int = 0
    chunk_frames: list = field(default_factory=list)  # frames per audio response, in arrival order
    first_frames: list = field(default_factory=list)  # FIRST_FRAME of each audio response, in arrival order
    sent_at: float | None = None  # time.perf_counter() of the first request (CLOCK_MONOTONIC on Linux)
    timing: dict | None = None  # the first audio response's TIMING, by protocol.TIMING_STAGES name

    @property
    def audio_s(self) -> float:
        return len(self.audio) / self.sample_rate

    @property
    def rtf(self) -> float | None:
        return self.total_s / self.audio_s if self.audio_s else None


def _bytes_input(name: str, value: str) -> grpcclient.InferInput:
    t = grpcclient.InferInput(name, [1], "BYTES")
    t.set_data_from_numpy(np.array([value.encode("utf-8")], dtype=object))
    return t


def start_inputs(text: str, **voice) -> list:
    """Inputs of a START request: TEXT plus the voice fields that are set (`voice_inputs`)."""
    return [_bytes_input(P.INPUT_TEXT, text), *voice_inputs(**voice)]


def voice_inputs(speaker=None, language=None, instruct=None, ref_audio=None, ref_sample_rate=None,
                 ref_text=None, voice=None) -> list:
    """The voice fields that are set, as inputs; `voice` names a registered voice (protocol.INPUT_VOICE)."""
    inputs = []
    for name, value in ((P.INPUT_SPEAKER, speaker), (P.INPUT_LANGUAGE, language),
                        (P.INPUT_INSTRUCT, instruct), (P.INPUT_REF_TEXT, ref_text), (P.INPUT_VOICE, voice)):
        if value:
            inputs.append(_bytes_input(name, value))
    if ref_audio is not None:
        a = grpcclient.InferInput(P.INPUT_REF_AUDIO, [len(ref_audio)], "FP32")
        a.set_data_from_numpy(np.asarray(ref_audio, np.float32))
        inputs.append(a)
        sr = grpcclient.InferInput(P.INPUT_REF_SAMPLE_RATE, [1], "INT32")
        sr.set_data_from_numpy(np.array([ref_sample_rate or P.SAMPLE_RATE], np.int32))
        inputs.append(sr)
    return inputs


class _Session:
    """One sequence on one gRPC stream: sends the pieces, folds the responses into a `Result`."""

    def __init__(self, client, sid: int | str, voice: dict, params: dict, on_chunk: OnChunk | None,
                 on_audio: OnAudio | None, cancel_after_chunks: int | None) -> None:
        self.client, self.sid, self.voice, self.params = client, sid, voice, params
        self.on_chunk, self.on_audio, self.cancel_after_chunks = on_chunk, on_audio, cancel_after_chunks
        self.fmt_name = P.AUDIO_FORMATS[params.get(P.PARAM_AUDIO_FORMAT, "float32")]
        self.res = Result(sid, np.zeros(0, np.float32))
        self.chunks: list[tuple[int, np.ndarray]] = []
        self.t0: float | None = None
        self.sent_end = threading.Event()
        self.send_error: Exception | None = None  # a send failed: no more responses will come
        self.cancelled = False

    def send(self, k: int, text: str, end: bool) -> None:
        """Request k of the sequence (k == 0 carries START, the voice and the parameters)."""
        first = k == 0
        if first:
            self.t0 = self.res.sent_at = time.perf_counter()
        inputs = start_inputs(text, **self.voice) if first else [_bytes_input(P.INPUT_TEXT, text)]
        self.client.async_stream_infer(P.MODEL, inputs, request_id=f"{self.sid}-{k}", sequence_id=self.sid,
                                       sequence_start=first, sequence_end=end,
                                       parameters=self.params if first else None,
                                       enable_empty_final_response=True)
        self.res.requests += 1
        if end:
            self.sent_end.set()

    def feed(self, pieces: Iterable[str]) -> None:
        """Each piece as its own request as soon as it is produced, then an empty END; a list of at most
        one piece is ONE START|END request (the common case). Never raises: a failed send (a broken
        stream) is kept in `send_error`, and `collect` reports the cause the stream callback gives."""
        try:
            if isinstance(pieces, (list, tuple)) and len(pieces) <= 1:
                self.send(0, pieces[0] if pieces else "", end=True)
                return
            k = -1
            for k, piece in enumerate(pieces):
                self.send(k, piece, end=False)
            self.send(k + 1, "", end=True)  # k = -1 (no text at all): one START|END with empty text
        except Exception as e:  # noqa: BLE001 - reported as the sequence's error, not a crash of the caller
            self.send_error = e
            self.sent_end.set()

    def fold(self, t: float, result) -> None:
        """Fold one data/final response into the result."""
        res = self.res
        sr = result.as_numpy(P.OUTPUT_SAMPLE_RATE)
        if sr is not None:
            res.sample_rate = int(sr[0])
        audio = result.as_numpy(self.fmt_name)
        if audio is not None and audio.size:
            self._audio(t, audio, result.as_numpy(P.OUTPUT_FIRST_FRAME))
            if self.cancelled:
                return
        timing = result.as_numpy(P.OUTPUT_TIMING)
        if timing is not None:
            res.timing = dict(zip(P.TIMING_STAGES, timing.astype(float).tolist()))
        reason = result.as_numpy(P.OUTPUT_FINISH_REASON)
        if reason is not None:
            res.finish_reason = reason.reshape(-1)[0].decode()
        err = result.as_numpy(P.OUTPUT_ERROR)
        if err is not None:  # failed after audio had started (protocol.py)
            res.error = res.error or err.reshape(-1)[0].decode()
        final = result.get_response().parameters.get("triton_final_response")
        if final is not None and final.bool_param:
            res.finals += 1

    def _audio(self, t: float, audio: np.ndarray, first: np.ndarray | None) -> None:
        """One audio response: record it, hand it to the hooks, cancel after `cancel_after_chunks`."""
        res = self.res
        if res.ttfa_s is None:
            res.ttfa_s = t - self.t0
        self.chunks.append((int(first[0]) if first is not None else len(self.chunks), audio))
        res.first_frames.append(self.chunks[-1][0])
        res.chunk_frames.append(audio.size // P.SAMPLES_PER_FRAME)
        res.chunks += 1
        if self.on_audio:
            self.on_audio(audio, res.sample_rate)
        if self.on_chunk:
            self.on_chunk(res, sum(len(a) for _, a in self.chunks))
        if self.cancel_after_chunks is not None and res.chunks >= self.cancel_after_chunks:
            self.cancelled = True
            self.client.stop_stream(cancel_requests=True)

    def collect(self, events: queue.Queue, timeout_s: float) -> None:
        """Consume responses until every request has its final (or an error, cancel, timeout)."""
        res, deadline = self.res, time.monotonic() + timeout_s
        while not (self.sent_end.is_set() and (res.finals >= res.requests or self.send_error)):
            try:
                t, result, error = events.get(timeout=max(0.01, min(0.5, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() > deadline:
                    res.error = f"timed out after {timeout_s:.0f} s"
                    return
                continue
            if error is not None:
                res.error = res.error or str(error)
                res.finals += 1
                if "CANCELLED" in str(error) or self.cancelled:
                    return
                continue
            self.fold(t, result)
            if self.cancelled:
                return
        if self.send_error is not None and res.error is None:
            res.error = self._stream_error(events) or f"sending a request failed: {self.send_error}"

    @staticmethod
    def _stream_error(events: queue.Queue, wait_s: float = 2.0) -> str | None:
        """The stream callback's error that broke the stream (it may come just after a send failed)."""
        deadline = time.monotonic() + wait_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                error = events.get(timeout=left)[2]
            except queue.Empty:
                return None
            if error is not None:
                return str(error)
        return None

    def audio(self) -> np.ndarray:
        """The chunks in FIRST_FRAME order, concatenated."""
        self.chunks.sort(key=lambda c: c[0])
        dtype = np.int16 if self.fmt_name == P.OUTPUT_AUDIO_INT16 else np.float32
        return np.concatenate([a for _, a in self.chunks]).astype(dtype) if self.chunks else np.zeros(0, dtype)


def synthesize(url: str, pieces: Iterable[str], voice: dict | None = None, params: dict | None = None,
               sequence_id: int | str | None = None, timeout_s: float = 300.0, on_chunk: OnChunk | None = None,
               cancel_after_chunks: int | None = None, client=None, on_audio: OnAudio | None = None,
               tls: Tls | None = None) -> Result:
    """Send `pieces` as one sequence (START on the first, END after the last) and collect the audio.

    `pieces` may be a generator (e.g. stdin lines): each piece is sent as soon as it is produced.
    sequence_id: the correlation ID, an integer or a string (default: a fresh integer).
    `cancel_after_chunks` stops the stream with cancel_requests=True after that many audio chunks; so
    does an exception raised by `on_chunk` / `on_audio`, which then propagates.
    `client`: an open `connect()` client to use (and leave open); else one to `url` (over `tls`).
    """
    params = {k: v for k, v in (params or {}).items() if v is not None}
    own = client is None
    client = client or connect(url, tls)
    session = _Session(client, sequence_id or next(_seq_ids), voice or {}, params, on_chunk, on_audio,
                       cancel_after_chunks)
    events: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: events.put((time.perf_counter(), result, error)))
    done = False
    try:
        if isinstance(pieces, (list, tuple)):
            session.feed(pieces)
        else:  # a generator may wait on its producer: the responses are collected meanwhile
            threading.Thread(target=session.feed, args=(pieces,), name="q3tts-client-feed",
                             daemon=True).start()
        session.collect(events, timeout_s)
        session.res.total_s = time.perf_counter() - (session.t0 or time.perf_counter())
        done = True
    finally:
        if not session.cancelled:  # gave up (timeout, error, a hook raised): cancel what is in flight
            client.stop_stream(cancel_requests=not done or session.res.error is not None)
        if own:
            client.close()
    session.res.audio = session.audio()
    return session.res
