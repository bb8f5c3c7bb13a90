"""CPU unit tests (no checkpoint): EngineConfig, KVPool, SlotPool, SlotState, Scheduler, TextStream."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from q3tts.core import AdmissionRejected, InvalidRequest, SamplingParams, VoiceSpec
from q3tts.engine.config import EngineConfig
from q3tts.engine.kv_pool import KVPool, OutOfPages
from q3tts.engine.scheduler import Scheduler
from q3tts.engine.sequence import Sequence, Status
from q3tts.engine.slots import SlotPool, SlotState
from q3tts.engine.text_feed import TextFeed


def cfg(**kw) -> EngineConfig:
    base = dict(page_size=4, num_pages=16, max_slots=3, max_queue=4, max_prompt_tokens=32,
                max_frames=40, device="cpu", dtype="float32", use_cuda_graphs=False)
    base.update(kw)
    return EngineConfig(**base)


def seq(sid, prompt_len=5, max_frames=10, mode="whole", done=True) -> Sequence:
    return Sequence(sid, VoiceSpec(speaker="x"), SamplingParams(), TextFeed(mode, done=done),
                    max_frames=max_frames, prompt_len=prompt_len, prompt_ready=True)


# --- config ---------------------------------------------------------------------------------------

def test_config_validates_and_derives():
    with pytest.raises(ValueError, match="page_size"):
        EngineConfig(page_size=0)
    with pytest.raises(ValueError, match="strictly increasing"):
        EngineConfig(graph_batch_sizes=(4, 2))
    with pytest.raises(ValueError, match="kv_policy"):
        EngineConfig(kv_policy="x")
    with pytest.raises(ValueError, match="codec_kernels must be true or false"):
        cfg(codec_kernels="yes")  # e.g. `q3tts serve --pool codec_kernels=yes`: a string, not a bool
    c = EngineConfig(max_slots=5, graph_batch_sizes=(1, 2, 4, 8))
    assert c.bucket_for(3) == 4 and c.bucket_for(9) is None and c.max_graph_batch == 8
    r = c.resolve(bytes_per_page=100, free_bytes=10_000)
    assert r.num_pages == 50 and c.num_pages is None  # copy, original untouched
    assert dataclasses.replace(r, num_pages=7).num_pages == 7
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.page_size = 3  # type: ignore[misc]
    assert EngineConfig.from_dict({"graph_batch_sizes": [1, 2]}).graph_batch_sizes == (1, 2)


# --- KV pool --------------------------------------------------------------------------------------

def test_kv_pool_lease_grow_close_and_integrity():
    kv = KVPool(num_pages=6, page_size=4)
    kv.open("a", 5)                       # 2 pages
    kv.open("b", 1, reserve_tokens=12)    # 1 page + 2 promised
    assert kv.num_used == 3 and kv.num_free == 1
    with pytest.raises(OutOfPages):
        kv.open("c", 8)
    kv.grow("b", 12)                      # from the promise: nothing new needed from the free pool
    assert kv.num_free == 1 and len(kv.pages("b")) == 3 and kv.leases["b"].reserved == 0
    kv.grow("a", 12)
    assert kv.num_free == 0
    with pytest.raises(OutOfPages):
        kv.grow("a", 13)
    kv.check_integrity()
    assert kv.close("a") == 3 and kv.close("b") == 3
    assert kv.num_free == 6 and not kv.leases
    kv.check_integrity()
    kv.free_page_ids.append(0)  # corrupt: a duplicate
    with pytest.raises(RuntimeError, match="integrity"):
        kv.check_integrity()


def test_slot_pool():
    sp = SlotPool(2)
    assert sp.acquire("a") == 0 and sp.acquire("b") == 1 and sp.dummy_slot == 2
    with pytest.raises(RuntimeError):
        sp.acquire("c")
    sp.release(0)
    assert sp.acquire("c") == 0
    sp.check_integrity()


# --- scheduler ------------------------------------------------------------------------------------

def test_never_fits_and_queue_bound():
    sch = Scheduler(cfg())
    with pytest.raises(AdmissionRejected, match="max_prompt_tokens"):
        sch.add(seq("long", prompt_len=33))
    with pytest.raises(AdmissionRejected, match="KV pages"):
        sch.add(seq("big", prompt_len=30, max_frames=40))  # 70 tokens = 18 pages > 16
    for i in range(4):
        sch.add(seq(i))
    with pytest.raises(AdmissionRejected, match="queue full"):
        sch.add(seq(99))
    started, decode, victims = sch.schedule()
    assert [s.seq_id for s in started] == [0, 1, 2] and decode == started and not victims
    assert len(sch.waiting) == 1
    sch.add(seq(5))  # the queue has room again
    sch.check_integrity()


def test_finish_returns_everything():
    sch = Scheduler(cfg())
    for i in range(3):
        sch.add(seq(i))
    sch.schedule()
    for s in list(sch.running):
        sch.finish(s, "eos")
    sch.check_integrity()
    assert sch.kv.num_free == 16 and sch.slots.num_free == 3 and not sch.has_work()


def test_text_starved_sequence_waits_without_blocking_others():
    sch = Scheduler(cfg())
    inc = seq("inc", mode="incremental", done=False)  # T0 only: no trailing text yet
    sch.add(inc)
    sch.add(seq("w"))
    started, decode, _ = sch.schedule()
    assert {s.seq_id for s in started} == {"inc", "w"}
    assert [s.seq_id for s in decode] == ["w"]
    inc.feed.trailing.append(7)  # T1 arrives: frame 0 can be made
    _, decode, _ = sch.schedule()
    assert {s.seq_id for s in decode} == {"inc", "w"}
    # not-yet-prefillable sequences (no text at all) are skipped, not waited on
    empty = seq("empty", mode="incremental", done=False)
    empty.prompt_ready = False
    sch.add(empty)
    sch.add(seq("after"))
    started, _, _ = sch.schedule()
    assert [s.seq_id for s in started] == ["after"]


def test_reserve_policy_promises_pages():
    sch = Scheduler(cfg(kv_policy="reserve"))
    sch.add(seq("a", prompt_len=5, max_frames=35))   # 40 tokens = 10 pages promised
    sch.add(seq("b", prompt_len=5, max_frames=35))   # does not fit next to a
    started, _, _ = sch.schedule()
    assert [s.seq_id for s in started] == ["a"] and sch.kv.num_free == 6
    a = started[0]
    for t in range(35):  # a runs to max_frames without ever needing a free page
        a.num_frames = t
        _, decode, victims = sch.schedule()
        assert decode == [a] and not victims
    assert len(sch.kv.pages("a")) == 10
    sch.finish(a, "max_frames")
    started, _, _ = sch.schedule()
    assert [s.seq_id for s in started] == ["b"]
    sch.check_integrity()


def test_on_demand_exhaustion_aborts_newest():
    sch = Scheduler(cfg(num_pages=6))
    a, b = seq("a", prompt_len=3, max_frames=20), seq("b", prompt_len=3, max_frames=20)
    sch.add(a)
    sch.add(b)
    sch.schedule()  # each holds 1 page (prompt 3 + 1 token)
    victims = []
    for t in range(1, 20):
        for s in sch.running:
            s.num_frames = t
        _, decode, v = sch.schedule()
        victims += v
        if v:
            break
    assert [s.seq_id for s in victims] == ["b"]
    assert b.status is Status.FINISHED and b.finish_reason == "error" and "KV pool exhausted" in b.error
    assert a.status is Status.RUNNING and decode == [a]
    sch.check_integrity()
    for t in range(a.num_frames + 1, 20):
        a.num_frames = t
        _, decode, v = sch.schedule()
        assert decode == [a] and not v  # a alone fits: 3 + 20 tokens = 6 pages
    sch.finish(a, "max_frames")
    assert sch.kv.num_free == 6



def test_running_sequences_grow_before_new_ones_start():
    """A step where a running sequence needs a new page and a waiting one could take the last free page:
    the running one gets it and the newcomer waits (it is never started and aborted in the same step)."""
    sch = Scheduler(cfg(num_pages=2))
    a = seq("a", prompt_len=2, max_frames=6)  # 2 + 6 tokens: fits the 2 pages of 4
    sch.add(a)
    sch.schedule()  # a: prompt 2 + 1 token in page 0
    a.num_frames = 2  # the next step needs token 5: a second page
    b = seq("b", prompt_len=2, max_frames=6)
    sch.add(b)
    started, decode, victims = sch.schedule()
    assert (started, decode, victims) == ([], [a], [])
    assert b.status is Status.WAITING and sch.kv.num_free == 0
    sch.check_integrity()
    sch.finish(a, "max_frames")
    started, decode, victims = sch.schedule()
    assert started == [b] and decode == [b] and not victims
    sch.check_integrity()

# --- incremental tokenization ---------------------------------------------------------------------

TEXTS = ["Hello world, this is a test of the speech system.",
         "It's 12:30 and we'll be there in 45 minutes!  Really?\n\nYes.",
         "今天天气很好，我们去公园散步吧。 Bonjour le monde, comment ça va ?",
         "  indented   spaces\tand tabs... ok "]


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    from q3tts.checkpoint.tokenizer import TextTokenizer, train_tiny_tokenizer

    d = tmp_path_factory.mktemp("tok")
    train_tiny_tokenizer(d, vocab_size=400)
    return TextTokenizer.from_dir(d)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_text_stream_matches_whole_tokenization(tiny_tokenizer, text, seed):
    import random

    from q3tts.engine.text_stream import TARGET_HEAD, TARGET_TAIL, TextStream

    whole = tiny_tokenizer.encode(TARGET_HEAD + text + TARGET_TAIL)[3:-5]
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), k=min(6, len(text) - 1)))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    stream, got = TextStream(tiny_tokenizer.encode), []
    for p in pieces:
        got += stream.append(p)
        assert got == whole[:len(got)]
    got += stream.end()
    assert got == whole
    # one character at a time
    stream, got = TextStream(tiny_tokenizer.encode), []
    for ch in text:
        got += stream.append(ch)
    assert got + stream.end() == whole


def _feed(tokenizer, head=(), prompt_rows=1, max_trailing=None) -> TextFeed:
    from q3tts.engine.text_stream import TextStream

    return TextFeed("incremental", TextStream(tokenizer.encode), list(head), prompt_rows, eos_id=-7,
                    max_trailing=max_trailing)


def test_text_feed_trailing_ids(tiny_tokenizer):
    """Incremental: the track is head + text ids + tts_eos (once ended); its first prompt_rows rows are
    the prompt's, the rest trail one per frame."""
    from q3tts.engine.text_stream import TARGET_HEAD, TARGET_TAIL

    text = TEXTS[0]
    ids = tiny_tokenizer.encode(TARGET_HEAD + text + TARGET_TAIL)[3:-5]
    plain = _feed(tiny_tokenizer)
    assert not plain.is_ready and not plain.covers(0)
    plain.add(text)
    assert plain.is_ready and plain.trailing == plain.stream.ids[1:] and not plain.covers(len(plain.trailing))
    plain.add("", done=True)
    assert plain.trailing == ids[1:] + [-7] and plain.covers(len(ids) + 5)
    # Base ICL, transcript longer than the prompt's rows: ready before any text, the transcript's rest trails
    icl = _feed(tiny_tokenizer, head=[1, 2, 3, 4, 5], prompt_rows=3)
    assert icl.is_ready and icl.trailing == [] and not icl.covers(0)
    icl.add("", done=True)  # ended without text: refused when the prompt is built
    with pytest.raises(InvalidRequest, match="empty"):
        icl.prompt_text()
    icl = _feed(tiny_tokenizer, head=[1, 2, 3, 4, 5], prompt_rows=3)
    icl.add(text, done=True)
    assert icl.trailing == [4, 5] + ids + [-7]
    # transcript shorter: the first text ids fill the prompt's rows; tts_eos inside the prompt when short
    short = _feed(tiny_tokenizer, head=[1], prompt_rows=len(ids) + 2)
    short.add(text)
    assert not short.is_ready
    short.add("", done=True)
    assert short.is_ready and short.trailing == []
    with pytest.raises(InvalidRequest, match="max_text_tokens=3"):
        _feed(tiny_tokenizer, max_trailing=3).add(text, done=True)


