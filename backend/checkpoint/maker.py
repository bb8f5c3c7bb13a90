"""`q3tts make-checkpoint OUT`: a random-weight checkpoint in the released folder layout (spec a.1, a.8).

config.json / generation_config.json come from `presets`, the tokenizer files from the tiny BPE
trainer, `model.safetensors` from our own modules' state_dict (so key names are the released ones),
`speech_tokenizer/` from the codec's `write_speech_tokenizer`. `tiny` is a few MB; `full` has the
released shapes (bf16 on disk by default, as released).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from q3tts.checkpoint import presets
from q3tts.checkpoint.loader import MAIN_WEIGHTS, SHARD_INDEX
from q3tts.checkpoint.tokenizer import train_tiny_tokenizer
from q3tts.codec.checkpoint import write_speech_tokenizer
from q3tts.config import VARIANTS, ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FULL_TEXT_VOCAB = 151936


def _init_tensor(name: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    """Random values that keep activations alive: norms near 1, fan-in scaled matrices."""
    if name.endswith("norm.weight"):
        return 1.0 + 0.05 * torch.randn(shape, generator=gen)
    if name.endswith(".bias"):
        return 0.02 * torch.randn(shape, generator=gen)
    if "embedding" in name:
        return 0.5 * torch.randn(shape, generator=gen)
    return torch.randn(shape, generator=gen) / math.sqrt(shape[-1])


def random_main_weights(config: ModelConfig, seed: int,
                        dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Seeded random `model.safetensors` contents for `config` (talker + Base speaker encoder)."""
    from q3tts.models.speaker_encoder import SpeakerEncoder  # noqa: PLC0415
    from q3tts.models.talker import Talker  # noqa: PLC0415

    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        talker = Talker(config.talker)
    weights = {f"talker.{k}": _init_tensor(k, v.shape, gen).to(dtype)
               for k, v in talker.state_dict().items()}
    if config.variant == "base":
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            encoder = SpeakerEncoder(config.speaker_encoder)
        weights.update({f"speaker_encoder.{k}": v.detach().to(dtype).contiguous()
                        for k, v in encoder.state_dict().items()})
    return weights


def save_weights(weights: dict[str, torch.Tensor], out: Path, max_shard_bytes: int | None) -> None:
    """One model.safetensors, or shards + model.safetensors.index.json above `max_shard_bytes`."""
    if max_shard_bytes is None:
        save_file(weights, str(out / MAIN_WEIGHTS), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in weights.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for t in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / SHARD_INDEX).write_text(json.dumps(index, indent=2))


def make_checkpoint(out: str | Path, variant: str, size: str, scale: str, seed: int,
                    dtype: torch.dtype | None = None, max_shard_bytes: int | None = None) -> Path:
    """Write a complete random checkpoint folder and return its path.

    size '1.7b' | '0.6b'; scale 'tiny' | 'full'; dtype defaults to fp32 (tiny) / bf16 (full).
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = dtype or (torch.float32 if scale == "tiny" else torch.bfloat16)
    text_ids = train_tiny_tokenizer(out)
    text_vocab = FULL_TEXT_VOCAB if scale == "full" else 64 * math.ceil(text_ids["vocab_size"] / 64)
    config_dict = presets.model_config_dict(variant, size, scale, text_ids, text_vocab)
    (out / "config.json").write_text(json.dumps(config_dict, indent=2))
    generation = presets.generation_config_dict()
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    weights = random_main_weights(ModelConfig.from_dict(config_dict), seed, dtype)
    save_weights(weights, out, max_shard_bytes)
    write_speech_tokenizer(out, scale, seed)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", type=Path, help="output folder")
    parser.add_argument("--variant", choices=VARIANTS, default="custom_voice")
    parser.add_argument("--size", choices=sorted(presets.SIZE_NAMES), default="1.7b")
    parser.add_argument("--scale", choices=presets.SCALES, default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="main weights dtype (default float32 for tiny, bfloat16 for full)")
    parser.add_argument("--max-shard-mb", type=float, default=None,
                        help="shard model.safetensors above this size (with an index file)")


def run(args: argparse.Namespace) -> int:
    shard = None if args.max_shard_mb is None else int(args.max_shard_mb * 2**20)
    out = make_checkpoint(args.out, args.variant, args.size, args.scale, args.seed,
                          DTYPES[args.dtype] if args.dtype else None, shard)
    print(f"wrote {out}")
    return 0
