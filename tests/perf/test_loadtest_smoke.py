"""CPU smoke of the load-test scripts against one real tritonserver (tiny checkpoint): the closed and open
modes of perf/bench_serve.py, perf/run_perf_analyzer.sh, the results CSV they append to and perf/plots.py."""

from __future__ import annotations

import csv
import datetime
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.server.conftest import server, tiny_checkpoint  # noqa: F401 - the module's server

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
# the issue's columns, written out here so that a change in perf/report.py cannot pass unnoticed
COLUMNS = ["mode", "level", "ttfa_p50_ms", "ttfa_p95_ms", "ttfa_p99_ms", "e2e_p95_ms", "rtf_p50", "audio_s_per_s",
           "underrun_streams", "streams", "errors", "gpu", "commit", "date"]
RATE, DURATION_S, ARRIVAL_SEED = 2.0, 2.0, 3


def run(cmd: list[str], **env) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", **env})
    assert out.returncode == 0, f"{cmd[:2]} rc {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def read(path: Path) -> tuple[list[str], list[dict]]:
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames), list(reader)


@pytest.fixture(scope="module")
def results(server, tmp_path_factory):  # noqa: F811
    """One closed + open bench and one perf_analyzer run, all into one CSV."""
    out = tmp_path_factory.mktemp("loadtest")
    csv_path = out / "loadtest.csv"
    run([sys.executable, "perf/bench_serve.py", "--url", server.grpc_url, "--concurrency", "1,2", "--requests", "1",
         "--rates", str(RATE), "--duration-s", str(DURATION_S), "--arrival-seed", str(ARRIVAL_SEED),
         "--max-frames", "2", "--modes", "sampled", "--check", "--csv", str(csv_path), "--md", str(out / "bench.md")])
    pa = run(["bash", "perf/run_perf_analyzer.sh"], GRPC_URL=server.grpc_url, CONCURRENCY="1", SEQUENCES_PER_STREAM="1",
             MAX_FRAMES="2", OUT=str(out / "pa"), CSV=str(csv_path), PY=sys.executable)
    return {"dir": out, "csv": csv_path, "pa_stdout": pa.stdout}


def test_results_csv_has_the_issue_columns_and_one_row_per_level(results):
    header, rows = read(results["csv"])
    assert header == COLUMNS
    assert [(r["mode"], r["level"]) for r in rows] == [("closed", "1"), ("closed", "2"), ("open", "2"),
                                                       ("perf_analyzer", "1")]
    for r in rows:
        assert r["errors"] == "0" and r["gpu"] == "cpu" and r["commit"]
        datetime.datetime.strptime(r["date"], "%Y-%m-%dT%H:%M:%SZ")
        ttfa = [float(r[k]) for k in ("ttfa_p50_ms", "ttfa_p95_ms", "ttfa_p99_ms")]
        assert 0 < ttfa[0] <= ttfa[1] <= ttfa[2] <= float(r["e2e_p95_ms"]), r
        assert float(r["audio_s_per_s"]) > 0 and float(r["rtf_p50"]) > 0, r
        assert 0 <= int(r["underrun_streams"]) <= int(r["streams"])
    closed = {r["level"]: r for r in rows if r["mode"] == "closed"}
    assert closed["1"]["streams"] == "1" and closed["2"]["streams"] == "2"  # 1 utterance per stream


def test_open_loop_sends_the_poisson_arrivals_of_its_rate_and_duration(results):
    gaps = np.random.default_rng(ARRIVAL_SEED).exponential(1 / RATE, size=100)
    arrivals = int((np.cumsum(gaps) < DURATION_S).sum())
    (row,) = [r for r in read(results["csv"])[1] if r["mode"] == "open"]
    assert int(row["streams"]) == arrivals
    table = (results["dir"] / "bench.md").read_text()
    assert "| requests/s |" in table and "peak in-flight" in table


