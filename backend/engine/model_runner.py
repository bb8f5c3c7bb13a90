"""Device side of the engine: paged talker KV, slot state, prefill and the batched decode step.

The runner makes no policy decision: the engine tells it which slots to prefill with which rows and
which rows (slot, position, pages, frame index) to decode. The sequences started in one step are
prefilled together (`start_batch`): one ragged talker forward over their prompts back to back (see
`models.step.prefill_batch`), then one batched draw of their first c0s, its row count padded to the
decode bucket like a decode step. One decode step (`decode_rows`), for rows [:bucket] of
`GraphBuffers` (all state in place, no host sync, so it is one CUDA graph per bucket on CUDA):

    c1..c15 = code_predictor(past_hidden[slot], last_c0[slot])        uniforms(seed, t)[:, 1:]
    frame   = (last_c0, c1..c15)  -> streaming codec -> pcm [1920]     on CUDA on its own stream, beside:
    x       = C(c0) + sum_g E_g(c_g) + (text_queue[slot, t] if t < text_len else E_pad)
    hidden  = talker(x @ position, paged KV)  -> logits -> c0_next     uniforms(seed, t + 1)[:, 0]
    faults  = slot_faults[slot] | (any of the 16 draws had non-finite scores)
    state[slot] <- (c0_next, hidden, rep_mask | c0_next)               last: a failed step leaves it

With `EngineConfig.codec_pipeline` the codec runs one step behind instead (engine/audio_pipeline.py).
The host's part of a step: `launch` packs the rows' metadata into pinned memory, copies it up without
blocking, replays and queues the outputs' copy down; `land` waits for them (one wait); pipelined,
`collect_audio` the audio. Two steps may be in flight (`EngineConfig.steps_in_flight`): each launch has its
own side of the host buffers.

A row whose sampling scores went non-finite (its prefill draw or any draw of a step) drew id 0 there (the
finite guard of models/sampling.py) and is reported in `DecodeOutput.faults`: the engine ends that sequence.
Padding rows (graph buckets, and on CPU too, so that a row's arithmetic never depends on how many real rows
share the step) use the dummy slot `max_slots`, the dummy page `num_pages` and slot_mapping -1.
`use_graphs(False)` runs the eager step body instead of the captured graphs. On CUDA a prefill whose
prompts fit a token bucket is two graph replays, the bucket's forward and the head of the step's sampling
variant (`PrefillGraphs`); the eager `prefill_batch` serves the rest.
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from q3tts import kernels
from q3tts.models import step
from q3tts.models.attention import PagedKVCache
from q3tts.models.sampling import (FULL, GRAPH_VARIANTS, TOPK, SamplingTensors, UniformSource, graph_variant,
                                  row_mode, sampling_mode, uniforms)
from q3tts.models.transfer import upload

from . import chain_tuning
from .audio_pipeline import AudioPipeline
from .config import EngineConfig
from .cuda_graph import SIDES, DecodeMeta, DecodeRow, GraphBuffers, GraphRunner, WhileWaiting
from .prefill_graph import PrefillGraphs, token_buckets
from .slots import SamplingColumns, SlotState
from .timing import START_LOG, Startup


@dataclass
class PrefillRow:
    slot: int
    sampling: object                        # SamplingParams
    prefill: torch.Tensor                   # prompt rows [L0, H]
    pages: list[int]                        # the sequence's pages, in order
    codec_context: np.ndarray | None = None  # [F, 16] frames primed into the codec stream
    codec_state: list[torch.Tensor] | None = None  # those frames already primed (`prime_state`)
    start: int = 0       # chunked prefill: `prefill` is the piece of the prompt after its first `start` rows
    final: bool = True   # the piece ends the prompt: only then is the sequence started (state, first c0)


class DecodeOutput(NamedTuple):
    """One decode step's results on the host, row i = rows[i]."""

    frames: np.ndarray   # [B, 16] int64
    c0_next: np.ndarray  # [B] int64 (EOS = finished)
    pcm: np.ndarray      # [B, 1920] float32 ([B, 0] without a codec, or pipelined: `collect_audio`)
    faults: np.ndarray   # [B] bool: the row's sampling scores were not finite (its frame is junk)


