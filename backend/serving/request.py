"""Triton request -> serving command, and serving results -> Triton responses.

Parsing uses only the request object's methods (`inputs()`, `parameters()`, `correlation_id()`, `flags()`),
so fakes test it directly; every problem raises `BadRequest` whose text names the input or parameter and
what was expected. The response builders import `triton_python_backend_utils` lazily (with model.py and
metrics.py, the only users of it).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

from q3tts_client import protocol as P
from q3tts.core import InvalidRequest, SamplingParams, VoiceSpec
from q3tts.serving.chunker import Chunk
from q3tts.serving.commands import Abort, Append, SessionOptions, Start

FLAG_START = 1  # TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
FLAG_END = 2  # TRITONSERVER_REQUEST_FLAG_SEQUENCE_END


class BadRequest(ValueError):
    """The request is malformed; the text names the problem."""


# --- requests ---------------------------------------------------------------------------------------------
def sequence_flags(request) -> tuple[Any, bool, bool]:
    """(correlation ID, START, END) of a request."""
    flags = int(request.flags())
    return request.correlation_id(), bool(flags & FLAG_START), bool(flags & FLAG_END)


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


def _ref_audio(inputs: dict[str, np.ndarray]) -> tuple[np.ndarray | None, int]:
    """REF_AUDIO and REF_SAMPLE_RATE, checked (protocol.FIELDS: rate range, at most MAX_REF_SECONDS) before
    any work is done on them."""
    sr = P.SAMPLE_RATE
    if P.INPUT_REF_SAMPLE_RATE in inputs:
        rate = np.asarray(inputs[P.INPUT_REF_SAMPLE_RATE]).reshape(-1)
        if rate.size != 1:
            raise BadRequest(f"input {P.INPUT_REF_SAMPLE_RATE} must hold one value, got {rate.size}")
        sr = int(rate[0])
        _check(P.INPUT_REF_SAMPLE_RATE, sr)
    if P.INPUT_REF_AUDIO not in inputs:
        return None, sr
    ref_audio = np.asarray(inputs[P.INPUT_REF_AUDIO], dtype=np.float32).reshape(-1)
    if ref_audio.size > P.MAX_REF_SECONDS * sr:
        raise BadRequest(f"input {P.INPUT_REF_AUDIO} holds {ref_audio.size / sr:.1f} s of audio at {sr} Hz; "
                         f"at most {P.MAX_REF_SECONDS} s")
    if ref_audio.size == 0 or not np.isfinite(ref_audio).all():
        raise BadRequest(f"input {P.INPUT_REF_AUDIO} must be non-empty finite float32 samples")
    return ref_audio, sr


def _check(name: str, value) -> None:
    try:
        P.FIELDS[name].check(value)
    except ValueError as e:
        raise BadRequest(str(e)) from None


def parse_voice(inputs: dict[str, np.ndarray], params: dict[str, Any]) -> VoiceSpec:
    def opt_str(name: str) -> str | None:
        return _one_string(name, inputs[name]) if name in inputs else None

    text_mode = params.get(P.PARAM_TEXT_MODE)  # checked by parse_parameters (protocol.FIELDS)
    ref_audio, sr = _ref_audio(inputs)
    return VoiceSpec(
        speaker=opt_str(P.INPUT_SPEAKER) or None, language=opt_str(P.INPUT_LANGUAGE) or "auto",
        instruct=opt_str(P.INPUT_INSTRUCT) or None, ref_text=opt_str(P.INPUT_REF_TEXT) or None,
        ref_audio=ref_audio, ref_sample_rate=sr, xvector_only=bool(params.get(P.PARAM_XVECTOR_ONLY, False)),
        text_mode=text_mode,
    )


def _voice_name(inputs: dict[str, np.ndarray]) -> str | None:
    """The VOICE input (a registered voice), which replaces every input that describes a voice."""
    if P.INPUT_VOICE not in inputs:
        return None
    clash = [name for name in (P.INPUT_SPEAKER, P.INPUT_INSTRUCT, P.INPUT_REF_AUDIO, P.INPUT_REF_SAMPLE_RATE,
                               P.INPUT_REF_TEXT) if name in inputs]
    if clash:
        raise BadRequest(f"input {P.INPUT_VOICE} names a registered voice: it cannot be combined with "
                         f"{', '.join(clash)}")
    return _one_string(P.INPUT_VOICE, inputs[P.INPUT_VOICE])


def parse_options(inputs: dict[str, np.ndarray], params: dict[str, Any], default_schedule,
                  defaults: SamplingParams, checkpoint: tuple[str, str] | None = None) -> SessionOptions:
    """What a START request fixes: the voice, sampling (`defaults` = the checkpoint's generation config,
    overridden field by field), audio format, chunk schedule and ack mode. `checkpoint` (variant, size):
    inputs and parameters that mean nothing for it are refused by name."""
    if checkpoint is not None:
        try:
            P.check_variant(*checkpoint, [*inputs, *params])
        except ValueError as e:
            raise BadRequest(str(e)) from None
    sampling = dataclasses.replace(defaults, **{k: v for k, v in params.items() if k in P.SAMPLING_PARAMS})
    try:
        sampling.validate()
    except InvalidRequest as e:
        raise BadRequest(str(e)) from None
    fmt = params.get(P.PARAM_AUDIO_FORMAT, "float32")  # checked by parse_parameters (protocol.FIELDS)
    schedule = default_schedule
    if P.PARAM_CHUNK_SCHEDULE in params:
        try:
            schedule = P.parse_chunk_schedule(params[P.PARAM_CHUNK_SCHEDULE])
        except ValueError as e:
            raise BadRequest(str(e)) from None
    return SessionOptions(parse_voice(inputs, params), sampling, fmt, schedule,
                          bool(params.get(P.PARAM_ACK_PIECES, False)), _voice_name(inputs))


def parse_request(request, default_schedule, defaults: SamplingParams,
                  checkpoint: tuple[str, str] | None = None) -> Start | Append | Abort:
    """Validate one request of the sequence model and turn it into its command (raises BadRequest);
    `checkpoint`: see parse_options."""
    key, start, end = sequence_flags(request)
    if key in (0, "", None):
        raise BadRequest("the request has no correlation ID (sequence_id): the sequence model needs one")
    inputs = {t.name(): t.as_numpy() for t in request.inputs()}
    if P.INPUT_TEXT not in inputs:
        raise BadRequest(f"input {P.INPUT_TEXT} is required on every request (it may be empty)")
    text = _one_string(P.INPUT_TEXT, inputs[P.INPUT_TEXT])
    if len(text) > P.MAX_TEXT_CHARS:
        raise BadRequest(f"input {P.INPUT_TEXT} holds {len(text)} characters; at most {P.MAX_TEXT_CHARS} per request")
    params = parse_parameters(request)
    abort = bool(params.pop(P.PARAM_ABORT, False))
    if not start:
        # NOTE: parameters on later requests are ignored (perf_analyzer repeats them on every step);
        # voice inputs there are an error, since they would silently not apply.
        extra = sorted(set(inputs) - {P.INPUT_TEXT})
        if extra:
            raise BadRequest(f"{', '.join(extra)} can only be set on the START request of a sequence")
    if abort:
        return Abort(key, end)
    if not start:
        return Append(key, text, end)
    if not end:  # the text is still open: synthesize it as it arrives (protocol.FIELDS text_mode default)
        params.setdefault(P.PARAM_TEXT_MODE, "incremental")
    return Start(key, text, end, parse_options(inputs, params, default_schedule, defaults, checkpoint))


def parse_voices_request(request) -> dict[str, Any]:
    """A request of the voices model (protocol.VOICES_INPUTS) -> `VoiceService.handle` keyword arguments."""
    inputs = {t.name(): t.as_numpy() for t in request.inputs()}
    if P.INPUT_ACTION not in inputs:
        raise BadRequest(f"input {P.INPUT_ACTION} is required ({' | '.join(P.VOICE_ACTIONS)})")
    ref_audio, sr = _ref_audio(inputs)
    name, text = (_one_string(n, inputs[n]) if n in inputs else None for n in (P.INPUT_VOICE, P.INPUT_REF_TEXT))
    return {"action": _one_string(P.INPUT_ACTION, inputs[P.INPUT_ACTION]), "name": name, "ref_audio": ref_audio,
            "sample_rate": sr, "ref_text": text,
            "xvector_only": bool(parse_parameters(request).get(P.PARAM_XVECTOR_ONLY, False))}


# --- responses --------------------------------------------------------------------------------------------
def _pb():
    import triton_python_backend_utils as pb  # only inside the stub; imported here so parsing runs without it

    return pb


def _strings(name: str, *values: str):
    return _pb().Tensor(name, np.array([v.encode() for v in values], dtype=object))


def send(sender, response, final: bool) -> None:
    """Send on a request's response sender (the response thread only)."""
    flags = _pb().TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
    if response is None:
        sender.send(flags=flags)
    else:
        sender.send(response, flags=flags)


