"""Custom Prometheus metrics on Triton's metrics endpoint (pb_utils.MetricFamily).

`pb` (the `triton_python_backend_utils` module) is passed in by model.py, so fakes test this module too.
Labels: {model, version, model_instance} (not `instance`: Prometheus sets that label to the scraped target),
plus `reason` on q3tts_failed_requests_total. Gauges are refreshed from `Engine.stats()` by the engine
thread's periodic tick (each update is an IPC round trip, so never per frame). Counters end in `_total`,
gauges never do. The table below is `python -m q3tts.serving.metrics` (README "Metrics").

The step counters are GPU time on a GPU (CUDA events), wall time on CPU; with the TTFA histogram they split
time to first audio into queue wait, prefill and the first decode step.
"""

from __future__ import annotations

TTFA_BUCKETS = [0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0]
HISTOGRAMS = {
    "q3tts_time_to_first_audio_seconds": "Seconds from a START request's arrival to its first audio response.",
}
GAUGES = {  # name -> (Engine.stats() key, None = set by the serving layer; HELP)
    "q3tts_active_sequences": ("active", "Sequences running in the engine."),
    "q3tts_queued_sequences": ("queued", "Sequences admitted with a complete prompt, waiting for a slot."),
    "q3tts_open_sessions": (None, "Sequences the serving layer holds, including those waiting for text."),
    "q3tts_kv_pages_used": ("kv_pages_used", "KV cache pages in use."),
    "q3tts_kv_pages_capacity": ("kv_pages_total", "KV cache pages of the instance."),
    "q3tts_slots_used": ("slots_used", "Engine state slots in use."),
    "q3tts_slots_capacity": ("slots_total", "Engine state slots of the instance (= max_candidate_sequences)."),
    "q3tts_voice_cache_entries": ("voice_cache_entries", "Base voices kept prepared on the engine's device "
                                  "(x-vector, reference codes, primed codec stream; LRU)."),
    "q3tts_voice_cache_bytes": ("voice_cache_bytes", "Device bytes the voice cache holds."),
    "q3tts_voice_cache_capacity_bytes": ("voice_cache_capacity_bytes", "Device bytes the voice cache holds at "
                                         "most (engine setting voice_cache_bytes)."),
    "q3tts_instance_ready": ("instance_ready", "1 when the instance serves, 0 while it restarts after a device "
                             "fault (strict readiness: Triton's own ready endpoint cannot show this)."),
    "q3tts_server_resident_bytes": ("server_resident_bytes", "Resident memory of the tritonserver process (it "
                                    "grows where Triton 2.51 leaks: serving/health.py)."),
    "q3tts_server_memory_budget_bytes": ("server_memory_budget_bytes", "The server's memory budget "
                                         "(max_server_memory_gib; 0 = none): over it, the health probe says "
                                         "not ready."),
}
COUNTERS = {  # name -> (cumulative Engine.stats() key, sent to Triton as increments at each tick; HELP)
    "q3tts_audio_seconds_total": (None, "Seconds of audio sent to clients."),
    "q3tts_prefill_seconds_total": ("prefill_seconds", "Seconds spent in prefill forwards."),
    "q3tts_prefill_steps_total": ("prefill_steps", "Prefill forwards run."),
    "q3tts_prefilled_sequences_total": ("prefilled_sequences", "Sequences started by prefill forwards."),
    "q3tts_decode_seconds_total": ("decode_seconds", "Seconds spent in batched decode steps."),
    "q3tts_decode_steps_total": ("decode_steps", "Batched decode steps run."),
    "q3tts_step_gap_seconds_total": ("step_gap_seconds", "Seconds the device idled between consecutive steps "
                                     "while the engine had work (the host's turn: outputs, scheduling)."),
    "q3tts_step_gaps_total": ("step_gaps", "Gaps between consecutive steps counted in q3tts_step_gap_seconds_total."),
    "q3tts_engine_gc_full_passes_total": ("gc_full_passes", "Full (generation 2) passes of Python's garbage "
                                          "collector in the engine process: host pauses in which no step "
                                          "launches (its start's objects are frozen out of them)."),
    "q3tts_engine_gc_full_pass_seconds_total": ("gc_full_pass_seconds", "Seconds the engine process spent in the "
                                                "passes counted in q3tts_engine_gc_full_passes_total."),
    "q3tts_queue_wait_seconds_total": ("queue_wait_seconds", "Seconds from a complete prompt to its start, "
                                       "summed over started sequences."),
    "q3tts_voice_cache_hits_total": ("voice_cache_hits", "Base sequences whose voice the cache kept (no "
                                     "upload, no priming)."),
    "q3tts_voice_cache_misses_total": ("voice_cache_misses", "Base voices prepared on the device, off the engine "
                                       "thread (kept while they fit)."),
    "q3tts_device_faults_total": ("device_faults", "Device faults (poisoned CUDA context, engine process "
                                  "died) since the model loaded."),
    "q3tts_instance_restarts_total": ("instance_restarts", "Engine processes restarted after a device fault."),
    "q3tts_failed_requests_total": (None, "Requests that ended with an error, by the error code the client got "
                                    "(label reason: invalid_arg, unavailable, cancelled, internal, ...)."),
}


