"""`CommandHandlers` (mixed into `EngineLoop`, which owns `engine`, `table`, `metrics`, `log`, `voices`,
`draining`, `restarting`, `_ids`, `_device_fault`): each command as a task (serving/calls.py) that yields its
engine calls, so that one batch of commands costs one round trip to the engine process per round.

Every path of a command ends its request with exactly one answer (session.py's rules); a failure in one
command ends that command's request with one error and leaves the others of its batch alone.
"""

from __future__ import annotations

import time
import traceback

from q3tts.core import AdmissionRejected, EngineError, InvalidRequest, VoiceSpec
from q3tts.serving import calls
from q3tts.serving.calls import Task, call
from q3tts.serving.commands import Abort, Append, Cancel, Command, Refuse, SessionOptions, Start
from q3tts.serving.engine_process import DeviceFault
from q3tts.serving.session import Session, refuse

SHUTTING_DOWN = "the model is being unloaded (the server is shutting down or was asked to unload it)"
INTERNAL = "an internal error: the server log has its traceback"  # never the exception's own text


class CommandHandlers:
    """The engine thread's command handlers and the one way a session ends outside the engine (`_close`)."""

    def _command(self, cmd: Command) -> Task:
        """One command's task; whatever fails in it ends its request with one error, never the thread."""
        handlers = {Start: self._start, Append: self._append, Abort: self._abort, Refuse: self._refuse,
                    Cancel: self._cancel}
        try:
            yield from handlers[type(cmd)](cmd)
        except DeviceFault:  # calls.run has healed the instance (_device_fault)
            if not cmd.reply.done:
                refuse(cmd.reply, "UNAVAILABLE", f"sequence {cmd.key}: {self.restarting}", self.metrics)
        except Exception:  # never let one request kill the engine thread
            self.log("error", f"{type(cmd).__name__} of sequence {cmd.key} failed: {traceback.format_exc()}")
            if not cmd.reply.done:
                refuse(cmd.reply, "INTERNAL", f"sequence {cmd.key}: {type(cmd).__name__} failed ({INTERNAL})")

    def _run(self, tasks) -> None:
        """Run (key, task) pairs (calls.run) against the current engine; a DeviceFault heals the instance."""
        calls.run(tasks, self._call_many, self._device_fault)

    def _call_many(self, batch: list) -> list:
        many = getattr(self.engine, "call_many", None)  # an EngineProcess; an engine in this process: one by one
        return many(batch) if many is not None else calls.call_each(self.engine, batch)

    def _close_now(self, sessions: list[Session], reason: str, error: str | None = None, why=None) -> None:
        """Close sessions outside a command (their engine aborts in one round trip)."""
        self._run((s.key, self._quietly(self._close(s, reason, error, why))) for s in sessions)

    @staticmethod
    def _quietly(task: Task) -> Task:
        """A close outside a command: a DeviceFault there has healed the instance, which closed every session."""
        try:
            yield from task
        except DeviceFault:
            pass

    # --- commands -----------------------------------------------------------------------------------------
    def _start(self, cmd: Start) -> Task:
        old = self.table.get(cmd.key)
        if old is not None:
            yield from self._close(old, "cancelled", "restarted by a new START request")
        self.table.forget_why(cmd.key)
        if self.draining or self.restarting:
            why = SHUTTING_DOWN if self.draining else self.restarting
            refuse(cmd.reply, "UNAVAILABLE", f"sequence {cmd.key}: {why}", self.metrics)
            return
        engine_id, o, added = next(self._ids), cmd.options, time.monotonic()
        try:
            yield call("add", engine_id, self._voice(o), o.sampling, text=cmd.text, text_done=cmd.end)
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

    def _append(self, cmd: Append) -> Task:
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
                yield call("append_text", s.engine_id, cmd.text)
        except (InvalidRequest, EngineError, ValueError) as e:
            refuse(reply, "INVALID_ARG", f"sequence {cmd.key}: {e}", self.metrics)
            reply = None
        if cmd.end:
            s.ended = True
            if running:
                yield call("end_text", s.engine_id)
        if reply is not None:
            s.attach(reply, cmd.end)
        self._forget_if_over(s)

    def _abort(self, cmd: Abort) -> Task:
        s = self.table.get(cmd.key)
        if s is not None:
            yield from self._close(s, "aborted", why="it was aborted")
        else:
            self.table.note(cmd.key, "it was aborted")
        cmd.reply.end()

    def _refuse(self, cmd: Refuse) -> Task:
        refuse(cmd.reply, "INVALID_ARG", cmd.message, self.metrics)
        s = self.table.get(cmd.key)
        if s is not None and (cmd.start or cmd.end):
            yield from self._close(s, "cancelled", "a new START request with invalid input replaced it"
                                   if cmd.start else f"its END request was invalid: {cmd.message}")
        if cmd.start:  # Triton opened the sequence: later requests get a clear error, not "unknown"
            self.table.note(cmd.key, f"its START request was invalid: {cmd.message}")
        if cmd.end:  # ... and closed it again
            self.table.forget_why(cmd.key)

    def _cancel(self, cmd: Cancel) -> Task:
        s = self.table.get(cmd.key)
        if s is not None and s.reply is cmd.reply and not cmd.reply.done:
            yield from self._close(s, "cancelled", "the request was cancelled", why="it was cancelled")

    # --- closing ------------------------------------------------------------------------------------------
    def _close(self, s: Session, reason: str, error: str | None = None, why: str | None = None) -> Task:
        """End a session on any path but the engine's own finish: abort it in the engine (pages and slot
        are freed at its next step), close it, forget it."""
        if self.table.stop(s):
            try:
                yield call("abort", s.engine_id)
            except EngineError:
                pass
        s.close(reason, error)
        self.table.remove(s, why)
        self.log("verbose", f"sequence {s.key} closed: {error or reason}")

    def _close_all(self, reason: str, error: str) -> None:
        self._close_now(self.table.sessions(), reason, error, why=f"it was closed: {error}")

    def _forget_if_over(self, s: Session) -> None:
        if s.ended and s.finished:  # END seen and the outcome delivered: nothing more can come
            self.table.remove(s)
