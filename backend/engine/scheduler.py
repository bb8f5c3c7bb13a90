"""Admission control and per-step batch selection (torch-free).

Policy, in the order `schedule()` applies it each step:

1. Admission (`add`): a request whose prompt is longer than `max_prompt_tokens`, or whose prompt +
   `max_frames` tokens need more pages than the whole pool, can never run: AdmissionRejected at
   once. Otherwise it joins the FIFO wait queue; a full queue (`max_queue`) rejects.
2. Start: waiting sequences are started in the order their prompts became ready (earliest deadline
   first: their time to first audio runs from then) while a slot and pages are free and their prompts
   fit the step's prefill budget: `max_prefill_tokens` rows, and a modelled step time (`StepCost`: the
   decode step + the prefill of the rows) within `max_step_seconds` and within the slack of the playing
   streams (the earliest moment a playing stream's audio runs out: it started playing when its first
   frame came out and every frame adds 80 ms). So a step that prefills never starves a playing stream,
   and arrivals take the room the players' buffers leave. The time bound holds for the first of a step
   only while a stream is playing. Chunked prefill: a prompt that no step could take whole (more rows
   than `max_prefill_tokens`, or a modelled prefill longer than `max_step_seconds` leaves after the
   decode step) is prefilled in pieces when it comes first in a step: each step the rows the budget
   leaves (`Sequence.piece`), before anyone behind it; it makes its first frame in the step of its last
   piece. A shorter prompt that does not fit waits for a step with room (it is prefilled whole, in one
   step: fewer steps to its first frame). A sequence that cannot be prefilled yet
   (whole mode before end_text, incremental mode before its first token) is skipped, not waited on; one
   that does not fit stops admission (no overtaking by smaller ones). The sequences a step prefills
   share one forward.
   Pages taken at start (its first piece): 'reserve' policy = prompt + max_frames (promised, taken as
   used); 'on_demand' = prompt + the first frame.
3. Decode: every running sequence whose next trailing text is known steps; one whose text ran out
   before end_text waits in its slot (keeps its pages, does not step) and holds nobody back.
4. Page growth (`on_demand`): before the step, each stepping sequence's lease is grown to cover the
   token it writes. If the pool is dry, the newest running sequence (latest arrival) is aborted with
   reason 'error' ("KV pool exhausted ..."), its pages freed, and growth retried; if the newest is the
   one that needs the page, it is the one aborted. Older sequences therefore always finish.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Hashable

from q3tts.core import AdmissionRejected
from .config import EngineConfig
from .kv_pool import KVPool, OutOfPages
from .sequence import Sequence, Status
from .slots import SlotPool


@dataclass
class StepCost:
    """The modelled time of a step: `decode_s` for the batched decode step, `prefill_s_per_row` per prompt
    row prefilled with it. The engine feeds it measured steps (`observe`, a moving average); the initial
    values hold until the first measurements (0: no step is thought to take time)."""

    decode_s: float = 0.0
    prefill_s_per_row: float = 0.0
    weight: float = 0.2  # of a new measurement in the moving average

    def step_seconds(self, prefill_rows: int) -> float:
        return self.decode_s + self.prefill_s_per_row * prefill_rows

    def observe(self, prefill_rows: int, prefill_s: float | None, decode_s: float | None) -> None:
        """One measured step: its prefill of `prefill_rows` rows and its decode step (None: none)."""
        if decode_s is not None:
            self.decode_s += self.weight * (decode_s - self.decode_s)
        if prefill_s is not None and prefill_rows:
            self.prefill_s_per_row += self.weight * (prefill_s / prefill_rows - self.prefill_s_per_row)


class Scheduler:
    def __init__(self, config: EngineConfig) -> None:
        assert config.num_pages is not None, "EngineConfig.resolve() first"
        self.config = config
        self.kv = KVPool(config.num_pages, config.page_size)
        self.slots = SlotPool(config.max_slots)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.seqs: dict[Hashable, Sequence] = {}
        self.cost = StepCost()

    # --- admission --------------------------------------------------------------------------------

    def check_fits(self, seq: Sequence) -> None:
        """Reject a sequence that can never run (its prompt length must be known)."""
        cfg = self.config
        if seq.prompt_len > cfg.max_prompt_tokens:
            raise AdmissionRejected(f"the prompt (TEXT, INSTRUCT, REF_TEXT and the reference's frames) has "
                                    f"{seq.prompt_len} tokens; max_prompt_tokens={cfg.max_prompt_tokens}")
        need = self.kv.pages_for(seq.prompt_len + seq.frame_cap)
        if need > self.kv.num_pages:
            raise AdmissionRejected(
                f"prompt ({seq.prompt_len} tokens) + max_frames ({seq.frame_cap}) needs {need} KV pages "
                f"of {cfg.page_size} tokens, the pool has {self.kv.num_pages}; lower max_frames")

    def add(self, seq: Sequence) -> None:
        if len(self.waiting) >= self.config.max_queue:
            raise AdmissionRejected(f"wait queue full ({self.config.max_queue} sequences waiting)")
        self.check_fits(seq)
        self.waiting.append(seq)
        self.seqs[seq.seq_id] = seq

    # --- per step ---------------------------------------------------------------------------------

    def schedule(self, now: float | None = None) -> tuple[list[Sequence], list[Sequence], list[Sequence]]:
        """Returns (to prefill: each one's piece of its prompt, rows `piece_start`..`prefilled`-1, to decode
        this step, aborted for lack of pages). `now`: time.monotonic() of the step (a modelled clock in tests).

        Running sequences take the pages they need first; waiting ones start on what is left (their
        open lease already covers their first decode step), so a sequence is never started and then
        aborted for pages in the same step."""
        now = time.monotonic() if now is None else now
        for seq in self.running:
            if seq.num_frames and seq.playing_since is None:
                seq.playing_since = now  # its first frame came out of the previous step
        decode = [s for s in self.running if s.is_prefilled and s.is_decodable]
        decode, victims = self._grow(decode)  # 'reserve': draws on the promise, never aborts
        prefill = self._pieces(self._prefill_seconds(decode, now))
        for seq in prefill:
            seq.stamps.setdefault("prefill_start", now)
        return prefill, decode + [s for s in prefill if s.is_prefilled and s.is_decodable], victims

    def observe(self, prefilled: list[Sequence], prefill_s: float | None, decode_s: float | None) -> None:
        """A step's measured device seconds (None: it had no prefill / no decode): into the cost model, and
        into the stamps of the sequences it prefilled (their first frame's timing; the prefill seconds of
        a chunked prompt add up over its pieces)."""
        self.cost.observe(sum(s.piece for s in prefilled), prefill_s, decode_s)
        for seq in prefilled:
            seq.stamps.update(prefill_device=seq.stamps.get("prefill_device", 0.0) + (prefill_s or 0.0),
                              decode_device=decode_s or 0.0)

    def _prefill_seconds(self, decode: list[Sequence], now: float) -> float | None:
        """The prefill time this step may take: within max_step_seconds and before the first playing
        stream's audio runs out (after this step's decode); None: no bound (deadline scheduling off)."""
        if self.config.max_step_seconds is None:
            return None
        bounds = [seq.runs_dry_at - now for seq in decode if seq.playing_since is not None]
        return min([self.config.max_step_seconds, *bounds]) - self.cost.step_seconds(0)

    def _pieces(self, prefill_seconds: float | None) -> list[Sequence]:
        """The sequences this step prefills, their `piece` set: first a prompt part-way in the KV, then
        the ready waiting ones (started here) in the order they became ready, within the budget."""
        prefill: list[Sequence] = []
        rows = 0
        playing = any(s.playing_since is not None for s in self.running)
        chunking = [s for s in self.running if not s.is_prefilled]
        ready = sorted((s for s in self.waiting if s.is_prefillable), key=lambda s: s.ready_at)
        for seq in chunking + ready:
            room = self._room(rows, prefill_seconds if prefill or playing else None)
            left = seq.prompt_len - seq.prefilled
            if left > room and not self._takes_a_piece(seq, left, room, first=not prefill):
                break
            if seq.status is Status.WAITING and not self._try_start(seq):
                break
            seq.piece = min(left, room)
            seq.prefilled += seq.piece
            prefill.append(seq)
            rows += seq.piece
        return prefill

    def _takes_a_piece(self, seq: Sequence, left: int, room: int, first: bool) -> bool:
        """Whether `seq`, whose `left` prompt rows to prefill exceed the step's `room`, gets a piece of `room`
        rows now: only as the step's first prefill, with room left, and when it is part-way in already or no
        step could take the rest whole (a prompt that would fit a roomier step waits for one and goes whole)."""
        return first and room > 0 and (seq.prefilled > 0 or left > self._step_room())

    def _step_room(self) -> int:
        """Prompt rows the roomiest step may prefill (no stream playing, or all with slack to spare)."""
        bound = self.config.max_step_seconds
        return self._room(0, None if bound is None else bound - self.cost.step_seconds(0))

    def _room(self, rows: int, prefill_seconds: float | None) -> int:
        """Prompt rows a step that already prefills `rows` may add: up to `max_prefill_tokens` in all, and
        (`prefill_seconds` not None) as many as the modelled prefill time leaves."""
        room = self.config.max_prefill_tokens - rows
        if prefill_seconds is not None:
            per_row = self.cost.prefill_s_per_row
            if per_row > 0:
                room = min(room, math.floor(prefill_seconds / per_row + 1e-9) - rows)
            elif prefill_seconds < 0:
                room = 0
        return max(room, 0)

    def _try_start(self, seq: Sequence) -> bool:
        if self.slots.num_free == 0:
            return False
        first = seq.prompt_len + 1  # prompt + the token the first decode step writes
        reserve = seq.prompt_len + seq.frames_bound if self.config.kv_policy == "reserve" else 0
        try:
            self.kv.open(seq.seq_id, first, reserve_tokens=reserve)
        except OutOfPages:
            return False
        seq.slot = self.slots.acquire(seq.seq_id)
        seq.status = Status.RUNNING
        self.waiting.remove(seq)
        self.running.append(seq)
        return True

    def _grow(self, decode: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
        victims: list[Sequence] = []
        for seq in sorted(decode, key=lambda s: s.arrival):
            while seq.status is Status.RUNNING:
                try:
                    self.kv.grow(seq.seq_id, seq.num_tokens)
                    break
                except OutOfPages:
                    assert self.config.kv_policy == "on_demand", "reserved lease ran dry"
                    victim = max(self.running, key=lambda s: s.arrival)
                    self.finish(victim, "error", f"KV pool exhausted ({self.kv.num_pages} pages of "
                                f"{self.config.page_size} tokens): newest sequence aborted")
                    victims.append(victim)
        return [s for s in decode if s.status is Status.RUNNING], victims

    # --- completion -------------------------------------------------------------------------------

    def finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """Return the sequence's pages and slot (idempotent); it stays known until `forget`."""
        if seq.status is Status.FINISHED:
            return
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self.kv.close(seq.seq_id)
            self.slots.release(seq.slot)
        else:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        seq.finish_reason, seq.error = reason, error

    def forget(self, seq_id) -> None:
        """Drop a finished sequence's record (after its final output went out)."""
        self.seqs.pop(seq_id, None)

    # --- introspection ----------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        self.slots.check_integrity()
        holders = {s.seq_id for s in self.running}
        if set(self.kv.leases) != holders or set(self.slots.owner.values()) != holders:
            raise RuntimeError(f"Scheduler integrity check failed: running {sorted(map(str, holders))}, "
                               f"leases {sorted(map(str, self.kv.leases))}, "
                               f"slots {sorted(map(str, self.slots.owner.values()))}")
