"""The OpenAI-compatible speech API in front of the Triton sequence model (FastAPI).

    POST /v1/audio/speech   {model, input, voice, instructions?, response_format?, speed?, stream_format?}
    GET  /v1/audio/voices   the registered voices and the checkpoint's CustomVoice speakers
    GET  /health            200 when the sequence model is ready, else 503

`voice` is a CustomVoice speaker or a registered voice (`q3tts voice add`), as a string or `{"id": ...}`; on a
VoiceDesign checkpoint `instructions` is the voice description and `voice` is not used. Extra body fields may
set the server's sampling parameters (client/protocol.py SAMPLING_PARAMS: greedy, seed, temperature, ...) and
`language`. The status and headers wait for the first audio, so every refusal before it is an ordinary
HTTP error in OpenAI's shape ({"error": {"message", "type", "param", "code"}}): 400 bad input, 404 unknown
voice, 413 a body over MAX_BODY_BYTES (refused as it arrives), 429 too many requests (this endpoint's limit
or the engine's wait queue), 503 the server cannot serve. A failure after audio has started ends the body
early (SSE: an `error` event). The Server-Timing header splits the time to the first byte into the
sequence's own time to first audio and the endpoint's.

The speech route is a plain ASGI handler in front of the FastAPI app (which serves the other routes): its
time to first byte is what the endpoint adds to every request, and FastAPI's per-request machinery (body
parsing through the dependency system, the middleware stack, a task group set up before the first send)
costs more than the rest of the handler together. The body is validated by pydantic in one pass.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from q3tts.openai_api import audio
from q3tts.openai_api.bridge import Refusal, SpeechStream, TritonBridge
from q3tts_client import protocol as P

SPEECH_PATH = "/v1/audio/speech"
MAX_INPUT_CHARS = 4096  # OpenAI's limit for `input`
ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
               413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}
# far above any valid body (input <= 4096 characters, instructions <= protocol.MAX_TEXT_CHARS, each at most 12
# bytes a character as JSON escapes), far below what would strain the process that serves the endpoint
MAX_BODY_BYTES = 1 << 20
EXTRA_FIELDS = (*P.SAMPLING_PARAMS, "language")


class SpeechRequest(BaseModel):
    """The body of POST /v1/audio/speech (unknown fields are checked against EXTRA_FIELDS)."""

    model_config = ConfigDict(extra="allow")
    model: str
    input: str
    voice: str | dict[str, str]
    instructions: str | None = None
    response_format: str = "mp3"
    speed: float = 1.0
    stream_format: str = "audio"


def error_body(status: int, message: str, param: str | None = None) -> JSONResponse:
    code = {404: "voice_not_found", 429: "rate_limit_exceeded"}.get(status)
    return JSONResponse({"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"),
                                   "param": param, "code": code}}, status_code=status)


async def _body(scope: Scope, receive: Receive) -> bytes:
    """The request body as it arrives, refused (413) once past MAX_BODY_BYTES; a declared Content-Length past it
    is refused before any of it is read."""
    declared = dict(scope["headers"]).get(b"content-length", b"")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise Refusal(413, f"the request body holds {int(declared)} bytes; at most {MAX_BODY_BYTES}")
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > MAX_BODY_BYTES:
            raise Refusal(413, f"the request body is over {MAX_BODY_BYTES} bytes")
        if not message.get("more_body", False):
            return b"".join(chunks)


def _parse(body: bytes) -> SpeechRequest:
    """The request body as a SpeechRequest (Refusal 400 naming the first field at fault)."""
    try:
        return SpeechRequest.model_validate_json(body)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err.get("loc", ())) or None
        raise Refusal(400, f"{field or 'body'}: {err.get('msg')}", field) from None


def _check(req: SpeechRequest, formats: tuple[str, ...]) -> dict[str, Any]:
    """Refusal (400) for a request this server cannot serve as asked; returns the sampling extras."""
    if not req.input.strip():
        raise Refusal(400, "input is empty", "input")
    if len(req.input) > MAX_INPUT_CHARS:
        raise Refusal(400, f"input is {len(req.input)} characters; the limit is {MAX_INPUT_CHARS}", "input")
    if req.response_format not in formats:
        raise Refusal(400, f"response_format {req.response_format!r} is not supported here; use one of "
                      f"{', '.join(formats)}", "response_format")
    if req.speed != 1.0:
        raise Refusal(400, f"speed {req.speed:g} is not supported: Qwen3-TTS speaks at its own pace (use 1.0)",
                      "speed")
    if req.stream_format not in ("audio", "sse"):
        raise Refusal(400, f"stream_format must be 'audio' or 'sse', got {req.stream_format!r}", "stream_format")
    extras = dict(req.model_extra or {})
    unknown = sorted(set(extras) - set(EXTRA_FIELDS))
    if unknown:
        raise Refusal(400, f"unknown field(s) {', '.join(unknown)}; extra fields may be {', '.join(EXTRA_FIELDS)}",
                      unknown[0])
    params = {}
    for name, value in extras.items():
        if name != "language":
            try:
                params[name] = P.coerce_param(name, value)
            except ValueError as e:
                raise Refusal(400, str(e), name) from None
    return params


async def _voice(bridge: TritonBridge, req: SpeechRequest) -> dict[str, Any]:
    """The START request's voice inputs for `req` (Refusal 404 for a voice the server does not know)."""
    name = req.voice.get("id", "") if isinstance(req.voice, dict) else req.voice
    voice = {"language": (req.model_extra or {}).get("language"), "instruct": req.instructions}
    catalogue = await bridge.catalogue()
    if catalogue["variant"] == "voice_design":
        return voice
    for attempt in range(2):  # a miss re-reads the catalogue: the voice may have been registered just now
        if name.lower() in (s.lower() for s in catalogue["speakers"]):
            return {**voice, "speaker": name}
        if name.lower() in (v["name"] for v in catalogue["voices"]):
            return {**voice, "voice": name}
        if attempt == 0:
            catalogue = await bridge.catalogue(refresh=True)
    known = catalogue["speakers"] + [v["name"] for v in catalogue["voices"]]
    raise Refusal(404, f"voice {name!r} is not a speaker or registered voice of this server; known: "
                  f"{', '.join(known) or 'none (register one with q3tts voice add)'}", "voice")


