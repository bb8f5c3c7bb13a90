"""Two KIND_CPU instances of the sequence model (`q3tts serve --gpus none --instances 2`) behind the real
tritonserver, on the tiny checkpoint: each instance is its own engine process with its own `model_instance`
label; a sequence stays on the instance that started it (integer and string correlation IDs, text pieces
seconds apart); new sequences spread over both; one instance's device fault ends only its own sequences.

The observable is the per-instance metrics (`q3tts_client.metrics.scrape_by`): `q3tts_open_sessions` while a
sequence's text is still open, the prefill and audio counters once it ended. What the CPU shows and what
remains for several GPUs: README "Several instances".
"""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from q3tts.serving.loop import RESTARTING
from q3tts_client import protocol as P
from q3tts_client.metrics import scrape_by
from q3tts_client.stream_client import synthesize
from tests.reliability.conftest import test_hooks as fault_hooks_enabled
from tests.reliability.served import FAULT_SEED
from tests.voice_fixtures import served

pytestmark = [pytest.mark.server, pytest.mark.timeout(300)]

INSTANCES = 2
VOICE = {"speaker": "ryan", "language": "english"}
PIECES = ["Hello there, ", "this sentence arrives ", "in pieces."]
PARAMS = {"greedy": True, "max_frames": 8, "text_mode": "incremental"}  # same audio in pieces or in one
GAP_S = 1.5  # between two pieces of a sequence
IDLE_S = 60.0  # Triton's idle time: an open sequence waits for its next piece that long


@pytest.fixture(scope="module")
def server(request, tiny_checkpoint, tmp_path_factory):
    with fault_hooks_enabled():  # the engines accept fault_injection_seed
        yield from served(request, tiny_checkpoint, tmp_path_factory, instances=INSTANCES, idle_s=IDLE_S,
                          pool={"fault_injection_seed": FAULT_SEED})


@pytest.fixture(scope="module")
def reference(server):
    """The sequence's text sent in one START|END request."""
    r = synthesize(server.grpc_url, ["".join(PIECES)], VOICE, PARAMS)
    assert r.error is None and r.audio.size > 0, r.error
    return r


def per_instance(server) -> dict[str, dict[str, float]]:
    return scrape_by(server.metrics_url)


def open_sessions(server, total: int, timeout_s: float = 30.0) -> dict[str, float]:
    """{instance: open sessions}, once they add up to `total` (the gauges follow each engine-loop tick)."""
    deadline = time.monotonic() + timeout_s
    while True:
        sessions = {k: m.get("q3tts_open_sessions", 0.0) for k, m in per_instance(server).items()}
        if sum(sessions.values()) == total or time.monotonic() > deadline:
            return sessions
        time.sleep(0.1)


def deltas(before: dict, after: dict, name: str) -> dict[str, float]:
    return {k: after[k].get(name, 0.0) - before.get(k, {}).get(name, 0.0) for k in after}


def counters_after(server, before: dict, name: str, total: float, timeout_s: float = 15.0) -> dict[str, float]:
    """Per-instance increase of counter `name` since `before`, once it adds up to `total`."""
    deadline = time.monotonic() + timeout_s
    while True:
        d = deltas(before, per_instance(server), name)
        if sum(d.values()) == pytest.approx(total) or time.monotonic() > deadline:
            return d
        time.sleep(0.1)


def engine_processes(server) -> dict[int, str]:
    """{engine process PID: the instance whose python stub (a process naming this server's repository)
    started it}."""
    procs = {}  # pid -> (argv, parent pid)
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
            procs[int(proc.name)] = (argv, int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]))
        except (OSError, ValueError, IndexError):
            continue
    repo = str(server.repository)
    stubs = {pid: argv for pid, (argv, _) in procs.items() if any(repo in a for a in argv)}
    return {pid: next(a for a in stubs[parent] if re.fullmatch(r"qwen3_tts_\d+_\d+", a))
            for pid, (argv, parent) in procs.items() if "q3tts.serving.engine_process" in argv and parent in stubs}


class HeldSequence:
    """A sequence whose first piece is sent at once (START, so Triton gives it a slot on one instance) and
    whose other pieces wait for `release()`."""

    def __init__(self, url: str, sequence_id: int | str, params: dict = PARAMS):
        self._go, self._rest = threading.Event(), PIECES[1:]
        self._result = None
        self._thread = threading.Thread(target=self._play, args=(url, sequence_id, params), daemon=True)
        self._thread.start()

    def _pieces(self):
        yield PIECES[0]
        self._go.wait()
        yield from self._rest

    def _play(self, url: str, sequence_id: int | str, params: dict) -> None:
        self._result = synthesize(url, self._pieces(), VOICE, params, sequence_id=sequence_id, timeout_s=200)

    def release(self, more_text: bool = True) -> HeldSequence:
        """Let the other pieces go (or only the END)."""
        if not more_text:
            self._rest = []
        self._go.set()
        return self

    def result(self):
        """The sequence's `Result`, once it ended."""
        self._thread.join(200)
        assert self._result is not None, "the sequence did not finish"
        return self._result


