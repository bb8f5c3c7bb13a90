"""`InputProcessor`: requests -> `Sequence`s, and the model inputs the engine takes from them.

A request's voice is resolved (reference audio encoded: `q3tts.codec.voice.resolve_voice`) and
checked, a Base voice is prepared on the device (`prepare`, kept by `engine/voice_cache.py`), its text
gets a `TextFeed` (Base ICL: split as `q3tts.models.prompt.icl_prefill_rows` says), its prompt rows are
built once the feed allows, and the feed's trailing ids are embedded for the slot's device text queue.
Nothing here touches the scheduler or the model runner.
"""

from __future__ import annotations

from typing import Callable, Hashable

import numpy as np
import torch

from q3tts.codec.voice import check_reference, needs_encoding, resolve_voice
from q3tts.core import SamplingParams, VoiceSpec
from q3tts.models.prompt import PromptBuilder, icl_prefill_rows, text_ids

from .config import EngineConfig
from .sequence import Sequence
from .text_feed import TextFeed
from .text_stream import TextStream
from .voice_cache import PreparedVoice

EMBED_ROWS = 16  # text rows are embedded in groups of >= 16 so their bits do not depend on the count


class InputProcessor:
    def __init__(self, model, checkpoint, config: EngineConfig) -> None:
        self.model, self.checkpoint, self.config = model, checkpoint, config
        self.builder = PromptBuilder(model, checkpoint.tokenizer)
        with torch.no_grad():
            _, self.eos_row, self.pad_row = self.builder.special_embeds()  # [1, H] each
        self._encoder = None  # the codec encoder, built when a reference recording first needs it

    def new_sequence(self, seq_id: Hashable, voice: VoiceSpec, sampling: SamplingParams,
                     prepared: PreparedVoice | None = None) -> Sequence:
        """A sequence with a resolved, checked voice and an empty text feed; raises InvalidRequest.
        `prepared`: the voice on the device (`prepare`; None: its prompt makes what it needs)."""
        voice = self.encode(voice)
        self.check(voice, sampling)
        given = sampling.max_frames
        tensors = prepared.tensors if prepared is not None else None
        return Sequence(seq_id, voice, sampling, self._feed(voice, tensors), text_cap=self.config.text_frame_cap,
                        max_frames=None if given is None else min(given, self.config.max_frames),
                        voice_tensors=tensors, codec_state=prepared.codec_state if prepared is not None else None)

    def check(self, voice: VoiceSpec, sampling: SamplingParams) -> None:
        """Everything `new_sequence` checks, without device work (reference audio still to be encoded:
        its limits): a request that would be refused is refused before any work."""
        sampling.validate()
        encoded = not needs_encoding(voice)
        if not encoded:
            check_reference(voice.ref_audio, voice.ref_sample_rate)
        self.builder.validate(voice, encoded=encoded)

    def prepare(self, voice: VoiceSpec, prime: Callable[[np.ndarray | None], list | None]) -> PreparedVoice:
        """A checked Base voice on the device: its prompt tensors, and for ICL its codec stream primed with
        the reference frames (`prime`: `ModelRunner.prime_state`). Run by the preparer's worker."""
        return PreparedVoice(self.builder.voice_tensors(voice), prime(self.codec_context(voice)))

    def encode(self, voice: VoiceSpec) -> VoiceSpec:
        """The voice with its reference audio encoded (a no-op when there is nothing to encode)."""
        return resolve_voice(voice, self.model, self._reference_encoder)

    def _feed(self, voice: VoiceSpec, tensors) -> TextFeed:
        mode = self.builder.text_mode(voice)
        if mode == "whole":
            return TextFeed(mode)
        head, prompt_rows = [], 1
        if self.builder.is_icl(voice):
            head = tensors.ref_ids if tensors is not None else self.builder.ref_ids(voice.ref_text)
            prompt_rows = icl_prefill_rows(len(voice.ref_codes))
        return TextFeed(mode, TextStream(self.builder.tokenizer.encode), head, prompt_rows,
                        eos_id=self.checkpoint.config.tts_eos_id, max_trailing=self.config.max_text_tokens)

    def _reference_encoder(self):
        if self._encoder is None:
            from q3tts.codec.encoder import CodecEncoder

            self._encoder = CodecEncoder.from_weights(
                self.checkpoint.codec_config, self.checkpoint.codec_weights,
                getattr(torch, self.config.dtype), self.config.device)
        return self._encoder

    # --- prompts ----------------------------------------------------------------------------------

    def build_prompt(self, seq: Sequence) -> None:
        """seq.prompt [L0, H] and seq.prompt_len from the feed's text (call once `feed.is_ready`); in whole mode
        also the feed's token count (the text is tokenized once, here)."""
        text = seq.feed.prompt_text()
        ids = self.builder.target_ids(text)
        prompt = self.builder.build(text, seq.voice, seq.voice_tensors, ids=ids)
        seq.prompt, seq.prompt_len = prompt.prefill, prompt.prefill.shape[0]
        if seq.feed.mode == "whole":
            seq.feed.num_tokens = len(text_ids(ids))

    def estimate_prompt_len(self, seq: Sequence) -> int:
        """L0 before the text allows the prompt: that of a one-token text (never-fits rejects early)."""
        return self.builder.build("a", seq.voice, seq.voice_tensors).prefill.shape[0]

    def codec_context(self, voice: VoiceSpec) -> np.ndarray | None:
        """Base ICL: the reference codes [F, 16] that precede the generated frames in the codec's
        input (spec e.1), so streamed audio continues the reference like the official decode."""
        if not self.builder.is_icl(voice) or voice.ref_codes is None:
            return None
        return np.asarray(voice.ref_codes, dtype=np.int64)

    # --- trailing text ----------------------------------------------------------------------------

    def trailing_rows(self, seq: Sequence) -> tuple[int, torch.Tensor] | None:
        """(start, rows [k, H]): the trailing ids not yet in the slot's text queue, embedded (they
        count as queued from now on); None when there are none."""
        feed = seq.feed
        start, ids = feed.num_queued, feed.trailing
        if start >= len(ids):
            return None
        rows = self._embed_trailing(ids[start:])
        feed.num_queued = len(ids)
        return start, rows

    @torch.no_grad()  # here, not on trailing_rows: every decode step asks for every row (a no_grad call: ~5 µs)
    def _embed_trailing(self, ids: list[int]) -> torch.Tensor:
        eos_at_end = ids[-1] == self.checkpoint.config.tts_eos_id
        body = ids[:-1] if eos_at_end else ids
        parts = []
        if body:
            padded = body + [self.checkpoint.config.tts_pad_id] * max(0, EMBED_ROWS - len(body))
            parts.append(self.builder.embed_text(padded)[:len(body)])
        if eos_at_end:
            parts.append(self.eos_row)
        return torch.cat(parts)  # [k, H]
