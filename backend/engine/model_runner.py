"""Device side of the engine: paged talker KV, slot state, prefill and the batched decode step.

The runner makes no policy decision: the engine tells it which slots to prefill with which rows and
which rows (slot, position, pages, frame index) to decode. The sequences started in one step are
prefilled together (`start_batch`): one ragged talker forward over their prompts back to back (see
`models.step.prefill_batch`), then one batched draw of their first c0s, its row count padded to the
decode bucket like a decode step. One decode step, for rows [:bucket] of
`GraphBuffers` (all state in place, no host sync, so it is one CUDA graph per bucket on CUDA):

    c1..c15 = code_predictor(past_hidden[slot], last_c0[slot])        uniforms(seed, t)[:, 1:]
    frame   = (last_c0, c1..c15)  -> streaming codec -> pcm [1920]
    x       = C(c0) + sum_g E_g(c_g) + (text_queue[slot, t] if t < text_len else E_pad)
    hidden  = talker(x @ position, paged KV)  -> logits -> c0_next     uniforms(seed, t + 1)[:, 0]
    state[slot] <- (c0_next, hidden, rep_mask | c0_next)

Padding rows (graph buckets, and on CPU too, so that a row's arithmetic never depends on how many
real rows share the step) use the dummy slot `max_slots`, the dummy page `num_pages` and
slot_mapping -1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from q3tts.models import step
from q3tts.models.attention import PagedKVCache
from q3tts.models.sampling import FULL, TOPK, SamplingTensors, row_mode, sampling_mode, uniforms

from .config import EngineConfig
from .cuda_graph import (META_COLS, META_CTX, META_FRAME, META_POS, META_SLOT, META_SLOT_MAP,
                         GraphBuffers, GraphRunner)
from .slots import SlotState

UniformSource = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (seeds [B], counters [B]) -> [B, 16]


@dataclass
class PrefillRow:
    slot: int
    sampling: object                        # SamplingParams
    prefill: torch.Tensor                   # prompt rows [L0, H]
    pages: list[int]                        # the sequence's pages, in order
    codec_context: np.ndarray | None = None  # [F, 16] frames primed into the codec stream


@dataclass
class DecodeRow:
    slot: int
    position: int      # KV position of the token this step writes (= prompt_len + frame)
    frame: int         # index of the frame this step makes
    pages: list[int]   # the sequence's pages, in order


class ModelRunner:
    def __init__(self, model, codec, config: EngineConfig, pad_row: torch.Tensor,
                 uniform_source: UniformSource | None = None) -> None:
        assert config.num_pages is not None, "EngineConfig.resolve() first"
        self.model, self.talker, self.codec, self.config = model, model.talker, codec, config
        tc = model.config.talker
        self.device = torch.device(config.device)
        self.dtype = getattr(torch, config.dtype)
        self.groups = tc.num_code_groups
        self.samples_per_frame = codec.samples_per_frame if codec is not None else 0
        lc = tc.layers
        self.kv = PagedKVCache(lc.num_layers, config.num_pages + 1, config.page_size, lc.num_kv_heads,
                               lc.head_dim, self.dtype, self.device)
        self.dummy_page, self.dummy_slot = config.num_pages, config.max_slots
        assert codec is None or codec.scratch_slot == self.dummy_slot, "padding rows share one slot id"
        self.max_pages = config.pages_for(config.max_prompt_tokens + config.max_frames)
        self.state = SlotState.allocate(config.max_slots, tc.hidden_size, tc.vocab_size,
                                        config.max_text_tokens, self.dtype, self.device)
        self.pad_row = pad_row.to(self.dtype).reshape(-1)  # [H] E_pad
        self.uniform_source = uniform_source or uniforms
        self.buckets = tuple(b for b in config.graph_batch_sizes if b <= config.max_graph_batch)
        self.max_batch = max(config.max_graph_batch, config.max_slots)
        self.buf = GraphBuffers.allocate(self.max_batch, self.max_pages, self.groups,
                                         max(self.samples_per_frame, 1), self.device)
        self.graphs: GraphRunner | None = None  # steps whose rows all allow the TOPK sampling mode
        self.graphs_full: GraphRunner | None = None  # the same steps with the reference (FULL) sampling
        # host copy of each slot's sampling mode (talker, code predictor); the dummy slot is greedy
        self.slot_modes: list[tuple[str, str]] = [(TOPK, TOPK)] * (config.max_slots + 1)
        self.num_decode_steps = 0

    @property
    def num_graph_replays(self) -> int:
        """Decode steps run as one graph replay (either sampling variant)."""
        return sum(g.num_replays for g in (self.graphs, self.graphs_full) if g is not None)

    def capture_graphs(self) -> None:
        """Capture the decode step for every bucket (CUDA only)."""
        if self.device.type != "cuda" or not self.config.use_cuda_graphs:
            return
        # NOTE: kernels tune on their first launch; GraphRunner.capture warms every bucket up first
        self.graphs = GraphRunner(self._decode_rows, self._fill_padding, self.buckets)
        self.graphs_full = GraphRunner(lambda bs: self._decode_rows(bs, fast=False), self._fill_padding,
                                       self.buckets)
        with torch.no_grad():
            self.graphs.capture()
            self.graphs_full.pool = self.graphs.pool  # one variant replays at a time: share the pool
            self.graphs_full.capture()

    # --- per sequence -----------------------------------------------------------------------------

    @torch.no_grad()
    def start_batch(self, rows: list[PrefillRow]) -> None:
        """`start` for several sequences (distinct slots) with one talker forward over all prompts.

        A sequence's result does not depend on the others as far as the talker's GEMMs give a row the
        same bits whatever the row count (true on the CPU test sizes; on CUDA and for large CPU
        GEMMs only up to rounding); the sampling head is padded to the decode bucket for that."""
        if not rows:
            return
        st, page_size = self.state, self.kv.page_size
        st.load_sampling([r.slot for r in rows], [r.sampling for r in rows])
        for r in rows:
            self.slot_modes[r.slot] = (
                row_mode(r.sampling.greedy, r.sampling.top_k, _f32(r.sampling.top_p)),
                row_mode(r.sampling.cp_greedy, r.sampling.subtalker_top_k, _f32(r.sampling.subtalker_top_p)))
        n = len(rows)
        sl = torch.tensor([r.slot for r in rows], device=self.device)
        st.rep_mask[sl] = False
        st.text_len[sl] = 0
        if self.codec is not None:
            self.codec.reset([r.slot for r in rows])
            by_frames: dict[int, list[int]] = {}  # contexts of equal length primed in one call
            for i, r in enumerate(rows):
                if r.codec_context is not None and len(r.codec_context):
                    by_frames.setdefault(len(r.codec_context), []).append(i)
            for idx in by_frames.values():
                context = torch.stack([torch.as_tensor(rows[i].codec_context, device=self.device).T
                                       for i in idx])  # [G, 16, F]
                # padded to the decode bucket on the dummy slot (= the codec's scratch slot), so a
                # stream's bits do not depend on how many others are primed with it
                pad = (self.config.bucket_for(len(idx)) or len(idx)) - len(idx)
                slots = torch.cat((sl[idx], sl.new_full((pad,), self.dummy_slot)))
                context = torch.cat((context, context.new_zeros((pad, *context.shape[1:]))))
                self.codec.decode_chunk(slots, context)
        lens = [r.prefill.shape[0] for r in rows]
        slot_mapping = np.concatenate([
            np.asarray(r.pages, dtype=np.int64)[np.arange(L) // page_size] * page_size + np.arange(L) % page_size
            for r, L in zip(rows, lens)])
        embeds = torch.cat([r.prefill.to(self.device, self.dtype) for r in rows])
        # sampling head rows: the decode bucket, padding rows on the dummy slot (greedy)
        bucket = self.config.bucket_for(n)
        head = bucket if bucket is not None else n
        head_sl = torch.cat((sl, sl.new_full((head - n,), self.dummy_slot)))
        mode = sampling_mode(self.slot_modes[r.slot][0] for r in rows)
        c0, hidden = step.prefill_batch(self.talker, self.kv, embeds, lens,
                                        torch.from_numpy(slot_mapping).to(self.device),
                                        self._talker_params(head_sl, mode), st.seed[head_sl],
                                        self.uniform_source)
        c0, hidden = c0[:n], hidden[:n]
        st.last_c0[sl] = c0
        st.past_hidden[sl] = hidden
        _mark_generated(st.rep_mask, sl, c0)

    @torch.no_grad()
    def push_text(self, slot: int, start: int, rows: torch.Tensor) -> None:
        """Trailing text rows [k, H] for frames start..start+k-1 of the slot."""
        k = rows.shape[0]
        self.state.text_queue[slot, start:start + k] = rows.to(self.dtype)
        self.state.text_len[slot] = start + k

    # --- the batched step -------------------------------------------------------------------------

    @torch.no_grad()
    def decode(self, rows: list[DecodeRow]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One decode step for `rows`: returns frames [B, 16], c0_next [B], pcm [B, 1920] (host)."""
        n = len(rows)
        bucket = self.config.bucket_for(n) if n <= self.max_batch else None
        bucket = bucket if bucket is not None and bucket <= self.max_batch else n
        meta = np.zeros((bucket, META_COLS), dtype=np.int64)
        tables = np.zeros((bucket, self.max_pages), dtype=np.int32)
        self._padding_meta(meta, tables)
        for i, r in enumerate(rows):
            page = r.pages[r.position // self.kv.page_size]
            meta[i] = (r.slot, r.position, page * self.kv.page_size + r.position % self.kv.page_size,
                       r.position + 1, r.frame)
            tables[i, :len(r.pages)] = r.pages
        self.buf.meta[:bucket].copy_(torch.from_numpy(meta))
        self.buf.tables[:bucket].copy_(torch.from_numpy(tables))
        fast = sampling_mode(m for r in rows for m in self.slot_modes[r.slot]) != FULL
        graphs = self.graphs if fast else self.graphs_full
        if graphs is not None and graphs.pad(bucket) == bucket:
            graphs.replay(bucket)
        else:
            self._decode_rows(bucket, fast)
        self.num_decode_steps += 1
        frames = self.buf.frames[:n].cpu().numpy()
        c0_next = self.buf.c0_next[:n].cpu().numpy()
        pcm = self.buf.pcm[:n].cpu().numpy() if self.codec is not None else np.zeros((n, 0), np.float32)
        return frames, c0_next, pcm

    def _padding_meta(self, meta: np.ndarray, tables: np.ndarray) -> None:
        meta[:, META_SLOT] = self.dummy_slot
        meta[:, META_POS] = 0
        meta[:, META_SLOT_MAP] = -1
        meta[:, META_CTX] = 1
        meta[:, META_FRAME] = 0
        tables[:] = self.dummy_page

    def _fill_padding(self, start: int, stop: int) -> None:
        meta = np.zeros((stop - start, META_COLS), dtype=np.int64)
        tables = np.zeros((stop - start, self.max_pages), dtype=np.int32)
        self._padding_meta(meta, tables)
        self.buf.meta[start:stop].copy_(torch.from_numpy(meta))
        self.buf.tables[start:stop].copy_(torch.from_numpy(tables))

    def _talker_params(self, sl: torch.Tensor, mode: str = FULL) -> SamplingTensors:
        st = self.state
        return SamplingTensors(st.temperature[sl], st.top_k[sl], st.top_p[sl],
                               st.repetition_penalty[sl], st.greedy[sl]).with_mode(mode)

    def _sub_params(self, sl: torch.Tensor, mode: str = FULL) -> SamplingTensors:
        st = self.state
        return SamplingTensors(st.sub_temperature[sl], st.sub_top_k[sl], st.sub_top_p[sl],
                               torch.ones_like(st.sub_temperature[sl]), st.sub_greedy[sl]).with_mode(mode)

    def _decode_rows(self, bs: int, fast: bool = True) -> None:
        """The step body on rows [:bs] of the static buffers (captured as-is into a CUDA graph).

        fast: sample in the TOPK mode (the caller vouches every row allows it), else FULL."""
        st, buf = self.state, self.buf
        meta = buf.meta[:bs]
        sl, pos, frame = meta[:, META_SLOT], meta[:, META_POS], meta[:, META_FRAME]  # [B] each
        queue_row = frame.clamp(max=st.text_queue.shape[1] - 1)
        text = st.text_queue[sl, queue_row]  # [B, H]
        text = torch.where((frame < st.text_len[sl])[:, None], text, self.pad_row[None, :])
        batch = step.DecodeBatch(
            c0=st.last_c0[sl], past_hidden=st.past_hidden[sl], text=text, positions=pos,
            slot_mapping=meta[:, META_SLOT_MAP], block_tables=buf.tables[:bs],
            context_lens=meta[:, META_CTX].int(), generated=st.rep_mask[sl], num_generated=frame + 1,
            seeds=st.seed[sl], counters=frame)
        mode = TOPK if fast else FULL
        result = step.decode_step(self.talker, self.kv, batch, self._talker_params(sl, mode),
                                  self._sub_params(sl, mode), self.uniform_source)
        frames, c0_next, hidden = result.codes, result.next_c0, result.hidden  # [B, 16], [B], [B, H]
        buf.frames[:bs] = frames
        buf.c0_next[:bs] = c0_next
        st.last_c0[sl] = c0_next
        st.past_hidden[sl] = hidden
        _mark_generated(st.rep_mask, sl, c0_next)
        if self.codec is not None:
            buf.pcm[:bs] = self.codec.decode_frame(sl, frames).float()


def _f32(x: float) -> float:
    """x as the float32 the slot state holds (the processors compare that value)."""
    return float(np.float32(x))


def _mark_generated(rep_mask: torch.Tensor, slots: torch.Tensor, ids: torch.Tensor) -> None:
    """rep_mask[slots, ids] = True without a host scalar: `x[i, j] = True` copies a CPU tensor to the
    device, which CUDA graph capture refuses."""
    rep_mask.index_put_((slots, ids), torch.ones_like(ids, dtype=torch.bool))
