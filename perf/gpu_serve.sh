#!/usr/bin/env bash
# Serve a real-size random Qwen3-TTS 1.7B CustomVoice checkpoint from tritonserver (KIND_GPU, bf16) on the
# GPU machine and stream 1 and 16 concurrent sequences (greedy and sampled) with perf/bench_serve.py over gRPC:
# prints TTFA p50/p90, RTF and audio-s/s, checks every stream (non-empty, finite, whole 1920-sample frames,
# as many frames as FINISH_REASON says), writes $OUT/serve_bench.md when OUT is set. One call, < 8 min.
#
#   device tool: bash perf/gpu_serve.sh    carry (64 MiB in all, so not the whole .gpu/ and .whl/):
#     [".gpu/pytriton_slim.tgz", ".gpu/site", ".whl/numpy-1.26.4-cp312-cp312-slim.whl"]
#   (.gpu/site without soundfile/cffi/pycparser: the client and the stub need tritonclient, rapidjson, soxr;
#    the slim numpy wheel is the cp312 wheel without tests/f2py/distutils/.pyi; the full one works too)
#   CPU simulation (tests the flow here):  see the "CPU simulation" block below
#
# Steps: (0) preflight  (1) pip -e . if needed, unpack the slim pytriton tarball, build the stub env
# (a venv of the image's base Python with numpy<2 + a .pth that appends the image's site-packages: the
# image's numpy 2.x empties every output of Triton 2.51, TRITON_RECIPE §4.4/§11), prepare the backend dir
# (2) make the checkpoint (3) `q3tts serve` in the background with a readiness timeout (a load hangs on a
# wrong libpython/numpy) (4) bench (5) stop the server by PID. On any failure: the server log tail.
#
# Environment (defaults are for the H200 machine):
#   PY=python3            the image Python (torch, q3tts installed -e); runs the launcher, maker and client
#   DEVICE=gpu            gpu | cpu
#   Q3TTS_GPU_SERVE_SCALE=full   checkpoint scale: full | tiny;   SIZE=1.7b (1.7b | 0.6b)
#   GPUS=0  DTYPE=bfloat16 (cpu: none, float32)   MAX_SLOTS=32 (cpu: 8)
#   CONCURRENCY=1,16  MODES=greedy,sampled  REQUESTS=2 (utterances per stream)  MAX_FRAMES=150
#   WARMUP=<largest concurrency> (uncounted warm-up streams)   READY_TIMEOUT_S=240   BENCH_TIMEOUT_S=300
#   WORK=<repo>/run/gpu_serve   CKPT=$WORK/ckpt-cv-$SIZE-$SCALE (reused when complete)
#   TRITON_TGZ=<repo>/.gpu/pytriton_slim.tgz   CLIENT_SITE=<repo>/.gpu/site (set empty for none)
#   STUB_PY=<base interpreter of PY>   NUMPY_WHL=<repo>/.whl/numpy-1.*-cp<XY>-*.whl   STUB_ENV=$WORK/stubenv
#   INSTALL=auto (pip install -e . when PY's q3tts is not this tree) | 0 | 1    OUT (optional)
#   POOL=""               EngineConfig overrides for `q3tts serve --pool`, e.g. codec_kernels=true
#
# CPU simulation (Python 3.11 venv, a 3.11 slim tarball made from the venv's wheel, the cp311 numpy wheel):
#   PY=.venv/bin/python DEVICE=cpu Q3TTS_GPU_SERVE_SCALE=tiny SIZE=0.6b CONCURRENCY=1,2 MAX_FRAMES=12 \
#   TRITON_TGZ=/tmp/gpu_sim/pytriton_slim311.tgz CLIENT_SITE= \
#   NUMPY_WHL=/opt/pypi/files/numpy-1.26.4-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl \
#   bash perf/gpu_serve.sh
set -euo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)"
cd "$ROOT"
T0=$SECONDS
log() { echo "[gpu_serve +$((SECONDS - T0))s] $*"; }
die() { echo "[gpu_serve +$((SECONDS - T0))s] FAILED: $*" >&2; exit 1; }

