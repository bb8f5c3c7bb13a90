"""What the engine builds around its runner: the streaming codec (one state slot per engine slot) and the
config resolved against the model and the device memory left once the codec exists."""

from __future__ import annotations

import torch

from .config import EngineConfig


def make_codec(ckpt, config: EngineConfig):
    """The streaming codec decoder with one state slot per engine slot (+ the scratch slot)."""
    from q3tts.codec.decoder import CodecDecoder
    from q3tts.codec.streaming import StreamingDecoder

    decoder = CodecDecoder.from_weights(ckpt.codec_config, ckpt.codec_weights)
    return StreamingDecoder(decoder, config.max_slots, getattr(torch, config.dtype), config.device,
                            use_kernels=config.codec_kernels or config.batch_invariant, fuse=config.codec_fusion)


def resolve_config(model, config: EngineConfig) -> EngineConfig:
    """`config` checked against the model, with `num_pages` filled in: the KV memory fraction of the
    device memory free now (so call it once the rest of the device state, e.g. the codec's, exists;
    on CPU: see EngineConfig.resolve)."""
    positions = model.talker.model.max_positions
    if config.max_prompt_tokens + config.max_frames > positions:
        # NOTE: the RoPE kernel reads its table without bounds checks: refuse configs that could overrun it
        raise ValueError(f"max_prompt_tokens + max_frames = {config.max_prompt_tokens + config.max_frames} "
                         f"exceeds the talker's {positions} positions")
    lc = model.config.talker.layers
    itemsize = torch.empty((), dtype=getattr(torch, config.dtype)).element_size()
    bytes_per_page = 2 * lc.num_layers * lc.num_kv_heads * lc.head_dim * itemsize * config.page_size  # K, V
    device = torch.device(config.device)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    return config.resolve(bytes_per_page, free)
