"""run_requests over a JSONL file; CUDA graph replay == eager (GPU only)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from q3tts.engine.batch import parse_requests, run_requests
from q3tts.engine.config import EngineConfig
from q3tts.engine.engine import Engine

CPU = EngineConfig(device="cpu", dtype="float32", num_pages=48, max_slots=4, max_queue=4,
                   max_prompt_tokens=256, max_text_tokens=128, max_frames=32, graph_batch_sizes=(8,),
                   use_cuda_graphs=False)


def test_run_requests_jsonl(tmp_path, tiny_ckpt, speaker):
    lines = [dict(id="a", text="Hello world, this is a test.", speaker=speaker, greedy=True, max_frames=3,
                  codes_out="a.npy"),
             {"id": "b", "text": "The quick brown fox.", "speaker": speaker, "seed": 4, "max-frames": 2,
              "start_step": 1, "codes_out": "out/b.npy", "text_mode": "incremental"},
             dict(id="bad", text="x", speaker="nobody")]
    path = tmp_path / "reqs.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    reqs = parse_requests(path, {"do_sample": True})
    assert [r.start_step for r in reqs] == [0, 1, 0]
    eng = Engine(tiny_ckpt, CPU)
    res = run_requests(eng, reqs)
    assert res["a"].reason == "max_frames" and res["a"].codes.shape == (3, 16)
    assert res["b"].codes.shape == (2, 16) and res["bad"].reason == "rejected"
    assert np.array_equal(np.load(tmp_path / "a.npy"), res["a"].codes)
    assert np.array_equal(np.load(tmp_path / "out" / "b.npy"), res["b"].codes)
    alone = run_requests(eng, [dataclasses.replace(reqs[1], start_step=0)], write=False)
    assert np.array_equal(alone["b"].codes, res["b"].codes)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x", "colour": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: unknown fields"):
        parse_requests(bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graph_replay_equals_eager(tiny_ckpt_dir):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))
    from bench_engine import graph_vs_eager

    cfg = EngineConfig(device="cuda", dtype="bfloat16", num_pages=256, max_slots=8, max_frames=64,
                       max_prompt_tokens=256, max_text_tokens=128, graph_batch_sizes=(1, 2, 4, 8))
    eng = Engine(str(tiny_ckpt_dir), cfg)
    assert eng.runner.graph_buckets == (1, 2, 4, 8)
    assert graph_vs_eager(eng, 3)
    before = eng.stats()
    spk = sorted(eng.checkpoint.config.talker.speaker_ids)[0]
    from q3tts.core import SamplingParams, VoiceSpec

    eng.add("x", VoiceSpec(speaker=spk), SamplingParams(max_frames=5), "Hello world.", True)
    n = 0
    while eng.has_work():
        eng.step()
        n += 1
    s = eng.stats()
    assert s["graph_replays"] - before["graph_replays"] == s["decode_steps"] - before["decode_steps"]
    assert s["kv_pages_used"] == 0 and s["slots_used"] == 0
