"""The Triton python-backend models: `TritonPythonModel` (the sequence model `qwen3_tts`) and
`OneShotModel` (`qwen3_tts_oneshot`, a BLS relay for HTTP generate_stream). The only module that imports
`triton_python_backend_utils`.

Threads (style rule 6): `execute()` validates and enqueues, then returns None. One engine thread owns the
Engine and the sessions (commands are applied in arrival order, which keeps each sequence ordered), one
response thread owns every `sender.send`. Every request is answered through its `Reply`, which sends
exactly one FINAL on every path (success, superseded, bad input, engine error, cancel, idle, shutdown).

Audio routing (see client/protocol.py): audio streams on the sender of the sequence's most recent request;
a request that is superseded by the next one of its sequence gets an empty FINAL first. With `ack_pieces`
every non-END request is answered at once and the audio streams on the END request.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import json
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from q3tts_client import protocol as P
from q3tts.core import AdmissionRejected, EngineError, InvalidRequest
from q3tts.serving.metrics import ServingMetrics
from q3tts.serving.request import FLAG_END, FLAG_START, BadRequest, Piece, SessionOptions, parse_request

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
TICK_S = 0.2  # engine thread housekeeping: cancellations, idle GC, metrics, open-sequence file
IDLE_MARGIN_S = 1.0


def log(level: str, msg: str) -> None:
    getattr(pb_utils.Logger, f"log_{level}")(f"[q3tts] {msg}")


def triton_error(code_name: str, msg: str):
    code = getattr(pb_utils.TritonError, code_name, None)
    return pb_utils.TritonError(msg) if code is None else pb_utils.TritonError(msg, code)


class Reply:
    """One request's response stream; `finish`/`fail` may be called once (asserted), `audio` before that."""

    def __init__(self, sender, out: queue.Queue, key: Any = None):
        self.sender, self.out, self.key, self.done, self.sent_data = sender, out, key, False, False

    def send(self, response) -> None:
        assert not self.done, "response after FINAL"
        self.sent_data = True
        self.out.put((self, response, 0))

    def finish(self, response=None) -> None:
        assert not self.done, "second FINAL for one request"
        self.done = True
        self.out.put((self, response, FINAL))

    def fail(self, code_name: str, msg: str) -> None:
        if self.sent_data:
            # NOTE: once audio went out, the request ends with a data response (FINISH_REASON + ERROR), not
            # a TritonError: in Triton 2.51 an error response after data responses breaks a BLS response
            # iterator (the one-shot relay hung or leaked, and the model could not unload).
            reason = "cancelled" if code_name == "CANCELLED" else "error"
            self.finish(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor(P.OUTPUT_FINISH_REASON, np.array([reason.encode()], object)),
                pb_utils.Tensor(P.OUTPUT_ERROR, np.array([msg.encode()], object))]))
        else:
            self.finish(pb_utils.InferenceResponse(error=triton_error(code_name, msg)))


@dataclass
class Session:
    key: Any
    engine_id: int
    reply: Reply | None
    options: SessionOptions
    t_start: float
    last_request: float
    ended: bool = False  # END received: Triton has closed the sequence
    finished: str | None = None  # engine finish reason (the sequence's last response was sent)
    buffer: list = field(default_factory=list)  # pcm arrays not yet sent
    buffered_frames: int = 0
    frames_sent: int = 0
    chunks_sent: int = 0
    first_audio_at: float | None = None
    last_check: float = 0.0
    pending: tuple | None = None  # (reason, error) of an engine finish that waits for a request (ack_pieces)


