#!/usr/bin/env bash
# The load test on the GPU machine, one command: our server under closed-loop, open-loop and perf_analyzer
# load, then the peers on the same random real-size checkpoint, then the results CSV, tables and PNGs.
#
#   here, right before the call:  bash perf/gpu_carry.sh --loadtest       (builds .gpu/loadtest, ~50 MiB)
#   device tool:  bash perf/gpu_loadtest.sh          carry: [".gpu/loadtest"]
#   or as two calls (more time for each part): PHASES=serve ..., then PHASES=peers ... (same carry)
#
# (0) unpack .gpu/loadtest under $WORK/carry (xz: the slim tritonserver, the numpy<2 stub wheel, the client
#     site, perf_analyzer 2.51, the peers' site; COMMIT names the tree the carry was built from)
# (serve) perf/gpu_serve.sh with BENCH_CMD = perf/loadtest.sh: CustomVoice 1.7B full random weights (seed 0),
#     bf16, MAX_SLOTS 128: closed loop 1..128 streams, perf_analyzer 1..128, open loop 1..32 requests/s
# (peers) perf/peers/run.py on that checkpoint: qwen-tts-hf batch 1 and 64; faster-qwen3-tts batch 1 and
#     streamed at 1 frame per chunk
# (plots) perf/plots.py over this call's CSV and perf/results/loadtest-<commit>-*.csv (an earlier call's)
# $OUT: loadtest-<commit>-<phases>.csv (copy it to perf/results/), loadtest.md (all tables), the PNGs,
#       loadtest.log, loadtest-raw.tgz (server log, per-part tables, perf_analyzer's own tables)
#
# Env: PHASES (serve,peers)  TOTAL_BUDGET_S (560: a part that no longer fits is skipped, and the log says so)
#      DURATION_S (10 s per open-loop rate)  MAX_FRAMES (100)  MAX_SLOTS (128)  PEERS (qwen-tts-hf,faster-qwen3-tts)
#      PEER_BATCHES (1,64: qwen-tts-hf)  PEER_REPEATS (2)  WORK (run/loadtest)  CARRY (.gpu/loadtest)  PY (python3)
#      perf/loadtest.sh's settings (CONCURRENCY, RATES, PA_CONCURRENCY, ...), perf/gpu_serve.py's (DEVICE, SIZE, ...)
# CPU simulation of the whole flow (tiny checkpoint, .venv's Python 3.11, ~5 min on 2 busy cores): a carry of
# the same names made from .venv (C=/tmp/lt_sim/carry; SP=.venv/lib/python3.11/site-packages), then the run:
#   mkdir -p $C /tmp/lt_sim/empty; tar -C $SP -cf - pytriton/tritonserver nvidia_pytriton.libs | xz -0 >$C/pytriton_slim.tar.xz
#   xz -0 -c <a numpy-1.26.4-cp311 manylinux wheel> >$C/numpy-1.26.4-cp311.whl.xz; echo sim >$C/COMMIT
#   tar -C /tmp/lt_sim/empty -cf - . | xz >$C/site.tar.xz; xz -0 -c .venv/bin/perf_analyzer >$C/perf_analyzer.xz
#   bash perf/peers/site.sh cpu /tmp/lt_sim/peers && tar -C /tmp/lt_sim/peers -cf - . | xz -0 >$C/peers.tar.xz
#   PY=.venv/bin/python DEVICE=cpu Q3TTS_GPU_SERVE_SCALE=tiny SIZE=0.6b MAX_SLOTS=8 CARRY=$C PEERS=qwen-tts-hf \
#   PEER_BATCHES=1,2 CONCURRENCY=1,2 REQUESTS=1 RATES=2 DURATION_S=2 PA_CONCURRENCY=1 PA_MAX_FRAMES=2 MAX_FRAMES=3 \
#   TOTAL_BUDGET_S=1500 WORK=run/lt_sim bash perf/gpu_loadtest.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
cd "$ROOT"
T0=$SECONDS
PY="${PY:-python3}"
PHASES=",${PHASES:-serve,peers},"
PEERS="${PEERS:-qwen-tts-hf,faster-qwen3-tts}"
BUDGET="${TOTAL_BUDGET_S:-560}"
WORK="${WORK:-$ROOT/run/loadtest}"
mkdir -p "$WORK" "${OUT:=$WORK/out}"
WORK="$(realpath "$WORK")" OUT="$(realpath "$OUT")" CARRY="$(realpath "${CARRY:-$ROOT/.gpu/loadtest}")"
U="$WORK/carry"
RESULTS="$WORK/results"
SIZE="${SIZE:-1.7b}" SCALE="${Q3TTS_GPU_SERVE_SCALE:-full}"
CKPT="$WORK/serve/ckpt-cv-$SIZE-$SCALE"  # where gpu_serve.py makes it (WORK=$WORK/serve)
export MAX_FRAMES="${MAX_FRAMES:-100}" DURATION_S="${DURATION_S:-10}"
mkdir -p "$RESULTS"
exec > >(tee -a "$OUT/loadtest.log") 2>&1
log() { echo "[gpu_loadtest +$((SECONDS - T0))s] $*"; }
left() { echo $((BUDGET - (SECONDS - T0))); }
phase() { [[ "$PHASES" == *",$1,"* ]]; }
failed=""

