"""The JSON dicts `q3tts make-checkpoint` writes: released values for `full`, small widths for `tiny`.

Codec-side ids (codec specials, languages, dialects, speakers) are the released ones at every scale.
Text-side special ids (`<|im_start|>`, `<tts_pad>`, ...) point into the checkpoint's own tokenizer:
the real ids at `full` scale would need the real 151k-token vocabulary, which cannot be downloaded here.
"""

from __future__ import annotations

import copy
from typing import Any

LANGUAGES = {
    "chinese": 2055, "english": 2050, "german": 2053, "italian": 2070, "portuguese": 2071,
    "spanish": 2054, "japanese": 2058, "korean": 2064, "french": 2061, "russian": 2069,
}
DIALECTS = {"beijing_dialect": 2074, "sichuan_dialect": 2062}
SPEAKERS = {
    "serena": 3066, "vivian": 3065, "uncle_fu": 3010, "ryan": 3061, "aiden": 2861,
    "ono_anna": 2873, "sohee": 2864, "eric": 2875, "dylan": 2878,
}
SPEAKER_DIALECTS = {**{s: False for s in SPEAKERS}, "eric": "sichuan_dialect", "dylan": "beijing_dialect"}

GENERATION_CONFIG = {
    "do_sample": True, "repetition_penalty": 1.05, "temperature": 0.9, "top_p": 1.0, "top_k": 50,
    "subtalker_dosample": True, "subtalker_temperature": 0.9, "subtalker_top_p": 1.0,
    "subtalker_top_k": 50, "max_new_tokens": 8192,
}

# name -> (talker hidden, talker intermediate, talker layers, heads, kv heads, head_dim, mrope_section,
#          text hidden, cp hidden, cp intermediate, cp layers, cp heads, cp kv heads, cp head_dim)
_TALKER_SHAPES = {
    ("1b7", "full"): (2048, 6144, 28, 16, 8, 128, [24, 20, 20], 2048, 1024, 3072, 5, 16, 8, 128),
    ("0b6", "full"): (1024, 3072, 28, 16, 8, 128, [24, 20, 20], 2048, 1024, 3072, 5, 16, 8, 128),
    ("1b7", "tiny"): (64, 128, 2, 4, 2, 16, [4, 2, 2], 32, 48, 96, 2, 4, 2, 16),
    ("0b6", "tiny"): (48, 96, 2, 4, 2, 16, [4, 2, 2], 32, 48, 96, 2, 4, 2, 16),
}
SIZE_NAMES = {"1.7b": "1b7", "0.6b": "0b6"}
SCALES = ("tiny", "full")


def model_config_dict(variant: str, size: str, scale: str, text_ids: dict[str, int],
                      text_vocab_size: int) -> dict[str, Any]:
    """config.json for `variant` at `size` ('1.7b'|'0.6b') and `scale` ('tiny'|'full').

    `text_ids` maps im_start/im_end/assistant/tts_pad/tts_bos/tts_eos to the tokenizer's ids.
    """
    size_key = SIZE_NAMES[size]
    (h, inter, nl, nh, nkv, hd, mrope, th, cph, cpi, cpl, cpnh, cpkv, cphd) = _TALKER_SHAPES[(size_key, scale)]
    custom = variant == "custom_voice"
    talker = {
        "vocab_size": 3072, "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": nl,
        "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": hd, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "rope_theta": 1000000, "max_position_embeddings": 32768,
        "rope_scaling": {"interleaved": True, "mrope_section": mrope, "rope_type": "default", "type": "default"},
        "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
        "num_code_groups": 16, "text_vocab_size": text_vocab_size, "text_hidden_size": th,
        "position_id_per_seconds": 13, "pad_token_id": None,
        "codec_pad_id": 2148, "codec_bos_id": 2149, "codec_eos_token_id": 2150,
        "codec_think_id": 2154, "codec_nothink_id": 2155, "codec_think_bos_id": 2156,
        "codec_think_eos_id": 2157,
        "codec_language_id": {**LANGUAGES, **(DIALECTS if custom else {})},
        "spk_id": dict(SPEAKERS) if custom else {},
        "spk_is_dialect": dict(SPEAKER_DIALECTS) if custom else {},
        "code_predictor_config": {
            "vocab_size": 2048, "hidden_size": cph, "intermediate_size": cpi, "num_hidden_layers": cpl,
            "num_attention_heads": cpnh, "num_key_value_heads": cpkv, "head_dim": cphd,
            "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000, "rope_scaling": None,
            "max_position_embeddings": 65536, "layer_types": ["full_attention"] * cpl,
            "num_code_groups": 16, "attention_bias": False, "use_sliding_window": False,
            "sliding_window": None, "max_window_layers": cpl,
        },
    }
    cfg = {
        "architectures": ["Qwen3TTSForConditionalGeneration"], "model_type": "qwen3_tts",
        "tokenizer_type": "qwen3_tts_tokenizer_12hz", "tts_model_size": size_key, "tts_model_type": variant,
        "im_start_token_id": text_ids["im_start"], "im_end_token_id": text_ids["im_end"],
        "assistant_token_id": text_ids["assistant"], "tts_pad_token_id": text_ids["tts_pad"],
        "tts_bos_token_id": text_ids["tts_bos"], "tts_eos_token_id": text_ids["tts_eos"],
        "talker_config": talker, "transformers_version": "4.57.3",
    }
    if variant == "base":
        enc_dim = h
        channels = [512, 512, 512, 512, 1536] if scale == "full" else [32, 32, 32, 32, 96]
        cfg["speaker_encoder_config"] = {
            "mel_dim": 128, "enc_dim": enc_dim, "enc_channels": channels,
            "enc_kernel_sizes": [5, 3, 3, 3, 1], "enc_dilations": [1, 2, 3, 4, 1],
            "enc_attention_channels": 128 if scale == "full" else 16, "enc_res2net_scale": 8 if scale == "full" else 4,
            "enc_se_channels": 128 if scale == "full" else 16, "sample_rate": 24000,
        }
    return cfg


