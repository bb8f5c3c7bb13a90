"""The codec encoder: 24 kHz reference audio -> codes [T, 16] (Mimi encoder, no decoder parts).

`MimiEncoder` is an nn.Module whose state_dict names are the released `encoder.*` keys minus the prefix
(SEANet `encoder.layers.*`, `encoder_transformer.layers.*`, `downsample`, split RVQ `quantizer.*` with
codebook buffers `initialized` / `cluster_usage` / `embed_sum`). `CodecEncoder` wraps it with the
reference's trimming: `ceil(n_samples / 1920)` frames, first 16 quantizers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from q3tts.kernels.reference import rope_cos_sin

from ..config import CodecConfig
from .audio import SAMPLE_RATE
from .layers import AttentionProjections, LayerScale, apply_rope


@dataclass(frozen=True)
class MimiEncoderConfig:
    """The fields of `encoder_config` (a transformers MimiConfig dict) the encoder uses."""

    sampling_rate: int
    hidden_size: int
    num_filters: int
    num_residual_layers: int
    ratios: tuple[int, ...]  # encoder order (reversed `upsampling_ratios`)
    kernel_size: int
    last_kernel_size: int
    residual_kernel_size: int
    dilation_growth_rate: int
    compress: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    rope_theta: float
    layer_scale: float
    codebook_size: int
    codebook_dim: int
    vq_dim: int
    num_quantizers: int
    num_semantic_quantizers: int
    frame_rate: float

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MimiEncoderConfig:
        heads = d.get("num_attention_heads", 8)
        hidden = d.get("hidden_size", 512)
        return cls(
            sampling_rate=d.get("sampling_rate", SAMPLE_RATE), hidden_size=hidden,
            num_filters=d.get("num_filters", 64), num_residual_layers=d.get("num_residual_layers", 1),
            ratios=tuple(reversed(d.get("upsampling_ratios", [8, 6, 5, 4]))),
            kernel_size=d.get("kernel_size", 7), last_kernel_size=d.get("last_kernel_size", 3),
            residual_kernel_size=d.get("residual_kernel_size", 3),
            dilation_growth_rate=d.get("dilation_growth_rate", 2), compress=d.get("compress", 2),
            num_layers=d.get("num_hidden_layers", 8), num_heads=heads,
            num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or hidden // heads,
            intermediate_size=d.get("intermediate_size", 2048), norm_eps=d.get("norm_eps", 1e-5),
            rope_theta=float(d.get("rope_theta", 10000.0)),
            layer_scale=d.get("layer_scale_initial_scale", 0.01),
            codebook_size=d.get("codebook_size", 2048), codebook_dim=d.get("codebook_dim", 256),
            vq_dim=d.get("vector_quantization_hidden_dimension") or hidden,
            num_quantizers=d.get("num_quantizers", 32),
            num_semantic_quantizers=d.get("num_semantic_quantizers", 1),
            frame_rate=float(d.get("_frame_rate") or d.get("frame_rate", 12.5)),
        )

    @property
    def downsample_stride(self) -> int:
        """Stride of the final conv from the SEANet rate (25 Hz) to the frame rate (12.5 Hz)."""
        return round(self.sampling_rate / math.prod(self.ratios) / self.frame_rate)


class PaddedConv1d(nn.Module):
    """Mimi's causal Conv1d: left pad `k_eff - stride`, right pad up to a whole number of strides."""

    def __init__(self, c_in: int, c_out: int, kernel: int, stride: int = 1, dilation: int = 1,
                 bias: bool = True, pad_mode: str = "constant") -> None:
        super().__init__()
        self.conv = nn.Conv1d(c_in, c_out, kernel, stride, dilation=dilation, bias=bias)
        self.kernel = (kernel - 1) * dilation + 1
        self.stride = stride
        self.pad_mode = pad_mode

    def forward(self, x: Tensor) -> Tensor:  # [B, C, T]
        left = self.kernel - self.stride
        frames = math.ceil((x.shape[-1] - self.kernel + left) / self.stride + 1) - 1
        right = frames * self.stride + self.kernel - left - x.shape[-1]
        return self.conv(F.pad(x, (left, right), mode=self.pad_mode))


