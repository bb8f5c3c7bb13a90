"""What the served reliability tests do, on any device: the validation table against a running server with a
healthy stream beside it, and the heal path (an injected device fault while healthy streams play). Each returns
rows for `table()`, the printed summary (the GPU run's report)."""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from q3tts.serving.loop import RESTARTING
from q3tts_client.metrics import scrape
from q3tts_client.stream_client import Result, synthesize

VOICE = {"speaker": "ryan", "language": "english"}
TEXT = "Hello there, this is a long enough sentence for a stream that keeps playing for a while."
HEALTHY = {"greedy": True, "max_frames": 40}
FAULT_SEED = 4242  # EngineConfig.fault_injection_seed of the heal servers
HUGE = 1e30

# (request parameters, the parameter the error must name); strings travel as text and are read as numbers
BAD_CASES = [({name: value}, name) for name, values in {
    "temperature": (math.nan, math.inf, HUGE),
    "top_p": (math.nan, math.inf, 5.0),
    "repetition_penalty": (math.nan, math.inf, HUGE),
    "subtalker_temperature": (math.nan, -math.inf, HUGE),
    "subtalker_top_p": (math.nan, math.inf, 5.0),
    "seed": ("1" * 30, -1),
    "top_k": (-1, 10 ** 12),
    "subtalker_top_k": (-5, 10 ** 12),
    "max_frames": (0, 10 ** 9),
}.items() for value in values]


@dataclass
class Row:
    case: str
    outcome: str
    seconds: float | None = None


@dataclass
class Stream:
    """A healthy sequence played in a thread; `started` is set at its first audio."""

    url: str
    params: dict
    sequence_id: int
    started: threading.Event = field(default_factory=threading.Event)
    result: Result | None = None
    done_at: float | None = None

    def start(self) -> Stream:
        def play():
            self.result = synthesize(self.url, [TEXT], VOICE, self.params, sequence_id=self.sequence_id,
                                     on_chunk=lambda *_: self.started.set(), timeout_s=600)
            self.done_at = time.monotonic()
            self.started.set()

        self.thread = threading.Thread(target=play, daemon=True)
        self.thread.start()
        return self

    def wait(self, timeout_s: float = 600) -> Result:
        self.thread.join(timeout_s)
        assert self.result is not None, "the stream did not finish"
        return self.result


def validation_cases(url: str, reference: Result, healthy_params: dict = HEALTHY,
                     bit_exact: bool = True) -> list[Row]:
    """Every BAD_CASES request while a healthy stream (`healthy_params`) plays: each gets one error naming its
    parameter; the healthy stream ends normally with as many frames as `reference` (the same request played
    alone), and with its bits when `bit_exact` (the CPU: on the H200 the same request repeated alone already
    differs in bits, so there the table reports the difference instead)."""
    healthy = Stream(url, healthy_params, 900_001).start()
    assert healthy.started.wait(300), "the healthy stream never started"
    rows = []
    for i, (params, name) in enumerate(BAD_CASES):
        t0 = time.monotonic()
        r = synthesize(url, [TEXT], VOICE, params, sequence_id=900_100 + i, timeout_s=60)
        assert r.error is not None and f"'{name}'" in r.error and r.audio.size == 0, (params, r.error)
        assert r.finals == 0 or r.finals == 1, (params, r.finals)
        rows.append(Row(f"{name}={params[name]!r}", r.error.split(": ", 1)[-1][:70], time.monotonic() - t0))
    assert healthy.done_at is None, "the healthy stream ended before the last bad request: make it longer"
    result = healthy.wait()
    assert result.error is None and result.finals == 1
    assert result.audio.size == reference.audio.size, "the healthy stream was cut or lengthened"
    if bit_exact:
        assert np.array_equal(result.audio, reference.audio), "the healthy stream was touched"
    diff = float(np.abs(result.audio - reference.audio).max())
    rows.append(Row("healthy stream beside them", f"ended normally ({result.finish_reason}, "
                    f"{result.audio_s:.2f} s), max |diff| vs alone {diff:.3g}"))
    return rows


