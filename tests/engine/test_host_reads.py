"""The engine's admission and decode steps read nothing back from the device as a Python number: on CUDA such a
read (`item()`, `int(t)`, a 0-dim tensor index) waits for the stream it is made on, so on those paths it holds the
step loop behind the queued work. (Their results reach the host as arrays, copied into pinned buffers.) The CPU
engine runs the same Python as the CUDA one's eager flow, so a read added there shows here."""

from __future__ import annotations

import pytest
import torch

from host_reads import HostReads  # tests/ is on sys.path
from q3tts.core import SamplingParams, VoiceSpec
from q3tts.engine.config import EngineConfig
from q3tts.engine.engine import Engine

CFG = EngineConfig(device="cpu", dtype="float32", page_size=16, num_pages=96, max_slots=6, max_queue=8,
                   max_prompt_tokens=256, max_text_tokens=256, max_frames=12, graph_batch_sizes=(8,),
                   use_cuda_graphs=False)


def admit_and_run(engine: Engine, speakers: list[str]) -> HostReads:
    """Four admissions of two voices new to the engine (their prompt heads not yet cached), then every decode step
    until the engine is idle, under `HostReads`."""
    before = engine.stats()["decode_steps"]
    with HostReads() as host:
        for i in range(4):
            engine.add(f"r{i}", VoiceSpec(speaker=speakers[i % 2]), SamplingParams(seed=i), "Hello there.", True)
        while engine.has_work():
            engine.step()
    assert engine.stats()["decode_steps"] - before >= 2  # frames were made under the mode
    return host


def test_admissions_and_steps_read_nothing_back(tiny_ckpt):
    host = admit_and_run(Engine(tiny_ckpt, CFG), sorted(tiny_ckpt.config.talker.speaker_ids))
    assert len(host.ops) > 1000 and host.reads == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_admissions_and_steps_read_nothing_back_from_the_gpu(tiny_ckpt_dir):
    """The CUDA engine as served (decode and prefill graphs, two steps in flight): admission's eager part and the
    host turn of each step read no CUDA tensor back as a number."""
    cfg = EngineConfig(device="cuda", dtype="bfloat16", num_pages=256, max_slots=8, max_frames=12,
                       max_prompt_tokens=256, max_text_tokens=128, graph_batch_sizes=(1, 2, 4, 8))
    engine = Engine(str(tiny_ckpt_dir), cfg)
    host = admit_and_run(engine, sorted(engine.checkpoint.config.talker.speaker_ids))
    assert [device for device in host.reads if device.startswith("cuda")] == []
