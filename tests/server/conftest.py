"""One real tritonserver per test module on 127.0.0.1 free ports, serving a generated tiny checkpoint with
the real engine; stopped by PID; its log is printed for every failed test."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from q3tts_client.metrics import scrape
from q3tts.serving.launcher import TritonServer

IDLE_S = 3.0


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "cv-0.6b-tiny"
    subprocess.run([sys.executable, "-m", "q3tts.cli", "make-checkpoint", str(out), "--variant", "custom_voice",
                    "--size", "0.6b", "--scale", "tiny", "--seed", "0"], check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    srv = TritonServer(str(tiny_checkpoint), run_dir=tmp_path_factory.mktemp("serve"), gpus=[], max_slots=8,
                       idle_s=IDLE_S, ready_timeout_s=180)
    srv.start()
    yield srv
    srv.stop()


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)


@pytest.fixture(autouse=True)
def print_log_on_failure(request):
    yield
    rep = getattr(request.node, "rep_call", None)
    srv = request.node.funcargs.get("server")
    if rep is not None and rep.failed and srv is not None:
        print(f"---- tritonserver log ({srv.log_path}), last 200 lines ----")
        print("\n".join(srv.log_text().splitlines()[-200:]))


def read_metrics(srv) -> dict[str, float]:
    """q3tts_* gauges and counters of the metrics endpoint, summed over labels."""
    return scrape(srv.metrics_url)


def wait_metrics(srv, predicate, timeout_s=15.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = read_metrics(srv)
        if predicate(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.2)
