"""Issue 12 as a hostile client, against the real server on a tiny Base checkpoint (CPU, one server): for every
class of harm, several requests each get exactly one final naming the input or parameter at fault, while a
healthy stream beside them finishes with the bits it has alone, and every resource gauge is back to baseline
after each case. Then a soak of 300 mixed sequences (normal, aborted, cancelled, bad) loses and duplicates no
final.

Classes: 1 values that reach the step (a reference with extreme samples; what the door refuses is in
test_served_faults), 2 inputs and parameters the checkpoint does not use, 3 heavy or oversized reference audio
(a minute-long reference is encoded while a stream plays: its gaps stay small; an oversized one is refused at
once), 4 every error names its cause (checked on every case)."""

from __future__ import annotations

import math
import queue
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from q3tts_client import protocol as P
from q3tts_client.stream_client import start_inputs, synthesize
from tests.server.conftest import wait_metrics
from voice_fixtures import REF_SR, REF_TEXT, base_checkpoint, reference_wav, served  # tests/ is on sys.path

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]

TEXT = "Hello there, this is a test."
HEALTHY = {"greedy": True, "max_frames": 30, "chunk_schedule": "1"}
INTERNAL = re.compile(r"Traceback|\b[A-Z]\w*(Error|Exception)\b")  # an exception's text reaching a client


@pytest.fixture(scope="module")
def server(request, tmp_path_factory):
    yield from served(request, base_checkpoint(tmp_path_factory), tmp_path_factory)


def ref_voice(wav=None, sr=REF_SR, **extra) -> dict:
    return {"ref_audio": reference_wav() if wav is None else wav, "ref_sample_rate": sr, "ref_text": REF_TEXT,
            **extra}


def noise(seconds: float, sr: int = REF_SR, scale: float = 0.1) -> np.ndarray:
    return (scale * np.random.default_rng(3).standard_normal(int(seconds * sr))).astype(np.float32)


def baseline(m: dict) -> bool:
    return all(m.get(k, -1) == 0 for k in ("q3tts_kv_pages_used", "q3tts_slots_used", "q3tts_open_sessions"))


class Healthy:
    """A healthy stream in a thread; `gaps` = seconds between its audio responses."""

    def __init__(self, url: str, sequence_id: int):
        self.started, self.stamps, self.result = threading.Event(), [], None
        self.thread = threading.Thread(target=self._play, args=(url, sequence_id), daemon=True)
        self.thread.start()
        assert self.started.wait(300), "the healthy stream never started"

    def _play(self, url, sequence_id):
        def chunk(*_):
            self.stamps.append(time.monotonic())
            self.started.set()
        self.result = synthesize(url, [TEXT * 3], ref_voice(), HEALTHY, sequence_id=sequence_id, on_chunk=chunk)
        self.started.set()

    def wait(self):
        self.thread.join(600)
        assert self.result is not None and self.result.error is None, self.result and self.result.error
        assert self.result.finals == 1
        return self.result


def untouched(got, alone, other) -> None:
    """The healthy stream gave what it gives alone: the same bits when the other request made no audio; when
    both streamed, the codec's GEMMs ran on 2 rows instead of 1 (the same codes, PCM within rounding)."""
    if other.audio.size == 0:
        assert np.array_equal(got.audio, alone.audio), "the healthy stream was touched"
    else:
        assert np.allclose(got.audio, alone.audio, rtol=0, atol=1e-5), "the healthy stream was touched"


@pytest.fixture(scope="module")
def alone(server):
    """The healthy request played alone: what it must give beside every case."""
    assert baseline(wait_metrics(server, baseline))
    r = synthesize(server.grpc_url, [TEXT * 3], ref_voice(), HEALTHY)
    assert r.error is None and r.audio.size > 0
    return r


# (voice, parameters, the name the error must carry, or None: the request may succeed)
CASES = {
    # class 1: values that reach the engine's step
    "ref-samples-1e30": (ref_voice(np.full(REF_SR, 1e30, np.float32)), {}, P.INPUT_REF_AUDIO),
    "ref-samples-1e4": (ref_voice(noise(1.0, scale=1e4)), {}, None),
    "ref-samples-max-float": (ref_voice(np.full(REF_SR, np.finfo(np.float32).max, np.float32)), {},
                              P.INPUT_REF_AUDIO),
    "temperature-nan": (ref_voice(), {"temperature": math.nan}, "temperature"),
    "seed-30-digits": (ref_voice(), {"seed": "1" * 30}, "seed"),
    # class 2: inputs and parameters the checkpoint does not use, or out of range
    "speaker-on-base": (ref_voice(speaker="ryan"), {}, P.INPUT_SPEAKER),
    "instruct-on-base": (ref_voice(instruct="whisper"), {}, P.INPUT_INSTRUCT),
    "unknown-parameter": (ref_voice(), {"temprature": 0.5}, "temprature"),
    "subtalker-top-k": (ref_voice(), {"subtalker_top_k": -5}, "subtalker_top_k"),
    "subtalker-top-p": (ref_voice(), {"subtalker_top_p": 0.0}, "subtalker_top_p"),
    "subtalker-temperature": (ref_voice(), {"subtalker_temperature": 1e9}, "subtalker_temperature"),
    # class 3: reference audio over the limits (refused before any work)
    "ref-too-long": (ref_voice(noise(P.MAX_REF_SECONDS + 1, 8000), 8000), {}, P.INPUT_REF_AUDIO),
    "ref-rate-low": (ref_voice(sr=4000), {}, P.INPUT_REF_SAMPLE_RATE),
    "ref-rate-high": (ref_voice(sr=10 ** 6), {}, P.INPUT_REF_SAMPLE_RATE),
    "ref-empty": (ref_voice(np.zeros(0, np.float32)), {}, P.INPUT_REF_AUDIO),
    "ref-too-short": (ref_voice(noise(0.005)), {}, P.INPUT_REF_AUDIO),
    "ref-nan": (ref_voice(np.full(REF_SR, np.nan, np.float32)), {}, P.INPUT_REF_AUDIO),
}


