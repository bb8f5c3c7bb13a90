"""The server's memory budget: the serving loop reports tritonserver's resident memory and its budget as gauges and
logs each time it goes over; the health probe says not ready while any instance reports more than a nonzero
budget. (tests/reliability/test_server_memory_leak.py drives it with the real server and Triton's leak.)"""

from __future__ import annotations

import os

from q3tts.serving import health
from q3tts.serving.loop import EngineLoop
from q3tts.serving.metrics import ServingMetrics
from tests.serving.test_glue import M, ScriptedEngine, wait_until

GIB = 2 ** 30


def page(*reports: tuple[float, float]) -> str:
    """A metrics page with one (resident, budget) report per instance, beside other series."""
    lines = ['q3tts_instance_ready{model="qwen3_tts",model_instance="qwen3_tts_0"} 1']
    for i, (held, budget) in enumerate(reports):
        labels = f'{{model="qwen3_tts",model_instance="qwen3_tts_{i}"}}'
        lines += [f"q3tts_server_resident_bytes{labels} {held}", f"q3tts_server_memory_budget_bytes{labels} {budget}"]
    return "\n".join(lines + ["# HELP q3tts_server_resident_bytes x", "nv_gpu_memory_used_bytes 123"]) + "\n"


def test_the_probe_is_ready_under_the_budget_or_without_one():
    assert health.memory_reason(page((GIB, 16 * GIB))) is None
    assert health.memory_reason(page((16 * GIB, 16 * GIB))) is None  # at the budget: still ready
    assert health.memory_reason(page((64 * GIB, 0))) is None  # 0: no budget
    assert health.memory_reason(page()) is None  # a server that reports none (older q3tts)


def test_the_probe_is_not_ready_over_the_budget_and_says_how_far():
    reason = health.memory_reason(page((GIB, 16 * GIB), (20 * GIB, 16 * GIB)))  # the second instance's report
    assert reason is not None
    assert "20.00 GiB" in reason and "16.00 GiB" in reason and "max_server_memory_gib" in reason


def test_resident_bytes_reads_a_live_process_and_gives_0_for_a_gone_one():
    mine = health.resident_bytes(os.getpid())
    assert 10 * 2 ** 20 < mine < 64 * GIB  # this interpreter with torch imported
    assert health.resident_bytes(2 ** 22 + 12345) == 0  # above Linux's pid_max: no such process


def test_the_loop_reports_the_servers_memory_and_logs_each_crossing():
    held = [GIB]
    logged = []
    metrics = ServingMetrics(M.pb_utils, {"model": "t", "version": "1"})
    core = EngineLoop(lambda: ScriptedEngine(), (1,), 30.0, metrics, lambda level, msg: logged.append((level, msg)),
                      server_memory_budget=2 * GIB, server_resident=lambda: held[0])
    core.start()
    try:
        gauge = lambda name: metrics.gauges[name].value  # noqa: E731
        assert wait_until(lambda: gauge("q3tts_server_resident_bytes") == GIB)
        assert gauge("q3tts_server_memory_budget_bytes") == 2 * GIB
        over = lambda: [msg for level, msg in logged if level == "error" and "over its budget" in msg]  # noqa: E731
        held[0] = 3 * GIB
        assert wait_until(lambda: gauge("q3tts_server_resident_bytes") == 3 * GIB)
        assert wait_until(lambda: len(over()) == 1)
        assert "3.00 GiB" in over()[0]
        held[0] = GIB  # back under (a restart of a leaking server cannot happen in-process; a test can)
        assert wait_until(lambda: gauge("q3tts_server_resident_bytes") == GIB)
        held[0] = 4 * GIB  # a second crossing is logged again, once
        assert wait_until(lambda: len(over()) == 2)
        assert wait_until(lambda: gauge("q3tts_server_resident_bytes") == 4 * GIB)
        assert len(over()) == 2
    finally:
        core.shutdown()
