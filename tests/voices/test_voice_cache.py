"""The engine's voice cache (engine/voice_cache.py): a Base voice is uploaded and its codec stream primed once,
on the reference worker, never on the engine thread; the bound is device bytes (least recently used out);
a replaced voice file is never served stale; a cached voice speaks bit for bit like the same arrays sent
uncached; the counts and bytes show in `Engine.stats()`."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from q3tts.codec.streaming import StreamingDecoder
from q3tts.core import SamplingParams, VoiceSpec
from q3tts.engine.batch import BatchRequest, run_requests
from q3tts.engine.config import EngineConfig
from q3tts.engine.engine import Engine
from q3tts.engine.voice_cache import PreparedVoice, VoiceCache
from q3tts.models.prompt import PromptBuilder, VoiceTensors
from q3tts.voices.cache import VoiceFiles
from q3tts.voices.store import Family, Voice

TEXT = "A kept voice speaks."
GREEDY = SamplingParams(greedy=True, max_frames=10)


def make_engine(ckpt, **overrides) -> Engine:
    settings = dict(device="cpu", dtype="float32", max_slots=4, use_cuda_graphs=False) | overrides
    return Engine.from_checkpoint(str(ckpt), EngineConfig(**settings))


@pytest.fixture(scope="module")
def engine(base_ckpt):
    return make_engine(base_ckpt)


@pytest.fixture(scope="module")
def uncached(base_ckpt):
    return make_engine(base_ckpt, voice_cache_bytes=0)


def synthetic(engine, name: str, seed: int, frames: int = 6) -> Voice:
    """An ICL voice of random (valid) content for the engine's checkpoint."""
    family = Family.of(engine.checkpoint.config)
    rng = np.random.default_rng(seed)
    codebook = engine.checkpoint.config.talker.codebook_size
    return Voice(name, family, rng.standard_normal(family.xvector_dim).astype(np.float32),
                 rng.integers(0, codebook, (frames, 16)).astype(np.int64), "the reference words")


def speak(engine, voices: list[VoiceSpec]) -> list[np.ndarray]:
    """Codes of one greedy request per voice, all submitted at once."""
    requests = [BatchRequest(f"r{i}", TEXT, voice, GREEDY) for i, voice in enumerate(voices)]
    results = run_requests(engine, requests, write=False)
    for r in requests:
        assert results[r.seq_id].reason in ("eos", "max_frames"), results[r.seq_id].error
    return [results[r.seq_id].codes for r in requests]


def counting(monkeypatch, cls, name: str) -> list[str]:
    """Wrap cls.name so that each call records the calling thread's name."""
    calls, original = [], getattr(cls, name)

    def wrapper(*args, **kwargs):
        calls.append(threading.current_thread().name)
        return original(*args, **kwargs)

    monkeypatch.setattr(cls, name, wrapper)
    return calls


def test_one_upload_and_one_priming_per_voice_off_the_engine_thread(engine, monkeypatch):
    voice = synthetic(engine, "once", seed=1).spec()
    before = engine.voices.stats()
    primed = counting(monkeypatch, StreamingDecoder, "prime_state")
    uploaded = counting(monkeypatch, PromptBuilder, "voice_tensors")
    together = speak(engine, [voice] * 3)  # all three miss at add: the worker prepares the first only
    later = speak(engine, [voice] * 2)  # hits at add: admitted at once
    assert primed == ["q3tts-reference"] and uploaded == ["q3tts-reference"]
    after = engine.voices.stats()
    assert after["voice_cache_misses"] - before["voice_cache_misses"] == 1
    assert after["voice_cache_hits"] - before["voice_cache_hits"] == 4
    for codes in together[1:] + later:
        np.testing.assert_array_equal(codes, together[0])


def test_cached_voice_equals_the_same_arrays_uncached(engine, uncached):
    assert_cached_equals_uncached(engine, uncached)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cached_voice_equals_uncached_on_cuda(base_ckpt, monkeypatch):
    """On CUDA (bfloat16, graphs): the kept state was primed on the worker's own stream and is copied by
    the engine's; the voice's tensors were made on the worker thread."""
    settings = dict(device="cuda", dtype="bfloat16", use_cuda_graphs=True, graph_batch_sizes=(1, 2, 4))
    primed = counting(monkeypatch, StreamingDecoder, "prime_state")
    assert_cached_equals_uncached(make_engine(base_ckpt, **settings),
                                  make_engine(base_ckpt, voice_cache_bytes=0, **settings))
    assert set(primed) == {"q3tts-reference"}


