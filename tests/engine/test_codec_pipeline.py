"""EngineConfig.codec_pipeline (engine/audio_pipeline.py): each frame's audio one step behind, on the codec's
own stream. The engine's pipelined flow (launch, land at the next step, audio collected before it returns)
runs on the CPU too, in line: every sequence's codes, pcm and end must be those of the synchronous step,
through slot reuse, finishing rows, streamed text and an abort while a frame is in flight."""

from __future__ import annotations

import dataclasses
import gc
import time

import numpy as np
import pytest
import torch

from q3tts.engine.config import EngineConfig
from q3tts.engine.cuda_graph import WAIT_POLL_S
from q3tts.engine.engine import Engine
from q3tts.models import step
from test_engine import CFG, TEXT, baseline, req, run


def _requests(speaker) -> list[dict]:
    """9 sequences through 6 slots: staggered starts, greedy and sampled, EOS-free caps of 3..12 frames,
    so slots are freed and reused while others play; one incremental-text sequence."""
    reqs = [req(f"r{i}", speaker, start=2 * i, seed=i, greedy=i % 3 == 0, max_frames=3 + i,
                text=TEXT[: 30 + 7 * i]) for i in range(8)]
    return reqs + [req("inc", speaker, start=1, mode="incremental", seed=42, max_frames=10)]


FLOWS = {"sync": dict(codec_pipeline=False), "pipelined": dict(codec_pipeline=True, steps_in_flight=1),
         "ahead": dict(codec_pipeline=True, steps_in_flight=2),  # ahead: two decode steps in flight
         "at_frames": dict(codec_pipeline=True, steps_in_flight=2, launch_at_frames=True),  # launched once made
         "in_step": dict(codec_pipeline=False, steps_in_flight=2)}  # the codec in the step, two steps in flight
PIPELINED = ["pipelined", "ahead", "at_frames", "in_step"]


@pytest.fixture(scope="module")
def engines(tiny_ckpt) -> dict[str, Engine]:
    engines = {flow: Engine(tiny_ckpt, dataclasses.replace(CFG, **kw)) for flow, kw in FLOWS.items()}
    assert not engines["in_step"].launches_ahead  # on the CPU its step is synchronous; where it is a CUDA graph
    engines["in_step"].launches_ahead = True  # it runs ahead (launched, landed later): that flow, on the CPU
    return engines


def _steps_with_pauses(engine: Engine, r: dict, pause_s: float) -> None:
    engine.add(r["id"], r["voice"], r["sampling"], r["text"], True)
    while engine.has_work():
        engine.step()
        time.sleep(pause_s)


@pytest.mark.parametrize("flow", FLOWS)
def test_step_gaps_are_the_device_idle_between_steps_while_there_is_work(engines, speaker, flow):
    """A gap per decode step after the first of a run (the caller's pause between steps is in it: on CPU the
    stamps are wall time); none across the second wait, the engine having no work then."""
    engine = engines[flow]
    before = engine.stats()
    _steps_with_pauses(engine, req("g1", speaker, seed=1, max_frames=4), 0.01)
    time.sleep(1.0)  # idle: no gap
    _steps_with_pauses(engine, req("g2", speaker, seed=2, max_frames=3), 0.01)
    after = engine.stats()
    decodes = after["decode_steps"] - before["decode_steps"]
    assert decodes == 7 and after["step_gaps"] - before["step_gaps"] == decodes - 2
    assert 5 * 0.01 <= after["step_gap_seconds"] - before["step_gap_seconds"] < 1.0
    baseline(engine)


@pytest.mark.parametrize("flow", PIPELINED)
def test_pipelined_engine_makes_the_synchronous_engines_codes_and_audio(engines, speaker, flow):
    assert engines["sync"].runner.audio is None and engines[flow].launches_ahead
    want = run(engines["sync"], _requests(speaker))
    got = run(engines[flow], _requests(speaker))
    assert sorted(got) == sorted(want)
    for rid, (codes, pcm, reason) in want.items():
        assert np.array_equal(got[rid][0], codes), rid
        assert got[rid][1].shape == pcm.shape and np.array_equal(got[rid][1], pcm), rid
        assert got[rid][2] == reason, rid
    baseline(engines[flow])


