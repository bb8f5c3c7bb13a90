"""Deadline scheduling (scheduler.py, 2.) on a modelled clock: a step's time is `StepCost` (decode step +
prefill rows), a stream plays in real time (80 ms a frame) from its first frame. With max_step_seconds set,
32 arrivals are admitted while 4 streams play, and no playing stream waits longer than the bound for a frame
or runs dry; without it the same arrivals stall the players."""

from __future__ import annotations

import pytest

from q3tts.core import SamplingParams, VoiceSpec
from q3tts.engine.config import EngineConfig
from q3tts.engine.scheduler import Scheduler, StepCost
from q3tts.engine.sequence import FRAME_SECONDS, Sequence
from q3tts.engine.text_feed import TextFeed

BOUND = 0.05
PROMPT = 60
COST = dict(decode_s=0.010, prefill_s_per_row=0.0005, weight=0.0)  # a 60-row prompt: 30 ms; 32 of them: 0.96 s


def config(max_step_seconds):
    return EngineConfig(page_size=16, num_pages=4096, max_slots=40, max_queue=64, max_prompt_tokens=128,
                        max_frames=200, max_step_seconds=max_step_seconds, device="cpu", dtype="float32",
                        use_cuda_graphs=False)


def seq(sid, frames, now) -> Sequence:
    return Sequence(sid, VoiceSpec(speaker="x"), SamplingParams(), TextFeed("whole", done=True), max_frames=frames,
                    prompt_len=PROMPT, prompt_ready=True, ready_at=now)


def simulate(max_step_seconds, players=4, arrivals=lambda now: [seq(f"a{i}", 12, now) for i in range(32)]):
    """`players` players start; once they play (step 5), `arrivals(now)` (default: 32) come at once.
    Returns ({id: [frame times]}, step times, [(id, piece_start, piece) of every prefill, in order])."""
    sch = Scheduler(config(max_step_seconds))
    sch.cost = StepCost(**COST)
    now, frames, steps, pieces = 0.0, {}, [], []
    for i in range(players):
        sch.add(seq(f"p{i}", 60, now))
    while sch.has_work():
        if len(steps) == 5:  # the players have made a few frames and play
            for arrival in arrivals(now):
                sch.add(arrival)
        started, decode, victims = sch.schedule(now)
        assert not victims
        pieces += [(s.seq_id, s.piece_start, s.piece) for s in started]
        step = sch.cost.step_seconds(sum(s.piece for s in started))
        now += step
        steps.append(step)
        for s in decode:
            s.num_frames += 1
            frames.setdefault(s.seq_id, []).append(now)
            if s.num_frames == s.frame_cap:
                sch.finish(s, "max_frames")
                sch.forget(s.seq_id)
        assert len(steps) < 2000
    sch.check_integrity()
    return frames, steps, pieces


def underruns(times: list[float]) -> int:
    """Frames that came after the client, playing from the first frame in real time, had played all before."""
    return sum(t > times[0] + k * FRAME_SECONDS + 1e-9 for k, t in enumerate(times))


def test_playing_streams_are_protected_while_32_arrive():
    frames, steps, _ = simulate(BOUND)
    assert len(frames) == 36 and all(len(frames[f"a{i}"]) == 12 for i in range(32))  # every arrival served
    for sid, times in frames.items():
        gaps = [b - a for a, b in zip(times, times[1:])]
        assert max(gaps) <= BOUND + 1e-9, (sid, max(gaps))
        assert underruns(times) == 0, sid
    assert max(steps[1:]) <= BOUND + 1e-9  # only the very first step (nobody playing yet) may be longer


def test_without_the_bound_the_arrivals_stall_the_players():
    frames, steps, _ = simulate(None)
    assert max(steps) > 0.9  # the step that prefills all 32 at once
    assert all(underruns(frames[f"p{i}"]) > 0 for i in range(4))


def test_earliest_ready_starts_first_and_the_slack_holds_the_rest():
    sch = Scheduler(config(1.0))
    sch.cost = StepCost(decode_s=0.010, prefill_s_per_row=0.001, weight=0.0)  # a 60-row prompt: 60 ms
    player = seq("player", 100, 0.0)
    sch.add(player)
    sch.schedule(0.0)
    player.num_frames = 1
    late, early = seq("late", 5, 0.9), seq("early", 5, 0.5)  # added in this order, ready in the other
    sch.add(late)
    sch.add(early)
    started, _, _ = sch.schedule(1.0)  # plays from now: 80 ms of audio - 10 ms decode = room for one prefill
    assert [s.seq_id for s in started] == ["early"]
    started, _, _ = sch.schedule(1.05)  # 30 ms before it runs dry: no prefill fits
    assert started == []
    player.num_frames = 10
    started, _, _ = sch.schedule(1.1)
    assert [s.seq_id for s in started] == ["late"]


def test_step_cost_follows_measurements():
    cost = StepCost(weight=0.5)
    cost.observe(0, None, 0.02)
    cost.observe(100, 0.01, 0.04)
    assert (cost.decode_s, cost.prefill_s_per_row) == pytest.approx((0.025, 0.00005))
    assert cost.step_seconds(10) == pytest.approx(0.0255)
