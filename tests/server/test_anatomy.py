"""The TTFA anatomy on a real server (tiny checkpoint, CPU): the first audio response carries TIMING, its
stamps follow the request's path in order on the clock the client shares, perf/anatomy.py splits a TTFA into
parts that add up to it, bench_serve prints the medians per level; and a request without max_frames is
capped by the runaway guard (FINISH_REASON max_frames)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from q3tts.engine.config import EngineConfig
from q3tts_client import protocol as P
from q3tts_client.stream_client import synthesize

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))
from anatomy import PARTS, SERVING, TOTAL, anatomy  # noqa: E402

pytestmark = [pytest.mark.server, pytest.mark.timeout(600)]

VOICE = {"speaker": "ryan", "language": "english"}
TEXT = "Hello there, this is a streaming test."
ORDER = ("engine_add", "prompt_ready", "prefill_start", "first_frame", "step_returned", "response_built")


def test_first_audio_response_carries_the_path(server):
    r = synthesize(server.grpc_url, [TEXT], VOICE, {"greedy": True, "max_frames": 6}, timeout_s=120)
    assert r.error is None and r.timing is not None and set(r.timing) == set(P.TIMING_STAGES)
    t = r.timing
    received = r.sent_at + r.ttfa_s
    assert r.sent_at <= t["arrival"] <= received  # one clock on this host
    offsets = [t[name] for name in ORDER]
    assert offsets == sorted(offsets) and offsets[0] >= 0 and t["arrival"] + offsets[-1] <= received
    assert t["prefill_device"] > 0 and t["decode_device"] > 0
    assert t["prefill_start"] + t["prefill_device"] <= t["first_frame"]  # the decode follows the prefill


def test_parts_add_up_to_the_ttfa(server):
    r = synthesize(server.grpc_url, [TEXT], VOICE, {"greedy": True, "max_frames": 4}, timeout_s=120)
    parts = anatomy(r)
    assert all(parts[name] >= 0 for name, _, _ in PARTS), parts
    assert sum(parts[name] for name, _, _ in PARTS) == pytest.approx(parts[TOTAL], abs=1e-6)
    assert parts[SERVING] == pytest.approx(sum(parts[n] for n in ("engine -> serving", "response built",
                                                                 "response -> client")), abs=1e-6)


def test_bench_serve_prints_the_anatomy_table(server):
    out = subprocess.run([sys.executable, "perf/bench_serve.py", "--url", server.grpc_url, "--concurrency", "1,2",
                          "--requests", "1", "--max-frames", "3", "--check"], capture_output=True, text=True,
                         timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stdout + out.stderr
    medians, slowest = (out.stdout[out.stdout.index(title):].splitlines()
                        for title in ("TTFA anatomy, medians", "TTFA anatomy of each level's slowest stream"))
    for table in (medians, slowest):
        header = table[2]
        assert all(name in header for name, _, _ in PARTS) and SERVING in header
        assert [line.split("|")[2].strip() for line in table[4:6]] == ["1", "2"]
    ttfa = lambda line: float(line.split("|")[-2])  # noqa: E731 - the last column
    assert ttfa(slowest[4]) == ttfa(medians[4])  # one stream at level 1: its median is itself
    assert ttfa(slowest[5]) >= ttfa(medians[5])  # level 2: the larger of two TTFAs >= their mean


def test_without_max_frames_the_text_caps_the_frames(server):
    r = synthesize(server.grpc_url, ["Hi."], VOICE, {"greedy": True}, timeout_s=300)
    frames = r.audio.size // P.SAMPLES_PER_FRAME
    floor = EngineConfig().min_text_frames  # "Hi." is a few tokens: the floor is its cap
    assert r.error is None and r.finish_reason in ("eos", "max_frames")
    assert frames == floor if r.finish_reason == "max_frames" else frames < floor


class _Sender:
    def __init__(self) -> None:
        self.queries = 0

    def is_cancelled(self) -> bool:
        self.queries += 1
        return True


def test_cancellation_is_asked_at_most_once_per_period():
    """Each is_cancelled() is a round trip to the server that holds up the responses queued behind it."""
    import queue
    import time

    from q3tts.serving.session import Reply

    sender = _Sender()
    reply = Reply(sender, queue.Queue())
    start = time.monotonic()
    assert not reply.check_cancelled(start + 0.1, 0.5) and sender.queries == 0  # too soon after it opened
    assert reply.check_cancelled(start + 0.6, 0.5) and sender.queries == 1
    assert not reply.check_cancelled(start + 0.9, 0.5) and sender.queries == 1
    assert reply.check_cancelled(start + 1.2, 0.5) and sender.queries == 2