def _assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for rid, (codes, pcm, reason) in want.items():
        assert np.array_equal(got[rid][0], codes) and np.array_equal(got[rid][1], pcm), rid
        assert got[rid][2] == reason, rid


@pytest.mark.parametrize("flow", ["ahead", "at_frames", "in_step"])
def test_a_row_that_ends_at_eos_runs_once_more_and_its_frame_is_dropped(engines, speaker, monkeypatch, flow):
    """Two steps in flight: the step after a row's EOS was launched before the EOS landed; its frame is dropped,
    the slot and pages it wrote go to waiting sequences, and every sequence's codes, audio and end are the
    synchronous engine's. The EOS id is taken as a code that the sequences' first codebook makes mid-stream
    (random weights never draw the real one), so several end on it while others wait for their slots."""
    reqs = _requests(speaker)
    first = {rid: codes[:, 0] for rid, (codes, _, _) in run(engines["sync"], reqs).items()}
    counts = np.bincount(np.concatenate([c[1:] for c in first.values()]))
    eos = int(np.argmax(counts))
    ends = [rid for rid, c in first.items() if eos in c[1:]]
    assert len(ends) >= 2, f"code {eos} ends only {ends}"
    runs, rows = {}, {}
    for name in ("sync", flow):
        runner, launch = engines[name].runner, engines[name].runner.launch
        rows[name] = []
        monkeypatch.setattr(engines[name], "codec_eos_id", eos)
        monkeypatch.setattr(runner, "launch", lambda decode_rows, launch=launch, name=name: (
            rows[name].append(len(decode_rows)), launch(decode_rows))[1])
        runs[name] = run(engines[name], _requests(speaker))
        baseline(engines[name])
    assert [rid for rid, (_, _, reason) in runs["sync"].items() if reason[0] == "eos"] == ends
    _assert_same(runs[flow], runs["sync"])
    assert sum(rows[flow]) == sum(rows["sync"]) + len(ends)  # one more row for each end at EOS


def _draw_eos_at_frame_5(monkeypatch, ckpt) -> None:
    """The talker draws its real EOS id (past the codec's codebook) as c0 of frame 5 of every sequence, in the eager
    step and in graphs captured after this."""
    eos = ckpt.config.talker.codec_eos_id
    assert eos >= ckpt.codec_config.decoder.codebook_size
    advance = step.advance

    def eos_at_frame_5(talker, cache, batch, *args, **kwargs):
        c0, hidden = advance(talker, cache, batch, *args, **kwargs)  # [B], [B, H]
        return torch.where(batch.counters == 3, eos, c0), hidden  # counters: the frame the step made (0-based)

    monkeypatch.setattr(step, "advance", eos_at_frame_5)


def _ended_at_frame_5(results: dict) -> None:
    ended = {rid: len(codes) for rid, (codes, _, reason) in results.items() if reason[0] == "eos"}
    assert ended and set(ended.values()) == {4}, results  # frames 1-4 played, EOS drawn as the fifth's c0


@pytest.mark.parametrize("flow", ["ahead", "at_frames", "in_step"])
def test_a_row_that_ends_at_the_real_eos_runs_once_more_without_a_fault(engines, tiny_ckpt, speaker, monkeypatch,
                                                                        flow):
    """The real EOS id lies outside the codec's codebook, and the row that ends on it runs once more with two steps
    in flight: that step's frame (c0 = EOS) reaches the codec. An index out of the codebook there was a device-side
    assert on the H200 that took the instance down with every stream on it (served 16 streams, 2026-12-03); on the
    CPU it raised in the launch, and the step ran again synchronously. Here the talker draws the real EOS as c0 of
    frame 5 of every sequence: no step fails, and every sequence is the synchronous engine's."""
    _draw_eos_at_frame_5(monkeypatch, tiny_ckpt)
    engine, again = engines[flow], []  # steps run again synchronously after their launch raised
    monkeypatch.setattr(engine, "_decode", lambda seqs, decode=engine._decode: again.append(seqs) or decode(seqs))
    want = run(engines["sync"], _requests(speaker))
    got = run(engine, _requests(speaker))
    _assert_same(got, want)
    _ended_at_frame_5(want)
    assert not again
    baseline(engine)


