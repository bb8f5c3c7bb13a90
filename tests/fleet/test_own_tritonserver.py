"""The fleet path: `q3tts render-repository` writes a repository that a tritonserver started by hand (the
wheel's, NOT through `q3tts serve` or TritonServer) loads in explicit model control mode. Load, stream audio,
Prometheus-style metrics, unload with a sequence open (it ends at once with a clear reason, long before the
idle time), and the one-shot model loaded without the sequence model names what is missing."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import tritonclient.grpc as grpcclient

from q3tts_client import protocol as P
from q3tts_client.stream_client import start_inputs, synthesize
from q3tts.serving import health, runtime
from q3tts.serving.launcher import TritonServer, free_ports

pytestmark = pytest.mark.server
IDLE_S = 20.0  # far above how fast an unload must end an open sequence
VOICE = {"speaker": "ryan", "language": "english"}
GREEDY = {"greedy": True, "subtalker_greedy": True, "max_frames": 6}


class HandStartedServer:
    """tritonserver with the flags a fleet would use, on free loopback ports, stopped by PID."""

    def __init__(self, repository, log_path):
        self.http, self.grpc, self.metrics = (f"127.0.0.1:{p}" for p in free_ports(3))
        rt = runtime.prepare()  # the wheel's tritonserver, its python backend with a stub for this Python
        cmd = [str(rt.tritonserver), "--model-repository", str(repository), "--backend-directory",
               str(rt.backend_dir), "--model-control-mode", "explicit", "--allow-gpu-metrics", "false",
               "--pinned-memory-pool-byte-size", "0", "--exit-timeout-secs", "10", "--disable-auto-complete-config"]
        for name, url in (("http", self.http), ("grpc", self.grpc), ("metrics", self.metrics)):
            host, port = url.split(":")
            cmd += [f"--{name}-address", host, f"--{name}-port", port]
        env = {**rt.server_env(), "CUDA_VISIBLE_DEVICES": ""}  # PATH + LD_LIBRARY_PATH for the stub's Python
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + 60
        while self._get("/v2/health/live") != 200:
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log()
            time.sleep(0.2)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _get(self, path: str) -> int:
        try:
            with urllib.request.urlopen(f"http://{self.http}{path}", timeout=5) as r:
                return r.status
        except (OSError, urllib.error.HTTPError):
            return 0

    def repository(self, action: str, model: str = "") -> list | dict:
        path = f"models/{model}/{action}" if model else action
        req = urllib.request.Request(f"http://{self.http}/v2/repository/{path}", data=b"{}", method="POST")
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                body = r.read()
        except urllib.error.HTTPError as e:
            return {"error": json.loads(e.read() or b"{}").get("error", str(e))}
        return json.loads(body) if body else {}

    def state(self, model: str) -> str | None:
        return {m["name"]: m.get("state") for m in self.repository("index")}.get(model)

    def stop(self, repository) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        stubs = TritonServer("unused", run_dir=repository.parent, gpus=[])  # finds stubs of `repository`
        stubs._kill(stubs._run_dir_pids(), grace_s=15)


@pytest.fixture(scope="module")
def fleet(tiny_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet")
    repo = root / "model_repository"
    render = subprocess.run(
        [sys.executable, "-m", "q3tts.cli", "render-repository", str(repo), "--model", str(tiny_checkpoint),
         "--gpus", "none", "--max-slots", "4", "--idle-s", str(IDLE_S), "--execution-env", sys.prefix,
         "--voices-dir", str(root / "voices")], capture_output=True, text=True, timeout=120)
    assert render.returncode == 0, render.stderr
    server = HandStartedServer(repo, root / "server.log")
    yield server, repo
    server.stop(repo)


def sse_body(server, body: dict) -> str:
    """The raw SSE stream of one POST to the one-shot model's generate_stream (what curl prints)."""
    req = urllib.request.Request(f"http://{server.http}/v2/models/{P.ONESHOT_MODEL}/generate_stream",
                                 data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.read().decode()


def sse(server, body: dict) -> list[dict]:
    return [json.loads(line[6:]) for line in sse_body(server, body).splitlines() if line.startswith("data: ")]


def test_rendered_config_derives_its_values(fleet):
    _, repo = fleet
    config = (repo / P.MODEL / "config.pbtxt").read_text()
    assert "max_candidate_sequences: 4 " in config and '\\"max_slots\\": 4' in config
    assert f"max_sequence_idle_microseconds: {int(IDLE_S * 1e6)}" in config and f'"{IDLE_S}"' in config
    for key in ("checkpoint", "engine_config", "chunk_schedule", "idle_s", "voices_dir", "voice_cache_size",
                "EXECUTION_ENV_PATH"):  # each parameter is explained in the config itself
        assert re.search(rf"^  # {key}\b.*:", config, re.M) or re.search(rf"^  # {key} \(", config, re.M), key
    assert (repo / P.MODEL / "1" / "model.py").exists() and (repo / P.ONESHOT_MODEL / "1" / "model.py").exists()


def test_oneshot_without_the_sequence_model_names_it(fleet):
    server, _ = fleet
    assert server.state(P.MODEL) is None
    assert server.repository("load", P.ONESHOT_MODEL) == {}  # it loads no weights: READY on its own
    events = sse(server, {"TEXT": "Hello.", "SPEAKER": "ryan"})
    assert len(events) == 1 and "AUDIO" not in events[0]
    assert f"sequence model '{P.MODEL}', which is not loaded" in events[0]["error"]


def test_load_stream_audio_and_metrics(fleet):
    server, _ = fleet
    assert server.repository("load", P.MODEL) == {}, server.log()
    assert server.state(P.MODEL) == "READY"
    deadline = time.monotonic() + 60
    while (reason := health.not_ready_reason(server.http, server.metrics)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert reason is None
    r = synthesize(server.grpc, ["Hello from a fleet."], VOICE, GREEDY)
    assert r.error is None and r.audio.size > 0 and r.finals == 1
    events = sse(server, {"TEXT": "Hello.", "SPEAKER": "ryan", "greedy": True, "max_frames": 4})
    assert events and all("error" not in e for e in events) and sum(len(e["AUDIO"]) for e in events) > 0
    page = urllib.request.urlopen(f"http://{server.metrics}/metrics", timeout=5).read().decode()
    ours = [line for line in page.splitlines() if line.startswith("q3tts_")]
    assert ours and all('model_instance="' in line for line in ours)
    assert not any(re.search(r'[{,]instance="', line) for line in ours)
    types = dict(re.findall(r"^# TYPE (q3tts_\w+) (\w+)", page, re.M))
    assert types and all(name.endswith("_total") == (kind == "counter") for name, kind in types.items())
    helps = dict(re.findall(r"^# HELP (q3tts_\w+) (.*)$", page, re.M))
    assert all(text.lower() != name.replace("_", " ") for name, text in helps.items())


def test_sse_int16_events_are_smaller(fleet):
    """audio_format=int16 makes the SSE events carry AUDIO_INT16 integer arrays, under half the bytes of the
    float32 arrays per second of audio (the README states both)."""
    server, _ = fleet
    request = {"TEXT": "Hello there.", "SPEAKER": "ryan", "greedy": True, "subtalker_greedy": True,
               "max_frames": 12}
    per_second = {}
    for fmt, output in (("float32", P.OUTPUT_AUDIO), ("int16", P.OUTPUT_AUDIO_INT16)):
        body = sse_body(server, {**request, "audio_format": fmt})
        events = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: ")]
        samples = [x for e in events for x in e.get(output, [])]
        assert samples and all("error" not in e for e in events), body[:500]
        assert all(isinstance(x, int) for x in samples) == (fmt == "int16")
        per_second[fmt] = len(body) / (len(samples) / P.SAMPLE_RATE)
    print(f"SSE bytes per second of audio: {per_second}")
    assert per_second["int16"] < per_second["float32"] / 2


def audio_then_error(events: queue.Queue, timeout_s: float) -> tuple[int, str]:
    """(audio responses, the error that ends the stream): a TritonError before any audio, else the ERROR
    output of the last response."""
    audio = 0
    while True:
        result, error = events.get(timeout=timeout_s)
        if error is not None:
            return audio, str(error)
        if result.as_numpy(P.OUTPUT_ERROR) is not None:
            return audio, result.as_numpy(P.OUTPUT_ERROR)[0].decode()
        audio += result.as_numpy(P.OUTPUT_AUDIO) is not None


def test_unload_with_a_sequence_open_ends_it_at_once(fleet):
    """Runs last: the sequence model is unloaded while a sequence waits for more text. Its START had no END,
    so its audio streamed before END (text_mode's default while the text is open)."""
    server, _ = fleet
    events: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc)
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    try:
        client.async_stream_infer(P.MODEL, start_inputs("waiting for more text", **VOICE), sequence_id=4242,
                                  sequence_start=True, enable_empty_final_response=True)
        first, _ = events.get(timeout=30)  # text_mode defaults to incremental: audio before END
        assert first is not None and first.as_numpy(P.OUTPUT_AUDIO) is not None
        t0 = time.monotonic()
        assert server.repository("unload", P.MODEL) == {}
        _, error = audio_then_error(events, IDLE_S / 2)
        assert "the model is being unloaded" in error and time.monotonic() - t0 < 5.0
    finally:
        client.stop_stream()
        client.close()
    deadline = time.monotonic() + 15
    while server.state(P.MODEL) not in ("UNAVAILABLE", None) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.state(P.MODEL) in ("UNAVAILABLE", None), server.log()[-3000:]
