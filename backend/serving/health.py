"""Strict readiness of a q3tts Triton server: the one probe of `q3tts serve`, the Docker HEALTHCHECK and a
fleet's own checks (`python -m q3tts.serving.health --http HOST:PORT --metrics HOST:PORT`, exit 0 = ready).

Ready means Triton's /v2/health/ready answers 200 AND every engine instance's `q3tts_instance_ready` gauge
is 1 AND the tritonserver process holds no more resident memory than its budget (`q3tts_server_resident_bytes`
against `q3tts_server_memory_budget_bytes`, the rendered `max_server_memory_gib`; 0 = none): a python model
cannot make Triton 2.51 answer NOT READY, so an instance restarting after a device fault, or a server grown
past its budget, shows only in those gauges.

Why a memory budget: Triton 2.51's gRPC frontend never frees a streamed request it refused itself (an input
of the wrong type, shape or name, a sequence without START) when the client then cancels the stream or drops
the connection, input buffers included (measured on the CPU: 2000 such requests of 1 KB left 84 MB behind,
100 of 4 MB 385 MB; the model cannot unload afterwards: a stop waits for Triton's exit timeout). A client can
thus grow the server without bound; over its budget the server reports not ready, so that a fleet drains and
replaces it before the host runs out of memory, while its streams play on.
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.request

from q3tts_client.metrics import series


def gauge_values(metrics_text: str, name: str) -> list[float]:
    """The values of gauge `name` (one per engine instance) in a Prometheus metrics page."""
    return [value for series_name, _, value in series(metrics_text) if series_name == name]


def instance_ready_values(metrics_text: str) -> list[float]:
    """The `q3tts_instance_ready` value of each engine instance in a Prometheus metrics page."""
    return gauge_values(metrics_text, "q3tts_instance_ready")


def resident_bytes(pid: int) -> int:
    """The resident memory of process `pid` in bytes (Linux /proc); 0 where it cannot be read."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def memory_reason(metrics_text: str) -> str | None:
    """Why the server is over its memory budget (`q3tts_server_resident_bytes` above a nonzero
    `q3tts_server_memory_budget_bytes`; every instance reports the one tritonserver and the one rendered
    budget, so the largest of each is read), or None."""
    held, budget = (max(gauge_values(metrics_text, name), default=0.0)
                    for name in ("q3tts_server_resident_bytes", "q3tts_server_memory_budget_bytes"))
    if not 0 < budget < held:
        return None
    return (f"tritonserver holds {held / 2 ** 30:.2f} GiB, over its budget of {budget / 2 ** 30:.2f} GiB "
            "(max_server_memory_gib): memory Triton 2.51 leaks when clients cancel refused requests; replace "
            "this server")


def not_ready_reason(http: str, metrics: str, instances: int = 1) -> str | None:
    """None when the server at `http` (HOST:PORT) with metrics at `metrics` (HOST:PORT) is ready with at least
    `instances` engine instances; otherwise why not."""
    try:
        with urllib.request.urlopen(f"http://{http}/v2/health/ready", timeout=2) as r:
            if r.status != 200:
                return f"http://{http}/v2/health/ready answered {r.status}"
        with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=2) as r:
            text = r.read().decode()
        values = instance_ready_values(text)
    except OSError as e:
        return f"not reachable: {e}"
    if len(values) < instances:
        return f"{len(values)} of {instances} engine instances report q3tts_instance_ready"
    if not all(v == 1 for v in values):
        return f"q3tts_instance_ready values {values} (0 = restarting after a device fault)"
    return memory_reason(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m q3tts.serving.health", description=__doc__.splitlines()[0])
    parser.add_argument("--http", default="127.0.0.1:8000", help="Triton's HTTP endpoint, HOST:PORT")
    parser.add_argument("--metrics", default="127.0.0.1:8002", help="Triton's metrics endpoint, HOST:PORT")
    parser.add_argument("--instances", type=int, default=1, help="engine instances the server must have")
    args = parser.parse_args(argv)
    reason = not_ready_reason(args.http, args.metrics, args.instances)
    print(reason or "ready", file=sys.stderr if reason else sys.stdout)
    return 1 if reason else 0


if __name__ == "__main__":
    sys.exit(main())
