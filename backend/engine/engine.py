"""`Engine`: continuous batching of Qwen3-TTS sequences (contract in docs/ARCHITECTURE.md).

Single-threaded, and it only orchestrates: the `InputProcessor` turns requests into `Sequence`s
(voice, text feed, prompt), the `Scheduler` decides who starts and who steps, the `ModelRunner` runs
the device work. `step()` = start (prefill, all in one ragged forward) the sequences the scheduler
admits, then one batched decode step for every running sequence whose next text is known; it
returns one StepOutput per sequence that made a frame or finished. Text can arrive in pieces
(`append_text`, `end_text`): in incremental mode token T_{t+1} enters with frame t (spec b.4), so a
sequence whose text ran out before `end_text` waits in its slot until more arrives.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Hashable

import torch

from q3tts.codec.audio import SAMPLE_RATE
from q3tts.core import (EngineError, InvalidRequest, SamplingParams, StepOutput, UnknownSequence,
                        VoiceSpec)
from q3tts.models.sampling import UniformSource

from .config import EngineConfig
from .cuda_graph import DecodeRow
from .faults import check_token_ids, inject_device_fault, nonfinite_error
from .input_processor import InputProcessor
from .model_runner import ModelRunner, PrefillRow, make_codec, resolve_config
from .scheduler import Scheduler
from .sequence import Sequence, Status
from .timing import PhaseClock, StepTimes


class Engine:
    sample_rate = SAMPLE_RATE

    def __init__(self, checkpoint_or_path: Any, config: EngineConfig | None = None, *,
                 uniform_source: UniformSource | None = None, with_codec: bool = True) -> None:
        from q3tts.checkpoint.loader import Checkpoint, load_checkpoint
        from q3tts.models.tts_model import Qwen3TTS

        config = config or EngineConfig()
        dtype = getattr(torch, config.dtype)
        ckpt = checkpoint_or_path
        if not isinstance(ckpt, Checkpoint):
            ckpt = load_checkpoint(ckpt, dtype=dtype, device=config.device)
        self.checkpoint = ckpt
        check_token_ids(ckpt.tokenizer.vocab_size, ckpt.config.talker.text_vocab_size)
        self.model = Qwen3TTS.from_checkpoint(ckpt).to(device=config.device, dtype=dtype)
        self.inputs = InputProcessor(self.model, ckpt, config)
        self.codec_eos_id = ckpt.config.talker.codec_eos_id
        codec = make_codec(ckpt, config) if with_codec else None
        self.config = resolve_config(self.model, config)  # after the codec: KV takes a share of what is left
        self.scheduler = Scheduler(self.config)
        self.runner = ModelRunner(self.model, codec, self.config, self.inputs.pad_row, uniform_source)
        self.runner.capture_graphs()
        self._outbox: list[StepOutput] = []  # finished outputs produced between steps (abort, errors)
        self.num_steps = 0
        self.clock = PhaseClock(self.runner.device)
        self.times = StepTimes()

    @classmethod
    def from_checkpoint(cls, checkpoint_or_path: Any, config: EngineConfig | None = None, **kwargs) -> Engine:
        """The public constructor: a loaded Checkpoint or a path / hub id, and the engine settings."""
        return cls(checkpoint_or_path, config, **kwargs)

    @property
    def default_sampling(self) -> SamplingParams:
        """The checkpoint's generation_config.json defaults (requests override field by field)."""
        return SamplingParams.from_generation_config(self.checkpoint.generation)

    # --- requests ---------------------------------------------------------------------------------

    def add(self, seq_id: Hashable, voice: VoiceSpec, sampling: SamplingParams | None = None,
            text: str = "", text_done: bool = False) -> None:
        """Queue a sequence (sampling None: `default_sampling`). Raises InvalidRequest (bad voice,
        params or text) or AdmissionRejected; a refused sequence leaves nothing behind."""
        if seq_id in self.scheduler.seqs or any(o.seq_id == seq_id for o in self._outbox):
            raise InvalidRequest(f"sequence id {seq_id!r} is already in use")
        seq = self.inputs.new_sequence(seq_id, voice, sampling or self.default_sampling)
        self._take_text(seq, text, text_done)
        if not seq.prompt_ready:  # size it already, so that a prompt that can never fit is refused now
            seq.prompt_len = self.inputs.estimate_prompt_len(seq)
            self.scheduler.check_fits(seq)
        self.scheduler.add(seq)

    def append_text(self, seq_id: Hashable, text: str) -> None:
        seq = self._live(seq_id)
        if seq is None:
            return
        if seq.feed.done:
            raise InvalidRequest(f"sequence {seq_id!r}: text already ended")
        self._guarded(seq, lambda: self._take_text(seq, text, False))

    def end_text(self, seq_id: Hashable) -> None:
        seq = self._live(seq_id)
        if seq is not None and not seq.feed.done:
            self._guarded(seq, lambda: self._take_text(seq, "", True))

    def abort(self, seq_id: Hashable) -> None:
        """Stop a sequence now: pages and slot return at once; its final output comes with the next step."""
        seq = self._live(seq_id)
        if seq is not None:
            self._finish(seq, "aborted", None)

    def _take_text(self, seq: Sequence, text: str, done: bool) -> None:
        """Feed the text; build the prompt as soon as the feed allows it and check that it fits."""
        seq.feed.add(text, done)
        if not seq.prompt_ready and seq.feed.is_ready:
            self.inputs.build_prompt(seq)
            self.scheduler.check_fits(seq)
            seq.prompt_ready, seq.ready_at = True, time.monotonic()

    # --- the step ---------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        outputs, self._outbox = self._outbox, []
        started, decode, victims = self.scheduler.schedule()
        outputs += [seq.final_output() for seq in victims]
        t_prefill = self.clock.stamp() if started else None
        if started:
            self._prefill(started)
        for seq in decode:
            queued = self.inputs.trailing_rows(seq)
            if queued is not None:
                self.runner.push_text(seq.slot, *queued)
        t_decode = self.clock.stamp() if started or decode else None
        decode_s = prefill_s = None
        if decode:
            outputs += self._decode(decode)
            decode_s = self.clock.seconds(t_decode, self.clock.stamp())
            self.times.decode_seconds += decode_s
        if started:  # complete already when a decode followed (its host copy waited for it)
            prefill_s = self.clock.seconds(t_prefill, t_decode)
            self.times.add_prefill(prefill_s, len(started))
        self.scheduler.observe(started, prefill_s, decode_s)
        outputs += self._outbox
        self._outbox = []
        for out in outputs:
            if out.finished:
                self.scheduler.forget(out.seq_id)
        self.num_steps += 1
        return outputs

    def _prefill(self, seqs: list[Sequence]) -> None:
        """One ragged prefill forward for the sequences started this step; their prompts are dropped."""
        now = time.monotonic()
        self.runner.start_batch([PrefillRow(s.slot, s.sampling, s.prompt, self.scheduler.kv.pages(s.seq_id),
                                            self.inputs.codec_context(s)) for s in seqs])
        for seq in seqs:
            seq.prompt = None
            self.times.queue_wait_seconds += now - seq.ready_at

    def _decode(self, seqs: list[Sequence]) -> list[StepOutput]:
        """One decode step; a row whose sampling went non-finite ends (reason 'error') without its frame."""
        injected = self.config.fault_injection_seed
        if injected is not None and any(s.sampling.seed == injected for s in seqs):
            inject_device_fault(self.runner.device)
        rows = [DecodeRow(s.slot, s.prompt_len + s.num_frames, s.num_frames,
                          self.scheduler.kv.pages(s.seq_id)) for s in seqs]
        frames, c0_next, pcm, faults = self.runner.decode(rows)
        outputs = []
        for i, seq in enumerate(seqs):
            if faults[i]:
                self._finish(seq, "error", nonfinite_error(seq.sampling))
                continue
            seq.num_frames += 1
            out = StepOutput(seq.seq_id, codes=frames[i:i + 1].copy(), pcm=pcm[i].copy(),
                             stats=seq.first_frame() if seq.num_frames == 1 else {})
            reason = ("eos" if c0_next[i] == self.codec_eos_id
                      else "max_frames" if seq.num_frames >= seq.frame_cap else None)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                out.finished, out.reason = True, reason
            outputs.append(out)
        return outputs

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._outbox)

    def stats(self) -> dict[str, Any]:
        sch = self.scheduler
        return dict(active=len(sch.running), queued=len(sch.waiting), kv_pages_used=sch.kv.num_used,
                    kv_pages_total=sch.kv.num_pages, slots_used=sch.slots.num_used,
                    slots_total=sch.slots.num_slots, steps=self.num_steps,
                    decode_steps=self.runner.num_decode_steps,
                    graph_replays=self.runner.num_graph_replays, **self.times.as_stats())

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    # --- completion -------------------------------------------------------------------------------

    def _live(self, seq_id: Hashable) -> Sequence | None:
        seq = self.scheduler.seqs.get(seq_id)
        if seq is None:
            raise UnknownSequence(f"unknown sequence {seq_id!r}")
        return None if seq.status is Status.FINISHED else seq

    def _guarded(self, seq: Sequence, fn: Callable[[], None]) -> None:
        """Run a text update; an error there ends the sequence (reason 'error') instead of raising."""
        try:
            fn()
        except (EngineError, ValueError) as exc:
            self._finish(seq, "error", f"{type(exc).__name__}: {exc}")

    def _finish(self, seq: Sequence, reason: str, error: str | None) -> None:
        self.scheduler.finish(seq, reason, error)
        self._outbox.append(seq.final_output())


__all__ = ["Engine", "EngineConfig"]
