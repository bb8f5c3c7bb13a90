"""`q3tts-client` (the console script) against the real tritonserver: raw PCM on stdout with a string
correlation ID, every sampling flag reaching the server under its protocol name, one error line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from q3tts_client import protocol as P
from q3tts_client.stream_client import synthesize

pytestmark = [pytest.mark.server, pytest.mark.timeout(600)]

CLIENT = Path(sys.executable).parent / "q3tts-client"
VOICE = {"speaker": "ryan", "language": "english"}
TEXT = "Hello there, this is the client test."
# none equal to the tiny checkpoint's generation_config.json defaults
SAMPLING = {"temperature": 0.7, "top_k": 40, "top_p": 0.95, "repetition_penalty": 1.2,
            "subtalker_temperature": 0.6, "subtalker_top_k": 30, "subtalker_top_p": 0.9, "seed": 7,
            "max_frames": 10}


def _client(server, *args: str) -> subprocess.CompletedProcess:
    argv = [CLIENT, "--url", server.grpc_url, "--text", TEXT, "--speaker", VOICE["speaker"],
            "--language", VOICE["language"], *args]
    return subprocess.run([str(a) for a in argv], capture_output=True, timeout=300)


def test_raw_pcm_on_stdout_is_the_streamed_audio(server):
    proc = _client(server, "--greedy", "--max-frames", "12", "--audio-format", "int16",
                   "--sequence-id", "client-cli-1", "--out", "-")
    assert proc.returncode == 0, proc.stderr.decode()
    pcm = np.frombuffer(proc.stdout, dtype="<i2")
    ref = synthesize(server.grpc_url, [TEXT], VOICE, {"greedy": True, "max_frames": 12, "audio_format": "int16"})
    assert ref.error is None, ref.error
    assert 0 < pcm.size <= 12 * P.SAMPLES_PER_FRAME and pcm.size % P.SAMPLES_PER_FRAME == 0
    assert np.array_equal(pcm, ref.audio)
    assert "sequence client-cli-1" in proc.stderr.decode()  # the string correlation ID was used


def test_every_sampling_flag_reaches_the_server(server, tmp_path):
    flags = [x for name, value in SAMPLING.items() for x in (f"--{name.replace('_', '-')}", str(value))]
    proc = _client(server, *flags, "--no-greedy", "--no-subtalker-greedy", "--sequence-id", "424242",
                   "--out", tmp_path / "sampled.wav")
    assert proc.returncode == 0, proc.stderr.decode()
    audio, sr = sf.read(tmp_path / "sampled.wav", dtype="float32")
    ref = synthesize(server.grpc_url, [TEXT], VOICE, {**SAMPLING, "greedy": False, "subtalker_greedy": False})
    assert ref.error is None, ref.error
    assert sr == P.SAMPLE_RATE and audio.size > 0 and np.array_equal(audio, ref.audio)
    defaults = synthesize(server.grpc_url, [TEXT], VOICE, {"seed": 7, "max_frames": 10})
    assert defaults.error is None and not np.array_equal(defaults.audio, audio)  # the flags took effect


def test_server_error_is_one_line_and_exit_status_1(server):
    proc = _client(server, "--top-p", "7.0", "--max-frames", "4", "--quiet")
    assert proc.returncode == 1 and proc.stdout == b""
    err = proc.stderr.decode().strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "top_p" in err[0]
