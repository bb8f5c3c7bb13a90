#!/usr/bin/env bash
# The README's main job: make the default tiny checkpoint (if missing) -> start tritonserver on 127.0.0.1
# -> stream a sentence to demo.wav with q3tts-client -> stop the server (q3tts.serving.launcher.TritonServer
# starts it and stops it in order). Run after scripts/setup.sh. Env: CKPT (default artifacts/cv-0.6b-tiny),
# TEXT, OUT (demo.wav).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export CKPT="${CKPT:-artifacts/cv-0.6b-tiny}" TEXT="${TEXT:-Hello from Qwen3-TTS, streamed by Triton.}" OUT="${OUT:-demo.wav}"

if [ ! -f "$CKPT/config.json" ]; then
  echo "demo: making the tiny checkpoint $CKPT"
  .venv/bin/q3tts make-checkpoint "$CKPT" --variant custom_voice --size 0.6b --scale tiny --seed 0
fi

.venv/bin/python - <<'PY'
import os
import subprocess

from q3tts.serving.launcher import TritonServer

print("demo: starting tritonserver on 127.0.0.1 (log run/demo/server/server.log)", flush=True)
with TritonServer(os.environ["CKPT"], run_dir="run/demo/server", ready_timeout_s=600) as server:
    print(f"demo: ready, grpc {server.grpc_url}", flush=True)
    subprocess.run([".venv/bin/q3tts-client", "--url", server.grpc_url, "--text", os.environ["TEXT"],
                    "--speaker", "ryan", "--language", "english", "--greedy", "--max-frames", "40",
                    "--out", os.environ["OUT"]], check=True)
    print("demo: stopping the server", flush=True)
PY