@pytest.mark.parametrize("flow", PIPELINED)
def test_frames_land_at_the_next_step_with_their_audio(engines, speaker, flow):
    engine = engines[flow]
    r = req("a", speaker, greedy=True, max_frames=2)
    engine.add(r["id"], r["voice"], r["sampling"], r["text"], True)
    assert engine.step() == []  # prefill + the first frame launched
    assert engine.has_work()
    first = engine.step()  # the first frame lands, its audio attached; the second is launched
    assert [o.seq_id for o in first] == ["a"] and first[0].codes.shape == (1, 16)
    assert first[0].pcm.shape == (engine.runner.samples_per_frame,) and np.abs(first[0].pcm).sum() > 0
    assert not first[0].finished and engine.has_work()
    last = engine.step()
    assert [(o.seq_id, o.finished, o.reason) for o in last] == [("a", True, "max_frames")]
    assert last[0].pcm.shape == (engine.runner.samples_per_frame,)
    assert not engine.has_work()
    baseline(engine)


def test_abort_while_a_frame_is_in_flight(engines, speaker):
    """The aborted sequence ends once ('aborted') and its frame in flight is dropped; the other sequence's
    codes and audio are those of the synchronous engine; nothing leaks."""
    reqs = [req("keep", speaker, seed=3, max_frames=6), req("drop", speaker, seed=4, max_frames=6)]
    want = run(engines["sync"], [reqs[0]])["keep"]
    engine = engines["pipelined"]
    for r in reqs:
        engine.add(r["id"], r["voice"], r["sampling"], r["text"], True)
    outs = engine.step() + engine.step()  # the first frames land; the second ones are in flight
    engine.abort("drop")
    while engine.has_work():
        outs += engine.step()
    drop = [o for o in outs if o.seq_id == "drop"]
    assert [o.codes.shape[0] for o in drop] == [1, 0] and (drop[-1].finished, drop[-1].reason) == (True, "aborted")
    keep = [o for o in outs if o.seq_id == "keep"]
    assert np.array_equal(np.concatenate([o.codes for o in keep]), want[0])
    assert np.array_equal(np.concatenate([o.pcm for o in keep]), want[1])
    baseline(engine)


@pytest.mark.parametrize("flow", PIPELINED)
def test_calls_made_while_a_step_waits_for_its_flight(engines, speaker, flow):
    """`step(while_waiting)`: the hook runs while the step waits on the device. Pipelined, the step first waits
    for the frames in flight, before admission: a sequence added there is prefilled by that step. With two steps
    in flight the step's own decode step is launched first, so a sequence added while it waits for the frames
    starts at the next call; with `launch_at_frames` the step first waits for those frames to be made (the hook
    runs, this step admits what it adds), launches, then lands them (the hook runs again). Either way one
    aborted at the hook's first call ends once, dropping its frames in flight, and every other output is the
    synchronous engine's."""
    reqs = [req("playing", speaker, seed=3, max_frames=5), req("new", speaker, seed=5, max_frames=3),
            req("gone", speaker, seed=4, max_frames=5)]
    want = {rid: v for r in reqs[:2] for rid, v in run(engines["sync"], [r]).items()}
    engine = engines[flow]
    for r in (reqs[0], reqs[2]):
        engine.add(r["id"], r["voice"], r["sampling"], r["text"], True)
    outs = engine.step()  # prefilled, their first frames in flight
    launched = []  # at each call of the hook: the decode steps this call had launched

    def while_waiting(timeout_s):
        launched.append(engine.runner.num_decode_steps - steps)
        if len(launched) == 1:
            engine.add(reqs[1]["id"], reqs[1]["voice"], reqs[1]["sampling"], reqs[1]["text"], True)
            engine.abort("gone")

    steps = engine.runner.num_decode_steps
    outs += engine.step(while_waiting)
    assert launched == {"pipelined": [0], "ahead": [1], "at_frames": [0, 1], "in_step": [1]}[flow]
    assert engine.stats()["queued"] == (launched == [1])  # "new" started by this call, or waits for the next
    while engine.has_work():
        outs += engine.step()
    gone = [o for o in outs if o.seq_id == "gone"]
    assert [(o.codes.shape[0], o.finished, o.reason) for o in gone] == [(0, True, "aborted")]
    for rid in ("playing", "new"):
        mine = [o for o in outs if o.seq_id == rid]
        assert np.array_equal(np.concatenate([o.codes for o in mine]), want[rid][0]), rid
        assert np.array_equal(np.concatenate([o.pcm for o in mine]), want[rid][1]), rid
    baseline(engine)