# --- (0) unpack ---------------------------------------------------------------------------------------
NUMPY_XZ="$(ls "$CARRY"/numpy-1.*.whl.xz 2>/dev/null | head -1)"
for f in pytriton_slim.tar.xz "$(basename "${NUMPY_XZ:-numpy-1.x.whl.xz}")" site.tar.xz perf_analyzer.xz peers.tar.xz COMMIT; do
  [ -f "$CARRY/$f" ] || { log "FAILED: $CARRY/$f missing: build .gpu/loadtest with 'bash perf/gpu_carry.sh --loadtest' and carry it"; exit 1; }
done
NUMPY_WHL="$U/$(basename "$NUMPY_XZ" .xz)"
export LOADTEST_COMMIT="$(cat "$CARRY/COMMIT")" LOADTEST_GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader -i 0 2>/dev/null || echo cpu)"
CSV="$OUT/loadtest-$LOADTEST_COMMIT-$(tr -s ',' '-' <<<"${PHASES:1:-1}").csv"
rm -f "$CSV"
log "commit $LOADTEST_COMMIT, gpu $LOADTEST_GPU, phases ${PHASES:1:-1}, budget $BUDGET s; unpacking $CARRY"
rm -rf "$U"; mkdir -p "$U/site" "$U/peers"
unxz() {  # FILE.xz -> stdout, through Python's lzma where the image has no xz
  if command -v xz >/dev/null; then xz -dc "$1"; else
    "$PY" -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer, 1 << 20)' "$1"; fi
}
unxz "$CARRY/pytriton_slim.tar.xz" | gzip -1 >"$U/pytriton_slim.tgz" &  # gpu_serve unpacks a .tgz
unpacking=($!)
unxz "$CARRY/peers.tar.xz" | tar -C "$U/peers" -xf - &
unpacking+=($!)
unxz "$NUMPY_XZ" >"$NUMPY_WHL" && unxz "$CARRY/site.tar.xz" | tar -C "$U/site" -xf - \
  && unxz "$CARRY/perf_analyzer.xz" >"$U/perf_analyzer" && chmod +x "$U/perf_analyzer"
unpacked=$?
for j in "${unpacking[@]}"; do wait "$j" || unpacked=1; done
[ "$unpacked" -eq 0 ] || { log "FAILED: unpacking $CARRY"; exit 1; }
log "unpacked: $(du -sh "$U" | cut -f1)"

