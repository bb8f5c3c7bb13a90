"""The OpenAI endpoint against a real tritonserver (tiny Base checkpoint, CPU, one per module) with one
registered voice, `alice`; the endpoint runs in-process on a free 127.0.0.1 port."""

from __future__ import annotations

import pytest

from q3tts.openai_api.server import OpenAIServer
from q3tts_client.voices import VoicesClient
from voice_fixtures import REF_SR, REF_TEXT, base_checkpoint, reference_wav, served  # tests/ is on sys.path


@pytest.fixture(scope="session")
def base_ckpt(tmp_path_factory):
    return base_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def server(request, base_ckpt, tmp_path_factory):
    yield from served(request, base_ckpt, tmp_path_factory)


@pytest.fixture(scope="module")
def alice(server) -> str:
    with VoicesClient(server.grpc_url) as voices:
        return voices.add("alice", reference_wav(), REF_SR, REF_TEXT)["name"]


@pytest.fixture(scope="module")
def api(server, alice):
    with OpenAIServer(server.grpc_url) as endpoint:
        yield endpoint
