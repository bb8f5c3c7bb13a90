"""speech_tokenizer/ folders: random ones in the released layout (for tests and benches) and loading.

`write_speech_tokenizer` builds our own `CodecDecoder` and `MimiEncoder` (whose state_dicts are the
released `decoder.*` / `encoder.*` names), gives them a seeded random init that keeps the decoder's
output non-degenerate, and writes config.json, preprocessor_config.json and model.safetensors exactly
as a released checkpoint has them, so the official `Qwen3TTSTokenizer.from_pretrained` loads the folder
with no missing or unexpected keys.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from q3tts.checkpoint import presets
from ..config import CodecConfig
from .decoder import CodecDecoder
from .encoder import CodecEncoder, MimiEncoder, MimiEncoderConfig

SPEECH_TOKENIZER_DIR = "speech_tokenizer"


def _randomize(module: nn.Module, gen: torch.Generator) -> None:
    """Reinitialise the non-conv/linear tensors so that every path carries signal.

    Decoder codebooks: unit-scale entries (embedding_sum = N(0,1)·usage, usage in [0.5, 2]); encoder
    codebooks: entries at the scale of a randomly initialised Mimi's projected features (std 0.02), so
    that the nearest-entry search follows the signal instead of the features' offset; norms and Snake
    parameters: small perturbations of their identity values; LayerScale / ConvNeXt gamma: small
    positive scales (0.05-0.15) so residual branches matter without dominating.
    """
    def uniform(t: Tensor, lo: float, hi: float) -> Tensor:
        return lo + (hi - lo) * torch.rand(t.shape, generator=gen)

    def normal(t: Tensor, std: float) -> Tensor:
        return std * torch.randn(t.shape, generator=gen)

    tensors = dict(module.named_parameters()) | dict(module.named_buffers())
    usage = {}
    for name, t in sorted(tensors.items()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "cluster_usage":
            usage[name] = uniform(t, 0.5, 2.0)
            new = usage[name]
        elif leaf in ("embedding_sum", "embed_sum"):
            std = 1.0 if leaf == "embedding_sum" else 0.02
            new = normal(t, std) * usage[name.rsplit(".", 1)[0] + ".cluster_usage"][:, None]
        elif leaf in ("scale", "gamma"):
            new = uniform(t, 0.05, 0.15)
        elif leaf in ("alpha", "beta"):
            new = normal(t, 0.1)
        elif "norm" in name and leaf == "weight":
            new = 1.0 + normal(t, 0.05)
        elif "norm" in name and leaf == "bias":
            new = normal(t, 0.02)
        else:
            continue
        with torch.no_grad():
            t.copy_(new)


def random_codec_state(codec_config: CodecConfig, seed: int) -> dict[str, Tensor]:
    """Seeded random weights for `codec_config` in the released speech_tokenizer key layout (fp32)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        decoder = CodecDecoder(codec_config.decoder)
        encoder = MimiEncoder(MimiEncoderConfig.from_dict(codec_config.encoder))
    gen = torch.Generator().manual_seed(seed + 1)
    _randomize(decoder, gen)
    _randomize(encoder, gen)
    state = {f"decoder.{k}": v for k, v in decoder.state_dict().items()}
    state |= {f"encoder.{k}": v for k, v in encoder.state_dict().items()}
    return state


def write_speech_tokenizer(out_dir: Path | str, scale: str, seed: int,
                           dtype: torch.dtype = torch.float32) -> Path:
    """Write `out_dir/speech_tokenizer/` (config.json, preprocessor_config.json, model.safetensors) with
    seeded random weights at `scale` ('tiny' | 'full') in `dtype`. Returns the speech_tokenizer folder."""
    folder = Path(out_dir) / SPEECH_TOKENIZER_DIR
    folder.mkdir(parents=True, exist_ok=True)
    config = presets.codec_config_dict(scale)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "preprocessor_config.json").write_text(json.dumps(presets.PREPROCESSOR_CONFIG, indent=2) + "\n")
    state = random_codec_state(CodecConfig.from_dict(config), seed)
    save_file({k: v.to(dtype).contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    return folder


def read_speech_tokenizer(folder: Path | str) -> tuple[CodecConfig, dict[str, Tensor]]:
    """Read a speech_tokenizer folder (or a checkpoint folder holding one) -> (config, weights)."""
    folder = Path(folder)
    if (folder / SPEECH_TOKENIZER_DIR).is_dir():
        folder = folder / SPEECH_TOKENIZER_DIR
    config = CodecConfig.from_dict(json.loads((folder / "config.json").read_text()))
    return config, load_file(str(folder / "model.safetensors"))


@dataclass
class Codec:
    """The loaded codec: full/streaming decoder and reference-audio encoder."""

    config: CodecConfig
    decoder: CodecDecoder
    encoder: CodecEncoder


def load_codec(codec_config: CodecConfig, codec_weights: dict[str, Tensor],
               dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> Codec:
    """Build decoder and encoder from `Checkpoint.codec_config` / `Checkpoint.codec_weights`, both in
    `dtype` on `device` (the reference runs both in its load dtype)."""
    decoder = CodecDecoder.from_weights(codec_config, codec_weights, dtype, device)
    encoder = CodecEncoder.from_weights(codec_config, codec_weights, dtype, device)
    return Codec(codec_config, decoder, encoder)
