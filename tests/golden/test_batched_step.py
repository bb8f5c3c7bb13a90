"""`decode_step` over a batch (with a padding row) gives each sequence the codes it gets alone."""

from __future__ import annotations

import torch

from q3tts.core import SamplingParams, VoiceSpec
from q3tts.models.attention import PagedKVCache
from q3tts.models.step import DecodeBatch, decode_step, prefill
from q3tts.models.sampling import SamplingTensors, uniforms
from q3tts.models.generate import generate_codes

FRAMES = 8
PAGE = 16
PAGES_PER_SEQ = 4
REQUESTS = [
    ("Hello world, this is a test.", VoiceSpec(speaker="ryan", text_mode="incremental"),
     SamplingParams(greedy=True, max_frames=FRAMES)),
    ("A second, longer sentence for the batch.", VoiceSpec(speaker="vivian", language="english"),
     SamplingParams(max_frames=FRAMES, seed=9, top_k=20)),
]


def _run_batch(model, prompts, params):
    """Two live rows (pages 0.. and 4..) plus one padding row, stepped together."""
    talker, cfg = model.talker, model.config.talker.layers
    cache = PagedKVCache(cfg.num_layers, 2 * PAGES_PER_SEQ + 1, PAGE, cfg.num_kv_heads,
                         cfg.head_dim, torch.float32)
    tables = torch.arange(2 * PAGES_PER_SEQ, dtype=torch.int32).view(2, PAGES_PER_SEQ)
    seeds = torch.tensor([p.seed for p in params] + [0])
    c0s, hiddens = [], []
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        slots = tables[i].long().repeat_interleave(PAGE) * PAGE + torch.arange(PAGE).repeat(PAGES_PER_SEQ)
        c0, hidden = prefill(talker, cache, prompt.prefill, slots[:prompt.prefill.shape[0]],
                             SamplingTensors.talker([p]), seeds[i:i + 1], uniforms)
        c0s.append(c0)
        hiddens.append(hidden)
    all_params = [*params, SamplingParams(greedy=True)]
    c0 = torch.cat(c0s + [torch.zeros(1, dtype=torch.int64)])
    hidden = torch.cat(hiddens + [torch.zeros_like(hiddens[0])])
    lengths = torch.tensor([p.prefill.shape[0] for p in prompts])
    generated = torch.zeros(3, talker.cfg.vocab_size, dtype=torch.bool)
    block_tables = torch.cat((tables, tables[:1]))
    out = []
    for t in range(FRAMES):
        generated[torch.arange(3), c0] = True
        pos = torch.cat((lengths + t, torch.zeros(1, dtype=torch.int64)))
        slot = block_tables[:2].long().gather(1, (pos[:2] // PAGE)[:, None])[:, 0] * PAGE + pos[:2] % PAGE
        text = torch.stack([pr.trailing[t] if t < pr.trailing.shape[0] else pr.pad for pr in prompts]
                           + [prompts[0].pad])
        batch = DecodeBatch(
            c0=c0, past_hidden=hidden, text=text, positions=pos,
            slot_mapping=torch.cat((slot, torch.tensor([-1]))), block_tables=block_tables,
            context_lens=torch.cat((pos[:2] + 1, torch.zeros(1, dtype=torch.int64))).int(),
            generated=generated, num_generated=torch.full((3,), t + 1), seeds=seeds,
            counters=torch.full((3,), t))
        result = decode_step(talker, cache, batch, SamplingTensors.talker(all_params),
                             SamplingTensors.subtalker(all_params), uniforms)
        out.append(result.codes[:2])
        c0, hidden = result.next_c0, result.hidden
    return torch.stack(out, dim=1)  # [2, FRAMES, 16]


def test_batched_decode_equals_single(ours):
    mine = ours("cv17")
    prompts = [mine.builder.build(text, voice) for text, voice, _ in REQUESTS]
    params = [p for _, _, p in REQUESTS]
    batched = _run_batch(mine.model, prompts, params)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        assert torch.equal(batched[i], generate_codes(mine.model, prompt, p))
