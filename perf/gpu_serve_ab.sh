#!/usr/bin/env bash
# A/B of the served model on one GPU machine: perf/gpu_serve.sh with POOL=$A and POOL=$B (and POOL=$C when C is
# set), interleaved ROUNDS times (A, B, A, B, ...) so that machine drift hits every side alike; prints each run's
# table rows and leaves every run's files under $OUT/<side><round>/. Same carry as gpu_serve.sh.
#   A="" B="codec_kernels=true" ROUNDS=2 CONCURRENCY=16 MODES=greedy,sampled bash perf/gpu_serve_ab.sh
#   A="" B="codec_pipeline=true" C="codec_pipeline=true,launch_at_frames=true" ROUNDS=2 CONCURRENCY=1,16,64 bash perf/gpu_serve_ab.sh
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-/tmp/out}"
A="${A-}" B="${B-codec_kernels=true}" ROUNDS="${ROUNDS:-2}"  # B="" gives an A/A run
export CONCURRENCY="${CONCURRENCY:-16}" MODES="${MODES:-greedy,sampled}"
failed=0
for round in $(seq 1 "$ROUNDS"); do
  for side in A B ${C+C}; do
    pool="${!side}"; dir="$OUT/$side$round"; mkdir -p "$dir"
    echo "== $side$round: POOL='$pool'"
    POOL="$pool" OUT="$dir" bash "$ROOT/perf/gpu_serve.sh" >"$dir/gpu_serve.log" 2>&1 || { failed=1; echo "FAILED: see $dir/gpu_serve.log"; }
    grep -E '^\| (greedy|sampled) ' "$dir/gpu_serve.log"
  done
done
exit "$failed"
