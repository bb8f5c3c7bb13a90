"""CUDA graphs for the decode step: capture / pad / replay, and the step's static buffers.

One graph per batch bucket, captured largest first into one shared memory pool, after a warm-up run
of the same bucket (so lazily built buffers, autotuned kernels and the allocator are settled). Every
input and output of the step lives in one `GraphBuffers`; the step reads rows [:bucket] of it.
`DecodeMeta` is the one definition of the per-row metadata layout (`pack` writes it, `columns`
reads it). During capture all rows are padding (dummy slot, slot_mapping -1, dummy page), so
capturing touches only the dummy state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import numpy as np
import torch

from q3tts import kernels

# while_waiting(timeout_s): work the host does while a step runs on the device (the engine process answers
# the calls that came meanwhile); it returns within about timeout_s when there is none
WhileWaiting = Callable[[float], None]
WAIT_POLL_S = 2e-4  # the longest a step's end may go unnoticed while the host waits with while_waiting


def wait_for(event, while_waiting: WhileWaiting | None) -> None:
    """Block until the device reached `event` (a torch.cuda.Event); `while_waiting` runs meanwhile."""
    while while_waiting is not None and not event.query():
        while_waiting(WAIT_POLL_S)
    event.synchronize()


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

    def pack(self, rows: list[DecodeRow], meta: np.ndarray, tables: np.ndarray) -> None:
        """`rows` then padding rows into meta [N, 5] int64 and tables [N, P] int32 (N = len(meta) >=
        len(rows); `GraphBuffers.staging` gives them): one conversion for all rows' metadata."""
        n, ps = len(rows), self.page_size
        meta[n:] = DecodeColumns(slot=self.dummy_slot, position=0, slot_mapping=-1, context_len=1, frame=0)
        tables[:] = self.dummy_page
        if not n:
            return
        # slot and page ids are valid by construction (SlotPool / KVPool hand out range ids); the slot and
        # the table width are asserted here, where they meet the device indexes
        assert all(0 <= r.slot < self.dummy_slot and len(r.pages) <= self.max_pages for r in rows)
        # plain tuples in DecodeColumns' order: numpy converts a list of namedtuples ~6x slower (0.1 ms at 64 rows
        # on a 2-core CPU, on the path between a step landing and the next launch)
        meta[:n] = [(r.slot, r.position, r.pages[r.position // ps] * ps + r.position % ps, r.position + 1, r.frame)
                    for r in rows]
        for i, r in enumerate(rows):
            tables[i, :len(r.pages)] = r.pages

    @staticmethod
    def columns(meta: torch.Tensor) -> DecodeColumns:
        """meta [B, 5] -> its columns as [B] views (strided: kernels read index vectors by stride)."""
        return DecodeColumns(*meta.unbind(1))


OUTPUTS = ("frames", "c0_next", "pcm", "faults")  # the `GraphBuffers` fields a step hands to the host


@dataclass
class GraphBuffers:
    """Static inputs/outputs of one decode step, sized for the largest bucket, and their host side.

    On CUDA every field has a pinned host mirror (`host`): the step's metadata is packed into the mirrors
    and copied up without blocking (`staging`, `load`), its outputs come back in one wait (`fetch`); one
    event orders the host's reuse of a mirror after the copy that reads or fills it. On the CPU the
    mirrors are the buffers themselves: nothing is copied."""

    meta: torch.Tensor      # [Bmax, 5] int64, rows of `DecodeColumns`
    tables: torch.Tensor    # [Bmax, P] int32 block tables
    frames: torch.Tensor    # [Bmax, 16] int64 codes of the frame made this step
    c0_next: torch.Tensor   # [Bmax] int64 first code of the next frame (EOS = finished)
    pcm: torch.Tensor       # [Bmax, samples_per_frame] float32
    faults: torch.Tensor    # [Bmax] bool: the row's sampling scores were not finite (models/step.py)
    host: dict[str, torch.Tensor]  # field -> its host mirror (pinned on CUDA, the field itself on CPU)
    copied: torch.cuda.Event | None  # recorded after the last copy between mirrors and fields (CUDA)
    arrays: dict[str, np.ndarray] = field(init=False, repr=False)  # the mirrors as numpy views

    def __post_init__(self) -> None:
        self.arrays = {name: t.numpy() for name, t in self.host.items()}

    @classmethod
    def allocate(cls, max_batch: int, max_pages: int, groups: int, samples: int,
                 device: torch.device) -> GraphBuffers:
        fields = dict(meta=torch.zeros(max_batch, DecodeMeta.NUM_COLUMNS, dtype=torch.int64, device=device),
                      tables=torch.zeros(max_batch, max_pages, dtype=torch.int32, device=device),
                      frames=torch.zeros(max_batch, groups, dtype=torch.int64, device=device),
                      c0_next=torch.zeros(max_batch, dtype=torch.int64, device=device),
                      pcm=torch.zeros(max_batch, samples, dtype=torch.float32, device=device),
                      faults=torch.zeros(max_batch, dtype=torch.bool, device=device))
        if device.type != "cuda":
            return cls(**fields, host=fields, copied=None)
        host = {name: torch.zeros(t.shape, dtype=t.dtype, pin_memory=True) for name, t in fields.items()}
        return cls(**fields, host=host, copied=torch.cuda.Event())

    def staging(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Host arrays (meta, tables) for rows [start, stop), to pack into before `load` (it waits for
        the previous copy out of them)."""
        self._wait()
        return self.arrays["meta"][start:stop], self.arrays["tables"][start:stop]

    def load(self, start: int, stop: int) -> None:
        """Rows [start, stop) of the staged metadata to the device (copies that do not block the host)."""
        if self.copied is None:
            return
        for name in ("meta", "tables"):
            getattr(self, name)[start:stop].copy_(self.host[name][start:stop], non_blocking=True)
        self._record()

    def fetch(self, n: int, pcm: bool = True, while_waiting: WhileWaiting | None = None
              ) -> tuple[np.ndarray, ...]:
        """Rows [:n] of the step's `OUTPUTS` on the host, once the step has run (the one wait of a step):
        views of the mirrors, valid until the next `fetch`; without `pcm`, pcm is [n, 0] (not copied).
        `while_waiting(timeout_s)` is called until the step is done (on CPU, where it is, once)."""
        names = [name for name in OUTPUTS if pcm or name != "pcm"]
        if self.copied is not None:
            for name in names:
                self.host[name][:n].copy_(getattr(self, name)[:n], non_blocking=True)
            self._record()
            wait_for(self.copied, while_waiting)
        elif while_waiting is not None:
            while_waiting(0.0)
        return tuple(self.arrays[name][:n] if name in names else np.zeros((n, 0), np.float32)
                     for name in OUTPUTS)

    def _record(self) -> None:
        self.copied.record(torch.cuda.current_stream(self.meta.device))  # the stream the copies ran on

    def _wait(self) -> None:
        if self.copied is not None:
            self.copied.synchronize()


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