@pytest.mark.parametrize("case", list(CASES))
def test_one_bad_request_harms_no_other(server, alone, case):
    voice, params, name = CASES[case]
    healthy = Healthy(server.grpc_url, 700_000 + list(CASES).index(case))
    t0 = time.monotonic()
    r = synthesize(server.grpc_url, [TEXT], voice, {"max_frames": 6, **params}, timeout_s=120)
    seconds = time.monotonic() - t0
    assert r.finals == 1, (r.finals, r.error)
    if name is not None:
        assert r.error is not None and name in r.error and r.audio.size == 0, r.error
        assert not INTERNAL.search(r.error), r.error  # class 4: the cause, not an exception's text
    elif r.error is not None:
        assert not INTERNAL.search(r.error), r.error
    untouched(healthy.wait(), alone, r)
    assert baseline(wait_metrics(server, baseline)), "resources are not back to baseline"
    print(f"{case}: {seconds:.2f} s: {r.error or r.finish_reason}")


def test_a_minute_long_reference_does_not_stall_a_playing_stream(server, alone):
    """Class 3: the reference is encoded off the engine thread (x-vector only: no reference frames to prime
    the codec with), so the playing stream's gap between frames stays far below the encoding time."""
    healthy = Healthy(server.grpc_url, 799_001)
    t0 = time.monotonic()
    r = synthesize(server.grpc_url, [TEXT], {**ref_voice(noise(P.MAX_REF_SECONDS, 8000), 8000), "ref_text": None},
                   {"max_frames": 2, "xvector_only": True}, timeout_s=300)
    seconds = time.monotonic() - t0
    got = healthy.wait()
    assert r.error is None and r.finals == 1, r.error
    gaps = np.diff(healthy.stamps)
    print(f"a {P.MAX_REF_SECONDS} s reference took {seconds:.2f} s; the playing stream's largest gap "
          f"{gaps.max() * 1e3:.0f} ms")
    untouched(got, alone, r)
    assert gaps.max() < max(0.5, seconds / 3)
    assert baseline(wait_metrics(server, baseline))


# --- soak ---------------------------------------------------------------------------------------------------
KINDS = ("normal", "aborted", "cancelled", "bad")
QUIET_S = 0.3  # after a sequence's final: how long to listen for a duplicate


def one_sequence(client: grpcclient.InferenceServerClient, sid: int, kind: str) -> tuple[int, str]:
    """One sequence of `kind` on its own stream of `client` -> (finals seen incl. errors, outcome)."""
    events: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    params = {"max_frames": 3, "chunk_schedule": "1"} | ({"top_p": 7.0} if kind == "bad" else {})
    inputs = start_inputs(TEXT, ref_audio=reference_wav(), ref_sample_rate=REF_SR, ref_text=REF_TEXT)
    end = kind != "aborted"
    client.async_stream_infer(P.MODEL, inputs, sequence_id=sid, sequence_start=True, sequence_end=end,
                              parameters=params, enable_empty_final_response=True)
    if kind == "aborted":
        client.async_stream_infer(P.MODEL, start_inputs(""), sequence_id=sid, sequence_end=True,
                                  parameters={P.PARAM_ABORT: True}, enable_empty_final_response=True)
    finals, outcome, deadline = 0, "lost", time.monotonic() + 120
    expected = 2 if kind == "aborted" else 1
    while time.monotonic() < deadline:
        try:
            result, error = events.get(timeout=QUIET_S if finals >= expected else 1.0)
        except queue.Empty:
            if finals >= expected:
                break
            continue
        if error is not None:
            finals, outcome = finals + 1, f"error: {error}"
            continue
        reason = result.as_numpy(P.OUTPUT_FINISH_REASON)
        if reason is not None:
            outcome = reason.reshape(-1)[0].decode()
        if kind == "cancelled" and result.as_numpy(P.OUTPUT_AUDIO) is not None:
            client.stop_stream(cancel_requests=True)
            return 1, "cancelled"
        param = result.get_response().parameters.get("triton_final_response")
        finals += bool(param is not None and param.bool_param)
    client.stop_stream()
    return finals - expected + 1, outcome


def test_soak_300_mixed_sequences(server):
    kinds = [KINDS[i % len(KINDS)] for i in range(300)]
    clients = threading.local()

    def run(i):
        if not hasattr(clients, "c"):
            clients.c = grpcclient.InferenceServerClient(server.grpc_url)
        return kinds[i], *one_sequence(clients.c, 800_000 + i, kinds[i])

    t0 = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, range(len(kinds))))
    seconds = time.monotonic() - t0
    bad = [(k, n, o) for k, n, o in results if n != 1]
    assert not bad, f"lost or duplicated finals: {bad[:5]}"
    for kind, _, outcome in results:
        expect = {"normal": ("eos", "max_frames"), "aborted": ("aborted", "eos", "max_frames"),  # may finish first
                  "cancelled": ("cancelled",)}.get(kind)
        if expect is None:
            assert outcome.startswith("error") and "top_p" in outcome, outcome
        else:
            assert outcome in expect, (kind, outcome)
    assert baseline(wait_metrics(server, baseline, 30))
    print(f"soak: {len(results)} sequences in {seconds:.1f} s, 0 lost or duplicated finals")