def audio_response(chunk: Chunk | None, finish_reason: str | None = None, timing: np.ndarray | None = None):
    """An audio response (AUDIO or AUDIO_INT16, SAMPLE_RATE, FIRST_FRAME); with `finish_reason` it is the
    sequence's last one (then `chunk` may be None: FINISH_REASON alone); `timing`: TIMING (the first one)."""
    pb = _pb()
    tensors = []
    if chunk is not None:
        tensors = [pb.Tensor(chunk.output, chunk.samples),
                   pb.Tensor(P.OUTPUT_SAMPLE_RATE, np.array([P.SAMPLE_RATE], np.int32)),
                   pb.Tensor(P.OUTPUT_FIRST_FRAME, np.array([chunk.first_frame], np.int64))]
    if finish_reason is not None:
        tensors.append(_strings(P.OUTPUT_FINISH_REASON, finish_reason))
    if timing is not None:
        tensors.append(pb.Tensor(P.OUTPUT_TIMING, timing))
    return pb.InferenceResponse(output_tensors=tensors)


def json_response(name: str, document: Any):
    """A response of one TYPE_STRING output holding `document` as JSON (the voices model)."""
    return _pb().InferenceResponse(output_tensors=[_strings(name, json.dumps(document))])


def triton_error(code: str, message: str):
    pb = _pb()
    code_value = getattr(pb.TritonError, code, None)
    return pb.TritonError(message) if code_value is None else pb.TritonError(message, code_value)


