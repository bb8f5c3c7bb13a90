"""Servers of the reliability tests: one per test module on 127.0.0.1 free ports (tests/server/conftest.py's
tiny checkpoint and failure log), the heal servers with the fault-injection test hook on."""

from __future__ import annotations

import os
from contextlib import contextmanager

from q3tts.engine.config import TEST_HOOKS_ENV
from q3tts.serving.launcher import TritonServer
from tests.server.conftest import (print_log_on_failure, pytest_runtest_makereport,  # noqa: F401 (fixtures, hook)
                                   tiny_checkpoint)

from tests.reliability.served import FAULT_SEED


@contextmanager
def test_hooks():
    """Q3TTS_TEST_HOOKS=1 for what starts inside (the server's environment is this process's)."""
    old = os.environ.get(TEST_HOOKS_ENV)
    os.environ[TEST_HOOKS_ENV] = "1"
    try:
        yield
    finally:
        os.environ.pop(TEST_HOOKS_ENV) if old is None else os.environ.__setitem__(TEST_HOOKS_ENV, old)


def start_server(checkpoint, run_dir, fault_injection: bool, **kw) -> TritonServer:
    pool = {**kw.pop("pool", {}), **({"fault_injection_seed": FAULT_SEED} if fault_injection else {})}
    srv = TritonServer(str(checkpoint), run_dir=run_dir, pool=pool, **kw)
    if fault_injection:
        with test_hooks():
            return srv.start()
    return srv.start()
