#!/usr/bin/env bash
# One device-tool call on the H200 (build the carry first: bash perf/gpu_carry.sh): run the GPU tests and every benchmark,
# leave tables and logs under $OUT. Usage (device tool, carry [".gpu"]): bash perf/gpu_session.sh [steps...]
# steps: env kernels kbench codec codec_layers engine engine_nock serve (default: all but codec_layers, engine_nock, serve)
# (engine_nock: the engine bench with EngineConfig.codec_kernels off, the torch codec)
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"; cd "$ROOT"
export PYTHONPATH="$ROOT/.gpu/site${PYTHONPATH:+:$PYTHONPATH}"
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || { tail -5 "$OUT/pip.log"; exit 1; }
steps=("$@"); [ ${#steps[@]} -gt 0 ] || steps=(env kernels kbench codec engine)
failed=0
run() { local name=$1; shift; echo "=== $name: $*"; local t0=$SECONDS
  "$@" 2>&1 | tee "$OUT/$name.log" | tail -40; local rc=${PIPESTATUS[0]}
  echo "=== $name: rc=$rc in $((SECONDS - t0)) s"; [ "$rc" -eq 0 ] || failed=1; }
for s in "${steps[@]}"; do case $s in
  env) run env bash -c 'nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"; git log -1 --format=%H' ;;
  kernels) run kernels_test python3 -m pytest -q tests/kernels -p no:cacheprovider ;;
  kbench) run kernels_bench python3 perf/bench_kernels.py ;;
  codec) run codec_bench python3 perf/bench_codec.py --scale full
         run codec_bench_kernels python3 perf/bench_codec.py --scale full --kernels ;;
  engine) run engine_test python3 -m pytest -q -x tests/engine -m gpu -p no:cacheprovider
          run engine_bench python3 perf/bench_engine.py ;;
  codec_layers) run codec_layers python3 perf/bench_codec_layers.py ;;
  engine_nock) run engine_bench_no_codec_kernels python3 perf/bench_engine.py --no-codec-kernels ;;
  serve) run serve_bench bash perf/gpu_serve.sh ;;
  *) echo "unknown step $s"; failed=1 ;;
esac; done
exit "$failed"
