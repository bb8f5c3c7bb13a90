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

import math
import sys
from dataclasses import dataclass

MODEL = "qwen3_tts"  # sequence model: gRPC streaming
ONESHOT_MODEL = "qwen3_tts_oneshot"  # one request = one utterance: gRPC streaming or HTTP generate_stream

SAMPLE_RATE = 24000
SAMPLES_PER_FRAME = 1920
FRAME_SECONDS = SAMPLES_PER_FRAME / SAMPLE_RATE  # 0.08 s of audio per frame (12.5 Hz)

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
OUTPUT_TIMING = "TIMING"  # float64 [len(TIMING_STAGES)], on the first audio response only: where its time went
# TIMING[0] is the request's arrival in execute() on the server's time.monotonic() (CLOCK_MONOTONIC: one clock
# for every process of a Linux host, so the engine process's stamps and a client's time.perf_counter() on the
# same host read the same clock); every other entry is seconds since that arrival, except the two *_device
# entries, which are durations measured on the device (CUDA events; wall clock on a CPU server).
TIMING_STAGES = (
    "arrival",         # execute() received the START request
    "engine_add",      # the engine thread applied it (Engine.add): execute() -> command queue -> engine thread
    "prompt_ready",    # its prompt was built and it joined the wait queue
    "prefill_start",   # the engine step that prefilled it began (queue wait: from prompt_ready)
    "first_frame",     # that step's decode (talker, code predictor, codec) handed its first frame to the host
    "step_returned",   # the serving loop had that step's outputs (from the engine process)
    "response_built",  # its first audio response was built, on its response thread, just before the send
    "prefill_device",  # seconds: that step's prefill on the device (all the sequences it started)
    "decode_device",   # seconds: that step's batched decode on the device
)
OUTPUTS = {
    OUTPUT_AUDIO: ("TYPE_FP32", [-1], "float32"),
    OUTPUT_AUDIO_INT16: ("TYPE_INT16", [-1], "int16"),
    OUTPUT_SAMPLE_RATE: ("TYPE_INT32", [1], "int32"),
    OUTPUT_FIRST_FRAME: ("TYPE_INT64", [1], "int64"),
    OUTPUT_FINISH_REASON: ("TYPE_STRING", [1], "object"),
    OUTPUT_ERROR: ("TYPE_STRING", [1], "object"),
    OUTPUT_TIMING: ("TYPE_FP64", [-1], "float64"),
}
AUDIO_FORMATS = {"float32": OUTPUT_AUDIO, "int16": OUTPUT_AUDIO_INT16}

# Request parameters (gRPC `parameters=`, perf_analyzer --request-parameter, HTTP generate top-level keys).
# Read on START; ignored on later requests (perf_analyzer repeats them), except `abort`. Their types, ranges
# and defaults: FIELDS below.
PARAM_TEXT_MODE = "text_mode"  # whole | incremental (default: FIELDS)
PARAM_XVECTOR_ONLY = "xvector_only"
PARAM_AUDIO_FORMAT = "audio_format"  # float32 | int16
PARAM_CHUNK_SCHEDULE = "chunk_schedule"  # "1,2,4,8": frames per response, the last entry repeats
PARAM_ABORT = "abort"  # any request: true = drop the sequence now (its open request ends with FINISH_REASON aborted)
PARAM_ACK_PIECES = "ack_pieces"  # true: non-END requests end at once, audio streams on END (perf_analyzer)

# frames: first response = 1 frame (80 ms), the second 1 too (served on the H200, fewer streams ran dry at 64
# streams than with 1,2,4,8,12: perf/results/RESULTS.md), then growing
DEFAULT_CHUNK_SCHEDULE = (1, 1, 2, 4, 8, 12)
# a later response goes out with what is buffered, short of its size, once the audio already sent (played in
# real time from the first response) would run out within this many seconds (serving/chunker.py)
CHUNK_URGENT_S = 0.1
SAMPLING_FIELD_NAMES = ("greedy", "temperature", "top_k", "top_p", "repetition_penalty", "subtalker_greedy",
                        "subtalker_temperature", "subtalker_top_k", "subtalker_top_p", "seed", "max_frames")

REF_SAMPLE_RATES = (8000, 192000)  # Hz, inclusive: reference recordings (REF_AUDIO, voice registration)
MAX_REF_SECONDS = 60  # the longest reference recording (REF_AUDIO of a request, voice registration)
MAX_TEXT_CHARS = 10000  # TEXT of one request (the engine's token limits apply after tokenization)

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


