"""The Triton python-backend models (loaded by model_repository/*/1/model.py): `TritonPythonModel`, the
sequence model `qwen3_tts`, `OneShotModel`, `qwen3_tts_oneshot`, a BLS relay for HTTP generate_stream, and
`VoicesModel`, `qwen3_tts_voices`, which registers voices while serving.

Style of vllm_backend: `execute()` validates and enqueues, then returns None; the work happens on the
threads of `EngineLoop` (serving/loop.py). Audio routing and the FINAL rules: serving/session.py and
client/protocol.py.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
import traceback

import triton_python_backend_utils as pb_utils

from q3tts_client import protocol as P
from q3tts.serving import request as R
from q3tts.serving.engine_process import EngineProcess
from q3tts.serving.loop import EngineLoop
from q3tts.serving.metrics import ServingMetrics


def log(level: str, msg: str) -> None:
    """Triton's log, every line prefixed `[q3tts]` (server tests grep it)."""
    getattr(pb_utils.Logger, f"log_{level}")(f"[q3tts] {msg}")


def model_parameters(args: dict) -> dict[str, str]:
    """The `parameters` of the model's config.pbtxt (model_repository/*/config.pbtxt.tmpl)."""
    config = json.loads(args["model_config"])
    return {k: v["string_value"] for k, v in config.get("parameters", {}).items()}


def model_ready(name: str, version: str) -> bool:
    """Whether Triton still serves this model: False once an unload began or the server is exiting."""
    try:
        return bool(pb_utils.is_model_ready(model_name=name, model_version=version))
    except Exception:  # noqa: BLE001 - 'Server not ready' while the server exits
        return False


class TritonPythonModel:
    """The sequence model `qwen3_tts`: one engine per instance (config: model_repository/qwen3_tts)."""

    def initialize(self, args: dict) -> None:
        params = model_parameters(args)
        engine_cfg = json.loads(params.get("engine_config") or "{}")
        if args.get("model_instance_kind") == "GPU":
            engine_cfg["device"] = f"cuda:{args['model_instance_device_id']}"
        schedule = P.parse_chunk_schedule(params.get("chunk_schedule") or "1")
        checkpoint = params["checkpoint"]

        def make_engine():  # in a child process: this stub never initializes CUDA (serving/engine_process.py)
            return EngineProcess(checkpoint, engine_cfg).start()

        voices_dir = params.get("voices_dir")

        def make_voices(engine):
            from q3tts.voices.cache import VoiceFiles

            return VoiceFiles.for_engine(engine, voices_dir, params.get("voice_cache_size"))

        name, version = args["model_name"], args["model_version"]
        instance = args.get("model_instance_name", "0").replace("/", "_")
        # NOTE: Triton is asked whether the model is ready only once a request arrived (Triton routes requests
        # to a READY model only; before that no sequence is open, so there is no unload to notice): with two
        # instances, the first one ready asked while the other still loaded, and Triton 2.51's stub then died
        # now and then with a general protection fault in its shared-memory allocator.
        self.requests_seen = threading.Event()
        self.metrics = ServingMetrics(pb_utils, {"model": name, "version": version, "model_instance": instance})
        self.loop = EngineLoop(make_engine, schedule, float(params.get("idle_s") or 30), self.metrics, log,
                               model_ready=lambda: self.requests_seen.is_set() and model_ready(name, version),
                               make_voices=make_voices if voices_dir else None,
                               server_memory_budget=int(float(params.get("max_server_memory_gib") or 0) * 2 ** 30))
        log("info", f"loading {checkpoint} ({json.dumps(engine_cfg)})")
        self.loop.start()
        log("info", f"ready: instance {instance}, chunk schedule {list(schedule)}")

    def execute(self, requests):
        self.requests_seen.set()
        for request in requests:
            self.loop.submit(request, request.get_response_sender())
        return None

    def finalize(self) -> None:
        log("info", "finalize: stopping engine and response threads")
        self.loop.shutdown()
        self.metrics.finalize()
        log("info", "finalize: done")