# --- configuration ------------------------------------------------------------------------------------
PY="${PY:-python3}"
DEVICE="${DEVICE:-gpu}"
SCALE="${Q3TTS_GPU_SERVE_SCALE:-full}"
SIZE="${SIZE:-1.7b}"
case "$DEVICE" in
  gpu) GPUS="${GPUS:-0}"; DTYPE="${DTYPE:-bfloat16}"; MAX_SLOTS="${MAX_SLOTS:-32}" ;;
  cpu) GPUS="none"; DTYPE="${DTYPE:-float32}"; MAX_SLOTS="${MAX_SLOTS:-8}" ;;
  *) die "DEVICE must be gpu or cpu, got '$DEVICE'" ;;
esac
CONCURRENCY="${CONCURRENCY:-1,16}"
MODES="${MODES:-greedy,sampled}"
REQUESTS="${REQUESTS:-2}"
MAX_FRAMES="${MAX_FRAMES:-150}"
MAX_CONC="$(tr ',' '\n' <<<"$CONCURRENCY" | sort -n | tail -1)"
WARMUP="${WARMUP:-$MAX_CONC}"
READY_TIMEOUT_S="${READY_TIMEOUT_S:-240}"
BENCH_TIMEOUT_S="${BENCH_TIMEOUT_S:-300}"
CKPT_TIMEOUT_S="${CKPT_TIMEOUT_S:-240}"
TOTAL_BUDGET_S="${TOTAL_BUDGET_S:-470}"  # the bench is cut to what is left of this (the lead's call: < 8 min)
WORK="${WORK:-$ROOT/run/gpu_serve}"
CKPT="${CKPT:-$WORK/ckpt-cv-$SIZE-$SCALE}"
TRITON_TGZ="${TRITON_TGZ:-$ROOT/.gpu/pytriton_slim.tgz}"
CLIENT_SITE="${CLIENT_SITE-$ROOT/.gpu/site}"
STUB_ENV="${STUB_ENV:-$WORK/stubenv}"
INSTALL="${INSTALL:-auto}"
PYTRITON_DIR="$WORK/pytriton"
SERVER_DIR="$WORK/server"
SERVE_OUT="$WORK/serve.out"
MD="$WORK/serve_bench.md"
mkdir -p "$WORK"
[ -n "$CLIENT_SITE" ] && export PYTHONPATH="$CLIENT_SITE${PYTHONPATH:+:$PYTHONPATH}"

SERVE_PID=""
TS_PID=""
CHILD_PID=""
PIDS_FILE="$WORK/server.pids"  # launcher + tritonserver of the current run: a later run kills leftovers
# a long step runs in the background and is waited for, so that INT/TERM reach the trap at once
run_child() { "$@" & CHILD_PID=$!; local rc=0; wait "$CHILD_PID" || rc=$?; CHILD_PID=""; return "$rc"; }
server_tail() {
  echo "---- q3tts serve output ($SERVE_OUT), last 40 lines ----" >&2
  tail -n 40 "$SERVE_OUT" >&2 2>/dev/null || true
  echo "---- tritonserver log ($SERVER_DIR/server.log), last 80 lines ----" >&2
  tail -n 80 "$SERVER_DIR/server.log" >&2 2>/dev/null || echo "(no server log)" >&2
}
alive() { [ -n "$1" ] && kill -0 "$1" 2>/dev/null; }
stop_server() {
  [ -n "$SERVE_PID" ] || return 0
  if alive "$SERVE_PID"; then
    [ -n "$TS_PID" ] || TS_PID="$(ps -o pid= --ppid "$SERVE_PID" 2>/dev/null | tr -d ' ' | head -1 || true)"
    log "stopping the server (launcher $SERVE_PID, tritonserver ${TS_PID:-?})"
    kill -TERM "$SERVE_PID" 2>/dev/null || true
    for _ in $(seq 120); do alive "$SERVE_PID" || break; sleep 0.5; done  # the launcher's ordered stop
    if alive "$SERVE_PID"; then
      echo "[gpu_serve] the launcher did not stop in 60 s: SIGKILL" >&2
      kill -KILL "$SERVE_PID" 2>/dev/null || true
    fi
  fi
  wait "$SERVE_PID" 2>/dev/null || true
  if alive "$TS_PID"; then
    echo "[gpu_serve] tritonserver $TS_PID still alive: SIGKILL" >&2
    kill -KILL "$TS_PID" 2>/dev/null || true
    sleep 3  # its python stubs should exit ~2 s after their parent; kill_leftovers gets the others
  fi
  SERVE_PID=""
  kill_leftovers
}
# processes of this WORK dir only, by PID: the pids file (launcher, tritonserver) and the python stubs that run
# from $WORK/runtime (a stub whose server was SIGKILLed can live on for minutes, reparented to init)
kill_leftovers() {
  local pids="" pid
  [ -f "$PIDS_FILE" ] && pids="$(cat "$PIDS_FILE")"
  for d in /proc/[0-9]*; do
    if tr '\0' ' ' <"$d/cmdline" 2>/dev/null | grep -qF "$WORK/runtime/backends/python/triton_python_backend_stub"; then
      pids="$pids ${d#/proc/}"
    fi
  done
  for pid in $pids; do
    [ "$pid" != "$$" ] || continue
    if alive "$pid" && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF "$WORK"; then
      echo "[gpu_serve] killing leftover pid $pid: $(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | cut -c1-120)" >&2
      kill -KILL "$pid" 2>/dev/null || true
    fi
  done
  rm -f "$PIDS_FILE"
}
on_exit() {
  local rc=$?
  trap - EXIT INT TERM
  if alive "$CHILD_PID"; then kill -TERM "$CHILD_PID" 2>/dev/null || true; wait "$CHILD_PID" 2>/dev/null || true; fi
  if [ "$rc" -ne 0 ] && [ -n "$SERVE_PID$TS_PID" ]; then server_tail; fi
  stop_server
  if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    cp "$SERVER_DIR/server.log" "$OUT/gpu_serve_server.log" 2>/dev/null || true
    cp "$SERVE_OUT" "$OUT/gpu_serve_serve.out" 2>/dev/null || true
  fi
  if [ "$rc" -eq 0 ]; then log "done (rc 0) in $((SECONDS - T0)) s"; else echo "[gpu_serve] FAILED rc=$rc after $((SECONDS - T0)) s" >&2; fi
  exit "$rc"
}
trap on_exit EXIT
trap 'exit 130' INT TERM

