"""The engine in a child process of the python stub, so that a device fault costs one process, not the
instance.

A CUDA device-side fault poisons the CUDA context of its process for good, and Triton 2.51's python backend
does not restart the stub of a decoupled model (its /v2/health/ready stays 200). So the stub never touches
CUDA: `EngineProcess` starts a child (`python -m q3tts.serving.engine_process`: a fresh interpreter, a fresh
CUDA context) that builds the `Engine` and answers calls over a socket pair (a multiprocessing Connection),
and the serving loop talks to it through today's engine API (`add`, `append_text`, `end_text`, `abort`,
`step`, `has_work`, `stats`, `default_sampling`). One message is one round trip and carries any number of
calls (`call_many`: a burst of 64 STARTs is one message, each call still gets its own result or error); each
answer carries `has_work`, so asking it costs nothing.

A step overlaps the calls made while it runs: `step(while_waiting)` runs `while_waiting` (a `WhileStepping`)
whenever its file is readable while the step's answer is not in, and the calls it makes go out at once
(messages carry ids; an answer that comes first waits for its caller). The child answers them while its step
waits for the device (`Engine.step`'s `while_waiting`) when every call of the message may run then (MID_STEP:
a sequence's add, text, end and abort), so an arrival joins the admission of the step in flight instead of
waiting for it to end; a message with another call, and every message after it, waits for the step.

The child steps ahead (`EngineConfig.run_ahead`): once it has answered a step and no message waits, it runs
the next step at once and keeps its answer for the parent's next `step` call. So the device's next step waits
neither for the parent to take in and route the last step's outputs (unpickling, routing, the response
threads) nor for the last step's audio: the parent's turn overlaps the device work. A call the parent makes
meanwhile reaches the step after the one it precedes only when it comes after that step's wait for the device
(MID_STEP calls during the wait run in it). The parent may learn of a sequence's end one answer after the
engine forgot it: text, end and abort of such a sequence are answered as the engine answers them for an ended
sequence it still knows (quietly, no error).

When a call fails with an error that poisons the device context (engine/faults.py), or the child dies, the
call raises `DeviceFault` and the child is gone; the serving loop then ends every open request and starts a
new `EngineProcess`.
"""

from __future__ import annotations

import gc
import json
import os
import pickle
import socket
import subprocess
import sys
import time
import traceback
from collections import OrderedDict, deque
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Callable

import numpy as np

from q3tts.core import EngineError, StepOutput

STOP_TIMEOUT_S = 10.0
# calls the child runs mid-step: the serving loop sends new sequences' adds during a step (EngineLoop._between),
# and everything else while the child steps ahead (a sequence's text then joins the step it precedes)
MID_STEP = frozenset({"add", "append_text", "end_text", "abort"})
# a sequence's calls the child answers itself once the engine forgot the sequence (see the module's doc)
ENDED_QUIET = frozenset({"append_text", "end_text", "abort"})
ENDED_KEPT = 4096  # how many of the last sequences to end the child remembers for that
Call = tuple[str, tuple, dict]  # (engine method, args, kwargs)
Result = tuple[bool, Any]  # (True, the call's result) | (False, its exception)


class DeviceFault(Exception):
    """The engine's device context is unusable or its process died; the text says what happened."""


class EngineProcessError(RuntimeError):
    """An unexpected error of the child's engine (not one of its request errors), as text."""


@dataclass(frozen=True)
class CheckpointInfo:
    """What the serving side reads of the child's checkpoint (the voice cache checks voices against it)."""

    config: Any  # q3tts.config.ModelConfig


def send(conn: Connection, message: Any) -> None:
    """One message, pickled with protocol 5: a step's outputs (`pack_outputs`) pickle ~3x faster than with the
    Connection's own protocol 4 (arrays in band as buffers, not through `tobytes`)."""
    conn.send_bytes(pickle.dumps(message, protocol=5))


