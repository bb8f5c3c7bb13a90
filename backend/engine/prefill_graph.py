"""Prefill as CUDA graphs: the prompts a step starts, packed into a token bucket, one graph per bucket.

`forward_packed` is the talker forward of `models.step.prefill_batch` with every index on the device:
one forward over the prompts back to back (`PackedPrefillContext`: block-diagonal causal attention from
device boundaries), padded to the bucket's row count (padding rows: slot -1, never read by attention),
then the last hidden row of each sequence on a head of `max_seqs` rows (one per sequence, the rest on
the dummy slot). The first c0 of each sequence is drawn from those rows by the head
(`models.step.first_c0`), in the step's sampling variant: TOPK when every row allows it (the default
parameters), else FULL, which sorts the vocabulary twice. `PrefillGraphs` holds the inputs and outputs
in static buffers and captures the forward once per token bucket and the head once per variant
(`GraphRunner`), so a prefill costs one metadata copy, one embedding copy and two graph launches
whatever the layer count; on CPU the same bodies run eagerly.

Chunked prefill: the first sequence may be a piece of its prompt after P rows already in the KV
(`run(prefix=...)`): its positions start at P and its rows attend to those P keys through its page
table (`PackedPrefillContext`); P = 0 for a whole prompt, so one graph per bucket serves both.

Static buffers, sized for the largest bucket T, S = max_seqs and M = max_prefix_pages:
    embeds [T, H]   the prompts back to back (rows past them keep stale, finite values)
    meta   int64 (one host-to-device copy): head_slots [S] | prefix_len [1] | prefix_table [M], the same
           place for every bucket (the head graphs read the slots), then bucket t's positions [t] |
           slot_mapping [t] | cu_seqlens [S+1]; each field 16-element aligned (`_fields`)
    hidden [S, H] (the forward's output, the head's input), c0 [S] int64, faults [S] bool (non-finite
    sampling scores, models/step.py): the outputs
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from q3tts.models import step
from q3tts.models.attention import PackedPrefillContext, PagedKVCache
from q3tts.models.layers import rows_at
from q3tts.models.sampling import FULL, GRAPH_VARIANTS, SamplingTensors, UniformSource
from q3tts.models.talker import Talker
from q3tts.models.transfer import upload

from .cuda_graph import GraphRunner

# up to the default max_prefill_tokens (4096), so that a step starting 64 arrivals of ~50 rows at once is one forward
# replay too (past the largest bucket the eager forward runs: one launch per op per layer)
PREFILL_TOKEN_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096)

_FIELD_ALIGN = 16  # int64 elements between the starts of `meta`'s fields (a multiple of 16 bytes)

# head slots [S] int64 -> the talker sampling parameters and seeds of those slots (graph-safe)
HeadParams = Callable[[torch.Tensor], tuple[SamplingTensors, torch.Tensor]]


def token_buckets(max_tokens: int, candidates: tuple[int, ...] = PREFILL_TOKEN_BUCKETS) -> tuple[int, ...]:
    """The candidates a prefill of at most `max_tokens` rows can use: those below it and the first
    at or above it (all of them when it is larger than every candidate)."""
    below = tuple(b for b in candidates if b < max_tokens)
    above = [b for b in candidates if b >= max_tokens]
    return below + tuple(above[:1])


@torch.no_grad()
def forward_packed(talker: Talker, cache: PagedKVCache, embeds: torch.Tensor, positions: torch.Tensor,
                   slot_mapping: torch.Tensor, cu_seqlens: torch.Tensor, prefix_table: torch.Tensor | None = None,
                   prefix_len: torch.Tensor | None = None) -> torch.Tensor:
    """The prompts of S sequences in one talker forward, no host value anywhere (a CUDA graph per shape).

    embeds [T, H] at positions [T] (each sequence from 0, sequence 0 from prefix_len), K/V to
    slot_mapping [T] (-1 = padding row); cu_seqlens [S+1]: sequence i = rows cu[i]..cu[i+1]-1, rows >=
    cu[S] are padding. prefix_table, prefix_len: see `PackedPrefillContext` (None: no piece).
    Returns past_hidden [S, H]: the final-normed hidden of each prompt's last row (an empty sequence's
    row is junk).
    """
    ctx = PackedPrefillContext(cache, slot_mapping, cu_seqlens, talker.attn_scale, prefix_table, prefix_len)
    out = talker(embeds, positions, ctx)  # [T, H]
    last = (cu_seqlens[1:] - 1).clamp(min=0)  # [S] last row of each sequence
    return rows_at(out, last)


@dataclass
class PackedBatch:
    """Views of one bucket's static inputs (t rows, S sequences)."""

    embeds: torch.Tensor        # [t, H]
    positions: torch.Tensor     # [t] int64
    slot_mapping: torch.Tensor  # [t] int64, -1 = padding row
    cu_seqlens: torch.Tensor    # [S+1] int64
    head_slots: torch.Tensor    # [S] int64, the dummy slot past the batch's sequences
    prefix_len: torch.Tensor    # [1] int64: prompt rows of sequence 0 already in the KV (0: whole)
    prefix_table: torch.Tensor  # [M] int64: sequence 0's pages (those of its prefix, then 0s)