# --- (0) preflight ------------------------------------------------------------------------------------
kill_leftovers  # a previous run killed hard leaves its tritonserver (own session) and stubs holding the GPU
command -v "$PY" >/dev/null 2>&1 || die "PY=$PY not found"
PYVER="$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" || die "cannot run $PY"
IMAGE_SITE="$("$PY" -c 'import sysconfig; p = sysconfig.get_paths(); print(p["purelib"]); print(p["platlib"]) if p["platlib"] != p["purelib"] else None')"
if [ -z "${STUB_PY:-}" ]; then
  STUB_PY="$("$PY" -c 'import os, sys; print(os.path.join(sys.base_prefix, "bin", "python%d.%d" % sys.version_info[:2]))')"
fi
[ -x "$STUB_PY" ] || die "STUB_PY=$STUB_PY (the base interpreter of $PY) is not executable: set STUB_PY"
STUB_VER="$("$STUB_PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
[ "$STUB_VER" = "$PYVER" ] || die "STUB_PY is Python $STUB_VER but PY is $PYVER: torch in $IMAGE_SITE needs the same version"
if [ -z "${NUMPY_WHL:-}" ]; then
  NUMPY_WHL="$(ls "$ROOT"/.whl/numpy-1.*-cp"${PYVER/./}"-*.whl 2>/dev/null | head -1 || true)"
fi
[ -f "$NUMPY_WHL" ] || die "no numpy<2 wheel for cp${PYVER/./} (NUMPY_WHL='${NUMPY_WHL}'): carry .whl/ (the stub env needs numpy<2)"
[ -f "$TRITON_TGZ" ] || die "TRITON_TGZ=$TRITON_TGZ missing: carry .gpu/ (pytriton_slim.tgz)"
[ -z "$CLIENT_SITE" ] || [ -d "$CLIENT_SITE" ] || die "CLIENT_SITE=$CLIENT_SITE missing: carry .gpu/ (site/: tritonclient, rapidjson, soxr)"
log "root $ROOT  work $WORK"
log "PY=$PY (Python $PYVER, site $(echo $IMAGE_SITE))  STUB_PY=$STUB_PY  numpy wheel $(basename "$NUMPY_WHL")"
log "device $DEVICE gpus $GPUS dtype $DTYPE max_slots $MAX_SLOTS  checkpoint cv-$SIZE-$SCALE  concurrency $CONCURRENCY modes $MODES requests/stream $REQUESTS max_frames $MAX_FRAMES warmup $WARMUP"
if [ "$DEVICE" = gpu ]; then
  command -v nvidia-smi >/dev/null 2>&1 || die "DEVICE=gpu but no nvidia-smi"
  nvidia-smi --query-gpu=index,name,driver_version,memory.used,memory.total --format=csv,noheader \
    || die "nvidia-smi failed"
