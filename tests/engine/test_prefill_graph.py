"""Token-bucketed prefill (engine/prefill_graph.py): the packed, padded forward gives each sequence the
c0, hidden and KV of today's `prefill_batch` (CPU: eagerly, bit for bit; GPU: as captured graphs)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from q3tts.core import SamplingParams, VoiceSpec
from q3tts.engine.prefill_graph import PREFILL_TOKEN_BUCKETS, PrefillGraphs, token_buckets
from q3tts.models import step
from q3tts.models.attention import PagedKVCache
from q3tts.models.prompt import PromptBuilder
from q3tts.models.sampling import (FULL, GRAPH_VARIANTS, GREEDY, TOPK, SamplingTensors, graph_variant, row_mode,
                                  uniforms)
from q3tts.models.tts_model import Qwen3TTS

TEXT = ("Hello world, this is a test of the speech system. The quick brown fox jumps over the "
        "lazy dog.")
PAGE, PAGES_EACH, MAX_SEQS = 16, 8, 8
DUMMY = MAX_SEQS
# per slot: seeded top-k, greedy, nucleus (the FULL variant), penalised, ...; the dummy slot greedy
SLOT_PARAMS = [SamplingParams(seed=7), SamplingParams(greedy=True), SamplingParams(seed=8, top_p=0.8),
               SamplingParams(seed=9, temperature=1.3, repetition_penalty=1.3),
               SamplingParams(seed=10, top_k=3), SamplingParams(seed=11), SamplingParams(seed=12),
               SamplingParams(seed=13, top_k=0), SamplingParams(greedy=True)]


class SlotTable:
    """Graph-safe head parameters: the talker sampling tensors of every slot, gathered by slot."""

    def __init__(self, params: list[SamplingParams], device):
        self.t = SamplingTensors.talker(params, device)
        self.seeds = torch.tensor([p.seed for p in params], device=device)

    def __call__(self, sl: torch.Tensor) -> tuple[SamplingTensors, torch.Tensor]:
        t = self.t
        return SamplingTensors(t.temperature[sl], t.top_k[sl], t.top_p[sl], t.repetition_penalty[sl],
                               t.greedy[sl]), self.seeds[sl]


def load_model(ckpt, device):
    model = Qwen3TTS.from_checkpoint(ckpt)
    return model.to(device).talker.fuse_(), model


def prompts_for(ckpt, model, text_lens: list[int]) -> list[torch.Tensor]:
    builder = PromptBuilder(model, ckpt.tokenizer)
    spk = sorted(ckpt.config.talker.speaker_ids)
    return [builder.build(TEXT[:n], VoiceSpec(speaker=spk[i % len(spk)])).prefill
            for i, n in enumerate(text_lens)]


def new_cache(talker, device) -> PagedKVCache:
    lc = talker.cfg.layers
    return PagedKVCache(lc.num_layers, MAX_SEQS * PAGES_EACH + 1, PAGE, lc.num_kv_heads, lc.head_dim,
                        talker.model.norm.weight.dtype, device)


def slot_mapping(slots: list[int], lens: list[int]) -> np.ndarray:
    """Slot s owns pages s*PAGES_EACH.. (the engine's page lists, contiguous here)."""
    return np.concatenate([s * PAGES_EACH * PAGE + np.arange(n) for s, n in zip(slots, lens)])


def eager(talker, prompts, slots, device, **kw):
    """Today's path: `prefill_batch` with a MAX_SEQS-row head (padding rows on the dummy slot),
    sampling in the cheapest mode valid for its rows (the packed head samples in FULL)."""
    cache = new_cache(talker, device)
    lens = [p.shape[0] for p in prompts]
    head = [SLOT_PARAMS[s] for s in slots] + [SLOT_PARAMS[DUMMY]] * (MAX_SEQS - len(slots))
    c0, hidden = step.prefill_batch(talker, cache, torch.cat(prompts).to(device), lens,
                                    torch.from_numpy(slot_mapping(slots, lens)).to(device),
                                    SamplingTensors.talker(head, device),
                                    torch.tensor([p.seed for p in head], device=device), uniforms, **kw)
    return c0[:len(slots)], hidden[:len(slots)], cache


def packed(graphs: PrefillGraphs, prompts, slots, mode: str = FULL):
    graphs.cache.k.zero_()
    graphs.cache.v.zero_()
    lens = [p.shape[0] for p in prompts]
    c0, hidden = graphs.run(prompts, slot_mapping(slots, lens), slots, mode=mode)
    return c0.clone(), hidden.clone(), graphs.cache


def make_graphs(talker, device, buckets) -> PrefillGraphs:
    return PrefillGraphs(talker, new_cache(talker, device), SlotTable(SLOT_PARAMS, device), uniforms,
                         MAX_SEQS, DUMMY, buckets, talker.model.norm.weight.dtype, torch.device(device))


BATCHES = [  # (text lengths of the prompts, their slots)
    ([90], [0]),
    ([12, 60, 30], [3, 0, 2]),               # nucleus slot 2: the eager head samples in FULL too
    ([5, 40, 1, 70, 20], [4, 1, 5, 6, 7]),
    ([60] * 8, list(range(8))),              # every head row used
]


def test_token_buckets():
    assert token_buckets(4096) == (64, 128, 256, 512, 1024, 2048, 4096)
    assert token_buckets(10_000) == PREFILL_TOKEN_BUCKETS  # all of them past the largest
    assert token_buckets(200) == (64, 128, 256)
    assert token_buckets(64) == (64,)
    assert token_buckets(10, (16, 32)) == (16,)


def test_packed_prefill_equals_prefill_batch(tiny_ckpt):
    talker, model = load_model(tiny_ckpt, "cpu")
    graphs = make_graphs(talker, "cpu", token_buckets(512))
    for text_lens, slots in BATCHES:
        prompts = prompts_for(tiny_ckpt, model, text_lens)
        lens = [p.shape[0] for p in prompts]
        bucket = graphs.bucket_for(sum(lens), len(lens))
        assert bucket > sum(lens), "the batch should carry padding rows"
        c0, hidden, cache = eager(talker, prompts, slots, "cpu")
        c0_p, hidden_p, cache_p = packed(graphs, prompts, slots)
        assert torch.equal(c0_p, c0), (lens, c0_p, c0)
        assert torch.equal(hidden_p, hidden), lens
        # every page, used or not: padding rows wrote nothing
        assert torch.equal(cache_p.k, cache.k) and torch.equal(cache_p.v, cache.v), lens


def test_topk_head_draws_the_full_heads_codes(tiny_ckpt):
    """The head's TOPK variant (what the default parameters take) draws FULL's first codes on rows that allow
    it: seeded top-k rows and a greedy one; a variant no graph is made in is refused."""
    talker, model = load_model(tiny_ckpt, "cpu")
    graphs = make_graphs(talker, "cpu", token_buckets(512))
    slots = [0, 1, 4, 5]  # top-k 50 seed 7, greedy, top-k 3, top-k 50 seed 11
    assert graph_variant(row_mode(p.greedy, p.top_k, p.top_p) for p in (SLOT_PARAMS[s] for s in slots)) == TOPK
    prompts = prompts_for(tiny_ckpt, model, [12, 40, 30, 7])
    c0, hidden, _ = packed(graphs, prompts, slots)
    c0_topk, hidden_topk, _ = packed(graphs, prompts, slots, TOPK)
    assert torch.equal(c0_topk, c0) and torch.equal(hidden_topk, hidden)
    with pytest.raises(AssertionError, match="head variant"):
        packed(graphs, prompts, slots, GREEDY)


def test_metadata_fields_are_16_byte_aligned(tiny_ckpt):
    """Every bucket's metadata views start 16-byte aligned (the kernels reading them are compiled for that),
    and do not overlap."""
    talker, _ = load_model(tiny_ckpt, "cpu")
    graphs = make_graphs(talker, "cpu", token_buckets(512))
    for bucket in graphs.buckets:
        batch = graphs._views(bucket)
        views = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch) if f.name != "embeds"}
        assert all(v.data_ptr() % 16 == 0 for v in views.values()), bucket
        spans = sorted((v.data_ptr(), v.data_ptr() + 8 * v.numel()) for v in views.values())
        assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:])), bucket


