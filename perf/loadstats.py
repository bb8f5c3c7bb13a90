"""Per-request records of a load test and the numbers a level reports from them (no tritonclient, no torch).

A `Record` is one utterance as its client saw it: when it was due (open loop: its Poisson arrival; closed loop:
when it was sent), each audio chunk's arrival and the samples received by then, and when it ended.
`summarize(records, wall_s)` gives the level's statistics under the names of `report.CSV_COLUMNS` (plus a
few more for the tables). perf/bench_serve.py (our server), perf/peers/run.py (the peers) and
perf/pa_export.py (perf_analyzer's timestamps) all report through it, so every mode is measured one way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

# what every load test sends (our server and the peers): one utterance, one CustomVoice speaker
TEXT = ("Streaming speech synthesis should start talking almost at once and keep up with the listener, "
        "one frame after another, without a single gap.")
SPEAKER, LANGUAGE = "ryan", "english"
UNDERRUN_S = 1e-3  # a simulated player that waits longer than this for audio counts the stream as underrun


@dataclass
class Record:
    """One utterance. Times are time.perf_counter() seconds; `chunks` holds (arrival, samples so far)."""
    due: float
    done: float = math.nan
    chunks: list = field(default_factory=list)
    sample_rate: int = 24000
    finish: str | None = None
    error: str | None = None  # the request failed (server or client)
    bad: str | None = None    # what is wrong with the utterance (an error, or a check that failed)

    @property
    def ttfa_s(self) -> float | None:
        """Due -> first audio."""
        return self.chunks[0][0] - self.due if self.chunks else None

    @property
    def e2e_s(self) -> float:
        """Due -> the last response."""
        return self.done - self.due

    @property
    def audio_s(self) -> float:
        return self.chunks[-1][1] / self.sample_rate if self.chunks else 0.0

    @property
    def underrun(self) -> bool:
        """A player that starts at the first chunk and plays in real time ever waits > UNDERRUN_S."""
        if not self.chunks:
            return False
        played_until, prev = self.chunks[0][0], 0  # wall time the audio received so far runs out
        for t, samples in self.chunks:
            if t > played_until + UNDERRUN_S:
                return True
            played_until = max(played_until, t) + (samples - prev) / self.sample_rate
            prev = samples
        return False


def pct(xs: list[float], q: float) -> float:
    """The q-th percentile of xs (NaN for none)."""
    return float(np.percentile(xs, q)) if xs else math.nan


def peak_in_flight(records: list[Record]) -> int:
    """The most records open at once (due <= t < done)."""
    events = sorted([(r.due, 1) for r in records] + [(r.done, -1) for r in records], key=lambda e: (e[0], e[1]))
    peak = now = 0
    for _, step in events:
        now += step
        peak = max(peak, now)
    return peak


def summarize(records: list[Record], wall_s: float) -> dict:
    """A level's statistics: TTFA and end-to-end percentiles (ms) and RTF p50 over the records without an
    error, audio seconds per wall second over all of them, underrun streams, errors, bad, peak in-flight."""
    ok = [r for r in records if r.error is None]
    ttfa = [1e3 * r.ttfa_s for r in ok if r.ttfa_s is not None]
    e2e = [1e3 * r.e2e_s for r in ok]
    rtf = [r.e2e_s / r.audio_s for r in ok if r.audio_s]
    audio = sum(r.audio_s for r in ok)
    return {"streams": len(records), "errors": len(records) - len(ok), "bad": sum(1 for r in records if r.bad),
            "bad_reasons": sorted({r.bad for r in records if r.bad})[:5],
            "ttfa_p50_ms": pct(ttfa, 50), "ttfa_p90_ms": pct(ttfa, 90), "ttfa_p95_ms": pct(ttfa, 95),
            "ttfa_p99_ms": pct(ttfa, 99), "e2e_p50_ms": pct(e2e, 50), "e2e_p95_ms": pct(e2e, 95),
            "rtf_p50": pct(rtf, 50), "audio_s": audio, "audio_s_per_s": audio / wall_s if wall_s > 0 else math.nan,
            "underrun_streams": sum(1 for r in ok if r.underrun), "peak_in_flight": peak_in_flight(records),
            "wall_s": wall_s}
