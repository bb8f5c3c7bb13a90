"""`q3tts serve`: render the model repository into a run dir and run tritonserver on 127.0.0.1.

`TritonServer` is the one implementation of starting and stopping the server (tests, perf scripts, the
demo and the Docker entrypoint use it): free ports, the rendered repository, the server env from
`runtime.prepare()`, readiness with a timeout (a load hangs forever when libpython is missing), and an
ordered stop through Triton itself:
1. unload the sequence model through the repository API (the server runs in explicit model control mode).
   The model sees the unload within a tick and ends every open request with "the model is being
   unloaded (...)"; Triton drops the sequences it still holds for clients that went away without END (those count
   as in-flight inferences and would otherwise hold a plain SIGTERM until --exit-timeout-secs);
2. SIGTERM by PID, wait; 3. wait for the python stubs (they outlive the server by ~2 s and keep writing
   to its log). A server or stub left by a killed run of the same run dir is stopped before a start.

NOTE (measured, Triton 2.51): a client that keeps its gRPC stream open still holds the shutdown until
--exit-timeout-secs, whatever the model does; the server then exits without calling finalize().
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from q3tts_client import protocol
from q3tts.serving import health, runtime
from q3tts.serving.render import RepositorySettings, add_settings_arguments, parse_pool
from q3tts.serving.repository import render_repository
from q3tts.voices.store import default_voices_dir

__all__ = ["ServerError", "TritonServer", "free_ports", "parse_gpus", "parse_pool"]


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1 (bound together, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def detect_gpus() -> list[int]:
    """GPU indices from nvidia-smi (no torch import); [] without a driver."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [i for i, _ in enumerate(line for line in out.splitlines() if line.startswith("GPU "))]


def parse_gpus(spec: str | None) -> list[int]:
    if spec in (None, "auto", "all"):
        return detect_gpus()
    if spec in ("", "none", "cpu"):
        return []
    return [int(x) for x in spec.split(",") if x != ""]


SERVER_PROGRAMS = ("tritonserver", runtime.STUB)


class ServerError(RuntimeError):
    pass


