#!/usr/bin/env bash
# The test command (README, CI): the whole CPU suite. GPU tests skip with a reason when no CUDA device exists.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q "$@"
