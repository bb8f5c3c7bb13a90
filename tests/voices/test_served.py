"""Registered voices on a real tritonserver (tiny Base checkpoint, CPU): the VOICE input, registration,
listing and removal through the qwen3_tts_voices model while sequences run, refusals, the voice files the
next server start reads, and the voice cache in the metrics."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import soundfile as sf

from q3tts.engine.config import EngineConfig
from q3tts.voices.store import Family, Voice, VoiceStore
from q3tts_client.cli import main as client_main
from q3tts_client.metrics import scrape
from q3tts_client.stream_client import synthesize
from q3tts_client.voices import VoicesClient, VoicesError
from voice_fixtures import REF_SR, REF_TEXT, reference_wav, served

pytestmark = [pytest.mark.server, pytest.mark.timeout(600)]

TEXT = "A registered voice speaks on the server."
GREEDY = {"greedy": True, "seed": 0, "max_frames": 12}


@pytest.fixture(scope="module")
def server(request, base_ckpt, tmp_path_factory):
    yield from served(request, base_ckpt, tmp_path_factory)


@pytest.fixture(scope="module")
def voices(server):
    with VoicesClient(server.grpc_url) as client:
        yield client


@pytest.fixture(scope="module")
def alice(voices, ref_wav) -> dict:
    return voices.add("Alice", ref_wav, REF_SR, REF_TEXT)


def speak(server, voice: dict, params=GREEDY):
    r = synthesize(server.grpc_url, [TEXT], voice, params)
    assert r.error is None, r.error
    assert r.audio.size > 0
    return r.audio


def test_voice_input_equals_its_reference_audio_and_persists(server, alice, ref_wav):
    info = alice
    assert (info["name"], info["frames"], info["ref_text"]) == ("alice", 8, REF_TEXT)
    by_name = speak(server, {"voice": "alice"})
    by_audio = speak(server, {"ref_audio": ref_wav, "ref_sample_rate": REF_SR, "ref_text": REF_TEXT})
    np.testing.assert_array_equal(by_name, by_audio)
    assert VoiceStore(server.voices_dir).read("alice").sha256 == info["sha256"]  # what a restart reads


def test_client_cli_voice_flag(server, alice, tmp_path):
    out = tmp_path / "alice.wav"
    assert client_main(["--url", server.grpc_url, "--text", TEXT, "--voice", "alice", "--greedy", "--seed", "0",
                        "--max-frames", "12", "--out", str(out)]) == 0
    np.testing.assert_array_equal(sf.read(str(out), dtype="float32")[0], speak(server, {"voice": "alice"}))


def test_list_and_remove_while_serving(server, voices, ref_wav):
    voices.add("bert", ref_wav, REF_SR, xvector_only=True)
    catalogue = voices.catalogue()
    assert (catalogue["variant"], catalogue["speakers"]) == ("base", [])
    listed = {v["name"]: v for v in catalogue["voices"]}
    assert listed["bert"]["xvector_only"] and listed["bert"]["frames"] == 0
    speak(server, {"voice": "bert"})
    voices.remove("bert")
    assert "bert" not in {v["name"] for v in voices.catalogue()["voices"]}
    r = synthesize(server.grpc_url, [TEXT], {"voice": "bert"}, GREEDY)
    assert "voice 'bert' is not registered" in r.error


def test_sequences_run_while_another_voice_is_added(server, voices, ref_wav):
    voices.add("cleo", ref_wav, REF_SR, REF_TEXT)
    params = {**GREEDY, "max_frames": 24}
    alone = speak(server, {"voice": "cleo"}, params)
    results, spans = [None] * 4, [None] * 4

    def one(i):
        t0 = time.monotonic()
        results[i] = synthesize(server.grpc_url, [TEXT], {"voice": "cleo"}, params)
        spans[i] = (t0, time.monotonic())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    t_add = time.monotonic()
    voices.add("dina", reference_wav(seed=11), REF_SR, "Another reference, another speaker.")
    t_added = time.monotonic()
    for t in threads:
        t.join(timeout=300)
    assert min(s[0] for s in spans) < t_added and t_add < max(s[1] for s in spans)  # they overlapped
    for r in results:
        assert r.error is None, r.error
        # NOTE: the same codes; the codec decodes them in a batch here, alone before: float rounding only
        np.testing.assert_allclose(r.audio, alone, rtol=0, atol=1e-5)
    other = speak(server, {"voice": "dina"}, params)
    assert other.size != alone.size or np.abs(other - alone).max() > 1e-2


@pytest.mark.parametrize("voice, inputs, match", [
    ("nobody", {}, "voice 'nobody' is not registered"),
    ("../etc", {}, "is not allowed"),
    ("alice", {"speaker": "ryan"}, "'SPEAKER' is for CustomVoice checkpoints"),
    ("alice", {"ref_text": "x"}, "cannot be combined with REF_TEXT"),
])
def test_bad_voice_inputs_are_refused(server, alice, voice, inputs, match):
    r = synthesize(server.grpc_url, [TEXT], {"voice": voice, **inputs}, GREEDY)
    assert r.error is not None and match in r.error and r.audio.size == 0


def test_voice_of_another_family_is_refused(server):
    other = Voice("eli", Family("base", "1b7", 64), np.ones(64, np.float32), None, None)
    VoiceStore(server.voices_dir).add(other)  # e.g. registered offline with a 1.7B checkpoint
    r = synthesize(server.grpc_url, [TEXT], {"voice": "eli"}, GREEDY)
    assert "'eli' was made for base-1b7" in r.error


@pytest.mark.parametrize("call, code, match", [
    (lambda v, wav: v.add("alice", wav, REF_SR, REF_TEXT), "ALREADY_EXISTS", "already registered"),
    (lambda v, wav: v.remove("nobody"), "NOT_FOUND", "not registered"),
    (lambda v, wav: v.add("fay", wav[:0], REF_SR, REF_TEXT), "INVALID_ARG", "REF_AUDIO"),
    (lambda v, wav: v.add("fay", np.where(wav > 0.3, np.nan, wav), REF_SR, REF_TEXT), "INVALID_ARG", "REF_AUDIO"),
    (lambda v, wav: v.add("fay", wav, 4000, REF_TEXT), "INVALID_ARG", "REF_SAMPLE_RATE"),
    (lambda v, wav: v.add("fay", np.zeros(61 * 8000, np.float32), 8000, REF_TEXT), "INVALID_ARG", "60 s"),
    (lambda v, wav: v.add("fay", wav, REF_SR), "INVALID_ARG", "transcript"),
    (lambda v, wav: v.add("a/b", wav, REF_SR, REF_TEXT), "INVALID_ARG", "not allowed"),
])
def test_registration_refusals(server, voices, alice, ref_wav, call, code, match):
    before = sorted(p.name for p in server.voices_dir.iterdir())
    with pytest.raises(VoicesError, match=match) as err:
        call(voices, ref_wav)
    assert err.value.code == f"StatusCode.{code}".replace("INVALID_ARG", "INVALID_ARGUMENT")
    assert sorted(p.name for p in server.voices_dir.iterdir()) == before  # nothing half-written


def test_voice_cache_in_the_metrics(server, alice):
    before = scrape(server.metrics_url)
    for _ in range(3):  # the first may prepare the voice on the device (a miss), the others are hits
        speak(server, {"voice": "alice"})
    deadline = time.monotonic() + 10
    while (m := scrape(server.metrics_url))["q3tts_voice_cache_hits_total"] < before.get(
            "q3tts_voice_cache_hits_total", 0) + 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert m["q3tts_voice_cache_hits_total"] >= before.get("q3tts_voice_cache_hits_total", 0) + 2
    assert m["q3tts_voice_cache_entries"] >= 1
    assert 0 < m["q3tts_voice_cache_bytes"] <= m["q3tts_voice_cache_capacity_bytes"] == EngineConfig().voice_cache_bytes
