"""Torch references of the code-predictor kernels (kernels/code_predictor_*.py): the eager layer's
own ops (models/layers.py), built from the references in kernels/reference.py.

The sampling kernel's reference is `q3tts.models.sampling.warp_and_draw_reference` (kernels/ may not
import models/: the tests compare the two directly).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from .reference import paged_decode_attention_ref, rms_norm_ref
from .talker_reference import qkv_rope_store_ref


def project_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight^T + bias -> [M, N]."""
    return F.linear(x, weight, bias)


def linear_residual_ref(x: torch.Tensor, weight: torch.Tensor,
                        residual: torch.Tensor) -> torch.Tensor:
    """residual + x @ weight^T, the product rounded to its dtype first (eager o_proj / down_proj
    followed by the residual add)."""
    return residual + F.linear(x, weight)


def norm_gate_up_ref(x: torch.Tensor, norm_weight: torch.Tensor, gate_up_weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
    """silu(gate) * up of rms_norm(x) (gate_up_weight rows: gate | up)."""
    gate, up = F.linear(rms_norm_ref(x, norm_weight, eps), gate_up_weight).chunk(2, dim=-1)
    return F.silu(gate) * up


def norm_head_ref(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, eps: float,
                  tokens_per_row: int = 1) -> torch.Tensor:
    """fp32 logits of the final norm + head on the last token of each batch row."""
    t = tokens_per_row
    return F.linear(rms_norm_ref(x[t - 1::t], norm_weight, eps), weight).float()


def embed_sum_ref(first: torch.Tensor, tables: tuple[torch.Tensor, ...], ids: torch.Tensor) -> torch.Tensor:
    """first [B, H] + sum of tables[g] at rows ids[:, g], in fp32 in the order of torch's CUDA sum of
    `torch.stack(rows, 1).sum(1)` (term i to accumulator i % 4, then ((a0 + a1) + a2) + a3), rounded once."""
    terms = [first] + [table[ids[:, g].long()] for g, table in enumerate(tables)]
    acc = [torch.zeros_like(first, dtype=torch.float32) for _ in range(4)]
    for i, term in enumerate(terms):
        acc[i % 4] = acc[i % 4] + term.float()
    return (((acc[0] + acc[1]) + acc[2]) + acc[3]).to(first.dtype)


def qkv_attention_ref(x: torch.Tensor, norm_weight: torch.Tensor, qkv_weight: torch.Tensor,
                      q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos0: int,
                      tokens_per_row: int, eps: float, scale: float) -> torch.Tensor:
    """The eager attention half of a layer (contract of `code_predictor_attention.qkv_attention`):
    the cache [B, P, KVH, D] is read as B pages of P slots, one per batch row."""
    rows = x.shape[0]
    _, positions, _, d = k_cache.shape
    r = torch.arange(rows, device=x.device)
    batch_row, pos = r // tokens_per_row, pos0 + r % tokens_per_row  # [M] each
    q = qkv_rope_store_ref(x, norm_weight, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, pos,
                           batch_row * positions + pos, k_cache, v_cache, eps)  # [M, NH * D]
    out = paged_decode_attention_ref(q.view(rows, -1, d), k_cache, v_cache,
                                     batch_row[:, None].int(), (pos + 1).int(), scale)  # [M, NH, D]
    return out.reshape(rows, -1)
