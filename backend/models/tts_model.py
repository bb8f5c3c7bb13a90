"""Top module `Qwen3TTS`: `talker` (+ `speaker_encoder` on Base); state_dict keys = released keys."""

from __future__ import annotations

import torch
from torch import nn

from q3tts.config import ModelConfig
from q3tts.models.talker import Talker


class Qwen3TTS(nn.Module):
    """The whole main checkpoint (`model.safetensors`) as one module."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.talker = Talker(config.talker)
        if config.variant == "base":
            from q3tts.models.speaker_encoder import SpeakerEncoder  # noqa: PLC0415 (codec-owned)

            self.speaker_encoder = SpeakerEncoder(config.speaker_encoder)

    @classmethod
    def from_checkpoint(cls, ckpt) -> Qwen3TTS:
        """Build from a `q3tts.checkpoint.loader.Checkpoint`, weights loaded strictly, eval mode."""
        any_weight = next(iter(ckpt.weights.values()))
        with torch.device("meta"):
            model = cls(ckpt.config)
        model.load_state_dict(ckpt.weights, strict=True, assign=True)
        return model.to(dtype=any_weight.dtype, device=any_weight.device).eval()