def test_run_refuses_what_fits_no_bucket(tiny_ckpt):
    talker, model = load_model(tiny_ckpt, "cpu")
    graphs = make_graphs(talker, "cpu", (16, 32))
    prompts = prompts_for(tiny_ckpt, model, [60])
    assert graphs.bucket_for(prompts[0].shape[0], 1) is None
    assert graphs.bucket_for(8, MAX_SEQS + 1) is None
    with pytest.raises(ValueError, match="fit no bucket"):
        graphs.run(prompts, slot_mapping([0], [prompts[0].shape[0]]), [0])


def test_engine_through_packed_prefill(tiny_ckpt, monkeypatch):
    """CPU engine whose runner prefills through PrefillGraphs (eagerly, as on CUDA before capture):
    every sequence's codes and audio equal today's path, arrivals together and one by one."""
    from test_engine import baseline, make_engine, req, run

    spk = sorted(tiny_ckpt.config.talker.speaker_ids)
    reqs = [req("g", spk[0], 0, greedy=True, max_frames=6),
            req("s", spk[1], 0, text=TEXT[:30], seed=4, top_p=0.8, max_frames=5),
            req("i", spk[2], 0, mode="incremental", text=TEXT[:50], seed=5, max_frames=7),
            req("late", spk[3], 2, seed=6, max_frames=4)]
    ref = run(make_engine(tiny_ckpt), reqs)
    eng = make_engine(tiny_ckpt)
    eng.runner.prefill_graphs = eng.runner.packed_prefill()
    monkeypatch.setattr(step, "prefill_batch", None)  # the eager path is not taken
    got = run(eng, reqs)
    for r in reqs:
        assert np.array_equal(got[r["id"]][0], ref[r["id"]][0]), r["id"]
        assert np.array_equal(got[r["id"]][1], ref[r["id"]][1]), r["id"]
        assert got[r["id"]][2] == ref[r["id"]][2], r["id"]
    baseline(eng)


