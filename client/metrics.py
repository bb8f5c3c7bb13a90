"""Read the server's q3tts_* metrics from Triton's Prometheus endpoint, and the TTFA breakdown they give.

`scrape(url)` sums every q3tts_* series over its labels (both models, every instance), `scrape_by(url)`
per engine instance (the `model_instance` label); `breakdown(before, after)` turns two scrapes into
per-event means: how long a sequence with a complete prompt waited for a slot, how long a prefill forward
took and how many sequences it started, how long a decode step took.
"""

from __future__ import annotations

import re
import urllib.request

_LINE = re.compile(r"^(q3tts_[a-z_]+)(\{[^}]*\})? ([0-9.eE+-]+)$")


def scrape(url: str, timeout_s: float = 5.0) -> dict[str, float]:
    """{metric name: value summed over labels} of the q3tts_* series at `url` (…:8002/metrics)."""
    out: dict[str, float] = {}
    for name, _, value in _series(url, timeout_s):
        out[name] = out.get(name, 0.0) + value
    return out


def scrape_by(url: str, label: str = "model_instance", timeout_s: float = 5.0) -> dict[str, dict[str, float]]:
    """{value of `label`: {metric name: value summed over the other labels}}: by default one entry per engine
    instance (on GPUs, one per GPU)."""
    out: dict[str, dict[str, float]] = {}
    for name, labels, value in _series(url, timeout_s):
        m = re.search(f'[{{,]{label}="([^"]*)"', labels)
        values = out.setdefault(m.group(1) if m else "", {})
        values[name] = values.get(name, 0.0) + value
    return out


def series(text: str):
    """(name, labels text, value) of each q3tts_* series of a Prometheus metrics page."""
    for line in text.splitlines():
        if m := _LINE.match(line):
            yield m.group(1), m.group(2) or "", float(m.group(3))


def _series(url: str, timeout_s: float):
    """`series` of the metrics page at `url`."""
    return series(urllib.request.urlopen(url, timeout=timeout_s).read().decode())


def breakdown(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Means over the work between two scrapes (None where nothing of that kind happened):
    queue_wait_ms per started sequence, prefill_ms per prefill forward, seqs_per_prefill, decode_ms per step,
    gap_ms per gap between consecutive steps (the device idle while the host handles a step's outputs),
    gc_full_ms per full garbage-collection pass of the engine process (a host pause in which no step launches)."""
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    def ratio(num: float, den: float, scale: float = 1.0) -> float | None:
        return num * scale / den if den > 0 else None

    started, prefills, decodes = (delta("q3tts_prefilled_sequences_total"), delta("q3tts_prefill_steps_total"),
                                  delta("q3tts_decode_steps_total"))
    return {"queue_wait_ms": ratio(delta("q3tts_queue_wait_seconds_total"), started, 1e3),
            "prefill_ms": ratio(delta("q3tts_prefill_seconds_total"), prefills, 1e3),
            "seqs_per_prefill": ratio(started, prefills),
            "decode_ms": ratio(delta("q3tts_decode_seconds_total"), decodes, 1e3),
            "gap_ms": ratio(delta("q3tts_step_gap_seconds_total"), delta("q3tts_step_gaps_total"), 1e3),
            "gc_full_ms": ratio(delta("q3tts_engine_gc_full_pass_seconds_total"),
                                delta("q3tts_engine_gc_full_passes_total"), 1e3)}
