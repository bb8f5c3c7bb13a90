"""CUDA graphs for the decode step: capture / pad / replay.

One graph per batch bucket, captured largest first into one shared memory pool, after a warm-up run
of the same bucket (so lazily built buffers, autotuned kernels and the allocator are settled). Every
input and output of the step lives in one `GraphBuffers`; the step reads rows [:bucket] of it.
During capture all rows are padding (dummy slot, slot_mapping -1, dummy page), so capturing
touches only the dummy state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from q3tts import kernels

META_SLOT, META_POS, META_SLOT_MAP, META_CTX, META_FRAME, META_PAGES = range(6)
META_COLS = META_PAGES  # block table columns follow


@dataclass
class GraphBuffers:
    """Static inputs/outputs of one decode step, sized for the largest bucket.

    meta [Bmax, 5] int64 per row: slot, position, slot_mapping (-1 = padding), context_len, frame
    index; tables [Bmax, P] int32: the block table (padded with the dummy page; int32 = the paged
    attention kernel's contract).
    """

    meta: torch.Tensor      # [Bmax, 5] int64
    tables: torch.Tensor    # [Bmax, P] int32
    frames: torch.Tensor    # [Bmax, 16] int64 codes of the frame made this step
    c0_next: torch.Tensor   # [Bmax] int64 first code of the next frame (EOS = finished)
    pcm: torch.Tensor       # [Bmax, samples_per_frame] float32

    @classmethod
    def allocate(cls, max_batch: int, max_pages: int, groups: int, samples: int,
                 device: torch.device) -> GraphBuffers:
        return cls(meta=torch.zeros(max_batch, META_COLS, dtype=torch.int64, device=device),
                   tables=torch.zeros(max_batch, max_pages, dtype=torch.int32, device=device),
                   frames=torch.zeros(max_batch, groups, dtype=torch.int64, device=device),
                   c0_next=torch.zeros(max_batch, dtype=torch.int64, device=device),
                   pcm=torch.zeros(max_batch, samples, dtype=torch.float32, device=device))


class GraphRunner:
    """Captured decode steps keyed by bucket; `step_fn(bucket)` runs one step on rows [:bucket]."""

    def __init__(self, step_fn: Callable[[int], None], fill_padding: Callable[[int, int], None],
                 batch_sizes: tuple[int, ...]) -> None:
        self.step_fn = step_fn
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
                    f"CUDA graph capture of the decode step failed at batch {bs}: {exc}. Check for host "
                    "syncs (.item(), .cpu(), data-dependent shapes) in the step or set "
                    "EngineConfig(use_cuda_graphs=False)") from exc
            self.pool = graph.pool() if self.pool is None else self.pool
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def pad(self, batch: int) -> int | None:
        return next((b for b in sorted(self.graphs) if b >= batch), None)

    def replay(self, bucket: int) -> None:
        self.graphs[bucket].replay()
        self.num_replays += 1

