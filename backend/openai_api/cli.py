"""`q3tts openai`: the OpenAI speech endpoint in front of a running Triton server (any deployment).

    q3tts openai --triton-url 10.0.0.5:8001 --port 8000 [--host 0.0.0.0]
    curl -s localhost:8000/v1/audio/speech -d '{"model":"qwen3-tts","input":"Hello.","voice":"ryan",
         "response_format":"wav"}' -H 'content-type: application/json' -o hello.wav
"""

from __future__ import annotations

import argparse

import uvicorn

from q3tts.openai_api.app import create_app
from q3tts.openai_api.bridge import TritonBridge


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--triton-url", default="127.0.0.1:8001", help="gRPC host:port of the Triton server")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--host", default="127.0.0.1", help="listen address (127.0.0.1: this machine only)")
    p.add_argument("--max-streams", type=int, default=64, help="speech requests served at once (more: 429)")
    p.add_argument("--log-level", default="info")
    p.add_argument("--access-log", action="store_true",
                   help="log every request (off by default: the line is written before each response's headers)")


def run(args: argparse.Namespace) -> int:
    bridge = TritonBridge(args.triton_url, args.max_streams)
    try:
        uvicorn.run(create_app(bridge), host=args.host, port=args.port, log_level=args.log_level,
                    access_log=args.access_log)
    finally:
        bridge.close()
    return 0
