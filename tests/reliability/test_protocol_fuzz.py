"""A seeded protocol fuzz against the real server (CPU, tiny CustomVoice): sequences of 1-4 requests with random
flags (START and END where they belong, or not), correlation IDs (ints, strings), texts (empty, unicode, over the
limit, invalid UTF-8), inputs of the wrong type, shape or variant, and parameters of random names, types and
values. Every request gets exactly one final (a response flagged final, or a stream error), no error text is an
exception's, and afterwards the server holds nothing and still plays a healthy request. (test_hostile.py
checks each class of harm on purpose; this looks between them.)"""

from __future__ import annotations

import math
import queue
import random
import re
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from q3tts_client import protocol as P
from q3tts_client.stream_client import synthesize
from tests.server.conftest import wait_metrics
from voice_fixtures import served  # tests/ is on sys.path

pytestmark = [pytest.mark.server, pytest.mark.timeout(600)]

SEQUENCES = 80
INTERNAL = re.compile(r"Traceback|\b[A-Z]\w*(Error|Exception)\b")  # an exception's text reaching a client
QUIET_S = 0.3  # after the last final: how long to listen for a duplicate
VALUES = [True, False, 0, 1, -1, 2 ** 62, 50, 8192, "x", "", "1,2", "0", "nan", "inf", "1,0", ",",
          "1000,1001", "whole", "incremental", "float32", "int16", "true"]
VOICE_INPUTS = (P.INPUT_SPEAKER, P.INPUT_LANGUAGE, P.INPUT_INSTRUCT, P.INPUT_REF_TEXT, P.INPUT_VOICE)


@pytest.fixture(scope="module")
def server(request, tiny_checkpoint, tmp_path_factory):
    yield from served(request, tiny_checkpoint, tmp_path_factory)


def strings(rng: random.Random, name: str, values: list) -> grpcclient.InferInput:
    """A BYTES input of `values` (str or bytes), now and then shaped [1, 1] instead of [1]."""
    arr = np.array([v if isinstance(v, bytes) else v.encode("utf-8", "surrogatepass") for v in values],
                   dtype=object)
    shape = [len(values)] if len(values) != 1 or rng.random() < 0.95 else [1, 1]
    i = grpcclient.InferInput(name, shape, "BYTES")
    i.set_data_from_numpy(arr.reshape(shape))
    return i


def text(rng: random.Random):
    if rng.random() < 0.5:
        return rng.choice(["Hello.", "Hi " * 5])
    return rng.choice(["", "Hello.", "Hi " * 5, "你好，世界", " ", "\x00\x01 x \ud7ff", b"\xff\xfe\x80",
                       "a" * (P.MAX_TEXT_CHARS + 1), "<|im_start|>assistant\n",
                       "".join(chr(rng.randrange(1, 0x2FFFF)) for _ in range(12))])


def inputs(rng: random.Random, start: bool) -> list:
    out = []
    if rng.random() < 0.05:
        i = grpcclient.InferInput(P.INPUT_TEXT, [1], "FP32")
        i.set_data_from_numpy(np.ones(1, np.float32))
        out.append(i)
    elif rng.random() < 0.95:
        out.append(strings(rng, P.INPUT_TEXT, [text(rng)] * (2 if rng.random() < 0.05 else 1)))
    if start and rng.random() < 0.7:  # a voice the checkpoint has: sequences that play
        out.append(strings(rng, P.INPUT_SPEAKER, ["ryan"]))
    for name in VOICE_INPUTS:
        if rng.random() < (0.1 if start else 0.03):
            out.append(strings(rng, name, [rng.choice(["ryan", "RYAN", "", "nobody", "english", "auto", "klingon"])]))
    if rng.random() < 0.08:
        n = rng.choice([0, 1, 2400])
        i = grpcclient.InferInput(P.INPUT_REF_AUDIO, [n], "FP32")
        i.set_data_from_numpy(np.full(n, rng.choice([0.1, math.nan, 1e30]), np.float32))
        out.append(i)
    return out


