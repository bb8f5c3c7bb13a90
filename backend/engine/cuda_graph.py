"""CUDA graphs for the decode step: capture / pad / replay, and the step's static buffers.

One graph per batch bucket, captured largest first into one shared memory pool, after a warm-up run
of the same bucket (so lazily built buffers, autotuned kernels and the allocator are settled). Every
input and output of the step lives in one `GraphBuffers`; the step reads rows [:bucket] of it.
`DecodeMeta` is the one definition of the per-row metadata layout (`pack` writes it, `columns`
reads it). During capture all rows are padding (dummy slot, slot_mapping -1, dummy page), so
capturing touches only the dummy state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np
import torch

from q3tts import kernels


@dataclass
class DecodeRow:
    """One sequence of a decode step, as the engine gives it."""

    slot: int
    position: int      # KV position of the token this step writes (= prompt_len + frame)
    frame: int         # index of the frame this step makes
    pages: list[int]   # the sequence's pages, in order


class DecodeColumns(NamedTuple):
    """The columns of one row of `GraphBuffers.meta`, in order (ints when packing, [B] views when read)."""

    slot: int | torch.Tensor          # state slot (the dummy slot on padding rows)
    position: int | torch.Tensor      # KV position this step writes
    slot_mapping: int | torch.Tensor  # KV cache slot of that position (-1 = padding row)
    context_len: int | torch.Tensor   # tokens attended (= position + 1)
    frame: int | torch.Tensor         # index of the frame this step makes


@dataclass(frozen=True)
class DecodeMeta:
    """Packs decode rows into the step's metadata: meta [B, 5] int64 (`DecodeColumns`) and the block
    table [B, max_pages] int32 (the paged attention kernel's contract), padded with the dummy page.
    Rows past the real ones are padding rows: dummy slot, slot_mapping -1, the dummy page."""

    page_size: int
    max_pages: int
    dummy_slot: int
    dummy_page: int

    NUM_COLUMNS = len(DecodeColumns._fields)

    def pack(self, rows: list[DecodeRow], num_rows: int) -> tuple[np.ndarray, np.ndarray]:
        """`rows` then padding up to `num_rows` -> (meta [num_rows, 5] int64, tables [num_rows, P] int32)."""
        meta = np.empty((num_rows, self.NUM_COLUMNS), dtype=np.int64)
        meta[:] = DecodeColumns(slot=self.dummy_slot, position=0, slot_mapping=-1, context_len=1, frame=0)
        tables = np.full((num_rows, self.max_pages), self.dummy_page, dtype=np.int32)
        for i, r in enumerate(rows):
            # slot and page ids are valid by construction (SlotPool / KVPool hand out range ids); the slot
            # and the table width are asserted here, where they meet the device indexes
            assert 0 <= r.slot < self.dummy_slot and len(r.pages) <= self.max_pages, (r.slot, len(r.pages))
            page = r.pages[r.position // self.page_size]
            meta[i] = DecodeColumns(slot=r.slot, position=r.position,
                                    slot_mapping=page * self.page_size + r.position % self.page_size,
                                    context_len=r.position + 1, frame=r.frame)
            tables[i, :len(r.pages)] = r.pages
        return meta, tables

    @staticmethod
    def columns(meta: torch.Tensor) -> DecodeColumns:
        """meta [B, 5] -> its columns as [B] views (strided: kernels read index vectors by stride)."""
        return DecodeColumns(*meta.unbind(1))


@dataclass
class GraphBuffers:
    """Static inputs/outputs of one decode step, sized for the largest bucket."""

    meta: torch.Tensor      # [Bmax, 5] int64, rows of `DecodeColumns`
    tables: torch.Tensor    # [Bmax, P] int32 block tables
    frames: torch.Tensor    # [Bmax, 16] int64 codes of the frame made this step
    c0_next: torch.Tensor   # [Bmax] int64 first code of the next frame (EOS = finished)
    pcm: torch.Tensor       # [Bmax, samples_per_frame] float32
    faults: torch.Tensor    # [Bmax] bool: the row's sampling scores were not finite (models/step.py)

    @classmethod
    def allocate(cls, max_batch: int, max_pages: int, groups: int, samples: int,
                 device: torch.device) -> GraphBuffers:
        return cls(meta=torch.zeros(max_batch, DecodeMeta.NUM_COLUMNS, dtype=torch.int64, device=device),
                   tables=torch.zeros(max_batch, max_pages, dtype=torch.int32, device=device),
                   frames=torch.zeros(max_batch, groups, dtype=torch.int64, device=device),
                   c0_next=torch.zeros(max_batch, dtype=torch.int64, device=device),
                   pcm=torch.zeros(max_batch, samples, dtype=torch.float32, device=device),
                   faults=torch.zeros(max_batch, dtype=torch.bool, device=device))

    def load(self, start: int, meta: np.ndarray, tables: np.ndarray) -> None:
        """Rows [start, start + len(meta)) = packed `DecodeMeta` rows (two host-to-device copies)."""
        stop = start + meta.shape[0]
        self.meta[start:stop].copy_(torch.from_numpy(meta))
        self.tables[start:stop].copy_(torch.from_numpy(tables))


class GraphRunner:
    """Captured steps keyed by bucket; `step_fn(bucket)` runs one step on rows [:bucket].

    what / switch: the captured work and the EngineConfig flag that turns it off (capture errors)."""

    def __init__(self, step_fn: Callable[[int], None], fill_padding: Callable[[int, int], None],
                 batch_sizes: tuple[int, ...], what: str = "the decode step",
                 switch: str = "use_cuda_graphs") -> None:
        self.step_fn = step_fn
        self.what, self.switch = what, switch
        self.fill_padding = fill_padding  # (start, stop): make rows [start, stop) padding rows
        self.batch_sizes = batch_sizes
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.num_replays = 0

    def capture(self) -> None:
        stream = torch.cuda.Stream()
        for bs in sorted(self.batch_sizes, reverse=True):
            self.fill_padding(0, bs)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), kernels.tuning():
                self.step_fn(bs)  # warm-up: lazy buffers, kernel tuning (this bucket's shapes), allocator
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=self.pool):
                    self.step_fn(bs)
            except RuntimeError as exc:
                raise RuntimeError(
                    f"CUDA graph capture of {self.what} failed at bucket {bs}: {exc}. Check for host "
                    "syncs (.item(), .cpu(), data-dependent shapes) in the step or set "
                    f"EngineConfig({self.switch}=False)") from exc
            self.pool = graph.pool() if self.pool is None else self.pool
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def pad(self, batch: int) -> int | None:
        return next((b for b in sorted(self.graphs) if b >= batch), None)

    def replay(self, bucket: int) -> None:
        self.graphs[bucket].replay()
        self.num_replays += 1