class ModelRunner:
    def __init__(self, model, codec, config: EngineConfig, pad_row: torch.Tensor,
                 uniform_source: UniformSource | None = None) -> None:
        assert config.num_pages is not None, "EngineConfig.resolve() first"
        self.model, self.talker, self.codec, self.config = model, model.talker, codec, config
        if config.batch_invariant:  # process-wide, left on: EngineConfig.batch_invariant
            kernels.set_batch_invariant(True)
        kernels.set_programmatic_launch(config.programmatic_launch)  # process-wide, as batch_invariant
        self.talker.keep_fp32_residual(config.fp32_residual)
        self.talker.code_predictor.use_fused(config.fused_code_predictor_batch)
        self.talker.use_fused(config.fused_talker_batch)
        tc = model.config.talker
        self.device = torch.device(config.device)
        self.dtype = getattr(torch, config.dtype)
        self.groups = tc.num_code_groups
        self.samples_per_frame = codec.samples_per_frame if codec is not None else 0
        # the codec's own stream: a step decodes its frame's audio beside its talker half (`_decode_audio`),
        # or, pipelined, one step behind (`audio`: engine/audio_pipeline.py)
        pipelined = codec is not None and config.pipelines_codec(self.device)
        self.codec_stream = (torch.cuda.Stream(self.device) if codec is not None and self.device.type == "cuda"
                             and not pipelined else None)
        lc = tc.layers
        self.kv = PagedKVCache(lc.num_layers, config.num_pages + 1, config.page_size, lc.num_kv_heads,
                               lc.head_dim, self.dtype, self.device)
        self.dummy_page, self.dummy_slot = config.num_pages, config.max_slots
        assert codec is None or codec.scratch_slot == self.dummy_slot, "padding rows share one slot id"
        max_pages = config.sequence_pages
        self.meta = DecodeMeta(config.page_size, max_pages, self.dummy_slot, self.dummy_page)
        self.state = SlotState.allocate(config.max_slots, tc.hidden_size, tc.vocab_size,
                                        config.max_text_tokens, self.dtype, self.device)
        self.pad_row = pad_row.to(self.dtype).reshape(-1)  # [H] E_pad
        self.uniform_source = uniform_source or uniforms
        self.buckets = tuple(b for b in config.graph_batch_sizes if b <= config.max_graph_batch)
        self.max_batch = max(config.max_graph_batch, config.max_slots)
        self.buf = GraphBuffers.allocate(self.max_batch, max_pages, self.groups,
                                         max(self.samples_per_frame, 1), self.device)
        self._in_flight: deque[tuple[int, int]] = deque()  # steps launched, not landed: (buffer side, rows)
        self.audio = (AudioPipeline(codec, self.max_batch, self.groups, self.dummy_slot, self.device,
                                    config.codec_sms) if pipelined else None)
        # captured decode steps per sampling mode: TOPK (every row allows it) and FULL (the reference)
        self.graphs: dict[str, GraphRunner] = {}
        self._graphs_on = True
        self.prefill_graphs: PrefillGraphs | None = None  # the captured prefill buckets (CUDA)
        # host copy of each slot's sampling mode (talker, code predictor); the dummy slot is greedy
        self.slot_modes: list[tuple[str, str]] = [(TOPK, TOPK)] * (config.max_slots + 1)
        self.num_decode_steps = 0
        # [S] bool: the slot's prefill draw had non-finite scores (reported with its first decode step)
        self.slot_faults = torch.zeros(config.max_slots + 1, dtype=torch.bool, device=self.device)

    # --- graphs -----------------------------------------------------------------------------------

    @property
    def num_graph_replays(self) -> int:
        """Decode steps run as one graph replay (either sampling variant)."""
        return sum(g.num_replays for g in self.graphs.values())

    @property
    def graph_buckets(self) -> tuple[int, ...]:
        """The decode batch sizes captured as CUDA graphs (none on CPU or with use_cuda_graphs off)."""
        return tuple(sorted(self.graphs[TOPK].graphs)) if self.graphs else ()

    def use_graphs(self, on: bool) -> None:
        """Replay the captured graphs (True, the default) or run the eager step body (False), for both
        sampling variants; e.g. to compare the two on the same rows. No effect when none were captured."""
        self._graphs_on = on

    def capture_graphs(self, startup: Startup) -> None:
        """Capture the prefill for every token bucket (`prefill_graphs`) and the decode step for every
        bucket and both sampling variants (`use_cuda_graphs`); CUDA only. Each part's time goes into
        `startup`."""
        if self.device.type != "cuda":
            return
        if self.config.prefill_graphs:
            with startup.phase("prefill graphs"):
                self.prefill_graphs = self.packed_prefill()
                self.prefill_graphs.capture()
        if not self.config.use_cuda_graphs:
            return
        self._chain_tune(startup)
        # NOTE: kernels tune on their first launch; GraphRunner.capture warms every bucket up first
        pool = None
        with torch.no_grad():
            for mode in GRAPH_VARIANTS:
                with startup.phase(f"decode graphs {mode}"):
                    graphs = GraphRunner(lambda bs, mode=mode: self.decode_rows(bs, mode), self._fill_padding,
                                         self.buckets)
                    graphs.pool = pool  # one variant replays at a time: they share one pool
                    graphs.capture()
                pool = graphs.pool
                self.graphs[mode] = graphs
        if self.audio is not None:
            with startup.phase("codec graphs"):
                self.audio.capture(self.buckets)

    def _chain_tune(self, startup: Startup) -> None:
        """`EngineConfig.chain_tune`: tune the launch configs of the fused code predictor's passes, then of the
        fused talker's decode forward (over this runner's KV cache, before any sequence holds a page, in block
        tables as wide as the step's), each on its captured chain (engine/chain_tuning.py), where it serves the
        step (not under `fp32_residual`, nor with the kernels off), unless the tuning table (`tune_cache`) says
        that was done; the decode graphs captured next take the result."""
        cp, talker, config = self.talker.code_predictor.fused, self.talker.fused, self.config
        parts = []
        if cp is not None and cp.serves(self.pad_row):
            parts.append((chain_tuning.CodePredictorPasses(cp),
                          config.chain_tune_batches(config.fused_code_predictor_batch)))
        if talker is not None and talker.serves(self.pad_row):
            parts.append((chain_tuning.TalkerDecode(talker, self.kv, width=self.meta.max_pages),
                          config.chain_tune_batches(config.fused_talker_batch)))
        for part, batches in parts:
            if not batches or not chain_tuning.needs_tuning(part, batches):
                continue
            with startup.phase("chain tuning"), torch.no_grad():
                result = chain_tuning.tune(part, batches)
            START_LOG.info("chain tuning of the %s: %s", part.name, result.summary())

    def packed_prefill(self) -> PrefillGraphs:
        """The token-bucketed prefill over this runner's talker, KV and slots, for up to max_slots
        sequences (it runs eagerly until captured)."""
        return PrefillGraphs(self.talker, self.kv, self._talker_sampling,
                             self.uniform_source, self.config.max_slots, self.dummy_slot,
                             token_buckets(self.config.max_prefill_tokens), self.dtype, self.device,
                             self.config.pages_for(self.config.max_prompt_tokens))

    # --- per sequence -----------------------------------------------------------------------------

    @torch.no_grad()
    def start_batch(self, rows: list[PrefillRow]) -> None:
        """Start several sequences (distinct slots) with one talker forward over all prompts. A row may
        be a piece of its prompt (chunked prefill: `PrefillRow.start`, `final`): its K/V fill the
        prompt's pages after the earlier pieces', and it attends to those; the sequence is started (slot
        state reset, first c0 drawn) with the piece that ends its prompt. The captured prefill buckets
        take a piece after earlier rows as the first row only (as the scheduler orders them); any
        other mix runs the eager forward.

        A sequence's result does not depend on the others as far as the talker's GEMMs give a row the
        same bits whatever the row count (true on the CPU test sizes; on CUDA and for large CPU
        GEMMs only up to rounding); the sampling head is padded to the decode bucket for that."""
        if not rows:
            return
        st = self.state
        self._load_sampling(rows)  # every row's head draw reads its slot's parameters
        final = [i for i, r in enumerate(rows) if r.final]
        started = [rows[i] for i in final]
        sl = upload(torch.tensor([r.slot for r in started], dtype=torch.int64), self.device)
        if self.codec is not None:
            with self.audio.ordered() if self.audio is not None else contextlib.nullcontext():
                self._prime_codec(started)
        if len(started) == len(rows):
            c0, hidden, faults = self._prefill(rows, sl)
        else:  # the draws of pieces that do not end their prompt are dropped
            every = upload(torch.tensor([r.slot for r in rows], dtype=torch.int64), self.device)
            c0, hidden, faults = self._prefill(rows, every)
            index = upload(torch.tensor(final, dtype=torch.int64), self.device)
            c0, hidden, faults = c0[index], hidden[index], faults[index]
        # the prefill reads neither: written once it is launched, with scalar fills (`x[sl] = False` would copy a
        # host scalar up, waiting for the stream: the prefill included, models/transfer.py)
        st.rep_mask.index_fill_(0, sl, False)
        st.text_len.index_fill_(0, sl, 0)
        st.last_c0[sl] = c0
        st.past_hidden[sl] = hidden
        self.slot_faults[sl] = faults
        _mark_generated(st.rep_mask, sl, c0)

    def _prefill(self, rows: list[PrefillRow], sl: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows' prompts in one talker forward -> their first c0 [n], hidden [n, H] and sampling faults
        [n]: a prefill graph replay when they fit a captured token bucket, else the eager `prefill_batch`."""
        n, lens, mapping = len(rows), [r.prefill.shape[0] for r in rows], self._slot_mapping(rows)
        graphs = self.prefill_graphs
        packs = all(r.start == 0 for r in rows[1:])
        mode = sampling_mode(self.slot_modes[r.slot][0] for r in rows)
        if packs and graphs is not None and graphs.bucket_for(sum(lens), n) is not None:
            first = rows[0]
            c0, hidden = graphs.run([r.prefill for r in rows], mapping, [r.slot for r in rows],
                                    (first.start, first.pages) if first.start else None, graph_variant([mode]))
            return c0, hidden, graphs.faults[:n]
        head_sl = self._pad_slots(sl)  # sampling head rows: the decode bucket, padding rows greedy
        embeds = torch.cat([r.prefill.to(self.device, self.dtype) for r in rows])  # [sum L0, H]
        faults = torch.zeros(head_sl.shape[0], dtype=torch.bool, device=self.device)
        prefixes = None if all(r.start == 0 for r in rows) else [
            torch.from_numpy(_cache_slots(r.pages, 0, r.start, self.kv.page_size)).to(self.device)
            if r.start else None for r in rows]
        c0, hidden = step.prefill_batch(self.talker, self.kv, embeds, lens,
                                        torch.from_numpy(mapping).to(self.device),
                                        *self._talker_sampling(head_sl, mode),
                                        self.uniform_source, faults=faults, prefixes=prefixes)
        return c0[:n], hidden[:n], faults[:n]

    def _load_sampling(self, rows: list[PrefillRow]) -> None:
        """The rows' SamplingParams into their slots' state, and each slot's host sampling modes."""
        self.state.load_sampling([r.slot for r in rows], [r.sampling for r in rows])
        for r in rows:
            p = r.sampling
            self.slot_modes[r.slot] = (row_mode(p.greedy, p.top_k, _f32(p.top_p)),
                                       row_mode(p.cp_greedy, p.subtalker_top_k, _f32(p.subtalker_top_p)))

    def prime_state(self, context: np.ndarray | None) -> list[torch.Tensor] | None:
        """Base ICL: the codec state of a stream primed with reference frames `context` [F, 16] (None
        when there is nothing to prime). Private tensors (`StreamingDecoder.prime_state`), so the
        preparer's thread makes it while the engine steps; decoded alone in a call padded to the decode
        bucket, so its bits depend on no other stream."""
        if self.codec is None or context is None or not len(context):
            return None
        codes = torch.as_tensor(context).T  # [16, F] (host; moved on the codec's own stream)
        return self.codec.prime_state(codes, self.config.bucket_for(1) or 1)

    def _prime_codec(self, rows: list[PrefillRow]) -> None:
        """Reset the rows' codec streams; Base ICL: load each one's primed state instead (made off the
        engine thread by the preparer; made here only for a row that came without one)."""
        states = {r.slot: r.codec_state if r.codec_state is not None else self.prime_state(r.codec_context)
                  for r in rows}
        self.codec.reset([slot for slot, state in states.items() if state is None])
        primed = {slot: state for slot, state in states.items() if state is not None}
        if primed:
            self.codec.load_states(list(primed), list(primed.values()))

    def _pad_slots(self, sl: torch.Tensor) -> torch.Tensor:
        """slots [n] -> [bucket]: padded to the decode bucket with the dummy slot."""
        n = sl.shape[0]
        return torch.cat((sl, sl.new_full(((self.config.bucket_for(n) or n) - n,), self.dummy_slot)))

    def _slot_mapping(self, rows: list[PrefillRow]) -> np.ndarray:
        """[sum L0] (host): each prompt row's KV cache slot (positions start.. of each row's piece)."""
        return np.concatenate([_cache_slots(r.pages, r.start, r.start + r.prefill.shape[0], self.kv.page_size)
                               for r in rows])

    @torch.no_grad()
    def push_text(self, slot: int, start: int, rows: torch.Tensor) -> None:
        """Trailing text rows [k, H] (on the device) for frames start..start+k-1 of the slot; no host sync."""
        k = rows.shape[0]
        self.state.text_queue[slot, start:start + k] = rows.to(self.dtype)
        # fill_, not `text_len[slot] = n`: a Python number written into a 0-dim CUDA view is a blocking host copy,
        # which made every text push (Base ICL's text, a streamed piece) wait for the prefill or step in flight
        self.state.text_len[slot:slot + 1].fill_(start + k)

    # --- the batched step -------------------------------------------------------------------------

    @torch.no_grad()
    def decode(self, rows: list[DecodeRow]) -> DecodeOutput:
        """One decode step for `rows`, its audio included (none may be in flight); its results on the host,
        valid until the launch after next."""
        self.launch(rows)
        out = self.land()
        return out if self.audio is None else out._replace(pcm=self.audio.collect())

    @torch.no_grad()
    def launch(self, rows: list[DecodeRow]) -> None:
        """Start one decode step for `rows` without waiting for it (`land` waits); pipelined, its audio
        too, on the codec's stream (`collect_audio`). A row's metadata is packed before anything runs. Up to
        `GraphBuffers` SIDES steps may be in flight: the next one's inputs are the slots' state as this one
        leaves it (stream order)."""
        n = len(rows)
        bucket = self.config.bucket_for(n) if n <= self.max_batch else None
        bucket = bucket if bucket is not None and bucket <= self.max_batch else n
        if len(self._in_flight) == SIDES:
            raise RuntimeError("ModelRunner: land the steps in flight first")
        if self.audio is not None:
            self.audio.before_step()
        self._load(0, bucket, rows)
        self.run_step(bucket, self.step_mode([r.slot for r in rows]))
        self.num_decode_steps += 1
        self._in_flight.append((self.buf.send_back(n, self.codec is not None and self.audio is None), n))
        if self.audio is not None:
            self.audio.launch(bucket, n, DecodeMeta.columns(self.buf.meta).slot, self.buf.frames)

    def land(self, while_waiting: WhileWaiting | None = None) -> DecodeOutput:
        """The results of the oldest step in flight, once it has run (`while_waiting`: GraphBuffers.fetch)."""
        side, n = self._in_flight.popleft()
        return DecodeOutput(*self.buf.fetch(side, n, self.codec is not None and self.audio is None, while_waiting))

    def collect_audio(self, while_waiting: WhileWaiting | None = None) -> np.ndarray:
        """Pipelined: pcm [n, samples] of the oldest launched step not collected yet (waits for it, running
        `while_waiting` meanwhile)."""
        return self.audio.collect(while_waiting)

    def step_mode(self, slots: list[int]) -> str:
        """The sampling variant of a step over these slots: TOPK when every row allows it, else FULL."""
        return graph_variant(m for s in slots for m in self.slot_modes[s])

    def run_step(self, bucket: int, mode: str) -> None:
        """The step on rows [:bucket] as loaded: a graph replay when one is captured (and on), else eager."""
        graphs = self.graphs.get(mode) if self._graphs_on else None
        if graphs is not None and graphs.pad(bucket) == bucket:
            graphs.replay(bucket)
        else:
            self.decode_rows(bucket, mode)

    def _fill_padding(self, start: int, stop: int) -> None:
        self._load(start, stop, [])

    def _load(self, start: int, stop: int, rows: list[DecodeRow]) -> None:
        """Rows [start, stop) of the step's metadata = `rows`, then padding rows."""
        self.meta.pack(rows, *self.buf.staging(start, stop))
        self.buf.load(start, stop)

    @staticmethod
    def talker_params(p: SamplingColumns, mode: str = FULL) -> SamplingTensors:
        """The talker's sampling parameters of some slots' rows (`SlotState.sampling_rows`), as tensors of the
        given mode."""
        return SamplingTensors(p.temperature, p.top_k, p.top_p, p.repetition_penalty, p.greedy).with_mode(mode)

    @staticmethod
    def sub_params(p: SamplingColumns, mode: str = FULL) -> SamplingTensors:
        """The code predictor's sampling parameters of some slots' rows (no repetition penalty)."""
        return SamplingTensors(p.sub_temperature, p.sub_top_k, p.sub_top_p, torch.ones_like(p.sub_temperature),
                               p.sub_greedy).with_mode(mode)

    def _talker_sampling(self, sl: torch.Tensor, mode: str = FULL) -> tuple[SamplingTensors, torch.Tensor]:
        """(the talker's sampling parameters, seeds [B]) of slots `sl` [B]: what a prefill's first draw takes."""
        p = self.state.sampling_rows(sl)
        return self.talker_params(p, mode), p.seed

    def decode_rows(self, bs: int, mode: str = TOPK) -> None:
        """The step body on rows [:bs] of the static buffers (captured as-is into a CUDA graph), sampling
        in `mode` (TOPK: the caller vouches every row allows it; FULL: any row)."""
        st, buf = self.state, self.buf
        row = DecodeMeta.columns(buf.meta[:bs])  # [B] each
        queue_row = row.frame.clamp(max=st.text_queue.shape[1] - 1)
        text = st.text_queue[row.slot, queue_row]  # [B, H]
        text = torch.where((row.frame < st.text_len[row.slot])[:, None], text, self.pad_row[None, :])
        sl = row.slot
        sampling = st.sampling_rows(sl)
        batch = step.DecodeBatch(
            c0=st.last_c0[sl], past_hidden=st.past_hidden[sl], text=text, positions=row.position,
            slot_mapping=row.slot_mapping, block_tables=buf.tables[:bs],
            context_lens=row.context_len.int(), generated=st.rep_mask[sl], num_generated=row.frame + 1,
            seeds=sampling.seed, counters=row.frame)
        faults = self.slot_faults[sl]  # [B] a fault of the row's prefill draw is reported with this step
        buf.frames[:bs], next_input = step.predict_frame(self.talker, batch, self.sub_params(sampling, mode),
                                                         self.uniform_source, faults)  # [B, 16], [B, H]
        if self.audio is not None:
            self.audio.frames_made()  # its codec runs one step behind (engine/audio_pipeline.py)
        else:
            self._decode_audio(bs, sl)
        c0_next, hidden = step.advance(self.talker, self.kv, batch, next_input, self.talker_params(sampling, mode),
                                       self.uniform_source, faults)  # [B], [B, H]
        buf.faults[:bs] = faults
        buf.c0_next[:bs] = c0_next
        if self.codec_stream is not None:  # join the audio branch
            torch.cuda.current_stream(self.device).wait_stream(self.codec_stream)
        # the slots' talker state last, after all work that can fail: a failed step leaves it as it was
        # (what a retry of its rows reads: engine/isolation.py)
        st.last_c0[sl] = c0_next
        st.past_hidden[sl] = hidden
        _mark_generated(st.rep_mask, sl, c0_next)

    def _decode_audio(self, bs: int, sl: torch.Tensor) -> None:
        """pcm [:bs] of the frames [:bs] in the step's buffers (slots `sl` [bs]). On CUDA the codec runs on its
        own stream, forked here, beside the talker half of the step (the step joins it before the talker state
        is written; captured into the step's graph as two branches): the codec reads only the static frames
        and slots and its own state."""
        if self.codec is None:
            return
        if self.codec_stream is not None:
            self.codec_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.codec_stream):  # None (CPU): in line
            self.buf.pcm[:bs].copy_(self.codec.decode_frame(sl, self.buf.frames[:bs]))


def _cache_slots(pages: list[int], start: int, stop: int, page_size: int) -> np.ndarray:
    """[stop - start] int64: the KV cache slots of positions start..stop-1 of a sequence holding `pages`
    (position p -> its page p // page_size, offset p % page_size)."""
    positions = np.arange(start, stop)
    return np.asarray(pages, dtype=np.int64)[positions // page_size] * page_size + positions % page_size


def _f32(x: float) -> float:
    """x as the float32 the slot state holds (the processors compare that value)."""
    return float(np.float32(x))


def _mark_generated(rep_mask: torch.Tensor, slots: torch.Tensor, ids: torch.Tensor) -> None:
    """rep_mask[slots, ids] = True without a host scalar: `x[i, j] = True` copies a CPU tensor to the
    device, which CUDA graph capture refuses."""
    rep_mask.index_put_((slots, ids), torch.ones_like(ids, dtype=torch.bool))
