"""`load_checkpoint(path_or_hub_id, dtype, device) -> Checkpoint`: a released Qwen3-TTS 12 Hz folder.

Reads config.json, generation_config.json, the tokenizer files, model.safetensors (single file or
shards listed in model.safetensors.index.json) and speech_tokenizer/{config.json,model.safetensors}.
Main weights are checked against the shapes our modules expect. Every failure is a `CheckpointError`
subclass whose message names the file or tensor at fault.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from q3tts.checkpoint.tokenizer import TextTokenizer
from q3tts.config import VARIANTS, CodecConfig, ModelConfig

MAIN_WEIGHTS = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"
REQUIRED_FILES = ("config.json", "generation_config.json", "vocab.json", "merges.txt",
                  "tokenizer_config.json", "speech_tokenizer/config.json",
                  "speech_tokenizer/model.safetensors")


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded; the message says which file or tensor and why."""


class CheckpointFileMissing(CheckpointError, FileNotFoundError):
    """A required file is absent."""


class CheckpointShapeError(CheckpointError):
    """Tensors are missing, unexpected, or have a shape the config does not imply."""


class UnknownVariantError(CheckpointError):
    """config.json names a tts_model_type this engine does not implement."""


class HubUnavailableError(CheckpointError):
    """A Hub id was given but the Hub cannot be reached (offline) or has no such repo."""


@dataclass(frozen=True)
class Checkpoint:
    """Everything a model, codec and prompt builder need from one checkpoint folder."""

    path: Path
    config: ModelConfig
    codec_config: CodecConfig
    generation: dict
    tokenizer: TextTokenizer
    weights: dict[str, torch.Tensor]
    codec_weights: dict[str, torch.Tensor]


def resolve_path(path_or_hub_id: str | Path) -> Path:
    """A local folder as is; otherwise download the Hub repo (snapshot) and return its folder."""
    path = Path(path_or_hub_id)
    if path.is_dir():
        return path
    repo_id = str(path_or_hub_id)
    if path.exists() or repo_id.count("/") != 1 or repo_id.startswith((".", "/")):
        raise CheckpointFileMissing(
            f"{repo_id}: not a checkpoint folder (and not a Hub id 'org/name')")
    from huggingface_hub import snapshot_download  # noqa: PLC0415
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError  # noqa: PLC0415

    try:
        return Path(snapshot_download(repo_id))
    except LocalEntryNotFoundError as err:
        raise HubUnavailableError(
            f"{repo_id}: not a local folder and the Hugging Face Hub is unreachable (offline or "
            f"HF_HUB_OFFLINE=1) with no cached copy; download it where there is network and pass "
            f"the folder") from err
    except (HfHubHTTPError, OSError) as err:
        raise HubUnavailableError(f"{repo_id}: Hub download failed: {err}") from err


def _read_json(root: Path, name: str) -> dict:
    return json.loads((root / name).read_text(encoding="utf-8"))


def _check_files(root: Path) -> None:
    for name in REQUIRED_FILES:
        if not (root / name).is_file():
            raise CheckpointFileMissing(f"{root}: missing {name}")
    if not (root / MAIN_WEIGHTS).is_file() and not (root / SHARD_INDEX).is_file():
        raise CheckpointFileMissing(f"{root}: missing {MAIN_WEIGHTS} (or {SHARD_INDEX})")


def _model_config(root: Path) -> ModelConfig:
    raw = _read_json(root, "config.json")
    variant = raw.get("tts_model_type")
    if variant not in VARIANTS:
        raise UnknownVariantError(f"{root / 'config.json'}: unknown tts_model_type {variant!r}; "
                                  f"known: {', '.join(VARIANTS)}")
    return ModelConfig.from_dict(raw)


def read_main_weights(root: Path) -> dict[str, torch.Tensor]:
    """model.safetensors, or every shard named in model.safetensors.index.json."""
    if (root / MAIN_WEIGHTS).is_file():
        return load_file(root / MAIN_WEIGHTS)
    weight_map = _read_json(root, SHARD_INDEX)["weight_map"]
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        if not (root / shard).is_file():
            raise CheckpointFileMissing(f"{root}: missing shard {shard} named in {SHARD_INDEX}")
        weights.update(load_file(root / shard))
    missing = sorted(set(weight_map) - set(weights))
    if missing:
        raise CheckpointShapeError(f"{root / SHARD_INDEX}: tensors not found in their shards: "
                                   f"{missing[:5]}")
    return weights


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Key -> shape of the main checkpoint our modules implement for `config`."""
    from q3tts.models.tts_model import Qwen3TTS  # noqa: PLC0415

    with torch.device("meta"):
        model = Qwen3TTS(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def check_shapes(weights: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]],
                 where: Path) -> None:
    """Raise CheckpointShapeError naming missing, unexpected and mis-shaped tensors."""
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    wrong = [f"{k}: {tuple(weights[k].shape)} != expected {expected[k]}"
             for k in sorted(set(expected) & set(weights))
             if tuple(weights[k].shape) != expected[k]]
    problems = wrong[:5]
    if missing:
        problems.insert(0, f"missing {missing[:5]} ({len(missing)} total)")
    if unexpected:
        problems.insert(0, f"unexpected {unexpected[:5]} ({len(unexpected)} total)")
    if problems:
        raise CheckpointShapeError(
            f"{where}: weights do not match config.json: " + "; ".join(problems))


def _cast(weights: dict[str, torch.Tensor], dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    """Floating tensors to `dtype`, all to `device`."""
    return {k: v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device)
            for k, v in weights.items()}


def load_checkpoint(path_or_hub_id: str | Path, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu") -> Checkpoint:
    """Load a checkpoint folder (or Hub id) with main weights cast to `dtype` on `device`."""
    root = resolve_path(path_or_hub_id)
    _check_files(root)
    config = _model_config(root)
    weights = read_main_weights(root)
    check_shapes(weights, expected_shapes(config), root / MAIN_WEIGHTS)
    codec_raw = _read_json(root, "speech_tokenizer/config.json")
    return Checkpoint(
        path=root,
        config=config,
        codec_config=CodecConfig.from_dict(codec_raw),
        generation=_read_json(root, "generation_config.json"),
        tokenizer=TextTokenizer.from_dir(root),
        weights=_cast(weights, dtype, device),
        codec_weights=_cast(load_file(root / "speech_tokenizer/model.safetensors"), dtype, device),
    )