_CODEC_DECODER = {
    "full": {"codebook_dim": 512, "latent_dim": 1024, "hidden_size": 512, "intermediate_size": 1024,
             "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 64, "num_hidden_layers": 8,
             "decoder_dim": 1536},
    "tiny": {"codebook_dim": 32, "latent_dim": 64, "hidden_size": 32, "intermediate_size": 64,
             "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 8, "num_hidden_layers": 2,
             "decoder_dim": 48},
}
_CODEC_ENCODER = {
    "full": {"hidden_size": 512, "num_filters": 64, "codebook_dim": 256, "num_hidden_layers": 8,
             "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 2048,
             "vector_quantization_hidden_dimension": 256, "upsample_groups": 512},
    "tiny": {"hidden_size": 32, "num_filters": 4, "codebook_dim": 16, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 8, "intermediate_size": 64,
             "vector_quantization_hidden_dimension": 16, "upsample_groups": 32},
}


def codec_config_dict(scale: str) -> dict[str, Any]:
    """speech_tokenizer/config.json at `scale` (released values for 'full')."""
    decoder = {
        "codebook_size": 2048, "max_position_embeddings": 8000, "rope_theta": 10000,
        "attention_bias": False, "sliding_window": 72, "hidden_act": "silu",
        "layer_scale_initial_scale": 0.01, "rms_norm_eps": 1e-5, "num_quantizers": 16,
        "upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2], "attention_dropout": 0.0,
        "num_semantic_quantizers": 1, "semantic_codebook_size": 4096,
        "vector_quantization_hidden_dimension": 512, **_CODEC_DECODER[scale],
    }
    encoder = {
        "_frame_rate": 12.5, "frame_rate": 12.5, "sampling_rate": 24000, "audio_channels": 1,
        "num_residual_layers": 1, "upsampling_ratios": [8, 6, 5, 4], "kernel_size": 7, "last_kernel_size": 3,
        "residual_kernel_size": 3, "dilation_growth_rate": 2, "compress": 2, "use_causal_conv": True,
        "pad_mode": "constant", "trim_right_ratio": 1.0, "use_conv_shortcut": False,
        "codebook_size": 2048, "num_quantizers": 32, "num_semantic_quantizers": 1,
        "hidden_act": "gelu", "max_position_embeddings": 8000,
        "initializer_range": 0.02, "norm_eps": 1e-5, "use_cache": False, "rope_theta": 10000.0,
        "sliding_window": 250, "attention_dropout": 0.0, "layer_scale_initial_scale": 0.01,
        "attention_bias": False, "model_type": "mimi", **_CODEC_ENCODER[scale],
    }
    return {
        "architectures": ["Qwen3TTSTokenizerV2Model"], "model_type": "qwen3_tts_tokenizer_12hz",
        "encoder_valid_num_quantizers": 16, "input_sample_rate": 24000, "output_sample_rate": 24000,
        "decode_upsample_rate": 1920, "encode_downsample_rate": 1920,
        "decoder_config": decoder, "encoder_config": encoder, "transformers_version": "4.57.3",
    }


PREPROCESSOR_CONFIG = {
    "chunk_length_s": None, "feature_extractor_type": "EncodecFeatureExtractor", "feature_size": 1,
    "overlap": None, "padding_side": "right", "padding_value": 0.0, "return_attention_mask": True,
    "sampling_rate": 24000,
}


def generation_config_dict() -> dict[str, Any]:
    """generation_config.json: the released sampling defaults (spec a.7)."""
    return copy.deepcopy(GENERATION_CONFIG)