class VoicesModel:
    """`qwen3_tts_voices`: add, list and remove registered voices while serving (q3tts.voices.service)."""

    def initialize(self, args: dict) -> None:
        from q3tts.voices.service import VoiceService

        params = model_parameters(args)
        gpu = args.get("model_instance_kind") == "GPU"
        device = f"cuda:{args['model_instance_device_id']}" if gpu else "cpu"
        self.service = VoiceService(params["checkpoint"], params["voices_dir"], device)
        log("info", f"voices: {params['voices_dir']} ({len(self.service.store.names())} registered)")

    def execute(self, requests):
        return [self._answer(request) for request in requests]

    def _answer(self, request):
        from q3tts.voices.service import error_code
        from q3tts.voices.store import VoiceError

        try:
            args = R.parse_voices_request(request)
            document = self.service.handle(**args)
        except R.BadRequest as e:
            return pb_utils.InferenceResponse(error=R.triton_error("INVALID_ARG", str(e)))
        except VoiceError as e:
            return pb_utils.InferenceResponse(error=R.triton_error(error_code(e), str(e)))
        if args["action"] != "list":
            log("info", f"voices: {args['action']} {document['name']}")
        return R.json_response(P.OUTPUT_VOICES, document)


class OneShotModel:
    """`qwen3_tts_oneshot`: each request becomes a START|END sequence of the sequence model (BLS), relayed.

    Loads no weights. `async execute` lets many requests relay at once; the blocking response iterator is
    advanced in the stub's default executor.
    """

    def initialize(self, args: dict) -> None:
        self.target = model_parameters(args).get("sequence_model") or P.MODEL
        # IDs no client picks by accident: high bit set, instance-unique counter
        self._ids = itertools.count((1 << 63) | (int(time.time() * 1000) % (1 << 40)) << 16)

    async def execute(self, requests):
        await asyncio.gather(*(self._relay(r) for r in requests))
        return None

    async def _relay(self, request) -> None:
        sender = request.get_response_sender()
        final_sent = False

        def send_final(response=None) -> None:  # exactly once, whatever fails after it
            nonlocal final_sent
            if not final_sent:
                final_sent = True
                R.send(sender, response, final=True)

        if not model_ready(self.target, ""):  # a fleet loaded this model alone (explicit model control)
            send_final(pb_utils.InferenceResponse(error=R.triton_error(
                "UNAVAILABLE", f"{P.ONESHOT_MODEL} relays each request into the sequence model "
                f"'{self.target}', which is not loaded: load '{self.target}' first")))
            return
        try:
            cid = next(self._ids)
            responses = await R.relay_request(request, self.target, cid).async_exec(decoupled=True)
            error = await self._forward(responses, sender, cid)
            send_final(None if error is None else pb_utils.InferenceResponse(error=error))
            log("info", f"oneshot: relay {cid} done")
        except Exception as e:
            log("error", f"oneshot relay failed: {traceback.format_exc()}")
            send_final(pb_utils.InferenceResponse(error=R.triton_error("INTERNAL", f"oneshot relay: {e}")))

    async def _forward(self, responses, sender, cid: int):
        """Relay the inner stream's data responses; returns its error (or None). A client gone mid-stream
        aborts the inner sequence."""
        loop = asyncio.get_running_loop()
        error, cancelled = None, False
        # NOTE: always drain the inner stream to its end: an undrained BLS response iterator keeps this
        # model from unloading (measured: the server then hits its exit timeout)
        while (resp := await loop.run_in_executor(None, next, responses, None)) is not None:
            if cancelled or error is not None:
                continue
            if resp.has_error():
                error = resp.error()
                continue
            tensors = resp.output_tensors()
            if not tensors:
                continue
            try:
                gone = sender.is_cancelled()
                if not gone:
                    R.send(sender, pb_utils.InferenceResponse(output_tensors=tensors), final=False)
            except Exception as e:  # the client's stream broke mid-send: same as a cancel
                log("warn", f"oneshot: sending to the client failed ({e})")
                gone = True
            if gone:  # client gone: stop the engine work too
                cancelled = True
                await loop.run_in_executor(None, self._abort_inner, cid)
                log("info", f"oneshot: client gone, sequence {cid} aborted")
        return error

    def _abort_inner(self, cid: int) -> None:
        """Drop the relayed sequence in the sequence model (a START|END request with abort=true)."""
        for _ in R.abort_request(self.target, cid).exec(decoupled=True):
            pass
