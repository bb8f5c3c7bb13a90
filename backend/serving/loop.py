"""The serving threads: one engine thread owns the Engine and the SessionTable, RESPONSE_THREADS response threads
build every response and own every `sender.send` (each sequence's on one of them, in order): the engine thread
only queues what to build, so a step's 64 responses do not hold up its next step. `submit()` (called by execute()) only parses and enqueues.

The engine thread applies the queued commands as one batch (serving/calls.py: their engine calls in one round
trip per round, each sequence's in arrival order), steps the engine while it has work (commands that come while
a step runs are applied meanwhile: `_between`, the step's `while_waiting`), routes each output's PCM to its
session, and every TICK_S does the housekeeping: idle sequences, cancellations while no audio flows, metrics (the
server's resident memory among them), and the unload check (once Triton unloads the model, every open sequence
ends within UNLOAD_CONFIRM_S with "the model is being unloaded (...)", new ones are refused: unloading never
waits on a client).

A `DeviceFault` from any engine call (the engine runs in a child process, serving/engine_process.py, whose
device context failed or which died) heals the instance: new sequences are refused at once, every open
sequence ends with one "instance restarting after a device fault: ..." error, the instance reports not
ready (`q3tts_instance_ready` 0), a new engine process starts, and once it is built the instance is ready
again.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import queue
import threading
import time
import traceback
from typing import Callable

from q3tts.core import StepOutput
from q3tts.serving import request as R
from q3tts.serving.commands import Cancel, Command, CommandQueue, Refuse, Shutdown, Start
from q3tts.serving.engine_process import DeviceFault, WhileStepping
from q3tts.serving.handlers import INTERNAL, SHUTTING_DOWN, CommandHandlers
from q3tts.serving.health import resident_bytes
from q3tts.serving.session import Reply, Session, SessionTable

TICK_S = 0.2  # engine thread housekeeping period
IDLE_MARGIN_S = 1.0  # after Triton's own idle timeout: Triton has dropped the sequence by then
# Triton's model readiness is every instance's health: one instance's device fault makes the model not ready
# for a moment (measured ~0.3 s with two CPU instances); an unload stays not ready
UNLOAD_CONFIRM_S = 2.0
CANCEL_CHECK_S = 0.5  # how often a request is asked is_cancelled() (a round trip to the server), at most
RESTARTING = "instance restarting after a device fault"
RESPAWN_RETRY_S = 5.0  # a replacement engine that failed to start is tried again after this long
# `sender.send` waits (GIL released) until Triton's side of the python backend took the response, ~0.1 ms: a
# step that starts 64 streams makes 64 first responses, which would wait for each other on one thread
RESPONSE_THREADS = 4


def _no_log(level: str, msg: str) -> None:
    pass


class EngineLoop(CommandHandlers):
    """`make_engine()` runs on the engine thread (a failure is raised from start()); it returns an engine or an
    `EngineProcess` (then the loop waits for its child, and replaces it after a device fault). `model_ready()`
    says whether Triton still serves the model; it is only trusted after it was once True (not while loading).
    `server_resident()`: the tritonserver process's resident bytes (by default the stub's parent's), reported
    at each tick with `server_memory_budget` (bytes, 0 = none) for the health probe (serving/health.py)."""

    def __init__(self, make_engine: Callable, default_schedule: tuple[int, ...], idle_s: float, metrics=None,
                 log: Callable[[str, str], None] = _no_log, model_ready: Callable[[], bool] = lambda: True,
                 make_voices: Callable | None = None, server_memory_budget: int = 0,
                 server_resident: Callable[[], int] = lambda: resident_bytes(os.getppid())):
        self.commands = CommandQueue()
        self.responses = [queue.Queue() for _ in range(RESPONSE_THREADS)]  # one per response thread
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
        # the tritonserver process's memory (the stub's parent) against its budget (bytes, 0 = none; health.py)
        self._memory_budget, self._server_resident, self._over_budget = server_memory_budget, server_resident, False
        self._not_ready_since: float | None = None  # after being ready: since when Triton says not ready
        self._ids = itertools.count(1)
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._last_tick = 0.0
        self._held: list[Command] = []  # commands met during a step and left for the loop (`_between`)
        self.engine_thread = threading.Thread(target=self._engine_main, name="q3tts-engine", daemon=True)
        self.response_threads = [threading.Thread(target=self._response_main, args=(q,), daemon=True,
                                                  name=f"q3tts-responses-{i}") for i, q in enumerate(self.responses)]

    # --- lifecycle ----------------------------------------------------------------------------------------
    def start(self) -> None:
        for thread in self.response_threads:
            thread.start()
        self.engine_thread.start()
        self._started.wait()
        if self._start_error is not None:  # the thread cannot raise into initialize: pass it back
            self._stop_responses()
            raise self._start_error

    def shutdown(self) -> None:
        """Reverse order: the engine thread (closes every session), then the response threads."""
        self.commands.put(Shutdown())
        self.engine_thread.join()
        self._stop_responses()
        self.commands.close()

    def _stop_responses(self) -> None:
        for q in self.responses:
            q.put(None)
        for thread in self.response_threads:
            thread.join()

    # --- called from execute() ----------------------------------------------------------------------------
    def submit(self, request, sender) -> None:
        now = time.monotonic()
        try:
            cmd = R.parse_request(request, self.default_schedule, self.defaults, self.checkpoint)
        except Exception as e:  # noqa: BLE001 - whatever the parser could not read gets one clear error
            if not isinstance(e, R.BadRequest):
                self.log("error", f"reading a request failed: {traceback.format_exc()}")
            msg = str(e) if isinstance(e, R.BadRequest) else f"could not read the request's inputs ({INTERNAL})"
            cmd = Refuse(*R.sequence_flags(request), msg)
        reply = Reply(sender, self.responses[hash(cmd.key) % RESPONSE_THREADS])  # a sequence's: one thread, in order
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
        """Those held back during the last step, then everything queued; waits up to TICK_S for the first one
        when there is none and the engine is idle."""
        held, self._held = self._held, []
        return held + self.commands.take(TICK_S if not (held or self.engine.has_work()) else 0.0)

    def _between(self, timeout_s: float) -> None:
        """The engine step's `while_waiting`: the commands that came while the step runs (waits up to timeout_s
        for one). The STARTs of new sequences are applied at once, so that they join this step's admission;
        from the first other command on (it may concern a sequence this step ends, whose output is not routed
        yet), they are held for the loop, in order."""
        cmds = self.commands.take(timeout_s)
        stop = 0 if self._held else next(
            (i for i, cmd in enumerate(cmds) if not (isinstance(cmd, Start) and self.table.get(cmd.key) is None)),
            len(cmds))
        self._held += cmds[stop:]
        if stop:
            self._run((cmd.key, self._command(cmd)) for cmd in cmds[:stop])

    def _apply_all(self, cmds: list[Command]) -> bool:
        """Apply the commands (those before a Shutdown) as one batch; False on Shutdown."""
        stop = next((i for i, cmd in enumerate(cmds) if isinstance(cmd, Shutdown)), len(cmds))
        self._run((cmd.key, self._command(cmd)) for cmd in cmds[:stop])
        if stop < len(cmds):
            self._close_all("unavailable", SHUTTING_DOWN)
            return False
        # NOTE: `cmds` dies with this frame: no response sender is held past its FINAL (see _response_main)
        return True

    def _step(self) -> None:
        faults = self.health["device_faults"]
        try:
            outputs = self.engine.step(WhileStepping(self._between, self.commands))
            returned = time.monotonic()
        except DeviceFault as e:
            if self.health["device_faults"] == faults:  # else a command run during the step healed it
                self._device_fault(e)
            return
        except Exception as e:  # an engine bug: fail every live session, keep serving
            self.log("error", f"engine step failed: {traceback.format_exc()}")
            self._close_all("error", f"the engine step failed ({INTERNAL})")
            return
        for out in sorted(outputs, key=lambda o: not o.stats):  # first frames (stats) queue their audio first
            s = self.table.running(out.seq_id)
            if s is None:
                continue  # closed (cancelled/idle/restarted): its outputs are ignored
            try:
                self._route(s, out, returned)
            except Exception:
                self.log("error", f"routing output of sequence {s.key} failed: {traceback.format_exc()}")
                self._close_now([s], "error", f"sending its audio failed ({INTERNAL})",
                                why="it failed with an internal error")

    def _route(self, s: Session, out: StepOutput, returned: float) -> None:
        s.feed(out.pcm, last=out.finished, stamps={**out.stats, "step_returned": returned} if out.stats else None)
        if out.finished:
            self.table.stop(s)
            if out.error or out.reason == "error":
                s.close("error", out.error or "engine error")
            else:
                s.close(out.reason or "eos")
            self._forget_if_over(s)

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
        idle = [s for s in self.table.sessions() if not s.ended and now - s.last_request > limit]  # Triton
        self._close_now(idle, "unavailable", f"no request for {self.idle_s:g} s without END: the sequence "
                        "idled out", why="it idled out")  # expired them silently
        # where no audio flows (waiting for text or a slot): the response threads ask the others
        cancelled = [s for s in self.table.sessions() if s.reply is not None
                     and s.reply.check_cancelled(now, CANCEL_CHECK_S)]
        self._close_now(cancelled, "cancelled", "the request was cancelled", why="it was cancelled")
        self.table.expire(now - limit)
        self._check_unload(now)
        self._update_metrics()

    def _update_metrics(self) -> None:
        if self.metrics is None:
            return
        engine = {} if self.restarting else self.engine.stats()  # the voice cache's counts included
        health = {**self.health, "instance_ready": 0 if self.restarting else 1, **self._server_memory()}
        self.metrics.update({**engine, **health}, len(self.table))

    def _server_memory(self) -> dict[str, int]:
        """The server's resident memory and budget (the health probe's); logs each time it goes over budget."""
        held, budget = self._server_resident(), self._memory_budget
        over = 0 < budget < held
        if over and not self._over_budget:
            self.log("error", f"tritonserver holds {held / 2 ** 30:.2f} GiB, over its budget of {budget / 2 ** 30:.2f} "
                     "GiB (max_server_memory_gib): the health probe now says not ready; the likely cause is Triton "
                     "2.51's gRPC leak of refused requests whose clients cancelled (q3tts.serving.health)")
        self._over_budget = over
        return {"server_resident_bytes": held, "server_memory_budget_bytes": budget}

    def _check_unload(self, now: float) -> None:
        ready = self._model_ready()
        self._was_ready |= ready
        self._not_ready_since = None if ready or not self._was_ready else (self._not_ready_since or now)
        if self._not_ready_since is not None and now - self._not_ready_since >= UNLOAD_CONFIRM_S \
                and not self.draining:
            self.draining = True
            self.log("info", f"the model is being unloaded: closing {len(self.table)} open sequences")
            self._close_all("unavailable", SHUTTING_DOWN)

    # --- response threads ---------------------------------------------------------------------------------
    def _response_main(self, responses: queue.Queue) -> None:
        while (item := responses.get()) is not None:
            reply, build, final = item
            try:
                response = build() if build is not None else None
            except Exception:  # a data response is left out; a FINAL still ends the request
                self.log("error", f"building a response of sequence {reply.key} failed: {traceback.format_exc()}")
                response = None if not final else R.error_response(
                    "INTERNAL", f"sequence {reply.key}: its last response failed ({INTERNAL})",
                    after_audio=reply.sent_data)
            try:
                if response is not None or final:
                    R.send(reply.sender, response, final)
                if not final and reply.check_cancelled(time.monotonic(), CANCEL_CHECK_S):
                    self.commands.put(Cancel(reply.key, reply))
            except Exception as e:  # a closed/cancelled stream: nothing more can reach the client
                self.log("warn", f"send failed for sequence {reply.key}: {e}")
            # NOTE: drop the references now: a response sender kept alive holds its request's response
            # factory, and the model cannot unload while one is held.
            del item, reply, build, response