class ResnetBlock(nn.Module):
    """SEANet residual block: x + conv1(ELU(conv_k(ELU(x)))) (`block.1`, `block.3`)."""

    def __init__(self, dim: int, hidden: int, kernel: int, dilation: int) -> None:
        super().__init__()
        self.block = nn.ModuleList([nn.ELU(), PaddedConv1d(dim, hidden, kernel, dilation=dilation),
                                    nn.ELU(), PaddedConv1d(hidden, dim, 1)])

    def forward(self, x: Tensor) -> Tensor:
        h = x
        for layer in self.block:
            h = layer(h)
        return x + h


def _seanet_layers(cfg: MimiEncoderConfig) -> list[nn.Module]:
    layers: list[nn.Module] = [PaddedConv1d(1, cfg.num_filters, cfg.kernel_size)]
    dim = cfg.num_filters
    for ratio in cfg.ratios:
        for j in range(cfg.num_residual_layers):
            layers.append(ResnetBlock(dim, dim // cfg.compress, cfg.residual_kernel_size,
                                      cfg.dilation_growth_rate ** j))
        layers += [nn.ELU(), PaddedConv1d(dim, dim * 2, 2 * ratio, stride=ratio)]
        dim *= 2
    layers += [nn.ELU(), PaddedConv1d(dim, cfg.hidden_size, cfg.last_kernel_size)]
    return layers


class SEANet(nn.Module):
    """Waveform [B, 1, n] -> [B, hidden, n / prod(ratios)]."""

    def __init__(self, cfg: MimiEncoderConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_seanet_layers(cfg))

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class MimiAttention(AttentionProjections):
    """Causal MHA with RoPE (the reference's eager/SDPA path: no sliding window)."""

    def __init__(self, cfg: MimiEncoderConfig) -> None:
        super().__init__(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:  # [B, T, h]
        b, t, _ = x.shape
        q = apply_rope(self.q_proj(x).view(b, t, self.heads, self.head_dim), *rope).transpose(1, 2)
        k = apply_rope(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim), *rope).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             enable_gqa=self.kv_heads != self.heads)  # [B, H, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MimiMlp(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, inter, bias=False)
        self.fc2 = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class MimiLayer(nn.Module):
    """Pre-LayerNorm transformer layer with LayerScale."""

    def __init__(self, cfg: MimiEncoderConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.self_attn = MimiAttention(cfg)
        self.mlp = MimiMlp(h, cfg.intermediate_size)
        self.input_layernorm = nn.LayerNorm(h, eps=cfg.norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(h, eps=cfg.norm_eps)
        self.self_attn_layer_scale = LayerScale(h, cfg.layer_scale)
        self.mlp_layer_scale = LayerScale(h, cfg.layer_scale)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor]) -> Tensor:
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), rope))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class MimiTransformer(nn.Module):
    def __init__(self, cfg: MimiEncoderConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MimiLayer(cfg) for _ in range(cfg.num_layers))
        self.head_dim, self.theta = cfg.head_dim, cfg.rope_theta

    def forward(self, x: Tensor) -> Tensor:  # [B, T, h]
        pos = torch.arange(x.shape[1], device=x.device)[None].expand(x.shape[0], -1)  # [B, T]
        rope = rope_cos_sin(pos, self.head_dim, self.theta, x.dtype)
        for layer in self.layers:
            x = layer(x, rope)
        return x


class EuclideanCodebook(nn.Module):
    """Codebook as buffers (`initialized`, `cluster_usage`, `embed_sum`); nearest entry by L2."""

    def __init__(self, dim: int, size: int) -> None:
        super().__init__()
        self.register_buffer("initialized", torch.ones(1))
        self.register_buffer("cluster_usage", torch.ones(size))
        self.register_buffer("embed_sum", torch.zeros(size, dim))

    def table(self) -> Tensor:  # [size, dim]
        return self.embed_sum / self.cluster_usage.clamp(min=1e-5)[:, None]

    def nearest(self, x: Tensor) -> Tensor:  # [N, dim] -> [N]
        return torch.cdist(x[None].float(), self.table()[None].float(), p=2)[0].argmin(dim=-1)


class _VQ(nn.Module):
    def __init__(self, dim: int, size: int) -> None:
        super().__init__()
        self.codebook = EuclideanCodebook(dim, size)