async def _audio_body(stream: SpeechStream, first, fmt: str):
    """The response body: streamed formats chunk by chunk, FLAC / MP3 once complete."""
    try:
        if fmt in audio.STREAMED:
            yield (audio.wav_header() if fmt == "wav" else b"") + audio.pcm_bytes(first)
            async for chunk in stream:
                yield audio.pcm_bytes(chunk)
        else:
            import numpy as np

            chunks = [first] + [chunk async for chunk in stream]
            yield audio.encode_file(fmt, np.concatenate(chunks))
    finally:
        stream.close()


def _event(doc: dict) -> bytes:
    return f"data: {json.dumps(doc)}\n\n".encode()


async def _sse_body(stream: SpeechStream, first, fmt: str):
    """Server-sent events: `speech.audio.delta` (base64 of the format's bytes), then `speech.audio.done`
    (usage.output_tokens = the 80 ms frames spoken; the endpoint does not tokenize the input: 0)."""
    try:
        async for piece in _audio_body(stream, first, fmt):
            yield _event({"type": "speech.audio.delta", "audio": base64.b64encode(piece).decode()})
        frames = stream.frames
        yield _event({"type": "speech.audio.done",
                      "usage": {"input_tokens": 0, "output_tokens": frames, "total_tokens": frames}})
    except Refusal as e:
        yield _event({"type": "error", "error": {"message": str(e), "type": ERROR_TYPES.get(e.status)}})


def _server_timing(stream: SpeechStream, handler_s: float) -> str:
    """`first-audio`: the sequence's own time to first audio (its gRPC stream opened -> first audio, what a
    gRPC client measures); `endpoint`: the rest of the handler's time to the first byte (ms)."""
    first = stream.first_audio_s or 0.0
    return f"first-audio;dur={1000 * first:.3f}, endpoint;dur={1000 * (handler_s - first):.3f}"


class FirstChunkFirst(StreamingResponse):
    """A StreamingResponse that sends its status, headers and first chunk before it sets up the task that
    watches for the client going away (Starlette's task group costs a loop turn before the first send)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": await anext(self.body_iterator), "more_body": True})
        await super().__call__(scope, receive, send)

    async def stream_response(self, send: Send) -> None:
        """The chunks after the first, then the end of the body."""
        async for chunk in self.body_iterator:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def speech_endpoint(bridge: TritonBridge, formats: tuple[str, ...]) -> ASGIApp:
    """POST /v1/audio/speech as an ASGI app: the response once the first audio is in (refusals before it)."""

    async def speech(scope: Scope, receive: Receive, send: Send) -> None:
        t0 = time.perf_counter()
        try:
            if scope["method"] != "POST":
                raise Refusal(405, f"{SPEECH_PATH} takes POST, not {scope['method']}")
            req = _parse(await _body(scope, receive))
            params = _check(req, formats)
            voice = await _voice(bridge, req)
            stream, first = await bridge.speak(req.input, voice, params)
        except Refusal as e:
            return await error_body(e.status, str(e), e.param)(scope, receive, send)
        headers = {"Server-Timing": _server_timing(stream, time.perf_counter() - t0)}
        if req.stream_format == "sse":
            response = FirstChunkFirst(_sse_body(stream, first, req.response_format),
                                       media_type="text/event-stream", headers=headers)
        else:
            response = FirstChunkFirst(_audio_body(stream, first, req.response_format),
                                       media_type=audio.MEDIA_TYPES[req.response_format], headers=headers)
        await response(scope, receive, send)

    return speech


def create_app(bridge: TritonBridge) -> ASGIApp:
    """The ASGI app serving `bridge`'s Triton server: the speech route, and FastAPI for the others."""
    app = FastAPI(title="Qwen3-TTS OpenAI-compatible speech API")
    speech = speech_endpoint(bridge, audio.available_formats())

    @app.exception_handler(Refusal)
    async def refused(_request: Request, e: Refusal) -> JSONResponse:
        return error_body(e.status, str(e), e.param)

    @app.get("/v1/audio/voices")
    async def voices():
        catalogue = await bridge.catalogue(refresh=True)
        data = [{"id": s, "name": s, "object": "audio.voice", "type": "speaker", "created_at": 0}
                for s in catalogue["speakers"]]
        data += [{"id": v["name"], "name": v["name"], "object": "audio.voice",
                  "type": "prompt" if v.get("source") == "design" else "audio_sample",
                  "created_at": v.get("created", 0), "prompt": v.get("prompt")} for v in catalogue["voices"]]
        return {"object": "list", "data": data, "variant": catalogue["variant"], "size": catalogue["size"]}

    @app.get("/health")
    async def health():
        ready = await asyncio.get_running_loop().run_in_executor(bridge.executor, bridge.ready)
        return JSONResponse({"status": "ok" if ready else "unavailable", "triton": bridge.url},
                            status_code=200 if ready else 503)

    async def dispatch(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == SPEECH_PATH:
            await speech(scope, receive, send)
        else:
            await app(scope, receive, send)

    return dispatch