class PrefillGraphs:
    """`forward_packed` and the first draw over static buffers: the forward captured per token bucket, the
    head per sampling variant.

    talker, cache: the model and its paged KV. head_params: the sampling parameters of a set of
    slots. max_seqs: sequences one prefill may hold (the sampling head's rows); dummy_slot: the slot
    padding head rows read and write. buckets: row counts, each captured (on CUDA) by `capture`.
    max_prefix_pages: pages of the longest prefix a piece may follow (those of the longest prompt).
    """

    def __init__(self, talker: Talker, cache: PagedKVCache, head_params: HeadParams,
                 uniform_source: UniformSource, max_seqs: int, dummy_slot: int,
                 buckets: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 max_prefix_pages: int = 1) -> None:
        assert buckets and list(buckets) == sorted(set(buckets)), f"buckets must increase: {buckets}"
        self.talker, self.cache, self.head_params = talker, cache, head_params
        self.uniform_source = uniform_source
        self.max_seqs, self.dummy_slot, self.buckets = max_seqs, dummy_slot, buckets
        self.max_prefix_pages = max_prefix_pages
        rows, hidden = buckets[-1], talker.cfg.hidden_size
        self.embeds = torch.zeros(rows, hidden, dtype=dtype, device=device)
        self.meta = torch.zeros(self._fields(rows)["cu_seqlens"].stop, dtype=torch.int64, device=device)
        self.c0 = torch.zeros(max_seqs, dtype=torch.int64, device=device)
        self.hidden = torch.zeros(max_seqs, hidden, dtype=dtype, device=device)
        self.faults = torch.zeros(max_seqs, dtype=torch.bool, device=device)
        self.graphs: GraphRunner | None = None  # the forwards, by bucket
        self.heads: dict[str, GraphRunner] = {}  # the first draw (one bucket: max_seqs), by sampling variant

    @property
    def num_replays(self) -> int:
        """Forward graphs replayed (one per captured prefill)."""
        return self.graphs.num_replays if self.graphs is not None else 0

    def bucket_for(self, tokens: int, seqs: int) -> int | None:
        """The smallest bucket holding `tokens` prompt rows of `seqs` sequences, None if none does."""
        if seqs > self.max_seqs:
            return None
        return next((b for b in self.buckets if b >= tokens), None)

    def run(self, prompts: list[torch.Tensor], slot_mapping: np.ndarray, slots: list[int],
            prefix: tuple[int, list[int]] | None = None, mode: str = FULL) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill n = len(prompts) sequences (prompt rows [L_i, H]) whose K/V go to slot_mapping
        [sum L] and whose sampling parameters are those of `slots`; prefix = (P, pages): prompts[0] is
        the piece of its prompt after P rows already in the KV, in those pages. mode: the head's sampling
        variant, one of GRAPH_VARIANTS (the caller vouches that it is valid for every row, as
        `SamplingTensors.with_mode`; greedy rows allow TOPK). Replays the bucket's and the variant's graphs
        when captured. Returns c0[0] [n] int64 and past_hidden [n, H]: views of buffers the next prefill
        overwrites."""
        assert mode in GRAPH_VARIANTS, f"head variant {mode!r} is none of {GRAPH_VARIANTS}"
        lens = [int(p.shape[0]) for p in prompts]
        bucket = self.bucket_for(sum(lens), len(lens))
        if bucket is None:
            raise ValueError(f"PrefillGraphs: {len(lens)} prompts of {sum(lens)} rows fit no bucket "
                             f"({self.max_seqs} sequences, {self.buckets[-1]} rows at most)")
        self._load(bucket, lens, slot_mapping, slots, prefix or (0, []))
        torch.cat([p.to(self.embeds.device, self.embeds.dtype) for p in prompts],
                  out=self.embeds[:sum(lens)])
        self._run(bucket, mode)
        return self.c0[:len(lens)], self.hidden[:len(lens)]

    def run_filler(self, bucket: int) -> None:
        """Bucket `bucket`'s prefill and a FULL head (their graphs when captured) on the capture's input: one
        sequence filling the bucket whose K/V go nowhere and whose head row is the dummy slot's, so nothing
        but the dummy slot's state is written (the bucket's work alone, e.g. to profile it)."""
        self._fill_capture(0, bucket)
        self._run(bucket, FULL)

    def capture(self) -> None:
        """Capture every bucket's forward (CUDA), largest first into one pool, each after a warm-up run; then
        the head of each sampling variant, into another."""
        self.graphs = GraphRunner(self._body, self._fill_capture, self.buckets, "the prefill",
                                  "prefill_graphs")
        self.graphs.capture()
        pool = None
        for mode in GRAPH_VARIANTS:
            heads = GraphRunner(lambda _, mode=mode: self._head(mode), self._fill_head, (self.max_seqs,),
                                f"the prefill's first draw ({mode})", "prefill_graphs")
            heads.pool = pool  # one variant replays at a time: they share one pool
            heads.capture()
            pool = heads.pool
            self.heads[mode] = heads

    def _run(self, bucket: int, mode: str) -> None:
        """The loaded bucket's forward, then the head of `mode`: graph replays where captured, else eagerly."""
        if self.graphs is not None and bucket in self.graphs.graphs:
            self.graphs.replay(bucket)
        else:
            self._body(bucket)
        head = self.heads.get(mode)
        if head is not None:
            head.replay(self.max_seqs)
        else:
            self._head(mode)

    def _fill_capture(self, start: int, stop: int) -> None:
        """What bucket `stop` is warmed up and captured on: one sequence filling it whose K/V go
        nowhere (slot -1) and whose head row is the dummy slot's, so the warm-up tunes the attention
        kernel on real work and nothing but the dummy state is written."""
        assert start == 0, "a prefill bucket is captured whole"
        self._load(stop, [stop], np.full(stop, -1), [self.dummy_slot], (0, []))

    def _fill_head(self, start: int, stop: int) -> None:
        """What the heads are warmed up and captured on: every head row on the dummy slot."""
        self._fill_capture(0, self.buckets[0])

    def _fields(self, bucket: int) -> dict[str, slice]:
        """Where each field of `meta` lies for bucket `bucket`: the head's first, in the same place for every
        bucket (the head graphs read them), then the bucket's; each starts at a multiple of `_FIELD_ALIGN`
        elements (the kernels are compiled for 16-byte aligned pointers)."""
        sizes = dict(head_slots=self.max_seqs, prefix_len=1, prefix_table=self.max_prefix_pages,
                     positions=bucket, slot_mapping=bucket, cu_seqlens=self.max_seqs + 1)
        fields, start = {}, 0
        for name, size in sizes.items():
            fields[name] = slice(start, start + size)
            start += -(-size // _FIELD_ALIGN) * _FIELD_ALIGN
        return fields

    def _views(self, bucket: int) -> PackedBatch:
        return PackedBatch(embeds=self.embeds[:bucket],
                           **{name: self.meta[where] for name, where in self._fields(bucket).items()})

    def _load(self, bucket: int, lens: list[int], slot_mapping: np.ndarray, slots: list[int],
              prefix: tuple[int, list[int]]) -> None:
        """The bucket's metadata as `_views` reads it, in one copy: padding rows at position 0 with
        slot -1, empty sequences after the real ones, head rows past them on the dummy slot, the first
        sequence's positions from its prefix length P and the pages of its prefix."""
        n, total = len(lens), sum(lens)
        plen, pages = prefix
        pages = pages[:-(-plen // self.cache.page_size)]  # those the prefix fills
        assert len(pages) <= self.max_prefix_pages, f"a prefix of {plen} rows exceeds max_prefix_pages"
        fields = self._fields(bucket)
        meta = np.zeros(fields["cu_seqlens"].stop, dtype=np.int64)
        f = {name: meta[where] for name, where in fields.items()}  # views
        ends = np.cumsum(lens)
        f["positions"][:total] = np.arange(total) - np.repeat(ends - lens, lens)  # from 0 per sequence
        f["positions"][:lens[0]] += plen  # the first sequence from its prefix on
        f["slot_mapping"][:] = -1
        f["slot_mapping"][:total] = slot_mapping
        f["cu_seqlens"][1:n + 1] = ends
        f["cu_seqlens"][n + 1:] = total
        f["head_slots"][:] = self.dummy_slot
        f["head_slots"][:n] = slots
        f["prefix_len"][0] = plen
        f["prefix_table"][:len(pages)] = pages
        upload(torch.from_numpy(meta), self.meta.device, out=self.meta[:meta.shape[0]])

    def _body(self, bucket: int) -> None:
        """The captured forward of one bucket: `forward_packed` on its views, into `hidden`."""
        v = self._views(bucket)
        self.hidden.copy_(forward_packed(self.talker, self.cache, v.embeds, v.positions, v.slot_mapping,
                                         v.cu_seqlens, v.prefix_table, v.prefix_len))

    @torch.no_grad()
    def _head(self, mode: str) -> None:
        """The captured first draw in sampling variant `mode`: c0 and faults of every head row from `hidden`."""
        params, seeds = self.head_params(self.meta[self._fields(self.buckets[0])["head_slots"]])
        self.faults.zero_()
        self.c0.copy_(step.first_c0(self.talker, self.hidden, params.with_mode(mode), seeds, self.uniform_source,
                                    self.faults))
