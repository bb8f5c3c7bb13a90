"""The registered voices of a running server, through its `qwen3_tts_voices` model (gRPC, no torch).

    with VoicesClient("127.0.0.1:8001") as voices:
        voices.add("alice", wav, 16000, "Hello, I am Alice.")  # the server encodes the reference and stores it
        voices.catalogue()  # {"variant", "size", "xvector_dim", "speakers": [...], "voices": [...]}
        voices.remove("alice")

A registered voice is then used by name: `synthesize(url, text, {"voice": "alice"})`.
"""

from __future__ import annotations

import json

import numpy as np
from tritonclient.utils import InferenceServerException

from q3tts_client import protocol as P
from q3tts_client.stream_client import Tls, _bytes_input, connect, voice_inputs


class VoicesError(RuntimeError):
    """The server refused a voices request: `code` is its status (StatusCode.NOT_FOUND, ...)."""

    def __init__(self, code: str | None, message: str):
        super().__init__(message)
        self.code = code


class VoicesClient:
    """add / remove / catalogue on one server; a context manager that closes its connection."""

    def __init__(self, url: str, tls: Tls | None = None, client=None):
        self.own = client is None
        self.client = client or connect(url, tls)

    def _call(self, action: str, xvector_only: bool = False, **voice) -> dict:
        inputs = [_bytes_input(P.INPUT_ACTION, action), *voice_inputs(**voice)]
        try:
            result = self.client.infer(P.VOICES_MODEL, inputs, parameters={P.PARAM_XVECTOR_ONLY: xvector_only})
        except InferenceServerException as e:
            raise VoicesError(e.status(), e.message()) from None
        return json.loads(result.as_numpy(P.OUTPUT_VOICES).reshape(-1)[0])

    def add(self, name: str, wav: np.ndarray, sample_rate: int, ref_text: str | None = None,
            xvector_only: bool = False) -> dict:
        """Register `name` from a mono recording (its transcript for an ICL voice); returns the voice's info."""
        return self._call("add", xvector_only, voice=name, ref_audio=np.asarray(wav, np.float32),
                          ref_sample_rate=int(sample_rate), ref_text=ref_text)

    def remove(self, name: str) -> dict:
        return self._call("rm", voice=name)

    def catalogue(self) -> dict:
        """The server's variant, CustomVoice speakers and registered voices."""
        return self._call("list")

    def close(self) -> None:
        if self.own:
            self.client.close()

    def __enter__(self) -> VoicesClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
