"""`Engine`: continuous batching of Qwen3-TTS sequences (contract in docs/ARCHITECTURE.md).

Called from one thread, and it only orchestrates: `RequestIntake` (engine/requests.py) takes requests,
the `InputProcessor` turns them into `Sequence`s (voice, text feed, prompt; reference audio is encoded on
the `Preparer`'s own thread), the `Scheduler` decides who starts and who steps, the `ModelRunner` runs
the device work. `step()` = start (prefill, all in one ragged forward) the sequences the scheduler
admits, then one batched decode step for every running sequence whose next text is known; it
returns one StepOutput per sequence that made a frame or finished. Text can arrive in pieces
(`append_text`, `end_text`): in incremental mode token T_{t+1} enters with frame t (spec b.4), so a
sequence whose text ran out before `end_text` waits in its slot until more arrives. A failure of the
step's device work that leaves the device usable ends only the sequences that fail on their own
(engine/isolation.py); the others stream on.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from q3tts.codec.audio import SAMPLE_RATE
from q3tts.core import SamplingParams, StepOutput
from q3tts.kernels.autotune import load_tuned, save_tuned
from q3tts.models.sampling import UniformSource

from .config import EngineConfig
from .cuda_graph import DecodeRow, WhileWaiting
from .faults import check_token_ids, inject_device_fault, is_device_fault, nonfinite_error
from .input_processor import InputProcessor
from .isolation import isolated, step_error
from .model_runner import DecodeOutput, ModelRunner, PrefillRow
from .preparer import Preparer
from .requests import RequestIntake
from .scheduler import Scheduler
from .sequence import Sequence, Status
from .setup import make_codec, resolve_config
from .timing import PhaseClock, Startup, StepTimes
from .voice_cache import VoiceCache


class Engine(RequestIntake):
    sample_rate = SAMPLE_RATE

    def __init__(self, checkpoint_or_path: Any, config: EngineConfig | None = None, *,
                 uniform_source: UniformSource | None = None, with_codec: bool = True) -> None:
        from q3tts.checkpoint.loader import Checkpoint, load_checkpoint
        from q3tts.models.tts_model import Qwen3TTS

        config = config or EngineConfig()
        dtype = getattr(torch, config.dtype)
        self.startup = Startup()  # where the construction's time went (the bench and the server log print it)
        with self.startup.phase("weights"):
            ckpt = checkpoint_or_path
            if not isinstance(ckpt, Checkpoint):
                ckpt = load_checkpoint(ckpt, dtype=dtype, device=config.device)
            self.checkpoint = ckpt
            check_token_ids(ckpt.tokenizer.vocab_size, ckpt.config.talker.text_vocab_size)
            self.model = Qwen3TTS.from_checkpoint(ckpt).to(device=config.device, dtype=dtype)
            self.inputs = InputProcessor(self.model, ckpt, config)
        self.codec_eos_id = ckpt.config.talker.codec_eos_id
        with self.startup.phase("codec"):
            codec = make_codec(ckpt, config) if with_codec else None
        self.config = resolve_config(self.model, config)  # after the codec: KV takes a share of what is left
        self.scheduler = Scheduler(self.config)
        device = torch.device(self.config.device)
        if self.config.tune_cache:
            self.startup.cached_configs = load_tuned(self.config.tune_cache, device)
        with self.startup.phase("runner"):
            self.runner = ModelRunner(self.model, codec, self.config, self.inputs.pad_row, uniform_source)
        self.runner.capture_graphs(self.startup)
        if self.config.tune_cache:
            save_tuned(self.config.tune_cache, device)
        # voices are encoded and prepared (an ICL codec stream primed) on their own thread, never during capture
        self.voices = VoiceCache(self.config.voice_cache_bytes,
                                 lambda voice: self.inputs.prepare(voice, self.runner.prime_state))
        self.preparer = Preparer(self.inputs.encode, self.voices.get_or_prepare)
        self._outbox: list[StepOutput] = []  # finished outputs produced between steps (abort, errors)
        # public: whether a decode step is launched by one step() call and landed by a later one (with the pipelined
        # codec, or where the step is a CUDA graph: the codec inside the step, its audio lands with the frames)
        self.launches_ahead = self.runner.audio is not None or bool(self.runner.graphs)
        self._flights: deque[_Flight] = deque()  # the decode steps launched and not landed yet
        self._unheard: list[tuple[int, StepOutput]] | None = None  # landed outputs (row, output) without pcm
        self.num_steps = 0
        self.clock = PhaseClock(self.runner.device)
        self.times = StepTimes()
        # the device idle between steps (`StepTimes.add_gap`, `_gap_before`): the last stamp of the previous step's
        # device work (None when that step had none or the engine ran out of work)
        self._last_end = None

    @classmethod
    def from_checkpoint(cls, checkpoint_or_path: Any, config: EngineConfig | None = None, **kwargs) -> Engine:
        """The public constructor: a loaded Checkpoint or a path / hub id, and the engine settings."""
        return cls(checkpoint_or_path, config, **kwargs)

    @property
    def default_sampling(self) -> SamplingParams:
        """The checkpoint's generation_config.json defaults (requests override field by field)."""
        return SamplingParams.from_generation_config(self.checkpoint.generation)

    # --- the step ---------------------------------------------------------------------------------

    def step(self, while_waiting: WhileWaiting | None = None) -> list[StepOutput]:
        """One engine step: the outputs of the sequences that made a frame or ended.

        Where the decode step runs ahead of the host (the pipelined codec, or a CUDA graph), with one step in
        flight the call first waits for the step the last call launched to finish on the device; `while_waiting`
        (timeout_s) is called meanwhile, and may add, feed, end and abort sequences (this step admits them).
        Pipelined, it is called again while the step, its next one launched, waits for the landed frames' audio
        (the next step admits what it adds then). With `steps_in_flight` 2 the step launches its decode step first
        and then waits for the one the last call launched (what `while_waiting` adds then, the next call admits);
        with `launch_at_frames` it first waits (`while_waiting` meanwhile, this step admitting what it adds) for
        that step's frames to be made."""
        ahead = self.config.steps_in_flight > 1
        if ahead and self.config.launch_at_frames and self._flights and self.runner.audio is not None:
            self.runner.audio.wait_frames(while_waiting)
        self._admit_prepared(idle=not (self.scheduler.has_work() or self._outbox or self._flights))
        outputs, self._outbox = self._outbox, []
        if not ahead:
            outputs += self._land(while_waiting)  # pipelined: the frames of the step the last call launched
        started, decode, victims = self.scheduler.schedule()
        outputs += [seq.final_output() for seq in victims]
        t_prefill = self.clock.stamp() if started else None
        if started:
            self._prefill(started)
        for seq in decode:
            self._push_text(seq)
        decode = [s for s in decode if s.status is Status.RUNNING]  # not ended by a failure of its own
        t_decode = self.clock.stamp() if started or decode else None
        gap = self._gap_before(t_prefill if started else t_decode)
        launched = bool(decode) and self.launches_ahead and self._launch(decode, started, t_prefill, t_decode, gap)
        if ahead and (len(self._flights) > 1 or not launched):
            outputs += self._land(while_waiting)  # the frames of the step the last call launched
        if not launched:
            self._hear()  # the landed frames' audio first: the synchronous step below collects its own
            decode = [s for s in decode if s.status is Status.RUNNING]  # not ended as a step in flight landed
            if decode:
                outputs += self._decode(decode)
            t_end = self.clock.stamp() if decode else None
            self._observe(started, t_prefill, t_decode, t_end, gap)
            self._last_end = t_decode if t_end is None else t_end
        self._hear(while_waiting)
        outputs += self._outbox
        self._outbox = []
        for out in outputs:
            if out.finished:
                self.scheduler.forget(out.seq_id)
        self.num_steps += 1
        if not self.has_work():  # the caller may wait for new work before it calls again: that is no gap
            self._last_end = None
        return outputs

    def _gap_before(self, t_first) -> tuple | None:
        """(the previous step's last stamp, `t_first`): the device's idle before this step's first work (stamp
        `t_first`; None: it has none), when the previous step had device work and the engine has had work
        since; resolved once both are reached (`_observe`)."""
        if t_first is None:
            self._last_end = None
            return None
        return None if self._last_end is None else (self._last_end, t_first)

    def _observe(self, started: list[Sequence], t_prefill, t_decode, t_end, gap) -> None:
        """A step's device times (stamps; `t_end` None: it had no decode) into the totals and the scheduler.
        The prefill is complete once a decode followed (its host copy waited for it). Also resolves `gap`,
        the device's idle before this step (stamps, or None), both reached by now."""
        if gap is not None:
            self.times.add_gap(self.clock.seconds(*gap))
        decode_s = prefill_s = None
        if t_end is not None:
            decode_s = self.clock.seconds(t_decode, t_end)
            self.times.decode_seconds += decode_s
        if started:
            prefill_s = self.clock.seconds(t_prefill, t_decode)
            self.times.add_prefill(prefill_s, sum(s.is_prefilled for s in started))
        self.scheduler.observe(started, prefill_s, decode_s)

    def _prefill(self, seqs: list[Sequence]) -> None:
        """One ragged prefill forward for this step's piece of each sequence's prompt (the whole prompt
        unless chunked); a prompt is dropped once its last piece is in."""
        now = time.monotonic()
        rows = [PrefillRow(s.slot, s.sampling, s.prompt[s.piece_start:s.prefilled],
                           self.scheduler.kv.pages(s.seq_id), self.inputs.codec_context(s.voice), s.codec_state,
                           s.piece_start, s.is_prefilled) for s in seqs]
        results = isolated(self._start_batch, rows, self.runner.device)
        for seq, result in zip(seqs, results):
            if seq.is_prefilled:
                seq.prompt = seq.codec_state = None
            if seq.piece_start == 0:
                self.times.queue_wait_seconds += now - seq.ready_at
            if isinstance(result, Exception):
                self._finish(seq, "error", step_error("prefill", 0))

    def _start_batch(self, rows: list[PrefillRow]) -> list[PrefillRow]:
        self.runner.start_batch(rows)
        return rows

    def _push_text(self, seq: Sequence) -> None:
        """The sequence's trailing text ids not yet in its slot's queue, embedded, into the queue."""
        try:
            queued = self.inputs.trailing_rows(seq)
            if queued is not None:
                self.runner.push_text(seq.slot, *queued)
        except Exception as exc:  # noqa: BLE001 - its own text failed: it ends alone (a device fault does not)
            if is_device_fault(exc, self.runner.device):
                raise
            self._finish(seq, "error", step_error("its text", seq.num_frames))

    def _decode(self, seqs: list[Sequence]) -> list[StepOutput]:
        """One decode step, its audio included; a row that fails alone ends (reason 'error')."""
        self._inject_fault(seqs)
        results = isolated(self._decode_rows, self._rows(seqs), self.runner.device)
        return [out for _, out in self._frame_outputs(seqs, results)]

    def _launch(self, seqs: list[Sequence], started: list[Sequence], t_prefill, t_decode, gap) -> bool:
        """Start the decode step of `seqs` and return; its frames land at a later step (`_land`), pipelined their
        audio when the codec is done (`_hear`). False when a row's metadata failed (it is packed before anything
        runs): the step then runs synchronously, each row isolated. The replays themselves fail only with device
        faults, which propagate."""
        self._inject_fault(seqs)
        try:
            self.runner.launch(self._rows(seqs))
        except Exception as exc:  # noqa: BLE001 - a row's error is isolated by the synchronous step
            if is_device_fault(exc, self.runner.device):
                raise
            return False
        for seq in seqs:
            seq.in_flight += 1
        flight = _Flight(seqs, started, t_prefill, t_decode, self.clock.stamp(), gap)
        self._flights.append(flight)
        self._last_end = flight.t_end
        return True

    def _land(self, while_waiting: WhileWaiting | None) -> list[StepOutput]:
        """The outputs of the oldest step in flight (none: []), with their pcm (pipelined: attached by `_hear`
        before the step returns); a sequence that ended meanwhile (aborted, also from `while_waiting`, or at EOS
        in an earlier step in flight) drops its frame."""
        if not self._flights:
            return []
        flight = self._flights.popleft()
        out = self.runner.land(while_waiting)
        for seq in flight.seqs:
            seq.in_flight -= 1
        self._observe(flight.started, flight.t_prefill, flight.t_decode, flight.t_end, flight.gap)
        landed = self._frame_outputs(flight.seqs, _row_results(out))
        if self.runner.audio is not None:  # the codec one step behind: `_hear` attaches the audio
            self._unheard = landed
        return [out for _, out in landed]

    def _hear(self, while_waiting: WhileWaiting | None = None) -> None:
        """Pipelined: the audio of the landed step into its outputs (waits for its codec; `while_waiting`
        runs meanwhile, as while the step lands: a sequence it ends keeps the frame it made)."""
        if self._unheard is None:
            return
        pcm = self.runner.collect_audio(while_waiting)
        for row, out in self._unheard:
            out.pcm = pcm[row].copy()
        self._unheard = None

    def _inject_fault(self, seqs: list[Sequence]) -> None:
        injected = self.config.fault_injection_seed
        if injected is not None and any(s.sampling.seed == injected for s in seqs):
            inject_device_fault(self.runner.device)

    def _rows(self, seqs: list[Sequence]) -> list[DecodeRow]:
        return [DecodeRow(s.slot, s.prompt_len + s.next_frame, s.next_frame, self.scheduler.kv.pages(s.seq_id))
                for s in seqs]

    def _frame_outputs(self, seqs: list[Sequence], results: list) -> list[tuple[int, StepOutput]]:
        """(row, StepOutput) of each row's frame; a row that failed alone or whose sampling went non-finite
        ends its sequence (reason 'error') without its frame; EOS or the frame cap finish it."""
        outputs = []
        for row, (seq, result) in enumerate(zip(seqs, results)):
            if seq.status is not Status.RUNNING:  # pipelined: ended while its frame was in flight
                continue
            if isinstance(result, Exception):
                self._finish(seq, "error", step_error("decode", seq.num_frames))
                continue
            frame, c0_next, pcm, fault = result
            if fault:
                self._finish(seq, "error", nonfinite_error(seq.sampling))
                continue
            seq.num_frames += 1
            out = StepOutput(seq.seq_id, codes=frame[None], pcm=pcm,
                             stats=seq.first_frame() if seq.num_frames == 1 else {})
            reason = ("eos" if c0_next == self.codec_eos_id
                      else "max_frames" if seq.num_frames >= seq.frame_cap else None)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                out.finished, out.reason = True, reason
            outputs.append((row, out))
        return outputs

    def _decode_rows(self, rows: list[DecodeRow]) -> list[tuple]:
        """One decode step -> per row (frame [16], next c0, pcm [1920], fault) (`_row_results`)."""
        return _row_results(self.runner.decode(rows))

    def has_work(self) -> bool:
        return (self.scheduler.has_work() or bool(self._outbox) or bool(self.preparer)
                or bool(self._flights))

    def stats(self) -> dict[str, Any]:
        sch = self.scheduler
        return dict(active=len(sch.running), queued=len(sch.waiting), kv_pages_used=sch.kv.num_used,
                    kv_pages_total=sch.kv.num_pages, slots_used=sch.slots.num_used,
                    slots_total=sch.slots.num_slots, steps=self.num_steps,
                    decode_steps=self.runner.num_decode_steps,
                    graph_replays=self.runner.num_graph_replays, **self.times.as_stats(), **self.voices.stats())

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()


def _row_results(out: DecodeOutput) -> list[tuple]:
    """A runner `DecodeOutput` -> per row (frame [16], next c0, pcm, fault), copied (the runner's arrays are
    views of its buffers, which the next decode, e.g. a bisection's, overwrites)."""
    return list(zip(out.frames.copy(), out.c0_next.tolist(), out.pcm.copy(), out.faults.tolist()))


@dataclass
class _Flight:
    """A decode step launched by one `step()` call and landed by the next (pipelined codec)."""

    seqs: list[Sequence]
    started: list[Sequence]  # the sequences its step prefilled
    t_prefill: Any           # PhaseClock stamps: prefill start, decode start, after the launch
    t_decode: Any
    t_end: Any
    gap: tuple | None        # (stamps) the device's idle before it, resolved at its landing


__all__ = ["Engine", "EngineConfig"]