fi
FREE_GB="$(df -Pk "$WORK" | awk 'NR==2 {print int($4 / 1048576)}')"
if [ "$SCALE" = full ] && [ "${FREE_GB:-0}" -lt 12 ]; then die "only ${FREE_GB} GiB free under $WORK (the full checkpoint needs ~5)"; fi

# --- (1) install, unpack, stub env, runtime -----------------------------------------------------------
q3tts_file() { "$PY" -c 'import os, q3tts; print(os.path.realpath(q3tts.__file__))' 2>/dev/null || true; }
if [ "$INSTALL" = 1 ] || { [ "$INSTALL" = auto ] && [ "$(q3tts_file)" != "$ROOT/backend/__init__.py" ]; }; then
  log "pip install -e . into $PY"
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$WORK/pip.log" 2>&1 \
    || { tail -20 "$WORK/pip.log" >&2; die "pip install -e . failed"; }
fi
[ "$(q3tts_file)" = "$ROOT/backend/__init__.py" ] \
  || die "$PY imports q3tts from '$(q3tts_file)', not $ROOT/backend (run: $PY -m pip install --no-deps -e .)"

"$PY" -c 'import tritonclient.grpc, q3tts_client.stream_client' \
  || die "the client side cannot import tritonclient.grpc with $PY (PYTHONPATH=${PYTHONPATH:-}): it needs grpcio + protobuf from the image and tritonclient + python-rapidjson from CLIENT_SITE"
STAMP="$(stat -c '%s %Y' "$TRITON_TGZ") $(basename "$TRITON_TGZ")"
if [ "$(cat "$PYTRITON_DIR/.stamp" 2>/dev/null || true)" != "$STAMP" ]; then
  log "unpacking $TRITON_TGZ -> $PYTRITON_DIR"
  rm -rf "$PYTRITON_DIR"; mkdir -p "$PYTRITON_DIR"
  tar xzf "$TRITON_TGZ" -C "$PYTRITON_DIR" || die "tar xzf $TRITON_TGZ failed"
  echo "$STAMP" >"$PYTRITON_DIR/.stamp"
fi
TS_ROOT="$PYTRITON_DIR/pytriton/tritonserver"
for f in bin/tritonserver backends/python/libtriton_python.so backends/python/triton_python_backend_utils.py \
         "python_backend_stubs/$STUB_VER/triton_python_backend_stub"; do
  [ -e "$TS_ROOT/$f" ] || die "the tarball lacks pytriton/tritonserver/$f"
done
[ -d "$PYTRITON_DIR/nvidia_pytriton.libs" ] || die "the tarball lacks nvidia_pytriton.libs/"

log "building the stub env $STUB_ENV ($STUB_PY -m venv --without-pip, numpy<2, .pth -> image site-packages)"
rm -rf "$STUB_ENV"
"$STUB_PY" -m venv --without-pip "$STUB_ENV" || die "$STUB_PY -m venv failed (Ubuntu: apt install python3.X-venv)"
STUB_SITE="$("$STUB_ENV/bin/python3" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
"$STUB_ENV/bin/python3" -m zipfile -e "$NUMPY_WHL" "$STUB_SITE" || die "cannot unpack $NUMPY_WHL"
# site.addsitedir (not a bare path line) so the image's own .pth files run too: the editable finder of q3tts
{
  echo "# q3tts perf/gpu_serve.sh: the image's packages (torch, q3tts -e) AFTER this env's numpy<2"
  for d in $IMAGE_SITE ${CLIENT_SITE:+"$CLIENT_SITE"}; do
    echo "import site; site.addsitedir('$d')"
  done
} >"$STUB_SITE/zz_q3tts_image_site.pth"
cat >"$WORK/stub_check.py" <<'EOF'
import os, sys
import numpy
assert numpy.__version__.startswith("1."), f"numpy {numpy.__version__} from {numpy.__file__}: the stub needs numpy<2"
assert numpy.__file__.startswith(sys.prefix), f"numpy from {numpy.__file__}, not from the stub env {sys.prefix}"
import torch
import q3tts, q3tts.engine, q3tts.serving.request  # what model.py imports (minus triton_python_backend_utils)
root = os.environ["ROOT"]
got = os.path.realpath(q3tts.__file__)
assert got == os.path.join(root, "backend", "__init__.py"), f"the stub env imports q3tts from {got}, not {root}"
cuda = torch.cuda.is_available()
print(f"stub env ok: python {sys.version.split()[0]}, numpy {numpy.__version__}, torch {torch.__version__} "
      f"(cuda {cuda}, {torch.cuda.device_count()} devices), q3tts {os.path.dirname(got)}")
