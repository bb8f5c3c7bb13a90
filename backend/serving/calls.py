"""Engine calls of many commands in one round trip: a burst of 64 STARTs costs the engine process one
message, not 64.

A command handler is a task: a generator that yields the engine calls it needs, `(method, args, kwargs)`, one at
a time, and receives each call's result (an error is raised at its `yield`). `run` advances every task of a
batch to its next call, sends those calls in one `call_many`, and resumes each task with its own result, until
all are done. Tasks of one key (a sequence's correlation ID) run one after the other in the given order, so a
sequence's requests still reach the engine in order; tasks of different keys run side by side.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Generator, Hashable, Iterable

from q3tts.serving.engine_process import Call, DeviceFault, Result

Task = Generator[Call, Any, None]


def call(method: str, *args, **kwargs) -> Call:
    """The engine call `engine.method(*args, **kwargs)`, for a task to yield."""
    return method, args, kwargs


def run(tasks: Iterable[tuple[Hashable, Task]], call_many: Callable[[list[Call]], list[Result]],
        on_fault: Callable[[DeviceFault], None]) -> None:
    """Run `(key, task)` pairs to their end. Each round sends the pending call of every running task (in the
    order their keys first came) in one `call_many`. When `call_many` raises DeviceFault, `on_fault(fault)` is
    called once and the fault is raised in every task of that round; the other tasks then go on. A task must
    handle what is raised in it: anything it lets out is a bug and propagates."""
    lanes: dict[Hashable, deque[Task]] = {}
    for key, task in tasks:
        lanes.setdefault(key, deque()).append(task)
    waiting: dict[Hashable, tuple[Task, Call]] = {}  # key -> its running task and the call it waits on
    for key in lanes:
        _advance(lanes[key], waiting, key, None)
    while waiting:
        keys = [key for key in lanes if key in waiting]
        try:
            results = call_many([waiting[key][1] for key in keys])
        except DeviceFault as fault:
            on_fault(fault)
            results = [(False, fault)] * len(keys)
        for key, result in zip(keys, results):
            _advance(lanes[key], waiting, key, result)


def _advance(lane: deque[Task], waiting: dict, key: Hashable, result: Result | None) -> None:
    """Resume the key's waiting task with `result` (None: start the lane), and start the lane's next tasks
    until one waits on a call or the lane is empty."""
    task = waiting.pop(key)[0] if result is not None else None
    while True:
        if task is None:
            if not lane:
                return
            task, result = lane.popleft(), (True, None)
        ok, value = result
        try:
            waiting[key] = (task, task.send(value) if ok else task.throw(value))
            return
        except StopIteration:
            task = None


def call_each(engine, calls: list[Call]) -> list[Result]:
    """`call_many` for an engine in this process: the calls one by one, each error kept as its result (a
    DeviceFault propagates: the engine is gone)."""
    results = []
    for method, args, kwargs in calls:
        try:
            results.append((True, getattr(engine, method)(*args, **kwargs)))
        except DeviceFault:
            raise
        except Exception as e:  # noqa: BLE001 - the task that made the call gets it
            results.append((False, e))
    return results
