#!/usr/bin/env bash
# The served bench on the GPU machine: perf/gpu_serve.py (its docstring lists the settings, the steps and the
# CPU simulation). This wrapper only readies the image Python PY (default python3): q3tts installed -e from this
# tree (INSTALL=auto: when PY imports it from elsewhere | 1 | 0) and the client wheels of CLIENT_SITE
# (default .gpu/site: tritonclient, rapidjson, soxr) on PYTHONPATH.
#   device tool: bash perf/gpu_serve.sh    carry (64 MiB in all, so not the whole .gpu/ and .whl/):
#     [".gpu/pytriton_slim.tgz", ".gpu/site", ".whl/numpy-1.26.4-cp312-cp312-slim.whl"]
set -euo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
cd "$ROOT"
PY="${PY:-python3}"
INSTALL="${INSTALL:-auto}"
export CLIENT_SITE="${CLIENT_SITE-$ROOT/.gpu/site}"
[ -z "$CLIENT_SITE" ] || export PYTHONPATH="$CLIENT_SITE${PYTHONPATH:+:$PYTHONPATH}"
q3tts_file() { "$PY" -c 'import os, q3tts; print(os.path.realpath(q3tts.__file__))' 2>/dev/null || true; }
if [ "$INSTALL" = 1 ] || { [ "$INSTALL" = auto ] && [ "$(q3tts_file)" != "$ROOT/backend/__init__.py" ]; }; then
  mkdir -p run
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . >run/gpu_serve_pip.log 2>&1 \
    || { tail -20 run/gpu_serve_pip.log >&2; echo "[gpu_serve] pip install -e . into $PY failed" >&2; exit 1; }
fi
if [ "$(q3tts_file)" != "$ROOT/backend/__init__.py" ]; then
  echo "[gpu_serve] $PY imports q3tts from '$(q3tts_file)', not $ROOT/backend (INSTALL=1 installs it)" >&2
  exit 1
fi
exec "$PY" perf/gpu_serve.py "$@"