class ServingCore:
    """Engine thread + response thread + session table. pb_utils reaches it only through Reply/responses."""

    def __init__(self, engine_fn, default_schedule, idle_s: float, state_file: Path | None, metrics=None):
        self.commands: queue.Queue = queue.Queue()
        self.responses: queue.Queue = queue.Queue()
        self.default_schedule = default_schedule
        self.idle_s = idle_s
        self.state_file = state_file
        self.metrics = metrics
        self.sessions: dict[Any, Session] = {}
        self.by_engine_id: dict[int, Session] = {}
        self.closed: dict[Any, tuple[str, float]] = {}  # key -> (why, when): answered without a session
        self.triton_open: dict[Any, float] = {}  # keys Triton still holds (START seen, no END, not idle)
        self._ids = itertools.count(1)
        self._engine_fn = engine_fn
        self.engine = None
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._last_tick = 0.0
        self._open_written: list | None = None
        self.engine_thread = threading.Thread(target=self._engine_loop, name="q3tts-engine", daemon=True)
        self.response_thread = threading.Thread(target=self._response_loop, name="q3tts-responses", daemon=True)

    # --- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        self.response_thread.start()
        self.engine_thread.start()
        self._started.wait()
        if self._start_error is not None:  # the thread cannot raise into initialize: pass it back
            self.responses.put(None)
            self.response_thread.join()
            raise self._start_error

    def shutdown(self) -> None:
        """Reverse order: engine thread (aborts and answers every session), then the response thread."""
        self.commands.put(("shutdown",))
        self.engine_thread.join()
        self.responses.put(None)
        self.response_thread.join()

    # --- called from execute() ----------------------------------------------------------------------
    def submit(self, request, sender) -> None:
        reply = Reply(sender, self.responses)
        now = time.monotonic()
        try:
            piece = parse_request(request, self.default_schedule)
        except Exception as e:  # noqa: BLE001 - whatever the parser could not read gets one clear error
            msg = str(e) if isinstance(e, BadRequest) else f"could not read the request: {type(e).__name__}: {e}"
            flags = int(request.flags())
            key = request.correlation_id()
            self.commands.put(("bad", key, reply, msg, bool(flags & FLAG_START), bool(flags & FLAG_END), now))
            return
        self.commands.put(("piece", piece, reply, now))

    # --- engine thread ------------------------------------------------------------------------------
    def _engine_loop(self) -> None:
        try:
            self.engine = self._engine_fn()
        except BaseException as e:
            self._start_error = e
            self._started.set()
            return
        self._started.set()
        log("info", "engine thread started")
        while True:
            busy = self.engine.has_work()
            try:
                cmds = [self.commands.get(timeout=0 if busy else TICK_S)] if not busy else []
            except queue.Empty:
                cmds = []
            while True:
                try:
                    cmds.append(self.commands.get_nowait())
                except queue.Empty:
                    break
            for cmd in cmds:
                if cmd[0] == "shutdown":
                    self._close_all("UNAVAILABLE", "the server is shutting down")
                    log("info", "engine thread stopped")
                    return
                try:
                    self._apply(cmd)
                except Exception as e:  # never let one request kill the engine thread
                    log("error", f"command {cmd[0]} failed: {traceback.format_exc()}")
                    reply = next((c for c in cmd if isinstance(c, Reply)), None)
                    if reply is not None and not reply.done:
                        reply.fail("INTERNAL", f"internal error: {type(e).__name__}: {e}")
            cmds = cmd = reply = None  # hold no sender past its FINAL (see _response_loop)
            now = time.monotonic()
            if now - self._last_tick >= TICK_S:
                self._last_tick = now
                try:
                    self._tick(now)
                except Exception:
                    log("error", f"tick failed: {traceback.format_exc()}")
            if self.engine.has_work():
                try:
                    outputs = self.engine.step()
                except Exception as e:  # an engine bug: fail every live session, keep serving
                    log("error", f"engine step failed: {traceback.format_exc()}")
                    self._close_all("INTERNAL", f"engine step failed: {e}")
                    continue
                for out in outputs:
                    try:
                        self._route(out)
                    except Exception as e:
                        log("error", f"routing output of {out.seq_id} failed: {traceback.format_exc()}")
                        s = self.by_engine_id.get(out.seq_id)
                        if s is not None:
                            self._drop(s.key, "INTERNAL", f"internal error: {type(e).__name__}: {e}",
                                       why="it failed with an internal error")

    def _apply(self, cmd) -> None:
        kind = cmd[0]
        if kind == "piece":
            _, piece, reply, now = cmd
            if piece.abort:  # the open request ends normally, with FINISH_REASON "aborted"
                self._drop(piece.key, None, "aborted by an abort request", why="it was aborted")
                if piece.end:
                    self.triton_open.pop(piece.key, None)
                reply.finish()
            elif piece.start:
                self._start(piece, reply, now)
            else:
                self._append(piece, reply, now)
        elif kind == "bad":
            _, key, reply, msg, start, end, now = cmd
            self._reject(reply, "INVALID_ARG", msg)
            if start:  # Triton opened the sequence: later requests get a clear error, not "unknown"
                self._drop(key, "CANCELLED", "a new START request with invalid input replaced it",
                           why=f"its START request was invalid: {msg}")
                self.triton_open[key] = now
            if end:
                self._drop(key, "CANCELLED", f"its END request was invalid: {msg}")
                self.closed.pop(key, None)
                self.triton_open.pop(key, None)
        elif kind == "cancel":
            _, key, reply = cmd
            s = self.sessions.get(key)
            if s is not None and s.reply is reply and not reply.done:
                self._drop(key, "CANCELLED", "the request was cancelled", why="it was cancelled")

    def _reject(self, reply: Reply, code: str, msg: str) -> None:
        if self.metrics:
            self.metrics.rejected.increment(1)
        reply.fail(code, msg)

    def _start(self, piece: Piece, reply: Reply, now: float) -> None:
        key = piece.key
        self._drop(key, "CANCELLED", f"sequence {key} was restarted by a new START request")
        self.closed.pop(key, None)
        self.triton_open[key] = now
        if piece.end:
            self.triton_open.pop(key)
        engine_id = next(self._ids)
        o = piece.options
        try:
            self.engine.add(engine_id, o.voice, o.sampling, text=piece.text, text_done=piece.end)
        except (InvalidRequest, AdmissionRejected, EngineError, ValueError) as e:
            code = "UNAVAILABLE" if isinstance(e, AdmissionRejected) else "INVALID_ARG"
            self._reject(reply, code, f"sequence {key}: {e}")
            if not piece.end:
                self.closed[key] = (f"its START request failed: {e}", now)
            return
        s = Session(key, engine_id, reply, o, t_start=now, last_request=now, ended=piece.end)
        reply.key = key
        if o.ack_pieces and not piece.end:
            reply.finish()
            s.reply = None
        self.sessions[key] = s
        self.by_engine_id[engine_id] = s

    def _append(self, piece: Piece, reply: Reply, now: float) -> None:
        key = piece.key
        if piece.end:
            self.triton_open.pop(key, None)
        else:
            self.triton_open[key] = now
        s = self.sessions.get(key)
        if s is None:
            why = self.closed.get(key, (None, 0))[0]
            if piece.end:
                self.closed.pop(key, None)
            if piece.end and not piece.text:  # closing an already closed sequence: harmless
                reply.finish()
            else:
                self._reject(reply, "INVALID_ARG", f"sequence {key} has no open session"
                             + (f": {why}" if why else " (send START first)"))
            return
        s.last_request = now
        if s.finished is not None:  # the engine already ended it (e.g. max_frames): nothing to stream
            reply.finish()
            if piece.end:
                self._forget(s)
            return
        running = s.engine_id in self.by_engine_id
        try:
            if piece.text and running:
                self.engine.append_text(s.engine_id, piece.text)
        except (InvalidRequest, EngineError, ValueError) as e:
            self._reject(reply, "INVALID_ARG", f"sequence {key}: {e}")
            if piece.end:
                self._end(s)
            return
        reply.key = key
        if s.options.ack_pieces and not piece.end:
            reply.finish()  # acknowledged: audio waits for the END request
            return
        if s.reply is not None:
            s.reply.finish()  # superseded: audio continues on the newest request
        s.reply = reply
        if piece.end:
            self._end(s)
        if s.pending is not None:  # the engine finished while no request was open (ack_pieces)
            self._complete(s, *s.pending)
        else:
            self._maybe_flush(s)

    def _end(self, s: Session) -> None:
        s.ended = True
        if s.engine_id in self.by_engine_id:
            self.engine.end_text(s.engine_id)

    def _route(self, out) -> None:
        s = self.by_engine_id.get(out.seq_id)
        if s is None:
            return  # dropped (cancelled/idle/restarted): its outputs are ignored
        pcm = np.asarray(out.pcm, dtype=np.float32).reshape(-1)
        if pcm.size:
            s.buffer.append(pcm)
            s.buffered_frames += max(1, pcm.size // P.SAMPLES_PER_FRAME)
        if out.finished:
            del self.by_engine_id[s.engine_id]
            if s.reply is None:  # ack_pieces between requests: deliver on the END request
                s.pending = (out.reason, out.error)
            else:
                self._complete(s, out.reason, out.error)
            return
        self._maybe_flush(s)

    def _maybe_flush(self, s: Session) -> None:
        sched = s.options.chunk_schedule
        if s.reply is not None and s.buffered_frames >= sched[min(s.chunks_sent, len(sched) - 1)]:
            self._flush(s)

    def _complete(self, s: Session, reason: str | None, error: str | None) -> None:
        """The sequence's last response (with FINISH_REASON) or its engine error, on the open request."""
        if error or reason == "error":
            self._flush(s)
            self._reject(s.reply, "INTERNAL", f"sequence {s.key}: {error or 'engine error'}")
        else:
            self._flush(s, final_reason=reason or "eos")
        s.reply, s.finished, s.pending = None, reason or "error", None
        if self.metrics:
            self.metrics.audio_seconds.increment(s.frames_sent * P.SAMPLES_PER_FRAME / P.SAMPLE_RATE)
        if s.ended:
            self._forget(s)

    def _flush(self, s: Session, final_reason: str | None = None) -> None:
        pcm = np.concatenate(s.buffer) if s.buffer else np.zeros(0, np.float32)
        if pcm.size == 0 and final_reason is None:
            return
        tensors = []
        if pcm.size:
            if s.options.audio_format == "int16":
                name, data = P.OUTPUT_AUDIO_INT16, (np.clip(pcm, -1.0, 1.0) * 32767.0).astype(np.int16)
            else:
                name, data = P.OUTPUT_AUDIO, pcm
            tensors = [pb_utils.Tensor(name, data),
                       pb_utils.Tensor(P.OUTPUT_SAMPLE_RATE, np.array([P.SAMPLE_RATE], np.int32)),
                       pb_utils.Tensor(P.OUTPUT_FIRST_FRAME, np.array([s.frames_sent], np.int64))]
            if s.first_audio_at is None:
                s.first_audio_at = time.monotonic()
                if self.metrics:
                    self.metrics.ttfa.observe(s.first_audio_at - s.t_start)
        if final_reason is not None:
            tensors.append(pb_utils.Tensor(P.OUTPUT_FINISH_REASON, np.array([final_reason.encode()], object)))
            s.reply.finish(pb_utils.InferenceResponse(output_tensors=tensors))
        else:
            s.reply.send(pb_utils.InferenceResponse(output_tensors=tensors))
        s.frames_sent += s.buffered_frames
        s.chunks_sent += 1
        s.buffer, s.buffered_frames = [], 0

    def _drop(self, key, code: str | None, msg: str, why: str | None = None) -> None:
        """Abort a live session in the engine (pages/slot freed at its next step) and fail its open request
        (code None: end it normally with FINISH_REASON "aborted"). `why`: what later requests of the
        sequence are told (recorded even when no session is live)."""
        if why is not None:
            self.closed[key] = (why, time.monotonic())
        s = self.sessions.get(key)
        if s is None:
            return
        if s.engine_id in self.by_engine_id:
            del self.by_engine_id[s.engine_id]
            try:
                self.engine.abort(s.engine_id)
            except EngineError:
                pass
        if s.reply is not None and not s.reply.done:
            if code is None:
                reason = pb_utils.Tensor(P.OUTPUT_FINISH_REASON, np.array([b"aborted"], object))
                s.reply.finish(pb_utils.InferenceResponse(output_tensors=[reason]))
            else:
                s.reply.fail(code, f"sequence {key}: {msg}")
        log("verbose", f"sequence {key} dropped: {msg}")
        self._forget(s)

    def _forget(self, s: Session) -> None:
        if self.sessions.get(s.key) is s:
            del self.sessions[s.key]

    def _close_all(self, code: str, msg: str) -> None:
        for key in list(self.sessions):
            self._drop(key, code, msg, why=f"it was closed: {msg}")

    def _tick(self, now: float) -> None:
        limit = self.idle_s + IDLE_MARGIN_S
        for s in list(self.sessions.values()):
            if not s.ended and now - s.last_request > limit:  # Triton expired it silently
                self._drop(s.key, "UNAVAILABLE", f"no request for {self.idle_s:g} s without END: "
                           "the sequence idled out", why="it idled out")
            elif s.reply is not None and now - s.last_check > 0.5:
                s.last_check = now  # cancellation while no audio flows (waiting for text or a slot)
                if s.reply.sender.is_cancelled():
                    self._drop(s.key, "CANCELLED", "the request was cancelled", why="it was cancelled")
        for table in (self.closed,):
            for key in [k for k, (_, t) in table.items() if now - t > limit]:
                del table[key]
        for key in [k for k, t in self.triton_open.items() if now - t > limit]:
            del self.triton_open[key]
        self._write_open_sequences()
        if self.metrics:
            self.metrics.update(self.engine.stats(), len(self.sessions))

    def _write_open_sequences(self) -> None:
        ids = sorted(self.triton_open, key=str)
        if self.state_file is None or ids == self._open_written:
            return
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(ids))
        tmp.replace(self.state_file)
        self._open_written = ids

    # --- response thread ----------------------------------------------------------------------------
    def _response_loop(self) -> None:
        while (item := self.responses.get()) is not None:
            reply, response, flags = item
            try:
                if response is None:
                    reply.sender.send(flags=flags)
                else:
                    reply.sender.send(response, flags=flags)
                if not flags and reply.sender.is_cancelled():
                    self.commands.put(("cancel", reply.key, reply))
            except Exception as e:  # a closed/cancelled stream: nothing more can reach the client
                log("warn", f"send failed for sequence {reply.key}: {e}")
            # NOTE: drop the references now: a response sender kept alive holds its request's response
            # factory, and the model cannot unload while one is held.
            del item, reply, response


