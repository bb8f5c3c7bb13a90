"""client/metrics.py: the TTFA breakdown from two scrapes of the counters."""

from __future__ import annotations

import pytest

from q3tts_client.metrics import breakdown


def test_breakdown_is_per_event_means_of_the_deltas():
    before = {"q3tts_prefilled_sequences_total": 4, "q3tts_prefill_steps_total": 2, "q3tts_prefill_seconds_total": 0.1,
              "q3tts_queue_wait_seconds_total": 1.0, "q3tts_decode_steps_total": 10, "q3tts_decode_seconds_total": 0.2}
    after = {"q3tts_prefilled_sequences_total": 12, "q3tts_prefill_steps_total": 4, "q3tts_prefill_seconds_total": 0.14,
             "q3tts_queue_wait_seconds_total": 1.4, "q3tts_decode_steps_total": 30, "q3tts_decode_seconds_total": 0.5}
    b = breakdown(before, after)
    assert b["queue_wait_ms"] == pytest.approx(50.0) and b["prefill_ms"] == pytest.approx(20.0)
    assert b["seqs_per_prefill"] == pytest.approx(4.0) and b["decode_ms"] == pytest.approx(15.0)


def test_breakdown_without_events_is_none():
    assert set(breakdown({}, {}).values()) == {None}
