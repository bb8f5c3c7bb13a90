"""`q3tts serve` says ready only when its own server is: a taken port fails the start with the cause, and a
probe answered by some other server on our ports never counts as ready."""

from __future__ import annotations

import http.server
import socket
import subprocess
import sys
import threading

import pytest

from q3tts.serving import health
from q3tts.serving.launcher import TritonServer, free_ports


class FakeReadyServer(http.server.BaseHTTPRequestHandler):
    """Answers like a ready q3tts server: /v2/health/ready 200, a metrics page with one ready instance."""

    def do_GET(self):  # noqa: N802 - http.server's name
        body = b"q3tts_instance_ready{model=\"qwen3_tts\"} 1\n" if self.path == "/metrics" else b""
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def impostor():
    """Another server holding two ports (http, metrics) on 127.0.0.1."""
    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeReadyServer) for _ in range(2)]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    yield [s.server_address[1] for s in servers]
    for s in servers:
        s.shutdown()
        s.server_close()


def test_a_probe_answered_by_another_server_is_not_ready(tmp_path, impostor):
    http_port, metrics_port = impostor
    srv = TritonServer("ckpt", run_dir=tmp_path, gpus=[], http_port=http_port, metrics_port=metrics_port)
    srv.run_dir.mkdir(parents=True, exist_ok=True)
    srv.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # "our" server
    try:
        assert health.not_ready_reason(srv.http_url, f"127.0.0.1:{metrics_port}") is None  # the probe alone
        assert not srv.is_ready()  # our server's log never said it listens on these ports
        srv.log_path.write_text("".join(f'I0 x.cc:1] "Started {name} at 127.0.0.1:{port}"\n' for name, port in (
            ("GRPCInferenceService", srv.grpc_port), ("HTTPService", http_port), ("Metrics Service", metrics_port))))
        assert srv.is_ready()
        srv.proc.kill()
        srv.proc.wait()
        assert not srv.is_ready()  # a dead server is never ready
    finally:
        srv.proc.kill()
        srv.proc.wait()


def test_serve_with_a_taken_port_fails_naming_it(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", free_ports(1)[0]))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        run = subprocess.run([sys.executable, "-m", "q3tts.cli", "serve", "--model", str(tmp_path / "ckpt"),
                              "--gpus", "none", "--grpc-port", str(port), "--run-dir", str(tmp_path / "run")],
                             capture_output=True, text=True, timeout=120)
    finally:
        taken.close()
    assert run.returncode == 1 and "[q3tts] ready" not in run.stdout
    assert f"the grpc port 127.0.0.1:{port} is already in use" in run.stderr
    assert not (tmp_path / "run" / "server.log").exists()  # no tritonserver was started


def test_serve_refuses_instances_on_gpus_naming_the_flag(tmp_path):
    run = subprocess.run([sys.executable, "-m", "q3tts.cli", "serve", "--model", str(tmp_path / "ckpt"),
                          "--gpus", "0", "--instances", "2", "--run-dir", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr == "q3tts serve: --instances 2 is for CPU serving (--gpus none); on GPUs there is one " \
                         "instance per GPU (--gpus)\n"
