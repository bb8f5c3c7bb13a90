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
        """Build from a `q3tts.checkpoint.loader.Checkpoint`, weights loaded strictly, eval mode,
        decoder projections fused and RoPE tables built (`fuse_`)."""
        any_weight = next(iter(ckpt.weights.values()))
        with torch.device("meta"):
            model = cls(ckpt.config)
        model.load_state_dict(ckpt.weights, strict=True, assign=True)
        model = model.to(dtype=any_weight.dtype, device=any_weight.device).eval().fuse_()
        # the fused weights are now slices of new concatenated buffers: point the checkpoint's
        # entries at them (equal values) so that the loaded copies are freed, not kept beside them
        for key, param in model.named_parameters():
            loaded = ckpt.weights.get(key)
            if (loaded is not None and loaded.data_ptr() != param.data_ptr()
                    and loaded.dtype == param.dtype and loaded.device == param.device
                    and loaded.shape == param.shape):
                ckpt.weights[key] = param.detach()
        return model

    def fuse_(self) -> Qwen3TTS:
        """Concatenate q/k/v and gate/up weights into non-persistent buffers (the released
        parameters become views of them: state_dict unchanged) and build the RoPE tables, for the
        current device/dtype. `.to()` keeps both in step; call again after
        `load_state_dict(assign=True)` and before CUDA graph capture."""
        self.talker.fuse_()
        return self
