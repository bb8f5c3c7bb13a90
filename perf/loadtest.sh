#!/usr/bin/env bash
# The load test of a running deployment of the qwen3_tts model (gRPC streaming): what a fleet points at its
# own Triton endpoint, and what perf/gpu_loadtest.sh runs against the server it starts.
#
#   GRPC_URL=triton.internal:8001 METRICS_URL=http://triton.internal:8002/metrics bash perf/loadtest.sh
#
# (closed) perf/bench_serve.py --concurrency $CONCURRENCY: N streams, REQUESTS utterances each, back to back
# (perf_analyzer) perf/run_perf_analyzer.sh at $PA_CONCURRENCY (PA_MAX_FRAMES frames per sequence)
# (open)   perf/bench_serve.py --rates $RATES: Poisson arrivals at R requests/s for DURATION_S each (last: the
#          longest part; a run cut short keeps the rows of the rates it finished)
# Writes $LOADTEST_OUT/: $CSV (one row per level, columns of perf/report.py CSV_COLUMNS: all three modes),
# closed.md, open.md, perf_analyzer.md and perf_analyzer's raw tables (pa/). A failed part does not stop the
# others; the exit status is 1 if any failed.
#
# Env: CONCURRENCY (1,16,32,64,128)  REQUESTS (2)  RATES (1,4,8,12,16,20,32)  DURATION_S (20)
#      MAX_FRAMES (100: 8 s of audio)  MODE (sampled | greedy)  WARMUP (the largest concurrency)
#      PA_CONCURRENCY (1,8,16,32,64,128)  PA_MAX_FRAMES (24: perf_analyzer's export holds every sample as text)
#      PARTS (closed,perf_analyzer,open)  LOADTEST_OUT (run/loadtest)  CSV ($LOADTEST_OUT/loadtest.csv)
#      CHUNK_SCHEDULE (frames per response of bench_serve's requests, e.g. 1,1,2,4,8; default: the server's)
#      LOADTEST_GPU (the server's GPU for the CSV when this client runs elsewhere)  PY (.venv/bin/python, else python3)
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -z "${PY:-}" ]; then PY="$ROOT/.venv/bin/python"; [ -x "$PY" ] || PY=python3; fi
: "${GRPC_URL:?set GRPC_URL=host:port, the gRPC endpoint of the deployment}"
CONCURRENCY="${CONCURRENCY:-1,16,32,64,128}"
RATES="${RATES:-1,4,8,12,16,20,32}"
PA_CONCURRENCY="${PA_CONCURRENCY:-1,8,16,32,64,128}"
LOADTEST_OUT="${LOADTEST_OUT:-$ROOT/run/loadtest}"
CSV="${CSV:-$LOADTEST_OUT/loadtest.csv}"
PARTS=",${PARTS:-closed,perf_analyzer,open},"
MAX_FRAMES="${MAX_FRAMES:-100}"
[ -n "${WARMUP:-}" ] || WARMUP="$(tr , '\n' <<<"$CONCURRENCY" | sort -n | tail -1)"
mkdir -p "$LOADTEST_OUT"
BENCH=("$PY" "$ROOT/perf/bench_serve.py" --url "$GRPC_URL" --modes "${MODE:-sampled}" --max-frames "$MAX_FRAMES"
       --timeout-s 120 --check --csv "$CSV" ${METRICS_URL:+--metrics-url "$METRICS_URL"}
       ${CHUNK_SCHEDULE:+--chunk-schedule "$CHUNK_SCHEDULE"})
failed=""
part() { [[ "$PARTS" == *",$1,"* ]]; }
if part closed; then
  echo "== closed loop: concurrency $CONCURRENCY, ${REQUESTS:-2} utterances per stream, $MAX_FRAMES frames"
  "${BENCH[@]}" --concurrency "$CONCURRENCY" --requests "${REQUESTS:-2}" \
    --warmup "$WARMUP" --md "$LOADTEST_OUT/closed.md" \
    || failed="$failed closed"
fi
if part perf_analyzer; then
  echo "== perf_analyzer: concurrency $PA_CONCURRENCY, ${PA_MAX_FRAMES:-24} frames"
  OUT="$LOADTEST_OUT/pa" CSV="$CSV" CONCURRENCY="$PA_CONCURRENCY" MAX_FRAMES="${PA_MAX_FRAMES:-24}" PY="$PY" \
    bash "$ROOT/perf/run_perf_analyzer.sh" || failed="$failed perf_analyzer"
  cp "$LOADTEST_OUT/pa/perf_analyzer.md" "$LOADTEST_OUT/" 2>/dev/null
  rm -f "$LOADTEST_OUT"/pa/pa_c*.json  # every sample as JSON text (tens of MB a level): read by pa_export.py
fi
if part open; then
  echo "== open loop: $RATES requests/s, ${DURATION_S:-20} s each, $MAX_FRAMES frames"
  "${BENCH[@]}" --concurrency "" --rates "$RATES" --duration-s "${DURATION_S:-20}" --md "$LOADTEST_OUT/open.md" \
    || failed="$failed open"
fi
echo "results: $CSV"
[ -z "$failed" ] || { echo "loadtest: failed:$failed" >&2; exit 1; }