def test_runner_runs_the_head_variant_its_rows_allow(tiny_ckpt, monkeypatch):
    """The engine's packed prefill draws with the TOPK head for default and greedy arrivals and with FULL
    once one of the step's arrivals needs the nucleus (top_p < 1)."""
    from test_engine import baseline, make_engine, req, run

    spk = sorted(tiny_ckpt.config.talker.speaker_ids)
    eng = make_engine(tiny_ckpt)
    eng.runner.prefill_graphs = eng.runner.packed_prefill()
    variants: list[str] = []
    real_run = PrefillGraphs.run

    def spy(self, prompts, mapping, slots, prefix=None, mode=FULL):
        variants.append(mode)
        return real_run(self, prompts, mapping, slots, prefix, mode)

    monkeypatch.setattr(PrefillGraphs, "run", spy)
    run(eng, [req("d", spk[0], 0, seed=3, max_frames=2), req("g", spk[1], 0, greedy=True, max_frames=2)])
    assert variants == [TOPK]
    run(eng, [req("d", spk[0], 0, seed=3, max_frames=2), req("p", spk[1], 0, seed=4, top_p=0.8, max_frames=2)])
    assert variants == [TOPK, FULL]
    baseline(eng)


# ------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graph_prefill_equals_eager_prefill(tiny_ckpt):
    """fp32 on the GPU: captured buckets (Triton varlen attention) vs the eager `prefill_batch`
    (padded torch attention): the same first codes, hidden and KV up to rounding."""
    talker, model = load_model(tiny_ckpt, "cuda")
    graphs = make_graphs(talker, "cuda", token_buckets(512))
    graphs.capture()
    assert sorted(graphs.graphs.graphs) == list(graphs.buckets) and sorted(graphs.heads) == sorted(GRAPH_VARIANTS)
    for i, (text_lens, slots) in enumerate(BATCHES):
        prompts = [p.cuda() for p in prompts_for(tiny_ckpt, model, text_lens)]
        c0, hidden, cache = eager(talker, prompts, slots, "cuda")
        c0_p, hidden_p, cache_p = packed(graphs, prompts, slots)
        assert graphs.num_replays == i + 1 and graphs.heads[FULL].num_replays == i + 1
        assert torch.equal(c0_p, c0), (text_lens, c0_p, c0)
        torch.testing.assert_close(hidden_p, hidden, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(cache_p.k, cache.k, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(cache_p.v, cache.v, rtol=1e-4, atol=1e-5)


def _engine_first_codes(ckpt, requests, prefill_graphs: bool) -> dict[str, np.ndarray]:
    """The first frames of each request on a fp32 CUDA engine, prefill graphs on or off."""
    from q3tts.engine.config import EngineConfig
    from q3tts.engine.engine import Engine

    cfg = EngineConfig(device="cuda", dtype="float32", num_pages=256, max_slots=8, max_frames=64,
                       max_prompt_tokens=256, max_text_tokens=128, graph_batch_sizes=(1, 2, 4, 8),
                       prefill_graphs=prefill_graphs)
    eng = Engine(ckpt, cfg)
    assert (eng.runner.prefill_graphs is not None) == prefill_graphs
    codes: dict[str, list] = {r["id"]: [] for r in requests}
    for r in requests:  # Base voices kept first (as the preparer would), so that every arrival starts at once
        eng.voices.get_or_prepare(eng.inputs.encode(r["voice"]))
    for r in requests:
        eng.add(r["id"], r["voice"], r["sampling"], r["text"], True)
    while eng.has_work():
        for out in eng.step():
            codes[out.seq_id].append(out.codes)
    if prefill_graphs:
        assert eng.runner.prefill_graphs.num_replays == 1, "all arrivals in one replay"
    return {k: np.concatenate(v) for k, v in codes.items()}


def _assert_same_first_codes(ckpt, requests):
    graph = _engine_first_codes(ckpt, requests, True)
    eager_ = _engine_first_codes(ckpt, requests, False)
    for r in requests:
        assert len(graph[r["id"]]) and np.array_equal(graph[r["id"]][:1], eager_[r["id"]][:1]), r["id"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_engine_graph_prefill_equals_eager(tiny_ckpt):
    spk = sorted(tiny_ckpt.config.talker.speaker_ids)
    requests = [dict(id=f"r{i}", voice=VoiceSpec(speaker=spk[i % len(spk)]), text=TEXT[:20 + 25 * i],
                     sampling=dataclasses.replace(SLOT_PARAMS[i], max_frames=3)) for i in range(5)]
    _assert_same_first_codes(tiny_ckpt, requests)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_engine_graph_prefill_base_icl(tmp_path_factory):
    """Base ICL voices (reference codes and text in the prompt) through the prefill graphs."""
    from q3tts.checkpoint.loader import load_checkpoint
    from q3tts.checkpoint.maker import make_checkpoint

    path = make_checkpoint(tmp_path_factory.mktemp("base") / "b", "base", "1.7b", "tiny", seed=3)
    ckpt = load_checkpoint(path, dtype=torch.float32)
    rng = np.random.default_rng(0)
    hidden = ckpt.config.talker.hidden_size
    requests = [dict(id=f"v{i}", text=TEXT[:30 + 20 * i],
                     voice=VoiceSpec(ref_codes=rng.integers(0, 2048, (frames, 16)), ref_text=ref_text,
                                     xvector=rng.standard_normal(hidden).astype(np.float32)),
                     sampling=SamplingParams(seed=10 + i, max_frames=3))
                for i, (frames, ref_text) in enumerate([(3, "Hi there."), (6, "A longer reference."),
                                                        (2, "Yes.")])]
    _assert_same_first_codes(ckpt, requests)
