#!/usr/bin/env bash
# perf_analyzer 2.51 (the binary in the tritonclient==2.51.0 wheel; 2.52+ needs glibc 2.38) against the
# decoupled sequence model over gRPC streaming: one sequence = one JSON list of text steps (perf/make_inputs.py).
#
#   bash perf/run_perf_analyzer.sh --model ckpt/cv-0.6b       # starts `q3tts serve` on loopback, stops it after
#   GRPC_URL=host:8001 bash perf/run_perf_analyzer.sh         # against a running server (a fleet's own)
#
# It always finishes: perf_analyzer runs once per concurrency level and measures a fixed number of whole
# sequences (--request-count = concurrency x SEQUENCES_PER_STREAM x STEPS) instead of waiting for
# "stable" time windows, which few, long sequences never give; each level also has a time limit.
# Per level: perf_analyzer's console table (pa_cN.txt), its CSV (pa_cN.csv) and its timestamps
# (--profile-export-file pa_cN.json), which perf/pa_export.py turns into TTFA / end-to-end / RTF / audio-s/s /
# underrun rows (perf_analyzer.md, and CSV rows of mode perf_analyzer when CSV is set).
# What its own numbers mean: perf/pa_export.py's docstring and the README's "Load testing".
#
# A level whose export is not whole JSON although perf_analyzer exited 0 runs again (up to PA_ATTEMPTS times):
# 2.51 exports, for an output that a response does not carry (an acknowledgement has no AUDIO, no TIMING), one
# value read from memory it never set. When those bytes are a NaN its JSON writer stops, and the export
# stays empty (or cut off at a 64 KiB buffer).
# Env: CONCURRENCY (1,8,16,32,64,128)  SEQUENCES_PER_STREAM (2)  STEPS (4 requests per sequence)
#      MAX_FRAMES (48)  LEVEL_TIMEOUT_S (300)  PA_ATTEMPTS (3)  OUT (run/perf)  CSV (append rows here)
#      PY (.venv/bin/python, else python3)  PERF_ANALYZER (.venv/bin/perf_analyzer)
#      PA_LIBS (folder with the pytriton wheel's libb64 / libcudart; default: PY's nvidia_pytriton.libs)
# The libshim: perf_analyzer NEEDs libb64.so.0d and libcudart.so.12, both already in the pytriton wheel under
# mangled names; symlinks with the plain names go into $OUT/libshim.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -z "${PY:-}" ]; then PY="$ROOT/.venv/bin/python"; [ -x "$PY" ] || PY=python3; fi
OUT="${OUT:-$ROOT/run/perf}"
PA="${PERF_ANALYZER:-$ROOT/.venv/bin/perf_analyzer}"
CONCURRENCY="${CONCURRENCY:-1,8,16,32,64,128}"
SEQUENCES_PER_STREAM="${SEQUENCES_PER_STREAM:-2}"
STEPS="${STEPS:-4}"
MAX_FRAMES="${MAX_FRAMES:-48}"
LEVEL_TIMEOUT_S="${LEVEL_TIMEOUT_S:-300}"
PA_ATTEMPTS="${PA_ATTEMPTS:-3}"
MODEL=""
while [ $# -gt 0 ]; do
  case "$1" in
    --model) MODEL="$2"; shift 2 ;;
    *) echo "usage: $0 [--model CKPT]  (or GRPC_URL=host:port)" >&2; exit 2 ;;
  esac
done
for v in SEQUENCES_PER_STREAM STEPS MAX_FRAMES LEVEL_TIMEOUT_S PA_ATTEMPTS; do
  [[ "${!v}" =~ ^[1-9][0-9]*$ ]] || { echo "$v='${!v}': give a whole number > 0" >&2; exit 2; }
