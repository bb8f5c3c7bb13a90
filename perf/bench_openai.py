"""Time to first byte through the OpenAI endpoint vs gRPC direct, for the same utterance on the same server.

    python perf/bench_openai.py                                  # a tiny CustomVoice server on this machine
    python perf/bench_openai.py --model CKPT --gpus 0 --requests 50
    python perf/bench_openai.py --triton-url 10.0.0.5:8001 --openai-url http://10.0.0.5:8000 --voice ryan

gRPC direct: `q3tts_client.synthesize` on one connected client, called -> first audio handed to its
`on_audio` (stream setup included, as for every new sequence). Endpoint: one keep-alive HTTP connection of
the standard library's `http.client` (the leanest Python client: what is timed is the endpoint, not a client
library), POST /v1/audio/speech (pcm, streamed) sent -> first body byte. The same request is also timed
through httpx (the `openai` package's HTTP client), whose own per-request work is part of what its users see.
The paths alternate request by request (same text, voice and greedy parameters), after `--warmup` rounds,
so drift on a shared machine hits all alike. Prints the table the README quotes (p50 / p90), with the commit
and the load average; it is also saved as $OUT/bench_openai.md.

On a busy machine the engine's own time to first audio varies by far more than the endpoint adds, so the
endpoint is also timed from inside: its Server-Timing header gives the sequence's own time to first audio
(the bridge's `synthesize` call -> first audio, the same measure as gRPC direct), which is subtracted from the
HTTP first byte of the same request. That difference is what the endpoint adds (HTTP, validation, thread
hops), free of the engine's noise. Local servers run as they would in production: tritonserver, and the
endpoint as its own process (`q3tts openai`); this process only runs the clients.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np

from report import commit, emit
from q3tts_client import protocol as P
from q3tts_client.stream_client import connect, synthesize

TEXT = "The quick brown fox jumps over the lazy dog."
SPEECH = "/v1/audio/speech"
JSON = {"content-type": "application/json"}


def timed_synthesize(synth, *args, **kwargs):
    """`synth(*args, **kwargs)` -> (its Result, seconds from the call to the first audio)."""
    first, real_hook = [], kwargs.pop("on_audio", None)

    def on_audio(audio, rate):
        if not first:
            first.append(time.perf_counter())
        if real_hook:
            real_hook(audio, rate)

    t0 = time.perf_counter()
    res = synth(*args, on_audio=on_audio, **kwargs)
    return res, (first[0] - t0 if first else None)


def grpc_ttfb(client, url: str, voice: dict, params: dict) -> float:
    r, t = timed_synthesize(synthesize, url, [TEXT], voice, {**params, P.PARAM_AUDIO_FORMAT: "int16"},
                            client=client)
    if r.error or t is None:
        raise RuntimeError(f"gRPC request failed: {r.error}")
    return t


def first_audio_s(server_timing: str) -> float:
    """The sequence's own time to first audio from the endpoint's Server-Timing header, seconds."""
    timing = dict(part.strip().split(";dur=") for part in server_timing.split(","))
    return float(timing["first-audio"]) / 1000


def post(conn: http.client.HTTPConnection, body: dict) -> tuple[float, http.client.HTTPResponse]:
    """POST `body` to the speech route on `conn` (connected again first if the endpoint closed it while it
    was idle: its keep-alive timeout) -> (perf_counter when sent, the response with its headers read)."""
    data = json.dumps(body).encode()
    if conn.sock is not None and select.select([conn.sock], [], [], 0)[0]:
        conn.close()
    if conn.sock is None:
        conn.connect()
    t0 = time.perf_counter()
    conn.request("POST", SPEECH, body=data, headers=JSON)
    return t0, conn.getresponse()


def stdlib_ttfb(conn: http.client.HTTPConnection, body: dict) -> tuple[float, float]:
    """(client: request sent -> first body byte, server: its sequence's own time to first audio), seconds."""
    t0, response = post(conn, body)
    if response.status != 200:
        raise RuntimeError(f"endpoint answered {response.status}: {response.read().decode()}")
    response.read1(1)
    t = time.perf_counter() - t0
    response.read()  # the rest: the next request starts on an idle server
    return t, first_audio_s(response.getheader("server-timing"))


def httpx_ttfb(session: httpx.Client, url: str, body: dict) -> tuple[float, float]:
    """`stdlib_ttfb` through httpx."""
    t0 = time.perf_counter()
    with session.stream("POST", f"{url}{SPEECH}", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"endpoint answered {response.status_code}: {response.read().decode()}")
        chunks = response.iter_raw()
        next(chunks)
        t = time.perf_counter() - t0
        for _ in chunks:
            pass
    return t, first_audio_s(response.headers["server-timing"])


def http_floor(conn: http.client.HTTPConnection, body: dict) -> float:
    """A request the endpoint refuses before any Triton work (speed 2): HTTP + parsing + validation, seconds."""
    t0, response = post(conn, {**body, "speed": 2.0})
    response.read()
    if response.status != 400:
        raise RuntimeError(f"expected a 400, got {response.status}")
    return time.perf_counter() - t0


def row(name: str, ms: list[float]) -> str:
    return f"| {name} | {np.percentile(ms, 50):.2f} | {np.percentile(ms, 90):.2f} |"


def load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def measure(args, triton_url: str, openai_url: str) -> str:
    voice = {"speaker": args.voice} if args.speaker else {"voice": args.voice}
    params = {"greedy": True, "seed": 0, "max_frames": args.max_frames}
    body = {"model": "qwen3-tts", "input": TEXT, "voice": args.voice, "response_format": "pcm", **params}
    ms: dict[str, list[float]] = {k: [] for k in ("grpc", "http", "added", "httpx_added", "floor")}
    client, load_before = connect(triton_url), load()
    where = urlsplit(openai_url)
    conn = http.client.HTTPConnection(where.hostname, where.port or 80, timeout=120)
    with httpx.Client(timeout=120) as session:
        for i in range(args.warmup + args.requests):
            g = grpc_ttfb(client, triton_url, voice, params)
            h, inner = stdlib_ttfb(conn, body)
            hx, hx_inner = httpx_ttfb(session, openai_url, body)
            f = http_floor(conn, body)
            if i >= args.warmup:
                for k, v in (("grpc", g), ("http", h), ("added", h - inner), ("httpx_added", hx - hx_inner),
                             ("floor", f)):
                    ms[k].append(1000 * v)
    conn.close()
    client.close()
    pairs = np.array(ms["http"]) - np.array(ms["grpc"])
    return "\n".join([
        f"TTFB through the endpoint vs gRPC direct: {args.requests} alternating rounds after {args.warmup} "
        f"warm-up rounds, {args.max_frames} frames, greedy, voice {args.voice!r}; Triton {triton_url}; "
        f"commit {commit()}; load average {load_before} before, {load()} after",
        "", "| | p50 ms | p90 ms |", "|---|---|---|",
        row("gRPC direct: `synthesize` called -> first audio", ms["grpc"]),
        row("endpoint: POST sent -> first body byte", ms["http"]),
        row("what the endpoint adds: first byte - the same request's first audio (`Server-Timing`)", ms["added"]),
        row("the same through httpx (the `openai` package's HTTP client)", ms["httpx_added"]),
        row("for scale: a request refused before any Triton work (400), round trip", ms["floor"]),
        "", f"endpoint - gRPC direct: p50 of the per-round differences {np.percentile(pairs, 50):.2f} ms "
        f"(the engine's own time to first audio varies by more on a busy machine)"])


def local_servers(args, stack: ExitStack) -> tuple[str, str]:
    """A tritonserver of --model (default: a tiny random CustomVoice checkpoint) and the endpoint process."""
    from q3tts.checkpoint.maker import make_checkpoint
    from q3tts.serving.launcher import TritonServer, free_ports, parse_gpus

    work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-openai-")))
    model = args.model or make_checkpoint(work / "cv-tiny", "custom_voice", "0.6b", "tiny", 0)
    server = stack.enter_context(TritonServer(str(model), run_dir=work / "serve", gpus=parse_gpus(args.gpus),
                                              voices_dir=work / "voices"))
    port = free_ports(1)[0]
    api = subprocess.Popen([sys.executable, "-m", "q3tts.cli", "openai", "--triton-url", server.grpc_url,
                            "--port", str(port), "--log-level", "warning"])
    stack.callback(lambda: (api.terminate(), api.wait(30)))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while not _healthy(url):
        if api.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the endpoint did not start on {url}")
        time.sleep(0.2)
    return server.grpc_url, url


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--triton-url", help="gRPC host:port of a running server (with --openai-url)")
    ap.add_argument("--openai-url", help="base URL of a running endpoint, e.g. http://127.0.0.1:8000")
    ap.add_argument("--model", help="checkpoint for the local server (default: a tiny random CustomVoice one)")
    ap.add_argument("--gpus", default="none", help="local server: none | auto | 0,1")
    ap.add_argument("--voice", default="ryan", help="a CustomVoice speaker, or a registered voice with --registered")
    ap.add_argument("--registered", dest="speaker", action="store_false", help="--voice is a registered voice")
    ap.add_argument("--requests", type=int, default=30, help="measured pairs (>= 20 for a p50)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--max-frames", type=int, default=4, help="frames per utterance (TTFB needs the first only)")
    args = ap.parse_args(argv)
    if bool(args.triton_url) != bool(args.openai_url):
        ap.error("--triton-url and --openai-url go together (or neither: local servers)")
    with ExitStack() as stack:
        where = (args.triton_url, args.openai_url) if args.triton_url else local_servers(args, stack)
        emit(measure(args, *where), "bench_openai.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
