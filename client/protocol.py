"""The one definition of the wire protocol: tensor names, dtypes, parameter names, model names.

Imported by the Triton model (`q3tts.serving`), the client, the tests and `perf/`. No torch, no tritonclient.

One sequence (correlation ID) = one utterance session:

| request | flags | carries |
|---|---|---|
| first | START (+END if it is the only one) | voice inputs (or VOICE), sampling parameters, first TEXT piece |
| middle | - | TEXT piece appended to the session's text |
| last | END | last TEXT piece (may be empty) |

Which response stream carries which audio: audio always streams on the sender of the session's most
recent request. When request k+1 arrives, request k gets its FINAL (an empty response) before any audio
goes to k+1, so one gRPC stream sees the sequence's audio in order. The sequence's last response carries
FINISH_REASON with the FINAL flag; every other request ends with an empty FINAL (clients set
`enable_empty_final_response=True`). Every request gets exactly one FINAL, or one error response.
Clients that wait for each request to complete before sending the next (perf_analyzer) set `ack_pieces`:
then every non-END request is answered at once and all the audio streams on the END request.
Each audio response carries SAMPLE_RATE and FIRST_FRAME (index of its first 80 ms frame).
Errors: a request that has not streamed audio yet fails with a TritonError naming the problem (bad input,
unknown speaker, admission, idle, ...). A request that has streamed audio ends instead with a final data
response FINISH_REASON=error|cancelled + ERROR=<text>: Triton 2.51 BLS response iterators (the one-shot
model) break on an error response that follows data responses.
"""

from __future__ import annotations

MODEL = "qwen3_tts"  # sequence model: gRPC streaming
ONESHOT_MODEL = "qwen3_tts_oneshot"  # one request = one utterance: gRPC streaming or HTTP generate_stream

SAMPLE_RATE = 24000
SAMPLES_PER_FRAME = 1920

# name -> (Triton data type, dims, numpy dtype name); optional inputs are voice fields read on START only
INPUT_TEXT = "TEXT"
INPUT_SPEAKER = "SPEAKER"
INPUT_LANGUAGE = "LANGUAGE"
INPUT_INSTRUCT = "INSTRUCT"
INPUT_REF_AUDIO = "REF_AUDIO"
INPUT_REF_SAMPLE_RATE = "REF_SAMPLE_RATE"
INPUT_REF_TEXT = "REF_TEXT"
INPUT_VOICE = "VOICE"  # a registered voice (`q3tts voice add`, VOICES_MODEL): no reference audio travels
INPUTS = {
    INPUT_TEXT: ("TYPE_STRING", [1], "object"),
    INPUT_SPEAKER: ("TYPE_STRING", [1], "object"),
    INPUT_LANGUAGE: ("TYPE_STRING", [1], "object"),
    INPUT_INSTRUCT: ("TYPE_STRING", [1], "object"),
    INPUT_REF_AUDIO: ("TYPE_FP32", [-1], "float32"),
    INPUT_REF_SAMPLE_RATE: ("TYPE_INT32", [1], "int32"),
    INPUT_REF_TEXT: ("TYPE_STRING", [1], "object"),
    INPUT_VOICE: ("TYPE_STRING", [1], "object"),
}
OPTIONAL_INPUTS = tuple(name for name in INPUTS if name != INPUT_TEXT)

OUTPUT_AUDIO = "AUDIO"  # float32 PCM in [-1, 1] (audio_format=float32, the default)
OUTPUT_AUDIO_INT16 = "AUDIO_INT16"  # int16 PCM (audio_format=int16)
OUTPUT_SAMPLE_RATE = "SAMPLE_RATE"
OUTPUT_FIRST_FRAME = "FIRST_FRAME"
OUTPUT_FINISH_REASON = "FINISH_REASON"  # the sequence's last response: eos|max_frames|aborted|error|cancelled
OUTPUT_ERROR = "ERROR"  # with FINISH_REASON error|cancelled: what went wrong after audio had started
OUTPUTS = {
    OUTPUT_AUDIO: ("TYPE_FP32", [-1], "float32"),
    OUTPUT_AUDIO_INT16: ("TYPE_INT16", [-1], "int16"),
    OUTPUT_SAMPLE_RATE: ("TYPE_INT32", [1], "int32"),
    OUTPUT_FIRST_FRAME: ("TYPE_INT64", [1], "int64"),
    OUTPUT_FINISH_REASON: ("TYPE_STRING", [1], "object"),
    OUTPUT_ERROR: ("TYPE_STRING", [1], "object"),
}
AUDIO_FORMATS = {"float32": OUTPUT_AUDIO, "int16": OUTPUT_AUDIO_INT16}

