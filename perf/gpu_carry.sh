#!/usr/bin/env bash
# Build what the device-tool calls carry to the H200 (Python 3.12, no network there), under the
# gitignored .gpu/ and .whl/ (total < 64 MiB with the slim numpy wheel):
#   .gpu/site/                 tritonclient 2.51 (pure python), python-rapidjson, soxr  -> PYTHONPATH
#   .gpu/pytriton_slim.tgz     the nvidia-pytriton wheel's tritonserver + libs, 3.12 stub only
#   .whl/numpy-1.26.4-cp312-cp312-slim.whl   numpy<2 for the Triton stub env (tests/f2py/distutils dropped)
# Needs .venv (scripts/setup.sh) for the pytriton files. Usage: bash perf/gpu_carry.sh [--loadtest]
# --loadtest also builds .gpu/loadtest/ for `bash perf/gpu_loadtest.sh` (the one carry path of that call): the
# three above as xz (25 MiB less than as gzip/zip), perf_analyzer 2.51 and the peers' site, about 50 MiB:
#   pytriton_slim.tar.xz  numpy-1.26.4-cp312-cp312-slim.whl.xz (a stored zip)  site.tar.xz  perf_analyzer.xz
#   peers.tar.xz (perf/peers/site.sh gpu)  COMMIT (HEAD, "-dirty" when the tree that travels differs from it)
# Run it right before the call: COMMIT is what the results CSV names (the GPU machine gets no .git); parts
# already built are kept, so a second run only restamps COMMIT.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"; cd "$ROOT"
SITE_PACKAGES="$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
TMP="$(mktemp -d)"; trap 'rm -rf "$TMP"' EXIT
download() {  # cp312 manylinux wheels, no deps
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$TMP" "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }
}
mkdir -p .gpu/site .whl
download tritonclient==2.51.0 python-rapidjson==1.20 soxr==0.5.0.post1 numpy==1.26.4
(cd "$TMP" && unzip -qo tritonclient-*.whl 'tritonclient-2.51.0.data/purelib/tritonclient/*' \
  && cp -r tritonclient-2.51.0.data/purelib/tritonclient "$ROOT/.gpu/site/")  # no perf_analyzer binary (39 MB)
for w in "$TMP"/python_rapidjson-*.whl "$TMP"/soxr-*.whl; do unzip -qo "$w" -d .gpu/site; done
strip --strip-unneeded .gpu/site/rapidjson.*.so  # 6.8 -> 0.8 MB: the served carry must fit the tool's 64 MiB
mkdir -p "$TMP/np" && unzip -q "$TMP"/numpy-1.26.4-*.whl -d "$TMP/np"
(cd "$TMP/np" && find numpy -type d \( -name tests -o -name f2py -o -name distutils \) -prune -exec rm -rf {} + \
  && find numpy -name '*.pyi' -delete && rm -f numpy-1.26.4.dist-info/RECORD \
  && zip -qr "$ROOT/.whl/numpy-1.26.4-cp312-cp312-slim.whl" numpy numpy.libs numpy-1.26.4.dist-info)
(cd "$SITE_PACKAGES" && tar czf "$ROOT/.gpu/pytriton_slim.tgz" \
  --exclude='python_backend_stubs/3.8' --exclude='python_backend_stubs/3.9' --exclude='python_backend_stubs/3.10' \
  --exclude='python_backend_stubs/3.11' --exclude='python_backend_stubs/3.13' \
  --exclude='libpython3-419a3a08.13.so.1.0' pytriton/tritonserver nvidia_pytriton.libs)
du -sh .gpu/site .gpu/pytriton_slim.tgz .whl/numpy-1.26.4-cp312-cp312-slim.whl
[ "${1:-}" = --loadtest ] || exit 0
LT=.gpu/loadtest  # its parts come from pinned versions: one already built is kept (rm -rf .gpu/loadtest rebuilds)
mkdir -p "$LT" "$TMP/npw"
part() { [ -s "$LT/$1" ] || { echo "building $LT/$1" && "${@:2}" >"$LT/$1.tmp" && mv "$LT/$1.tmp" "$LT/$1"; }; }
xz6() { xz -6 -T0 -c "$@"; }
numpy_stored() {  # the slim wheel as a stored zip, which xz compresses
  (cd "$TMP/npw" && unzip -qo "$ROOT/.whl/numpy-1.26.4-cp312-cp312-slim.whl" && zip -q -0 -r ../numpy-slim.whl .) && xz6 "$TMP/numpy-slim.whl"
}
peers_site() { bash perf/peers/site.sh gpu "$TMP/peers" >&2 && tar -C "$TMP/peers" -cf - . | xz6; }
part pytriton_slim.tar.xz bash -c 'gzip -dc .gpu/pytriton_slim.tgz | xz -6 -T0'
part numpy-1.26.4-cp312-cp312-slim.whl.xz numpy_stored
part site.tar.xz bash -c 'tar -C .gpu/site -cf - . | xz -6 -T0'
part perf_analyzer.xz bash -c "unzip -p $TMP/tritonclient-2.51.0-*.whl tritonclient-2.51.0.data/data/bin/perf_analyzer | xz -6 -T0"
part peers.tar.xz peers_site
echo "$(git rev-parse --short HEAD)$([ -z "$(git status --porcelain)" ] || echo -dirty)" >"$LT/COMMIT"
du -sh "$LT"/* "$LT"
