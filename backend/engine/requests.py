"""`RequestIntake`: the Engine's request API (add, append_text, end_text, abort), between steps.

A request becomes a `Sequence` (InputProcessor) and joins the scheduler's queue, or is refused at once
(InvalidRequest / AdmissionRejected) leaving nothing behind. A voice with reference audio to encode, or a
Base voice the engine's `VoiceCache` does not keep yet, is checked first (limits, variant, parameters: no
work yet) and then prepared off the engine thread (`Preparer`); text, end and abort that arrive meanwhile
are kept with it, and once it is prepared the next `step` admits it, or ends it with the error that
prevented that. A kept voice is admitted at once with its device tensors and primed codec state.
"""

from __future__ import annotations

import time
from typing import Callable, Hashable

import numpy as np

from q3tts.codec.voice import needs_encoding
from q3tts.core import EngineError, InvalidRequest, SamplingParams, StepOutput, UnknownSequence, VoiceSpec

from .preparer import WAIT_S, Pending
from .sequence import Sequence, Status


class RequestIntake:
    """Mixed into `Engine` (it owns `inputs`, `scheduler`, `preparer`, `voices`, `_outbox`,
    `default_sampling`)."""

    def add(self, seq_id: Hashable, voice: VoiceSpec, sampling: SamplingParams | None = None,
            text: str = "", text_done: bool = False) -> None:
        """Queue a sequence (sampling None: `default_sampling`). Raises InvalidRequest (bad voice,
        params or text) or AdmissionRejected; a refused sequence leaves nothing behind. A voice whose
        reference audio must be encoded, or that is not kept on the device yet, is checked, then
        prepared off the engine thread: an error there ends the sequence (reason 'error') with a later
        step."""
        if (seq_id in self.scheduler.seqs or seq_id in self.preparer
                or any(o.seq_id == seq_id for o in self._outbox)):
            raise InvalidRequest(f"sequence id {seq_id!r} is already in use")
        sampling = sampling or self.default_sampling
        encode = needs_encoding(voice)
        prepared = None if encode else self.voices.get(voice)
        if encode or (prepared is None and self.voices.keeps(voice)):
            self.inputs.check(voice, sampling)
            self.preparer.submit(Pending(seq_id, voice, sampling, [text], text_done))
            return
        self._admit(self.inputs.new_sequence(seq_id, voice, sampling, prepared), text, text_done)

    def append_text(self, seq_id: Hashable, text: str) -> None:
        job = self.preparer.pending.get(seq_id)
        seq = self._live(seq_id) if job is None else None
        if (job or seq) is None:
            return
        if (job.text_done if job else seq.feed.done):
            raise InvalidRequest(f"sequence {seq_id!r}: text already ended")
        if job is not None:
            job.text.append(text)
        else:
            self._guarded(seq, lambda: self._take_text(seq, text, False))

    def end_text(self, seq_id: Hashable) -> None:
        job = self.preparer.pending.get(seq_id)
        if job is not None:
            job.text_done = True
            return
        seq = self._live(seq_id)
        if seq is not None and not seq.feed.done:
            self._guarded(seq, lambda: self._take_text(seq, "", True))

    def abort(self, seq_id: Hashable) -> None:
        """Stop a sequence now: pages and slot return at once; its final output comes with the next step."""
        if self.preparer.cancel(seq_id):
            self._outbox.append(ended(seq_id, "aborted"))
            return
        seq = self._live(seq_id)
        if seq is not None:
            self._finish(seq, "aborted", None)

    # --- helpers ----------------------------------------------------------------------------------

    def _admit(self, seq: Sequence, text: str, text_done: bool) -> None:
        self._take_text(seq, text, text_done)
        if not seq.prompt_ready:  # size it already, so that a prompt that can never fit is refused now
            seq.prompt_len = self.inputs.estimate_prompt_len(seq)
            self.scheduler.check_fits(seq)
        self.scheduler.add(seq)

    def _admit_prepared(self, idle: bool) -> None:
        """Admit the sequences whose voices were prepared since the last step (waits WAIT_S for one when
        the engine has nothing else to do); one that cannot be admitted ends with its error."""
        for job in self.preparer.take(WAIT_S if idle else 0.0):
            try:
                if isinstance(job.result, Exception):
                    raise job.result
                seq = self.inputs.new_sequence(job.seq_id, job.result, job.sampling, job.prepared)
                self._admit(seq, "".join(job.text), job.text_done)
            except EngineError as exc:
                self._outbox.append(ended(job.seq_id, "error", str(exc)))

    def _take_text(self, seq: Sequence, text: str, done: bool) -> None:
        """Feed the text; build the prompt as soon as the feed allows it and check that it fits."""
        seq.feed.add(text, done)
        if not seq.prompt_ready and seq.feed.is_ready:
            self.inputs.build_prompt(seq)
            self.scheduler.check_fits(seq)
            seq.prompt_ready, seq.ready_at = True, time.monotonic()

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
            self._finish(seq, "error", f"input TEXT: {exc}")

    def _finish(self, seq: Sequence, reason: str, error: str | None) -> None:
        self.scheduler.finish(seq, reason, error)
        self._outbox.append(seq.final_output())


def ended(seq_id: Hashable, reason: str, error: str | None = None) -> StepOutput:
    """The final output of a sequence that ended before it had a `Sequence` (still being prepared)."""
    return StepOutput(seq_id, codes=np.zeros((0, 16), np.int64), pcm=np.zeros(0, np.float32),
                      finished=True, reason=reason, error=error)
