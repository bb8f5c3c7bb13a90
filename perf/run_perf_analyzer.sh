#!/usr/bin/env bash
# perf_analyzer 2.51 (the binary in the tritonclient==2.51.0 wheel; 2.52+ needs glibc 2.38) against the
# decoupled sequence model: -i grpc --streaming, one sequence = one JSON list of steps, concurrency sweep.
#
#   perf/run_perf_analyzer.sh --model ckpt/cv-0.6b            # starts `q3tts serve` on loopback, stops it after
#   GRPC_URL=127.0.0.1:8001 perf/run_perf_analyzer.sh         # against a running server
#
# Env: CONCURRENCY (default 1:8:2), MAX_FRAMES (48), MEASURE_MS (20000), OUT (run/perf).
# The libshim (TRITON_RECIPE §6.1): perf_analyzer NEEDs libb64.so.0d and libcudart.so.12, both already in the
# pytriton wheel under mangled names; symlinks with the plain names go into $OUT/libshim.
# perf_analyzer waits for each request to complete before the next step of its sequence, hence ack_pieces
# (protocol.py). Its "latency" for decoupled models is send -> LAST response; use perf/bench_serve.py for TTFA.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$ROOT/.venv/bin/python"
OUT="${OUT:-$ROOT/run/perf}"
MODEL=""
while [ $# -gt 0 ]; do
  case "$1" in
    --model) MODEL="$2"; shift 2 ;;
    *) echo "usage: $0 [--model CKPT]  (or GRPC_URL=host:port)" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT/libshim"
PA="$ROOT/.venv/bin/perf_analyzer"
[ -x "$PA" ] || { echo "perf_analyzer not found: pip install tritonclient==2.51.0 into .venv" >&2; exit 1; }
LIBS="$("$PY" -c 'import sysconfig;print(sysconfig.get_paths()["purelib"])')/nvidia_pytriton.libs"
ln -sf "$(ls "$LIBS"/libb64-*.so.0d | head -1)" "$OUT/libshim/libb64.so.0d"
ln -sf "$(ls "$LIBS"/libcudart-*.so.12* | head -1)" "$OUT/libshim/libcudart.so.12"
export LD_LIBRARY_PATH="$OUT/libshim${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

SERVE_PID=""
cleanup() { if [ -n "$SERVE_PID" ]; then kill -TERM "$SERVE_PID" 2>/dev/null || true; wait "$SERVE_PID" 2>/dev/null || true; fi; }
trap cleanup EXIT
if [ -z "${GRPC_URL:-}" ]; then
  [ -n "$MODEL" ] || { echo "give --model CKPT or GRPC_URL" >&2; exit 2; }
  "$ROOT/.venv/bin/q3tts" serve --model "$MODEL" --run-dir "$OUT/server" > "$OUT/serve.out" 2>&1 &
  SERVE_PID=$!
  for _ in $(seq 1200); do
    grep -q '"grpc_port"' "$OUT/serve.out" 2>/dev/null && break
    kill -0 "$SERVE_PID" 2>/dev/null || { cat "$OUT/serve.out" >&2; exit 1; }
    sleep 0.5
  done
  grep -q '"grpc_port"' "$OUT/serve.out" || { echo "q3tts serve not ready after 600 s" >&2; cat "$OUT/serve.out" >&2; exit 1; }
  GRPC_URL="127.0.0.1:$(grep '"grpc_port"' "$OUT/serve.out" | "$PY" -c 'import json,sys;print(json.loads(sys.stdin.readline())["grpc_port"])')"
fi

"$PY" "$ROOT/perf/make_inputs.py" --out "$OUT/inputs.json" --sequences 32 --steps 4
"$PA" -m qwen3_tts -i grpc --streaming -u "$GRPC_URL" \
  --input-data "$OUT/inputs.json" --sequence-id-range 1:1000000000 --serial-sequences \
  --concurrency-range "${CONCURRENCY:-1:8:2}" -p "${MEASURE_MS:-20000}" -s 50 -r 5 \
  --request-parameter "max_frames:${MAX_FRAMES:-48}:int" --request-parameter "seed:0:int" \
  --request-parameter "ack_pieces:true:bool" \
  -f "$OUT/perf_analyzer.csv" | tee "$OUT/perf_analyzer.txt"
echo "results: $OUT/perf_analyzer.csv"
