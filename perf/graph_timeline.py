"""The decode step as the GPU ran it: the kernels of a few CUDA graph replays, from a torch.profiler trace.

The component timings of perf/profile_step.py time each part in a graph of its own, and its kernel table
traces one eager step. Neither says how the engine's own step graph spends its time on the device: how much
of a replay no kernel runs at all (the dependent launches' gaps: the part that fewer, longer launches or
programmatic launch could win back), how much of it two branches overlap (the codec beside the talker
half), and what each kernel takes inside the graph, beside the others, at the step's real sizes. This
reads that from the profiler's Chrome trace of the replays:

    kernels = kernel_events(trace)          # the trace's "kernel" events: name, start, duration (µs)
    replays = split_replays(kernels)        # one list a replay (the caller idles the device between them)
    t = summarize(replays)                  # medians over the replays, kernels ranked by time a replay
    lines = timeline_table(t)               # markdown

CUPTI places a graph's kernels on streams of the graph executor's choosing, so streams are not read:
"busy" is the union of the kernels' intervals, "idle" the rest of the replay's span, "overlap" how many
kernels run at once on average while one does (sum of durations / busy).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import NamedTuple

REPLAY_GAP_US = 500.0  # an idle stretch this long separates two replays (the caller sleeps between them)
GAP_BOUNDS_US = (2.0, 5.0, 10.0)  # idle stretches inside a replay, counted below / between / above these


class Kernel(NamedTuple):
    name: str
    start: float  # µs
    dur: float    # µs


@dataclass
class Timeline:
    """Medians over the replays (µs unless named), and the kernels ranked by their time a replay."""

    replays: int
    kernels: float      # kernels a replay
    span: float         # first kernel start to last kernel end
    busy: float         # at least one kernel running
    idle: float         # span - busy: no kernel running
    kernel_time: float  # sum of the kernels' durations
    overlap: float      # kernel_time / busy: kernels running at once while one does
    gaps: list[float]   # idle stretches a replay, by GAP_BOUNDS_US bucket (len(GAP_BOUNDS_US) + 1)
    top: list[tuple[str, float, float]]  # (name, launches a replay, µs a replay), most time first


def kernel_events(trace: dict) -> list[Kernel]:
    """The kernels of a torch.profiler Chrome trace (`export_chrome_trace`, loaded): events of category
    "kernel" with a duration, by start time."""
    events = [Kernel(e["name"], float(e["ts"]), float(e["dur"])) for e in trace.get("traceEvents", [])
              if e.get("cat") == "kernel" and e.get("ph") == "X" and "dur" in e]
    return sorted(events, key=lambda k: k.start)


def split_replays(kernels: list[Kernel], gap_us: float = REPLAY_GAP_US) -> list[list[Kernel]]:
    """Kernels (by start) -> one list a replay: a replay ends where no kernel runs for `gap_us`."""
    replays: list[list[Kernel]] = []
    end = None
    for k in kernels:
        if end is None or k.start - end >= gap_us:
            replays.append([])
        replays[-1].append(k)
        end = k.start + k.dur if end is None else max(end, k.start + k.dur)
    return replays


def _busy_and_gaps(replay: list[Kernel]) -> tuple[float, list[float]]:
    """(the union of the kernels' intervals, the idle stretches between its pieces), µs."""
    busy, gaps = 0.0, []
    lo = hi = None
    for k in replay:  # by start
        if hi is None or k.start > hi:
            if hi is not None:
                busy += hi - lo
                gaps.append(k.start - hi)
            lo, hi = k.start, k.start + k.dur
        else:
            hi = max(hi, k.start + k.dur)
    if hi is not None:
        busy += hi - lo
    return busy, gaps


def _bucket(gap: float) -> int:
    return sum(gap >= b for b in GAP_BOUNDS_US)


def summarize(replays: list[list[Kernel]], top: int = 15) -> Timeline:
    """`Timeline` of the replays (at least one)."""
    assert replays, "no replay in the trace"
    per = []
    by_name: dict[str, list[float]] = {}
    for replay in replays:
        busy, gaps = _busy_and_gaps(replay)
        span = max(k.start + k.dur for k in replay) - replay[0].start
        counts = [0] * (len(GAP_BOUNDS_US) + 1)
        for g in gaps:
            counts[_bucket(g)] += 1
        total = sum(k.dur for k in replay)
        per.append((len(replay), span, busy, span - busy, total, total / busy, counts))
        for k in replay:
            by_name.setdefault(k.name, []).append(k.dur)
    med = lambda i: statistics.median(p[i] for p in per)  # noqa: E731
    n = len(replays)
    ranked = sorted(((name, len(d) / n, sum(d) / n) for name, d in by_name.items()), key=lambda t: -t[2])
    gaps = [statistics.median(p[6][b] for p in per) for b in range(len(GAP_BOUNDS_US) + 1)]
    return Timeline(n, med(0), med(1), med(2), med(3), med(4), med(5), gaps, ranked[:top])


def timeline_table(t: Timeline, name_width: int = 80) -> list[str]:
    """Markdown: the replay summary line, the idle stretches by length, then the kernels ranked by time."""
    edges = ["< %g" % GAP_BOUNDS_US[0]] + [f"{a:g}-{b:g}" for a, b in zip(GAP_BOUNDS_US, GAP_BOUNDS_US[1:])] \
        + ["≥ %g" % GAP_BOUNDS_US[-1]]
    lines = [f"{t.replays} replays, medians: {t.kernels:.0f} kernels, span {t.span / 1e3:.3f} ms, busy "
             f"{t.busy / 1e3:.3f} ms (kernel time {t.kernel_time / 1e3:.3f}), idle {t.idle / 1e3:.3f} ms "
             f"({100 * t.idle / t.span:.1f} %), {t.overlap:.2f} kernels at once while busy",
             "", "| idle stretches a replay, µs | " + " | ".join(edges) + " |",
             "|---|" + "---:|" * len(edges),
             "| count | " + " | ".join(f"{g:.0f}" for g in t.gaps) + " |",
             "", "| kernel (in the graph) | launches a replay | µs a replay | µs a launch | % of kernel time |",
             "|---|---:|---:|---:|---:|"]
    for name, launches, us in t.top:
        short = (name if len(name) <= name_width else name[:name_width - 3] + "...").replace("|", "/")
        lines.append(f"| `{short}` | {launches:.0f} | {us:.1f} | {us / launches:.2f} | "
                     f"{100 * us / t.kernel_time:.1f} |")
    return lines
