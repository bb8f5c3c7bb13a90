"""Triton request -> serving command. No `triton_python_backend_utils` here: only methods of the request
object (`inputs()`, `parameters()`, `correlation_id()`, `flags()`) are used, so fakes test it directly.

Every problem raises `BadRequest` whose text names the input or parameter and what was expected.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from q3tts_client import protocol as P
from q3tts.core import TEXT_MODES, InvalidRequest, SamplingParams, VoiceSpec

FLAG_START = 1  # TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
FLAG_END = 2  # TRITONSERVER_REQUEST_FLAG_SEQUENCE_END


class BadRequest(ValueError):
    """The request is malformed; the text names the problem."""


@dataclass
class SessionOptions:
    """What a START request fixes for the whole sequence."""

    voice: VoiceSpec
    sampling: SamplingParams
    audio_format: str = "float32"
    chunk_schedule: tuple[int, ...] = P.DEFAULT_CHUNK_SCHEDULE
    ack_pieces: bool = False  # non-END requests get their FINAL at once; audio streams on the END request


@dataclass
class Piece:
    """One request of a sequence: `options` is set on START only."""

    key: Any  # correlation ID (int or str)
    start: bool
    end: bool
    text: str
    options: SessionOptions | None = None
    abort: bool = False  # drop the sequence (protocol.PARAM_ABORT)


def _inputs(request) -> dict[str, np.ndarray]:
    return {t.name(): t.as_numpy() for t in request.inputs()}


def _one_string(name: str, arr: np.ndarray) -> str:
    if arr.size != 1:
        raise BadRequest(f"input {name} must hold exactly one string, got shape {list(arr.shape)}")
    v = arr.reshape(-1)[0]
    if isinstance(v, (bytes, np.bytes_)):
        try:
            return bytes(v).decode("utf-8")
        except UnicodeDecodeError:
            raise BadRequest(f"input {name} is not valid UTF-8") from None
    if isinstance(v, str):
        return v
    raise BadRequest(f"input {name} must be TYPE_STRING (BYTES), got {arr.dtype}")


def parse_parameters(request) -> dict[str, Any]:
    """Request parameters coerced to the protocol's types; unknown names are errors."""
    raw = request.parameters()
    params = json.loads(raw) if isinstance(raw, str) and raw else dict(raw or {})
    out = {}
    for name, value in params.items():
        if name.startswith("triton_") or name in ("model_name", "model_version"):
            continue  # set by Triton frontends (e.g. triton_enable_empty_final_response)
        try:
            out[name] = P.coerce_param(name, value)
        except ValueError as e:
            raise BadRequest(str(e)) from None
    return out


def parse_options(inputs: dict[str, np.ndarray], params: dict[str, Any], default_schedule) -> SessionOptions:
    def opt_str(name: str) -> str | None:
        return _one_string(name, inputs[name]) if name in inputs else None

    text_mode = params.get(P.PARAM_TEXT_MODE)
    if text_mode is not None and text_mode not in TEXT_MODES:
        raise BadRequest(f"parameter {P.PARAM_TEXT_MODE} must be one of {TEXT_MODES}, got {text_mode!r}")
    ref_audio = None
    if P.INPUT_REF_AUDIO in inputs:
        ref_audio = np.asarray(inputs[P.INPUT_REF_AUDIO], dtype=np.float32).reshape(-1)
        if ref_audio.size == 0 or not np.isfinite(ref_audio).all():
            raise BadRequest(f"input {P.INPUT_REF_AUDIO} must be non-empty finite float32 samples")
    sr = 24000
    if P.INPUT_REF_SAMPLE_RATE in inputs:
        rate = np.asarray(inputs[P.INPUT_REF_SAMPLE_RATE]).reshape(-1)
        if rate.size != 1:
            raise BadRequest(f"input {P.INPUT_REF_SAMPLE_RATE} must hold one value, got {rate.size}")
        sr = int(rate[0])
        if not 8000 <= sr <= 192000:
            raise BadRequest(f"input {P.INPUT_REF_SAMPLE_RATE} must be in 8000..192000, got {sr}")
    voice = VoiceSpec(
        speaker=opt_str(P.INPUT_SPEAKER) or None, language=opt_str(P.INPUT_LANGUAGE) or "auto",
        instruct=opt_str(P.INPUT_INSTRUCT) or None, ref_text=opt_str(P.INPUT_REF_TEXT) or None,
        ref_audio=ref_audio, ref_sample_rate=sr, xvector_only=bool(params.get(P.PARAM_XVECTOR_ONLY, False)),
        text_mode=text_mode,
    )
    sampling = SamplingParams(**{k: v for k, v in params.items() if k in P.SAMPLING_PARAMS})
    try:
        sampling.validate()
    except InvalidRequest as e:
        raise BadRequest(str(e)) from None
    fmt = params.get(P.PARAM_AUDIO_FORMAT, "float32")
    if fmt not in P.AUDIO_FORMATS:
        raise BadRequest(f"parameter {P.PARAM_AUDIO_FORMAT} must be one of {sorted(P.AUDIO_FORMATS)}, got {fmt!r}")
    schedule = default_schedule
    if P.PARAM_CHUNK_SCHEDULE in params:
        try:
            schedule = P.parse_chunk_schedule(params[P.PARAM_CHUNK_SCHEDULE])
        except ValueError as e:
            raise BadRequest(str(e)) from None
    return SessionOptions(voice, sampling, fmt, schedule, bool(params.get(P.PARAM_ACK_PIECES, False)))


def parse_request(request, default_schedule=P.DEFAULT_CHUNK_SCHEDULE) -> Piece:
    """Validate one request of the sequence model and turn it into a Piece (raises BadRequest)."""
    flags = int(request.flags())
    start, end = bool(flags & FLAG_START), bool(flags & FLAG_END)
    key = request.correlation_id()
    if key in (0, "", None):
        raise BadRequest("the request has no correlation ID (sequence_id): the sequence model needs one")
    inputs = _inputs(request)
    if P.INPUT_TEXT not in inputs:
        raise BadRequest(f"input {P.INPUT_TEXT} is required on every request (it may be empty)")
    text = _one_string(P.INPUT_TEXT, inputs[P.INPUT_TEXT])
    params = parse_parameters(request)
    abort = bool(params.pop(P.PARAM_ABORT, False))
    if abort or not start:
        # NOTE: parameters on later requests are ignored (perf_analyzer repeats them on every step);
        # voice inputs there are an error, since they would silently not apply.
        extra = sorted(set(inputs) - {P.INPUT_TEXT})
        if extra and not start:
            raise BadRequest(f"{', '.join(extra)} can only be set on the START request of a sequence")
        return Piece(key, start, end, text, None, abort=True) if abort else Piece(key, False, end, text)
    return Piece(key, True, end, text, parse_options(inputs, params, default_schedule))
