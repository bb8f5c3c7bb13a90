"""Serve a real-size random Qwen3-TTS CustomVoice checkpoint from tritonserver on the GPU machine and stream
1 and 16 concurrent sequences (greedy and sampled) with perf/bench_serve.py over gRPC: TTFA p50/p90, RTF and
audio-s/s, every stream checked (--check); $OUT/serve_bench.md when OUT is set. One device call, < 8 min.

Run it through perf/gpu_serve.sh, which installs q3tts -e into the image Python and puts the client wheels
on PYTHONPATH. Steps: (1) unpack the slim pytriton tarball and describe the stub env: a venv of the image's
base Python with numpy<2 that falls through to the image's site-packages (the image's numpy 2 empties every
output of Triton 2.51; runtime.StubEnvSpec builds it) (2) make the checkpoint (reused when complete)
(3) serve it (launcher.TritonServer: a server left by a killed run is stopped first) (4) bench (5) stop.
On failure the server log's tail is printed; with OUT, the logs are copied there.

Settings (environment; the defaults are for the H200 machine):
  DEVICE=gpu (gpu | cpu)   Q3TTS_GPU_SERVE_SCALE=full (full | tiny)   SIZE=1.7b (1.7b | 0.6b)
  GPUS=0   DTYPE=bfloat16 (cpu: float32)   MAX_SLOTS=32 (cpu: 8)   POOL=""  (`q3tts serve --pool`, e.g.
  codec_kernels=true)   CONCURRENCY=1,16   MODES=greedy,sampled   REQUESTS=2 (utterances per stream)
  MAX_FRAMES=150   WARMUP=<largest concurrency>   READY_TIMEOUT_S=240   BENCH_TIMEOUT_S=300
  BENCH_CMD="" (a shell command run as the bench instead, GRPC_URL / METRICS_URL naming the server: perf/gpu_loadtest.sh)
  CKPT_TIMEOUT_S=240   TOTAL_BUDGET_S=470 (the bench is cut to what is left of it)
  WORK=<repo>/run/gpu_serve   CKPT=$WORK/ckpt-cv-$SIZE-$SCALE   TRITON_TGZ=<repo>/.gpu/pytriton_slim.tgz
  CLIENT_SITE=<repo>/.gpu/site (empty: none)   STUB_PY=<base interpreter of this Python>
  NUMPY_WHL=<repo>/.whl/numpy-1.*-cp<XY>-*.whl   OUT (optional)

CPU simulation (here, with the venv's Python; a 3.11 slim tarball made from the venv's wheel the way
perf/gpu_carry.sh makes the 3.12 one, and the cp311 numpy<2 wheel):
  PY=.venv/bin/python DEVICE=cpu Q3TTS_GPU_SERVE_SCALE=tiny SIZE=0.6b CONCURRENCY=1,2 MAX_FRAMES=12 \\
  TRITON_TGZ=/tmp/gpu_sim/pytriton_slim311.tgz CLIENT_SITE= NUMPY_WHL=<numpy-1.26.4-cp311 wheel> \\
  bash perf/gpu_serve.sh
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tarfile
import time
from pathlib import Path

from q3tts.serving.launcher import ServerError, TritonServer, parse_gpus, parse_pool
from q3tts.serving.runtime import RuntimeSetupError, StubEnvSpec
from report import commit  # perf/report.py (this script's directory is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[gpu_serve +{time.monotonic() - T0:.0f}s] {msg}", flush=True)


class Failed(RuntimeError):
    pass


def env(name: str, default: str) -> str:
    return os.environ.get(name, default)


def smi(*query: str) -> str:
    """nvidia-smi --query-gpu output (empty without a driver)."""
    try:
        return subprocess.run(["nvidia-smi", f"--query-gpu={','.join(query)}", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def unpack(tgz: Path, dest: Path) -> None:
    """Unpack the slim pytriton tarball into dest (skipped when dest holds this tarball already)."""
    if not tgz.is_file():
        raise Failed(f"TRITON_TGZ={tgz} missing: carry .gpu/pytriton_slim.tgz (bash perf/gpu_carry.sh)")
    stamp = f"{tgz.stat().st_size} {tgz.stat().st_mtime_ns} {tgz.name}"
    if (dest / ".stamp").exists() and (dest / ".stamp").read_text() == stamp:
        return
    log(f"unpacking {tgz} -> {dest}")
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    with tarfile.open(tgz) as tar:
        tar.extractall(dest)
    (dest / ".stamp").write_text(stamp)


def stub_env_spec(work: Path, client_site: str) -> StubEnvSpec:
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub_py = Path(env("STUB_PY", os.path.join(sys.base_prefix, "bin", f"python{version}")))
    wheels = sorted(glob.glob(str(ROOT / ".whl" / f"numpy-1.*-cp{version.replace('.', '')}-*.whl")))
    numpy_whl = Path(env("NUMPY_WHL", wheels[0] if wheels else ""))
    if not numpy_whl.is_file():
        raise Failed(f"no numpy<2 wheel for Python {version} (NUMPY_WHL='{numpy_whl}'): carry .whl/")
    paths = sysconfig.get_paths()  # the image's packages (torch, q3tts -e) after the stub env's numpy
    sites = dict.fromkeys([paths["purelib"], paths["platlib"], *([client_site] if client_site else [])])
    return StubEnvSpec(work / "stubenv", stub_py, numpy_whl, tuple(sites))


def make_checkpoint(ckpt: Path, size: str, scale: str, timeout_s: float) -> None:
    if (ckpt / ".gpu_serve_complete").exists():
        log(f"reusing checkpoint {ckpt}")
        return
    log(f"making the checkpoint {ckpt} (custom_voice {size} {scale}, seed 0)")
    shutil.rmtree(ckpt, ignore_errors=True)
    cmd = [sys.executable, "-m", "q3tts.cli", "make-checkpoint", str(ckpt), "--variant", "custom_voice",
           "--size", size, "--scale", scale, "--seed", "0"]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise Failed(f"make-checkpoint took > {timeout_s:.0f} s") from None
    if run.returncode:
        raise Failed(f"make-checkpoint failed:\n{run.stderr[-2000:]}")
    (ckpt / ".gpu_serve_complete").touch()


def bench(server: TritonServer, work: Path, title: str, timeout_s: float) -> None:
    conc = env("CONCURRENCY", "1,16")
    cmd = [sys.executable, str(ROOT / "perf" / "bench_serve.py"), "--url", server.grpc_url, "--concurrency", conc,
           "--modes", env("MODES", "greedy,sampled"), "--requests", env("REQUESTS", "2"),
           "--max-frames", env("MAX_FRAMES", "150"), "--warmup", env("WARMUP", max(conc.split(","), key=int)),
           "--timeout-s", "120", "--check", "--md", str(work / "serve_bench.md"),
           "--json", str(work / "serve_bench.json"), "--title", title, "--metrics-url", server.metrics_url]
    if env("BENCH_CMD", ""):
        cmd = ["bash", "-c", env("BENCH_CMD", "")]
    what = env("BENCH_CMD", "") or f"concurrency {conc}, modes {env('MODES', 'greedy,sampled')}"
    log(f"bench: {what} (timeout {timeout_s:.0f} s)")
    try:
        rc = subprocess.run(cmd, timeout=timeout_s, env={**os.environ, "GRPC_URL": server.grpc_url,
                                                          "METRICS_URL": server.metrics_url}).returncode
    except subprocess.TimeoutExpired:
        raise Failed(f"the bench took longer than {timeout_s:.0f} s") from None
    if rc:
        raise Failed(f"the bench failed (rc {rc}): errors or bad streams above")


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed call still stops the server
    device, scale, size = env("DEVICE", "gpu"), env("Q3TTS_GPU_SERVE_SCALE", "full"), env("SIZE", "1.7b")
    if device not in ("gpu", "cpu"):
        raise Failed(f"DEVICE must be gpu or cpu, got {device!r}")
    gpu = device == "gpu"
    gpus = parse_gpus(env("GPUS", "0") if gpu else "none")
    dtype, max_slots = env("DTYPE", "bfloat16" if gpu else "float32"), int(env("MAX_SLOTS", "32" if gpu else "8"))
    work = Path(env("WORK", str(ROOT / "run" / "gpu_serve"))).resolve()
    ckpt = Path(env("CKPT", str(work / f"ckpt-cv-{size}-{scale}")))
    client_site, pool = env("CLIENT_SITE", str(ROOT / ".gpu" / "site")), env("POOL", "")
    work.mkdir(parents=True, exist_ok=True)
    if gpu and not smi("name"):
        raise Failed("DEVICE=gpu but nvidia-smi reports no GPU")
    if scale == "full" and shutil.disk_usage(work).free < 12 * 2**30:
        raise Failed(f"less than 12 GiB free under {work} (the full checkpoint needs ~5)")
    unpack(Path(env("TRITON_TGZ", str(ROOT / ".gpu" / "pytriton_slim.tgz"))), work / "pytriton")
    os.environ.update(Q3TTS_PYTRITON_ROOT=str(work / "pytriton"), Q3TTS_TRITON_RUNTIME=str(work / "runtime"))
    os.environ.pop("Q3TTS_TRITON_HOME", None)
    spec = stub_env_spec(work, client_site)
    log(f"device {device} gpus {gpus} dtype {dtype} max_slots {max_slots} checkpoint cv-{size}-{scale} "
        f"stub env {spec.path} ({spec.python}, {spec.numpy_wheel.name})")
    make_checkpoint(ckpt, size, scale, float(env("CKPT_TIMEOUT_S", "240")))
    server = TritonServer(str(ckpt), run_dir=work / "server", gpus=gpus, dtype=dtype, max_slots=max_slots,
                          pool=parse_pool(pool), stub_env=spec, ready_timeout_s=float(env("READY_TIMEOUT_S", "240")))
    out = os.environ.get("OUT")
    try:
        log(f"starting tritonserver (log {server.log_path})")
        server.start()
        log(f"ready: grpc {server.grpc_url} (tritonserver pid {server.proc.pid}); {smi('memory.used', 'memory.total')}")
        max_frames = int(env("MAX_FRAMES", "150"))
        title = (f"Qwen3-TTS serve bench: tritonserver 2.51 python backend, {device} ({smi('name') or 'cpu'}), "
                 f"CustomVoice {size} {scale} random weights, {dtype}, max_slots {max_slots}{', ' + pool if pool else ''}, "
                 f"gRPC streaming, {env('REQUESTS', '2')} utterances/stream, max_frames {max_frames} "
                 f"({max_frames * 0.08:g} s), commit {commit()}")
        left = float(env("TOTAL_BUDGET_S", "470")) - (time.monotonic() - T0) - 40  # 40 s for the stop
        timeout_s = min(float(env("BENCH_TIMEOUT_S", "300")), left)
        if timeout_s < 30:
            raise Failed(f"no time left for the bench ({time.monotonic() - T0:.0f} s used)")
        bench(server, work, title, timeout_s)
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
            for name in ("serve_bench.md", "serve_bench.json"):
                if (work / name).exists():  # not with BENCH_CMD
                    shutil.copy(work / name, Path(out) / name)
    except BaseException:
        print(f"---- tritonserver log ({server.log_path}), last 80 lines ----\n"
              + "\n".join(server.log_text().splitlines()[-80:]), file=sys.stderr)
        raise
    finally:
        server.stop()
        if out and server.log_path.exists():
            Path(out).mkdir(parents=True, exist_ok=True)
            shutil.copy(server.log_path, Path(out) / "gpu_serve_server.log")
    log(f"server stopped; table: {work / 'serve_bench.md'}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (Failed, ServerError, RuntimeSetupError) as e:
        log(f"FAILED: {e}")
        sys.exit(1)
