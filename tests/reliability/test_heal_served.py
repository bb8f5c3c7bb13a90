"""The heal path with the real server (CPU): the test hook makes the engine raise the error class of a CUDA
device fault, so the whole path runs: healthy streams get one 'restarting' error each, readiness (the
q3tts_instance_ready gauge, TritonServer.is_ready) drops and returns, the counters move, and a new request
after recovery streams audio. tests/reliability/test_gpu_faults.py runs it with a real device-side assert."""

from __future__ import annotations

import pytest

from tests.reliability.conftest import start_server
from tests.reliability.served import heal, table

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    srv = start_server(tiny_checkpoint, tmp_path_factory.mktemp("serve"), True, gpus=[], max_slots=8,
                       ready_timeout_s=240)
    yield srv
    srv.stop()


def test_a_device_fault_heals_the_instance(server):
    print(table("heal path (CPU, injected fault of the CUDA error class)", heal(server)))
    assert "device fault" in server.log_text()
