"""Engine on a tiny random checkpoint (CPU, eager): batching invariance, parity with synth, pools,
admission, streamed text, page exhaustion."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from q3tts.core import AdmissionRejected, InvalidRequest, SamplingParams, UnknownSequence, VoiceSpec
from q3tts.engine.config import EngineConfig
from q3tts.engine.engine import Engine

TEXT = ("Hello world, this is a test of the speech system. The quick brown fox jumps over the "
        "lazy dog.")
# NOTE: CPU buckets start at 8 rows: MKL's GEMM gives row results independent of the row count only
# from a few rows up (1- and 2-row products take other paths), so padding every decode batch to >= 8
# rows makes a sequence's bits independent of who else is in the step.
CFG = EngineConfig(device="cpu", dtype="float32", page_size=16, num_pages=96, max_slots=6, max_queue=8,
                   max_prompt_tokens=256, max_text_tokens=256, max_frames=64,
                   graph_batch_sizes=(8,), use_cuda_graphs=False)


def make_engine(ckpt, **kw) -> Engine:
    return Engine(ckpt, dataclasses.replace(CFG, **kw))


def run(engine: Engine, requests: list[dict], feeds: dict | None = None) -> dict:
    """requests: dicts with id, voice, sampling, text, done, start (step at which add() happens).
    feeds: {step: [(id, text or None = end)]}. Returns id -> (codes [F,16], pcm, reason)."""
    feeds = feeds or {}
    codes, pcm, reason = {}, {}, {}
    step = 0
    pending = sorted(requests, key=lambda r: r.get("start", 0))
    while pending or engine.has_work():
        while pending and pending[0].get("start", 0) <= step:
            r = pending.pop(0)
            engine.add(r["id"], r["voice"], r["sampling"], r.get("text", ""), r.get("done", True))
            codes[r["id"]], pcm[r["id"]] = [], []
        for sid, piece in feeds.get(step, []):
            engine.append_text(sid, piece) if piece is not None else engine.end_text(sid)
        for out in engine.step():
            codes[out.seq_id].append(out.codes)
            pcm[out.seq_id].append(out.pcm)
            if out.finished:
                assert out.seq_id not in reason, "finished twice"
                reason[out.seq_id] = (out.reason, out.error)
        step += 1
        assert step < 500
    return {k: (np.concatenate(codes[k]), np.concatenate(pcm[k]), reason[k]) for k in codes}


def req(rid, speaker, start=0, text=TEXT, mode=None, **sp):
    sp.setdefault("max_frames", 20)
    return dict(id=rid, voice=VoiceSpec(speaker=speaker, text_mode=mode), sampling=SamplingParams(**sp),
                text=text, start=start)


def baseline(engine: Engine):
    s = engine.stats()
    assert (s["active"], s["queued"], s["kv_pages_used"], s["slots_used"]) == (0, 0, 0, 0), s
    engine.check_integrity()


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    return make_engine(tiny_ckpt)


@pytest.mark.parametrize("mode", ["whole", "incremental"])
def test_batched_equals_alone(engine, speaker, mode):
    reqs = [req("g", speaker, 0, mode=mode, greedy=True, max_frames=8),
            req("s1", speaker, 2, mode=mode, seed=11, max_frames=4),
            req("s2", speaker, 3, mode=mode, seed=12, text=TEXT[:40], max_frames=9)]
    together = run(engine, reqs)
    baseline(engine)
    for r in reqs:
        alone = run(engine, [dict(r, start=0)])[r["id"]]
        assert np.array_equal(alone[0], together[r["id"]][0]), r["id"]
        assert np.array_equal(alone[1], together[r["id"]][1]), r["id"]
        assert alone[2] == together[r["id"]][2]
    baseline(engine)


def test_injected_uniforms_batched_equals_alone(tiny_ckpt, speaker):
    def table(seeds, counters):  # any per-(seed, counter) table works
        g = (seeds[:, None] * 7919 + counters[:, None] * 104729 + torch.arange(16)) % 1000
        return g.float() / 1000.0

    eng = make_engine(tiny_ckpt)
    eng.runner.uniform_source = table
    reqs = [req("a", speaker, 0, seed=1, top_k=0, max_frames=6),
            req("b", speaker, 1, seed=2, temperature=1.3, max_frames=6)]
    together = run(eng, reqs)
    for r in reqs:
        assert np.array_equal(run(eng, [dict(r, start=0)])[r["id"]][0], together[r["id"]][0])


@pytest.mark.parametrize("mode", ["whole", "incremental"])
def test_engine_equals_synth(tiny_ckpt, speaker, mode):
    from q3tts.models.tts_model import Qwen3TTS
    from q3tts.models.prompt import PromptBuilder
    from q3tts.models.generate import generate_codes

    model = Qwen3TTS.from_checkpoint(tiny_ckpt)
    voice = VoiceSpec(speaker=speaker, text_mode=mode)
    eng = make_engine(tiny_ckpt, graph_batch_sizes=(1, 8))  # alone = 1 row, as synth
    for params in (SamplingParams(greedy=True, max_frames=8), SamplingParams(seed=5, max_frames=8)):
        ref = generate_codes(model, PromptBuilder(model, tiny_ckpt.tokenizer).build(TEXT, voice), params)
        got = run(eng, [dict(id="x", voice=voice, sampling=params, text=TEXT)])["x"]
        assert np.array_equal(got[0], ref.numpy()), params


def test_streamed_text_equals_up_front(engine, speaker):
    words = TEXT.split(" ")
    pieces = [w + " " for w in words[:-1]] + [words[-1]]
    up_front = run(engine, [req("u", speaker, mode="incremental", greedy=True, max_frames=22)])["u"]
    # first piece at add, one piece per step (arrives in time: 1 token/frame is consumed)
    feeds = {i: [("s", p)] for i, p in enumerate(pieces[1:])}
    feeds.setdefault(len(pieces) - 1, []).append(("s", None))
    streamed = run(engine, [dict(req("s", speaker, mode="incremental", greedy=True, max_frames=22),
                                 text=pieces[0], done=False)], feeds)["s"]
    assert np.array_equal(streamed[0], up_front[0]) and np.array_equal(streamed[1], up_front[1])
    # text that arrives late: the sequence waits (no frames), others keep going
    feeds = {0: [("late", TEXT[:6])], 5: [("late", TEXT[6:])], 6: [("late", None)]}
    out = run(engine, [dict(req("late", speaker, mode="incremental", greedy=True, max_frames=8),
                            text="", done=False), req("other", speaker, max_frames=5, greedy=True)], feeds)
    assert out["other"][0].shape[0] == 5 and out["late"][2] == ("max_frames", None)
    assert np.array_equal(out["late"][0], up_front[0][:8])  # same text, waited, same frames
    baseline(engine)


def test_abort_and_finish_return_everything(engine, speaker):
    baseline(engine)
    for i in range(3):
        engine.add(f"r{i}", VoiceSpec(speaker=speaker), SamplingParams(max_frames=6), TEXT, True)
    engine.add("wait", VoiceSpec(speaker=speaker, text_mode="incremental"), SamplingParams(max_frames=6), "Hi there", False)
    engine.step()
    engine.step()
    assert engine.stats()["active"] == 4 and engine.stats()["kv_pages_used"] > 0
    engine.abort("r1")
    engine.abort("wait")
    assert engine.stats()["active"] == 2  # freed at once
    outs = engine.step()
    fin = {o.seq_id: o.reason for o in outs if o.finished}
    assert fin == {"r1": "aborted", "wait": "aborted"}
    with pytest.raises(UnknownSequence):
        engine.abort("nope")
    while engine.has_work():
        for o in engine.step():
            assert o.seq_id not in fin
            if o.finished:
                fin[o.seq_id] = o.reason
    assert set(fin) == {"r0", "r1", "r2", "wait"}
    baseline(engine)


def test_admission(tiny_ckpt, speaker):
    eng = make_engine(tiny_ckpt, max_slots=1, max_queue=2, num_pages=8)
    v = VoiceSpec(speaker=speaker)
    with pytest.raises(AdmissionRejected, match="KV pages"):
        eng.add("big", v, SamplingParams(max_frames=200), TEXT, True)  # 8 pages = 128 tokens
    with pytest.raises(AdmissionRejected, match="max_prompt_tokens"):
        make_engine(tiny_ckpt, max_prompt_tokens=20).add("long", v, SamplingParams(), TEXT, True)
    with pytest.raises(InvalidRequest):
        eng.add("bad", VoiceSpec(speaker="nobody"), SamplingParams(), TEXT, True)
    eng.add("a", v, SamplingParams(max_frames=2), TEXT, True)
    eng.add("b", v, SamplingParams(max_frames=2), TEXT, True)
    with pytest.raises(AdmissionRejected, match="queue full"):
        eng.add("c", v, SamplingParams(max_frames=2), TEXT, True)
    eng.step()  # a starts (one slot), b waits
    eng.add("c", v, SamplingParams(max_frames=2), TEXT, True)
    done = set()
    while eng.has_work():
        done |= {o.seq_id for o in eng.step() if o.finished}
    assert done == {"a", "b", "c"}
    baseline(eng)


def test_page_exhaustion_aborts_newest(tiny_ckpt, speaker):
    eng = make_engine(tiny_ckpt, num_pages=2, page_size=16, kv_policy="on_demand")  # 32 tokens
    v = VoiceSpec(speaker=speaker)
    SHORT = "Hello."
    prompt = eng.inputs.builder.build(SHORT, v).prefill.shape[0]
    frames = 2 * 16 - prompt  # each fits alone; together both start (1 page each), then run dry
    assert prompt < 16 and frames >= 3
    reqs = [dict(id="old", voice=v, sampling=SamplingParams(greedy=True, max_frames=frames), text=SHORT),
            dict(id="new", voice=v, sampling=SamplingParams(greedy=True, max_frames=frames), text=SHORT,
                 start=1)]
    out = run(eng, reqs)
    assert out["old"][2] == ("max_frames", None) and out["old"][0].shape[0] == frames
    assert out["new"][2][0] == "error" and "KV pool exhausted" in out["new"][2][1]
    baseline(eng)
    # 'reserve' never runs dry: the second waits for the first instead
    eng2 = make_engine(tiny_ckpt, num_pages=2, page_size=16, kv_policy="reserve")
    out2 = run(eng2, reqs)
    assert out2["new"][2] == ("max_frames", None) and np.array_equal(out2["old"][0], out["old"][0])
    baseline(eng2)


def test_config_beyond_the_talker_positions_is_refused(tiny_ckpt):
    """Prompt + frames past the RoPE table would read out of bounds on the GPU: refused up front."""
    positions = tiny_ckpt.config.raw["talker_config"]["max_position_embeddings"]
    cfg = EngineConfig(device="cpu", dtype="float32", num_pages=8, max_slots=1,
                       max_prompt_tokens=256, max_frames=positions, use_cuda_graphs=False)
    with pytest.raises(ValueError, match="exceeds the talker's"):
        Engine(tiny_ckpt, cfg, with_codec=False)


def test_step_phase_times_are_counted(tiny_ckpt, speaker):
    """stats(): prefill forwards and the sequences they started, decode time, queue wait (one slot: the
    second sequence waits for the first to finish)."""
    engine = make_engine(tiny_ckpt, max_slots=1)
    out = run(engine, [req("a", speaker, greedy=True, max_frames=3), req("b", speaker, greedy=True, max_frames=3)])
    s = engine.stats()
    assert s["prefill_steps"] == 2 and s["prefilled_sequences"] == 2
    assert s["decode_steps"] == sum(len(codes) for codes, _, _ in out.values()) == 6
    assert s["prefill_seconds"] > 0 and s["decode_seconds"] > 0
    # b had its prompt at step 0 and started after a's three decode steps
    assert s["queue_wait_seconds"] >= 0.25 * s["decode_seconds"]


def test_failed_add_leaves_nothing_behind(tiny_ckpt, speaker, monkeypatch):
    """Whatever add() fails on (not only EngineError), nothing of the sequence stays: its id is free
    again and the pools are at baseline."""
    engine = make_engine(tiny_ckpt)
    real = engine.inputs.builder.build

    def broken(*args, **kwargs):
        raise RuntimeError("tokenizer exploded")

    monkeypatch.setattr(engine.inputs.builder, "build", broken)
    for mode in ("whole", "incremental"):
        with pytest.raises(RuntimeError, match="exploded"):
            engine.add(f"x-{mode}", VoiceSpec(speaker=speaker, text_mode=mode), SamplingParams(), TEXT, True)
    assert not engine.scheduler.seqs and not engine.has_work()
    baseline(engine)
    monkeypatch.setattr(engine.inputs.builder, "build", real)
    out = run(engine, [req("x-whole", speaker, max_frames=2, greedy=True)])  # the id is free again
    assert out["x-whole"][2] == ("max_frames", None)
