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
   and arrivals take the room the players' buffers leave. The first of a step always starts when no
   stream is playing (a prompt past the budget runs alone). A sequence that cannot be prefilled yet
   (whole mode before end_text, incremental mode before its first token) is skipped, not waited on; one
   that does not fit stops admission (no overtaking by smaller ones). The sequences started in one step
   are prefilled together, in one forward.
   Pages taken at start: 'reserve' policy = prompt + max_frames (promised, taken as used);
   'on_demand' = prompt + the first frame.
3. Decode: every running sequence whose next trailing text is known steps; one whose text ran out
   before end_text waits in its slot (keeps its pages, does not step) and holds nobody back.
4. Page growth (`on_demand`): before the step, each stepping sequence's lease is grown to cover the
   token it writes. If the pool is dry, the newest running sequence (latest arrival) is aborted with
   reason 'error' ("KV pool exhausted ..."), its pages freed, and growth retried; if the newest is the
   one that needs the page, it is the one aborted. Older sequences therefore always finish.
"""

from __future__ import annotations

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
        """Returns (newly started = to prefill, to decode this step, aborted for lack of pages).
        `now`: time.monotonic() of the step (a modelled clock in tests).

        Running sequences take the pages they need first; waiting ones start on what is left (their
        open lease already covers their first decode step), so a sequence is never started and then
        aborted for pages in the same step."""
        now = time.monotonic() if now is None else now
        for seq in self.running:
            if seq.num_frames and seq.playing_since is None:
                seq.playing_since = now  # its first frame came out of the previous step
        decode = [s for s in self.running if s.is_decodable]
        decode, victims = self._grow(decode)  # 'reserve': draws on the promise, never aborts
        started = self._start_waiting(self._prefill_seconds(decode, now))
        for seq in started:
            seq.stamps["prefill_start"] = now
        return started, decode + [s for s in started if s.is_decodable], victims

    def observe(self, started: list[Sequence], prefill_s: float | None, decode_s: float | None) -> None:
        """A step's measured device seconds (None: it had no prefill / no decode): into the cost model, and
        into the stamps of the sequences it started (their first frame's timing)."""
        self.cost.observe(sum(s.prompt_len for s in started), prefill_s, decode_s)
        for seq in started:
            seq.stamps.update(prefill_device=prefill_s or 0.0, decode_device=decode_s or 0.0)

    def _prefill_seconds(self, decode: list[Sequence], now: float) -> float | None:
        """The prefill time this step may take: within max_step_seconds and before the first playing
        stream's audio runs out (after this step's decode); None: no bound (deadline scheduling off)."""
        if self.config.max_step_seconds is None:
            return None
        bounds = [seq.runs_dry_at - now for seq in decode if seq.playing_since is not None]
        return min([self.config.max_step_seconds, *bounds]) - self.cost.step_seconds(0)

    def _start_waiting(self, prefill_seconds: float | None) -> list[Sequence]:
        started: list[Sequence] = []
        tokens = 0
        ready = sorted((s for s in self.waiting if s.is_prefillable), key=lambda s: s.ready_at)
        playing = any(s.playing_since is not None for s in self.running)
        for seq in ready:
            rows = tokens + seq.prompt_len
            if started and rows > self.config.max_prefill_tokens:
                break
            too_long = prefill_seconds is not None and self.cost.prefill_s_per_row * rows > prefill_seconds
            if too_long and (started or playing):  # nobody plays: the first starts, however long
                break
            if not self._try_start(seq):
                break
            self.waiting.remove(seq)
            self.running.append(seq)
            started.append(seq)
            tokens += seq.prompt_len
        return started

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
