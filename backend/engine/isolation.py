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
  state, advanced only after success: a retry writes the same values again), the codec's stream state
  (written back after the codec forward, `StreamingDecoder.scatter_states`: a failure before it leaves the
  stream as it was) and, last of all, each slot's talker state (`last_c0`, `past_hidden`, `rep_mask`, which
  the step reads): a step that fails anywhere before leaves it as it was, so nothing needs undoing and the
  steps that succeed pay nothing for isolation (the RowFault tests fail if the talker state is written before
  the codec).
With the codec one step behind (`EngineConfig.codec_pipeline`, engine/audio_pipeline.py) the engine launches the
step without waiting; a row's error there can only come from its metadata, packed before anything runs, and
then the step runs again synchronously through `isolated`. The replays themselves fail only with device faults.
"""

from __future__ import annotations

import sys
import traceback
from typing import Callable, TypeVar

import torch

from .faults import is_device_fault

Row = TypeVar("Row")


def isolated(run: Callable[[list[Row]], list], rows: list[Row], device: torch.device) -> list:
    """`run(rows)` -> one result per row; on an error that is not a device fault, the rows are bisected
    and run again. Returns one entry per row: its result, or the exception it failed with alone."""
    try:
        return list(run(rows))
    except Exception as exc:  # noqa: BLE001 - every row error is isolated; a device fault is not ours
        if is_device_fault(exc, device):
            raise
        if len(rows) == 1:
            _log(exc)
            return [exc]
    half = len(rows) // 2
    return isolated(run, rows[:half], device) + isolated(run, rows[half:], device)


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
    `seq_id`: at "decode", in the codec call (the step's last work before it writes its rows' talker
    state), at "prefill", in `start_batch`. `remove()` uninstalls it."""

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