# Request parameters (gRPC `parameters=`, perf_analyzer --request-parameter, HTTP generate top-level keys).
# Read on START; ignored on later requests (perf_analyzer repeats them), except `abort`. name -> python type
PARAM_TEXT_MODE = "text_mode"  # whole | incremental (default: the variant's reference default)
PARAM_XVECTOR_ONLY = "xvector_only"
PARAM_AUDIO_FORMAT = "audio_format"  # float32 | int16
PARAM_CHUNK_SCHEDULE = "chunk_schedule"  # "1,2,4,8": frames per response, the last entry repeats
PARAM_ABORT = "abort"  # any request: true = drop the sequence now (its open request ends with FINISH_REASON aborted)
PARAM_ACK_PIECES = "ack_pieces"  # true: non-END requests end at once, audio streams on END (perf_analyzer)
SAMPLING_PARAMS = {
    "greedy": bool,
    "temperature": float,
    "top_k": int,
    "top_p": float,
    "repetition_penalty": float,
    "subtalker_greedy": bool,
    "subtalker_temperature": float,
    "subtalker_top_k": int,
    "subtalker_top_p": float,
    "seed": int,
    "max_frames": int,
}
SESSION_PARAMS = {
    PARAM_TEXT_MODE: str,
    PARAM_XVECTOR_ONLY: bool,
    PARAM_AUDIO_FORMAT: str,
    PARAM_CHUNK_SCHEDULE: str,
    PARAM_ABORT: bool,
    PARAM_ACK_PIECES: bool,
}
PARAMS = {**SAMPLING_PARAMS, **SESSION_PARAMS}

DEFAULT_CHUNK_SCHEDULE = (1, 2, 4, 8, 12)  # frames: first response = 1 frame (80 ms), then growing

REF_SAMPLE_RATES = (8000, 192000)  # Hz, inclusive: reference recordings (REF_AUDIO, voice registration)
MAX_REF_SECONDS = 60  # the longest recording a voice is registered from

# The voices model: one request = one action (not decoupled, no sequence). Registers, lists and removes the
# voices the sequence model's VOICE input names, while serving. Errors: INVALID_ARG, NOT_FOUND (unknown
# voice), ALREADY_EXISTS (the name is taken), INTERNAL (the voices directory could not be written).
VOICES_MODEL = "qwen3_tts_voices"
INPUT_ACTION = "ACTION"  # add (VOICE, REF_AUDIO, REF_SAMPLE_RATE, REF_TEXT | xvector_only) | list | rm (VOICE)
VOICE_ACTIONS = ("add", "list", "rm")
VOICES_INPUTS = {INPUT_ACTION: ("TYPE_STRING", [1], "object"),
                 **{name: INPUTS[name] for name in (INPUT_VOICE, INPUT_REF_AUDIO, INPUT_REF_SAMPLE_RATE,
                                                    INPUT_REF_TEXT)}}
VOICES_OPTIONAL_INPUTS = tuple(name for name in VOICES_INPUTS if name != INPUT_ACTION)
OUTPUT_VOICES = "VOICES"  # JSON: add / rm -> the voice; list -> {"variant", "speakers", "voices"}
VOICES_OUTPUTS = {OUTPUT_VOICES: ("TYPE_STRING", [1], "object")}


def parse_chunk_schedule(text: str) -> tuple[int, ...]:
    """'1,2,4' -> (1, 2, 4); raises ValueError naming the problem."""
    try:
        frames = tuple(int(x) for x in str(text).replace(" ", "").split(",") if x)
    except ValueError:
        raise ValueError(f"chunk_schedule must be comma-separated frame counts, got {text!r}") from None
    if not frames or any(f < 1 or f > 1000 for f in frames):
        raise ValueError(f"chunk_schedule entries must be in 1..1000, got {text!r}")
    return frames


def coerce_param(name: str, value):
    """Convert a request parameter to its declared type; raises ValueError naming it."""
    kind = PARAMS.get(name)
    if kind is None:
        raise ValueError(f"unknown request parameter {name!r}; known: {', '.join(sorted(PARAMS))}")
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, (int, float)) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        raise ValueError(f"parameter {name!r} must be a bool, got {value!r}")
    if kind is int:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError(f"parameter {name!r} must be an integer, got {value!r}")
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ValueError(f"parameter {name!r} must be an integer, got {value!r}") from None
    if kind is float:
        if isinstance(value, bool):
            raise ValueError(f"parameter {name!r} must be a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"parameter {name!r} must be a number, got {value!r}") from None
    return str(value)
