"""`Sequence`: the host-side record of one request, shared by the scheduler and the engine (torch-free).

It owns its text (`feed`: the pieces, the trailing ids, the Base ICL split) and, once the prompt can be
built, the prompt's rows until the prefill takes them."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from q3tts.core import SamplingParams, StepOutput, VoiceSpec
from q3tts_client.protocol import FRAME_SECONDS  # what one frame adds to a playing stream's buffer

from .text_feed import TextFeed

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
    feed: TextFeed                 # the text as it arrives and the trailing ids taken from it
    max_frames: int | None         # min(sampling.max_frames, EngineConfig.max_frames); None: follows the text
    text_cap: Callable[[int | None], int] | None = None  # EngineConfig.text_frame_cap (when max_frames is None)
    prompt_len: int = 0            # L0 (known once the prompt can be built)
    prefilled: int = 0             # prompt rows in the KV once this step's prefill ran (chunked: piece by piece)
    piece: int = 0                 # prompt rows this step prefills (set by the scheduler; 0: none)
    status: Status = Status.WAITING
    slot: int = -1
    num_frames: int = 0            # frames made so far (landed on the host)
    in_flight: int = 0             # frames of it in decode steps launched and not landed yet
    prompt_ready: bool = False     # the prefill input is built and fits (set by the engine)
    ready_at: float = 0.0          # time.monotonic() when prompt_ready was set (queue-wait metric)
    playing_since: float | None = None  # when its first frame came out (the scheduler's clock)
    stamps: dict[str, float] = field(default_factory=dict)  # where its first frame's time went (first_frame)
    arrival: int = field(default_factory=lambda: next(_arrivals))
    finish_reason: str | None = None
    error: str | None = None
    prompt: Any = None             # the model runner's prefill input (opaque to the scheduler)
    voice_tensors: Any = None      # Base: its voice on the device (engine/voice_cache.py), None: made per prompt
    codec_state: Any = None        # Base ICL: its codec stream primed off the engine thread (Preparer)

    @property
    def next_frame(self) -> int:
        """The index of the frame its next decode step makes (its frames in flight counted as made)."""
        return self.num_frames + self.in_flight

    @property
    def num_tokens(self) -> int:
        """Talker KV tokens after the next decode step (the prompt + one token per frame step)."""
        return self.prompt_len + self.next_frame + 1

    @property
    def frame_cap(self) -> int:
        """Frames it may make: the request's max_frames, else the runaway guard's cap for the text so far
        (EngineConfig.text_frame_cap), which rises as streamed text arrives."""
        if self.max_frames is not None:
            return self.max_frames
        return self.text_cap(self.feed.num_tokens)

    @property
    def frames_bound(self) -> int:
        """The most frames it may ever make (what a page reservation must cover): `frame_cap`, or while
        text may still arrive and the cap follows it, the engine-wide ceiling."""
        if self.max_frames is not None or self.feed.done:
            return self.frame_cap
        return self.text_cap(None)

    @property
    def runs_dry_at(self) -> float:
        """When a client that plays from the first frame in real time has played every frame made so far."""
        return self.playing_since + self.num_frames * FRAME_SECONDS

    def first_frame(self) -> dict[str, float]:
        """The stamps its first frame's StepOutput carries (`stats`): time.monotonic() when its prompt was
        ready, when the step that prefilled it began (prefill_start, by the scheduler) and now, when that
        step handed the frame to the host; the step's device seconds (prefill_device, decode_device) are
        added to the same dict by `Scheduler.observe` before the step returns."""
        self.stamps.update(prompt_ready=self.ready_at, first_frame=time.monotonic())
        return self.stamps

    @property
    def is_prefillable(self) -> bool:
        return self.prompt_ready

    @property
    def is_prefilled(self) -> bool:
        """Its whole prompt is in the KV (after this step's prefill): it is started and may decode."""
        return self.prefilled == self.prompt_len > 0

    @property
    def piece_start(self) -> int:
        """The first prompt row of this step's piece (rows piece_start..prefilled-1)."""
        return self.prefilled - self.piece

    @property
    def is_decodable(self) -> bool:
        """It may step now: the next frame is within its cap (with frames in flight it may not be), and that
        frame's trailing text is known (or can only be padding)."""
        return self.next_frame < self.frame_cap and self.feed.covers(self.next_frame)

    def final_output(self) -> StepOutput:
        """The output that ends a finished sequence without a frame (abort, error, pool exhaustion)."""
        return StepOutput(self.seq_id, codes=np.zeros((0, 16), np.int64), pcm=np.zeros(0, np.float32),
                          finished=True, reason=self.finish_reason, error=self.error)
