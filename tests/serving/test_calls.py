"""serving/calls.py: the tasks of one batch share one `call_many` per round, a key's tasks run in order, each
task gets its own result or error, and a DeviceFault heals once and reaches every task of its round."""

from __future__ import annotations

import pytest

from q3tts.serving import calls
from q3tts.serving.calls import call
from q3tts.serving.engine_process import DeviceFault


class Recorder:
    """call_many: 'put' answers its value, 'bad' raises ValueError, `fault_on` in a batch is a DeviceFault."""

    def __init__(self, fault_on=None):
        self.batches, self.fault_on = [], fault_on

    def call_many(self, batch):
        self.batches.append([(m, a) for m, a, _ in batch])
        if self.fault_on is not None and any(m == self.fault_on for m, _, _ in batch):
            raise DeviceFault("CUDA error: an illegal memory access")
        return [(False, ValueError(f"bad {a}")) if m == "bad" else (True, a[1])
                for m, a, _ in batch]


def task(log, name, *steps):
    """A task that yields each (method, arg) step and logs what it got back."""
    for method, arg in steps:
        try:
            got = yield call(method, name, arg)
            log.append((name, method, got))
        except ValueError as e:
            log.append((name, method, str(e)))
            return
        except DeviceFault:
            log.append((name, method, "fault"))
            return


def test_one_call_many_per_round_and_each_key_in_order():
    engine, log = Recorder(), []
    tasks = [(k, task(log, k, ("put", 1))) for k in "abcdefgh"]  # a burst of 8 starts
    tasks.insert(2, ("a", task(log, "a2", ("put", 2))))  # a's second command waits for its first
    calls.run(tasks, engine.call_many, on_fault=pytest.fail)
    assert engine.batches == [[("put", (k, 1)) for k in "abcdefgh"], [("put", ("a2", 2))]]
    assert [entry[0] for entry in log] == list("abcdefgh") + ["a2"]


def test_a_task_with_many_calls_and_one_error_leaves_the_others_alone():
    engine, log = Recorder(), []
    calls.run([("x", task(log, "x", ("put", 1), ("put", 2))), ("y", task(log, "y", ("bad", 0), ("put", 3))),
               ("z", task(log, "z", ("put", 4)))], engine.call_many, on_fault=pytest.fail)
    assert engine.batches == [[("put", ("x", 1)), ("bad", ("y", 0)), ("put", ("z", 4))], [("put", ("x", 2))]]
    assert log == [("x", "put", 1), ("y", "bad", "bad ('y', 0)"), ("z", "put", 4), ("x", "put", 2)]


def test_a_fault_heals_once_and_reaches_every_task_of_its_round():
    engine, log, faults = Recorder(fault_on="boom"), [], []
    calls.run([("x", task(log, "x", ("put", 1), ("boom", 0))), ("y", task(log, "y", ("put", 2), ("put", 3))),
               ("x", task(log, "later", ("put", 5)))], engine.call_many, faults.append)
    assert len(faults) == 1 and "illegal memory access" in str(faults[0])
    assert ("x", "boom", "fault") in log and ("y", "put", "fault") in log
    assert log[-1] == ("later", "put", 5)  # the key's next task runs after the fault


def test_call_each_keeps_each_error_and_lets_a_fault_through():
    class Engine:
        def ok(self, v):
            return v * 2

        def bad(self, v):
            raise ValueError(f"bad {v}")

        def dead(self):
            raise DeviceFault("gone")

    results = calls.call_each(Engine(), [call("ok", 2), call("bad", 3), call("ok", 4)])
    assert results[0] == (True, 4) and results[2] == (True, 8)
    assert results[1][0] is False and str(results[1][1]) == "bad 3"
    with pytest.raises(DeviceFault, match="gone"):
        calls.call_each(Engine(), [call("ok", 1), call("dead")])
