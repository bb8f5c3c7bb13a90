"""The code predictor's 15 passes through the fused kernels of `q3tts.kernels.code_predictor`.

Same contract and arithmetic as `CodePredictor.generate` (models/code_predictor.py), in far fewer
launches: the first pass projects its two input rows, then 4 launches per layer, the final norm + head
and the draw (23 for the 1.7B models; the 0.6B models have no projection); a later pass gathers its input
row by the last code's id inside its first layer's first launch (22), and one launch sums the talker's next
input. The 1.7B gathers from the codec embeddings through the projection, computed once per weights
(`_pass_tables`: 14 tables of [2048, Hc], 59 MB at bf16), each row summed in float64 and rounded once (the eager
projection sums in fp32 and rounds once: the two differ at most where an fp32 sum order would; no TF32 switch
reaches float64).
The K/V of a frame's 16 positions live in a small contiguous cache [layers, B, 16, KVH, D] (no pages).
Sampling: the sampler's (`warp_and_draw`: the GREEDY and TOPK modes in the sampling kernel).
Used by `CodePredictor.generate` after `use_fused(max_batch)` when the kernels serve the inputs' device
(CUDA, or the Triton interpreter with Q3TTS_TRITON_ON_CPU=1); otherwise the eager passes run.
Buffers grow, and the tables are projected, outside CUDA graph capture only: warm up with the largest batch first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

from q3tts import kernels
from q3tts.kernels import code_predictor as cpk
from q3tts.models.layers import refuse_in_capture
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
        self._projected: tuple[tuple, list[torch.Tensor]] | None = None  # (weights' identity, tables)

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

    def _input(self, counters: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rows x [N, H] through small_to_mtp_projection -> [N, Hc]."""
        proj = self.cp.small_to_mtp_projection
        if isinstance(proj, nn.Identity):
            return x
        return cpk.project(x, proj.weight, proj.bias, counters)

    def _pass_tables(self) -> list[torch.Tensor]:
        """The input table [V, Hc] of passes 1..14: codec_embedding[j - 1] through small_to_mtp_projection,
        each row summed in float64 and rounded once (kept while the weights are the same tensors, unmodified)."""
        tables = [e.weight for e in self.cp.model.codec_embedding[:-1]]
        proj = self.cp.small_to_mtp_projection
        if isinstance(proj, nn.Identity):
            return tables
        key = tuple((t.data_ptr(), t._version, t.dtype, t.device) for t in (proj.weight, proj.bias, *tables))
        if self._projected is None or self._projected[0] != key:
            refuse_in_capture("projecting the code predictor's input tables")
            self._projected = None  # the old tables go before the new ones are made
            with torch.no_grad():
                w, b = proj.weight.double(), proj.bias.double()
                self._projected = (key, [F.linear(t.double(), w, b).to(t.dtype) for t in tables])
        return self._projected[1]

    def _layer(self, layer: DecoderLayer, x: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, pos0: int, tokens: int, counters: torch.Tensor,
               rope: tuple[torch.Tensor, torch.Tensor], ids: torch.Tensor | None = None) -> torch.Tensor:
        """One decoder layer in 4 launches on the residual stream x [N, Hc], or with ids [N] on the rows ids of
        the table x [V, Hc]."""
        attn, mlp = layer.self_attn, layer.mlp
        norm = layer.input_layernorm
        h = x if ids is None else x.new_empty(ids.shape[0], x.shape[1])  # gathered by the first launch
        out = cpk.qkv_attention(x, norm.weight, attn.fused_weight(), attn.q_norm.weight,
                                attn.k_norm.weight, *rope, k_cache, v_cache, pos0, tokens,
                                norm.eps, self.cp.model.attn_scale, counters, ids=ids,
                                rows_out=None if ids is None else h)  # [N, NH * D]
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
        tables = self._pass_tables()
        e0 = self.cp._embed_c0(c0)  # [B, H]
        h = self._input(counters, torch.stack((past_hidden, e0), dim=1).reshape(2 * bsz, -1))
        codes = torch.empty(bsz, groups - 1, dtype=torch.int64, device=c0.device)
        for j in range(groups - 1):
            # pass 0: rows (b, past_hidden) and (b, c0) at positions 0, 1; pass j: c_j at j + 1, by id
            tokens, pos0 = (2, 0) if j == 0 else (1, j + 1)
            for i, layer in enumerate(model.layers):
                gather = j > 0 and i == 0
                h = self._layer(layer, tables[j - 1] if gather else h, k_cache[i], v_cache[i], pos0, tokens,
                                counters, rope, ids=codes[:, j - 1] if gather else None)
            logits = cpk.norm_head(h, model.norm.weight, self.cp.lm_head[j].weight,
                                   model.norm.eps, counters, tokens)  # [B, V] fp32
            sampler(logits, j + 1, out=codes[:, j])
        next_input = cpk.embed_sum(e0, tuple(e.weight for e in model.codec_embedding), codes)  # [B, H]
        return codes, next_input