def receive(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def pack_outputs(outputs: list[StepOutput]) -> tuple:
    """A step's outputs as they cross the pipe: each one's fields, then every codes and every pcm array in one
    array each (64 outputs pickle in about half the time, and unpickle in a third, of 64 StepOutputs)."""
    fields = [(o.seq_id, len(o.codes), len(o.pcm), o.finished, o.reason, o.error, o.stats) for o in outputs]
    if not outputs:
        return fields, None, None
    return fields, np.concatenate([o.codes for o in outputs]), np.concatenate([o.pcm for o in outputs])


def unpack_outputs(packed: tuple) -> list[StepOutput]:
    """`pack_outputs`' outputs back: their codes and pcm are views of the two arrays."""
    fields, codes, pcm = packed
    outputs, c, p = [], 0, 0
    for seq_id, frames, samples, finished, reason, error, stats in fields:
        outputs.append(StepOutput(seq_id, codes[c:c + frames], pcm[p:p + samples], finished, reason, error, stats))
        c, p = c + frames, p + samples
    return outputs


def _python() -> str:
    """The interpreter the child runs: inside the stub `sys.executable` may be the stub binary."""
    exe = Path(sys.executable)
    if exe.name.startswith("python"):
        return str(exe)
    return str(Path(sys.prefix) / "bin" / "python3")


@dataclass(frozen=True)
class WhileStepping:
    """A step's `while_waiting` with a file to sleep on: `wake` (has `fileno()`) is readable while there is work
    for `between`, and `EngineProcess.step` sleeps on it and on the step's answer at once (no polling)."""

    between: Callable[[float], None]
    wake: Any

    def __call__(self, timeout_s: float) -> None:
        self.between(timeout_s)

    def fileno(self) -> int:
        return self.wake.fileno()


class EngineProcess:
    """An Engine in a child process. `start()` returns at once; `wait_ready()` / `poll_ready()` take the
    child's hello (its defaults), or raise the child's start error.

    NOTE: a plain subprocess, not multiprocessing's spawn: spawn re-imports the parent's `__main__` in the
    child, which inside the stub is Triton's loader, not ours."""

    def __init__(self, checkpoint: str, engine_config: dict[str, Any]):
        self.checkpoint_path, self.engine_config = checkpoint, dict(engine_config)
        self.default_sampling = None
        self.checkpoint: CheckpointInfo | None = None
        self.frozen_objects = 0  # the child's start objects out of its collector's reach (`freeze_heap`)
        self._work = False
        self._ready = False
        self._conn = self._proc = None
        self._sent = 0  # the id of the last message sent
        self._answers: dict[int, list[Result]] = {}  # answers that came before their callers asked

    # --- lifecycle ----------------------------------------------------------------------------------------
    def start(self) -> EngineProcess:
        ours, theirs = socket.socketpair()
        fd = theirs.fileno()
        self._proc = subprocess.Popen([_python(), "-m", __name__, str(fd), self.checkpoint_path,
                                       json.dumps(self.engine_config)], pass_fds=(fd,))
        theirs.close()
        self._conn = Connection(ours.detach())
        return self

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def poll_ready(self) -> bool:
        """Whether the child's engine is built (non-blocking); raises its start error."""
        if not self._ready and self._conn.poll():
            self._take_hello()
        return self._ready

    def wait_ready(self) -> None:
        """Block until the child's engine is built; raises its start error."""
        if not self._ready:
            self._take_hello()

    def _take_hello(self) -> None:
        kind, *body = self._recv()
        if kind != "ready":
            self.close()
            raise RuntimeError(f"the engine process could not start: {body[0]}")
        self.default_sampling, self.checkpoint, self.frozen_objects = body[0], CheckpointInfo(body[1]), body[2]
        self._ready = True

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def close(self) -> None:
        """Stop the child (ask, then kill by PID); nothing is raised."""
        if self._proc is None:
            return
        try:
            send(self._conn, None)
        except (OSError, ValueError):
            pass
        try:
            self._proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._conn.close()
        self._proc, self._work = None, False

    # --- the engine API -----------------------------------------------------------------------------------
    def add(self, *args, **kwargs) -> None:
        self._call("add", args, kwargs)

    def append_text(self, seq_id, text: str) -> None:
        self._call("append_text", (seq_id, text))

    def end_text(self, seq_id) -> None:
        self._call("end_text", (seq_id,))

    def abort(self, seq_id) -> None:
        self._call("abort", (seq_id,))

    def step(self, while_waiting: WhileStepping | None = None) -> list:
        """The engine's step; while its answer is not in, `while_waiting(0.0)` runs whenever its file is
        readable (the calls it makes may be answered mid-step: see the module's doc)."""
        [(ok, value)] = self._answer(self._send([("step", (), {})]), while_waiting)
        if not ok:
            raise value
        return unpack_outputs(value)

    def has_work(self) -> bool:
        return self._ready and self._work

    def stats(self) -> dict[str, Any]:
        return self._call("stats")

    def call_many(self, calls: list[Call]) -> list[Result]:
        """Run `calls` (method, args, kwargs) in order in one round trip -> one (ok, value) per call: the
        call's result, or (False, its exception). Raises DeviceFault when a call poisoned the device context
        (the calls after it did not run) or the child died."""
        return self._answer(self._send(calls))

    def _send(self, calls: list[Call]) -> int:
        """Send one message of calls; returns its id."""
        if self._proc is None:
            raise DeviceFault("the engine process was closed")
        self._sent += 1
        try:
            send(self._conn, (self._sent, list(calls)))
        except (OSError, ValueError) as e:
            raise self._died(e) from None
        return self._sent

    def _answer(self, message: int, while_waiting: WhileStepping | None = None) -> list[Result]:
        """The answer to message `message`; answers to other messages that come first are kept for their
        callers. With `while_waiting`, it runs as `step` says (it may send and await messages of its own; a
        fault it met closed the process)."""
        while message not in self._answers:
            if self._proc is None:
                raise DeviceFault("the engine process was closed while a call was waiting")
            if while_waiting is not None and self._conn not in wait([self._conn, while_waiting]):
                while_waiting(0.0)
                continue
            answered, kind, value, self._work = self._recv()
            if kind == "fault":
                self.close()
                raise DeviceFault(value)
            self._answers[answered] = value
        return self._answers.pop(message)

    def _call(self, method: str, args: tuple = (), kwargs: dict | None = None):
        [(ok, value)] = self.call_many([(method, args, kwargs or {})])
        if not ok:
            raise value
        return value

    def _recv(self) -> tuple:
        try:
            return receive(self._conn)
        except (EOFError, OSError) as e:
            raise self._died(e) from None

    def _died(self, e: BaseException) -> DeviceFault:
        try:
            code = self._proc.wait(1.0)
        except subprocess.TimeoutExpired:
            code = None
        self.close()
        return DeviceFault(f"the engine process exited (exit code {code}, {type(e).__name__})")


# --- the child ----------------------------------------------------------------------------------------------
def child_main(conn, checkpoint: str, engine_config: dict[str, Any]) -> None:
    """Build the engine, say hello, then answer calls until told to stop (None) or the parent goes away.
    A call whose error poisoned the device is answered with ("fault", text) and the child exits."""
    from q3tts.engine import Engine, EngineConfig
    from q3tts.engine.timing import log_start_phases

    log_start_phases(f"[q3tts] engine process {os.getpid()}: start: %(message)s")
    try:
        engine = Engine.from_checkpoint(checkpoint, EngineConfig.from_dict(engine_config))
    except BaseException as e:  # noqa: BLE001 - the parent raises it from wait_ready
        send(conn, ("start_error", f"{type(e).__name__}: {e}"))
        return
    full_passes = FullCollections()
    frozen = freeze_heap()
    sys.stderr.write(f"[q3tts] engine process {os.getpid()}: engine up in {engine.startup}; "
                     f"{frozen} objects of the start frozen\n")
    send(conn, ("ready", engine.default_sampling, engine.checkpoint.config, frozen))
    serve(conn, engine, engine.config.run_ahead, full_passes)


def freeze_heap() -> int:
    """Move every object alive now into the collector's permanent generation (`gc.freeze`) and return how many:
    called once the engine is built, it takes the start's objects (modules, the model, compiled kernels, graphs:
    310k on a tiny CPU engine) out of every later full collection. A full pass over them took 121 ms on a 2-core
    CPU; in the step loop such a pass is a host pause while streams wait, a gap of the device (two of nine served
    c16 runs on an H100 had one host gap of about 200 ms, cause unconfirmed: perf/results/RESULTS.md). Passes
    then scan only what serving allocates. Frozen garbage is never collected: the start's objects live as long
    as the process anyway."""
    gc.collect()  # what the start already dropped is not frozen with the rest
    gc.freeze()
    return gc.get_freeze_count()


class FullCollections:
    """The garbage collector's full (generation 2) passes in this process, counted and timed from now on
    (`gc.callbacks`): `stats()` -> gc_full_passes, gc_full_pass_seconds, which the engine process adds to the
    engine's stats (metrics q3tts_engine_gc_full_passes_total, q3tts_engine_gc_full_pass_seconds_total). A full
    pass is a host pause in which no step launches."""

    def __init__(self) -> None:
        self.passes, self.seconds, self._start = 0, 0.0, None
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.passes, self.seconds = self.passes + 1, self.seconds + time.perf_counter() - self._start

    def stats(self) -> dict[str, float]:
        return {"gc_full_passes": self.passes, "gc_full_pass_seconds": self.seconds}


def serve(conn, engine, run_ahead: bool = False, full_passes: FullCollections | None = None) -> None:
    """Answer the messages (id, calls) in order, each with (id, kind, value, has_work) (`_Child.answer_all`),
    until told to stop (None) or the parent goes away. While a step waits for the device, a message that came
    meanwhile is answered at once when all its calls are MID_STEP; else it, and every message after it, is
    held until the step is answered. `run_ahead`: when no message waits and the engine has work, the next step
    runs before it is asked for; its answer goes to the next message that asks for a step alone (a fault in
    it: to the next message). `full_passes`: the process's `FullCollections`, which stats answers carry."""
    held: deque = deque()
    child = _Child(engine, full_passes)

    def while_waiting(timeout_s: float) -> None:
        if held:  # the rest waits for the step
            time.sleep(timeout_s)
            return
        if not conn.poll(timeout_s):
            return
        message = _next(conn)
        if message is not None and all(method in MID_STEP for method, _, _ in message[1]):
            _reply(conn, message, child.answer_all(message[1]))
        else:
            held.append(message)

    while True:
        if run_ahead and child.ahead is None and not held and engine.has_work() and not conn.poll(0):
            child.ahead = child.answer_all([STEP], while_waiting)
            continue
        message = held.popleft() if held else _next(conn)
        if message is None:
            return
        ahead = child.ahead
        if ahead is not None and (message[1] == [STEP] or ahead[0] == "fault"):
            child.ahead = None
            _reply(conn, message, ahead[:2] + (child.has_work(),))
        else:
            _reply(conn, message, child.answer_all(message[1], while_waiting))


STEP: Call = ("step", (), {})


def _reply(conn, message: tuple[int, list[Call]], answer: tuple) -> None:
    send(conn, (message[0], *answer))
    if answer[0] == "fault":
        os._exit(1)  # the context is poisoned: nothing of this process can be trusted


class _Child:
    """The child's engine as its messages reach it: calls in order, a step's `while_waiting` passed on, the
    answer of a step run ahead, and the sequences that ended lately (`ENDED_QUIET`)."""

    def __init__(self, engine, full_passes: FullCollections | None = None):
        self.engine, self.full_passes = engine, full_passes  # stats answers carry the process's full passes
        self.ahead: tuple | None = None  # the answer of the step run ahead, until a message asks for it
        self.ended: OrderedDict = OrderedDict()  # the last ENDED_KEPT sequence ids that ended, oldest first

    def has_work(self) -> bool:
        return self.ahead is not None or self.engine.has_work()

    def answer_all(self, calls: list[Call], while_waiting=None) -> tuple:
        """Calls in order -> ("ok", [Result per call], has_work), or ("fault", text, False) at the first call
        that poisoned the device context (the rest do not run). A step gets `while_waiting`."""
        try:
            results = [self.answer(*call, while_waiting) for call in calls]
        except _Poisoned as e:
            return "fault", str(e), False
        return "ok", results, self.has_work()

    def answer(self, method: str, args: tuple, kwargs: dict, while_waiting=None) -> Result:
        if method in ENDED_QUIET and args and args[0] in self.ended:
            return True, None
        ok, value = _answer(self.engine, method, args, kwargs, while_waiting)
        if ok and method == "stats" and self.full_passes is not None:
            value = {**value, **self.full_passes.stats()}
        if ok and method == "step":
            self.ended.update((seq_id, None) for seq_id, _, _, finished, *_ in value[0] if finished)
            while len(self.ended) > ENDED_KEPT:
                self.ended.popitem(last=False)
        return ok, value


def _next(conn):
    try:
        return receive(conn)
    except (EOFError, OSError):
        return None


class _Poisoned(Exception):
    """A call left the device context unusable: the child answers with a fault and exits."""


def _answer(engine, method: str, args: tuple, kwargs: dict, while_waiting=None) -> Result:
    """One call -> (True, result) | (False, exception); raises _Poisoned."""
    from q3tts.engine.faults import context_usable, is_device_fault

    device = engine.runner.device
    if method == "step" and while_waiting is not None:
        kwargs = {**kwargs, "while_waiting": while_waiting}
    try:
        result = getattr(engine, method)(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - every error goes back to the caller
        if is_device_fault(e, device):
            sys.stderr.write(f"[q3tts] engine process: device fault in {method}: {traceback.format_exc()}")
            raise _Poisoned(f"{type(e).__name__}: {e}") from None
        return False, _picklable(e)
    if method == "step" and any(out.reason == "error" for out in result) and not context_usable(device):
        raise _Poisoned("the device context failed after a step that ended sequences with errors")
    return True, pack_outputs(result) if method == "step" else result


def _picklable(e: Exception) -> Exception:
    """The engine's request errors travel as they are; anything else as an EngineProcessError with its text."""
    if isinstance(e, (EngineError, ValueError, KeyError)) and type(e).__module__.startswith(("q3tts", "builtins")):
        return e
    return EngineProcessError(f"{type(e).__name__}: {e}")


if __name__ == "__main__":  # python -m q3tts.serving.engine_process FD CHECKPOINT ENGINE_CONFIG_JSON
    child_main(Connection(int(sys.argv[1])), sys.argv[2], json.loads(sys.argv[3]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown (seconds with torch loaded): the unload waits on this exit
