"""`q3tts-client`: stream text to the Triton sequence model over gRPC and write the audio to a WAV.

    q3tts-client --url 127.0.0.1:8001 --text "Hello there." --speaker ryan --out hello.wav
    some_llm | q3tts-client --speaker ryan --out reply.wav          # stdin: each line is one text piece
    q3tts-client --text "Hello." --concurrency 8                     # quick load check

Prints time to first audio (TTFA: first request sent -> first audio response) and RTF (wall time / audio
seconds). No torch: tritonclient, numpy, soundfile only. `synthesize()` is reused by tests and perf/.
"""

from __future__ import annotations

import argparse
import itertools
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np
import tritonclient.grpc as grpcclient

from q3tts_client import protocol as P

_seq_ids = itertools.count((os.getpid() % 100000) * 1_000_000 + 1)


@dataclass
class Result:
    sequence_id: int
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


def start_inputs(text: str, speaker=None, language=None, instruct=None, ref_audio=None, ref_sample_rate=None,
                 ref_text=None) -> list:
    """Inputs of a START request: TEXT plus the voice fields that are set."""
    inputs = [_bytes_input(P.INPUT_TEXT, text)]
    for name, value in ((P.INPUT_SPEAKER, speaker), (P.INPUT_LANGUAGE, language),
                        (P.INPUT_INSTRUCT, instruct), (P.INPUT_REF_TEXT, ref_text)):
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

    def __init__(self, client, sid: int, voice: dict, params: dict) -> None:
        self.client, self.sid, self.voice, self.params = client, sid, voice, params
        self.fmt_name = P.AUDIO_FORMATS[params.get(P.PARAM_AUDIO_FORMAT, "float32")]
        self.res = Result(sid, np.zeros(0, np.float32))
        self.chunks: list[tuple[int, np.ndarray]] = []
        self.t0: float | None = None
        self.sent_end = threading.Event()
        self.cancelled = False

    def send(self, k: int, text: str, end: bool) -> None:
        """Request k of the sequence (k == 0 carries START, the voice and the parameters)."""
        first = k == 0
        if first:
            self.t0 = time.perf_counter()
        inputs = start_inputs(text, **self.voice) if first else [_bytes_input(P.INPUT_TEXT, text)]
        self.client.async_stream_infer(P.MODEL, inputs, request_id=f"{self.sid}-{k}", sequence_id=self.sid,
                                       sequence_start=first, sequence_end=end,
                                       parameters=self.params if first else None,
                                       enable_empty_final_response=True)
        self.res.requests += 1
        if end:
            self.sent_end.set()

    def feed(self, pieces: Iterable[str]) -> None:
        """Each piece as its own request as soon as it is produced, then an empty END."""
        k = -1
        for k, piece in enumerate(pieces):
            self.send(k, piece, end=False)
        if k < 0:  # no text at all: one START|END with empty text
            self.send(0, "", end=True)
        else:
            self.send(k + 1, "", end=True)

    def fold(self, t: float, result, on_chunk, cancel_after_chunks: int | None) -> None:
        """Fold one data/final response into the result."""
        res = self.res
        audio = result.as_numpy(self.fmt_name)
        if audio is not None and audio.size:
            if res.ttfa_s is None:
                res.ttfa_s = t - self.t0
            first = result.as_numpy(P.OUTPUT_FIRST_FRAME)
            self.chunks.append((int(first[0]) if first is not None else len(self.chunks), audio))
            res.first_frames.append(self.chunks[-1][0])
            res.chunk_frames.append(audio.size // P.SAMPLES_PER_FRAME)
            res.chunks += 1
            if on_chunk:
                on_chunk(res, sum(len(a) for _, a in self.chunks))
            if cancel_after_chunks is not None and res.chunks >= cancel_after_chunks:
                self.cancelled = True
                self.client.stop_stream(cancel_requests=True)
                return
        reason = result.as_numpy(P.OUTPUT_FINISH_REASON)
        if reason is not None:
            res.finish_reason = reason.reshape(-1)[0].decode()
        err = result.as_numpy(P.OUTPUT_ERROR)
        if err is not None:  # failed after audio had started (protocol.py)
            res.error = res.error or err.reshape(-1)[0].decode()
        sr = result.as_numpy(P.OUTPUT_SAMPLE_RATE)
        if sr is not None:
            res.sample_rate = int(sr[0])
        final = result.get_response().parameters.get("triton_final_response")
        if final is not None and final.bool_param:
            res.finals += 1

    def collect(self, events: queue.Queue, timeout_s: float, on_chunk, cancel_after_chunks) -> None:
        """Consume responses until every request has its final (or an error, cancel, timeout)."""
        res, deadline = self.res, time.monotonic() + timeout_s
        while not (self.sent_end.is_set() and res.finals >= res.requests):
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
            self.fold(t, result, on_chunk, cancel_after_chunks)
            if self.cancelled:
                return

    def audio(self) -> np.ndarray:
        """The chunks in FIRST_FRAME order, concatenated."""
        self.chunks.sort(key=lambda c: c[0])
        dtype = np.int16 if self.fmt_name == P.OUTPUT_AUDIO_INT16 else np.float32
        return np.concatenate([a for _, a in self.chunks]).astype(dtype) if self.chunks else np.zeros(0, dtype)


def synthesize(url: str, pieces: Iterable[str], voice: dict | None = None, params: dict | None = None,
               sequence_id: int | None = None, timeout_s: float = 300.0, on_chunk=None,
               cancel_after_chunks: int | None = None, client=None) -> Result:
    """Send `pieces` as one sequence (START on the first, END after the last) and collect the audio.

    `pieces` may be a generator (e.g. stdin lines): each piece is sent as soon as it is produced.
    `cancel_after_chunks` stops the stream with cancel_requests=True after that many audio chunks.
    """
    params = {k: v for k, v in (params or {}).items() if v is not None}
    own = client is None
    client = client or grpcclient.InferenceServerClient(url)
    session = _Session(client, sequence_id or next(_seq_ids), voice or {}, params)
    events: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: events.put((time.perf_counter(), result, error)))
    try:
        # NOTE: the common case (a list of text) is sent as ONE START|END request when it has one piece.
        if isinstance(pieces, (list, tuple)) and len(pieces) <= 1:
            session.send(0, pieces[0] if pieces else "", end=True)
        else:
            threading.Thread(target=session.feed, args=(pieces,), name="q3tts-client-feed", daemon=True).start()
        session.collect(events, timeout_s, on_chunk, cancel_after_chunks)
        session.res.total_s = time.perf_counter() - (session.t0 or time.perf_counter())
    finally:
        if not session.cancelled:  # gave up (timeout, error): cancel what is in flight instead of waiting on it
            client.stop_stream(cancel_requests=session.res.error is not None)
        if own:
            client.close()
    session.res.audio = session.audio()
    return session.res