def _load_factory(spec: str):
    """'pkg.module:Attr' or '/path/file.py:Attr' -> the callable."""
    target, _, attr = spec.partition(":")
    if target.endswith(".py"):
        mod_spec = importlib.util.spec_from_file_location(Path(target).stem, target)
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    if not hasattr(module, attr or "Engine") and target == "q3tts.engine":
        module = importlib.import_module("q3tts.engine.engine")  # the contract's name, before it is re-exported
    return getattr(module, attr or "Engine")


class TritonPythonModel:
    """The sequence model `qwen3_tts` (config: model_repository/qwen3_tts/config.pbtxt.tmpl)."""

    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        engine_cfg = json.loads(params.get("engine_config") or "{}")
        if args.get("model_instance_kind") == "GPU":
            engine_cfg["device"] = f"cuda:{args['model_instance_device_id']}"
        schedule = P.parse_chunk_schedule(params.get("chunk_schedule") or "1")
        factory = _load_factory(params.get("engine_factory") or "q3tts.engine:Engine")
        checkpoint = params["checkpoint"]

        def make_engine():
            from q3tts.engine.config import EngineConfig

            return factory(checkpoint, EngineConfig.from_dict(engine_cfg))

        instance = args.get("model_instance_name", "0").replace("/", "_")
        state_dir = params.get("state_dir")
        state_file = Path(state_dir) / f"open_sequences.{instance}.json" if state_dir else None
        labels = {"model": args["model_name"], "version": args["model_version"], "instance": instance}
        self.metrics = ServingMetrics(pb_utils, labels)
        self.core = ServingCore(make_engine, schedule, float(params.get("idle_s") or 30), state_file, self.metrics)
        log("info", f"loading {checkpoint} ({json.dumps(engine_cfg)})")
        self.core.start()
        log("info", f"ready: instance {instance}, chunk schedule {list(schedule)}")

    def execute(self, requests):
        for request in requests:
            self.core.submit(request, request.get_response_sender())
        return None

    def finalize(self) -> None:
        log("info", "finalize: stopping engine and response threads")
        self.core.shutdown()
        self.metrics.finalize()
        log("info", "finalize: done")


