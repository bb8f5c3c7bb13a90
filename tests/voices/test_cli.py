"""`q3tts voice add|list|rm` offline: the console script's exit codes, output and the files it leaves."""

from __future__ import annotations

import json

import numpy as np
import pytest
import soundfile as sf

from q3tts.checkpoint.maker import make_checkpoint
from q3tts.cli import main

from voice_fixtures import REF_SR, REF_TEXT


@pytest.fixture
def ref_path(tmp_path, ref_wav):
    path = tmp_path / "ref.wav"
    sf.write(str(path), np.stack([ref_wav, ref_wav], axis=1), REF_SR, subtype="PCM_16")  # stereo file
    return path


def voice(*argv) -> int:
    return main(["voice", *map(str, argv)])


def test_add_list_rm(base_ckpt, ref_path, tmp_path, capsys):
    d = tmp_path / "voices"
    assert voice("add", "Kim", "--model", base_ckpt, "--ref-audio", ref_path, "--ref-text", REF_TEXT,
                 "--voices-dir", d) == 0
    assert "registered voice 'kim'" in capsys.readouterr().out
    assert voice("add", "lee", "--model", base_ckpt, "--ref-audio", ref_path, "--xvector-only",
                 "--voices-dir", d) == 0
    capsys.readouterr()
    assert voice("list", "--json", "--voices-dir", d) == 0
    listed = {v["name"]: v for v in json.loads(capsys.readouterr().out)}
    assert sorted(listed) == ["kim", "lee"]
    assert listed["kim"]["ref_text"] == REF_TEXT and listed["kim"]["frames"] == 8
    assert listed["lee"]["xvector_only"] and listed["lee"]["family"]["variant"] == "base"
    assert voice("rm", "kim", "--voices-dir", d) == 0
    assert sorted(p.name for p in d.glob("*.safetensors")) == ["lee.safetensors"]


@pytest.mark.parametrize("argv, match", [
    (["--ref-text", REF_TEXT], "--model"),
    (["--model", "{ckpt}"], "--ref-audio"),
    (["--model", "{ckpt}", "--ref-audio", "{ref}"], "transcript"),
    (["--model", "{ckpt}", "--ref-audio", "{missing}", "--ref-text", "x"], "no such file"),
    (["--model", "{ckpt}", "--design", "a calm voice"], "--design-model"),
])
def test_add_usage_errors(base_ckpt, ref_path, tmp_path, capsys, argv, match):
    fill = {"ckpt": base_ckpt, "ref": ref_path, "missing": tmp_path / "nope.wav"}
    argv = [a.format(**fill) for a in argv]
    assert voice("add", "max", "--voices-dir", tmp_path / "voices", *argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("q3tts voice: ") and match in err and err.count("\n") == 1
    assert not (tmp_path / "voices").exists() or not list((tmp_path / "voices").glob("*.safetensors"))


def test_rm_unknown(tmp_path, capsys):
    assert voice("rm", "nobody", "--voices-dir", tmp_path) == 1
    assert "'nobody' is not registered" in capsys.readouterr().err


def test_design_voice(base_ckpt, tmp_path, capsys):
    design = make_checkpoint(tmp_path / "vd", "voice_design", "1.7b", "tiny", 43)
    d = tmp_path / "voices"
    assert voice("add", "narrator", "--model", base_ckpt, "--design", "a calm, deep voice",
                 "--design-model", design, "--script", "It was a quiet evening.", "--max-frames", 12,
                 "--voices-dir", d) == 0
    capsys.readouterr()
    assert voice("list", "--json", "--voices-dir", d) == 0
    (info,) = json.loads(capsys.readouterr().out)
    assert (info["source"], info["prompt"], info["ref_text"]) == ("design", "a calm, deep voice",
                                                                  "It was a quiet evening.")
    assert 0 < info["frames"] <= 12