def test_text_feed_whole_mode():
    feed = TextFeed("whole")
    feed.add("Hello ")
    assert not feed.is_ready and feed.covers(100)  # nothing trails: every frame adds E_pad
    feed.add("world.", done=True)
    assert feed.is_ready and feed.prompt_text() == "Hello world." and feed.trailing == []
    blank = TextFeed("whole")
    blank.add("  ", done=True)
    with pytest.raises(InvalidRequest, match="empty"):
        blank.prompt_text()


def test_load_sampling_writes_only_the_given_slots():
    """A batch of SamplingParams lands in its slots' rows of every parameter view; others keep theirs."""
    st = SlotState.allocate(4, hidden=8, vocab=16, queue=2, dtype=torch.float32, device="cpu")
    before = {n: getattr(st, n).clone() for n in ("temperature", "top_k", "seed", "greedy", "sub_greedy")}
    a = SamplingParams(greedy=False, temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.2,
                       subtalker_greedy=True, subtalker_temperature=0.5, subtalker_top_k=7,
                       subtalker_top_p=0.9, seed=2**40 + 3)
    b = SamplingParams(greedy=True, seed=5)
    st.load_sampling([3, 1], [a, b])
    row = lambda s: (st.temperature[s].item(), st.top_k[s].item(), st.top_p[s].item(),  # noqa: E731
                     st.repetition_penalty[s].item(), st.greedy[s].item(), st.sub_temperature[s].item(),
                     st.sub_top_k[s].item(), st.sub_top_p[s].item(), st.sub_greedy[s].item(), st.seed[s].item())
    assert row(3) == pytest.approx((0.7, 20, 0.8, 1.2, False, 0.5, 7, 0.9, True, 2**40 + 3))
    assert row(1) == pytest.approx((b.temperature, b.top_k, b.top_p, b.repetition_penalty, True,
                                    b.subtalker_temperature, b.subtalker_top_k, b.subtalker_top_p, True, 5))
    assert st.seed[3].item() == 2**40 + 3 and st.top_p[3].item() == np.float32(0.8)  # exact, not approx
    for name, old in before.items():  # slots 0, 2 and the dummy row 4 untouched
        assert torch.equal(getattr(st, name)[[0, 2, 4]], old[[0, 2, 4]]), name
