"""The real tritonserver + python backend + real engine on a tiny checkpoint (CPU): the sequence protocol,
concurrency, cancellation, idle collection, HTTP SSE via the one-shot model, bad input, offline parity."""

from __future__ import annotations

import dataclasses
import json
import queue
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from q3tts_client import protocol as P
from q3tts_client.stream_client import start_inputs, synthesize
from tests.server.conftest import IDLE_S, read_metrics, wait_metrics

pytestmark = [pytest.mark.server, pytest.mark.timeout(600)]

VOICE = {"speaker": "ryan", "language": "english"}
GREEDY = {"greedy": True, "max_frames": 12}
TEXT = "Hello there, this is a streaming test."


def baseline_ok(m: dict) -> bool:
    return m.get("q3tts_kv_pages_used", -1) == 0 and m.get("q3tts_slots_used", -1) == 0 \
        and m.get("q3tts_open_sessions", -1) == 0


def test_model_py_reexport_loads_both_models(server):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    assert client.is_model_ready(P.MODEL) and client.is_model_ready(P.ONESHOT_MODEL)
    assert "[q3tts] ready: instance" in server.log_text()


def test_one_request_sequence(server):
    r = synthesize(server.grpc_url, [TEXT], VOICE, GREEDY)
    assert r.error is None, r.error
    assert r.requests == 1 and r.finals == 1
    assert r.finish_reason in ("eos", "max_frames") and r.sample_rate == 24000
    assert 0 < r.audio.size <= 12 * P.SAMPLES_PER_FRAME and r.audio.size % P.SAMPLES_PER_FRAME == 0
    assert r.chunk_frames[0] == 1  # first response = one 80 ms frame
    assert r.audio.dtype == np.float32 and np.isfinite(r.audio).all()


def test_multi_request_sequence_with_streamed_text(server):
    def pieces():
        for word in TEXT.split():
            yield word + " "
            time.sleep(0.1)  # text at LLM pace

    r = synthesize(server.grpc_url, pieces(), VOICE, {**GREEDY, "text_mode": "incremental"})
    assert r.error is None, r.error
    assert r.requests == len(TEXT.split()) + 1 and r.finals == r.requests  # each request: one FINAL
    assert r.finish_reason in ("eos", "max_frames") and r.audio.size > 0
    # one ordered audio stream across the requests: each chunk starts where the previous one ended
    assert r.first_frames == [sum(r.chunk_frames[:i]) for i in range(len(r.chunk_frames))]


def test_eight_concurrent_sequences(server):
    before = read_metrics(server)
    results = [None] * 8

    def one(i):
        results[i] = synthesize(server.grpc_url, [f"{TEXT} Number {i}."], VOICE,
                                {"seed": i, "max_frames": 10, "audio_format": "int16"})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for r in results:
        assert r is not None and r.error is None, r and r.error
        assert r.audio.dtype == np.int16 and r.audio.size > 0 and r.finals == 1
    assert len({r.sequence_id for r in results}) == 8
    assert baseline_ok(wait_metrics(server, baseline_ok))
    # the step-phase counters (TTFA breakdown) moved by this test's work
    started = before.get("q3tts_prefilled_sequences_total", 0) + 8
    after = wait_metrics(server, lambda m: m.get("q3tts_prefilled_sequences_total", 0) >= started)
    assert after["q3tts_prefilled_sequences_total"] >= started
    for name in ("q3tts_prefill_steps_total", "q3tts_prefill_seconds_total", "q3tts_decode_steps_total",
                 "q3tts_decode_seconds_total", "q3tts_step_gaps_total", "q3tts_step_gap_seconds_total"):
        assert after[name] > before.get(name, 0), name


def test_cancel_mid_stream_frees_pages_and_slots(server):
    assert baseline_ok(wait_metrics(server, baseline_ok))
    r = synthesize(server.grpc_url, [TEXT * 4], VOICE, {"max_frames": 2000, "chunk_schedule": "1"},
                   cancel_after_chunks=2)
    assert r.chunks == 2
    m = wait_metrics(server, baseline_ok)
    assert baseline_ok(m), m
    assert "the request was cancelled" in server.log_text() or m["q3tts_open_sessions"] == 0


def test_oneshot_cancel_aborts_the_relayed_sequence(server):
    assert baseline_ok(wait_metrics(server, baseline_ok))
    events: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    client.async_stream_infer(P.ONESHOT_MODEL, start_inputs(TEXT * 4, **VOICE), enable_empty_final_response=True,
                              parameters={"max_frames": 2000, "chunk_schedule": "1"})
    result, error = events.get(timeout=120)
    assert error is None and result.as_numpy(P.OUTPUT_AUDIO).size == P.SAMPLES_PER_FRAME
    client.stop_stream(cancel_requests=True)
    client.close()
    m = wait_metrics(server, baseline_ok, 30)
    assert baseline_ok(m), m


def test_idle_sequence_is_collected(server):
    events: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    try:
        client.async_stream_infer(P.MODEL, start_inputs("Waiting for more text", **VOICE), sequence_id=424242,
                                  sequence_start=True, enable_empty_final_response=True,
                                  parameters={"text_mode": "whole"})
        assert wait_metrics(server, lambda m: m.get("q3tts_open_sessions", 0) >= 1, 10)["q3tts_open_sessions"] >= 1
        t0 = time.monotonic()
        result, error = events.get(timeout=IDLE_S + 10)
        assert result is None and "idled out" in str(error)
        assert time.monotonic() - t0 < IDLE_S + 5
    finally:
        client.stop_stream()
        client.close()
    assert baseline_ok(wait_metrics(server, baseline_ok))


