#!/usr/bin/env bash
# A/B of chunk schedules against one running server: perf/loadtest.sh's closed loop once per schedule, the
# schedules interleaved ROUNDS times so that drift hits each alike; prints each run's rows.
#   GRPC_URL=127.0.0.1:8001 SCHEDULES="default 1,2,4,8,12" ROUNDS=2 CONCURRENCY=1,16,32,64 bash perf/chunk_ab.sh
# On the GPU machine, as perf/gpu_serve.sh's bench: BENCH_CMD="bash perf/chunk_ab.sh" (GRPC_URL set there).
# Env: SCHEDULES ("default 1,2,4,8,12"; "default" = the server's)  ROUNDS (2)  AB_OUT (run/chunk_ab: one
#      CSV and closed.md per schedule and round), and perf/loadtest.sh's (CONCURRENCY, REQUESTS, MAX_FRAMES, ...)
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
AB_OUT="${AB_OUT:-$ROOT/run/chunk_ab}"
failed=0
for round in $(seq 1 "${ROUNDS:-2}"); do
  for schedule in ${SCHEDULES:-default 1,2,4,8,12}; do
    dir="$AB_OUT/${schedule//,/-}-$round"
    mkdir -p "$dir"
    echo "== chunk schedule $schedule, round $round"
    [ "$schedule" = default ] && s="" || s="$schedule"
    CHUNK_SCHEDULE="$s" PARTS=closed LOADTEST_OUT="$dir" CSV="$dir/closed.csv" bash "$ROOT/perf/loadtest.sh" \
      >"$dir/loadtest.log" 2>&1 || { failed=1; echo "FAILED: see $dir/loadtest.log"; tail -5 "$dir/loadtest.log"; }
    grep -E '^\| (greedy|sampled) ' "$dir/closed.md" 2>/dev/null
  done
done
exit "$failed"
