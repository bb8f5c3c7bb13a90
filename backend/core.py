"""The package's core types: what `q3tts synth`, the Triton glue and perf scripts pass to the engine.

Nothing here knows Triton or torch, and nothing here imports the rest of the package (only the wire
protocol's table of parameter ranges, `q3tts_client.protocol.FIELDS`, which `validate` enforces). `VoiceSpec`
says who speaks and how text is fed, `SamplingParams` how codes are drawn (its defaults read from a
checkpoint's generation_config.json by `from_generation_config`), `StepOutput` what one
`Engine.step()` produced for one sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from q3tts_client.protocol import FIELDS, SAMPLE_RATE, SAMPLING_FIELD_NAMES

TEXT_MODES = FIELDS["text_mode"].choices  # ("whole", "incremental")


class EngineError(Exception):
    """Base of every error the engine reports for one request; its text names the problem."""


class InvalidRequest(EngineError, ValueError):
    """The request can never be served as given (unknown speaker, missing reference, bad parameter)."""


class AdmissionRejected(EngineError):
    """The request was refused by admission control: it can never fit, or the wait queue is full."""


class UnknownSequence(EngineError, KeyError):
    """An operation named a sequence id the engine does not hold."""


@dataclass(frozen=True)
class VoiceSpec:
    """Who speaks, and how the text is fed to the talker.

    CustomVoice: `speaker` (+ `language`, `instruct` on 1.7B). VoiceDesign: `instruct` = the voice
    description. Base: `ref_codes` [F, 16] + `ref_text` (ICL) and/or `xvector` [H]; `xvector_only`
    drops the ICL part. `ref_audio` (mono float32, `ref_sample_rate`) is encoded by the engine into
    `ref_codes`/`xvector` when those are absent. `text_mode` None = the variant's reference default
    (whole for CustomVoice/VoiceDesign, incremental for Base).
    """

    speaker: str | None = None
    language: str = "auto"
    instruct: str | None = None
    ref_text: str | None = None
    ref_codes: np.ndarray | None = None
    xvector: np.ndarray | None = None
    ref_audio: np.ndarray | None = None
    ref_sample_rate: int = SAMPLE_RATE
    xvector_only: bool = False
    text_mode: str | None = None


@dataclass(frozen=True)
class SamplingParams:
    """How codes are drawn. Defaults = the released generation_config.json (spec a.7).

    `greedy=True` means argmax for both the talker and the code predictor (parity tests).
    `seed` selects the sequence's uniform stream: the same seed gives the same audio, batched or alone.
    `max_frames` caps the number of frames produced (EOS may end earlier); None: the engine's runaway guard
    caps them by the length of the text (`EngineConfig.text_frame_cap`).
    """

    greedy: bool = False
    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.05
    subtalker_greedy: bool | None = None  # None = same as `greedy`
    subtalker_temperature: float = 0.9
    subtalker_top_k: int = 50
    subtalker_top_p: float = 1.0
    seed: int = 0
    max_frames: int | None = None

    @classmethod
    def from_generation_config(cls, gen: dict[str, Any] | None, **overrides: Any) -> SamplingParams:
        """The checkpoint's generation_config.json defaults (absent keys: this class's defaults), then
        `overrides` (field name -> value; None values are ignored). The one place defaults are read.

        `max_new_tokens` (8192 in every release, 11 minutes of audio) is not a default: a request without
        `max_frames` is capped by the length of its text instead. `do_sample` / `subtalker_dosample` set the talker / code predictor draws apart, as in the
        reference; a `greedy` override without a `subtalker_greedy` one applies to both."""
        gen = gen or {}
        base = cls()
        do_sample, sub_sample = gen.get("do_sample", True), gen.get("subtalker_dosample", True)
        fields = dict(
            greedy=not do_sample, subtalker_greedy=None if sub_sample == do_sample else not sub_sample,
            **{name: gen.get(name, getattr(base, name)) for name in (
                "temperature", "top_k", "top_p", "repetition_penalty", "subtalker_temperature",
                "subtalker_top_k", "subtalker_top_p")})
        given = {k: v for k, v in overrides.items() if v is not None}
        if "greedy" in given and "subtalker_greedy" not in given:
            fields["subtalker_greedy"] = None
        return cls(**{**fields, **given})

    @property
    def cp_greedy(self) -> bool:
        return self.greedy if self.subtalker_greedy is None else self.subtalker_greedy

    def validate(self) -> None:
        """Raise InvalidRequest naming the first field that is not of its type, not finite or out of its
        range (`q3tts_client.protocol.FIELDS`; a temperature a greedy draw does not use: finiteness only),
        so no value that could make a device index go out of bounds reaches the slot tensors."""
        draws_greedy = {"greedy": self.greedy, "subtalker_greedy": self.cp_greedy}
        for name in SAMPLING_FIELD_NAMES:
            value, f = getattr(self, name), FIELDS[name]
            if value is None and name in ("subtalker_greedy", "max_frames"):
                continue
            if not _is_type(value, f.type):
                raise InvalidRequest(f"parameter {name!r} must be {f.type.__name__}, got {value!r}")
            try:
                f.check(value, used=not draws_greedy.get(f.unused_when, False))
            except ValueError as e:
                raise InvalidRequest(str(e)) from None


def _is_type(value: Any, kind: type) -> bool:
    """bool: a bool; int: an integer that is not a bool; float: any real number that is not a bool."""
    if isinstance(value, (bool, np.bool_)):
        return kind is bool
    if kind is int:
        return isinstance(value, (int, np.integer))
    return kind is float and isinstance(value, (int, float, np.integer, np.floating))


@dataclass
class StepOutput:
    """What one engine step produced for one sequence.

    `codes` [n, 16] int64 and `pcm` [n * 1920] float32 (24 kHz) are the frames made this step
    (n is 0 or 1 in steady state). `finished` is set exactly once per sequence, on its last output;
    `error` (with `finished`) says why a sequence ended abnormally. `reason` is one of
    'eos', 'max_frames', 'aborted', 'error' when finished. `stats` is set on a sequence's first frame only
    (its TTFA stamps, engine/sequence.py `first_frame`): the serving loop queues those frames' audio first.
    """

    seq_id: Any
    codes: np.ndarray
    pcm: np.ndarray
    finished: bool = False
    reason: str | None = None
    error: str | None = None
    stats: dict[str, float] = field(default_factory=dict)
