"""Custom Prometheus metrics on Triton's metrics endpoint (pb_utils.MetricFamily).

`pb` (the `triton_python_backend_utils` module) is passed in by model.py, so fakes test this module too.
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
| q3tts_prefill_seconds_total / q3tts_prefill_steps_total | counter | time in / number of prefill forwards |
| q3tts_prefilled_sequences_total | counter | sequences those forwards started |
| q3tts_decode_seconds_total / q3tts_decode_steps_total | counter | time in / number of batched decode steps |
| q3tts_queue_wait_seconds_total | counter | complete prompt -> started, summed over started sequences |
| q3tts_voice_cache_entries / q3tts_voice_cache_capacity | gauge | registered voices held resolved / the LRU bound |
| q3tts_voice_cache_hits_total / q3tts_voice_cache_misses_total | counter | VOICE inputs served from / read into it |
| q3tts_instance_ready | gauge | 1 = the instance serves; 0 = restarting after a device fault (strict readiness) |
| q3tts_device_faults_total / q3tts_instance_restarts_total | counter | device faults / recoveries since load |

The step counters are GPU time on a GPU (CUDA events), wall time on CPU; with the TTFA histogram they split
time to first audio into queue wait, prefill and the first decode step.
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
    "q3tts_voice_cache_entries": "voice_cache_entries",  # VoiceCache.stats(), merged in by the engine loop
    "q3tts_voice_cache_capacity": "voice_cache_capacity",
    "q3tts_instance_ready": "instance_ready",  # EngineLoop.health, merged in by the engine loop
}


COUNTERS = {  # metric name -> cumulative Engine.stats() key (sent to Triton as increments at each tick)
    "q3tts_prefill_seconds_total": "prefill_seconds",
    "q3tts_prefill_steps_total": "prefill_steps",
    "q3tts_prefilled_sequences_total": "prefilled_sequences",
    "q3tts_decode_seconds_total": "decode_seconds",
    "q3tts_decode_steps_total": "decode_steps",
    "q3tts_queue_wait_seconds_total": "queue_wait_seconds",
    "q3tts_voice_cache_hits_total": "voice_cache_hits",
    "q3tts_voice_cache_misses_total": "voice_cache_misses",
    "q3tts_device_faults_total": "device_faults",
    "q3tts_instance_restarts_total": "instance_restarts",
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
        self.counters = {name: family(name, pb.MetricFamily.COUNTER, name.replace("_", " ")).Metric(labels=labels)
                         for name in COUNTERS}
        self._last: dict[str, float] = {}

    def update(self, stats: dict, open_sessions: int) -> None:
        values = {name: float(stats.get(key, 0) if key else open_sessions) for name, key in GAUGES.items()}
        for name, value in values.items():
            if self._last.get(name) != value:
                self.gauges[name].set(value)
                self._last[name] = value
        for name, key in COUNTERS.items():
            total, last = float(stats.get(key, 0)), self._last.get(name, 0.0)
            if total < last:  # a new engine (after a device fault) counts from 0 again
                last = 0.0
            if total > last:
                self.counters[name].increment(total - last)
            self._last[name] = total

    def finalize(self) -> None:
        self.gauges.clear()
        self.counters.clear()
        self._families.clear()