# --- (serve) ------------------------------------------------------------------------------------------
if phase serve; then
  if phase peers; then reserve=230; else reserve=10; fi  # the peers' two runs, or the plots
  SERVE_BUDGET=$(( $(left) - reserve ))
  log "serve phase (budget $SERVE_BUDGET s): closed-loop, perf_analyzer and open-loop load on our server"
  # ends 50 s before the phase's budget, 10 s before gpu_serve.py's own bench timeout would kill bash alone:
  # timeout stops the whole process group (bench_serve, perf_analyzer), and the rows written so far stay
  export LOADTEST_DEADLINE=$(( $(date +%s) + SERVE_BUDGET - 50 ))
  BENCH_CMD="PERF_ANALYZER='$U/perf_analyzer' PA_LIBS='$WORK/serve/pytriton/nvidia_pytriton.libs' CSV='$CSV' \
LOADTEST_OUT='$RESULTS' timeout -k 5 \$((LOADTEST_DEADLINE - \$(date +%s))) bash '$ROOT/perf/loadtest.sh'" \
  TRITON_TGZ="$U/pytriton_slim.tgz" NUMPY_WHL="$NUMPY_WHL" CLIENT_SITE="$U/site" \
  WORK="$WORK/serve" CKPT="$CKPT" MAX_SLOTS="${MAX_SLOTS:-128}" TOTAL_BUDGET_S="$SERVE_BUDGET" \
  BENCH_TIMEOUT_S="$SERVE_BUDGET" PY="$PY" OUT= bash "$ROOT/perf/gpu_serve.sh" || failed="$failed serve"
  cp "$WORK/serve/server/server.log" "$RESULTS/server.log" 2>/dev/null
fi

# --- (peers) ------------------------------------------------------------------------------------------
peer() {  # NAME TIMEOUT_S ARGS...: perf/peers/run.py with the peers' site first on PYTHONPATH
  local name="$1" limit="$2"; shift 2
  if [ "$(left)" -lt $((limit / 2)) ]; then log "SKIPPED peer $name: $(left) s left"; failed="$failed $name(skipped)"; return; fi
  [ "$limit" -le "$(left)" ] || limit="$(left)"
  log "peer $name (time limit $limit s)"
  PYTHONPATH="$U/peers" timeout "$limit" "$PY" "$ROOT/perf/peers/run.py" --peer "$name" --checkpoint "$CKPT" \
    --max-frames "$MAX_FRAMES" --repeats "${PEER_REPEATS:-2}" --csv "$CSV" --md "$RESULTS/peer-$name.md" "$@" \
    || failed="$failed $name"
}
if phase peers; then
  if [ ! -f "$CKPT/.gpu_serve_complete" ]; then  # a peers-only call on a fresh machine: the same seed-0 checkpoint
    log "making $CKPT"
    { "$PY" -c 'import q3tts' 2>/dev/null \
      || "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$WORK/pip.log" 2>&1; } \
      && "$PY" -m q3tts.cli make-checkpoint "$CKPT" --variant custom_voice --size "$SIZE" --scale "$SCALE" --seed 0 \
      && touch "$CKPT/.gpu_serve_complete" || failed="$failed checkpoint"
  fi
  [[ ",$PEERS," != *",qwen-tts-hf,"* ]] || peer qwen-tts-hf 200 --batches "${PEER_BATCHES:-1,64}"
  [[ ",$PEERS," != *",faster-qwen3-tts,"* ]] || peer faster-qwen3-tts 150 --batches 1 --stream-chunk 1
fi

# --- (plots) ------------------------------------------------------------------------------------------
CSVS=("$CSV")
for f in "$ROOT"/perf/results/loadtest-"$LOADTEST_COMMIT"-*.csv; do
  [ -f "$f" ] && [ "$(basename "$f")" != "$(basename "$CSV")" ] && CSVS+=("$f")
done
if [ -s "$CSV" ]; then
  "$PY" "$ROOT/perf/plots.py" "${CSVS[@]}" --out "$OUT" --md "$WORK/plots.md" || failed="$failed plots"
  cat "$WORK/plots.md" "$RESULTS"/*.md >"$OUT/loadtest.md" 2>/dev/null
else
  log "no results CSV was written"; failed="$failed results"
fi
tar -C "$RESULTS" -czf "$OUT/loadtest-raw.tgz" . 2>/dev/null
log "done in $((SECONDS - T0)) s; \$OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
[ -z "$failed" ] || { log "FAILED:$failed"; exit 1; }