if os.environ["DEVICE"] == "gpu":
    assert cuda, "torch in the stub env sees no CUDA device"
    x = torch.ones(64, 64, device="cuda", dtype=torch.bfloat16)
    assert float((x @ x).float().mean()) == 64.0
EOF
# the stub ignores PYTHONPATH (TRITON_RECIPE §4.3): check without it, as the stub will see it
env -u PYTHONPATH ROOT="$ROOT" DEVICE="$DEVICE" "$STUB_ENV/bin/python3" "$WORK/stub_check.py" \
  || die "the stub env cannot import what the model needs (see above); .pth: $(cat "$STUB_SITE/zz_q3tts_image_site.pth")"

export Q3TTS_PYTRITON_ROOT="$PYTRITON_DIR" Q3TTS_STUB_ENV="$STUB_ENV" Q3TTS_TRITON_RUNTIME="$WORK/runtime"
unset Q3TTS_TRITON_HOME
"$PY" -m q3tts.serving.runtime --prepare >"$WORK/runtime.json" || die "q3tts runtime --prepare failed"
LDP="$("$PY" -c 'import json, sys; print(":".join(json.load(open(sys.argv[1]))["ld_library_path"]))' "$WORK/runtime.json")"
log "runtime ready: LD_LIBRARY_PATH+=$LDP"
MISSING="$(LD_LIBRARY_PATH="$LDP${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ldd "$WORK/runtime/backends/python/triton_python_backend_stub" \
  "$WORK/runtime/backends/python/libtriton_python.so" "$TS_ROOT/bin/tritonserver" 2>&1 | grep 'not found' || true)"
[ -z "$MISSING" ] || die "unresolved shared libraries (a model load would hang):
$MISSING"

# --- (2) checkpoint -----------------------------------------------------------------------------------
if [ -f "$CKPT/.gpu_serve_complete" ]; then
  log "reusing checkpoint $CKPT"
else
  log "making the checkpoint $CKPT (custom_voice $SIZE $SCALE, seed 0)"
  rm -rf "$CKPT"
  run_child timeout "$CKPT_TIMEOUT_S" "$PY" -m q3tts.cli make-checkpoint "$CKPT" --variant custom_voice --size "$SIZE" \
    --scale "$SCALE" --seed 0 >"$WORK/make_checkpoint.log" 2>&1 \
    || { tail -20 "$WORK/make_checkpoint.log" >&2; die "make-checkpoint failed or took > $CKPT_TIMEOUT_S s"; }
  touch "$CKPT/.gpu_serve_complete"
fi
log "checkpoint: $(du -sh "$CKPT" | cut -f1)"

# --- (3) serve ----------------------------------------------------------------------------------------
log "starting q3tts serve (readiness timeout ${READY_TIMEOUT_S} s; log $SERVER_DIR/server.log)"
rm -f "$SERVE_OUT"
"$PY" -m q3tts.cli serve --model "$CKPT" --gpus "$GPUS" --dtype "$DTYPE" --max-slots "$MAX_SLOTS" \
  --pool "${POOL:-}" --run-dir "$SERVER_DIR" --ready-timeout-s "$READY_TIMEOUT_S" >"$SERVE_OUT" 2>&1 &
