"""`q3tts-client` without a server: flags (one per protocol parameter), correlation IDs, TLS options,
outputs (raw PCM bytes, WAV, playback), the progress line and the error paths."""

from __future__ import annotations

import io
import socket
import struct
import sys

import numpy as np
import pytest
import soundfile as sf

from q3tts_client import cli
from q3tts_client import protocol as P
from q3tts_client.audio_out import PlaybackUnavailable, RawPcm, Speakers, write_wav
from q3tts_client.stream_client import Result, Tls


def _usage_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_every_sampling_parameter_has_a_typed_flag():
    values = {bool: ("", True), int: ("7", 7), float: ("0.25", 0.25)}
    argv, want = [], {}
    for name, kind in P.SAMPLING_PARAMS.items():
        text, value = values[kind]
        argv += [f"--{name.replace('_', '-')}"] + ([text] if text else [])
        want[name] = value
    got = cli.request_params(cli.parse_args(argv))
    assert got == want and all(type(got[k]) is type(v) for k, v in want.items())


def test_unset_flags_leave_every_parameter_to_the_server():
    assert cli.request_params(cli.parse_args([])) == {}


def test_booleans_can_be_sent_false_and_session_flags_use_protocol_names():
    args = cli.parse_args(["--no-greedy", "--no-subtalker-greedy", "--text-mode", "incremental",
                           "--audio-format", "int16", "--chunk-schedule", "1,2,4", "--xvector-only"])
    assert cli.request_params(args) == {
        "greedy": False, "subtalker_greedy": False, P.PARAM_TEXT_MODE: "incremental",
        P.PARAM_AUDIO_FORMAT: "int16", P.PARAM_CHUNK_SCHEDULE: "1,2,4", P.PARAM_XVECTOR_ONLY: True}


@pytest.mark.parametrize("argv, named", [
    (["--top-k", "many"], "--top-k"),
    (["--temperature", "hot"], "--temperature"),
    (["--chunk-schedule", "1,0"], "--chunk-schedule"),
    (["--audio-format", "mp3"], "--audio-format"),
    (["--sequence-id", "0"], "--sequence-id"),
    (["--sequence-id", str(2 ** 64)], "--sequence-id"),
    (["--sequence-id", " "], "--sequence-id"),
    (["--root-certificates", "/no/such/ca.pem"], "/no/such/ca.pem"),
    (["--concurrency", "0"], "--concurrency"),
])
def test_bad_flags_are_usage_errors_naming_the_flag(capsys, argv, named):
    assert named in _usage_error(capsys, argv)


def test_correlation_ids_integer_or_string():
    assert cli.parse_args(["--sequence-id", "42"]).sequence_id == 42
    assert cli.parse_args(["--sequence-id", "call-42"]).sequence_id == "call-42"
    assert cli.parse_args(["--sequence-id", str(2 ** 64 - 1)]).sequence_id == 2 ** 64 - 1
    assert cli.parse_args([]).sequence_id is None
    assert cli.stream_ids(40, 3) == [40, 41, 42]
    assert cli.stream_ids("call", 3) == ["call-0", "call-1", "call-2"]
    assert cli.stream_ids("call", 1) == ["call"] and cli.stream_ids(None, 2) == [None, None]


def test_tls_options(tmp_path, capsys):
    pem = {name: tmp_path / f"{name}.pem" for name in ("ca", "key", "chain")}
    for path in pem.values():
        path.write_text("-----BEGIN CERTIFICATE-----\n")
    assert cli.tls_options(cli.parse_args([])) is None
    assert cli.tls_options(cli.parse_args(["--ssl"])) == Tls()
    assert cli.tls_options(cli.parse_args(["--root-certificates", str(pem["ca"])])) == Tls(str(pem["ca"]))
    mutual = ["--ssl", "--private-key", str(pem["key"]), "--certificate-chain", str(pem["chain"])]
    assert cli.tls_options(cli.parse_args(mutual)) == Tls(None, str(pem["key"]), str(pem["chain"]))
    assert "--certificate-chain" in _usage_error(capsys, ["--private-key", str(pem["key"])])


def test_output_defaults_and_conflicts(capsys):
    assert cli.parse_args([]).out == "out.wav"
    assert cli.parse_args(["--play"]).out is None
    assert cli.parse_args(["--play", "--out", "-"]).out == "-"
    assert cli.parse_args(["--concurrency", "4"]).out is None
    assert "--concurrency" in _usage_error(capsys, ["--concurrency", "4", "--out", "-"])
    assert "--concurrency" in _usage_error(capsys, ["--concurrency", "4", "--play"])


def test_raw_pcm_is_little_endian_samples_in_arrival_order():
    out = io.BytesIO()
    sink = RawPcm(out)
    sink(np.array([1, -2, 32767], np.int16), P.SAMPLE_RATE)
    sink(np.array([-32768], np.int16), P.SAMPLE_RATE)
    assert out.getvalue() == struct.pack("<4h", 1, -2, 32767, -32768)
    out = io.BytesIO()
    RawPcm(out)(np.array([0.5, -1.0], np.float32), P.SAMPLE_RATE)
    assert out.getvalue() == struct.pack("<2f", 0.5, -1.0)


@pytest.mark.parametrize("dtype, subtype", [(np.int16, "PCM_16"), (np.float32, "FLOAT")])
def test_wav_keeps_the_samples(tmp_path, dtype, subtype):
    audio = (np.arange(-8, 8) * 1000).astype(dtype) if dtype == np.int16 else np.linspace(-1, 1, 16, dtype=dtype)
    write_wav(str(tmp_path / "a.wav"), audio, P.SAMPLE_RATE)
    back, sr = sf.read(tmp_path / "a.wav", dtype=np.dtype(dtype).name)
    assert sr == P.SAMPLE_RATE and sf.info(tmp_path / "a.wav").subtype == subtype
    assert np.array_equal(back, audio)


def test_play_without_sounddevice_is_one_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "sounddevice", None)  # import sounddevice -> ImportError
    with pytest.raises(PlaybackUnavailable, match="sounddevice"):
        Speakers()
    assert cli.main(["--text", "Hello.", "--play", "--url", "127.0.0.1:1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --play needs the sounddevice package")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_line_on_a_terminal_only():
    res = Result(7, np.zeros(0, np.float32), ttfa_s=0.0123, chunks=2)
    term, log = _Terminal(), io.StringIO()
    for stream in (term, log):
        progress = cli.Progress(stream)
        progress(res, 3 * P.SAMPLES_PER_FRAME)
        progress.end()
    assert term.getvalue() == "\r2 chunks,   0.24 s audio, TTFA 12 ms\n"
    assert log.getvalue() == ""


def test_unreachable_server_is_one_error_line(capsys):
    with socket.socket() as s:  # a free port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert cli.main(["--url", f"127.0.0.1:{port}", "--text", "Hello.", "--quiet", "--timeout-s", "20"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "UNAVAILABLE" in err[0].upper()
