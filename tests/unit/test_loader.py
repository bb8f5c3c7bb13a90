"""Checkpoint loader: layout, dtypes, sharding, and the named errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from q3tts.checkpoint.loader import (
    CheckpointFileMissing,
    CheckpointShapeError,
    HubUnavailableError,
    UnknownVariantError,
    load_checkpoint,
)
from q3tts.checkpoint.maker import make_checkpoint
from q3tts.models.tts_model import Qwen3TTS


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ck") / "cv", "custom_voice", "0.6b", "tiny", 3)


@pytest.fixture
def copy_dir(ckpt_dir, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(ckpt_dir, dst)
    return dst


def test_loads_in_fp32_and_bf16(ckpt_dir):
    ck = load_checkpoint(ckpt_dir, dtype=torch.bfloat16)
    assert ck.config.variant == "custom_voice" and ck.config.size == "0b6"
    assert all(t.dtype == torch.bfloat16 for t in ck.weights.values())
    assert ck.generation["max_new_tokens"] == 8192
    assert ck.tokenizer.encode("hello") and ck.codec_weights
    model = Qwen3TTS.from_checkpoint(load_checkpoint(ckpt_dir))
    assert set(model.state_dict()) == set(ck.weights)


def test_sharded_equals_single(ckpt_dir, tmp_path):
    sharded = make_checkpoint(tmp_path / "sh", "custom_voice", "0.6b", "tiny", 3,
                              max_shard_bytes=2 * 2**20)
    assert not (sharded / "model.safetensors").exists()
    assert len(json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]) > 1
    single, multi = load_checkpoint(ckpt_dir).weights, load_checkpoint(sharded).weights
    assert single.keys() == multi.keys()
    assert all(torch.equal(single[k], multi[k]) for k in single)


def test_missing_file(copy_dir):
    (copy_dir / "merges.txt").unlink()
    with pytest.raises(CheckpointFileMissing, match="merges.txt"):
        load_checkpoint(copy_dir)


def test_missing_weights(copy_dir):
    (copy_dir / "model.safetensors").unlink()
    with pytest.raises(CheckpointFileMissing, match="model.safetensors"):
        load_checkpoint(copy_dir)


def test_wrong_shape(copy_dir):
    weights = load_file(copy_dir / "model.safetensors")
    weights["talker.codec_head.weight"] = weights["talker.codec_head.weight"][:, :-1].contiguous()
    save_file(weights, copy_dir / "model.safetensors")
    with pytest.raises(CheckpointShapeError, match="talker.codec_head.weight"):
        load_checkpoint(copy_dir)


def test_unknown_variant(copy_dir):
    cfg = json.loads((copy_dir / "config.json").read_text())
    cfg["tts_model_type"] = "singing"
    (copy_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnknownVariantError, match="singing"):
        load_checkpoint(copy_dir)


def test_offline_hub_id(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    import huggingface_hub.constants as hub_constants  # noqa: PLC0415

    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(HubUnavailableError, match="offline"):
        load_checkpoint("Qwen/Qwen3-TTS-12Hz-0.6B-Base")


def test_not_a_folder(tmp_path):
    with pytest.raises(CheckpointFileMissing):
        load_checkpoint(tmp_path / "nope")
