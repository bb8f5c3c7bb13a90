"""The numbers the load tests report, on hand-made inputs: perf/loadstats.py (TTFA, underrun, peak in-flight),
perf/pa_export.py (a perf_analyzer profile export) and perf/plots.py (ours / theirs)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))
import pa_export  # noqa: E402
import plots  # noqa: E402
from loadstats import Record, peak_in_flight, summarize  # noqa: E402
from report import append_csv, read_csv  # noqa: E402

SR = 24000


def test_record_times_and_underrun():
    # due 10.0; 0.5 s of audio at 10.2, the next 0.5 s at 10.6 (in time: the first plays until 10.7)
    steady = Record(due=10.0, done=10.9, chunks=[(10.2, SR // 2), (10.6, SR)])
    assert steady.ttfa_s == pytest.approx(0.2) and steady.e2e_s == pytest.approx(0.9) and steady.audio_s == 1.0
    assert not steady.underrun
    late = Record(due=10.0, done=11.0, chunks=[(10.2, SR // 2), (10.75, SR)])  # 50 ms after the audio ran out
    assert late.underrun
    assert Record(due=0.0, done=1.0).ttfa_s is None and not Record(due=0.0, done=1.0).underrun


def test_summarize_counts_errors_apart_and_peak_in_flight():
    ok = [Record(due=0.0, done=2.0, chunks=[(0.1, SR)]), Record(due=1.0, done=2.5, chunks=[(1.3, 2 * SR)])]
    failed = Record(due=1.5, done=1.6, error="boom", bad="error: boom")
    s = summarize(ok + [failed], wall_s=3.0)
    assert (s["streams"], s["errors"], s["bad"]) == (3, 1, 1)
    assert s["ttfa_p50_ms"] == pytest.approx(200.0)  # the failed one has no TTFA
    assert s["audio_s_per_s"] == pytest.approx(1.0)  # 3 s of audio over 3 s
    assert s["rtf_p50"] == pytest.approx((2.0 / 1 + 1.5 / 2) / 2)
    assert peak_in_flight(ok + [failed]) == 3  # at t = 1.5 all three are open


def _response(t_ns: int, samples: int, first: int, finish: str = "") -> tuple[int, dict]:
    return t_ns, {"SAMPLE_RATE": SR, "FIRST_FRAME": first, "FINISH_REASON": finish, "ERROR": "",
                  "AUDIO": [0.1] * samples, "AUDIO_INT16": [7] * 3}


def test_pa_export_builds_one_record_per_sequence(tmp_path):
    ms = 1_000_000
    ack = {"SAMPLE_RATE": -2080374640, "FIRST_FRAME": 0, "FINISH_REASON": "", "ERROR": "", "AUDIO": [1.0] * 9}
    data_1, data_2 = _response(1_180 * ms, 1920, 0), _response(1_400 * ms, 3840, 1, "max_frames")
    requests = [  # one sequence: an acked text step (its leftover AUDIO must not count), then END with audio
        {"timestamp": 1_000 * ms, "sequence_id": 7, "response_timestamps": [1_010 * ms], "response_outputs": [ack]},
        {"timestamp": 1_020 * ms, "sequence_id": 7, "response_timestamps": [data_1[0], data_2[0]],
         "response_outputs": [data_1[1], data_2[1]]},
    ]
    export = tmp_path / "pa_c1.json"
    export.write_text(json.dumps({"experiments": [{"experiment": {"mode": "concurrency", "value": 1},
                                                   "requests": requests,
                                                   "window_boundaries": [990 * ms, 1_990 * ms]}]}))
    (row,) = pa_export.rows_of(export)
    assert (row["mode"], row["level"], row["streams"], row["errors"]) == ("perf_analyzer", 1, 1, 0)
    assert row["ttfa_p50_ms"] == pytest.approx(180.0) and row["e2e_p50_ms"] == pytest.approx(400.0)
    assert row["audio_s_per_s"] == pytest.approx(5760 / SR / 1.0)


def test_ratio_table_is_ours_over_theirs_at_the_peer_level(tmp_path):
    path = tmp_path / "r.csv"
    base = {"ttfa_p95_ms": 1.0, "ttfa_p99_ms": 1.0, "e2e_p95_ms": 1.0, "underrun_streams": 0, "streams": 4, "errors": 0}
    append_csv(path, [{**base, "mode": "closed", "level": 1, "ttfa_p50_ms": 100.0, "rtf_p50": 0.2, "audio_s_per_s": 5.0},
                      {**base, "mode": "closed", "level": 64, "ttfa_p50_ms": 300.0, "rtf_p50": 0.3, "audio_s_per_s": 200.0},
                      {**base, "mode": "peer:x", "level": 1, "ttfa_p50_ms": 400.0, "rtf_p50": 0.1, "audio_s_per_s": 10.0}],
               gpu="test-gpu")
    rows = read_csv([path])
    assert [r["gpu"] for r in rows] == ["test-gpu"] * 3
    (line,) = [ln for ln in plots.ratio_table(rows).splitlines() if ln.startswith("| x |")]
    assert line == "| x | 1 | 100.0 / 400.0 | 0.25 | 0.200 / 0.100 | 2.00 | 5.00 / 10.00 | 0.50 |"
    written = plots.plot(rows, tmp_path / "png", "test")
    assert tmp_path / "png" / "ours_vs_peers.png" in written


def test_read_csv_names_a_file_with_other_columns(tmp_path):
    bad = tmp_path / "other.csv"
    bad.write_text("mode,level\nclosed,1\n")
    with pytest.raises(ValueError, match="other.csv"):
        read_csv([bad])
