"""perf/bench_serve.py's report of the server's memory: the gauges summed over instances by `scrape`, read back
per server."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))
from bench_serve import server_memory  # noqa: E402


def test_the_servers_memory_is_reported_once_whatever_the_instances():
    # two instances, each reporting the same server: 300 MiB, budget 16 GiB
    two = {"q3tts_instance_ready": 2.0, "q3tts_server_resident_bytes": 2 * 300 * 2 ** 20,
           "q3tts_server_memory_budget_bytes": 2 * 16 * 2 ** 30}
    assert server_memory(two) == "tritonserver resident memory after the run: 300 MiB (budget 16 GiB; 0 = none)"
    one = {"q3tts_instance_ready": 1.0, "q3tts_server_resident_bytes": 1.5 * 2 ** 30}
    assert server_memory(one) == "tritonserver resident memory after the run: 1536 MiB (budget 0 GiB; 0 = none)"
