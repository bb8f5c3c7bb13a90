"""Generation steps over explicit per-sequence state: the units an engine batches.

`prefill_batch` runs the prompts of several sequences as one ragged forward (rows back to back,
positions restarting at 0, block-diagonal causal attention) and draws each one's first c0;
`prefill` is its one-sequence case. `decode_step` advances B sequences by one
frame each: code predictor (c1..c15 of frame t from `past_hidden` and c0[t]: `predict_frame`) -> talker
step at the frame's position with input `next_input + text_row` -> c0[t+1] (`advance`; the two halves are
separate so that a caller can decode the frame's audio while the talker runs). The caller owns all bookkeeping:
positions, pages, the c0 history mask, the text queue and stopping (c0 == EOS ends a sequence
without a frame; see spec b.4).
Uniform column 0 of counter t draws c0[t]; columns 1..15 of counter t draw c1..c15 of frame t.
`faults` [B] bool (optional, in place, graph-safe): rows whose sampling scores were not finite (any of the
16 draws of the frame) are or-ed in; such rows drew id 0 (models/sampling.py: the finite guard), so every
later gather stays in bounds, and the caller ends them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from q3tts.models.attention import DecodeContext, PagedKVCache, PrefillContext
from q3tts.models.layers import rows_at
from q3tts.models.talker import Talker
from q3tts.models.sampling import (SamplingTensors, SubtalkerSampler, TalkerRules, UniformSource,
                            sample_talker)


def talker_rules(talker: Talker) -> TalkerRules:
    """EOS id and the suppressed control-id range of a talker config."""
    cfg = talker.cfg
    return TalkerRules(eos_id=cfg.codec_eos_id, suppress_start=cfg.vocab_size - 1024)


@dataclass
class DecodeBatch:
    """Inputs of one decode step for B rows (all tensors on the model's device).

    c0 [B] int64: first code of this frame (sampled last step). past_hidden [B, H]: talker hidden of
    the previous position. text [B, H]: text-track row for this step (trailing[t] or E_pad).
    positions [B]: talker position of this step (L0 + t). slot_mapping [B] (-1 = padding row),
    block_tables [B, max_pages], context_lens [B] (= positions + 1 on live rows): the paged KV.
    generated [B, vocab] bool and num_generated [B]: c0 history including c0[t].
    seeds [B], counters [B] = t: the uniform stream.
    """

    c0: torch.Tensor
    past_hidden: torch.Tensor
    text: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    generated: torch.Tensor
    num_generated: torch.Tensor
    seeds: torch.Tensor
    counters: torch.Tensor


@dataclass
class StepResult:
    """codes [B, 16] of frame t; next_c0 [B] = c0[t+1] (EOS ends the row); hidden [B, H]."""

    codes: torch.Tensor
    next_c0: torch.Tensor
    hidden: torch.Tensor


@torch.no_grad()
def prefill(talker: Talker, cache: PagedKVCache, embeds: torch.Tensor, slot_mapping: torch.Tensor,
            params: SamplingTensors, seeds: torch.Tensor, uniform_source: UniformSource
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's prompt embeds [L0, H] at positions 0..L0-1 (K/V to slot_mapping [L0]).

    Returns c0[0] [1] int64 and past_hidden [1, H] (final-normed hidden of the last prompt row).
    """
    return prefill_batch(talker, cache, embeds, [embeds.shape[0]], slot_mapping, params, seeds,
                         uniform_source)


@torch.no_grad()
def prefill_batch(talker: Talker, cache: PagedKVCache, embeds: torch.Tensor, seq_lens: list[int],
                  slot_mapping: torch.Tensor, params: SamplingTensors, seeds: torch.Tensor,
                  uniform_source: UniformSource, padded_attention: bool | None = None,
                  faults: torch.Tensor | None = None, prefixes: list[torch.Tensor | None] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts of B = len(seq_lens) sequences in one forward.

    embeds [N, H]: the prompts back to back (sequence i = the next seq_lens[i] rows, at positions
    0..L_i-1; rows past sum(seq_lens) are padding with slot -1). slot_mapping [N]: each row's KV slot
    in its sequence's pages. params / seeds: R >= B rows; rows past B are padding rows of the
    sampling head (so the caller can fix the head's row count: their hidden is 0, their draw junk).
    padded_attention: see `PrefillContext` (None = per device). faults [R] bool: see the module docstring.
    prefixes (chunked prefill, see `PrefillContext`): sequence i's rows are a piece of its prompt after
    the P_i rows whose cache slots prefixes[i] [P_i] holds (None: none), at positions P_i..P_i+L_i-1;
    the result of a piece that is not its prompt's last is that of its last row (the caller drops it).
    Returns c0[0] [R] int64 and past_hidden [R, H] (final-normed hidden of each prompt's last row).
    """
    device = embeds.device
    lens = [int(n) for n in seq_lens]
    total, rows = sum(lens), seeds.shape[0]
    assert len(lens) >= 1 and min(lens) >= 1 and total <= embeds.shape[0] and rows >= len(lens)
    starts = [0 if p is None else int(p.shape[0]) for p in prefixes] if prefixes else [0] * len(lens)
    if len(lens) == 1 and total == embeds.shape[0]:
        positions = torch.arange(starts[0], starts[0] + total, device=device)
    else:  # positions from each sequence's start; padding rows at 0
        pos = [torch.arange(p, p + n) for p, n in zip(starts, lens)]
        positions = torch.cat(pos + [torch.zeros(embeds.shape[0] - total, dtype=torch.int64)]).to(device)
    ctx = PrefillContext(cache, slot_mapping, talker.attn_scale, lens, padded_attention, prefixes)
    out = talker(embeds, positions, ctx)  # [N, H]
    if len(lens) == 1:
        hidden = out[lens[0] - 1:lens[0]]  # [1, H]
    else:
        last = torch.tensor(lens).cumsum(0) - 1
        hidden = rows_at(out, last.to(device))  # [B, H]
    if rows > len(lens):
        hidden = torch.cat((hidden, hidden.new_zeros(rows - len(lens), hidden.shape[1])))
    return first_c0(talker, hidden, params, seeds, uniform_source, faults), hidden


def first_c0(talker: Talker, hidden: torch.Tensor, params: SamplingTensors, seeds: torch.Tensor,
             uniform_source: UniformSource, faults: torch.Tensor | None = None) -> torch.Tensor:
    """c0[0] [R] int64 of R prompts from the hidden [R, H] of their last rows (no history yet,
    uniform counter 0); faults [R] bool: see the module docstring. Static shapes, no host sync."""
    rows, device = hidden.shape[0], hidden.device
    no_history = torch.zeros(rows, talker.cfg.vocab_size, dtype=torch.bool, device=device)
    zero = torch.zeros(rows, dtype=torch.int64, device=device)
    u = uniform_source(seeds, zero)[:, 0]
    return sample_talker(talker.logits(hidden), params, talker_rules(talker), no_history, zero, u, faults)


@torch.no_grad()
def decode_step(talker: Talker, cache: PagedKVCache, batch: DecodeBatch, params: SamplingTensors,
                cp_params: SamplingTensors, uniform_source: UniformSource,
                faults: torch.Tensor | None = None) -> StepResult:
    """Advance every row by one frame (see module docstring); static shapes for a given B."""
    codes, next_input = predict_frame(talker, batch, cp_params, uniform_source, faults)
    next_c0, hidden = advance(talker, cache, batch, next_input, params, uniform_source, faults)
    return StepResult(codes=codes, next_c0=next_c0, hidden=hidden)


def predict_frame(talker: Talker, batch: DecodeBatch, cp_params: SamplingTensors,
                  uniform_source: UniformSource, faults: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The first half of a decode step: the code predictor -> codes [B, 16] of frame t (c0[t] first) and
    the talker's next input [B, H] (the frame's summed embeddings)."""
    u_frame = uniform_source(batch.seeds, batch.counters)  # [B, 16]
    codes, next_input = talker.code_predictor.generate(
        batch.past_hidden, batch.c0, SubtalkerSampler(cp_params, u_frame, faults))
    return torch.cat((batch.c0[:, None], codes), dim=1), next_input


def advance(talker: Talker, cache: PagedKVCache, batch: DecodeBatch, next_input: torch.Tensor,
            params: SamplingTensors, uniform_source: UniformSource, faults: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The second half: the talker step on next_input [B, H] + the text row -> c0[t+1] [B] and its
    hidden [B, H]."""
    ctx = DecodeContext(cache, batch.slot_mapping, batch.block_tables, batch.context_lens,
                        talker.attn_scale)
    hidden = talker(next_input + batch.text, batch.positions, ctx)  # [B, H]
    u_next = uniform_source(batch.seeds, batch.counters + 1)[:, 0]  # [B]
    next_c0 = sample_talker(talker.logits(hidden), params, talker_rules(talker), batch.generated,
                            batch.num_generated, u_next, faults)
    return next_c0, hidden
