"""`Sequence`: the host-side record of one request, shared by the scheduler and the engine (torch-free)."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from q3tts.core import SamplingParams, VoiceSpec

_arrivals = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"    # admitted, no slot yet (queued, or waiting for its first text)
    RUNNING = "running"    # holds a slot and pages; prefilled
    FINISHED = "finished"  # pages and slot returned; its final StepOutput is pending or sent


@dataclass(eq=False)
class Sequence:
    seq_id: Any
    voice: VoiceSpec
    sampling: SamplingParams
    text_mode: str                 # 'whole' | 'incremental'
    max_frames: int                # min(sampling.max_frames, EngineConfig.max_frames)
    prompt_len: int = 0            # L0 (known once the prompt can be built)
    status: Status = Status.WAITING
    slot: int = -1
    num_frames: int = 0            # frames made so far
    text_ids: list[int] = field(default_factory=list)  # committed text ids T0, T1, ...
    text_done: bool = False
    prompt_ready: bool = False     # the prefill input can be built (set by the engine)
    ready_at: float = 0.0          # time.monotonic() when prompt_ready was set (queue-wait metric)
    trailing_ids: list[int] = field(default_factory=list)  # trailing text ids known so far
    num_queued_text: int = 0       # trailing ids already copied into the slot's text queue
    arrival: int = field(default_factory=lambda: next(_arrivals))
    finish_reason: str | None = None
    error: str | None = None
    prompt: Any = None             # the model runner's prefill input (opaque to the scheduler)

    @property
    def num_tokens(self) -> int:
        """Talker KV tokens after the next decode step (the prompt + one token per frame step)."""
        return self.prompt_len + self.num_frames + 1

    @property
    def is_prefillable(self) -> bool:
        return self.prompt_ready

    @property
    def is_decodable(self) -> bool:
        """The next frame's trailing text is known (or can only be padding): it may step now.

        Frame t adds trailing[t] to the talker input (spec b.4); past the end of the trailing list
        that is E_pad, which is only right once the text has ended.
        """
        return self.text_mode == "whole" or self.text_done or len(self.trailing_ids) > self.num_frames
