"""Time to first byte through the OpenAI endpoint vs gRPC direct, for the same utterance on the same server.

    python perf/bench_openai.py                                  # a tiny CustomVoice server on this machine
    python perf/bench_openai.py --model CKPT --gpus 0 --requests 50
    python perf/bench_openai.py --triton-url 10.0.0.5:8001 --openai-url http://10.0.0.5:8000 --voice ryan

gRPC direct: `q3tts_client.synthesize` on one connected client, called -> first audio handed to its
`on_audio` (stream setup included, as for every new sequence). Endpoint: one keep-alive HTTP connection, POST /v1/audio/speech (pcm, streamed) sent -> first body
byte. The two alternate request by request (same text, voice and greedy parameters), after `--warmup` pairs
of each, so drift on a shared machine hits both alike. Prints p50 / p90 / mean of each and the p50 of the
per-pair differences; the table is also saved as $OUT/bench_openai.md.

On a busy machine the engine's own time to first audio varies by far more than the endpoint adds, so the
endpoint is also timed from inside: its Server-Timing header gives the sequence's own time to first audio
(the bridge's `synthesize` call -> first audio, the same measure as gRPC direct), which is subtracted from the
HTTP first byte of the same request. That difference is what the endpoint adds (HTTP, validation, thread
hops), free of the engine's noise. Local servers run as they would in production: tritonserver, and the
endpoint as its own process (`q3tts openai`); this process only runs the two clients.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import numpy as np

from report import emit
from q3tts_client import protocol as P
from q3tts_client.stream_client import connect, synthesize

TEXT = "The quick brown fox jumps over the lazy dog."


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


def http_ttfb(http: httpx.Client, url: str, voice_name: str, params: dict) -> tuple[float, float]:
    """(client: request sent -> first body byte, server: its sequence's own time to first audio), seconds."""
    body = {"model": "qwen3-tts", "input": TEXT, "voice": voice_name, "response_format": "pcm", **params}
    t0 = time.perf_counter()
    with http.stream("POST", f"{url}/v1/audio/speech", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"endpoint answered {response.status_code}: {response.read().decode()}")
        chunks = response.iter_raw()
        next(chunks)
        t = time.perf_counter() - t0
        for _ in chunks:  # read the rest: the next request starts on an idle server
            pass
    timing = dict(part.strip().split(";dur=") for part in response.headers["server-timing"].split(","))
    return t, float(timing["first-audio"]) / 1000


def http_floor(http: httpx.Client, url: str, voice_name: str) -> float:
    """A request the endpoint refuses before any Triton work (speed 2): HTTP + parsing + validation, seconds."""
    t0 = time.perf_counter()
    response = http.post(f"{url}/v1/audio/speech", json={"model": "m", "input": TEXT, "voice": voice_name,
                                                         "speed": 2.0})
    if response.status_code != 400:
        raise RuntimeError(f"expected a 400, got {response.status_code}: {response.text}")
    return time.perf_counter() - t0


def row(name: str, ms: np.ndarray) -> str:
    return f"| {name} | {len(ms)} | {np.percentile(ms, 50):.2f} | {np.percentile(ms, 90):.2f} | {ms.mean():.2f} |"


def measure(args, triton_url: str, openai_url: str) -> str:
    voice = {"speaker": args.voice} if args.speaker else {"voice": args.voice}
    params = {"greedy": True, "seed": 0, "max_frames": args.max_frames}
    grpc_ms, http_ms, added_ms, floor_ms = [], [], [], []
    client = connect(triton_url)
    with httpx.Client(timeout=120) as http:
        for i in range(args.warmup + args.requests):
            g = grpc_ttfb(client, triton_url, voice, params)
            h, inner = http_ttfb(http, openai_url, args.voice, params)
            f = http_floor(http, openai_url, args.voice)
            if i >= args.warmup:
                floor_ms.append(1000 * f)
                grpc_ms.append(1000 * g)
                http_ms.append(1000 * h)
                added_ms.append(1000 * (h - inner))
    client.close()
    g, h = np.array(grpc_ms), np.array(http_ms)
    added = np.percentile(h - g, 50)
    lines = [
        f"TTFB, {args.requests} alternating pairs after {args.warmup} warm-up pairs; {args.max_frames} frames, "
        f"greedy, voice {args.voice!r}; Triton {triton_url}",
        "", "| path | requests | p50 ms | p90 ms | mean ms |", "|---|---|---|---|---|",
        row("gRPC direct (first audio)", g), row("OpenAI endpoint (first byte)", h), "",
        f"endpoint adds: p50 of the per-pair differences {added:.2f} ms; difference of the p50s "
        f"{np.percentile(h, 50) - np.percentile(g, 50):.2f} ms"]
    lines += ["", "| what the endpoint adds | requests | p50 ms | p90 ms | mean ms |", "|---|---|---|---|---|",
              row("HTTP first byte - its sequence's first audio (Server-Timing)", np.array(added_ms)),
              row("for scale: a request refused before any Triton work (400), round trip", np.array(floor_ms))]
    return "\n".join(lines)


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