class ServingMetrics:
    """The q3tts_* metric families of one model instance; `labels` = {model, version, model_instance}."""

    def __init__(self, pb, labels: dict[str, str]):
        self._labels = labels
        kinds = {pb.MetricFamily.HISTOGRAM: HISTOGRAMS, pb.MetricFamily.GAUGE: GAUGES,
                 pb.MetricFamily.COUNTER: COUNTERS}
        self._families = {name: pb.MetricFamily(name=name, description=_help(spec), kind=kind)
                          for kind, table in kinds.items() for name, spec in table.items()}
        self.ttfa = self._families["q3tts_time_to_first_audio_seconds"].Metric(labels=labels, buckets=TTFA_BUCKETS)
        self.audio_seconds = self._families["q3tts_audio_seconds_total"].Metric(labels=labels)
        self.gauges = {name: self._families[name].Metric(labels=labels) for name in GAUGES}
        self.counters = {name: self._families[name].Metric(labels=labels)
                         for name, (key, _) in COUNTERS.items() if key}
        self.failures: dict[str, object] = {}  # error code -> its labelled q3tts_failed_requests_total
        self._last: dict[str, float] = {}

    def failed(self, code: str) -> None:
        """Count one request that ended with the Triton error `code` (e.g. "INVALID_ARG")."""
        reason = code.lower()
        if reason not in self.failures:
            family = self._families["q3tts_failed_requests_total"]
            self.failures[reason] = family.Metric(labels={**self._labels, "reason": reason})
        self.failures[reason].increment(1)

    def update(self, stats: dict, open_sessions: int) -> None:
        values = {name: float(stats.get(key, 0) if key else open_sessions) for name, (key, _) in GAUGES.items()}
        for name, value in values.items():
            if self._last.get(name) != value:
                self.gauges[name].set(value)
                self._last[name] = value
        for name, (key, _) in COUNTERS.items():
            if key is None:
                continue
            total, last = float(stats.get(key, 0)), self._last.get(name, 0.0)
            if total < last:  # a new engine (after a device fault) counts from 0 again
                last = 0.0
            if total > last:
                self.counters[name].increment(total - last)
            self._last[name] = total

    def finalize(self) -> None:
        self.gauges.clear()
        self.counters.clear()
        self.failures.clear()
        self._families.clear()


def _help(spec: str | tuple) -> str:
    return spec if isinstance(spec, str) else spec[1]


def markdown_table() -> str:
    """The README's metrics table: name, type, HELP text."""
    rows = ["| metric | type | meaning |", "|---|---|---|"]
    for kind, table in (("histogram", HISTOGRAMS), ("gauge", GAUGES), ("counter", COUNTERS)):
        rows += [f"| `{name}` | {kind} | {_help(spec)} |" for name, spec in table.items()]
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