SERVE_PID=$!
echo "$SERVE_PID" >"$PIDS_FILE"
DEADLINE=$((SECONDS + READY_TIMEOUT_S + 30))
until grep -q '"grpc_port"' "$SERVE_OUT" 2>/dev/null; do
  alive "$SERVE_PID" || { wait "$SERVE_PID" 2>/dev/null || true; SERVE_PID=""; server_tail; die "q3tts serve exited before ready"; }
  if [ "$SECONDS" -ge "$DEADLINE" ]; then die "tritonserver not ready after $((READY_TIMEOUT_S + 30)) s (a wrong libpython or numpy makes the load hang)"; fi
  sleep 0.5
done
read -r GRPC_PORT METRICS_PORT TS_PID < <("$PY" -c 'import json, sys
for line in open(sys.argv[1]):
    if line.startswith("{") and "grpc_port" in line:
        d = json.loads(line); print(d["grpc_port"], d["metrics_port"], d["pid"]); break' "$SERVE_OUT") \
  || die "cannot read the ports from $SERVE_OUT"
echo "$SERVE_PID $TS_PID" >"$PIDS_FILE"
log "ready: grpc 127.0.0.1:$GRPC_PORT (tritonserver pid $TS_PID)"
grep -E '\[q3tts\] (loading|ready)' "$SERVER_DIR/server.log" | cut -c1-400 || true
if [ "$DEVICE" = gpu ]; then
  nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv,noheader || true
fi

# --- (4) bench ----------------------------------------------------------------------------------------
TITLE="Qwen3-TTS serve bench: tritonserver 2.51 python backend, $DEVICE ($( [ "$DEVICE" = gpu ] && nvidia-smi --query-gpu=name --format=csv,noheader -i "${GPUS%%,*}" 2>/dev/null | head -1 || echo cpu)), CustomVoice $SIZE $SCALE random weights, $DTYPE, max_slots $MAX_SLOTS${POOL:+, $POOL}, gRPC streaming, $REQUESTS utterances/stream, max_frames $MAX_FRAMES ($(awk "BEGIN {print $MAX_FRAMES * 0.08}") s), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
log "bench: concurrency $CONCURRENCY, modes $MODES"
LEFT=$((TOTAL_BUDGET_S - (SECONDS - T0) - 40))  # 40 s for the stop
if [ "$LEFT" -lt "$BENCH_TIMEOUT_S" ]; then
  [ "$LEFT" -ge 30 ] || die "no time left for the bench (TOTAL_BUDGET_S=$TOTAL_BUDGET_S, $((SECONDS - T0)) s used)"
  log "bench timeout cut to $LEFT s (TOTAL_BUDGET_S=$TOTAL_BUDGET_S)"; BENCH_TIMEOUT_S=$LEFT
fi
BENCH_RC=0
run_child timeout "$BENCH_TIMEOUT_S" "$PY" perf/bench_serve.py --url "127.0.0.1:$GRPC_PORT" --concurrency "$CONCURRENCY" \
  --modes "$MODES" --requests "$REQUESTS" --max-frames "$MAX_FRAMES" --warmup "$WARMUP" --timeout-s 120 \
  --check --md "$MD" --json "$WORK/serve_bench.json" --title "$TITLE" \
  --metrics-url "http://127.0.0.1:$METRICS_PORT/metrics" || BENCH_RC=$?
if [ "$DEVICE" = gpu ]; then
  nvidia-smi --query-gpu=index,memory.used,utilization.gpu --format=csv,noheader || true
fi
if [ -n "${OUT:-}" ] && [ -f "$MD" ]; then
  mkdir -p "$OUT"; cp "$MD" "$OUT/serve_bench.md"; cp "$WORK/serve_bench.json" "$OUT/" 2>/dev/null || true
fi
case "$BENCH_RC" in
  0) ;;
  124) die "the bench took longer than ${BENCH_TIMEOUT_S} s" ;;
  *) die "the bench failed (rc $BENCH_RC): errors or bad streams above" ;;
esac
if grep -qiE 'Traceback|\[q3tts\].*(error|failed)' "$SERVER_DIR/server.log"; then
  echo "[gpu_serve] note: the server log mentions errors:" >&2
  grep -iE -A3 'Traceback|\[q3tts\].*(error|failed)' "$SERVER_DIR/server.log" | head -30 >&2
fi

# --- (5) stop -----------------------------------------------------------------------------------------
stop_server
TS_PID=""
log "server stopped; table: $MD${OUT:+ (and $OUT/serve_bench.md)}"