class SlowCodec:
    """Stands in for the codec's done event of one launch: not reached for `polls` queries."""

    def __init__(self, polls: int):
        self.polls = polls

    def query(self) -> bool:
        self.polls -= 1
        return self.polls < 0

    def synchronize(self) -> None:
        assert self.polls < 0, "waited before the codec was done"


def test_calls_made_while_a_step_waits_for_its_audio_run_then(engines, speaker):
    """`step(while_waiting)` also runs the hook while it waits for the landed frames' audio (after the next
    step is launched): a sequence aborted there keeps the frame that landed (then ends 'aborted'); the other
    sequence's codes and audio are the synchronous engine's."""
    reqs = [req("stays", speaker, seed=3, max_frames=5), req("leaves", speaker, seed=4, max_frames=5)]
    want = run(engines["sync"], [reqs[0]])["stays"]
    engine = engines["pipelined"]
    for r in reqs:
        engine.add(r["id"], r["voice"], r["sampling"], r["text"], True)
    outs = engine.step()  # prefilled, their first frames in flight
    rows, host, _ = engine.runner.audio.pending[0]
    engine.runner.audio.pending[0] = (rows, host, SlowCodec(polls=2))  # the first frames' codec still runs
    waits = []

    def while_waiting(timeout_s):
        waits.append(timeout_s)
        if timeout_s == WAIT_POLL_S and len(waits) == 2:
            engine.abort("leaves")

    outs += engine.step(while_waiting)
    assert waits == [0.0, WAIT_POLL_S, WAIT_POLL_S]  # landing (CPU: once), then the audio, twice
    while engine.has_work():
        outs += engine.step()
    leaves = [o for o in outs if o.seq_id == "leaves"]
    assert [(o.codes.shape[0], o.finished, o.reason) for o in leaves] == [(1, False, None), (0, True, "aborted")]
    stays = [o for o in outs if o.seq_id == "stays"]
    assert np.array_equal(np.concatenate([o.codes for o in stays]), want[0])
    assert np.array_equal(np.concatenate([o.pcm for o in stays]), want[1])
    baseline(engine)


def test_codec_pipeline_setting():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert EngineConfig(steps_in_flight=1).pipelines_codec(cuda)  # default: where the step is a graph, one in flight
    assert not EngineConfig(steps_in_flight=1).pipelines_codec(cpu)
    assert not EngineConfig(steps_in_flight=1, use_cuda_graphs=False).pipelines_codec(cuda)
    assert not EngineConfig().pipelines_codec(cuda)  # two in flight (the default): the codec in the step
    assert EngineConfig(codec_pipeline=True).pipelines_codec(cpu)
    for bad in ("yes", 1):
        with pytest.raises(ValueError, match="codec_pipeline must be true, false or null"):
            EngineConfig(codec_pipeline=bad)
    for bad in (-1, 8.0, True, "64"):
        with pytest.raises(ValueError, match="codec_sms must be an int >= 0"):
            EngineConfig(codec_sms=bad)
    for bad in (0, 3, 2.0, True):
        with pytest.raises(ValueError, match="steps_in_flight must be 1 or 2"):
            EngineConfig(steps_in_flight=bad)
    with pytest.raises(ValueError, match="launch_at_frames must be true or false"):
        EngineConfig(launch_at_frames=1)
    # the pipelined codec's settings where the codec runs in the step: one error naming the setting
    for kw in (dict(), dict(codec_pipeline=False, steps_in_flight=1)):
        with pytest.raises(ValueError, match="codec_sms=16 sets the pipelined codec's SMs.*set codec_pipeline=true"):
            EngineConfig(codec_sms=16, **kw)
    for kw in (dict(), dict(codec_pipeline=False), dict(codec_pipeline=True, steps_in_flight=1)):
        with pytest.raises(ValueError, match="launch_at_frames .* needs codec_pipeline=true and steps_in_flight=2"):
            EngineConfig(launch_at_frames=True, **kw)
    assert EngineConfig(codec_sms=16, steps_in_flight=1).codec_sms == 16  # pipelined where the step is a graph
    assert EngineConfig(codec_sms=16, codec_pipeline=True, launch_at_frames=True).launch_at_frames


