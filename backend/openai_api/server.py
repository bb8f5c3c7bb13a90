"""`OpenAIServer`: the speech API served by uvicorn on a background thread (`q3tts serve --openai-port`, tests).

    with OpenAIServer("127.0.0.1:8001", port=0) as api:   # port 0: a free port
        api.url   # http://127.0.0.1:PORT
"""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from q3tts.openai_api.app import create_app
from q3tts.openai_api.bridge import TritonBridge


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class OpenAIServer:
    """The app for the Triton server at `triton_url`, on `host:port` (127.0.0.1 unless told otherwise)."""

    def __init__(self, triton_url: str, port: int = 0, host: str = "127.0.0.1", max_streams: int = 64,
                 log_level: str = "warning"):
        self.host, self.port = host, port or _free_port(host)
        self.bridge = TritonBridge(triton_url, max_streams)
        config = uvicorn.Config(create_app(self.bridge), host=host, port=self.port, log_level=log_level,
                                lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="q3tts-openai", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> OpenAIServer:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the OpenAI endpoint did not start on {self.host}:{self.port}")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.bridge.close()

    def __enter__(self) -> OpenAIServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
