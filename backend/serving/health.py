"""Strict readiness of a q3tts Triton server: the one probe of `q3tts serve`, the Docker HEALTHCHECK and a
fleet's own checks (`python -m q3tts.serving.health --http HOST:PORT --metrics HOST:PORT`, exit 0 = ready).

Ready means Triton's /v2/health/ready answers 200 AND every engine instance's `q3tts_instance_ready` gauge
is 1: a python model cannot make Triton 2.51 answer NOT READY, so an instance restarting after a device fault
shows only in that gauge.
"""

from __future__ import annotations

import argparse
import sys
import urllib.request


def instance_ready_values(metrics_text: str) -> list[float]:
    """The `q3tts_instance_ready` value of each engine instance in a Prometheus metrics page."""
    return [float(line.rsplit(" ", 1)[1]) for line in metrics_text.splitlines()
            if line.startswith(("q3tts_instance_ready{", "q3tts_instance_ready "))]


def not_ready_reason(http: str, metrics: str, instances: int = 1) -> str | None:
    """None when the server at `http` (HOST:PORT) with metrics at `metrics` (HOST:PORT) is ready with at least
    `instances` engine instances; otherwise why not."""
    try:
        with urllib.request.urlopen(f"http://{http}/v2/health/ready", timeout=2) as r:
            if r.status != 200:
                return f"http://{http}/v2/health/ready answered {r.status}"
        with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=2) as r:
            values = instance_ready_values(r.read().decode())
    except OSError as e:
        return f"not reachable: {e}"
    if len(values) < instances:
        return f"{len(values)} of {instances} engine instances report q3tts_instance_ready"
    if not all(v == 1 for v in values):
        return f"q3tts_instance_ready values {values} (0 = restarting after a device fault)"
    return None


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