def _sse(server, body: dict) -> tuple[int, list[dict]]:
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/{P.ONESHOT_MODEL}/generate_stream",
                                 data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            lines, status = resp.read().decode().splitlines(), resp.status
    except urllib.error.HTTPError as e:
        lines, status = e.read().decode().splitlines(), e.code
    return status, [json.loads(line[6:]) for line in lines if line.startswith("data: ")]


def test_http_sse_oneshot(server):
    status, events = _sse(server, {"TEXT": TEXT, "SPEAKER": "ryan", "greedy": True, "max_frames": 6})
    assert status == 200 and events and all("error" not in e for e in events)
    audio = [x for e in events for x in e.get("AUDIO", [])]
    assert len(audio) > 0 and len(events[0]["AUDIO"]) == P.SAMPLES_PER_FRAME
    assert events[-1]["FINISH_REASON"] in ("eos", "max_frames")


def test_bad_input_one_clear_error_and_server_stays_up(server):
    r = synthesize(server.grpc_url, [TEXT], {"speaker": "no_such_speaker"}, GREEDY)
    assert r.finals == 1 and r.error and "speaker" in r.error.lower()
    r = synthesize(server.grpc_url, [TEXT], VOICE, {"top_p": 7.0})
    assert r.finals == 1 and "parameter 'top_p' must be in (0, 1]" in r.error
    status, events = _sse(server, {"TEXT": TEXT, "SPEAKER": "ryan", "bogus": 1})
    assert len(events) == 1 and "unknown request parameter 'bogus'" in events[0]["error"]
    client = grpcclient.InferenceServerClient(server.grpc_url)
    assert client.is_server_live() and client.is_model_ready(P.MODEL)
    assert read_metrics(server)["q3tts_failed_requests_total"] >= 3
    ok = synthesize(server.grpc_url, [TEXT], VOICE, GREEDY)
    assert ok.error is None and ok.audio.size > 0
    assert baseline_ok(wait_metrics(server, baseline_ok))


def offline_pcm(checkpoint, text: str, voice: dict, sampling: dict) -> np.ndarray:
    """The engine's offline output for one request, in this process (no Triton): the same defaults
    (the checkpoint's generation config) overridden by the same request parameters."""
    from q3tts.core import VoiceSpec
    from q3tts.engine import Engine, EngineConfig

    engine = Engine.from_checkpoint(str(checkpoint), EngineConfig(max_slots=8, dtype="float32", device="cpu"))
    engine.add(1, VoiceSpec(**voice), dataclasses.replace(engine.default_sampling, **sampling), text=text,
               text_done=True)
    pcm = []
    while engine.has_work():
        for out in engine.step():
            pcm.append(np.asarray(out.pcm, np.float32).reshape(-1))
    return np.concatenate(pcm)


def test_served_audio_equals_offline_engine_output(server, tiny_checkpoint):
    served = synthesize(server.grpc_url, [TEXT], VOICE, GREEDY)
    assert served.error is None
    offline = offline_pcm(tiny_checkpoint, TEXT, VOICE, GREEDY)
    assert served.audio.shape == offline.shape
    np.testing.assert_allclose(served.audio, offline, rtol=0, atol=1e-5)


def test_stop_ends_open_sequences_with_a_clear_reason(server):
    """Runs last in the module. Two sequences are open when the server stops: one left by a client that went
    away without END (Triton holds it until idle), one whose client still waits for audio. The stop unloads
    the model through Triton: the waiting request ends at once with a clear reason, the vanished client's
    sequence does not hold the shutdown, and finalize() runs."""
    assert baseline_ok(wait_metrics(server, baseline_ok))
    gone = grpcclient.InferenceServerClient(server.grpc_url)
    gone.start_stream(callback=lambda result, error: None)
    whole = {P.PARAM_TEXT_MODE: "whole"}  # both wait for END: no audio (nor an end by max_frames) before the stop
    gone.async_stream_infer(P.MODEL, start_inputs("left open", **VOICE), sequence_id=777001,
                            sequence_start=True, enable_empty_final_response=True, parameters=whole)
    events: queue.Queue = queue.Queue()
    waiting = grpcclient.InferenceServerClient(server.grpc_url)
    waiting.start_stream(callback=lambda result, error: events.put((result, error)))
    waiting.async_stream_infer(P.MODEL, start_inputs("waiting for more text", **VOICE), sequence_id=777002,
                               sequence_start=True, enable_empty_final_response=True, parameters=whole)
    assert wait_metrics(server, lambda m: m.get("q3tts_open_sessions", 0) >= 2, 10)["q3tts_open_sessions"] >= 2
    gone.stop_stream(cancel_requests=True)
    gone.close()
    stopper = threading.Thread(target=server.stop)
    stopper.start()
    try:
        result, error = events.get(timeout=20)
        assert result is None and "the server is shutting down" in str(error)
    finally:
        waiting.stop_stream()  # NOTE: an open client stream would hold Triton's shutdown (launcher docstring)
        waiting.close()
        stopper.join(timeout=60)
    assert not stopper.is_alive() and not server.running
    log = server.log_text()
    assert "Exit timeout expired" not in log and "[q3tts] finalize: done" in log
