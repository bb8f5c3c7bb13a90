"""`Engine`: continuous batching of Qwen3-TTS sequences (contract in docs/ARCHITECTURE.md).

Single-threaded. `step()` = start (prefill, all in one ragged forward) the sequences the scheduler
admits (at most `max_prefill_tokens` prompt rows per step), then one batched
decode step for every running sequence whose next text is known; it returns one StepOutput per
sequence that made a frame or finished. Text can arrive in pieces (`append_text`, `end_text`):
in incremental mode token T_{t+1} enters with frame t (spec b.4), so a sequence whose text ran out
before `end_text` waits in its slot until more arrives; after `end_text` it gets E_eos, then E_pad.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Hashable

import numpy as np
import torch

from q3tts.core import (AdmissionRejected, EngineError, InvalidRequest, SamplingParams, StepOutput,
                  UnknownSequence, VoiceSpec)
from .config import EngineConfig
from .model_runner import DecodeRow, ModelRunner, PrefillRow, UniformSource
from .scheduler import Scheduler
from .sequence import Sequence, Status
from .text_stream import TextStream
from .timing import PhaseClock, StepTimes

EMBED_ROWS = 16  # text rows are embedded in groups of >= 16 so their bits do not depend on the count


class Engine:
    sample_rate = 24000

    def __init__(self, checkpoint_or_path: Any, config: EngineConfig | None = None, *,
                 uniform_source: UniformSource | None = None, with_codec: bool = True) -> None:
        from q3tts.checkpoint.loader import Checkpoint, load_checkpoint
        from q3tts.models.tts_model import Qwen3TTS
        from q3tts.models.prompt import PromptBuilder

        config = config or EngineConfig()
        dtype = getattr(torch, config.dtype)
        ckpt = checkpoint_or_path
        if not isinstance(ckpt, Checkpoint):
            ckpt = load_checkpoint(Path(ckpt) if isinstance(ckpt, str) and Path(ckpt).exists() else ckpt,
                                   dtype=dtype, device=config.device)
        self.checkpoint = ckpt
        self.model = Qwen3TTS.from_checkpoint(ckpt).to(device=config.device, dtype=dtype)
        positions = self.model.talker.model.max_positions
        if config.max_prompt_tokens + config.max_frames > positions:
            # NOTE: the RoPE kernel reads its table without bounds checks: refuse configs that could overrun it
            raise ValueError(f"max_prompt_tokens + max_frames = {config.max_prompt_tokens + config.max_frames} "
                             f"exceeds the talker's {positions} positions")
        self.builder = PromptBuilder(self.model, ckpt.tokenizer)
        self.tts_eos_id = ckpt.config.tts_eos_id
        self.codec_eos_id = ckpt.config.talker.codec_eos_id
        with torch.no_grad():
            _, self.eos_row, self.pad_row = self.builder.special_embeds()  # [1, H] each
        codec = self._make_codec(ckpt, config, dtype) if with_codec else None
        config = config.resolve(self._bytes_per_page(ckpt, dtype, config.page_size), self._free_bytes(config))
        self.config = config
        self.scheduler = Scheduler(config)
        self.runner = ModelRunner(self.model, codec, config, self.pad_row, uniform_source)
        self.runner.capture_graphs()
        self._outbox: list[StepOutput] = []  # finished outputs produced between steps (abort, errors)
        self._streams: dict[Hashable, TextStream] = {}
        self._whole_text: dict[Hashable, str] = {}
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

    # --- construction helpers ---------------------------------------------------------------------

    @staticmethod
    def _make_codec(ckpt, config: EngineConfig, dtype: torch.dtype):
        from q3tts.codec.decoder import CodecDecoder
        from q3tts.codec.streaming import StreamingDecoder

        decoder = CodecDecoder.from_weights(ckpt.codec_config, ckpt.codec_weights)
        return StreamingDecoder(decoder, config.max_slots, dtype, config.device, use_kernels=config.codec_kernels)

    @staticmethod
    def _bytes_per_page(ckpt, dtype: torch.dtype, page_size: int) -> int:
        """K and V of every layer for `page_size` tokens."""
        lc = ckpt.config.talker.layers
        per_token = 2 * lc.num_layers * lc.num_kv_heads * lc.head_dim * torch.empty((), dtype=dtype).element_size()
        return per_token * page_size

    @staticmethod
    def _free_bytes(config: EngineConfig) -> int | None:
        if torch.device(config.device).type != "cuda":
            return None
        return torch.cuda.mem_get_info(torch.device(config.device))[0]

    # --- requests ---------------------------------------------------------------------------------

    def add(self, seq_id: Hashable, voice: VoiceSpec, sampling: SamplingParams | None = None,
            text: str = "", text_done: bool = False) -> None:
        """Queue a sequence. Raises InvalidRequest (bad voice/params) or AdmissionRejected."""
        sampling = sampling or SamplingParams()
        if seq_id in self.scheduler.seqs or any(o.seq_id == seq_id for o in self._outbox):
            raise InvalidRequest(f"sequence id {seq_id!r} is already in use")
        sampling.validate()
        if voice.ref_audio is not None and (voice.xvector is None or
                                            (voice.ref_codes is None and not voice.xvector_only)):
            voice = self._encode_ref_audio(voice)
        self.builder.validate(voice)  # raises InvalidRequest
        mode = self.builder.text_mode(voice)
        seq = Sequence(seq_id, voice, sampling, text_mode=mode,
                       max_frames=min(sampling.max_frames, self.config.max_frames))
        if mode == "incremental":
            self._streams[seq_id] = TextStream(self.builder.tokenizer.encode)
        else:
            self._whole_text[seq_id] = ""
        try:
            self._feed(seq, text, text_done)
            self._estimate_prompt(seq)
            self.scheduler.add(seq)
        except BaseException:  # refused or failed: nothing of the sequence stays behind
            self._drop_text(seq_id)
            raise

    def _encode_ref_audio(self, voice: VoiceSpec) -> VoiceSpec:
        """Fill the absent ref_codes / xvector from ref_audio (codec encoder loaded on first use)."""
        import dataclasses

        from q3tts.codec.encoder import CodecEncoder
        from q3tts.codec.voice import encode_reference

        if getattr(self, "_ref_encoder", None) is None:
            self._ref_encoder = CodecEncoder.from_weights(
                self.checkpoint.codec_config, self.checkpoint.codec_weights,
                getattr(torch, self.config.dtype), self.config.device)
        codes, xvector = encode_reference(self.model, self._ref_encoder, voice.ref_audio,
                                          voice.ref_sample_rate)
        return dataclasses.replace(
            voice, ref_codes=codes if voice.ref_codes is None else voice.ref_codes,
            xvector=xvector if voice.xvector is None else voice.xvector)

    def append_text(self, seq_id: Hashable, text: str) -> None:
        seq = self._live(seq_id)
        if seq is None:
            return
        if seq.text_done:
            raise InvalidRequest(f"sequence {seq_id!r}: text already ended")
        self._guarded(seq, lambda: self._feed(seq, text, False))

    def end_text(self, seq_id: Hashable) -> None:
        seq = self._live(seq_id)
        if seq is not None and not seq.text_done:
            self._guarded(seq, lambda: self._feed(seq, "", True))

    def abort(self, seq_id: Hashable) -> None:
        """Stop a sequence now: pages and slot return at once; its final output comes with the next step."""
        seq = self._live(seq_id)
        if seq is not None:
            self._finish(seq, "aborted", None)

    def _codec_context(self, seq) -> np.ndarray | None:
        """Base ICL: the reference codes [F, 16] that precede the generated frames in the codec's
        input (spec e.1), so streamed audio continues the reference like the official decode."""
        if not self._is_icl(seq.voice) or seq.voice.ref_codes is None:
            return None
        return np.asarray(seq.voice.ref_codes, dtype=np.int64)

    # --- the step ---------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        outputs, self._outbox = self._outbox, []
        started, decode, victims = self.scheduler.schedule()
        for seq in victims:
            outputs.append(self._final_output(seq))
        t_prefill = self.clock.stamp() if started else None
        if started:  # one ragged prefill forward for all of them
            now = time.monotonic()
            self.runner.start_batch([
                PrefillRow(seq.slot, seq.sampling, seq.prompt, self.scheduler.kv.pages(seq.seq_id),
                           self._codec_context(seq)) for seq in started])
            for seq in started:
                seq.prompt = None
                self.times.queue_wait_seconds += now - seq.ready_at
        for seq in decode:
            self._push_trailing(seq)
        decode = [s for s in decode if s.status is Status.RUNNING]
        t_decode = self.clock.stamp() if started or decode else None
        if decode:
            outputs += self._decode(decode)
            self.times.decode_seconds += self.clock.seconds(t_decode, self.clock.stamp())
        if started:  # complete already when a decode followed (its host copy waited for it)
            self.times.prefill_seconds += self.clock.seconds(t_prefill, t_decode)
            self.times.prefill_steps += 1
            self.times.prefilled_sequences += len(started)
        outputs += self._outbox
        self._outbox = []
        for out in outputs:
            if out.finished:
                self.scheduler.forget(out.seq_id)
        self.num_steps += 1
        return outputs

    def _decode(self, seqs: list[Sequence]) -> list[StepOutput]:
        rows = [DecodeRow(s.slot, s.prompt_len + s.num_frames, s.num_frames,
                          self.scheduler.kv.pages(s.seq_id)) for s in seqs]
        frames, c0_next, pcm = self.runner.decode(rows)
        outputs = []
        for i, seq in enumerate(seqs):
            seq.num_frames += 1
            out = StepOutput(seq.seq_id, codes=frames[i:i + 1].copy(), pcm=pcm[i].copy())
            reason = ("eos" if c0_next[i] == self.codec_eos_id
                      else "max_frames" if seq.num_frames >= seq.max_frames else None)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                self._drop_text(seq.seq_id)
                out.finished, out.reason = True, reason
            outputs.append(out)
        return outputs

    # --- state ------------------------------------------------------------------------------------

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

    # --- text handling ----------------------------------------------------------------------------

    def _feed(self, seq: Sequence, text: str, done: bool) -> None:
        """Take new text; make the prompt once it can be built; extend the trailing ids."""
        if seq.text_mode == "incremental":
            stream = self._streams[seq.seq_id]
            if text:
                seq.text_ids += stream.append(text)
            if done:
                seq.text_ids += stream.end()
        else:
            self._whole_text[seq.seq_id] += text
        seq.text_done = seq.text_done or done
        if not seq.prompt_ready and self._can_build(seq):
            self._build_prompt(seq)
        if seq.prompt_ready and seq.text_mode == "incremental":
            self._extend_trailing(seq)

    def _can_build(self, seq: Sequence) -> bool:
        if seq.text_mode == "whole" or self._is_icl(seq.voice):
            return seq.text_done or (self._is_icl(seq.voice) and len(seq.text_ids) >= self._icl_k(seq))
        return bool(seq.text_ids) or seq.text_done

    def _build_prompt(self, seq: Sequence) -> None:
        if seq.text_done and not (seq.text_ids if seq.text_mode == "incremental"
                                  else self._whole_text[seq.seq_id].strip()):
            raise InvalidRequest("text is empty")
        text = (self._streams[seq.seq_id].text if seq.text_mode == "incremental"
                else self._whole_text[seq.seq_id])
        with torch.no_grad():
            prompt = self.builder.build(text, seq.voice)
        seq.prompt = prompt.prefill
        seq.prompt_len = prompt.prefill.shape[0]
        self.scheduler.check_fits(seq)
        seq.prompt_ready = True
        seq.ready_at = time.monotonic()

    def _extend_trailing(self, seq: Sequence) -> None:
        """trailing ids = the ref/text ids the prompt did not take, then tts_eos once the text ended
        (ICL with more ref-text tokens than ref frames + 1: the rest of the ref text comes first)."""
        icl = self._is_icl(seq.voice)
        k = self._icl_k(seq) if icl else 1
        ref_rest = self._icl_ref_ids(seq)[len(seq.voice.ref_codes) + 1:] if icl else []
        ids = ref_rest + seq.text_ids[k:]
        if seq.text_done and (not self._is_icl(seq.voice) or len(seq.text_ids) + 1 > k):
            ids = ids + [self.tts_eos_id]
        if len(ids) > self.config.max_text_tokens:
            raise InvalidRequest(f"text of {len(ids)} trailing tokens exceeds max_text_tokens="
                                 f"{self.config.max_text_tokens}")
        seq.trailing_ids = ids

    def _push_trailing(self, seq: Sequence) -> None:
        """Copy trailing rows not yet in the slot's device queue (embedded in groups, see EMBED_ROWS)."""
        start, ids = seq.num_queued_text, seq.trailing_ids
        if start >= len(ids):
            return
        new = ids[start:]
        with torch.no_grad():
            rows = self._embed_trailing(new)
        self.runner.push_text(seq.slot, start, rows)
        seq.num_queued_text = len(ids)

    def _embed_trailing(self, ids: list[int]) -> torch.Tensor:
        eos_at_end = ids[-1] == self.tts_eos_id
        body = ids[:-1] if eos_at_end else ids
        parts = []
        if body:
            padded = body + [self.checkpoint.config.tts_pad_id] * max(0, EMBED_ROWS - len(body))
            parts.append(self.builder.embed_text(padded)[:len(body)])
        if eos_at_end:
            parts.append(self.eos_row)
        return torch.cat(parts)

    def _is_icl(self, voice: VoiceSpec) -> bool:
        return self.checkpoint.config.variant == "base" and not voice.xvector_only

    def _icl_ref_ids(self, seq: Sequence) -> list[int]:
        from q3tts.models.prompt import REF_TAIL, ROLE_TOKENS, ref_string

        return self.builder.tokenizer.encode(ref_string(seq.voice.ref_text))[ROLE_TOKENS:-REF_TAIL]

    def _icl_k(self, seq: Sequence) -> int:
        """ICL streaming: text tokens inside the prefill = |Y| - n_ref (spec b.3)."""
        return max(0, len(seq.voice.ref_codes) + 1 - len(self._icl_ref_ids(seq)))

    def _estimate_prompt(self, seq: Sequence) -> None:
        """Before the prompt exists, size it with a one-token text so never-fits rejects early."""
        if not seq.prompt_ready:
            seq.prompt_len = self.builder.build("a", seq.voice).prefill.shape[0]
            self.scheduler.check_fits(seq)

    def _drop_text(self, seq_id: Hashable) -> None:
        self._streams.pop(seq_id, None)
        self._whole_text.pop(seq_id, None)

    # --- completion -------------------------------------------------------------------------------

    def _live(self, seq_id: Hashable) -> Sequence | None:
        seq = self.scheduler.seqs.get(seq_id)
        if seq is None:
            raise UnknownSequence(f"unknown sequence {seq_id!r}")
        return None if seq.status is Status.FINISHED else seq

    def _guarded(self, seq: Sequence, fn) -> None:
        """Run a text update; an error there ends the sequence (reason 'error') instead of raising."""
        try:
            fn()
        except (EngineError, ValueError) as exc:
            reason = "error"
            self._finish(seq, reason, f"{type(exc).__name__}: {exc}")

    def _finish(self, seq: Sequence, reason: str, error: str | None) -> None:
        self.scheduler.finish(seq, reason, error)
        self._drop_text(seq.seq_id)
        self._outbox.append(self._final_output(seq))

    def _final_output(self, seq: Sequence) -> StepOutput:
        self._drop_text(seq.seq_id)
        return StepOutput(seq.seq_id, codes=np.zeros((0, 16), np.int64), pcm=np.zeros(0, np.float32),
                          finished=True, reason=seq.finish_reason, error=seq.error)


__all__ = ["Engine", "EngineConfig", "AdmissionRejected", "InvalidRequest"]
