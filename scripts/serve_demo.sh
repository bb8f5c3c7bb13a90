#!/usr/bin/env bash
# The README's main job: make the default tiny checkpoint (if missing) -> start tritonserver on 127.0.0.1
# -> stream a sentence to demo.wav with q3tts-client -> stop the server (by PID, through the launcher).
# Run after scripts/setup.sh. Env: CKPT (default artifacts/cv-0.6b-tiny), TEXT, OUT (demo.wav).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
CKPT="${CKPT:-artifacts/cv-0.6b-tiny}"
TEXT="${TEXT:-Hello from Qwen3-TTS, streamed by Triton.}"
OUT="${OUT:-demo.wav}"
RUN_DIR="$ROOT/run/demo"
mkdir -p "$RUN_DIR"

if [ ! -f "$CKPT/config.json" ]; then
  echo "demo: making the tiny checkpoint $CKPT"
  .venv/bin/q3tts make-checkpoint "$CKPT" --variant custom_voice --size 0.6b --scale tiny --seed 0
fi

echo "demo: starting tritonserver on 127.0.0.1 (log $RUN_DIR/server/server.log)"
.venv/bin/q3tts serve --model "$CKPT" --run-dir "$RUN_DIR/server" > "$RUN_DIR/serve.out" 2>&1 &
SERVE_PID=$!
stop() {
  if kill -0 "$SERVE_PID" 2>/dev/null; then
    echo "demo: stopping the server"
    kill -TERM "$SERVE_PID"
    wait "$SERVE_PID" || true
  fi
}
trap stop EXIT

for _ in $(seq 600); do
  grep -q '"grpc_port"' "$RUN_DIR/serve.out" 2>/dev/null && break
  if ! kill -0 "$SERVE_PID" 2>/dev/null; then
    cat "$RUN_DIR/serve.out" >&2
    exit 1
  fi
  sleep 0.5
done
GRPC_PORT="$(grep '"grpc_port"' "$RUN_DIR/serve.out" | .venv/bin/python -c 'import json,sys;print(json.loads(sys.stdin.readline())["grpc_port"])')"
grep '\[q3tts\] ready' "$RUN_DIR/serve.out"

.venv/bin/q3tts-client --url "127.0.0.1:$GRPC_PORT" --text "$TEXT" --speaker ryan --language english \
  --greedy --max-frames 40 --out "$OUT"
