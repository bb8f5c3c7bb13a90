"""The TTFA anatomy: where one request's time to first audio went, from the client's send to its receipt.

The server stamps every stage of the first audio response (protocol.TIMING, stage names
`protocol.TIMING_STAGES`) on its time.monotonic(), which on Linux is CLOCK_MONOTONIC: one clock for every
process of a host (the engine process included) and the clock of the client's time.perf_counter(). So a
client on the server's host joins its own send and receipt times to the server's stamps; from another host
the first and last parts ("gRPC -> execute", "response -> client") are meaningless (only their sum is).

    parts = anatomy(result)          # a q3tts_client Result -> {part: seconds} (None without TIMING)
    table = anatomy_table(rows)      # rows with "level" and "anatomy" (medians in ms) -> markdown
    table = anatomy_table(rows, SLOWEST)  # the same of each level's slowest stream ("anatomy_slowest")
"""

from __future__ import annotations

import statistics

# (part, from stamp, to stamp) on the joined clock; "prefill_end" = prefill_start + prefill_device
PARTS = (
    ("gRPC -> execute", "sent", "arrival"),
    ("execute -> engine add", "arrival", "engine_add"),
    ("add -> prompt ready", "engine_add", "prompt_ready"),
    ("queue wait", "prompt_ready", "prefill_start"),
    ("prefill (device)", "prefill_start", "prefill_end"),
    ("first decode step", "prefill_end", "first_frame"),
    ("engine -> serving", "first_frame", "step_returned"),
    ("response built", "step_returned", "response_built"),
    ("response -> client", "response_built", "received"),
)
TOTAL = "TTFA"
MEDIANS, SLOWEST = "anatomy", "anatomy_slowest"  # row keys: medians_ms, slowest_ms
SERVING = "first frame -> client"  # issue 10's "serving overhead": first_frame -> received


def anatomy(result) -> dict[str, float] | None:
    """{part: seconds} of one stream (its parts add up to its TTFA), or None when it has no TIMING."""
    t = result.timing
    if t is None or result.sent_at is None or result.ttfa_s is None:
        return None
    arrival = t["arrival"]
    at = {name: arrival + t[name] for name in t if name != "arrival" and not name.endswith("_device")}
    at.update(sent=result.sent_at, arrival=arrival, received=result.sent_at + result.ttfa_s,
              prefill_end=arrival + t["prefill_start"] + t["prefill_device"])
    parts = {name: at[end] - at[start] for name, start, end in PARTS}
    parts[SERVING] = at["received"] - at["first_frame"]
    parts[TOTAL] = result.ttfa_s
    return parts


def medians_ms(parts: list[dict[str, float]]) -> dict[str, float] | None:
    """Per part, the median over streams, in ms (NaN parts, e.g. a stage the server did not stamp, skipped)."""
    if not parts:
        return None
    names = [name for name, _, _ in PARTS] + [SERVING, TOTAL]
    return {name: 1e3 * statistics.median(v) if (v := [p[name] for p in parts if p[name] == p[name]]) else None
            for name in names}


def slowest_ms(parts: list[dict[str, float]]) -> dict[str, float] | None:
    """The parts of the stream with the largest TTFA, in ms (NaN: None): where a level's worst first audio went,
    one slow phase or a stall that a median hides."""
    if not parts:
        return None
    worst = max(parts, key=lambda p: p[TOTAL])
    return {name: 1e3 * v if v == v else None for name, v in worst.items()}


def anatomy_table(rows: list[dict], key: str = MEDIANS) -> str:
    """Markdown: one line per row ("mode", "level", and `key`: MEDIANS = medians_ms, SLOWEST = slowest_ms), one
    column per part."""
    rows = [r for r in rows if r.get(key)]
    if not rows:
        return ""
    names = list(rows[0][key])
    title = {MEDIANS: "TTFA anatomy, medians (ms):", SLOWEST: "TTFA anatomy of each level's slowest stream (ms):"}
    lines = [title[key], "", "| mode | level | " + " | ".join(names) + " |", "|---|---:|" + "---:|" * len(names)]
    for r in rows:
        cells = ["-" if r[key][n] is None else f"{r[key][n]:.2f}" for n in names]
        lines.append(f"| {r['mode']} | {r['level']:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