class MimiRVQ(nn.Module):
    """Residual VQ over `input_proj(x)`: each layer quantizes the residual of the previous ones."""

    def __init__(self, n: int, cfg: MimiEncoderConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_VQ(cfg.codebook_dim, cfg.codebook_size) for _ in range(n))
        self.input_proj = nn.Conv1d(cfg.hidden_size, cfg.vq_dim, 1, bias=False)
        self.output_proj = nn.Conv1d(cfg.vq_dim, cfg.hidden_size, 1, bias=False)  # decoding only

    def encode(self, x: Tensor, n: int) -> Tensor:  # [B, h, T] -> codes [B, n, T]
        residual = self.input_proj(x).transpose(1, 2)  # [B, T, D]
        codes = []
        for vq in self.layers[:n]:
            table = vq.codebook.table()
            idx = vq.codebook.nearest(residual.reshape(-1, residual.shape[-1])).view(residual.shape[:-1])
            residual = residual - F.embedding(idx, table)
            codes.append(idx)
        return torch.stack(codes, dim=1)


class MimiSplitRVQ(nn.Module):
    def __init__(self, cfg: MimiEncoderConfig) -> None:
        super().__init__()
        n_sem = cfg.num_semantic_quantizers
        self.n_semantic = n_sem
        self.semantic_residual_vector_quantizer = MimiRVQ(n_sem, cfg)
        self.acoustic_residual_vector_quantizer = MimiRVQ(cfg.num_quantizers - n_sem, cfg)

    def encode(self, x: Tensor, n: int) -> Tensor:  # [B, h, T] -> [B, n, T]
        sem = self.semantic_residual_vector_quantizer.encode(x, self.n_semantic)
        rest = self.acoustic_residual_vector_quantizer.encode(x, n - self.n_semantic)
        return torch.cat([sem, rest], dim=1)


class MimiEncoder(nn.Module):
    """Mimi encoder; state_dict names = released `encoder.*` keys minus the prefix."""

    def __init__(self, cfg: MimiEncoderConfig) -> None:
        super().__init__()
        self.config = cfg
        self.encoder = SEANet(cfg)
        self.encoder_transformer = MimiTransformer(cfg)
        stride = cfg.downsample_stride
        self.downsample = PaddedConv1d(cfg.hidden_size, cfg.hidden_size, 2 * stride, stride=stride,
                                       bias=False, pad_mode="replicate")
        self.quantizer = MimiSplitRVQ(cfg)

    def forward(self, wav: Tensor, num_quantizers: int) -> Tensor:
        """wav [B, n] -> codes [B, num_quantizers, ceil(n / samples_per_frame)] (int64)."""
        h = self.encoder(wav[:, None])  # [B, hidden, T25]
        h = self.encoder_transformer(h.transpose(1, 2)).transpose(1, 2)
        return self.quantizer.encode(self.downsample(h), num_quantizers)


class CodecEncoder:
    """Reference audio -> codes, as `Qwen3TTSTokenizer.encode` does for one item."""

    def __init__(self, model: MimiEncoder, num_quantizers: int, samples_per_frame: int) -> None:
        self.model = model
        self.num_quantizers = num_quantizers
        self.samples_per_frame = samples_per_frame

    @classmethod
    def from_weights(cls, codec_config: CodecConfig, weights: dict[str, Tensor],
                     dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> CodecEncoder:
        """Build from the codec config and `encoder.*` weights (other keys are ignored). Strict load."""
        model = MimiEncoder(MimiEncoderConfig.from_dict(codec_config.encoder))
        own = {k.removeprefix("encoder."): v for k, v in weights.items() if k.startswith("encoder.")}
        model.load_state_dict(own, strict=True)
        return cls(model.to(device=device, dtype=dtype).eval(), codec_config.valid_num_quantizers,
                   codec_config.samples_per_frame)

    @torch.inference_mode()
    def encode(self, wav: Tensor) -> Tensor:
        """wav [n] float32 mono at 24 kHz -> codes [T, 16] int64, T = ceil(n / 1920)."""
        p = next(self.model.parameters())
        codes = self.model(wav.to(device=p.device, dtype=p.dtype)[None], self.num_quantizers)[0]
        frames = -(-wav.shape[-1] // self.samples_per_frame)
        return codes[:, :frames].transpose(0, 1)
