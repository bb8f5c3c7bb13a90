"""The serving threads: one engine thread owns the Engine and the SessionTable, one response thread owns every
`sender.send`. `submit()` (called by execute()) only parses and enqueues.

The engine thread applies commands in arrival order, steps the engine while it has work, routes each
output's PCM to its session, and every TICK_S does the housekeeping: idle sequences, cancellations while
no audio flows, metrics, and the unload check (once Triton unloads the model, every open sequence ends within
UNLOAD_CONFIRM_S with "the model is being unloaded (...)", new ones are refused: unloading never waits on a client).

A `DeviceFault` from any engine call (the engine runs in a child process, serving/engine_process.py, whose
device context failed or which died) heals the instance: new sequences are refused at once, every open
sequence ends with one "instance restarting after a device fault: ..." error, the instance reports not
ready (`q3tts_instance_ready` 0), a new engine process starts, and once it is built the instance is ready
again.
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import threading
import time
import traceback
from typing import Callable

from q3tts.core import AdmissionRejected, EngineError, InvalidRequest, StepOutput, VoiceSpec
from q3tts.serving import request as R
from q3tts.serving.commands import Abort, Append, Cancel, Command, Refuse, SessionOptions, Shutdown, Start
from q3tts.serving.engine_process import DeviceFault
from q3tts.serving.session import Reply, Session, SessionTable, refuse

TICK_S = 0.2  # engine thread housekeeping period
IDLE_MARGIN_S = 1.0  # after Triton's own idle timeout: Triton has dropped the sequence by then
# Triton's model readiness is every instance's health: one instance's device fault makes the model not ready
# for a moment (measured ~0.3 s with two CPU instances); an unload stays not ready
UNLOAD_CONFIRM_S = 2.0
CANCEL_CHECK_S = 0.5  # how often a request is asked is_cancelled() (a round trip to the server), at most
SHUTTING_DOWN = "the model is being unloaded (the server is shutting down or was asked to unload it)"
RESTARTING = "instance restarting after a device fault"
INTERNAL = "an internal error: the server log has its traceback"  # never the exception's own text
RESPAWN_RETRY_S = 5.0  # a replacement engine that failed to start is tried again after this long


def _no_log(level: str, msg: str) -> None:
    pass


class EngineLoop:
    """`make_engine()` runs on the engine thread (a failure is raised from start()); it returns an engine or an
    `EngineProcess` (then the loop waits for its child, and replaces it after a device fault). `model_ready()`
    says whether Triton still serves the model; it is only trusted after it was once True (not while loading)."""

    def __init__(self, make_engine: Callable, default_schedule: tuple[int, ...], idle_s: float, metrics=None,
                 log: Callable[[str, str], None] = _no_log, model_ready: Callable[[], bool] = lambda: True,
                 make_voices: Callable | None = None):
        self.commands: queue.Queue = queue.Queue()
        self.responses: queue.Queue = queue.Queue()
        self.default_schedule, self.idle_s, self.metrics, self.log = default_schedule, idle_s, metrics, log
        self.table = SessionTable()
        self.engine = None
        self.defaults = None  # engine.default_sampling: request parameters override it field by field
        self.checkpoint = None  # (variant, size): inputs that mean nothing for it are refused
        self.voices = None  # make_voices(engine): the VoiceFiles that resolve VOICE inputs (None: no voices)
        self._make_voices = make_voices
        self.draining = False  # the model is being unloaded: new sequences are refused
        self.restarting: str | None = None  # after a device fault, until the new engine is built: why
        self.health = {"device_faults": 0, "instance_restarts": 0}  # cumulative, for the metrics
        self._respawn_at: float | None = None  # when to try again to start a replacement engine
        self._make_engine, self._model_ready, self._was_ready = make_engine, model_ready, False
        self._not_ready_since: float | None = None  # after being ready: since when Triton says not ready
        self._ids = itertools.count(1)
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._last_tick = 0.0
        self.engine_thread = threading.Thread(target=self._engine_main, name="q3tts-engine", daemon=True)
        self.response_thread = threading.Thread(target=self._response_main, name="q3tts-responses", daemon=True)

    # --- lifecycle ----------------------------------------------------------------------------------------
    def start(self) -> None:
        self.response_thread.start()
        self.engine_thread.start()
        self._started.wait()
        if self._start_error is not None:  # the thread cannot raise into initialize: pass it back
            self.responses.put(None)
            self.response_thread.join()
            raise self._start_error

    def shutdown(self) -> None:
        """Reverse order: the engine thread (closes every session), then the response thread."""
        self.commands.put(Shutdown())
        self.engine_thread.join()
        self.responses.put(None)
        self.response_thread.join()

    # --- called from execute() ----------------------------------------------------------------------------
    def submit(self, request, sender) -> None:
        reply, now = Reply(sender, self.responses), time.monotonic()
        try:
            cmd = R.parse_request(request, self.default_schedule, self.defaults, self.checkpoint)
        except Exception as e:  # noqa: BLE001 - whatever the parser could not read gets one clear error
            if not isinstance(e, R.BadRequest):
                self.log("error", f"reading a request failed: {traceback.format_exc()}")
            msg = str(e) if isinstance(e, R.BadRequest) else f"could not read the request's inputs ({INTERNAL})"
            cmd = Refuse(*R.sequence_flags(request), msg)
        self.commands.put(dataclasses.replace(cmd, reply=reply, at=now))

    # --- engine thread ------------------------------------------------------------------------------------
    def _engine_main(self) -> None:
        try:
            self.engine = self._make_engine()
            if hasattr(self.engine, "wait_ready"):
                self.engine.wait_ready()
            self.defaults = self.engine.default_sampling
            config = self.engine.checkpoint.config if hasattr(self.engine, "checkpoint") else None
            self.checkpoint = (config.variant, config.size) if config is not None else None
            self.voices = self._make_voices(self.engine) if self._make_voices else None
        except BaseException as e:
            self._start_error = e
            self._started.set()
            return
        self._started.set()
        self.log("info", "engine thread started")
        while self._apply_all(self._next_commands()):
            self._maybe_tick()
            if self.engine.has_work():
                self._step()
        if hasattr(self.engine, "close"):
            self.engine.close()
        self.log("info", "engine thread stopped")

    def _next_commands(self) -> list[Command]:
        """Everything queued; waits up to TICK_S for the first one when the engine is idle."""
        cmds = []
        if not self.engine.has_work():
            try:
                cmds.append(self.commands.get(timeout=TICK_S))
            except queue.Empty:
                pass
        while True:
            try:
                cmds.append(self.commands.get_nowait())
            except queue.Empty:
                return cmds

    def _apply_all(self, cmds: list[Command]) -> bool:
        """Apply the commands in order; False on Shutdown."""
        handlers = {Start: self._start, Append: self._append, Abort: self._abort, Refuse: self._refuse,
                    Cancel: self._cancel}
        for cmd in cmds:
            if isinstance(cmd, Shutdown):
                self._close_all("unavailable", SHUTTING_DOWN)
                return False
            try:
                handlers[type(cmd)](cmd)
            except DeviceFault as e:
                self._device_fault(e)
                if not cmd.reply.done:
                    refuse(cmd.reply, "UNAVAILABLE", f"sequence {cmd.key}: {self.restarting}", self.metrics)
            except Exception as e:  # never let one request kill the engine thread
                self.log("error", f"{type(cmd).__name__} of sequence {cmd.key} failed: {traceback.format_exc()}")
                if not cmd.reply.done:
                    refuse(cmd.reply, "INTERNAL", f"sequence {cmd.key}: {type(cmd).__name__} failed ({INTERNAL})")
        # NOTE: `cmds` dies with this frame: no response sender is held past its FINAL (see _response_main)
        return True

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
            returned = time.monotonic()
        except DeviceFault as e:
            self._device_fault(e)
            return
        except Exception as e:  # an engine bug: fail every live session, keep serving
            self.log("error", f"engine step failed: {traceback.format_exc()}")
            self._close_all("error", f"the engine step failed ({INTERNAL})")
            return
        for out in outputs:
            s = self.table.running(out.seq_id)
            if s is None:
                continue  # closed (cancelled/idle/restarted): its outputs are ignored
            try:
                self._route(s, out, returned)
            except Exception as e:
                self.log("error", f"routing output of sequence {s.key} failed: {traceback.format_exc()}")
                self._close(s, "error", f"sending its audio failed ({INTERNAL})", why="it failed with an internal error")

    def _route(self, s: Session, out: StepOutput, returned: float) -> None:
        s.feed(out.pcm, last=out.finished, stamps={**out.stats, "step_returned": returned} if out.stats else None)
        if out.finished:
            self.table.stop(s)
            if out.error or out.reason == "error":
                s.close("error", out.error or "engine error")
            else:
                s.close(out.reason or "eos")
            self._forget_if_over(s)

    # --- commands -----------------------------------------------------------------------------------------
    def _start(self, cmd: Start) -> None:
        old = self.table.get(cmd.key)
        if old is not None:
            self._close(old, "cancelled", "restarted by a new START request")
        self.table.forget_why(cmd.key)
        if self.draining or self.restarting:
            why = SHUTTING_DOWN if self.draining else self.restarting
            refuse(cmd.reply, "UNAVAILABLE", f"sequence {cmd.key}: {why}", self.metrics)
            return
        engine_id, o, added = next(self._ids), cmd.options, time.monotonic()
        try:
            self.engine.add(engine_id, self._voice(o), o.sampling, text=cmd.text, text_done=cmd.end)
        except (InvalidRequest, AdmissionRejected, EngineError, ValueError) as e:
            code = "UNAVAILABLE" if isinstance(e, AdmissionRejected) else "INVALID_ARG"
            refuse(cmd.reply, code, f"sequence {cmd.key}: {e}", self.metrics)
            if not cmd.end:
                self.table.note(cmd.key, f"its START request failed: {e}")
            return
        s = Session(cmd.key, engine_id, o, started_at=cmd.at, metrics=self.metrics, ended=cmd.end,
                    stamps={"engine_add": added})
        self.table.add(s)
        s.attach(cmd.reply, cmd.end)

    def _voice(self, o: SessionOptions) -> VoiceSpec:
        """The START request's voice: a VOICE input comes from the voice cache (nothing to encode)."""
        if o.voice_name is None:
            return o.voice
        if self.voices is None:
            raise InvalidRequest("input VOICE: this server has no voices directory")
        return self.voices.resolve(o.voice_name).spec(o.voice.language, o.voice.text_mode, o.voice.xvector_only)

    def _append(self, cmd: Append) -> None:
        s = self.table.get(cmd.key)
        if s is None:
            why = self.table.why(cmd.key)
            if cmd.end:
                self.table.forget_why(cmd.key)
            if cmd.end and not cmd.text:  # closing an already closed sequence: harmless
                cmd.reply.end()
            else:
                refuse(cmd.reply, "INVALID_ARG", f"sequence {cmd.key} has no open session"
                       + (f": {why}" if why else " (send START first)"), self.metrics)
            return
        s.last_request = cmd.at
        running, reply = self.table.is_running(s), cmd.reply
        try:
            if cmd.text and running:
                self.engine.append_text(s.engine_id, cmd.text)
        except (InvalidRequest, EngineError, ValueError) as e:
            refuse(reply, "INVALID_ARG", f"sequence {cmd.key}: {e}", self.metrics)
            reply = None
        if cmd.end:
            s.ended = True
            if running:
                self.engine.end_text(s.engine_id)
        if reply is not None:
            s.attach(reply, cmd.end)
        self._forget_if_over(s)

    def _abort(self, cmd: Abort) -> None:
        s = self.table.get(cmd.key)
        if s is not None:
            self._close(s, "aborted", why="it was aborted")
        else:
            self.table.note(cmd.key, "it was aborted")
        cmd.reply.end()

    def _refuse(self, cmd: Refuse) -> None:
        refuse(cmd.reply, "INVALID_ARG", cmd.message, self.metrics)
        s = self.table.get(cmd.key)
        if s is not None and (cmd.start or cmd.end):
            self._close(s, "cancelled", "a new START request with invalid input replaced it" if cmd.start
                        else f"its END request was invalid: {cmd.message}")
        if cmd.start:  # Triton opened the sequence: later requests get a clear error, not "unknown"
            self.table.note(cmd.key, f"its START request was invalid: {cmd.message}")
        if cmd.end:  # ... and closed it again
            self.table.forget_why(cmd.key)

    def _cancel(self, cmd: Cancel) -> None:
        s = self.table.get(cmd.key)
        if s is not None and s.reply is cmd.reply and not cmd.reply.done:
            self._close(s, "cancelled", "the request was cancelled", why="it was cancelled")

    # --- closing ------------------------------------------------------------------------------------------
    def _close(self, s: Session, reason: str, error: str | None = None, why: str | None = None) -> None:
        """End a session on any path but the engine's own finish: abort it in the engine (pages and slot
        are freed at its next step), close it, forget it."""
        if self.table.stop(s):
            try:
                self.engine.abort(s.engine_id)
            except EngineError:
                pass
        s.close(reason, error)
        self.table.remove(s, why)
        self.log("verbose", f"sequence {s.key} closed: {error or reason}")

    def _close_all(self, reason: str, error: str) -> None:
        for s in self.table.sessions():
            self._close(s, reason, error, why=f"it was closed: {error}")

    # --- device faults ------------------------------------------------------------------------------------
    def _device_fault(self, fault: DeviceFault) -> None:
        """The engine is gone: end every open sequence with one error, report not ready, start a new one."""
        self.restarting = f"{RESTARTING}: {fault}"
        self.health["device_faults"] += 1
        self.log("error", f"{self.restarting}; closing {len(self.table)} open sequences")
        for s in self.table.sessions():
            self.table.stop(s)  # nothing to abort: the engine process is gone
            s.close("unavailable", self.restarting)
            self.table.remove(s, why=f"it was closed: {self.restarting}")
        self.engine.close()
        self._respawn()
        self._update_metrics()

    def _respawn(self) -> None:
        try:
            self.engine, self._respawn_at = self._make_engine(), None
        except Exception:  # noqa: BLE001 - e.g. the spawn itself failed: try again later
            self.log("error", f"starting a new engine process failed: {traceback.format_exc()}")
            self._respawn_at = time.monotonic() + RESPAWN_RETRY_S

    def _check_recovery(self, now: float) -> None:
        """While restarting: ready once the new engine is built; a failed start is tried again."""
        if self._respawn_at is not None:
            if now >= self._respawn_at:
                self._respawn()
            return
        try:
            ready = self.engine.poll_ready()
        except Exception as e:  # noqa: BLE001 - the new engine could not start
            self.log("error", f"the new engine process failed: {e}")
            self._respawn_at = now + RESPAWN_RETRY_S
            return
        if ready:
            self.log("info", f"instance ready again after: {self.restarting}")
            self.restarting = None
            self.health["instance_restarts"] += 1
            self._update_metrics()

    def _forget_if_over(self, s: Session) -> None:
        if s.ended and s.finished:  # END seen and the outcome delivered: nothing more can come
            self.table.remove(s)

    # --- housekeeping -------------------------------------------------------------------------------------
    def _maybe_tick(self) -> None:
        now = time.monotonic()
        if now - self._last_tick < TICK_S:
            return
        self._last_tick = now
        try:
            self._tick(now)
        except DeviceFault as e:
            self._device_fault(e)
        except Exception:
            self.log("error", f"tick failed: {traceback.format_exc()}")

    def _tick(self, now: float) -> None:
        if self.restarting:
            self._check_recovery(now)
        elif hasattr(self.engine, "alive") and not self.engine.alive():
            raise DeviceFault("the engine process exited")
        limit = self.idle_s + IDLE_MARGIN_S
        for s in self.table.sessions():
            if not s.ended and now - s.last_request > limit:  # Triton expired it silently
                self._close(s, "unavailable", f"no request for {self.idle_s:g} s without END: the sequence "
                            "idled out", why="it idled out")
            elif s.reply is not None and s.reply.check_cancelled(now, CANCEL_CHECK_S):
                # where no audio flows (waiting for text or a slot): the response thread asks the others
                self._close(s, "cancelled", "the request was cancelled", why="it was cancelled")
        self.table.expire(now - limit)
        self._check_unload(now)
        self._update_metrics()

    def _update_metrics(self) -> None:
        if self.metrics is None:
            return
        engine = {} if self.restarting else self.engine.stats()  # the voice cache's counts included
        health = {**self.health, "instance_ready": 0 if self.restarting else 1}
        self.metrics.update({**engine, **health}, len(self.table))

    def _check_unload(self, now: float) -> None:
        ready = self._model_ready()
        self._was_ready |= ready
        self._not_ready_since = None if ready or not self._was_ready else (self._not_ready_since or now)
        if self._not_ready_since is not None and now - self._not_ready_since >= UNLOAD_CONFIRM_S \
                and not self.draining:
            self.draining = True
            self.log("info", f"the model is being unloaded: closing {len(self.table)} open sequences")
            self._close_all("unavailable", SHUTTING_DOWN)

    # --- response thread ----------------------------------------------------------------------------------
    def _response_main(self) -> None:
        while (item := self.responses.get()) is not None:
            reply, response, final = item
            try:
                R.send(reply.sender, response, final)
                if not final and reply.check_cancelled(time.monotonic(), CANCEL_CHECK_S):
                    self.commands.put(Cancel(reply.key, reply))
            except Exception as e:  # a closed/cancelled stream: nothing more can reach the client
                self.log("warn", f"send failed for sequence {reply.key}: {e}")
            # NOTE: drop the references now: a response sender kept alive holds its request's response
            # factory, and the model cannot unload while one is held.
            del item, reply, response
