"""Custom Prometheus metrics on Triton's metrics endpoint (pb_utils.MetricFamily).

`pb` (the `triton_python_backend_utils` module) is passed in: only triton_model.py imports it.
Each metric carries the labels {model, version, instance}. Gauges are refreshed from `Engine.stats()` by the
engine thread's periodic tick (each update is an IPC round trip, so never per frame).

| metric | kind | meaning |
|---|---|---|
| q3tts_time_to_first_audio_seconds | histogram | START request received -> first audio response queued |
| q3tts_audio_seconds_total | counter | seconds of audio sent |
| q3tts_active_sequences | gauge | sequences running in the engine |
| q3tts_queued_sequences | gauge | sequences admitted but waiting for a slot |
| q3tts_open_sessions | gauge | sequences the serving layer holds (incl. waiting for text) |
| q3tts_kv_pages_used / q3tts_kv_pages_total | gauge | KV cache pages |
| q3tts_slots_used / q3tts_slots_total | gauge | engine state slots |
| q3tts_rejected_requests_total | counter | requests refused (bad input, admission, unknown sequence) |
"""

from __future__ import annotations

TTFA_BUCKETS = [0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0]
GAUGES = {  # metric name -> Engine.stats() key (None = set by the serving layer)
    "q3tts_active_sequences": "active",
    "q3tts_queued_sequences": "queued",
    "q3tts_open_sessions": None,
    "q3tts_kv_pages_used": "kv_pages_used",
    "q3tts_kv_pages_total": "kv_pages_total",
    "q3tts_slots_used": "slots_used",
    "q3tts_slots_total": "slots_total",
}


class ServingMetrics:
    def __init__(self, pb, labels: dict[str, str]):
        self._families = []

        def family(name, kind, desc):
            fam = pb.MetricFamily(name=name, description=desc, kind=kind)
            self._families.append(fam)
            return fam

        ttfa = family("q3tts_time_to_first_audio_seconds", pb.MetricFamily.HISTOGRAM,
                      "START request received -> first audio response queued")
        self.ttfa = ttfa.Metric(labels=labels, buckets=TTFA_BUCKETS)
        self.audio_seconds = family("q3tts_audio_seconds_total", pb.MetricFamily.COUNTER,
                                    "seconds of audio sent").Metric(labels=labels)
        self.rejected = family("q3tts_rejected_requests_total", pb.MetricFamily.COUNTER,
                               "requests refused (bad input, admission, unknown sequence)").Metric(labels=labels)
        self.gauges = {name: family(name, pb.MetricFamily.GAUGE, name.replace("_", " ")).Metric(labels=labels)
                       for name in GAUGES}
        self._last: dict[str, float] = {}

    def update(self, stats: dict, open_sessions: int) -> None:
        values = {name: float(stats.get(key, 0) if key else open_sessions) for name, key in GAUGES.items()}
        for name, value in values.items():
            if self._last.get(name) != value:
                self.gauges[name].set(value)
                self._last[name] = value

    def finalize(self) -> None:
        self.gauges.clear()
        self._families.clear()
