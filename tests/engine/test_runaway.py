"""The runaway guard: a request without max_frames makes at most a number of frames that follows its text
(EngineConfig.frames_per_text_token with the min_text_frames floor, never past max_frames), ends with reason
'max_frames'; an explicit max_frames wins; streamed text raises the cap as its tokens arrive."""

from __future__ import annotations

import dataclasses

import pytest

from q3tts.checkpoint.presets import GENERATION_CONFIG as RELEASED
from q3tts.core import SamplingParams, VoiceSpec
from q3tts.engine.config import EngineConfig
from q3tts.engine.engine import Engine
from q3tts.engine.sequence import Sequence
from q3tts.engine.text_feed import TextFeed

SHORT = "Hi."
LONG = "Hello world, this is a test of the speech system. The quick brown fox jumps."
# 0.5 frames per token (the tiny tokenizer splits text almost per character), floor 6: short runs
CFG = EngineConfig(device="cpu", dtype="float32", page_size=16, num_pages=64, max_slots=4, max_queue=8,
                   max_prompt_tokens=256, max_text_tokens=256, max_frames=48, frames_per_text_token=0.5,
                   min_text_frames=6, graph_batch_sizes=(8,), use_cuda_graphs=False)


def test_cap_formula_floor_and_ceiling():
    cfg = EngineConfig(device="cpu", frames_per_text_token=10.0, min_text_frames=64, max_frames=8192)
    assert [cfg.text_frame_cap(n) for n in (0, 6, 7, 100, 819, 820, 10 ** 6)] == \
        [64, 64, 70, 1000, 8190, 8192, 8192]
    assert cfg.text_frame_cap(None) == 8192  # text still open: only the engine-wide ceiling holds
    for bad in (dict(frames_per_text_token=0.0), dict(frames_per_text_token=float("nan")),
                dict(min_text_frames=0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EngineConfig(**bad)


def test_released_generation_config_leaves_the_cap_to_the_text():
    assert SamplingParams.from_generation_config(RELEASED).max_frames is None
    SamplingParams().validate()  # None is a valid max_frames
    assert SamplingParams.from_generation_config(RELEASED, max_frames=9).max_frames == 9


def test_reservation_covers_the_ceiling_while_text_may_grow():
    feed = TextFeed("incremental", done=False)
    seq = Sequence("s", VoiceSpec(speaker="x"), SamplingParams(), feed, max_frames=None,
                   text_cap=CFG.text_frame_cap)
    feed.num_tokens = 30
    assert (seq.frame_cap, seq.frames_bound) == (15, 48)
    feed.done = True
    assert (seq.frame_cap, seq.frames_bound) == (15, 15)
    fixed = Sequence("f", VoiceSpec(speaker="x"), SamplingParams(), TextFeed("incremental"), max_frames=30,
                     text_cap=CFG.text_frame_cap)
    assert (fixed.frame_cap, fixed.frames_bound) == (30, 30)


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    return Engine(tiny_ckpt, CFG)


def tokens(ckpt, text: str) -> int:
    return len(ckpt.tokenizer.encode(text))


def finish(engine: Engine, feeds: dict[int, list] | None = None) -> dict:
    """Step until idle; feeds: {step: [(id, piece or None = end)]}. Returns id -> (frames, reason)."""
    feeds, frames, reason, step = feeds or {}, {}, {}, 0
    while engine.has_work() or any(s >= step for s in feeds):
        for sid, piece in feeds.get(step, []):
            engine.append_text(sid, piece) if piece is not None else engine.end_text(sid)
        for out in engine.step():
            frames[out.seq_id] = frames.get(out.seq_id, 0) + out.codes.shape[0]
            if out.finished:
                reason[out.seq_id] = out.reason
        step += 1
        assert step < 200
    return {k: (frames[k], reason[k]) for k in frames}


def expected_cap(n_tokens: int) -> int:
    return min(48, max(6, -(-n_tokens // 2)))  # the documented rule at 0.5 frames/token, floor 6


@pytest.mark.parametrize("mode", ["whole", "incremental"])
def test_default_cap_follows_the_text(engine, tiny_ckpt, speaker, mode):
    greedy = SamplingParams(greedy=True)
    for sid, text in (("short", SHORT), ("long", LONG)):
        engine.add(f"{sid}-{mode}", VoiceSpec(speaker=speaker, text_mode=mode), greedy, text, True)
    got = finish(engine)
    n_short, n_long = tokens(tiny_ckpt, SHORT), tokens(tiny_ckpt, LONG)
    assert expected_cap(n_short) == 6 < expected_cap(n_long) < 48  # the floor, then the rule, below the ceiling
    assert got[f"short-{mode}"] == (6, "max_frames")
    assert got[f"long-{mode}"] == (expected_cap(n_long), "max_frames")


def test_explicit_max_frames_wins(engine, speaker):
    voice = VoiceSpec(speaker=speaker)
    engine.add("above", voice, SamplingParams(greedy=True, max_frames=20), SHORT, True)  # guard: 6
    engine.add("below", voice, SamplingParams(greedy=True, max_frames=3), LONG, True)
    assert finish(engine) == {"above": (20, "max_frames"), "below": (3, "max_frames")}


def test_streamed_text_raises_the_cap(engine, tiny_ckpt, speaker):
    words = LONG.split(" ")
    pieces = [w + " " for w in words[:-1]] + [words[-1]]
    engine.add("s", VoiceSpec(speaker=speaker, text_mode="incremental"), SamplingParams(greedy=True),
               pieces[0], False)
    feeds = {i: [("s", p)] for i, p in enumerate(pieces[1:])}
    feeds[len(pieces)] = [("s", None)]
    frames, reason = finish(engine, feeds)["s"]
    first = expected_cap(tokens(tiny_ckpt, pieces[0]))
    assert (frames, reason) == (expected_cap(tokens(tiny_ckpt, LONG)), "max_frames") and frames > first
