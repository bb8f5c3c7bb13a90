"""End-to-end `q3tts synth` on tiny random checkpoints (fp32, CPU, greedy): waveforms equal the
official qwen-tts 0.1.1 wrapper's for CustomVoice / VoiceDesign / Base voice cloning from a wav,
`--stream` equals the full decode, `--requests` through the engine equals single synth, and the
engine's ref_audio path equals precomputed ref_codes / x-vector."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from q3tts.codec.audio import read_wav
from q3tts.core import InvalidRequest, SamplingParams, VoiceSpec

FRAMES = 24
TEXT = "Hello world, this is a test of the speech system."
REF_TEXT = "Hi there, my old friend."
LSB = 1 / 32768  # one step of the 16-bit wav

# name -> (checkpoint, synth flags, official wrapper method, its kwargs (ref_audio added for Base))
CASES = {
    "custom_voice": ("cv", ["--speaker", "ryan", "--language", "english"], "generate_custom_voice",
                     dict(speaker="ryan", language="english")),
    "voice_design": ("vd", ["--language", "english", "--instruct", "A calm, low female voice."],
                     "generate_voice_design",
                     dict(instruct="A calm, low female voice.", language="english")),
    "base_icl": ("base", ["--language", "english", "--ref-text", REF_TEXT], "generate_voice_clone",
                 dict(language="english", ref_text=REF_TEXT)),
}


def _synth_args(name, ckpt_dirs, ref_wav, out_dir: Path, *extra):
    ckpt, flags, _, _ = CASES[name]
    args = ["synth", "--model", ckpt_dirs[ckpt], "--text", TEXT, *flags, "--greedy",
            "--max-frames", FRAMES, *extra]
    if ckpt == "base":
        args += ["--ref-audio", ref_wav]
    return args


def _full_run(name, synth, ckpt_dirs, ref_wav, session_cache, tmp_path_factory):
    """The non-stream run of a case (`--out` + `--codes-out`), once per session."""
    key = ("full", name)
    if key not in session_cache:
        out = tmp_path_factory.mktemp(f"full_{name}")
        run = synth(*_synth_args(name, ckpt_dirs, ref_wav, out, "--out", out / "a.wav",
                                 "--codes-out", out / "a.npy"))
        assert run.rc == 0, run.stderr
        session_cache[key] = (run, out / "a.wav", np.load(out / "a.npy"))
    return session_cache[key]


@pytest.mark.oracle
@pytest.mark.parametrize("name", list(CASES))
def test_synth_wav_matches_reference(name, synth, ckpt_dirs, ref_wav, session_cache,
                                     tmp_path_factory):
    import oracle

    run, wav_path, codes = _full_run(name, synth, ckpt_dirs, ref_wav, session_cache,
                                     tmp_path_factory)
    ckpt, _, method, kwargs = CASES[name]
    if ckpt == "base":
        kwargs = dict(kwargs, ref_audio=str(ref_wav))  # the reference reads the same file
    wrapper = oracle.load_reference(str(ckpt_dirs[ckpt]))
    with torch.no_grad():
        wavs, sr = getattr(wrapper, method)(TEXT, do_sample=False, subtalker_dosample=False,
                                            max_new_tokens=FRAMES + 1, **kwargs)
    ref = np.asarray(wavs[0], dtype=np.float32)
    assert sr == 24000 and codes.shape == (FRAMES, 16)
    pcm = run.pcm[str(wav_path)]
    assert pcm.shape == ref.shape == (FRAMES * 1920,)
    assert np.abs(pcm - ref).max() <= 1e-4
    assert np.abs(ref).max() > 1e-3  # not a silent (degenerate) comparison
    from_file, file_sr = sf.read(str(wav_path), dtype="float32")
    assert file_sr == 24000 and np.abs(from_file - pcm).max() <= LSB


@pytest.mark.oracle
def test_reference_encoding_matches_reference(ckpt_dirs, ref_wav):
    """encode_reference (codec encoder + speaker encoder) equals create_voice_clone_prompt."""
    import oracle
    from q3tts.checkpoint.loader import load_checkpoint
    from q3tts.codec import CodecEncoder
    from q3tts.models.tts_model import Qwen3TTS
    from q3tts.codec.voice import encode_reference

    ckpt = load_checkpoint(ckpt_dirs["base"])
    model = Qwen3TTS.from_checkpoint(ckpt)
    encoder = CodecEncoder.from_weights(ckpt.codec_config, ckpt.codec_weights)
    codes, xvector = encode_reference(model, encoder, *read_wav(ref_wav))
    item = oracle.load_reference(str(ckpt_dirs["base"])).create_voice_clone_prompt(
        ref_audio=str(ref_wav), ref_text=REF_TEXT)[0]
    assert codes.dtype == np.int64 and codes.shape == (8, 16)
    assert np.array_equal(codes, item.ref_code.cpu().numpy())
    assert xvector.dtype == np.float32
    assert np.abs(xvector - item.ref_spk_embedding.float().cpu().numpy()).max() <= 1e-5


@pytest.mark.parametrize("name", ["custom_voice", "base_icl"])
def test_stream_equals_full_decode(name, synth, ckpt_dirs, ref_wav, session_cache, tmp_path,
                                   tmp_path_factory):
    full, full_wav, full_codes = _full_run(name, synth, ckpt_dirs, ref_wav, session_cache,
                                           tmp_path_factory)
    run = synth(*_synth_args(name, ckpt_dirs, ref_wav, tmp_path, "--stream", "--out",
                             tmp_path / "s.wav", "--codes-out", tmp_path / "s.npy"))
    assert run.rc == 0, run.stderr
    assert np.array_equal(np.load(tmp_path / "s.npy"), full_codes)
    pcm, ref = run.pcm[str(tmp_path / "s.wav")], full.pcm[str(full_wav)]
    assert pcm.shape == ref.shape == (FRAMES * 1920,)
    assert np.abs(pcm - ref).max() <= 1e-5
    lines = run.stdout.splitlines()
    assert sum(line.startswith("frame ") and " ms" in line for line in lines) == FRAMES
    assert "first audio at" in lines[[line.startswith("frame ") for line in lines].index(True)]
    assert any("time to first audio" in line and "ms/frame" in line for line in lines)


def test_requests_equal_single_synth(synth, ckpt_dirs, ref_wav, tmp_path):
    """3 Base requests through one engine (one joins at step 3; the engine encodes ref_audio itself)
    give each request the codes of a single `synth` of the same request."""
    requests = [
        dict(id="icl", text=TEXT, language="english", ref_audio=str(ref_wav), ref_text=REF_TEXT,
             greedy=True, max_frames=FRAMES, codes_out="icl.npy", out="icl.wav"),
        dict(id="late", text="The quick brown fox jumps.", ref_audio=str(ref_wav),
             xvector_only=True, greedy=True, max_frames=FRAMES - 6, start_step=3,
             codes_out="late.npy"),
        dict(id="whole", text="Good morning to you all.", language="english",
             ref_audio=str(ref_wav), ref_text=REF_TEXT, text_mode="whole", greedy=True,
             max_frames=FRAMES - 4, codes_out="whole.npy"),
    ]
    jsonl = tmp_path / "reqs.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in requests))
    run = synth("synth", "--model", ckpt_dirs["base"], "--requests", jsonl, "--device", "cpu",
                "--max-slots", 4, "--num-pages", 64, "--no-cuda-graphs")
    assert run.rc == 0, run.stdout + run.stderr
    for r in requests:
        flags = ["--text", r["text"], "--ref-audio", r["ref_audio"], "--greedy",
                 "--max-frames", r["max_frames"], "--codes-out", tmp_path / f"single_{r['id']}.npy"]
        for key in ("language", "ref_text", "text_mode"):
            if key in r:
                flags += [f"--{key.replace('_', '-')}", r[key]]
        flags += ["--xvector-only"] if r.get("xvector_only") else []
        single = synth("synth", "--model", ckpt_dirs["base"], *flags)
        assert single.rc == 0, single.stderr
        want = np.load(tmp_path / f"single_{r['id']}.npy")
        got = np.load(tmp_path / r["codes_out"])
        assert want.shape == (r["max_frames"], 16), r["id"]
        assert np.array_equal(got, want), r["id"]
    # ICL audio streamed by the engine continues the reference codes, like the official decode of
    # ref_codes ++ generated (cut after the reference): compare with single synth's --out audio.
    single = synth("synth", "--model", ckpt_dirs["base"], "--text", TEXT, "--language", "english",
                   "--ref-audio", ref_wav, "--ref-text", REF_TEXT, "--greedy", "--max-frames", FRAMES,
                   "--out", tmp_path / "single_icl.wav")
    assert single.rc == 0, single.stderr
    got = sf.read(str(tmp_path / "icl.wav"), dtype="float32")[0]  # batch writes float wavs: exact
    want = single.pcm[str(tmp_path / "single_icl.wav")]
    assert got.shape == want.shape == (FRAMES * 1920,)
    assert np.abs(got - want).max() <= 1e-5


def test_engine_ref_audio_equals_precomputed(ckpt_dirs, ref_wav):
    from q3tts.codec import CodecEncoder
    from q3tts.codec.voice import encode_reference
    from q3tts.engine.batch import BatchRequest, run_requests
    from q3tts.engine.config import EngineConfig
    from q3tts.engine.engine import Engine

    cfg = EngineConfig(device="cpu", dtype="float32", num_pages=32, max_slots=2, max_frames=32,
                       use_cuda_graphs=False)
    engine = Engine(str(ckpt_dirs["base"]), cfg, with_codec=False)
    wav, sr = read_wav(ref_wav)
    params = SamplingParams(greedy=True, max_frames=12)
    from_audio = run_requests(engine, [BatchRequest("a", TEXT, VoiceSpec(
        ref_audio=wav, ref_sample_rate=sr, ref_text=REF_TEXT), params)], write=False)["a"]
    encoder = CodecEncoder.from_weights(engine.checkpoint.codec_config, engine.checkpoint.codec_weights)
    codes, xvector = encode_reference(engine.model, encoder, wav, sr)
    precomputed = run_requests(engine, [BatchRequest("b", TEXT, VoiceSpec(
        ref_codes=codes, xvector=xvector, ref_text=REF_TEXT), params)], write=False)["b"]
    assert from_audio.reason == precomputed.reason == "max_frames"
    assert np.array_equal(from_audio.codes, precomputed.codes)
    with pytest.raises(InvalidRequest, match="empty"):
        engine.add("c", VoiceSpec(ref_audio=np.zeros(0, np.float32), ref_text=REF_TEXT))


@pytest.mark.parametrize("argv, message", [
    ([], "give --text"),
    (["--text", "hi"], "at least one output"),
    (["--text", "hi", "--requests", "r.jsonl"], "cannot be combined with --requests"),
    (["--requests", "r.jsonl", "--out", "a.wav"], "cannot be combined with --requests"),
    (["--requests", "missing.jsonl"], "no such file"),
])
def test_usage_errors(argv, message, synth, tmp_path):
    run = synth("synth", "--model", tmp_path, *argv)
    assert run.rc == 2 and message in run.stderr


def test_ref_audio_errors(synth, ckpt_dirs, ref_wav, tmp_path):
    run = synth("synth", "--model", ckpt_dirs["cv"], "--text", "hi", "--speaker", "ryan",
                "--ref-audio", ref_wav, "--out", tmp_path / "a.wav")
    assert run.rc == 2 and "Base" in run.stderr
    run = synth("synth", "--model", ckpt_dirs["base"], "--text", "hi", "--ref-audio",
                tmp_path / "nope.wav", "--out", tmp_path / "a.wav")
    assert run.rc == 2 and "no such file" in run.stderr
    run = synth("synth", "--model", ckpt_dirs["base"], "--text", "hi", "--ref-audio", ref_wav,
                "--out", tmp_path / "a.wav")  # ICL without a transcript
    assert run.rc == 2 and "ref_text" in run.stderr


def test_console_script_smoke(ckpt_dirs, tmp_path):
    script = Path(sys.executable).with_name("q3tts")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "q3tts.cli"]
    out = tmp_path / "smoke.wav"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd + ["synth", "--model", str(ckpt_dirs["cv"]), "--text", TEXT,
                                 "--speaker", "ryan", "--greedy", "--max-frames", "2", "--out",
                                 str(out), "--device", "cpu"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    pcm, sr = sf.read(str(out), dtype="float32")
    assert sr == 24000 and pcm.shape == (2 * 1920,)