class OneShotModel:
    """`qwen3_tts_oneshot`: each request becomes a START|END sequence of the sequence model (BLS), relayed.

    Loads no weights. `async execute` lets many requests relay at once; the blocking response iterator is
    advanced in the stub's default executor.
    """

    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.target = params.get("sequence_model") or P.MODEL
        self.outputs = list(P.OUTPUTS)
        # IDs no client picks by accident: high bit set, instance-unique counter
        self._ids = itertools.count((1 << 63) | (int(time.time() * 1000) % (1 << 40)) << 16)

    async def execute(self, requests):
        import asyncio

        await asyncio.gather(*(self._relay(r) for r in requests))
        return None

    async def _relay(self, request) -> None:
        import asyncio

        sender = request.get_response_sender()
        final_sent = False

        def send_final(response=None) -> None:  # exactly once, whatever fails after it
            nonlocal final_sent
            if not final_sent:
                final_sent = True
                sender.send(response, flags=FINAL)

        try:
            raw = request.parameters()
            params = json.loads(raw) if isinstance(raw, str) and raw else {}
            params = {k: (str(v) if isinstance(v, float) else v) for k, v in params.items()
                      if not k.startswith("triton_")}
            cid = next(self._ids)
            inner = pb_utils.InferenceRequest(
                model_name=self.target, requested_output_names=self.outputs, inputs=request.inputs(),
                correlation_id=cid, flags=FLAG_START | FLAG_END, parameters=params)
            responses = await inner.async_exec(decoupled=True)
            loop = asyncio.get_running_loop()
            error, cancelled = None, False
            # NOTE: always drain the inner stream to its end: an undrained BLS response iterator keeps
            # this model from unloading (measured: the server then hits its exit timeout)
            while (resp := await loop.run_in_executor(None, next, responses, None)) is not None:
                if cancelled or error is not None:
                    continue
                if resp.has_error():
                    error = resp.error()
                    continue
                tensors = resp.output_tensors()
                if not tensors:
                    continue
                try:
                    gone = sender.is_cancelled()
                    if not gone:
                        sender.send(pb_utils.InferenceResponse(output_tensors=tensors))
                except Exception as e:  # the client's stream broke mid-send: same as a cancel
                    log("warn", f"oneshot: sending to the client failed ({e})")
                    gone = True
                if gone:  # client gone: stop the engine work too
                    cancelled = True
                    await loop.run_in_executor(None, self._abort_inner, cid)
                    log("info", f"oneshot: client gone, sequence {cid} aborted")
            send_final(pb_utils.InferenceResponse(error=error) if error is not None else None)
            log("info", f"oneshot: relay {cid} done")
        except Exception as e:
            log("error", f"oneshot relay failed: {traceback.format_exc()}")
            send_final(pb_utils.InferenceResponse(error=triton_error("INTERNAL", f"oneshot relay: {e}")))

    def _abort_inner(self, cid: int) -> None:
        """Drop the relayed sequence in the sequence model (a START|END request with abort=true)."""
        text = pb_utils.Tensor(P.INPUT_TEXT, np.array([b""], dtype=object))
        req = pb_utils.InferenceRequest(model_name=self.target, requested_output_names=self.outputs,
                                        inputs=[text], correlation_id=cid, flags=FLAG_START | FLAG_END,
                                        parameters={P.PARAM_ABORT: True})
        for _ in req.exec(decoupled=True):
            pass
