"""Issue 17 on the GPU (marked gpu: skipped without CUDA). Prints one table:

1. the faults path inside the captured decode graphs: a NaN written into one row's slot parameters mid-stream
   ends that row alone ("sampling produced non-finite scores"), the others finish, nothing reads out of bounds;
2. the served validation table (tiny or full checkpoint, bf16): each bad parameter gets one error naming it,
   a healthy stream beside them finishes with the bits it has alone;
3. the heal path with a REAL device-side assert (EngineConfig.fault_injection_seed: an out-of-range
   index_select): healthy streams get one 'restarting' error each, readiness drops and returns, a new request
   streams audio; the fault -> READY seconds are measured.

Setup as perf/gpu_serve.py does it (same settings: WORK, TRITON_TGZ, CLIENT_SITE, STUB_PY, NUMPY_WHL, SIZE,
Q3TTS_GPU_SERVE_SCALE (default here: tiny), DTYPE, MAX_SLOTS), the checkpoint reused from WORK when complete.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from q3tts.core import SamplingParams, VoiceSpec
from q3tts_client.stream_client import synthesize
from tests.reliability.conftest import start_server
from tests.reliability.served import HEALTHY, TEXT, VOICE, Row, heal, table, validation_cases

pytestmark = [pytest.mark.gpu, pytest.mark.server]
LONG = {**HEALTHY, "max_frames": 1000}  # a GPU step is fast: the healthy stream must outlast the bad requests
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "perf"))  # perf/gpu_serve.py, and the report module it imports
ROWS: list[Row] = []


def setting(name: str, default: str) -> str:
    return os.environ.get(name, default)


@pytest.fixture(scope="module")
def checkpoint():
    import gpu_serve as G

    work = Path(setting("WORK", str(ROOT / "run" / "gpu_serve"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    size, scale = setting("SIZE", "1.7b"), setting("Q3TTS_GPU_SERVE_SCALE", "tiny")
    ckpt = Path(setting("CKPT", str(work / f"ckpt-cv-{size}-{scale}")))
    G.make_checkpoint(ckpt, size, scale, float(setting("CKPT_TIMEOUT_S", "240")))
    return work, ckpt


@pytest.fixture(scope="module")
def server(checkpoint):
    import gpu_serve as G

    work, ckpt = checkpoint
    G.unpack(Path(setting("TRITON_TGZ", str(ROOT / ".gpu" / "pytriton_slim.tgz"))), work / "pytriton")
    os.environ.update(Q3TTS_PYTRITON_ROOT=str(work / "pytriton"), Q3TTS_TRITON_RUNTIME=str(work / "runtime"))
    os.environ.pop("Q3TTS_TRITON_HOME", None)
    spec = G.stub_env_spec(work, setting("CLIENT_SITE", str(ROOT / ".gpu" / "site")))
    srv = start_server(ckpt, work / "faults_server", True, gpus=[0], dtype=setting("DTYPE", "bfloat16"),
                       max_slots=int(setting("MAX_SLOTS", "16")), stub_env=spec, ready_timeout_s=600)
    yield srv
    srv.stop()
    report = table(f"issue 17 on {torch.cuda.get_device_name(0)} (checkpoint {ckpt.name})", ROWS)
    print(report, file=sys.__stdout__, flush=True)  # past pytest's capture: the table is the run's report
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / "gpu_faults.md").write_text(report + "\n")


def test_a_non_finite_row_ends_alone_inside_the_decode_graphs(checkpoint):
    from q3tts.engine import Engine, EngineConfig

    _, ckpt = checkpoint
    engine = Engine.from_checkpoint(ckpt, EngineConfig(max_slots=8, dtype="bfloat16", max_frames=256,
                                                       kv_memory_fraction=0.2))
    assert engine.runner.graph_buckets, "the decode step is not captured"
    speaker = sorted(engine.checkpoint.config.talker.speaker_ids)[0]
    for i in range(3):
        engine.add(i, VoiceSpec(speaker=speaker), SamplingParams(seed=i, max_frames=40), TEXT, True)
    finals, replays, step = {}, engine.runner.num_graph_replays, 0
    while engine.has_work():
        if step == 4:  # the victim's talker temperature goes NaN in its slot, read by the graph
            engine.runner.state.temperature[engine.scheduler.seqs[1].slot] = math.nan
        finals.update({o.seq_id: (o.reason, o.error) for o in engine.step() if o.finished})
        step += 1
    torch.cuda.synchronize()  # the context is healthy: no device-side assert happened
    assert engine.runner.num_graph_replays > replays
    assert finals[1][0] == "error" and "sampling produced non-finite scores (temperature=" in finals[1][1]
    assert all(finals[i][0] in ("eos", "max_frames") for i in (0, 2))
    assert engine.stats()["slots_used"] == 0 and engine.stats()["kv_pages_used"] == 0
    del engine
    torch.cuda.empty_cache()  # the served engine process sizes its KV pool from the free memory
    ROWS.append(Row("NaN temperature in one row's slot (graph replay)", f"that row: {finals[1][1][:60]}; "
                    "the others finish"))


def test_validation_table(server):
    reference = synthesize(server.grpc_url, [TEXT], VOICE, LONG)
    assert reference.error is None
    again = synthesize(server.grpc_url, [TEXT], VOICE, LONG)
    # NOTE: on the H200 (c0e5453) the same request repeated alone already differs in bits (bf16 is not
    # run-to-run invariant there: issue 11's batch-invariance item), so the healthy stream beside the bad
    # requests is held to what the bad requests could change (an error, a cut) and its difference is shown
    repeat = float(np.abs(again.audio - reference.audio).max()) if again.audio.size == reference.audio.size \
        else float("nan")
    ROWS.append(Row("the same request alone, twice", f"max |diff| {repeat:.3g}"))
    ROWS.extend(validation_cases(server.grpc_url, reference, LONG, bit_exact=False))


def test_device_side_assert_heals_the_instance(server):
    ROWS.extend(heal(server, streams=4, ready_timeout_s=900))
    assert "device-side assert" in server.log_text() or "CUDA error" in server.log_text()