@pytest.mark.gpu
@pytest.mark.usefixtures("switch")  # the batch-invariance switch off at the start, restored after
@pytest.mark.parametrize("invariant", [True, False], ids=["batch_invariant", "default"])
def test_pipelined_graphs_make_the_synchronous_graphs_codes_and_audio(tiny_ckpt_dir, speaker, invariant):
    """CUDA graphs, bf16: the codec graphs one step behind (one or two steps in flight, the latter launched at
    once or once the frames are made) and the codec inside the step with two steps in flight give the codes of
    the codec inside the step with one, and its audio: bit for bit under batch_invariant (the same kernels, no
    per-engine choice); by default each engine times Triton against cuDNN per codec conv shape, so their audio
    may differ by the rounding of another conv algorithm: at most 2 bf16 steps of a sample (|pcm| <= 1)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    cfg = dataclasses.replace(CFG, device="cuda", dtype="bfloat16", use_cuda_graphs=True,
                              graph_batch_sizes=(1, 2, 4, 8), batch_invariant=invariant)
    results = {}
    for flow, kw in {"sync": dict(codec_pipeline=False, steps_in_flight=1), "pipelined": dict(steps_in_flight=1),
                     "ahead": dict(codec_pipeline=True), "at_frames": dict(codec_pipeline=True, launch_at_frames=True),
                     "in_step": {}}.items():  # the default: the codec in the step, two in flight
        engine = Engine(str(tiny_ckpt_dir), dataclasses.replace(cfg, **kw))
        assert (engine.runner.audio is None) == (flow in ("sync", "in_step")) and engine.launches_ahead
        results[flow] = run(engine, _requests(speaker))
        assert engine.runner.num_graph_replays > 0
        baseline(engine)
        del engine
    bound = 0.0 if invariant else 2 * 2.0 ** -8  # bf16 has 8 significand bits: a step is <= 2^-8 below 1
    for flow in ("pipelined", "ahead", "at_frames", "in_step"):
        for rid, (codes, pcm, reason) in results["sync"].items():
            got = results[flow][rid]
            assert np.array_equal(got[0], codes) and got[2] == reason, (flow, rid)
            worst = np.abs(got[1] - pcm).max()
            assert got[1].shape == pcm.shape and worst <= bound, f"{flow} {rid}: audio differs by up to {worst}"


@pytest.mark.gpu
@pytest.mark.usefixtures("switch")  # the batch-invariance switch off at the start, restored after
def test_rows_ending_at_the_real_eos_with_two_steps_in_flight_keep_the_device_up(tiny_ckpt_dir, tiny_ckpt, speaker,
                                                                                 monkeypatch):
    """CUDA graphs captured with the talker drawing its real EOS as c0 of frame 5: the row that ends runs once more
    with two steps in flight, and its frame (c0 = EOS, past the codebook) reaches the codec, pipelined or in the
    step. Served at 16 streams this was a device-side assert that ended the instance (2026-12-03). No device fault,
    and the codes, ends and audio of the synchronous graphs (batch_invariant: bit for bit)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    cfg = dataclasses.replace(CFG, device="cuda", dtype="bfloat16", use_cuda_graphs=True,
                              graph_batch_sizes=(1, 2, 4, 8), batch_invariant=True)
    _draw_eos_at_frame_5(monkeypatch, tiny_ckpt)  # before the engines capture their graphs
    results = {}
    for flow, kw in {"sync": dict(codec_pipeline=False, steps_in_flight=1), "ahead": dict(codec_pipeline=True),
                     "in_step": {}}.items():  # in_step: the default
        engine = Engine(str(tiny_ckpt_dir), dataclasses.replace(cfg, **kw))
        results[flow] = run(engine, _requests(speaker))
        assert engine.runner.num_graph_replays > 0
        baseline(engine)
        del engine
    _ended_at_frame_5(results["sync"])
    _assert_same(results["ahead"], results["sync"])
    _assert_same(results["in_step"], results["sync"])


