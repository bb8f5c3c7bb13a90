"""Batched (ragged) prefill: the sequences started in one step share one talker forward, and each gets
exactly the codes (and audio) it gets alone; `max_prefill_tokens` caps the rows of one step."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from q3tts.core import SamplingParams, VoiceSpec
from q3tts.engine.config import EngineConfig
from q3tts.engine.engine import Engine
from q3tts.models import attention, step
from q3tts.models.attention import PagedKVCache, PrefillContext, causal_attention

from test_engine import CFG, TEXT, baseline, make_engine, run


@pytest.fixture
def prefill_calls(monkeypatch):
    """Records the seq_lens of every `step.prefill_batch` call the runner makes."""
    calls: list[list[int]] = []
    real = step.prefill_batch

    def spy(talker, cache, embeds, seq_lens, *args, **kw):
        calls.append(list(seq_lens))
        return real(talker, cache, embeds, seq_lens, *args, **kw)

    monkeypatch.setattr(step, "prefill_batch", spy)
    return calls


def _four(speakers):
    """Different prompt lengths, voices, text modes, seeds and sampling modes."""
    return [
        dict(id="a", voice=VoiceSpec(speaker=speakers[0]), text=TEXT,
             sampling=SamplingParams(seed=3, max_frames=7)),
        dict(id="b", voice=VoiceSpec(speaker=speakers[1], text_mode="incremental"), text=TEXT[:25],
             sampling=SamplingParams(seed=4, top_k=0, top_p=0.9, max_frames=6)),
        dict(id="c", voice=VoiceSpec(speaker=speakers[2], instruct="Speak slowly and softly."),
             text=TEXT[:60], sampling=SamplingParams(greedy=True, max_frames=8)),
        dict(id="d", voice=VoiceSpec(speaker=speakers[3], language="english"), text="Hi.",
             sampling=SamplingParams(seed=5, temperature=1.2, repetition_penalty=1.3, max_frames=5)),
    ]


def test_same_step_prefill_equals_alone(tiny_ckpt, prefill_calls):
    eng = make_engine(tiny_ckpt)
    reqs = _four(sorted(tiny_ckpt.config.talker.speaker_ids))
    lens = [eng.inputs.builder.build(r["text"], r["voice"]).prefill.shape[0] for r in reqs]
    assert len(set(lens)) == 4, lens
    together = run(eng, reqs)
    assert prefill_calls == [lens]  # all four in one forward
    baseline(eng)
    for r, n in zip(reqs, lens):
        prefill_calls.clear()
        alone = run(eng, [r])[r["id"]]
        assert prefill_calls == [[n]]
        got = together[r["id"]]
        assert np.array_equal(alone[0], got[0]), r["id"]
        assert np.array_equal(alone[1], got[1]), r["id"]
        assert alone[2] == got[2]
    baseline(eng)


def test_same_step_prefill_icl_equals_alone(tmp_path_factory):
    """Base ICL voices (codec stream primed with each one's reference codes) started together give
    the codes and audio they give alone."""
    from q3tts.checkpoint.loader import load_checkpoint
    from q3tts.checkpoint.maker import make_checkpoint

    ckpt = load_checkpoint(make_checkpoint(tmp_path_factory.mktemp("base") / "b", "base", "1.7b", "tiny",
                                           seed=3), dtype=torch.float32)
    hidden = ckpt.config.talker.hidden_size
    rng = np.random.default_rng(0)
    reqs = []
    # two references of 3 frames: primed in one codec call
    for i, (frames, ref_text) in enumerate([(3, "Hi there."), (6, "A longer reference text here."),
                                           (2, "Yes."), (3, "Another one.")]):
        voice = VoiceSpec(ref_codes=rng.integers(0, 2048, (frames, 16)), ref_text=ref_text,
                          xvector=rng.standard_normal(hidden).astype(np.float32))
        reqs.append(dict(id=f"v{i}", voice=voice, text=TEXT[:30 + 20 * i],
                         sampling=SamplingParams(seed=10 + i, max_frames=5)))
    eng = Engine(ckpt, dataclasses.replace(CFG))
    together = run(eng, reqs)
    for r in reqs:
        alone = run(eng, [r])[r["id"]]
        assert np.array_equal(alone[0], together[r["id"]][0]), r["id"]
        assert np.array_equal(alone[1], together[r["id"]][1]), r["id"]
    baseline(eng)


def test_max_prefill_tokens_caps_a_step(tiny_ckpt, prefill_calls):
    reqs = _four(sorted(tiny_ckpt.config.talker.speaker_ids))
    probe = make_engine(tiny_ckpt)
    lens = [probe.inputs.builder.build(r["text"], r["voice"]).prefill.shape[0] for r in reqs]
    ref = run(probe, reqs)
    prefill_calls.clear()
    # room for the first two and the fourth: the third waits, and the fourth behind it (FIFO)
    assert lens[2] > lens[3] and lens[2] + lens[3] <= lens[0] + lens[1] + lens[3]
    eng = make_engine(tiny_ckpt, max_prefill_tokens=lens[0] + lens[1] + lens[3])
    for r in reqs:
        eng.add(r["id"], r["voice"], r["sampling"], r["text"], True)
    eng.step()
    assert prefill_calls == [lens[:2]]
    assert (eng.stats()["active"], eng.stats()["queued"]) == (2, 2)
    eng.step()
    assert prefill_calls == [lens[:2], lens[2:]]
    while eng.has_work():
        eng.step()
    baseline(eng)
    # a budget below every prompt: each is prefilled in pieces of at most the budget, one prompt after
    # the other (chunked prefill, tests/engine/test_chunked_prefill.py)
    prefill_calls.clear()
    eng = make_engine(tiny_ckpt, max_prefill_tokens=8)
    out = run(eng, reqs)
    assert prefill_calls == [[min(8, n - a)] for n in lens for a in range(0, n, 8)]
    for r in reqs:  # when a sequence starts does not change its codes
        assert np.array_equal(out[r["id"]][0], ref[r["id"]][0]), r["id"]
        assert np.array_equal(out[r["id"]][1], ref[r["id"]][1]), r["id"]
    baseline(eng)
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        EngineConfig(max_prefill_tokens=0)


def test_prefill_batch_equals_prefill(tiny_ckpt):
    """Model level: one ragged forward (with tail padding rows and head padding rows) gives each
    sequence the c0, hidden and KV of its own `prefill`."""
    from q3tts.models.tts_model import Qwen3TTS
    from q3tts.models.prompt import PromptBuilder
    from q3tts.models.sampling import SamplingTensors, uniforms

    model = Qwen3TTS.from_checkpoint(tiny_ckpt)
    talker, lc = model.talker, model.config.talker.layers
    builder = PromptBuilder(model, tiny_ckpt.tokenizer)
    spk = sorted(tiny_ckpt.config.talker.speaker_ids)
    prompts = [builder.build(TEXT[:n], VoiceSpec(speaker=s)).prefill for n, s in
               [(90, spk[0]), (12, spk[1]), (40, spk[2])]]
    params = [SamplingParams(seed=7), SamplingParams(greedy=True), SamplingParams(seed=8, top_p=0.8)]
    page, pages_each = 16, 8

    def cache():
        return PagedKVCache(lc.num_layers, 3 * pages_each + 1, page, lc.num_kv_heads, lc.head_dim,
                            torch.float32)

    def slots(i, n):
        return i * pages_each * page + torch.arange(n)

    alone_cache, c0s, hiddens = cache(), [], []
    for i, (x, p) in enumerate(zip(prompts, params)):
        c0, h = step.prefill(talker, alone_cache, x, slots(i, len(x)), SamplingTensors.talker([p]),
                             torch.tensor([p.seed]), uniforms)
        c0s.append(c0)
        hiddens.append(h)
    head = params + [SamplingParams(greedy=True)] * 5  # 8 head rows
    for padded in (False, True):
        batch_cache = cache()
        embeds = torch.cat(prompts + [torch.zeros(3, prompts[0].shape[1])])  # 3 tail padding rows
        mapping = torch.cat([slots(i, len(x)) for i, x in enumerate(prompts)] + [torch.full((3,), -1)])
        c0, h = step.prefill_batch(talker, batch_cache, embeds, [len(x) for x in prompts], mapping,
                                   SamplingTensors.talker(head), torch.tensor([p.seed for p in head]),
                                   uniforms, padded_attention=padded)
        assert c0.shape == (8,) and h.shape == (8, lc.hidden_size)
        if not padded:  # the CPU default: exact
            assert torch.equal(c0[:3], torch.cat(c0s))
            assert torch.equal(h[:3], torch.cat(hiddens))
            assert torch.equal(batch_cache.k, alone_cache.k) and torch.equal(batch_cache.v, alone_cache.v)
        else:  # the CUDA default: same math, batched: equal up to rounding
            torch.testing.assert_close(h[:3], torch.cat(hiddens), rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(batch_cache.k, alone_cache.k, rtol=1e-4, atol=1e-5)


def test_padded_attention_groups_equal_loop(monkeypatch):
    """The padded block-diagonal attention equals per-sequence `causal_attention`, also when the
    score budget splits the sequences into several groups; tail padding rows give 0."""
    g = torch.Generator().manual_seed(0)
    lens, nh, kvh, d = [5, 17, 1, 9, 30], 4, 2, 8
    n = sum(lens) + 2
    q, k, v = (torch.randn(n, h, d, generator=g) for h in (nh, kvh, kvh))
    cache = PagedKVCache(1, 8, 16, kvh, d, torch.float32)
    mapping = torch.cat((torch.arange(sum(lens)), torch.full((2,), -1)))
    ref, start = [], 0
    for m in lens:
        ref.append(causal_attention(q[start:start + m], k[start:start + m], v[start:start + m], 0.3))
        start += m
    ref = torch.cat(ref + [torch.zeros(2, nh, d)])
    loop = PrefillContext(cache, mapping, 0.3, lens, padded=False).attend(0, q, k, v)
    assert torch.equal(loop, ref)
    # default budget: one group; 800 * 4 * nh bytes: groups [5, 17] (2 * 17^2), [1, 9], [30]
    for budget, groups in ((attention.PADDED_SCORE_BYTES, 1), (800 * 4 * nh, 3)):
        monkeypatch.setattr(attention, "PADDED_SCORE_BYTES", budget)
        ctx = PrefillContext(cache, mapping, 0.3, lens, padded=True)
        torch.testing.assert_close(ctx.attend(0, q, k, v), ref, rtol=1e-5, atol=1e-6)
        assert len(ctx._groups) == groups