def parameters(rng: random.Random, start: bool) -> dict | None:
    """Random parameters; a START's max_frames is always short or invalid (a random-weight voice never stops
    on its own: the whole test stays short)."""
    frames = {"max_frames": rng.choice([1, 2, 4, 4, 4, 0, "x"])} if start else {}
    if rng.random() < 0.2:
        return frames or None
    if rng.random() < 0.4:  # valid ones: sequences that play between the refused ones
        return {"greedy": rng.random() < 0.5, **frames}
    names = [n for n, f in P.FIELDS.items() if f.kind != "input" and n != "max_frames"] + ["bogus", "stream"]
    return {**{rng.choice(names): rng.choice(VALUES) for _ in range(rng.randrange(1, 5))}, **frames}


def one_sequence(url: str, case: int) -> tuple[int, int, list[str], int]:
    """A random sequence on its own stream -> (requests sent, finals seen, error texts, audio responses)."""
    rng = random.Random(case)
    client = grpcclient.InferenceServerClient(url)
    events: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: events.put((result, error)))
    sid = rng.choice([900_000 + case, f"fuzz-{case}-" + rng.choice(["x", "é", "a" * 64])])
    requests = rng.randrange(1, 5)
    sent = 0
    for k in range(requests):
        start = (k == 0) if rng.random() < 0.9 else rng.random() < 0.5
        end = (k == requests - 1) if rng.random() < 0.85 else rng.random() < 0.5
        client.async_stream_infer(P.MODEL, inputs(rng, start), sequence_id=sid, sequence_start=start,
                                  sequence_end=end, parameters=parameters(rng, start), enable_empty_final_response=True)
        sent += 1
        if rng.random() < 0.2:
            time.sleep(rng.random() * 0.2)
    finals, errors, audio, deadline = 0, [], 0, time.monotonic() + 20  # an open sequence idles out in 3 s
    while time.monotonic() < deadline:
        try:
            result, error = events.get(timeout=QUIET_S if finals >= sent else 1.0)
        except queue.Empty:
            if finals >= sent:
                break
            continue
        if error is not None:
            finals += 1
            errors.append(str(error))
            continue
        audio += result.as_numpy(P.OUTPUT_AUDIO) is not None
        err = result.as_numpy(P.OUTPUT_ERROR)
        if err is not None:
            errors.append(err.reshape(-1)[0].decode())
        final = result.get_response().parameters.get("triton_final_response")
        finals += bool(final is not None and final.bool_param)
    # not cancelled (Triton 2.51 keeps the refused requests of a cancelled stream: health.py), unless a final is
    # missing: stop_stream would wait for it
    client.stop_stream(cancel_requests=finals < sent)
    client.close()
    return sent, finals, errors, audio


def test_random_requests_each_get_one_final_and_leave_nothing_behind(server):
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda case: one_sequence(server.grpc_url, case), range(SEQUENCES)))
    wrong = [(case, sent, finals) for case, (sent, finals, _, _) in enumerate(results) if finals != sent]
    assert not wrong, f"(sequence, requests, finals) with lost or duplicated finals: {wrong[:5]}"
    errors = [e for _, _, errs, _ in results for e in errs]
    played = sum(audio > 0 for _, _, _, audio in results)
    assert errors and played, f"{len(errors)} refused, {played} played: the fuzz no longer reaches both"
    leaked = [e for e in errors if INTERNAL.search(e)]
    assert not leaked, leaked[:3]
    m = wait_metrics(server, lambda m: all(m.get(k, -1) == 0 for k in (
        "q3tts_kv_pages_used", "q3tts_slots_used", "q3tts_open_sessions")), 30)
    assert m["q3tts_open_sessions"] == 0 and m["q3tts_slots_used"] == 0 and m["q3tts_kv_pages_used"] == 0, m
    r = synthesize(server.grpc_url, ["Still here."], {"speaker": "ryan", "language": "english"},
                   {"greedy": True, "max_frames": 4}, timeout_s=60)
    assert r.finals == 1 and r.error is None and r.audio.size > 0, r.error
    print(f"fuzz: {sum(r[0] for r in results)} requests in {SEQUENCES} sequences, {len(errors)} refused, "
          f"{played} sequences played audio")
