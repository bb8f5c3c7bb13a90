"""`q3tts serve --openai-port` as a user runs it (a tiny CustomVoice checkpoint, CPU): the endpoint starts beside
tritonserver on loopback, a CustomVoice speaker given as `voice` sounds as over gRPC, and SIGTERM stops both."""

from __future__ import annotations

import io
import json
import queue
import signal
import subprocess
import sys
import threading

import httpx
import numpy as np
import pytest
import soundfile as sf

from q3tts.checkpoint.maker import make_checkpoint
from q3tts.serving.launcher import free_ports
from q3tts_client.stream_client import synthesize

pytestmark = [pytest.mark.server, pytest.mark.timeout(600)]

TEXT = "A built-in speaker through the endpoint."
GREEDY = {"greedy": True, "seed": 3, "max_frames": 10}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(gRPC url, endpoint url) of a running `q3tts serve --openai-port`; its output is printed on failure."""
    tmp = tmp_path_factory.mktemp("serve_openai")
    ckpt = make_checkpoint(tmp / "cv", "custom_voice", "0.6b", "tiny", 5)
    port = free_ports(1)[0]
    proc = subprocess.Popen([sys.executable, "-m", "q3tts.cli", "serve", "--model", str(ckpt), "--gpus", "none",
                             "--max-slots", "4", "--run-dir", str(tmp / "run"), "--voices-dir", str(tmp / "voices"),
                             "--openai-port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    seen, grpc_port = [], None
    try:
        while not any("OpenAI endpoint" in line for line in seen):
            seen.append(lines.get(timeout=300))
            if seen[-1].startswith("{"):
                grpc_port = json.loads(seen[-1])["grpc_port"]
        assert f"http://127.0.0.1:{port}/v1/audio/speech" in seen[-1]
        yield f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
        while not lines.empty():
            seen.append(lines.get())
        print("".join(seen))  # shown by pytest when a test failed
    assert code == 0


def test_speaker_as_voice_equals_grpc(served):
    grpc_url, url = served
    direct = synthesize(grpc_url, [TEXT], {"speaker": "ryan"}, {**GREEDY, "audio_format": "int16"})
    assert direct.error is None and direct.audio.size > 0, direct.error
    r = httpx.post(f"{url}/v1/audio/speech", json={"model": "qwen3-tts", "input": TEXT, "voice": "Ryan",
                                                    "response_format": "wav", **GREEDY}, timeout=120)
    assert r.status_code == 200, r.text
    np.testing.assert_array_equal(sf.read(io.BytesIO(r.content), dtype="int16")[0], direct.audio)


def test_speakers_are_listed_and_voices_refused(served):
    _, url = served
    voices = httpx.get(f"{url}/v1/audio/voices").json()
    assert voices["variant"] == "custom_voice"
    assert "ryan" in {v["id"] for v in voices["data"] if v["type"] == "speaker"}
    r = httpx.post(f"{url}/v1/audio/speech", json={"model": "m", "input": TEXT, "voice": "nobody"}, timeout=60)
    assert r.status_code == 404 and "ryan" in r.json()["error"]["message"]
