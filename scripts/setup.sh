#!/usr/bin/env bash
# Create .venv in the repo root with every pinned dependency: the engine, the Triton server
# (nvidia-pytriton wheel), the client, the test oracle (official qwen-tts 0.1.1) and pytest.
# Idempotent: re-running only installs what is missing.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3.11}"
VENV="$ROOT/.venv"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
"${PIP[@]}" --upgrade "pip>=24"
# NOTE: torch first, pinned: the CPU wheel lies on local disk; an unpinned torch pulls a CUDA build.
"${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" -r "$ROOT/requirements/runtime.txt" -r "$ROOT/requirements/server.txt"
# The oracle: qwen-tts without its declared deps (gradio etc.), plus the modules it imports.
"${PIP[@]}" -r "$ROOT/requirements/test.txt"
"${PIP[@]}" --no-deps -r "$ROOT/requirements/oracle-nodeps.txt"
"${PIP[@]}" --no-deps -e "$ROOT"
"$VENV/bin/python" -m q3tts.serving.runtime --prepare >/dev/null 2>&1 || true
echo "setup: ok ($VENV)"