done
[[ "$CONCURRENCY" =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] || { echo "CONCURRENCY='$CONCURRENCY': give e.g. 1,8,16" >&2; exit 2; }
[ -x "$PA" ] || { echo "perf_analyzer not found at $PA: pip install tritonclient==2.51.0 into .venv, or set PERF_ANALYZER" >&2; exit 1; }
if [ -z "${PA_LIBS:-}" ]; then
  PA_LIBS="$("$PY" -c 'import sysconfig;print(sysconfig.get_paths()["purelib"])')/nvidia_pytriton.libs"
fi
mkdir -p "$OUT/libshim"
for pair in "libb64-*.so.0d libb64.so.0d" "libcudart-*.so.12* libcudart.so.12"; do
  set -- $pair
  lib="$(ls "$PA_LIBS"/$1 2>/dev/null | head -1)"
  [ -n "$lib" ] || { echo "no $1 in PA_LIBS=$PA_LIBS (the nvidia-pytriton wheel's nvidia_pytriton.libs)" >&2; exit 1; }
  ln -sf "$(realpath "$lib")" "$OUT/libshim/$2"
done
export LD_LIBRARY_PATH="$OUT/libshim${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

SERVE_PID=""
cleanup() { if [ -n "$SERVE_PID" ]; then kill -TERM "$SERVE_PID" 2>/dev/null || true; wait "$SERVE_PID" 2>/dev/null || true; fi; }
trap cleanup EXIT
if [ -z "${GRPC_URL:-}" ]; then
  [ -n "$MODEL" ] || { echo "give --model CKPT or GRPC_URL" >&2; exit 2; }
  "$PY" -m q3tts.cli serve --model "$MODEL" --run-dir "$OUT/server" > "$OUT/serve.out" 2>&1 &
  SERVE_PID=$!
  for _ in $(seq 1200); do
    grep -q '"grpc_port"' "$OUT/serve.out" 2>/dev/null && break
    kill -0 "$SERVE_PID" 2>/dev/null || { cat "$OUT/serve.out" >&2; exit 1; }
    sleep 0.5
  done
  grep -q '"grpc_port"' "$OUT/serve.out" || { echo "q3tts serve not ready after 600 s" >&2; cat "$OUT/serve.out" >&2; exit 1; }
  GRPC_URL="127.0.0.1:$(grep '"grpc_port"' "$OUT/serve.out" | "$PY" -c 'import json,sys;print(json.loads(sys.stdin.readline())["grpc_port"])')"
fi

"$PY" "$ROOT/perf/make_inputs.py" --out "$OUT/inputs.json" --sequences 32 --steps "$STEPS"
# run_level N: one perf_analyzer run at concurrency N (its exit status)
run_level() {
  local n="$1"
  rm -f "$OUT/pa_c$n.json" "$OUT/pa_c$n.csv"
  timeout "$LEVEL_TIMEOUT_S" "$PA" -m qwen3_tts -i grpc --streaming -u "$GRPC_URL" \
    --input-data "$OUT/inputs.json" --sequence-id-range 1:1000000000 --serial-sequences \
    --concurrency-range "$n:$n" --request-count "$((n * SEQUENCES_PER_STREAM * STEPS))" \
    --request-parameter "max_frames:$MAX_FRAMES:int" --request-parameter "seed:0:int" \
    --request-parameter "ack_pieces:true:bool" \
    -f "$OUT/pa_c$n.csv" --profile-export-file "$OUT/pa_c$n.json" > "$OUT/pa_c$n.txt" 2>&1
}
whole_json() { "$PY" -c 'import json, sys; json.load(open(sys.argv[1]))' "$1" 2>/dev/null; }

failed=""
exports=()
for n in ${CONCURRENCY//,/ }; do
  echo "== perf_analyzer: concurrency $n, $((n * SEQUENCES_PER_STREAM)) sequences of $STEPS requests, max_frames $MAX_FRAMES"
  why=""
  for attempt in $(seq "$PA_ATTEMPTS"); do
    rc=0
    run_level "$n" || rc=$?
    if [ "$rc" -ne 0 ]; then why="rc $rc$([ "$rc" = 124 ] && echo ": over LEVEL_TIMEOUT_S=$LEVEL_TIMEOUT_S s")"; break; fi
    whole_json "$OUT/pa_c$n.json" && { why=""; break; }
    why="rc 0, but no whole profile export in $attempt run(s)"
    echo "perf_analyzer at concurrency $n: its profile export is not whole JSON (run $attempt of $PA_ATTEMPTS; see the header)" >&2
  done
  grep -vE '^\s*$' "$OUT/pa_c$n.txt" | sed -n '/^Request concurrency/,$p'
  if [ -n "$why" ]; then
    echo "perf_analyzer failed at concurrency $n ($why):" >&2
    tail -5 "$OUT/pa_c$n.txt" >&2
    failed="$failed $n"
  else
    exports+=("$OUT/pa_c$n.json")
  fi
done
if [ "${#exports[@]}" -gt 0 ]; then
  "$PY" "$ROOT/perf/pa_export.py" "${exports[@]}" --md "$OUT/perf_analyzer.md" \
    ${CSV:+--csv "$CSV"}
fi
echo "results: $OUT/perf_analyzer.md, per level $OUT/pa_c*.{txt,csv,json}"
[ -z "$failed" ] || { echo "perf_analyzer failed at concurrency$failed" >&2; exit 1; }
