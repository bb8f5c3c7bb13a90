"""`q3tts render-repository` without a server: instance groups per --gpus, the execution env forms it
accepts, and one clear error (exit status 2) naming a bad flag."""

from __future__ import annotations

import json
import re

import pytest

from q3tts_client import protocol as P
from q3tts.cli import main


def render(tmp_path, *flags: str) -> dict[str, str]:
    out = tmp_path / "repo"
    assert main(["render-repository", str(out), "--model", "/models/ckpt", *flags]) == 0
    return {m: (out / m / "config.pbtxt").read_text() for m in (P.MODEL, P.ONESHOT_MODEL, P.VOICES_MODEL)}


def groups(config: str) -> str:
    return re.search(r"^instance_group \[ (.*) \]$", config, re.M).group(1)


def test_gpus_each_lets_the_server_place_one_instance_per_gpu(tmp_path):
    configs = render(tmp_path)
    assert groups(configs[P.MODEL]) == "{ count: 1, kind: KIND_GPU }"
    assert groups(configs[P.VOICES_MODEL]) == "{ count: 1, kind: KIND_GPU, gpus: [ 0 ] }"
    assert "max_candidate_sequences: 64 " in configs[P.MODEL] and '\\"dtype\\": \\"bfloat16\\"' in configs[P.MODEL]
    assert all('key: "EXECUTION_ENV_PATH"' not in c for c in configs.values())  # the server's own python3


def test_listed_gpus_and_cpu(tmp_path):
    assert groups(render(tmp_path, "--gpus", "2,3")[P.MODEL]) == "{ count: 1, kind: KIND_GPU, gpus: [ 2, 3 ] }"
    cpu = render(tmp_path, "--gpus", "none", "--max-slots", "5")
    assert groups(cpu[P.MODEL]) == "{ count: 1, kind: KIND_CPU }" and "max_candidate_sequences: 5 " in cpu[P.MODEL]


def test_cpu_instances_render_one_group_of_that_count_for_the_sequence_model_only(tmp_path):
    configs = render(tmp_path, "--gpus", "none", "--instances", "3")
    assert groups(configs[P.MODEL]) == "{ count: 3, kind: KIND_CPU }"
    assert groups(configs[P.VOICES_MODEL]) == groups(configs[P.ONESHOT_MODEL]) == "{ count: 1, kind: KIND_CPU }"


@pytest.mark.parametrize("kind", ["archive", "model_dir"])
def test_packed_env_archives_are_accepted(tmp_path, kind):
    archive = tmp_path / "q3tts-env.tar.gz"
    archive.write_bytes(b"")
    env = str(archive) if kind == "archive" else "$$TRITON_MODEL_DIRECTORY/q3tts-env.tar.gz"
    for config in render(tmp_path, "--execution-env", env).values():
        assert f'{{ key: "EXECUTION_ENV_PATH" value: {{ string_value: "{env}" }} }}' in config


@pytest.mark.parametrize("flags, needle", [
    (["--execution-env", "/"], "a folder must be a venv"),
    (["--execution-env", "/no/such/env.zip"], "neither a venv folder nor a packed env archive"),
    (["--gpus", "first"], "--gpus must be each, none or GPU indices"),
    (["--chunk-schedule", "0"], "chunk_schedule entries must be in 1..1000"),
    (["--pool", "max_slots=9"], "set the engine slots with --max-slots"),
    (["--instances", "2"], "--instances 2 is for CPU serving (--gpus none)"),
    (["--gpus", "none", "--instances", "0"], "--instances must be >= 1"),
    (["--max-server-memory-gib", "-1"], "--max-server-memory-gib must be >= 0"),
    (["--max-server-memory-gib", "nan"], "--max-server-memory-gib must be >= 0"),
])
def test_bad_flags_get_one_clear_error(tmp_path, capsys, flags, needle):
    assert main(["render-repository", str(tmp_path / "repo"), "--model", "ckpt", *flags]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and not (tmp_path / "repo").exists()


def engine_config(config: str) -> dict:
    raw = re.search(r'key: "engine_config" value: \{ string_value: (".*") \}', config).group(1)
    return json.loads(json.loads(raw))


def test_gpu_engines_keep_their_kernel_tuning_in_the_user_cache_unless_told_otherwise(tmp_path, monkeypatch):
    monkeypatch.delenv("Q3TTS_TUNE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert engine_config(render(tmp_path)[P.MODEL])["tune_cache"] == str(tmp_path / "cache" / "q3tts" / "tuning.pkl")
    monkeypatch.setenv("Q3TTS_TUNE_CACHE", "/srv/tuning.pkl")
    assert engine_config(render(tmp_path)[P.MODEL])["tune_cache"] == "/srv/tuning.pkl"
    assert engine_config(render(tmp_path, "--pool", "tune_cache=null")[P.MODEL])["tune_cache"] is None
    assert "tune_cache" not in engine_config(render(tmp_path, "--gpus", "none")[P.MODEL])  # CPU: nothing to tune


def test_the_server_memory_budget_reaches_the_sequence_model(tmp_path):
    out = tmp_path / "repo"
    assert main(["render-repository", str(out), "--model", "ckpt", "--gpus", "none",
                 "--max-server-memory-gib", "2.5"]) == 0
    config = (out / "qwen3_tts" / "config.pbtxt").read_text()
    assert 'key: "max_server_memory_gib" value: { string_value: "2.5" }' in config
    assert main(["render-repository", str(out), "--model", "ckpt", "--gpus", "none"]) == 0  # the default
    config = (out / "qwen3_tts" / "config.pbtxt").read_text()
    assert 'key: "max_server_memory_gib" value: { string_value: "16.0" }' in config
