"""The code predictor's 15 passes through the fused kernels of `q3tts.kernels.code_predictor`.

Same contract and arithmetic as `CodePredictor.generate` (models/code_predictor.py), in far fewer
launches: per pass the input projection, 4 launches per layer, the final norm + head and the draw
(23 for the 1.7B models; the 0.6B models have no projection: an embedding lookup instead). The
K/V of a frame's 16 positions live in a small contiguous cache [layers, B, 16, KVH, D] (no pages).
Sampling: the sampler's (`warp_and_draw`: the GREEDY and TOPK modes in the sampling kernel).
Used by `CodePredictor.generate` after `use_fused(max_batch)` when the kernels serve the inputs' device
(CUDA, or the Triton interpreter with Q3TTS_TRITON_ON_CPU=1); otherwise the eager passes run.
Buffers grow outside CUDA graph capture only: warm up with the largest batch first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

from q3tts import kernels
from q3tts.kernels import code_predictor as cpk
from q3tts.models.sampling import SubtalkerSampler

if TYPE_CHECKING:
    from q3tts.models.code_predictor import CodePredictor
    from q3tts.models.layers import DecoderLayer


class FusedCodePredictor:
    """`generate(past_hidden, c0, sampler)` of a `CodePredictor` through the fused kernels.

    Holds no weights of its own: it reads the module's (fused q/k/v and gate/up buffers included)
    at every call, so `.to()` / `load_state_dict` on the module are seen."""

    def __init__(self, code_predictor: CodePredictor):
        self.cp = code_predictor
        self._kv: tuple[torch.Tensor, torch.Tensor] | None = None  # [L, B, P, KVH, D] each
        self._counters: torch.Tensor | None = None

    def serves(self, x: torch.Tensor) -> bool:
        """Whether the kernels run on x's device and the stack's residual stream is in the model dtype (their
        epilogues round it there: an fp32 stream, `DecoderStack.fp32_residual`, takes the eager passes)."""
        return kernels.use_triton(x) and not self.cp.model.fp32_residual

    def _workspace(self, batch: int, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                 torch.Tensor]:
        """K/V caches for >= batch rows and the kernels' ticket counters (int32 zeros)."""
        cfg = self.cp.model.cfg
        kv = self._kv
        if kv is None or kv[0].shape[1] < batch or kv[0].dtype != ref.dtype \
                or kv[0].device != ref.device:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"FusedCodePredictor: new buffers for batch {batch} inside CUDA "
                                   f"graph capture: run the largest batch eagerly first")
            shape = (cfg.num_layers, batch, self.cp.num_groups, cfg.num_kv_heads, cfg.head_dim)
            kv = self._kv = (torch.zeros(shape, dtype=ref.dtype, device=ref.device),
                             torch.zeros(shape, dtype=ref.dtype, device=ref.device))
            # one ticket per (row block, output tile) of the widest GEMM, or per kv head
            widths = (cfg.hidden_size, cfg.intermediate_size, self.cp.lm_head[0].out_features)
            units = max(max(widths) // cpk.MIN_BLOCK_N, cfg.num_kv_heads)
            need = cpk.counters_needed(2 * batch, units)  # pass 0 runs 2 rows per batch row
            self._counters = torch.zeros(need, dtype=torch.int32, device=ref.device)
        return kv[0], kv[1], self._counters

    def _input(self, counters: torch.Tensor, x: torch.Tensor,
               ids: torch.Tensor | None = None) -> torch.Tensor:
        """Rows x [N, H] (or table x's rows ids [N]) through small_to_mtp_projection -> [N, Hc]."""
        proj = self.cp.small_to_mtp_projection
        if isinstance(proj, nn.Identity):
            return x if ids is None else F.embedding(ids, x)
        return cpk.project(x, proj.weight, proj.bias, counters, ids=ids)

    def _layer(self, layer: DecoderLayer, h: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, pos0: int, tokens: int, counters: torch.Tensor,
               rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """One decoder layer on the residual stream h [N, Hc] in 4 launches."""
        attn, mlp = layer.self_attn, layer.mlp
        norm = layer.input_layernorm
        out = cpk.qkv_attention(h, norm.weight, attn.fused_weight(), attn.q_norm.weight,
                                attn.k_norm.weight, *rope, k_cache, v_cache, pos0, tokens,
                                norm.eps, self.cp.model.attn_scale, counters)  # [N, NH * D]
        h = cpk.linear_residual(out, attn.o_proj.weight, h, counters)
        norm = layer.post_attention_layernorm
        act = cpk.norm_gate_up(h, norm.weight, mlp.fused_weight(), norm.eps, counters)  # [N, I]
        return cpk.linear_residual(act, mlp.down_proj.weight, h, counters)

    def generate(self, past_hidden: torch.Tensor, c0: torch.Tensor, sampler: SubtalkerSampler
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """past_hidden [B, H], c0 [B] -> codes [B, 15] int64 (c1..c15), next_input [B, H]: the
        contract of `CodePredictor.generate`."""
        model = self.cp.model
        bsz, groups = c0.shape[0], self.cp.num_groups
        k_cache, v_cache, counters = self._workspace(bsz, past_hidden)
        rope = model.rope(past_hidden.device, past_hidden.dtype)  # cos, sin [P, D]
        e0 = self.cp._embed_c0(c0)  # [B, H]
        h = self._input(counters, torch.stack((past_hidden, e0), dim=1).reshape(2 * bsz, -1))
        codes = torch.empty(bsz, groups - 1, dtype=torch.int64, device=c0.device)
        for j in range(groups - 1):
            # pass 0: rows (b, past_hidden) and (b, c0) at positions 0, 1; pass j: c_j at j + 1
            tokens, pos0 = (2, 0) if j == 0 else (1, j + 1)
            if j > 0:
                h = self._input(counters, model.codec_embedding[j - 1].weight, codes[:, j - 1])
            for i, layer in enumerate(model.layers):
                h = self._layer(layer, h, k_cache[i], v_cache[i], pos0, tokens, counters, rope)
            logits = cpk.norm_head(h, model.norm.weight, self.cp.lm_head[j].weight,
                                   model.norm.eps, counters, tokens)  # [B, V] fp32
            sampler(logits, j + 1, out=codes[:, j])
        embeds = [e0] + [model.codec_embedding[g](codes[:, g]) for g in range(groups - 1)]
        return codes, torch.stack(embeds, dim=1).sum(1)  # [B, 16, H] -> [B, H]
