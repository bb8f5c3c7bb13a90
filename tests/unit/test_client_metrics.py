"""client/metrics.py: a metrics page summed and per instance, and the TTFA breakdown from two scrapes."""

from __future__ import annotations

import http.server
import threading

import pytest

from q3tts_client.metrics import breakdown, scrape, scrape_by

PAGE = """# HELP q3tts_open_sessions Sequences the serving layer holds.
# TYPE q3tts_open_sessions gauge
q3tts_open_sessions{model="qwen3_tts",model_instance="qwen3_tts_0_0",version="1"} 2
q3tts_open_sessions{model="qwen3_tts",model_instance="qwen3_tts_0_1",version="1"} 1
q3tts_failed_requests_total{model="qwen3_tts",model_instance="qwen3_tts_0_1",reason="internal",version="1"} 3
q3tts_failed_requests_total{model="qwen3_tts",model_instance="qwen3_tts_0_1",reason="invalid_arg",version="1"} 4
nv_inference_count{model="qwen3_tts",version="1"} 9
"""


@pytest.fixture
def metrics_url():
    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(PAGE.encode())

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    server.shutdown()
    server.server_close()


def test_scrape_sums_over_labels_and_scrape_by_keeps_each_instance_apart(metrics_url):
    assert scrape(metrics_url) == {"q3tts_open_sessions": 3.0, "q3tts_failed_requests_total": 7.0}
    assert scrape_by(metrics_url) == {"qwen3_tts_0_0": {"q3tts_open_sessions": 2.0},
                                      "qwen3_tts_0_1": {"q3tts_open_sessions": 1.0, "q3tts_failed_requests_total": 7.0}}
    assert scrape_by(metrics_url, "reason") == {"": {"q3tts_open_sessions": 3.0},
                                                "internal": {"q3tts_failed_requests_total": 3.0},
                                                "invalid_arg": {"q3tts_failed_requests_total": 4.0}}


def test_breakdown_is_per_event_means_of_the_deltas():
    before = {"q3tts_prefilled_sequences_total": 4, "q3tts_prefill_steps_total": 2, "q3tts_prefill_seconds_total": 0.1,
              "q3tts_queue_wait_seconds_total": 1.0, "q3tts_decode_steps_total": 10, "q3tts_decode_seconds_total": 0.2,
              "q3tts_step_gaps_total": 9, "q3tts_step_gap_seconds_total": 0.01,
              "q3tts_engine_gc_full_passes_total": 1, "q3tts_engine_gc_full_pass_seconds_total": 0.1}
    after = {"q3tts_prefilled_sequences_total": 12, "q3tts_prefill_steps_total": 4, "q3tts_prefill_seconds_total": 0.14,
             "q3tts_queue_wait_seconds_total": 1.4, "q3tts_decode_steps_total": 30, "q3tts_decode_seconds_total": 0.5,
             "q3tts_step_gaps_total": 27, "q3tts_step_gap_seconds_total": 0.037,
             "q3tts_engine_gc_full_passes_total": 3, "q3tts_engine_gc_full_pass_seconds_total": 0.104}
    b = breakdown(before, after)
    assert b["queue_wait_ms"] == pytest.approx(50.0) and b["prefill_ms"] == pytest.approx(20.0)
    assert b["seqs_per_prefill"] == pytest.approx(4.0) and b["decode_ms"] == pytest.approx(15.0)
    assert b["gap_ms"] == pytest.approx(1.5) and b["gc_full_ms"] == pytest.approx(2.0)


def test_breakdown_without_events_is_none():
    assert set(breakdown({}, {}).values()) == {None}
