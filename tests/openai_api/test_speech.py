"""POST /v1/audio/speech through the official `openai` package, curl (SSE) and httpx against the real server:
the bytes equal the gRPC audio of the same request, every format decodes, refusals have OpenAI's error shape
and status, and a client that goes away aborts its sequence on the server."""

from __future__ import annotations

import base64
import io
import json
import shutil
import subprocess
import time

import httpx
import numpy as np
import openai
import pytest
import soundfile as sf

from q3tts.openai_api.app import MAX_BODY_BYTES
from q3tts.openai_api.server import OpenAIServer
from q3tts_client import protocol as P
from q3tts_client.metrics import scrape
from q3tts_client.stream_client import synthesize

pytestmark = [pytest.mark.server, pytest.mark.timeout(600)]

TEXT = "The endpoint speaks with a registered voice."
GREEDY = {"greedy": True, "seed": 0, "max_frames": 16}


@pytest.fixture(scope="module")
def grpc_audio(server, alice) -> np.ndarray:
    """The same greedy request over gRPC direct: the int16 audio every format must carry."""
    r = synthesize(server.grpc_url, [TEXT], {"voice": alice}, {**GREEDY, "audio_format": "int16"})
    assert r.error is None and r.audio.size > 0, r.error
    return r.audio


def post(api, timeout=120.0, **body) -> httpx.Response:
    return httpx.post(f"{api.url}/v1/audio/speech", json={"model": "qwen3-tts", "input": TEXT, "voice": "alice",
                                                            **GREEDY, **body}, timeout=timeout)


def test_openai_sdk_streamed_wav_equals_grpc(api, grpc_audio, tmp_path):
    client = openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused", max_retries=0)
    path = tmp_path / "speech.wav"
    with client.audio.speech.with_streaming_response.create(
            model="qwen3-tts", input=TEXT, voice="alice", response_format="wav", extra_body=GREEDY) as response:
        assert response.headers["content-type"] == "audio/wav"
        response.stream_to_file(path)
    audio, rate = sf.read(str(path), dtype="int16")
    assert rate == P.SAMPLE_RATE
    np.testing.assert_array_equal(audio, grpc_audio)


def test_pcm_is_the_raw_samples(api, grpc_audio):
    r = post(api, response_format="pcm", voice={"id": "alice"})
    assert r.status_code == 200 and r.headers["content-type"] == "audio/pcm"
    assert r.content == grpc_audio.astype("<i2").tobytes()


def test_flac_and_mp3_decode(api, grpc_audio):
    flac = post(api, response_format="flac")
    assert flac.headers["content-type"] == "audio/flac"
    np.testing.assert_array_equal(sf.read(io.BytesIO(flac.content), dtype="int16")[0], grpc_audio)
    mp3 = post(api)  # OpenAI's default format
    assert mp3.status_code == 200 and mp3.headers["content-type"] == "audio/mpeg"
    decoded, rate = sf.read(io.BytesIO(mp3.content), dtype="float32")
    # MP3 is lossy and pads the start and end with encoder frames: the duration, not the samples
    assert rate == P.SAMPLE_RATE and abs(decoded.size - grpc_audio.size) <= 2 * 1152


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs the curl command")
def test_sse_with_curl(api, grpc_audio):
    body = json.dumps({"model": "qwen3-tts", "input": TEXT, "voice": "alice", "response_format": "pcm",
                       "stream_format": "sse", **GREEDY})
    out = subprocess.run(["curl", "-sN", "-H", "content-type: application/json", "-d", body,
                          f"{api.url}/v1/audio/speech"], capture_output=True, text=True, timeout=120, check=True)
    events = [json.loads(line[len("data: "):]) for line in out.stdout.splitlines() if line.startswith("data: ")]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) > 1 and events[-1]["type"] == "speech.audio.done"  # streamed as frames arrived
    pcm = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    assert pcm == grpc_audio.astype("<i2").tobytes()
    assert events[-1]["usage"]["output_tokens"] == grpc_audio.size // P.SAMPLES_PER_FRAME