class ReadyWatch:
    """Samples `is_ready()` and the q3tts_instance_ready gauge every 50 ms from a thread."""

    def __init__(self, is_ready, metrics_url: str):
        self.samples: list[tuple[float, bool, float]] = []
        self._is_ready, self._url, self._stop = is_ready, metrics_url, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            gauge = scrape(self._url).get("q3tts_instance_ready", math.nan)
            self.samples.append((time.monotonic(), self._is_ready(), gauge))
            time.sleep(0.05)

    def ready_again_after(self, t0: float, timeout_s: float) -> float:
        """Seconds from t0 to the first ready sample after a not-ready one (waits up to timeout_s)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            after = [s for s in self.samples if s[0] >= t0]
            down = next((i for i, s in enumerate(after) if not s[1]), None)
            up = next((s for s in after[down:] if s[1]), None) if down is not None else None
            if up is not None:
                return up[0] - t0
            time.sleep(0.05)
        raise AssertionError(f"not ready again {timeout_s:.0f} s after the fault")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def heal(server, streams: int = 2, ready_timeout_s: float = 300) -> list[Row]:
    """An injected device fault (a request with FAULT_SEED) while `streams` healthy streams play: each of
    them and the faulty request get one 'restarting' error, readiness drops then returns, the counters
    move, and a new request streams audio."""
    before = scrape(server.metrics_url)
    assert before["q3tts_instance_ready"] >= 1 and server.is_ready()
    healthy = [Stream(server.grpc_url, {**HEALTHY, "max_frames": 400}, 910_000 + i).start() for i in range(streams)]
    for s in healthy:
        assert s.started.wait(300), "a healthy stream never started"
    watch = ReadyWatch(server.is_ready, server.metrics_url)
    t_fault = time.monotonic()
    faulty = synthesize(server.grpc_url, [TEXT], VOICE, {"seed": FAULT_SEED}, sequence_id=919_000, timeout_s=120)
    try:
        seconds = watch.ready_again_after(t_fault, ready_timeout_s)
    finally:
        watch.stop()
    rows = [Row("injected device fault: the faulty request", _outcome(faulty))]
    for s in healthy:
        r = s.wait()
        assert r.error is not None and RESTARTING in r.error and r.finals == 1 and r.audio.size > 0, r.error
        rows.append(Row(f"healthy stream {s.sequence_id}", _outcome(r)))
    assert faulty.error is not None and RESTARTING in faulty.error and faulty.finals <= 1
    not_ready = [s for s in watch.samples if not s[1]]
    assert not_ready and all(s[2] == 0 for s in not_ready if not math.isnan(s[2]) and s[0] > not_ready[0][0] + 0.2)
    after = synthesize(server.grpc_url, [TEXT], VOICE, {"greedy": True, "max_frames": 8}, timeout_s=120)
    assert after.error is None and after.audio.size > 0, after.error
    rows.append(Row("new request after recovery", f"streams audio ({after.finish_reason}, {after.audio_s:.2f} s)"))
    counters = scrape(server.metrics_url)
    for name in ("q3tts_device_faults_total", "q3tts_instance_restarts_total"):
        assert counters.get(name, 0) == before.get(name, 0) + 1, (name, before.get(name), counters.get(name))
    assert counters["q3tts_instance_ready"] >= 1
    rows.append(Row("fault -> READY", "NOT READY while recovering, READY after", seconds))
    return rows


def _outcome(r: Result) -> str:
    return f"one error after {r.audio_s:.2f} s of audio: {r.error}"[:110] if r.error else "no error"


def table(title: str, rows: list[Row]) -> str:
    lines = [f"\n{title}", "| case | outcome | seconds |", "|---|---|---|"]
    lines += [f"| {r.case} | {r.outcome} | {'' if r.seconds is None else f'{r.seconds:.2f}'} |" for r in rows]
    return "\n".join(lines)