# --- every request input and parameter: the one table the validator enforces and the README shows ----------
VARIANTS = ("custom_voice", "voice_design", "base")  # a checkpoint's tts_model_type
ALL = VARIANTS
VARIANT_NAMES = {"custom_voice": "CustomVoice", "voice_design": "VoiceDesign", "base": "Base",
                 "custom_voice-1b7": "CustomVoice 1.7B"}


@dataclass(frozen=True)
class Field:
    """One request input or parameter. Numbers are checked finite and within [low, high] (`low_open`: low
    excluded); strings against `choices`; `high` of a TEXT/REF_AUDIO input is a size in `unit`. `variants`:
    the checkpoints it means something for ("variant" or "variant-size"), refused on the others. `unused_when`:
    a bool parameter that makes this one unused (then only its type and finiteness are checked)."""

    name: str
    kind: str  # "input" (a tensor) | "parameter" (START) | "control" (any request)
    type: type  # bool | int | float | str (an input: its element type)
    default: str
    meaning: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    choices: tuple[str, ...] = ()
    unit: str = ""
    variants: tuple[str, ...] = ALL
    unused_when: str | None = None

    def bounds(self) -> str:
        """The accepted values, as the errors and the README say them."""
        if self.choices:
            return " | ".join(self.choices)
        if self.type is bool:
            return "true | false"
        if self.low is None and self.high is None:
            return ""
        if self.low is None:
            return f"<= {_num(self.high)} {self.unit}".strip()
        return f"{'(' if self.low_open else '['}{_num(self.low)}, {_num(self.high)}]"

    def check(self, value, used: bool = True) -> None:
        """Raise ValueError naming this field when `value` (already of `type`) is not finite or, when `used`,
        out of its range."""
        if self.type is float and not math.isfinite(value):
            raise ValueError(f"{self.kind} {self.name!r} must be a finite number, got {value!r}")
        if not used:
            return
        if self.choices and value not in self.choices:
            raise ValueError(f"{self.kind} {self.name!r} must be one of {self.bounds()}, got {value!r}")
        if self.type in (int, float) and self.low is not None:
            low_ok = value > self.low if self.low_open else value >= self.low
            if not (low_ok and value <= self.high):
                raise ValueError(f"{self.kind} {self.name!r} must be in {self.bounds()}, got {value!r}")


def _num(x: float) -> str:
    if isinstance(x, int) and x > 1 << 32 and (x + 1) & x == 0:
        return f"2^{x.bit_length()} - 1"
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


