"""Chunked prefill (scheduler.py, 2.): a prompt that does not fit a step's prefill budget is prefilled in
pieces over several steps, each piece attending to the earlier pieces' K/V in the paged cache, while the
playing streams keep stepping; the sequence makes its first frame in the step of its last piece. The
pieces give what the whole prompt gives (model level: hidden, logits and KV within fp32 rounding; engine
level: the same greedy codes), and an abort between pieces returns the pages and the slot."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from q3tts.core import SamplingParams, VoiceSpec
from q3tts.models import step
from q3tts.models.attention import PagedKVCache
from q3tts.models.prompt import PromptBuilder
from q3tts.models.sampling import SamplingTensors, uniforms
from q3tts.models.tts_model import Qwen3TTS

from test_engine import CFG, TEXT, make_engine
from test_scheduling import BOUND, seq, simulate, underruns

LONG = TEXT * 2  # a prompt of a little over 60 rows
BUDGET = 16      # max_prefill_tokens of the chunking engines: the long prompt takes 4+ pieces


@pytest.fixture
def prefill_calls(monkeypatch):
    """The (seq_lens, piece starts) of every `step.prefill_batch` call the runner makes."""
    calls: list[tuple[list[int], list[int]]] = []
    real = step.prefill_batch

    def spy(talker, cache, embeds, seq_lens, *args, prefixes=None, **kw):
        starts = [0 if p is None else p.shape[0] for p in prefixes] if prefixes else [0] * len(seq_lens)
        calls.append((list(seq_lens), starts))
        return real(talker, cache, embeds, seq_lens, *args, prefixes=prefixes, **kw)

    monkeypatch.setattr(step, "prefill_batch", spy)
    return calls


def first_codes(engine, requests: list[dict]) -> dict:
    """Runs the requests (added at once) to the end: id -> (codes [F, 16], step index of each frame)."""
    for r in requests:
        engine.add(r["id"], r["voice"], r["sampling"], r["text"], True)
    codes: dict = {r["id"]: [] for r in requests}
    steps: dict = {r["id"]: [] for r in requests}
    n = 0
    while engine.has_work():
        for out in engine.step():
            if len(out.codes):
                codes[out.seq_id].append(out.codes)
                steps[out.seq_id].append(n)
        n += 1
        assert n < 500
    engine.check_integrity()
    return {k: (np.concatenate(v), steps[k]) for k, v in codes.items()}


def test_a_prompt_past_the_step_bound_is_chunked_while_streams_play():
    """Modelled clock (as tests/engine/test_scheduling.py): a 120-row prompt, whose prefill alone would
    take longer than max_step_seconds, arrives while two streams play; it is prefilled in pieces of at
    most the rows the bound leaves, every step stays within the bound and no player runs dry. The 60-row
    prompt behind it (one a step can take whole) does not overtake it and is prefilled whole."""
    def arrivals(now):  # a step may prefill (50 - 10 ms decode) / 0.5 ms = 80 rows at most
        long = seq("long", 3, now)
        long.prompt_len = 120
        return [long, seq("short", 3, now + 1e-3)]

    frames, steps, pieces = simulate(BOUND, players=2, arrivals=arrivals)
    long_pieces = [(a, n) for sid, a, n in pieces if sid == "long"]
    assert len(long_pieces) >= 2 and all(n <= 80 for _, n in long_pieces)
    assert [a for a, _ in long_pieces] == list(np.cumsum([0] + [n for _, n in long_pieces])[:-1])
    assert sum(n for _, n in long_pieces) == 120
    assert [n for sid, _, n in pieces if sid == "short"] == [60]  # whole, after the long one's last piece
    assert pieces.index(("short", 0, 60)) > pieces.index(("long", *long_pieces[-1]))
    assert max(steps[1:]) <= BOUND + 1e-9
    for sid in ("p0", "p1"):
        times = frames[sid]
        assert max(b - a for a, b in zip(times, times[1:])) <= BOUND + 1e-9 and underruns(times) == 0


def test_pieces_equal_the_whole_prompt_model_level(tiny_ckpt):
    """One prompt prefilled whole vs in three pieces (the second piece sharing its forward with another
    sequence's whole prompt): same first c0, and hidden, logits and KV within fp32 rounding."""
    model = Qwen3TTS.from_checkpoint(tiny_ckpt)
    talker, lc = model.talker, model.config.talker.layers
    spk = sorted(tiny_ckpt.config.talker.speaker_ids)
    builder = PromptBuilder(model, tiny_ckpt.tokenizer)
    x = builder.build(LONG, VoiceSpec(speaker=spk[0])).prefill  # [L, H]
    other = builder.build(TEXT[:20], VoiceSpec(speaker=spk[1])).prefill
    n, page = x.shape[0], 16
    assert 50 < n <= 10 * page
    one, two = (SamplingTensors.talker([SamplingParams(greedy=True)] * k) for k in (1, 2))
    seeds = torch.zeros(2, dtype=torch.int64)

    def cache():
        return PagedKVCache(lc.num_layers, 16, page, lc.num_kv_heads, lc.head_dim, torch.float32)

    # the sequence's pages are not in order (as the pool hands them out)
    pages = torch.tensor([9, 2, 7, 4, 5, 11, 0, 3, 10, 1])
    slots = pages[torch.arange(n) // page] * page + torch.arange(n) % page
    whole = cache()
    c0, hidden = step.prefill_batch(talker, whole, x, [n], slots, one, seeds[:1], uniforms)
    chunked = cache()
    cuts = [0, 21, 45, n]
    other_slots = 13 * page + torch.arange(other.shape[0])
    for a, b in zip(cuts, cuts[1:]):
        prefix = slots[:a] if a else None
        if a == 21:  # with a whole prompt in the same forward
            c0_p, hidden_p = step.prefill_batch(
                talker, chunked, torch.cat((x[a:b], other)), [b - a, other.shape[0]],
                torch.cat((slots[a:b], other_slots)), two, seeds, uniforms, prefixes=[prefix, None])
        else:
            c0_p, hidden_p = step.prefill_batch(talker, chunked, x[a:b], [b - a], slots[a:b], one,
                                                seeds[:1], uniforms, prefixes=[prefix])
    assert torch.equal(c0_p[:1], c0[:1])
    torch.testing.assert_close(hidden_p[:1], hidden[:1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(talker.logits(hidden_p[:1]), talker.logits(hidden[:1]), rtol=1e-5, atol=1e-5)
    used = pages.tolist()
    torch.testing.assert_close(chunked.k[:, used], whole.k[:, used], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked.v[:, used], whole.v[:, used], rtol=1e-5, atol=1e-5)


def test_long_prompt_is_chunked_while_a_stream_plays(tiny_ckpt, prefill_calls, speaker):
    """A long prompt arriving while a stream plays is prefilled in pieces of <= max_prefill_tokens rows,
    one step each; the playing stream makes a frame in every step meanwhile."""
    eng = make_engine(tiny_ckpt, max_prefill_tokens=BUDGET)
    short = TEXT[:2]
    n_short = eng.inputs.builder.build(short, VoiceSpec(speaker=speaker)).prefill.shape[0]
    n_long = eng.inputs.builder.build(LONG, VoiceSpec(speaker=speaker)).prefill.shape[0]
    assert n_short <= BUDGET < 3 * BUDGET < n_long
    eng.add("player", VoiceSpec(speaker=speaker), SamplingParams(greedy=True, max_frames=30), short, True)
    frames = {"player": [], "long": []}
    for n in range(40):
        if n == 2:
            eng.add("long", VoiceSpec(speaker=speaker), SamplingParams(greedy=True, max_frames=3), LONG, True)
        for out in eng.step():
            if len(out.codes):
                frames[out.seq_id].append(n)
        if not eng.has_work():
            break
    assert prefill_calls[0] == ([n_short], [0])
    pieces = prefill_calls[1:]
    expect = [([min(BUDGET, n_long - a)], [a]) for a in range(0, n_long, BUDGET)]
    assert pieces == expect  # every row once, in order, each step within the budget
    chunk_steps = range(2, 2 + len(expect))
    assert frames["long"][0] == chunk_steps[-1]  # its first frame: in the step of its last piece
    assert set(chunk_steps) <= set(frames["player"])  # the player stepped through every piece
    assert frames["player"] == list(range(30))  # one frame a step from the first to the last
    eng.check_integrity()


@pytest.mark.parametrize("budget", [BUDGET, 7])
def test_chunked_equals_whole_greedy(tiny_ckpt, speaker, budget):
    """The codes (and audio) of a chunked prompt equal those of the same prompt prefilled whole."""
    voice = VoiceSpec(speaker=speaker)
    reqs = [dict(id="long", voice=voice, text=LONG, sampling=SamplingParams(greedy=True, max_frames=12))]
    whole = first_codes(make_engine(tiny_ckpt), reqs)["long"][0]
    chunked = first_codes(make_engine(tiny_ckpt, max_prefill_tokens=budget), reqs)["long"][0]
    assert len(whole) == 12 and np.array_equal(chunked, whole)


def test_chunked_equals_whole_base_icl(tmp_path_factory):
    """Base ICL with a long reference (the motivating case: hundreds of prompt rows on a real voice):
    chunked == whole, greedy, the primed codec stream loaded with the last piece."""
    from q3tts.checkpoint.loader import load_checkpoint
    from q3tts.checkpoint.maker import make_checkpoint
    from q3tts.engine.engine import Engine

    ckpt = load_checkpoint(make_checkpoint(tmp_path_factory.mktemp("base") / "b", "base", "1.7b", "tiny",
                                           seed=3), dtype=torch.float32)
    rng = np.random.default_rng(0)
    voice = VoiceSpec(ref_codes=rng.integers(0, 2048, (40, 16)), ref_text="A reference of some length.",
                      xvector=rng.standard_normal(ckpt.config.talker.hidden_size).astype(np.float32))
    reqs = [dict(id="icl", voice=voice, text=TEXT[:40], sampling=SamplingParams(greedy=True, max_frames=8))]
    whole = first_codes(Engine(ckpt, CFG), reqs)["icl"][0]
    eng = Engine(ckpt, dataclasses.replace(CFG, max_prefill_tokens=BUDGET))
    chunked, steps = first_codes(eng, reqs)["icl"]
    assert steps[0] >= 2, "the prompt took several pieces"
    assert len(whole) == 8 and np.array_equal(chunked, whole)


def test_abort_between_pieces_frees_pages_and_slot(tiny_ckpt, speaker):
    eng = make_engine(tiny_ckpt, max_prefill_tokens=BUDGET)
    free_pages, free_slots = eng.scheduler.kv.num_free, eng.scheduler.slots.num_free
    eng.add("long", VoiceSpec(speaker=speaker), SamplingParams(greedy=True, max_frames=3), LONG, True)
    assert eng.step() == []  # the first piece: no frame yet
    seq = eng.scheduler.seqs["long"]
    assert 0 < seq.prefilled < seq.prompt_len and seq.slot >= 0
    assert eng.scheduler.kv.num_free < free_pages and eng.scheduler.slots.num_free == free_slots - 1
    eng.abort("long")
    assert (eng.scheduler.kv.num_free, eng.scheduler.slots.num_free) == (free_pages, free_slots)
    eng.check_integrity()
    outs = eng.step()
    assert [(o.seq_id, o.finished, o.reason, len(o.codes)) for o in outs] == [("long", True, "aborted", 0)]
    assert not eng.has_work()
    # the freed slot and pages serve the next request, which gets what it gets on a fresh engine
    req = [dict(id="next", voice=VoiceSpec(speaker=speaker), text=LONG,
                sampling=SamplingParams(greedy=True, max_frames=4))]
    assert np.array_equal(first_codes(eng, req)["next"][0],
                          first_codes(make_engine(tiny_ckpt, max_prefill_tokens=BUDGET), req)["next"][0])


def test_chunked_through_packed_prefill_equals_whole(tiny_ckpt, speaker, monkeypatch):
    """CPU engine whose runner prefills through PrefillGraphs (eagerly, as on CUDA before capture): the
    pieces (the last one sharing its forward with a whole prompt) give the codes and audio of the
    whole prompts on today's eager path."""
    voice = VoiceSpec(speaker=speaker)
    reqs = [dict(id="long", voice=voice, text=LONG, sampling=SamplingParams(greedy=True, max_frames=8)),
            dict(id="short", voice=voice, text=TEXT[:2], sampling=SamplingParams(seed=3, max_frames=6))]
    whole = first_codes(make_engine(tiny_ckpt), reqs)
    eng = make_engine(tiny_ckpt, max_prefill_tokens=BUDGET)
    eng.runner.prefill_graphs = eng.runner.packed_prefill()
    monkeypatch.setattr(step, "prefill_batch", None)  # the eager path is not taken
    got = first_codes(eng, reqs)
    assert got["long"][1][0] >= 3, "the long prompt took several pieces"
    for r in reqs:
        assert np.array_equal(got[r["id"]][0], whole[r["id"]][0]), r["id"]


def packed_piece_vs_eager(ckpt, device: str):
    """One prompt prefilled as a first piece then a second piece (sharing its forward with a whole
    prompt), through PrefillGraphs and through the eager `prefill_batch`: their (c0, hidden, cache)."""
    from q3tts.engine.prefill_graph import PrefillGraphs

    model = Qwen3TTS.from_checkpoint(ckpt).to(device)
    talker, lc = model.talker.fuse_(), model.config.talker.layers
    spk = sorted(ckpt.config.talker.speaker_ids)
    builder = PromptBuilder(model, ckpt.tokenizer)
    x = builder.build(LONG, VoiceSpec(speaker=spk[0])).prefill.to(device)  # [L, H]
    other = builder.build(TEXT[:20], VoiceSpec(speaker=spk[1])).prefill.to(device)
    page, pages = 16, [9, 2, 7, 4, 5, 11, 0, 3, 10, 1]
    n, cut = x.shape[0], 37
    slots = torch.tensor(pages)[torch.arange(n) // page] * page + torch.arange(n) % page
    other_slots = 13 * page + torch.arange(other.shape[0])
    params = SamplingTensors.talker([SamplingParams(greedy=True)] * 2, device)
    seeds = torch.zeros(2, dtype=torch.int64, device=device)

    def cache():
        return PagedKVCache(lc.num_layers, 16, page, lc.num_kv_heads, lc.head_dim, torch.float32, device)

    eager_cache = cache()
    step.prefill_batch(talker, eager_cache, x[:cut], [cut], slots[:cut].to(device), params, seeds, uniforms)
    eager = step.prefill_batch(talker, eager_cache, torch.cat((x[cut:], other)), [n - cut, other.shape[0]],
                               torch.cat((slots[cut:], other_slots)).to(device), params, seeds, uniforms,
                               prefixes=[slots[:cut].to(device), None])
    graphs = PrefillGraphs(talker, cache(), lambda sl: (params, seeds), uniforms, 2, 1, (128,), torch.float32,
                           torch.device(device), max_prefix_pages=10)
    if device == "cuda":
        graphs.capture()
    graphs.run([x[:cut]], slots[:cut].numpy(), [0])
    c0, hidden = graphs.run([x[cut:], other], torch.cat((slots[cut:], other_slots)).numpy(), [0, 0],
                            (cut, pages))
    return (eager[0][:2], eager[1][:2], eager_cache), (c0.clone(), hidden.clone(), graphs.cache), graphs


def test_packed_piece_equals_eager_piece(tiny_ckpt):
    """CPU: the packed forward of a piece after 37 cached rows (the kernel's torch reference) gives the
    eager piece's c0, hidden and KV bit for bit."""
    (c0, hidden, cache), (c0_p, hidden_p, cache_p), _ = packed_piece_vs_eager(tiny_ckpt, "cpu")
    assert torch.equal(c0_p, c0) and torch.equal(hidden_p, hidden)
    assert torch.equal(cache_p.k, cache.k) and torch.equal(cache_p.v, cache.v)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_piece_equals_eager_piece(tiny_ckpt):
    """fp32 on the GPU: a piece after 37 cached rows through the captured prefill graph (Triton attention
    over the paged prefix) vs the eager piece: the same c0, hidden and KV up to rounding."""
    (c0, hidden, cache), (c0_p, hidden_p, cache_p), graphs = packed_piece_vs_eager(tiny_ckpt, "cuda")
    assert graphs.num_replays == 2
    assert torch.equal(c0_p, c0)
    torch.testing.assert_close(hidden_p, hidden, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(cache_p.k, cache.k, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(cache_p.v, cache.v, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_chunked_equals_whole(tiny_ckpt, speaker):
    """fp32 CUDA engines with prefill graphs: the long prompt whole (one replay) vs in pieces (one replay
    a piece, each over its prompt's earlier pieces in the paged KV): the same first frame."""
    from q3tts.engine.config import EngineConfig
    from q3tts.engine.engine import Engine

    cfg = EngineConfig(device="cuda", dtype="float32", num_pages=256, max_slots=8, max_frames=64,
                       max_prompt_tokens=256, max_text_tokens=128, graph_batch_sizes=(1, 2, 4, 8))
    reqs = [dict(id="long", voice=VoiceSpec(speaker=speaker), text=LONG,
                 sampling=SamplingParams(greedy=True, max_frames=3))]
    whole_engine = Engine(tiny_ckpt, cfg)
    whole = first_codes(whole_engine, reqs)["long"][0]
    assert whole_engine.runner.prefill_graphs.num_replays == 1
    engine = Engine(tiny_ckpt, dataclasses.replace(cfg, max_prefill_tokens=BUDGET))
    chunked, _ = first_codes(engine, reqs)["long"]
    rows = engine.inputs.builder.build(LONG, VoiceSpec(speaker=speaker)).prefill.shape[0]
    # a replay a piece (not counted from the first frame's step: two steps in flight emit it a step later)
    assert engine.runner.prefill_graphs.num_replays == -(-rows // BUDGET) >= 3
    assert np.array_equal(chunked[:1], whole[:1])
