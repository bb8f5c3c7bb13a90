#!/usr/bin/env bash
# One device-tool call over a clean snapshot of a commit, so that uncommitted work in the tree cannot leak into a
# GPU measurement. Here: git archive HEAD | gzip -9 > .gpu/snap.tar.gz (SNAP= picks another archive); carry
# [".gpu/snap.tar.gz", ".gpu/site", "perf/gpu_round.sh"] (+ ".gpu/pytriton_slim.tgz" and the slim numpy wheel for a
# served run). Each argument is a step, e.g. "run bench 120 python3 perf/bench_engine.py --batches 1 64": name,
# time limit (s), command; its log goes to $OUT/<name>.log and its tail (TAILN lines) to the output. More than 7 files
# under $OUT at the end (the tool brings back 8) are packed into $OUT/round.tgz. COMMIT=<sha> names the snapshot's
# commit in the CSV rows the benches append (LOADTEST_COMMIT): the snapshot has no .git (one in the archive, e.g. a
# tar of the device's copy of the tree, is removed: it may be stale).
# Triton's compile cache: a fresh machine compiles every kernel variant again (part of an engine's 70-134 s start).
# Carry .gpu/triton_cache.tgz (from an earlier call's $OUT) and the steps start from it; the cache as it stands at
# the end comes back as $OUT/triton_cache.tgz when it is under 15 MiB (kernels the commit did not change hit).
# The kernels' tuned launch configs (EngineConfig.tune_cache, which the engine benches and `q3tts serve` read from
# $Q3TTS_TUNE_CACHE): carry .gpu/tuning.pkl (an earlier call's $OUT/tuning.pkl; a table a step named, e.g.
# /tmp/head.pkl, comes back as $OUT/table-head.pkl) and the engines start from it
# (valid while kernels/*.py, torch, triton and the GPU model are the same: kernels/autotune.py fingerprint), so a
# cold machine's engine compiles and times only what the file lacks; the file as it stands at the end comes back.
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
SRC="$PWD"; S=/tmp/s; rm -rf $S; mkdir -p $S; tar -xzf ${SNAP:-.gpu/snap.tar.gz} -C $S; mkdir -p $S/.gpu; cp -r .gpu/site $S/.gpu/site
for f in .gpu/pytriton_slim.tgz; do [ -f $f ] && ln -s $SRC/$f $S/.gpu/; done; [ -d .whl ] && ln -s $SRC/.whl $S/.whl
rm -rf $S/.git; cd $S; export PYTHONPATH="$S/.gpu/site" LOADTEST_COMMIT="${COMMIT:-unknown}"
export TRITON_CACHE_DIR=/tmp/triton_cache; mkdir -p $TRITON_CACHE_DIR
[ -f "$SRC/.gpu/triton_cache.tgz" ] && tar -xzf "$SRC/.gpu/triton_cache.tgz" -C $TRITON_CACHE_DIR
export Q3TTS_TUNE_CACHE=/tmp/q3tts_tuning.pkl
[ -f "$SRC/.gpu/tuning.pkl" ] && [ ! -f $Q3TTS_TUNE_CACHE ] && cp "$SRC/.gpu/tuning.pkl" $Q3TTS_TUNE_CACHE
pip_e() { python3 -m pip install -q --no-index --no-deps --no-build-isolation -e .; }
pip_e >"$OUT/pip.log" 2>&1 || { tail -5 "$OUT/pip.log"; exit 1; }
T0=$SECONDS
run() { local name=$1; local lim=$2; shift 2; echo "=== $name (+$((SECONDS-T0))s): $*"
  timeout "$lim" "$@" > "$OUT/$name.log" 2>&1; local rc=$?; tail -${TAILN:-25} "$OUT/$name.log"; echo "=== $name rc=$rc (+$((SECONDS-T0))s)"; }
# at ARCHIVE COMMIT STEP...: one step in another commit's snapshot (a git archive carried beside the first), e.g.
# "at .gpu/snap-b.tar.gz <sha> run bench 300 python3 perf/bench_engine.py ...": an A/B in one call on one machine.
at() { local arc=$1 commit=$2 dir=/tmp/s-$2; shift 2; rm -rf "$dir"; mkdir -p "$dir"; tar -xzf "$SRC/$arc" -C "$dir"
  (cd "$dir" && { pip_e >"$OUT/pip-$commit.log" 2>&1 || { echo "=== at $commit: pip failed, step skipped"; exit; }
   LOADTEST_COMMIT=$commit "$@"; })
  pip_e >>"$OUT/pip.log" 2>&1; }
for step in "$@"; do eval "$step"; done
[ -f $Q3TTS_TUNE_CACHE ] && cp $Q3TTS_TUNE_CACHE "$OUT/tuning.pkl"
# tables the steps kept elsewhere (Q3TTS_TUNE_CACHE=/tmp/head.pkl ...) come back too: a fresh H200 table took 150 s
# of tuning and chain tuning that the next call need not repeat (forty-sixth session)
for t in /tmp/*.pkl; do [ -f "$t" ] && [ "$t" != "$Q3TTS_TUNE_CACHE" ] && cp "$t" "$OUT/table-$(basename "$t")"; done
# the device tool brings back at most 8 files: past 7 (the 8th is the cache), everything else as one round.tgz
if [ "$(find "$OUT" -type f | wc -l)" -gt 7 ]; then
  tar -czf /tmp/round.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/round.tgz "$OUT/"; fi
tar -czf /tmp/triton_cache.tgz -C $TRITON_CACHE_DIR . && [ "$(stat -c %s /tmp/triton_cache.tgz)" -lt $((15 << 20)) ] \
  && mv /tmp/triton_cache.tgz "$OUT/" || echo "triton cache not brought back ($(du -sh $TRITON_CACHE_DIR | cut -f1))"
