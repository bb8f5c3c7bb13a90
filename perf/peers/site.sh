#!/usr/bin/env bash
# Install the peers' packages into one folder that goes first on PYTHONPATH (pip --target, no deps: everything
# else comes from the interpreter's own site-packages), without touching any environment.
#
#   bash perf/peers/site.sh gpu DIR   # cp312 manylinux wheels for the H200 image (its torch, torchaudio,
#                                     # numba, scipy, accelerate ... stay; its transformers 5.17 cannot load the
#                                     # official codec and its tokenizers 0.23 is above transformers 5.15's cap)
#   bash perf/peers/site.sh cpu DIR   # for .venv's Python (CPU tests of perf/peers/run.py): the same peers
#                                     # plus what .venv pins lower for the oracle (huggingface_hub, safetensors)
set -euo pipefail
[ $# -eq 2 ] && { [ "$1" = gpu ] || [ "$1" = cpu ]; } || { echo "usage: $0 gpu|cpu DIR" >&2; exit 2; }
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PEERS=(faster-qwen3-tts==0.5.4 qwen-tts-hf==0.1.1.post1 transformers==5.15.1 tokenizers==0.22.2)
mkdir -p "$2"
quiet() { grep -vE "^WARNING: (Location|Running pip as)" || true; }
if [ "$1" = gpu ]; then
  # what qwen_tts imports at module level and the image lacks (librosa, soundfile, sox and their needs; sox
  # 1.5.0 has no wheel, 1.4.1 imports the same)
  IMPORTS=(librosa==0.11.0 audioread==3.0.1 decorator==5.2.1 pooch==1.8.2 platformdirs==4.5.0 soundfile==0.13.1
           cffi==2.0.0 pycparser==2.23 sox==1.4.1 soxr==0.5.0.post1)
  python3 -m pip install -q --no-deps --no-compile --only-binary=:all: --target "$2" --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 "${PEERS[@]}" "${IMPORTS[@]}" 2>&1 | quiet
else
  "$ROOT/.venv/bin/python" -m pip install -q --no-deps --no-compile --target "$2" "${PEERS[@]}" huggingface-hub==1.33.0 \
    safetensors==0.8.0 2>&1 | quiet
fi
rm -rf "$2/bin"
echo "peers' site: $2 ($(du -sh "$2" | cut -f1))"
