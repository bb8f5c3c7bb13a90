"""The q3tts_* metrics follow Prometheus conventions (no `_total` on gauges, `_total` on every counter, real
HELP text, `model_instance` rather than `instance`, failed requests counted by reason), and the README's
metrics table is the module's own."""

from __future__ import annotations

import re
from pathlib import Path

from q3tts.serving import metrics as M

README = Path(__file__).resolve().parents[2] / "README.md"
LABELS = {"model": "qwen3_tts", "version": "1", "model_instance": "qwen3_tts_0"}


class FakePb:
    """Records every family and every labelled series created on it."""

    class MetricFamily:
        COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
        made: list = []

        def __init__(self, name, description, kind):
            self.name, self.description, self.kind = name, description, kind
            self.series = []
            FakePb.MetricFamily.made.append(self)

        def Metric(self, labels=None, buckets=None):
            series = FakeSeries(labels)
            self.series.append(series)
            return series


class FakeSeries:
    def __init__(self, labels):
        self.labels, self.value = labels, 0.0

    def increment(self, v):
        self.value += v

    def set(self, v):
        self.value = v


def families() -> dict[str, FakePb.MetricFamily]:
    FakePb.MetricFamily.made = []
    m = M.ServingMetrics(FakePb, LABELS)
    return m, {f.name: f for f in FakePb.MetricFamily.made}


def test_names_kinds_and_help_follow_prometheus_conventions():
    _, fams = families()
    assert fams and all(name.startswith("q3tts_") for name in fams)
    for name, fam in fams.items():
        assert fam.name.endswith("_total") == (fam.kind == "counter"), name
        words = fam.description.rstrip(".").split()
        assert fam.description.endswith(".") and len(words) >= 3, f"{name}: HELP {fam.description!r}"
        assert fam.description.lower() != name.replace("_", " ")
    assert {"q3tts_kv_pages_capacity", "q3tts_slots_capacity"} <= set(fams)


def test_every_series_has_model_instance_and_never_instance():
    _, fams = families()
    for fam in fams.values():
        for series in fam.series:
            assert "instance" not in series.labels and series.labels["model_instance"] == "qwen3_tts_0"


def test_failed_requests_are_counted_by_reason():
    m, fams = families()
    m.failed("INVALID_ARG")
    m.failed("INVALID_ARG")
    m.failed("UNAVAILABLE")
    series = {s.labels["reason"]: s.value for s in fams["q3tts_failed_requests_total"].series}
    assert series == {"invalid_arg": 2.0, "unavailable": 1.0}
    assert all(s.labels["model_instance"] == "qwen3_tts_0" for s in fams["q3tts_failed_requests_total"].series)


def test_readme_metrics_table_is_the_modules():
    block = re.search(r"<!-- metrics:begin -->\n(.*?)\n<!-- metrics:end -->", README.read_text(), re.S)
    assert block is not None, "README.md has no metrics block"
    assert block.group(1) == M.markdown_table()