class TritonServer:
    """One tritonserver process on 127.0.0.1 serving the rendered repository.

    with TritonServer(checkpoint, run_dir=tmp) as server:
        server.grpc_url, server.http_url, server.metrics_url, server.log_text()
    """

    def __init__(self, model: str, *, run_dir: Path | None = None, http_port: int = 0, grpc_port: int = 0,
                 metrics_port: int = 0, gpus: list[int] | None = None, dtype: str | None = None,
                 max_slots: int | None = None, pool: dict | None = None, idle_s: float = 30.0,
                 chunk_schedule: str | None = None, stub_env: Path | runtime.StubEnvSpec | None = None,
                 ready_timeout_s: float = 300.0, exit_timeout_s: int = 10, log_verbose: int = 0,
                 bind: str = "127.0.0.1", voices_dir: Path | None = None, voice_cache_size: int | None = None,
                 instances: int = 1, max_server_memory_gib: float = RepositorySettings.max_server_memory_gib):
        self.model = str(Path(model).resolve()) if Path(model).exists() else model
        self.run_dir = (Path(run_dir) if run_dir else Path(tempfile.mkdtemp(prefix="q3tts-serve-"))).resolve()
        self.gpus = detect_gpus() if gpus is None else list(gpus)
        self.voices_dir = Path(voices_dir or default_voices_dir()).resolve()  # registered voices (q3tts.voices)
        self.settings = RepositorySettings(self.model, tuple(self.gpus), dtype, max_slots, dict(pool or {}),
                                           float(idle_s), chunk_schedule, str(self.voices_dir), voice_cache_size,
                                           instances=instances, max_server_memory_gib=max_server_memory_gib)
        self.stub_env = stub_env
        self.ready_timeout_s = ready_timeout_s
        self.exit_timeout_s = exit_timeout_s
        self.log_verbose = log_verbose
        self.bind = bind  # 127.0.0.1 everywhere except inside a container (docker/Dockerfile)
        ports = free_ports(3)
        self.http_port = http_port or ports[0]
        self.grpc_port = grpc_port or ports[1]
        self.metrics_port = metrics_port or ports[2]
        self.proc: subprocess.Popen | None = None
        self.log_path = self.run_dir / "server.log"
        self._lock = threading.Lock()
        self._listening_pid: int | None = None  # the server process whose log showed our three ports

    # --- urls ---------------------------------------------------------------------------------------------
    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    # --- repository and command ---------------------------------------------------------------------------
    @property
    def repository(self) -> Path:
        return self.run_dir / "model_repository"

    def template_values(self, rt: runtime.Runtime) -> dict[str, str]:
        """The rendered configs' values (render.RepositorySettings), with the stub env of `rt`."""
        env = str(rt.execution_env) if rt.use_execution_env else None
        return dataclasses.replace(self.settings, execution_env=env).values()

    def command(self, rt: runtime.Runtime) -> list[str]:
        cmd = [str(rt.tritonserver), "--model-repository", str(self.repository),
               "--backend-directory", str(rt.backend_dir),
               # explicit: every model loads at start, and stop() can unload the sequence model
               "--model-control-mode", "explicit", "--load-model", "*",
               "--http-address", self.bind, "--http-port", str(self.http_port),
               "--grpc-address", self.bind, "--grpc-port", str(self.grpc_port),
               "--metrics-address", self.bind, "--metrics-port", str(self.metrics_port),
               "--allow-gpu-metrics", "true" if self.gpus else "false",
               "--disable-auto-complete-config", "--exit-timeout-secs", str(self.exit_timeout_s),
               "--log-verbose", str(self.log_verbose)]
        if not self.gpus:
            cmd += ["--pinned-memory-pool-byte-size", "0"]
        return cmd

    # --- lifecycle ----------------------------------------------------------------------------------------
    def start(self) -> TritonServer:
        rt = runtime.prepare(self.stub_env)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._kill(self._run_dir_pids())  # left by a killed run of this run dir (they may hold the GPU)
        self.check_ports()
        render_repository(self.repository, self.template_values(rt))
        env = rt.server_env()
        if not self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ""
        with open(self.log_path, "wb") as log:
            # NOTE: cwd = run dir: the stub's sys.path[0] is the server's working directory; own session so
            # Ctrl-C reaches only us and the stop stays ordered.
            self.proc = subprocess.Popen(self.command(rt), cwd=self.run_dir, env=env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def is_ready(self) -> bool:
        """Strict readiness (serving/health.py) of THIS server: its process runs, its log says it listens on
        our three ports (so a probe answered by another server on a taken port never counts), every engine
        instance's `q3tts_instance_ready` is 1."""
        return self.running and self._listening() and health.not_ready_reason(
            self.http_url, f"127.0.0.1:{self.metrics_port}", self.settings.engine_instances) is None

    def _listening(self) -> bool:
        if self._listening_pid == self.proc.pid:  # seen once for this process: the log only grows
            return True
        log = self.log_text()
        seen = all(f'Started {service} at {self.bind}:{port}"' in log for service, port in (
            ("GRPCInferenceService", self.grpc_port), ("HTTPService", self.http_port),
            ("Metrics Service", self.metrics_port)))
        self._listening_pid = self.proc.pid if seen else None
        return seen

    def check_ports(self) -> None:
        """Refuse to start when a port is taken, naming it (tritonserver would die with 'Socket already in use'
        while a readiness probe could reach whatever holds the port)."""
        for name, port in (("http", self.http_port), ("grpc", self.grpc_port), ("metrics", self.metrics_port)):
            with socket.socket() as s:
                try:
                    s.bind((self.bind, port))
                except OSError as e:
                    raise ServerError(f"the {name} port {self.bind}:{port} is already in use ({e.strerror}): "
                                      f"pass another --{name}-port, or 0 for a free one") from None

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"tritonserver exited with {self.proc.returncode} before ready; "
                                  f"log {self.log_path}:\n{self.log_text()[-4000:]}")
            if self.is_ready():
                return
            time.sleep(0.1)
        raise ServerError(f"tritonserver not ready after {self.ready_timeout_s:.0f} s (a missing libpython "
                          f"makes the load hang); log {self.log_path}:\n{self.log_text()[-4000:]}")

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _repository_api(self, path: str) -> list | dict:
        req = urllib.request.Request(f"http://{self.http_url}/v2/repository/{path}", data=b"{}", method="POST")
        with urllib.request.urlopen(req, timeout=10) as r:
            body = r.read()
        return json.loads(body) if body else {}

    def unload(self, model: str = protocol.MODEL) -> bool:
        """Unload `model` and wait (up to the exit timeout) until Triton reports it unloaded."""
        self._repository_api(f"models/{model}/unload")
        deadline = time.monotonic() + self.exit_timeout_s
        while time.monotonic() < deadline and self.running:
            states = {m["name"]: m.get("state") for m in self._repository_api("index")}
            if states.get(model) not in ("READY", "UNLOADING"):
                return True
            time.sleep(0.1)
        return False

    def stop(self) -> None:
        """Ordered stop: unload the sequence model, SIGTERM by PID and wait, then wait for the stubs."""
        with self._lock:
            if self.proc is None:
                return
            if self.running:
                try:
                    if not self.unload():
                        print(f"[q3tts] {protocol.MODEL} did not unload in {self.exit_timeout_s} s", file=sys.stderr)
                except OSError as e:  # the stop must go on
                    print(f"[q3tts] unloading {protocol.MODEL} failed: {e}", file=sys.stderr)
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=self.exit_timeout_s + 15)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            self._kill(self._run_dir_pids(), grace_s=15)
            self.proc = None

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- processes of this run dir ------------------------------------------------------------------------
    def _run_dir_pids(self) -> list[int]:
        """Live tritonserver and python stub processes whose command line names this run dir's repository."""
        needle, pids = str(self.repository).encode(), []
        for d in Path("/proc").iterdir():
            try:
                argv = (d / "cmdline").read_bytes().split(b"\0") if d.name.isdigit() else []
            except OSError:
                continue
            if argv and Path(argv[0].decode(errors="replace")).name in SERVER_PROGRAMS \
                    and any(a == needle or a.startswith(needle + b"/") for a in argv) and _alive(int(d.name)):
                pids.append(int(d.name))
        return pids

    @staticmethod
    def _kill(pids: list[int], grace_s: float = 0.0) -> None:
        """Wait up to `grace_s` for `pids` to exit, then SIGKILL the rest."""
        deadline = time.monotonic() + grace_s
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        for p in pids:
            if _alive(p):
                try:
                    os.kill(p, signal.SIGKILL)
                except OSError:
                    pass


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except OSError:
        return False


