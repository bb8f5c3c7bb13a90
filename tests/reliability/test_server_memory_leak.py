"""Triton 2.51's gRPC frontend keeps every streamed request it refused itself (a wrong input type, here) once the
client cancels the stream, input buffers included. Against the real server (CPU, tiny checkpoint, a 0.5 GiB
budget): such requests grow tritonserver's resident memory in the q3tts_server_resident_bytes gauge until the
health probe says not ready, naming the budget, while a stream still plays and the log says why once."""

from __future__ import annotations

import queue
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from q3tts.serving import health
from q3tts_client import protocol as P
from q3tts_client.stream_client import synthesize
from tests.server.conftest import wait_metrics
from voice_fixtures import served  # tests/ is on sys.path

pytestmark = [pytest.mark.server, pytest.mark.timeout(600)]

BUDGET_GIB = 0.5
SAMPLES = 2 ** 21  # an 8 MiB INT32 REF_AUDIO (the model takes FP32): refused by Triton before the model


@pytest.fixture(scope="module")
def server(request, tiny_checkpoint, tmp_path_factory):
    yield from served(request, tiny_checkpoint, tmp_path_factory, max_server_memory_gib=BUDGET_GIB)


def resident(server) -> float:
    text = wait_metrics(server, lambda m: m.get("q3tts_server_resident_bytes", 0) > 0)
    return text["q3tts_server_resident_bytes"]


def refused_then_cancelled(url: str) -> str:
    """One stream: a request Triton refuses (its answer awaited), then the stream cancelled; -> the error."""
    client = grpcclient.InferenceServerClient(url)
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put(error))
    bad = grpcclient.InferInput(P.INPUT_REF_AUDIO, [SAMPLES], "INT32")
    bad.set_data_from_numpy(np.zeros(SAMPLES, np.int32))
    client.async_stream_infer(P.MODEL, [bad], sequence_id=1, sequence_start=True, sequence_end=True)
    error = answers.get(timeout=30)
    client.stop_stream(cancel_requests=True)
    client.close()
    return str(error)


def test_refused_requests_cancelled_by_their_clients_make_the_server_not_ready(server):
    assert health.not_ready_reason(server.http_url, f"127.0.0.1:{server.metrics_port}") is None
    start = resident(server)
    assert start < BUDGET_GIB * 2 ** 30, f"tritonserver already holds {start / 2 ** 20:.0f} MiB"
    error = refused_then_cancelled(server.grpc_url)
    assert "REF_AUDIO" in error and "expects 'FP32'" in error, error  # Triton's own refusal: the model never saw it
    reason, deadline = None, time.monotonic() + 120
    sent = 1
    while reason is None and time.monotonic() < deadline and sent < 200:
        refused_then_cancelled(server.grpc_url)
        sent += 1
        if sent % 10 == 0:
            time.sleep(0.5)  # a metrics tick
            reason = health.not_ready_reason(server.http_url, f"127.0.0.1:{server.metrics_port}")
    grown = resident(server) - start
    assert reason is not None and "max_server_memory_gib" in reason, (sent, grown, reason)
    # 8 MiB a request stays behind (the measured leak); the budget was crossed by that, not by noise
    assert grown > 0.5 * sent * SAMPLES * 4, (sent, grown)
    r = synthesize(server.grpc_url, ["Still playing."], {"speaker": "ryan", "language": "english"},
                   {"greedy": True, "max_frames": 4}, timeout_s=60)
    assert r.finals == 1 and r.error is None and r.audio.size > 0, r.error
    assert server.log_text().count("over its budget") == 1