def test_perf_analyzer_script_finishes_with_its_table_and_ours(results):
    pa = results["dir"] / "pa"
    assert "Request concurrency: 1" in (pa / "pa_c1.txt").read_text()
    md = (pa / "perf_analyzer.md").read_text()
    assert "perf_analyzer latency p50" in md
    (row,) = [r for r in read(results["csv"])[1] if r["mode"] == "perf_analyzer"]
    assert row["streams"] == "1"  # 1 stream x SEQUENCES_PER_STREAM 1


def test_plots_write_the_pngs(results, tmp_path):
    run([sys.executable, "perf/plots.py", str(results["csv"]), "--out", str(tmp_path), "--md", str(tmp_path / "t.md")])
    for name in ("ttfa_vs_concurrency.png", "ttfa_vs_rate.png", "audio_s_per_s_vs_concurrency.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name
    assert "| perf_analyzer | 1 |" in (tmp_path / "t.md").read_text()


# perf_analyzer 2.51 sometimes exits 0 with an empty profile export (a NaN read from unset memory stops its JSON
# writer): this stand-in does that for its first BREAK calls, then runs the real binary, and counts in PA_REAL_BAD
# the real runs that did it of their own accord (each one more run the script must make)
FLAKY_PA = """#!/usr/bin/env bash
n=$(cat "$PA_CALLS" 2>/dev/null || echo 0); echo $((n + 1)) > "$PA_CALLS"
file=""; prev=""
for a in "$@"; do [ "$prev" = --profile-export-file ] && file=$a; prev=$a; done
if [ "$n" -lt "$PA_BREAK" ]; then
  : > "$file"
  echo "Request concurrency: 1"
  exit 0
fi
"$PA_REAL" "$@"; rc=$?
"$PY" -c 'import json, sys; json.load(open(sys.argv[1]))' "$file" 2>/dev/null || echo "$rc" >> "$PA_REAL_BAD"
exit $rc
"""


@pytest.mark.parametrize(("breaks", "attempts", "rc", "calls"), [(1, 3, 0, 2), (5, 2, 1, 2)])
def test_perf_analyzer_runs_a_level_again_when_its_export_is_not_json(server, tmp_path, breaks, attempts, rc,  # noqa: F811
                                                                      calls):
    fake = tmp_path / "perf_analyzer"
    fake.write_text(FLAKY_PA)
    fake.chmod(0o755)
    env = {**os.environ, "GRPC_URL": server.grpc_url, "CONCURRENCY": "1", "SEQUENCES_PER_STREAM": "1",
           "MAX_FRAMES": "2", "OUT": str(tmp_path / "pa"), "CSV": str(tmp_path / "pa.csv"), "PY": sys.executable,
           "PA_ATTEMPTS": str(attempts), "PERF_ANALYZER": str(fake), "PA_BREAK": str(breaks),
           "PA_CALLS": str(tmp_path / "calls"), "PA_REAL": str(Path(sys.executable).parent / "perf_analyzer"),
           "PA_REAL_BAD": str(tmp_path / "real_bad")}
    out = subprocess.run(["bash", "perf/run_perf_analyzer.sh"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env=env)
    assert out.returncode == rc, out.stdout[-2000:] + out.stderr[-2000:]
    real_bad = len((tmp_path / "real_bad").read_text().split()) if (tmp_path / "real_bad").exists() else 0
    assert int((tmp_path / "calls").read_text()) == calls + real_bad  # the real binary's own empty exports run again
    assert f"not whole JSON (run 1 of {attempts}" in out.stderr
    if rc == 0:
        (row,) = read(tmp_path / "pa.csv")[1]
        assert row["mode"] == "perf_analyzer" and row["streams"] == "1"
    else:
        assert f"perf_analyzer failed at concurrency 1 (rc 0, but no whole profile export in {attempts} run(s))" \
            in out.stderr
        assert not (tmp_path / "pa.csv").exists()