def test_each_instance_is_its_own_engine_process_with_its_own_label(server):
    metrics = per_instance(server)
    assert len(metrics) == INSTANCES, sorted(metrics)
    assert all(m["q3tts_instance_ready"] == 1 and m["q3tts_slots_capacity"] == 8 for m in metrics.values())
    ready = re.findall(r"\[q3tts\] ready: instance (\S+),", server.log_text())
    assert sorted(ready) == sorted(metrics)  # each model_instance label is an instance Triton started
    engines = engine_processes(server)
    assert sorted(engines.values()) == sorted(metrics), engines  # one engine process per instance


@pytest.mark.parametrize("sequence_id", [7_100_001, "pinned-string-id"])
def test_a_sequence_sent_in_pieces_seconds_apart_stays_on_its_instance(server, reference, sequence_id):
    assert set(open_sessions(server, 0).values()) == {0.0}  # the sessions of earlier requests are closed
    before = per_instance(server)
    holders = []

    def pieces():
        for i, piece in enumerate(PIECES):
            if i:
                time.sleep(GAP_S)
                holders.append(open_sessions(server, 1))  # the text is open: one session, on one instance
            yield piece

    r = synthesize(server.grpc_url, pieces(), VOICE, PARAMS, sequence_id=sequence_id, timeout_s=200)
    assert r.error is None and r.requests == len(PIECES) + 1 and r.finals == r.requests, r.error
    assert len(holders) == len(PIECES) - 1
    (home,) = [k for k, n in holders[0].items() if n == 1]
    assert all(h == {k: float(k == home) for k in before} for h in holders), holders
    audio = counters_after(server, before, "q3tts_audio_seconds_total", r.audio_s)
    assert audio == {k: pytest.approx(r.audio_s if k == home else 0.0) for k in before}
    started = deltas(before, per_instance(server), "q3tts_prefilled_sequences_total")
    assert started == {k: float(k == home) for k in before}
    assert np.array_equal(r.audio, reference.audio)  # every piece reached the engine that started it


def test_open_sequences_spread_evenly_over_the_instances(server):
    """Triton's `oldest` batcher gives a new sequence the lowest free slot index over all instances: with 4
    sequences open at once, 2 per instance."""
    params = {**PARAMS, "max_frames": 4}
    assert set(open_sessions(server, 0).values()) == {0.0}
    held = [HeldSequence(server.grpc_url, 7_200_000 + i, params) for i in range(2 * INSTANCES)]
    sessions = open_sessions(server, len(held))
    results = [h.result() for h in [h.release() for h in held]]
    assert sessions == {k: 2.0 for k in sessions} and len(sessions) == INSTANCES, sessions
    assert all(r.error is None and r.audio.size == 4 * P.SAMPLES_PER_FRAME for r in results), results


def test_one_request_sequences_spread_over_both_instances(server):
    """A START|END request frees its batcher slot as soon as Triton hands it over, so such sequences are not
    held apart by slots: the next one takes the lowest free slot, which alternates between the instances."""
    before, n = per_instance(server), 8
    results = [None] * n

    def one(i: int) -> None:
        results[i] = synthesize(server.grpc_url, [f"Number {i}."], VOICE, {"seed": i, "max_frames": 4})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(200)
    assert all(r is not None and r.error is None for r in results), [r and r.error for r in results]
    started = counters_after(server, before, "q3tts_prefilled_sequences_total", n)
    assert sum(started.values()) == n and min(started.values()) >= n // 4, started


def test_a_failing_instance_ends_only_its_own_sequences(server, reference):
    """One open sequence per instance, then a request whose engine step faults (fault_injection_seed): the
    sequences of the faulted instance end with one 'restarting' error each; the other instance's sequence,
    open across the fault, gets its remaining text and ends normally with the same audio as alone."""
    assert set(open_sessions(server, 0).values()) == {0.0}
    first = HeldSequence(server.grpc_url, 7_300_001)
    (first_home,) = [k for k, n in open_sessions(server, 1).items() if n == 1]
    second = HeldSequence(server.grpc_url, "isolation-second")
    sessions = open_sessions(server, 2)
    assert sessions == {k: 1.0 for k in sessions}, sessions  # the second one started on the other instance
    held = {first_home: first, **{k: second for k in sessions if k != first_home}}

    before = per_instance(server)
    faulty = synthesize(server.grpc_url, ["This request faults its engine."], VOICE,
                        {"seed": FAULT_SEED, "max_frames": 8}, timeout_s=200)
    assert faulty.error is not None and RESTARTING in faulty.error and faulty.finals <= 1, faulty.error
    faults = counters_after(server, before, "q3tts_device_faults_total", 1)  # the gauges follow loop ticks
    (faulted,) = [k for k, n in faults.items() if n == 1]
    (survivor,) = [k for k in faults if k != faulted]
    assert faults[survivor] == 0

    lost = held[faulted].release(more_text=False).result()
    assert lost.error is not None and RESTARTING in lost.error and lost.finals == lost.requests, lost.error
    kept = held[survivor].release().result()
    assert kept.error is None and kept.finals == kept.requests, kept.error
    assert np.array_equal(kept.audio, reference.audio)
    assert per_instance(server)[survivor]["q3tts_instance_ready"] == 1  # never stopped serving

    deadline = time.monotonic() + 120  # the faulted instance comes back with a new engine process
    while not server.is_ready() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.is_ready() and per_instance(server)[faulted]["q3tts_instance_restarts_total"] == 1
