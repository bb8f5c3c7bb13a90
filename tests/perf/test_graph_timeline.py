"""perf/graph_timeline.py: a profiler trace of graph replays read into idle time, overlap and kernel ranks, checked
on hand-made traces whose figures are worked out here, not by the code under test."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))
from graph_timeline import Kernel, kernel_events, split_replays, summarize, timeline_table  # noqa: E402


def event(name: str, ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": 7}}


# one replay: a [0, 10), b [15, 20), c [2, 8) beside a, then d [20.5, 30.5) right after a gap of 0.5 and
# e [43.5, 47.5) after a gap of 13. Busy: [0, 10) + [15, 20) + [20.5, 30.5) + [43.5, 47.5) = 29; span 47.5, idle
# 18.5 in three stretches (5, 0.5, 13); kernel time 10 + 5 + 6 + 10 + 4 = 35.
ONE = [("a", 0, 10), ("b", 15, 5), ("c", 2, 6), ("d", 20.5, 10), ("e", 43.5, 4)]


def trace(*replays: list[tuple[str, float, float]], gap: float = 5000.0, extra: list[dict] = ()) -> dict:
    events, t0 = list(extra), 0.0
    for replay in replays:
        events += [event(n, t0 + ts, d) for n, ts, d in replay]
        t0 += gap
    return {"traceEvents": events}


def test_only_kernel_events_are_read_in_start_order():
    t = trace(ONE, extra=[event("cudaGraphLaunch", 1, 50, cat="cuda_runtime"),
                          {"ph": "i", "cat": "kernel", "name": "marker", "ts": 3}])
    got = kernel_events(t)
    assert [k.name for k in got] == ["a", "c", "b", "d", "e"]
    assert got[0] == Kernel("a", 0.0, 10.0)


def test_replays_split_where_the_device_idles():
    got = split_replays(kernel_events(trace(ONE, ONE, ONE, gap=600.0)))
    assert [len(r) for r in got] == [5, 5, 5]
    # 13 µs of idle inside a replay does not split it; 500 µs does
    assert len(split_replays(kernel_events(trace(ONE, gap=600.0)), gap_us=13.0)) == 2


def test_busy_idle_overlap_and_gaps_of_one_replay():
    t = summarize(split_replays(kernel_events(trace(ONE))))
    assert t.replays == 1 and t.kernels == 5
    assert t.span == pytest.approx(47.5)
    assert t.busy == pytest.approx(29.0)
    assert t.idle == pytest.approx(18.5)
    assert t.kernel_time == pytest.approx(35.0)
    assert t.overlap == pytest.approx(35.0 / 29.0)
    assert t.gaps == [1, 0, 1, 1]  # 0.5 (< 2), none in 2-5, 5 (5-10), 13 (>= 10)


def test_medians_over_replays_and_kernels_ranked_by_time():
    slow = [("a", 0, 30), ("b", 40, 5)]  # a slower replay: span 45, busy 35
    t = summarize(split_replays(kernel_events(trace(ONE, ONE, slow))))
    assert t.replays == 3
    assert t.span == pytest.approx(47.5)  # median of 47.5, 47.5, 45
    assert t.busy == pytest.approx(29.0)  # median of 29, 29, 35
    assert t.kernels == 5
    # a: (10 + 10 + 30) / 3 a replay, 1 launch; d: 20 / 3 over 2 launches in 3 replays
    assert t.top[0] == ("a", 1.0, pytest.approx(50 / 3))
    assert t.top[1][0] == "d" and t.top[1][1] == pytest.approx(2 / 3) and t.top[1][2] == pytest.approx(20 / 3)
    assert [name for name, _, _ in t.top] == ["a", "d", "b", "c", "e"]


def test_table_names_the_figures():
    lines = timeline_table(summarize(split_replays(kernel_events(trace(ONE)))))
    # idle 18.5 of 47.5 µs; 35 µs of kernels over 29 busy
    assert "5 kernels" in lines[0] and "(38.9 %)" in lines[0] and "1.21 kernels at once" in lines[0]
    row = next(line for line in lines if line.startswith("| `a`"))
    # 10 µs a replay of 35 µs of kernel time
    assert row == "| `a` | 1 | 10.0 | 10.00 | 28.6 |"


def test_an_empty_trace_is_refused():
    with pytest.raises(AssertionError):
        summarize(split_replays(kernel_events({"traceEvents": []})))