@pytest.mark.gpu
def test_adding_a_request_does_not_wait_for_the_step_in_flight(tiny_ckpt_dir, speaker):
    """With CUDA graphs a decode step is in flight between step() calls: adding a request (its text tokenized,
    its prompt built on the device) must not synchronize the device, or every add waits for that step.
    torch's sync debug mode raises on any synchronizing call."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    engine = Engine(str(tiny_ckpt_dir), dataclasses.replace(
        CFG, device="cuda", dtype="bfloat16", use_cuda_graphs=True, graph_batch_sizes=(1, 2, 4, 8)))
    first, second = req("a", speaker, seed=1, max_frames=6), req("b", speaker, seed=2, max_frames=6)
    engine.add(first["id"], first["voice"], first["sampling"], first["text"], True)
    engine.step()
    engine.step()  # the first frame landed, the second is in flight
    torch.cuda.set_sync_debug_mode("error")
    try:
        engine.add(second["id"], second["voice"], second["sampling"], second["text"], True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    while engine.has_work():
        engine.step()
    baseline(engine)


@pytest.mark.gpu
def test_pushing_text_does_not_wait_for_the_step_in_flight(tiny_ckpt_dir, speaker):
    """Trailing text rows (Base ICL's text, each streamed piece) reach a slot's device queue without a host sync
    while a step is in flight; the queue and its length hold them after."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    engine = Engine(str(tiny_ckpt_dir), dataclasses.replace(
        CFG, device="cuda", dtype="bfloat16", use_cuda_graphs=True, graph_batch_sizes=(1, 2, 4, 8)))
    first = req("a", speaker, seed=1, max_frames=6)
    engine.add(first["id"], first["voice"], first["sampling"], first["text"], True)
    engine.step()
    engine.step()  # a step is in flight
    state, slot = engine.runner.state, engine.config.max_slots - 1  # a slot no sequence holds
    rows = torch.randn(3, state.text_queue.shape[-1], device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        engine.runner.push_text(slot, 2, rows)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert int(state.text_len[slot]) == 5 and torch.equal(state.text_queue[slot, 2:5], rows.to(state.text_queue.dtype))
    while engine.has_work():
        engine.step()


@pytest.mark.gpu
@pytest.mark.usefixtures("switch")  # the batch-invariance switch off at the start, restored after
def test_codec_on_a_green_context_makes_the_same_codes_and_audio(tiny_ckpt_dir, speaker):
    """EngineConfig.codec_sms: the pipelined codec's graphs captured on a stream of a green context of 16
    SMs order against the step's graphs as on a plain stream: bit for bit the codes and audio of
    codec_sms=0 (batch_invariant: the same kernels either way, whatever the SMs they run on). An engine on a
    green context is collected like any other (its context stays: a destroyed one aborted the process as
    its codec's tensors were freed) and the next engine of as many SMs takes the same context. More SMs
    than the device has is refused, naming the setting."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    cfg = dataclasses.replace(CFG, device="cuda", dtype="bfloat16", use_cuda_graphs=True, codec_pipeline=True,
                              graph_batch_sizes=(1, 2, 4, 8), batch_invariant=True)
    results, contexts = {}, []
    for sms in (0, 16, 16):
        engine = Engine(str(tiny_ckpt_dir), dataclasses.replace(cfg, codec_sms=sms))
        assert (engine.runner.audio.green is not None) == (sms > 0)
        contexts.append(engine.runner.audio.green)
        results[sms] = run(engine, _requests(speaker))
        assert engine.runner.num_graph_replays > 0
        baseline(engine)
        del engine
        gc.collect()
        torch.cuda.synchronize()
    assert contexts[1] is contexts[2]
    for rid, (codes, pcm, reason) in results[0].items():
        got = results[16][rid]
        assert np.array_equal(got[0], codes) and np.array_equal(got[1], pcm) and got[2] == reason, rid
    total = torch.cuda.get_device_properties(0).multi_processor_count
    with pytest.raises(ValueError, match=f"codec_sms={total + 1} exceeds the {total} SMs"):
        Engine(str(tiny_ckpt_dir), dataclasses.replace(cfg, codec_sms=total + 1))
