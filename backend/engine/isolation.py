"""Step fault isolation: an error in one sequence's part of a step ends that sequence, not the batch.

`Engine.step` runs the prefill of the sequences it starts and the batched decode step through
`isolated`. When the device work raises an error that leaves the device usable (one that poisons it
propagates: engine/faults.py), the rows are bisected: each half runs again on its own, down to the
rows that fail alone; those are returned as failed and every other row's results are those of a step
without them, bit for bit (steps are padded to the same buckets, so a row's bits do not depend on who
else is in it).

What a failed attempt may have written, and why running rows again is exact:
- prefill (`ModelRunner.start_batch`) sets everything of its slots afresh (sampling rows, KV of the
  prompt, talker state, codec stream), so running it again for a subset starts those slots anew;
- decode (`ModelRunner.decode`) writes each row's KV at the row's position (the position is host
  state, advanced only after success: a retry writes the same values again), then each slot's talker
  state (`last_c0`, `past_hidden`, `rep_mask`: read by the step, so a retry must see them as they
  were: `SlotSnapshot` copies those rows before each attempt and puts them back after a failed one),
  and last the codec's stream state (one index_copy_ after the codec forward: a failure before it
  leaves the stream as it was).
"""

from __future__ import annotations

import sys
import traceback
from dataclasses import dataclass
from typing import Callable, TypeVar

import torch

from .faults import is_device_fault

Row = TypeVar("Row")
TALKER_STATE = ("last_c0", "past_hidden", "rep_mask")  # the SlotState fields a decode step writes


@dataclass
class SlotSnapshot:
    """Copies of the talker-state rows of some slots (taken before a decode attempt)."""

    slots: torch.Tensor  # [B] int64
    rows: dict[str, torch.Tensor]  # field -> [B, ...] copy

    @classmethod
    def take(cls, state, slots: list[int]) -> SlotSnapshot:
        sl = torch.tensor(slots, dtype=torch.int64, device=state.last_c0.device)
        return cls(sl, {name: getattr(state, name).index_select(0, sl) for name in TALKER_STATE})

    def restore(self, state) -> None:
        for name, rows in self.rows.items():
            getattr(state, name).index_copy_(0, self.slots, rows)


def decode_undo(state) -> Callable[[list], Callable[[], None]]:
    """`isolated`'s `before` for decode rows: snapshots their slots' talker state; the undo restores it."""
    def before(rows: list) -> Callable[[], None]:
        snapshot = SlotSnapshot.take(state, [r.slot for r in rows])
        return lambda: snapshot.restore(state)
    return before


def isolated(run: Callable[[list[Row]], list], rows: list[Row], device: torch.device,
             before: Callable[[list[Row]], Callable[[], None]] | None = None) -> list:
    """`run(rows)` -> one result per row; on an error that is not a device fault, the rows are bisected
    and run again. Returns one entry per row: its result, or the exception it failed with alone.
    `before(rows)` (called before each attempt) returns what undoes a failed attempt's writes."""
    undo = before(rows) if before is not None else None
    try:
        return list(run(rows))
    except Exception as exc:  # noqa: BLE001 - every row error is isolated; a device fault is not ours
        if is_device_fault(exc, device):
            raise
        if undo is not None:
            undo()
        if len(rows) == 1:
            _log(exc)
            return [exc]
    half = len(rows) // 2
    return (isolated(run, rows[:half], device, before) + isolated(run, rows[half:], device, before))


def _log(exc: BaseException) -> None:
    """The traceback of a row's failure goes to the log (the request's error names its inputs only)."""
    sys.stderr.write("[q3tts] engine step failed for one sequence: "
                     + "".join(traceback.format_exception(exc)))


def step_error(stage: str, frame: int) -> str:
    """The error of a sequence whose part of a step failed alone (the cause is in the server log)."""
    return (f"generation failed at {stage} (frame {frame}) for this request's inputs (text, voice, "
            "sampling parameters); the other requests were not affected")


class RowFault:
    """Test hook (off unless installed): the step's device work raises whenever it includes the slot of
    `seq_id`: at "decode", in the codec call (after the step wrote its rows' talker state: what a retry
    must undo), at "prefill", in `start_batch`. `remove()` uninstalls it."""

    def __init__(self, engine, seq_id, stage: str = "decode") -> None:
        self.engine, self.seq_id = engine, seq_id
        self.owner, self.name = ((engine.runner.codec, "decode_chunk") if stage == "decode"
                                 else (engine.runner, "start_batch"))
        self.original = getattr(self.owner, self.name)
        setattr(self.owner, self.name, self._call)

    def _call(self, *args):
        seq = self.engine.scheduler.seqs.get(self.seq_id)
        slots = ([r.slot for r in args[0]] if self.name == "start_batch"
                 else args[0].tolist() if args[1].shape[-1] == 1 else [])  # codec: frames, not ICL priming
        if seq is not None and seq.slot in slots:
            raise RuntimeError(f"RowFault: injected failure for sequence {self.seq_id!r}")
        return self.original(*args)

    def remove(self) -> None:
        setattr(self.owner, self.name, self.original)
