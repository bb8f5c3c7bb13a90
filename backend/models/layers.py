"""Qwen3 decoder building blocks shared by the talker and the code predictor (spec b.1, c).

Token-major, batch-free tensors: every forward takes `x [N, H]` rows (tokens of any sequences) with
their `positions [N]`; the `AttentionContext` knows which rows belong to which sequence.
Attribute names equal the released safetensors keys (`self_attn.q_proj`, `mlp.gate_proj`, ...).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from q3tts.config import DecoderLayerConfig
from q3tts import kernels
from q3tts.kernels.reference import rotary_ref
from q3tts.models.attention import AttentionContext


class RMSNorm(nn.Module):
    """RMSNorm over the last dim; statistics in fp32, rounded to the input dtype before the weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables for `positions [N]` -> cos, sin `[N, D]` (cat(freqs, freqs) layout).

    inv_freq and the angles in fp32 exactly as the official rotary embedding, then cast to `dtype`.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float()
    inv_freq = 1.0 / (theta ** (exponents / head_dim))  # [D/2]
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [N, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [N, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


class SelfAttention(nn.Module):
    """GQA self-attention with QK-norm (RMSNorm over head_dim before RoPE), no biases."""

    def __init__(self, cfg: DecoderLayerConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=False)
        self.o_proj = nn.Linear(q_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttentionContext) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(n, self.num_heads, self.head_dim))  # [N, NH, D]
        k = self.k_norm(self.k_proj(x).view(n, self.num_kv_heads, self.head_dim))  # [N, KVH, D]
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)  # [N, KVH, D]
        q, k = rotary_ref(q, cos, sin), rotary_ref(k, cos, sin)
        out = attn.attend(self.layer_idx, q, k, v)  # [N, NH, D]
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm Qwen3 layer: h = x + attn(norm(x)); y = h + mlp(norm(h))."""

    def __init__(self, cfg: DecoderLayerConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttentionContext) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderStack(nn.Module):
    """`layers.{i}` + final `norm`; subclasses add their embedding tables under the same prefix."""

    def __init__(self, cfg: DecoderLayerConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def attn_scale(self) -> float:
        return self.cfg.head_dim ** -0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                attn: AttentionContext) -> torch.Tensor:
        """x [N, H], positions [N] -> final-normed hidden [N, H]."""
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, attn)
        return self.norm(x)