def assert_cached_equals_uncached(engine, uncached):
    voice = synthetic(engine, "same", seed=2)
    speak(engine, [voice.spec()])  # now kept
    hits = engine.voices.stats()["voice_cache_hits"]
    as_arrays = VoiceSpec(ref_codes=voice.ref_codes.copy(), xvector=voice.xvector.copy(), ref_text=voice.ref_text)
    [cached] = speak(engine, [as_arrays])
    assert engine.voices.stats()["voice_cache_hits"] == hits + 1  # same content, other objects: the entry
    [fresh] = speak(uncached, [voice.spec()])
    assert uncached.voices.stats()["voice_cache_entries"] == 0
    assert cached.shape[0] > 0
    np.testing.assert_array_equal(cached, fresh)


def test_replaced_voice_file_is_not_served_stale(engine, uncached, store):
    files = VoiceFiles(store, Family.of(engine.checkpoint.config))
    old, new = synthetic(engine, "kim", seed=3), synthetic(engine, "kim", seed=4, frames=9)
    store.add(old)
    [first] = speak(engine, [files.resolve("kim").spec()])
    store.remove("kim")
    store.add(new)
    [second] = speak(engine, [files.resolve("kim").spec()])
    [expected] = speak(uncached, [new.spec()])
    np.testing.assert_array_equal(second, expected)
    assert not np.array_equal(first, second)


def test_stats_show_the_bytes_kept(base_ckpt):
    engine = make_engine(base_ckpt)
    voices = [synthetic(engine, f"v{i}", seed=10 + i) for i in range(2)]
    speak(engine, [v.spec() for v in voices] + [voices[0].spec(xvector_only=True)])
    kept = [engine.voices.get(v.spec()) for v in voices] + [engine.voices.get(voices[0].spec(xvector_only=True))]
    stats = engine.stats()
    assert stats["voice_cache_entries"] == 3 and stats["voice_cache_misses"] == 3
    assert stats["voice_cache_bytes"] == sum(p.nbytes for p in kept) > 0
    assert stats["voice_cache_capacity_bytes"] == EngineConfig().voice_cache_bytes
    assert kept[2].codec_state is None and kept[0].codec_state is not None  # x-vector only: nothing to prime


# --- the cache alone -------------------------------------------------------------------------------------------

def xvector_voice(seed: int, dim: int = 100) -> VoiceSpec:
    return VoiceSpec(xvector=np.random.default_rng(seed).standard_normal(dim).astype(np.float32),
                     xvector_only=True)


def prepare(voice: VoiceSpec) -> PreparedVoice:
    return PreparedVoice(VoiceTensors(torch.as_tensor(voice.xvector).clone(), None, None), None)  # 400 bytes


def test_byte_bound_evicts_the_least_recently_used():
    cache = VoiceCache(1000, prepare)
    a, b, c = (xvector_voice(s) for s in range(3))
    for voice in (a, b):
        cache.get_or_prepare(voice)
    assert cache.get(a) is not None  # a is now the most recently used
    cache.get_or_prepare(c)  # 1200 bytes > 1000: b goes
    assert cache.get(b) is None and cache.get(a) is not None and cache.get(c) is not None
    assert cache.stats() == {"voice_cache_entries": 2, "voice_cache_bytes": 800,
                             "voice_cache_capacity_bytes": 1000, "voice_cache_hits": 3, "voice_cache_misses": 3}


def test_a_voice_larger_than_the_bound_is_used_not_kept():
    cache = VoiceCache(300, prepare)
    voice = xvector_voice(0)
    assert cache.get_or_prepare(voice).nbytes == 400
    assert cache.get(voice) is None and cache.stats()["voice_cache_bytes"] == 0


def test_key_covers_what_the_prepared_voice_is_made_from():
    cache = VoiceCache(1 << 20, prepare)
    xv, codes = xvector_voice(0).xvector, np.zeros((3, 16), np.int64)
    icl = VoiceSpec(xvector=xv, ref_codes=codes, ref_text="words")
    cache.get_or_prepare(icl)
    assert cache.get(VoiceSpec(xvector=xv.copy(), ref_codes=codes.copy(), ref_text="words")) is not None
    assert cache.get(VoiceSpec(xvector=xv, ref_codes=codes, ref_text="other words")) is None
    assert cache.get(VoiceSpec(xvector=xv, ref_codes=codes + 1, ref_text="words")) is None
    assert cache.get(VoiceSpec(xvector=xv.astype(np.float64), ref_codes=codes, ref_text="words")) is None
    assert cache.get(VoiceSpec(xvector=xv, xvector_only=True)) is None  # no ICL part: another entry
    assert cache.get(VoiceSpec(speaker="ryan")) is None and not cache.keeps(VoiceSpec(speaker="ryan"))
