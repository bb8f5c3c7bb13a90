"""The engine's admission and decode steps read nothing back from the device as a Python number: on CUDA such a
read (`item()`, `int(t)`, a 0-dim tensor index) waits for the stream it is made on, so on those paths it holds the
step loop behind the queued work. (Their results reach the host as arrays, copied into pinned buffers.) The CPU
engine runs the same Python as the CUDA one's eager flow, so a read added there shows here."""

from __future__ import annotations

import torch

from host_reads import HostReads  # tests/ is on sys.path
from q3tts.core import SamplingParams, VoiceSpec
from q3tts.engine.config import EngineConfig
from q3tts.engine.engine import Engine

CFG = EngineConfig(device="cpu", dtype="float32", page_size=16, num_pages=96, max_slots=6, max_queue=8,
                   max_prompt_tokens=256, max_text_tokens=256, max_frames=12, graph_batch_sizes=(8,),
                   use_cuda_graphs=False)


def test_admissions_and_steps_read_nothing_back(tiny_ckpt):
    engine = Engine(tiny_ckpt, CFG)
    speakers = sorted(tiny_ckpt.config.talker.speaker_ids)
    with HostReads() as host:
        for i in range(4):  # two voices, each admitted for the first time (their prompt heads not yet cached)
            engine.add(f"r{i}", VoiceSpec(speaker=speakers[i % 2]), SamplingParams(seed=i), "Hello there.", True)
        steps = 0
        while engine.has_work():
            engine.step()
            steps += 1
    assert steps >= CFG.max_frames and len(host.ops) > 1000  # the frames were made under the mode
    assert host.reads == []