# --- CLI ----------------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    add_settings_arguments(p)
    p.add_argument("--http-port", type=int, default=0, help="0 = a free port")
    p.add_argument("--grpc-port", type=int, default=0, help="0 = a free port")
    p.add_argument("--metrics-port", type=int, default=0, help="0 = a free port")
    p.add_argument("--gpus", default="auto", help="auto | none | all | 0,1 (one engine instance per GPU)")
    p.add_argument("--stub-env", type=Path, default=None,
                   help="the venv the python stub runs in (default: this one; it needs numpy<2)")
    p.add_argument("--run-dir", type=Path, default=None, help="where the rendered repository and log go")
    p.add_argument("--ready-timeout-s", type=float, default=600.0)
    p.add_argument("--log-verbose", type=int, default=0)
    p.add_argument("--bind", default="127.0.0.1", help="listen address (keep 127.0.0.1 outside a container)")
    p.add_argument("--openai-port", type=int, default=0, help="also serve POST /v1/audio/speech on this port")
    p.add_argument("--openai-bind", default="127.0.0.1", help="listen address of the OpenAI endpoint")


def run(args: argparse.Namespace) -> int:
    try:
        server = TritonServer(args.model, run_dir=args.run_dir, http_port=args.http_port, grpc_port=args.grpc_port,
                              metrics_port=args.metrics_port, gpus=parse_gpus(args.gpus), dtype=args.dtype,
                              max_slots=args.max_slots, pool=parse_pool(args.pool), idle_s=args.idle_s,
                              chunk_schedule=args.chunk_schedule, stub_env=args.stub_env,
                              ready_timeout_s=args.ready_timeout_s, log_verbose=args.log_verbose, bind=args.bind,
                              voices_dir=args.voices_dir, voice_cache_size=args.voice_cache_size,
                              instances=args.instances, max_server_memory_gib=args.max_server_memory_gib)
    except ValueError as e:  # a flag the settings refuse (RepositorySettings), named
        print(f"q3tts serve: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"[q3tts] starting tritonserver (log {server.log_path})", flush=True)
    try:
        server.start()
    except (ServerError, runtime.RuntimeSetupError) as e:
        print(f"[q3tts] {e}", file=sys.stderr)
        return 1
    print(f"[q3tts] ready: grpc {server.grpc_url}  http {server.http_url}  metrics {server.metrics_url}  "
          f"model {protocol.MODEL} (+ {protocol.ONESHOT_MODEL})", flush=True)
    print(json.dumps({"grpc_port": server.grpc_port, "http_port": server.http_port,
                      "metrics_port": server.metrics_port, "pid": server.proc.pid,
                      "run_dir": str(server.run_dir)}), flush=True)
    openai = None
    try:
        if args.openai_port:
            from q3tts.openai_api.server import OpenAIServer

            openai = OpenAIServer(server.grpc_url, args.openai_port, args.openai_bind).start()
            print(f"[q3tts] OpenAI endpoint: {openai.url}/v1/audio/speech", flush=True)
        while not stop.is_set() and server.running:
            stop.wait(0.5)
    finally:
        code = 0 if server.running else 1
        if code:  # it died under us: say why
            print(f"[q3tts] tritonserver exited with {server.proc.returncode}; log {server.log_path}:\n"
                  f"{server.log_text()[-4000:]}", file=sys.stderr)
        print("[q3tts] stopping", flush=True)
        if openai is not None:
            openai.stop()
        server.stop()
    return code


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="q3tts serve")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
