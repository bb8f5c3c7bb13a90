"""Issue 17 / 12 against the real server on CPU (one server, the fault-injection test hook on):

- the validation table: every out-of-range, non-finite or oversized parameter and every input the checkpoint's
  variant does not use gets one error naming it, while a healthy stream beside them keeps the bits it has alone;
- the heal path: the hook makes the engine raise the error class of a CUDA device fault, so the whole path runs:
  healthy streams get one 'restarting' error each, readiness (q3tts_instance_ready, TritonServer.is_ready)
  drops and returns, the counters move, a new request after recovery streams audio.
tests/reliability/test_gpu_faults.py runs the same with a real device-side assert.
"""

from __future__ import annotations

import numpy as np
import pytest

from q3tts_client import protocol as P
from q3tts_client.stream_client import synthesize
from tests.reliability.conftest import start_server
from tests.reliability.served import HEALTHY, TEXT, VOICE, heal, table, validation_cases

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    srv = start_server(tiny_checkpoint, tmp_path_factory.mktemp("serve"), True, gpus=[], max_slots=8,
                       ready_timeout_s=240)
    yield srv
    srv.stop()


def test_bad_parameters_are_refused_by_name_beside_a_healthy_stream(server):
    reference = synthesize(server.grpc_url, [TEXT], VOICE, HEALTHY)
    assert reference.error is None and reference.audio.size > 0
    print(table("validation table (CPU, tiny checkpoint)", validation_cases(server.grpc_url, reference)))


@pytest.mark.parametrize("voice, name", [
    ({**VOICE, "ref_audio": np.zeros(24000, np.float32), "ref_sample_rate": 24000}, P.INPUT_REF_AUDIO),
    ({**VOICE, "instruct": "whisper"}, P.INPUT_INSTRUCT),  # a 0.6B CustomVoice drops instructions
    ({**VOICE, "ref_text": "hello"}, P.INPUT_REF_TEXT),
])
def test_inputs_the_variant_does_not_use_are_refused_by_name(server, voice, name):
    r = synthesize(server.grpc_url, [TEXT], voice, {"max_frames": 4})
    assert r.error is not None and f"input '{name}' is for" in r.error and r.audio.size == 0


def test_oversized_text_is_refused_before_any_work(server):
    r = synthesize(server.grpc_url, ["x" * (P.MAX_TEXT_CHARS + 1)], VOICE, {"max_frames": 4})
    assert r.error is not None and f"at most {P.MAX_TEXT_CHARS}" in r.error and r.audio.size == 0


def test_a_device_fault_heals_the_instance(server):
    print(table("heal path (CPU, injected fault of the CUDA error class)", heal(server)))
    assert "device fault" in server.log_text()