def error_response(code: str, message: str, after_audio: bool):
    """A request's error. Before any audio: a TritonError with `code` (a TritonError code name).

    NOTE: once audio went out, the request ends with a data response (FINISH_REASON cancelled|error + ERROR)
    instead: in Triton 2.51 an error response after data responses breaks a BLS response iterator (the
    one-shot relay hung or leaked, and the model could not unload)."""
    if not after_audio:
        return _pb().InferenceResponse(error=triton_error(code, message))
    reason = "cancelled" if code == "CANCELLED" else "error"
    return _pb().InferenceResponse(output_tensors=[_strings(P.OUTPUT_FINISH_REASON, reason),
                                                   _strings(P.OUTPUT_ERROR, message)])


def relay_request(request, target: str, correlation_id: int):
    """The one-shot model's request as a START|END sequence of the sequence model `target` (BLS)."""
    raw = request.parameters()
    params = json.loads(raw) if isinstance(raw, str) and raw else {}
    # BLS parameters take str, int and bool only: floats travel as text (parse_parameters reads them back)
    params = {k: (str(v) if isinstance(v, float) else v) for k, v in params.items() if not k.startswith("triton_")}
    return _pb().InferenceRequest(model_name=target, requested_output_names=list(P.OUTPUTS), inputs=request.inputs(),
                                  correlation_id=correlation_id, flags=FLAG_START | FLAG_END, parameters=params)


def abort_request(target: str, correlation_id: int):
    """Drop a relayed sequence in the sequence model: a START|END request with protocol.PARAM_ABORT."""
    return _pb().InferenceRequest(model_name=target, requested_output_names=list(P.OUTPUTS),
                                  inputs=[_strings(P.INPUT_TEXT, "")], correlation_id=correlation_id,
                                  flags=FLAG_START | FLAG_END, parameters={P.PARAM_ABORT: True})