def test_voices_and_health(api):
    voices = httpx.get(f"{api.url}/v1/audio/voices").json()
    assert voices["object"] == "list" and voices["variant"] == "base"
    assert [(v["id"], v["object"], v["type"]) for v in voices["data"]] == [("alice", "audio.voice", "audio_sample")]
    health = httpx.get(f"{api.url}/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"


@pytest.mark.parametrize("body, status, param, match", [
    ({"input": "  "}, 400, "input", "input is empty"),
    ({"input": "x" * 4097}, 400, "input", "limit is 4096"),
    ({"speed": 1.25}, 400, "speed", "not supported"),
    ({"response_format": "opus"}, 400, "response_format", "wav, pcm, flac, mp3"),
    ({"stream_format": "chunks"}, 400, "stream_format", "'audio' or 'sse'"),
    ({"temperature": "hot"}, 400, "temperature", "must be a number"),
    ({"top_p": 7.0}, 400, "top_p", "top_p"),
    ({"loudness": 3}, 400, "loudness", "unknown field"),
    ({"model": None}, 400, "model", "model"),
    ({"voice": "bob"}, 404, "voice", "'bob' is not a speaker or registered voice"),
    ({"instructions": "whisper"}, 400, None, "'INSTRUCT' is for"),  # refused by the server, not the endpoint
])
def test_refusals_have_openai_shape(api, body, status, param, match):
    r = post(api, **body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and match in error["message"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"


def test_an_oversized_body_is_refused_before_it_is_read_whole(api):
    over = MAX_BODY_BYTES + 1
    declared = httpx.post(f"{api.url}/v1/audio/speech", content=b" " * over, timeout=60)
    assert declared.status_code == 413, declared.text
    assert f"holds {over} bytes; at most {MAX_BODY_BYTES}" in declared.json()["error"]["message"]

    def chunks():  # no Content-Length (chunked): 64 MiB offered, refused once past the limit
        for _ in range(1024):
            yield b" " * (64 << 10)

    streamed = httpx.post(f"{api.url}/v1/audio/speech", content=chunks(), timeout=60)
    assert streamed.status_code == 413 and streamed.json()["error"]["type"] == "invalid_request_error"
    assert f"over {MAX_BODY_BYTES} bytes" in streamed.json()["error"]["message"]
    assert post(api, response_format="pcm").status_code == 200  # the endpoint serves on


def test_malformed_requests_have_openai_shape(api):
    broken = httpx.post(f"{api.url}/v1/audio/speech", content=b'{"model": "m", "input": ', timeout=60)
    assert broken.status_code == 400 and broken.json()["error"]["message"].startswith("body: Invalid JSON")
    wrong_method = httpx.get(f"{api.url}/v1/audio/speech", timeout=60)
    assert wrong_method.status_code == 405 and "takes POST" in wrong_method.json()["error"]["message"]
    assert wrong_method.json()["error"]["type"] == "invalid_request_error"


def long_request(api) -> httpx.Response:
    """A streamed request that would run for minutes, its first bytes already received. The tiny checkpoint's
    sampled stream ends on EOS after 111 frames with the default seed (a few seconds: gone before the metrics are
    read); with seed 2 it runs to the 2000-frame cap (88 s on a 2-core CPU)."""
    client = httpx.Client(timeout=120)
    response = client.send(client.build_request(
        "POST", f"{api.url}/v1/audio/speech", json={"model": "m", "input": TEXT * 4, "voice": "alice",
                                                   "response_format": "pcm", "max_frames": 2000, "seed": 2}), stream=True)
    assert response.status_code == 200
    response.chunks = response.iter_bytes()  # kept: a dropped iterator closes the connection (an abort)
    next(response.chunks)
    response.client = client
    return response


def idle(m: dict) -> bool:
    return m.get("q3tts_open_sessions", -1) == 0 and m.get("q3tts_active_sequences", -1) == 0


def wait_metrics(server, predicate, timeout_s: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while not predicate(m := scrape(server.metrics_url)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return m


def test_client_gone_aborts_the_sequence(server, api):
    assert idle(wait_metrics(server, idle))
    aborted = api.bridge.aborted
    response = long_request(api)
    assert wait_metrics(server, lambda m: m["q3tts_active_sequences"] == 1)["q3tts_active_sequences"] == 1
    t0 = time.monotonic()
    response.close()
    response.client.close()
    m = wait_metrics(server, idle, timeout_s=5.0)
    assert idle(m), m  # freed within seconds, not after 2000 frames
    assert api.bridge.aborted == aborted + 1
    assert time.monotonic() - t0 < 5.0


def test_busy_endpoint_answers_429(server, alice):
    with OpenAIServer(server.grpc_url, max_streams=1) as one:
        response = long_request(one)
        try:
            r = post(one)
            assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        finally:
            response.close()
            response.client.close()
        assert idle(wait_metrics(server, idle))


def test_unreachable_triton_answers_503(alice):
    with OpenAIServer("127.0.0.1:1") as dead:
        assert httpx.get(f"{dead.url}/health").status_code == 503
        r = post(dead)
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