_TEMPERATURE, _TOP_K, _TOP_P = (0.01, 100.0), (0, 65536), (0.0, 1.0)
FIELDS = {f.name: f for f in (
    Field(INPUT_TEXT, "input", str, "", "text of this request (every request; may be empty)", high=MAX_TEXT_CHARS,
          unit="characters"),
    Field(INPUT_SPEAKER, "input", str, "", "a built-in speaker", variants=("custom_voice",)),
    Field(INPUT_LANGUAGE, "input", str, "auto", "language of the text (auto = detect)"),
    Field(INPUT_INSTRUCT, "input", str, "", "voice description (VoiceDesign) or style instruction",
          variants=("custom_voice-1b7", "voice_design")),
    Field(INPUT_REF_AUDIO, "input", float, "", "reference recording, mono float32 samples (finite)",
          high=MAX_REF_SECONDS, unit="seconds", variants=("base",)),
    Field(INPUT_REF_SAMPLE_RATE, "input", int, str(SAMPLE_RATE), "sample rate of REF_AUDIO in Hz",
          low=REF_SAMPLE_RATES[0], high=REF_SAMPLE_RATES[1], variants=("base",)),
    Field(INPUT_REF_TEXT, "input", str, "", "transcript of REF_AUDIO (voice cloning in context)", variants=("base",)),
    Field(INPUT_VOICE, "input", str, "", "a registered voice (replaces SPEAKER, INSTRUCT and the REF_ inputs)",
          variants=("base",)),
    Field("greedy", "parameter", bool, "checkpoint", "argmax instead of sampling (talker and code predictor)"),
    Field("temperature", "parameter", float, "checkpoint (0.9)", "talker softmax temperature", *_TEMPERATURE,
          low_open=False, unused_when="greedy"),
    Field("top_k", "parameter", int, "checkpoint (50)", "talker top-k (0 = off)", *_TOP_K),
    Field("top_p", "parameter", float, "checkpoint (1.0)", "talker nucleus mass", *_TOP_P, low_open=True),
    Field("repetition_penalty", "parameter", float, "checkpoint (1.05)", "talker repetition penalty",
          0.01, 100.0),
    Field("subtalker_greedy", "parameter", bool, "= greedy", "argmax in the code predictor"),
    Field("subtalker_temperature", "parameter", float, "checkpoint (0.9)", "code predictor temperature",
          *_TEMPERATURE, unused_when="subtalker_greedy"),
    Field("subtalker_top_k", "parameter", int, "checkpoint (50)", "code predictor top-k (0 = off)", *_TOP_K),
    Field("subtalker_top_p", "parameter", float, "checkpoint (1.0)", "code predictor nucleus mass", *_TOP_P,
          low_open=True),
    Field("seed", "parameter", int, "0", "selects the sequence's random stream (same seed, same audio)",
          0, 2 ** 63 - 1),
    Field("max_frames", "parameter", int, "follows the text",
          "frames (80 ms each) at most; default: the engine's cap by text length (frames_per_text_token, "
          "min_text_frames)", 1, 8191),
    Field(PARAM_TEXT_MODE, "parameter", str, "incremental if START lacks END, else variant's",
          "how text is fed: all at once (audio waits for END), or as it arrives",
          choices=("whole", "incremental")),
    Field(PARAM_XVECTOR_ONLY, "parameter", bool, "false", "clone from the x-vector alone (no REF_TEXT)",
          variants=("base",)),
    Field(PARAM_AUDIO_FORMAT, "parameter", str, "float32", "AUDIO (float32) or AUDIO_INT16 (int16)",
          choices=tuple(AUDIO_FORMATS)),
    Field(PARAM_CHUNK_SCHEDULE, "parameter", str, ",".join(map(str, DEFAULT_CHUNK_SCHEDULE)),
          f"frames per response, the last entry repeats (each 1..1000); fewer once the audio sent runs out in "
          f"{CHUNK_URGENT_S:g} s"),
    Field(PARAM_ABORT, "control", bool, "false", "drop the sequence now"),
    Field(PARAM_ACK_PIECES, "control", bool, "false", "non-END requests end at once, audio streams on END"),
)}
SAMPLING_PARAMS = {name: f.type for name, f in FIELDS.items()
                   if f.kind == "parameter" and name in SAMPLING_FIELD_NAMES}
PARAMS = {name: f.type for name, f in FIELDS.items() if f.kind != "input"}
SESSION_PARAMS = {name: kind for name, kind in PARAMS.items() if name not in SAMPLING_PARAMS}


def check_variant(variant: str, size: str, names) -> None:
    """Raise ValueError naming the first of `names` (inputs and parameters of a START request) that means
    nothing for a `variant`-`size` checkpoint."""
    for name in names:
        f = FIELDS.get(name)
        if f is not None and variant not in f.variants and f"{variant}-{size}" not in f.variants:
            where = ", ".join(VARIANT_NAMES[v] for v in f.variants)
            raise ValueError(f"{f.kind} {name!r} is for {where} checkpoints; this one is "
                             f"{VARIANT_NAMES.get(variant, variant)} {size}")


def markdown_table() -> str:
    """FIELDS as the README's table (`python -m q3tts_client.protocol --markdown`)."""
    rows = ["| name | kind | type | accepted | default | checkpoints | meaning |", "|---|---|---|---|---|---|---|"]
    for f in FIELDS.values():
        where = "all" if f.variants == ALL else ", ".join(VARIANT_NAMES[v] for v in f.variants)
        accepted = f.bounds().replace("|", "\\|")
        if f.unused_when:
            accepted += f" (unused when {f.unused_when})"
        rows.append(f"| `{f.name}` | {f.kind} | {f.type.__name__} | {accepted} | {f.default} | {where} | {f.meaning} |")
    return "\n".join(rows)


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
    """Convert a request parameter to its declared type and check it (FIELDS; a parameter that another one
    can make unused, e.g. temperature by greedy, only for finiteness here: SamplingParams.validate checks the
    rest); raises ValueError naming it."""
    kind = PARAMS.get(name)
    if kind is None:
        raise ValueError(f"unknown request parameter {name!r}; known: {', '.join(sorted(PARAMS))}")
    value = _coerce(name, kind, value)
    FIELDS[name].check(value, used=FIELDS[name].unused_when is None)
    return value


def _coerce(name: str, kind: type, value):
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


if __name__ == "__main__":  # python -m q3tts_client.protocol --markdown: the README's table of FIELDS
    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m q3tts_client.protocol --markdown")
    print(markdown_table())