def _stdin_pieces():
    for line in sys.stdin:
        line = line.rstrip("\n")
        if line.strip():
            yield line + " "


def _params(args) -> dict:
    return {"greedy": True if args.greedy else None, "seed": args.seed, "max_frames": args.max_frames,
            P.PARAM_TEXT_MODE: args.text_mode, P.PARAM_AUDIO_FORMAT: args.audio_format,
            P.PARAM_CHUNK_SCHEDULE: args.chunk_schedule}


def _voice(args) -> dict:
    voice = {"speaker": args.speaker, "language": args.language, "instruct": args.instruct,
             "ref_text": args.ref_text}
    if args.ref_audio:
        import soundfile as sf

        audio, sr = sf.read(args.ref_audio, dtype="float32", always_2d=True)
        voice.update(ref_audio=audio.mean(axis=1), ref_sample_rate=sr)
    return voice


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="q3tts-client", description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="127.0.0.1:8001", help="gRPC host:port of tritonserver")
    ap.add_argument("--text", default=None, help="the text (default: stdin, one piece per line)")
    ap.add_argument("--speaker", default=None)
    ap.add_argument("--language", default=None)
    ap.add_argument("--instruct", default=None)
    ap.add_argument("--ref-audio", default=None, help="reference WAV for voice cloning (Base models)")
    ap.add_argument("--ref-text", default=None, help="transcript of --ref-audio")
    ap.add_argument("--text-mode", default=None, choices=["whole", "incremental"])
    ap.add_argument("--greedy", action="store_true")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--max-frames", type=int, default=None)
    ap.add_argument("--audio-format", default=None, choices=sorted(P.AUDIO_FORMATS))
    ap.add_argument("--chunk-schedule", default=None, help="frames per response, e.g. 1,2,4,8")
    ap.add_argument("--out", default="out.wav", help="WAV to write (not with --concurrency: the load check keeps no audio)")
    ap.add_argument("--concurrency", type=int, default=1, help="N concurrent sequences of the same text")
    ap.add_argument("--timeout-s", type=float, default=600.0)
    args = ap.parse_args(argv)
    voice, params = _voice(args), _params(args)
    if args.concurrency > 1:
        return _load_check(args, voice, params)
    pieces = [args.text] if args.text is not None else _stdin_pieces()

    def progress(res, samples):
        print(f"\r  {res.chunks} chunks, {samples / P.SAMPLE_RATE:6.2f} s audio", end="", file=sys.stderr)

    res = synthesize(args.url, pieces, voice, params, timeout_s=args.timeout_s, on_chunk=progress)
    print(file=sys.stderr)
    if res.error:
        print(f"error: {res.error}", file=sys.stderr)
        return 1
    _write(args.out, res)
    print(f"wrote {args.out}: {res.audio_s:.2f} s at {res.sample_rate} Hz, {res.chunks} chunks, "
          f"finish={res.finish_reason}, TTFA {1000 * (res.ttfa_s or 0):.1f} ms, "
          f"RTF {res.rtf if res.rtf is not None else float('nan'):.3f}")
    return 0


def _write(path: str, res: Result) -> None:
    import soundfile as sf

    sf.write(path, res.audio, res.sample_rate, subtype="PCM_16" if res.audio.dtype == np.int16 else "FLOAT")


def _load_check(args, voice, params) -> int:
    text = args.text if args.text is not None else sys.stdin.read()
    results: list = [None] * args.concurrency
    t0 = time.perf_counter()

    def one(i):
        try:
            results[i] = synthesize(args.url, [text], voice, params, timeout_s=args.timeout_s)
        except Exception as e:  # noqa: BLE001 - one failed stream is counted, not a crash of the check
            results[i] = Result(-1, np.zeros(0, np.float32), error=f"client: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    errors = [r.error for r in results if r.error]
    ttfa = sorted(1000 * r.ttfa_s for r in results if r.ttfa_s is not None)
    audio = sum(r.audio_s for r in results)
    if ttfa:
        print(f"{args.concurrency} streams: TTFA p50 {ttfa[len(ttfa) // 2]:.1f} ms, max {ttfa[-1]:.1f} ms; "
              f"{audio:.2f} audio-s in {wall:.2f} s = {audio / wall:.2f} audio-s/s; errors {len(errors)}")
    for e in errors[:3]:
        print(f"error: {e}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
