"""Model configuration: typed, frozen views of a released Qwen3-TTS 12 Hz checkpoint's JSON files.

`ModelConfig.from_dict(json.load(config.json))` and `CodecConfig.from_dict(json.load(speech_tokenizer/config.json))`
are the only parsers; everything below them takes these objects. `presets.py` builds the JSON dicts that
`q3tts make-checkpoint` writes (the released values for `full`, small widths for `tiny`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

VARIANTS = ("custom_voice", "voice_design", "base")
SIZES = {"1b7": "1.7b", "0b6": "0.6b"}


class ConfigError(ValueError):
    """A checkpoint's config is missing a field or names something this engine does not support."""


def _req(d: dict[str, Any], key: str, where: str) -> Any:
    if key not in d:
        raise ConfigError(f"{where}: missing field {key!r}")
    return d[key]


@dataclass(frozen=True)
class DecoderLayerConfig:
    """Shape of a Qwen3 decoder stack (talker or code predictor)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int = 32768  # positions the RoPE tables cover

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str) -> DecoderLayerConfig:
        heads = _req(d, "num_attention_heads", where)
        hidden = _req(d, "hidden_size", where)
        return cls(
            hidden_size=hidden,
            intermediate_size=_req(d, "intermediate_size", where),
            num_layers=_req(d, "num_hidden_layers", where),
            num_heads=heads,
            num_kv_heads=_req(d, "num_key_value_heads", where),
            head_dim=d.get("head_dim") or hidden // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(d.get("rope_theta", 10000.0)),
            max_position_embeddings=int(d.get("max_position_embeddings") or 32768),
        )


@dataclass(frozen=True)
class TalkerConfig:
    """`talker_config`: the first-codebook LM and its codec/text embeddings (spec a.3)."""

    layers: DecoderLayerConfig
    code_predictor: DecoderLayerConfig
    vocab_size: int  # codec vocab of the talker (3072)
    text_vocab_size: int
    text_hidden_size: int
    num_code_groups: int
    codebook_size: int  # code predictor vocab (2048)
    codec_pad_id: int
    codec_bos_id: int
    codec_eos_id: int
    codec_think_id: int
    codec_nothink_id: int
    codec_think_bos_id: int
    codec_think_eos_id: int
    language_ids: dict[str, int] = field(default_factory=dict)
    speaker_ids: dict[str, int] = field(default_factory=dict)
    speaker_dialects: dict[str, str | bool] = field(default_factory=dict)

    @property
    def hidden_size(self) -> int:
        return self.layers.hidden_size

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TalkerConfig:
        w = "talker_config"
        cp = _req(d, "code_predictor_config", w)
        return cls(
            layers=DecoderLayerConfig.from_dict(d, w),
            code_predictor=DecoderLayerConfig.from_dict(cp, "code_predictor_config"),
            vocab_size=_req(d, "vocab_size", w),
            text_vocab_size=_req(d, "text_vocab_size", w),
            text_hidden_size=_req(d, "text_hidden_size", w),
            num_code_groups=_req(d, "num_code_groups", w),
            codebook_size=_req(cp, "vocab_size", "code_predictor_config"),
            codec_pad_id=_req(d, "codec_pad_id", w),
            codec_bos_id=_req(d, "codec_bos_id", w),
            codec_eos_id=_req(d, "codec_eos_token_id", w),
            codec_think_id=_req(d, "codec_think_id", w),
            codec_nothink_id=_req(d, "codec_nothink_id", w),
            codec_think_bos_id=_req(d, "codec_think_bos_id", w),
            codec_think_eos_id=_req(d, "codec_think_eos_id", w),
            language_ids=dict(d.get("codec_language_id") or {}),
            speaker_ids=dict(d.get("spk_id") or {}),
            speaker_dialects=dict(d.get("spk_is_dialect") or {}),
        )


@dataclass(frozen=True)
class SpeakerEncoderConfig:
    """`speaker_encoder_config` (Base only): ECAPA-TDNN x-vector extractor (spec a.5)."""

    mel_dim: int = 128
    enc_dim: int = 1024
    enc_channels: tuple[int, ...] = (512, 512, 512, 512, 1536)
    enc_kernel_sizes: tuple[int, ...] = (5, 3, 3, 3, 1)
    enc_dilations: tuple[int, ...] = (1, 2, 3, 4, 1)
    enc_attention_channels: int = 128
    enc_res2net_scale: int = 8
    enc_se_channels: int = 128
    sample_rate: int = 24000

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpeakerEncoderConfig:
        known = {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items()
                 if k in cls.__dataclass_fields__}
        return cls(**known)


@dataclass(frozen=True)
class ModelConfig:
    """Top-level `config.json` (spec a.2) with its talker and (Base) speaker-encoder configs."""

    variant: str  # custom_voice | voice_design | base
    size: str  # "1b7" | "0b6"
    talker: TalkerConfig
    speaker_encoder: SpeakerEncoderConfig | None
    im_start_id: int
    im_end_id: int
    assistant_id: int
    tts_pad_id: int
    tts_bos_id: int
    tts_eos_id: int
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def drops_instruct(self) -> bool:
        """The reference ignores `instruct` on 0.6B models (`WRAP:799`)."""
        return self.size == "0b6"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        w = "config.json"
        if d.get("model_type") != "qwen3_tts":
            raise ConfigError(f"{w}: model_type {d.get('model_type')!r} is not 'qwen3_tts'")
        variant = _req(d, "tts_model_type", w)
        if variant not in VARIANTS:
            raise ConfigError(f"{w}: unknown tts_model_type {variant!r}; known: {', '.join(VARIANTS)}")
        size = _req(d, "tts_model_size", w)
        if size not in SIZES:
            raise ConfigError(f"{w}: unknown tts_model_size {size!r}; known: {', '.join(SIZES)}")
        spk = d.get("speaker_encoder_config")
        return cls(
            variant=variant,
            size=size,
            talker=TalkerConfig.from_dict(_req(d, "talker_config", w)),
            speaker_encoder=SpeakerEncoderConfig.from_dict(spk or {}) if variant == "base" else None,
            im_start_id=_req(d, "im_start_token_id", w),
            im_end_id=_req(d, "im_end_token_id", w),
            assistant_id=_req(d, "assistant_token_id", w),
            tts_pad_id=_req(d, "tts_pad_token_id", w),
            tts_bos_id=_req(d, "tts_bos_token_id", w),
            tts_eos_id=_req(d, "tts_eos_token_id", w),
            raw=d,
        )


@dataclass(frozen=True)
class CodecDecoderConfig:
    """`speech_tokenizer/config.json` → `decoder_config` (spec a.6, e)."""

    codebook_size: int
    codebook_dim: int
    latent_dim: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    sliding_window: int
    rope_theta: float
    rms_norm_eps: float
    layer_scale_initial_scale: float
    num_quantizers: int
    upsampling_ratios: tuple[int, ...]
    upsample_rates: tuple[int, ...]
    decoder_dim: int

    @property
    def samples_per_frame(self) -> int:
        n = 1
        for r in (*self.upsampling_ratios, *self.upsample_rates):
            n *= r
        return n

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CodecDecoderConfig:
        w = "decoder_config"
        heads = _req(d, "num_attention_heads", w)
        return cls(
            codebook_size=_req(d, "codebook_size", w),
            codebook_dim=_req(d, "codebook_dim", w),
            latent_dim=_req(d, "latent_dim", w),
            hidden_size=_req(d, "hidden_size", w),
            intermediate_size=_req(d, "intermediate_size", w),
            num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads", heads),
            head_dim=d.get("head_dim") or _req(d, "hidden_size", w) // heads,
            num_layers=_req(d, "num_hidden_layers", w),
            sliding_window=_req(d, "sliding_window", w),
            rope_theta=float(d.get("rope_theta", 10000.0)),
            rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            layer_scale_initial_scale=d.get("layer_scale_initial_scale", 0.01),
            num_quantizers=_req(d, "num_quantizers", w),
            upsampling_ratios=tuple(_req(d, "upsampling_ratios", w)),
            upsample_rates=tuple(_req(d, "upsample_rates", w)),
            decoder_dim=_req(d, "decoder_dim", w),
        )


@dataclass(frozen=True)
class CodecConfig:
    """`speech_tokenizer/config.json`: the 12 Hz codec. `encoder` is the raw MimiConfig dict."""

    decoder: CodecDecoderConfig
    encoder: dict[str, Any]
    valid_num_quantizers: int
    sample_rate: int
    samples_per_frame: int
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CodecConfig:
        w = "speech_tokenizer/config.json"
        if d.get("model_type") != "qwen3_tts_tokenizer_12hz":
            raise ConfigError(f"{w}: model_type {d.get('model_type')!r} is not 'qwen3_tts_tokenizer_12hz'")
        return cls(
            decoder=CodecDecoderConfig.from_dict(_req(d, "decoder_config", w)),
            encoder=dict(_req(d, "encoder_config", w)),
            valid_num_quantizers=d.get("encoder_valid_num_quantizers", 16),
            sample_rate=d.get("output_sample_rate", 24000),
            samples_per_frame=d.get("decode_upsample_rate", 1920),
            raw=d,
        )
