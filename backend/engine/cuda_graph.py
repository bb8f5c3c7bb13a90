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
    """Block until the device reached `event` (a torch.cuda.Event); `while_waiting` runs meanwhile. None: there
    is nothing to wait for (the CPU, where the work ran in line), and `while_waiting` runs once."""
    if event is None:
        if while_waiting is not None:
            while_waiting(0.0)
        return
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
SIDES = 2  # host mirror sets, used by launches in turn: a step's outputs wait on the host while the next one runs


@dataclass
class GraphBuffers:
    """Static inputs/outputs of one decode step, sized for the largest bucket, and their host side.

    Every field has a host mirror on each of `SIDES` sides (pinned on CUDA), which launches use in turn, so
    that the outputs of one step wait on the host while the next step is in flight: a launch packs its
    metadata into its side's mirrors and copies it up without blocking (`staging`, `load`), and once its step
    is enqueued copies the outputs down into the same side (`send_back`); `fetch` waits for that side's
    copies. One event per side orders the host's reuse of a side after its copies. On the CPU the copies
    run in line and there are no events."""

    meta: torch.Tensor      # [Bmax, 5] int64, rows of `DecodeColumns`
    tables: torch.Tensor    # [Bmax, P] int32 block tables
    frames: torch.Tensor    # [Bmax, 16] int64 codes of the frame made this step
    c0_next: torch.Tensor   # [Bmax] int64 first code of the next frame (EOS = finished)
    pcm: torch.Tensor       # [Bmax, samples_per_frame] float32
    faults: torch.Tensor    # [Bmax] bool: the row's sampling scores were not finite (models/step.py)
    host: list[dict[str, torch.Tensor]]  # per side: field -> its host mirror
    copied: list[torch.cuda.Event | None]  # per side: recorded after the last copy between its mirrors and the fields
    side: int = 0  # the side the next launch uses
    arrays: list[dict[str, np.ndarray]] = field(init=False, repr=False)  # the mirrors as numpy views

    def __post_init__(self) -> None:
        self.arrays = [{name: t.numpy() for name, t in side.items()} for side in self.host]

    @classmethod
    def allocate(cls, max_batch: int, max_pages: int, groups: int, samples: int,
                 device: torch.device) -> GraphBuffers:
        fields = dict(meta=torch.zeros(max_batch, DecodeMeta.NUM_COLUMNS, dtype=torch.int64, device=device),
                      tables=torch.zeros(max_batch, max_pages, dtype=torch.int32, device=device),
                      frames=torch.zeros(max_batch, groups, dtype=torch.int64, device=device),
                      c0_next=torch.zeros(max_batch, dtype=torch.int64, device=device),
                      pcm=torch.zeros(max_batch, samples, dtype=torch.float32, device=device),
                      faults=torch.zeros(max_batch, dtype=torch.bool, device=device))
        cuda = device.type == "cuda"
        host = [{name: torch.zeros(t.shape, dtype=t.dtype, pin_memory=cuda) for name, t in fields.items()}
                for _ in range(SIDES)]
        return cls(**fields, host=host, copied=[torch.cuda.Event() if cuda else None for _ in range(SIDES)])

    def staging(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Host arrays (meta, tables) of the next launch's side for rows [start, stop), to pack into before
        `load` (it waits for the side's last copies)."""
        if self.copied[self.side] is not None:
            self.copied[self.side].synchronize()
        arrays = self.arrays[self.side]
        return arrays["meta"][start:stop], arrays["tables"][start:stop]

    def load(self, start: int, stop: int) -> None:
        """Rows [start, stop) of the staged metadata to the device (copies that do not block the host)."""
        for name in ("meta", "tables"):
            getattr(self, name)[start:stop].copy_(self.host[self.side][name][start:stop], non_blocking=True)
        self._record()

    def send_back(self, n: int, pcm: bool = True) -> int:
        """Enqueue the copies of rows [:n] of the step's `OUTPUTS` (without `pcm`: all but pcm) into the launch's
        side, once the step is enqueued; returns that side (`fetch` reads it) and passes to the next."""
        side = self.side
        for name in OUTPUTS:
            if pcm or name != "pcm":
                self.host[side][name][:n].copy_(getattr(self, name)[:n], non_blocking=True)
        self._record()
        self.side = (side + 1) % SIDES
        return side

    def fetch(self, side: int, n: int, pcm: bool = True, while_waiting: WhileWaiting | None = None
              ) -> tuple[np.ndarray, ...]:
        """Rows [:n] of the `OUTPUTS` that `send_back` copied into `side`, once the step has run (the one wait of
        a step): views of the mirrors, valid until that side's next launch; without `pcm`, pcm is [n, 0].
        `while_waiting(timeout_s)` is called until the step is done (on CPU, where it is, once)."""
        wait_for(self.copied[side], while_waiting)
        arrays = self.arrays[side]
        return tuple(arrays[name][:n] if pcm or name != "pcm" else np.zeros((n, 0), np.float32) for name in OUTPUTS)

    def _record(self) -> None:
        event = self.copied[self.side]
        if event is not None:
            event.record(torch.cuda.current_stream(self.meta.device))  # the stream the copies ran on


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

