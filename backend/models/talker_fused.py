"""The talker's decode forward (one token per row over the paged KV) through fused kernels.

Same contract and arithmetic (roundings) as the eager `DecoderStack.forward` under a
`DecodeContext` (models/layers.py), in 5 launches per layer instead of 14:

    1 talker_qkv.qkv_rope_store       RMSNorm + QKV GEMM + QK-norm + RoPE + K/V store (paged)
    2 talker_attention.decode_attention  paged decode attention, split-K and merge in one launch
    3 code_predictor.linear_residual  o_proj + residual
    4 code_predictor.norm_gate_up     RMSNorm + gate/up + SiLU * up
    5 code_predictor.linear_residual  down_proj + residual

and one final RMSNorm per forward: 28 x 5 + 1 = 141 launches for the 28-layer talker (eager: 11
kernels per layer besides the K/V store and paged attention's two, 28 x 14 + 1 = 393). Launches
3-5 are the code predictor's skinny GEMMs (kernels/code_predictor_linear.py). The residual
stream is carried whole (h = residual + product, rounded as the eager add), so the eager stack's
(x, residual) pair never appears.
Used by `Talker.forward` after `use_fused(max_batch)` for a `DecodeContext` when the kernels serve the
inputs' device (CUDA, or the Triton interpreter with Q3TTS_TRITON_ON_CPU=1); prefill stays eager.
The tickets' workspace grows outside CUDA graph capture only: warm up with the largest batch first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from q3tts import kernels
from q3tts.kernels import code_predictor as cpk
from q3tts.kernels.talker_attention import decode_attention
from q3tts.kernels.talker_qkv import qkv_rope_store
from q3tts.models.attention import DecodeContext

if TYPE_CHECKING:
    from q3tts.models.layers import DecoderLayer, DecoderStack

LAUNCHES_PER_LAYER = 5


class FusedTalker:
    """`forward(x, positions, ctx)` of a `DecoderStack` (the talker's `model`) for decode.

    Holds no weights of its own: it reads the stack's (fused q/k/v and gate/up buffers included) at
    every call, so `.to()` / `load_state_dict` on the module are seen."""

    def __init__(self, stack: DecoderStack):
        self.stack = stack
        self._counters: torch.Tensor | None = None
        self._stats: torch.Tensor | None = None  # the residual stream's row statistics [B, H / STAT_COLS]

    def serves(self, x: torch.Tensor) -> bool:
        """Whether the kernels run on x's device and the stack's residual stream is in the model dtype (their
        epilogues round it there: an fp32 stream, `DecoderStack.fp32_residual`, takes the eager stack)."""
        return kernels.use_triton(x) and not self.stack.fp32_residual

    def _workspace(self, batch: int, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernels' ticket counters (int32 zeros) for >= batch rows: one per (row block, output
        tile) of the widest GEMM, per (row block, kv head) of the QKV launch, per (row, kv head) of
        the attention; and the residual stream's row statistics (`cpk.linear_residual`)."""
        cfg = self.stack.cfg
        need = max(cpk.counters_needed(batch, max(cfg.hidden_size, cfg.intermediate_size)
                                       // cpk.MIN_BLOCK_N), batch * cfg.num_kv_heads)
        counters = self._counters
        if counters is None or counters.numel() < need or counters.device != ref.device:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"FusedTalker: new buffers for batch {batch} inside CUDA graph "
                                   f"capture: run the largest batch eagerly first")
            counters = self._counters = torch.zeros(need, dtype=torch.int32, device=ref.device)
            self._stats = cpk.row_stats_buffer(batch, cfg.hidden_size, ref.device)
        return counters, self._stats

    def _layer(self, layer: DecoderLayer, h: torch.Tensor, positions: torch.Tensor,
               rope: tuple[torch.Tensor, torch.Tensor], ctx: DecodeContext,
               counters: torch.Tensor, stats: torch.Tensor, h_stats: bool) -> torch.Tensor:
        """One decoder layer on the residual stream h [B, H] in LAUNCHES_PER_LAYER launches. Its residual
        launches write the stream's row statistics to stats, which its norms read, and the first norm when
        h_stats (h was made by the layer before)."""
        attn, mlp, cfg = layer.self_attn, layer.mlp, self.stack.cfg
        rows, i = h.shape[0], attn.layer_idx
        norm = layer.input_layernorm
        q = qkv_rope_store(h, norm.weight, attn.fused_weight(), attn.q_norm.weight,
                           attn.k_norm.weight, *rope, positions, ctx.slot_mapping,
                           ctx.cache.k[i], ctx.cache.v[i], norm.eps, counters,
                           stats=stats if h_stats else None)  # [B, NH * D]
        out = decode_attention(q.view(rows, cfg.num_heads, cfg.head_dim), ctx.cache.k[i],
                               ctx.cache.v[i], ctx.block_tables, ctx.context_lens, ctx.scale,
                               counters)  # [B, NH, D]
        h = cpk.linear_residual(out.view(rows, -1), attn.o_proj.weight, h, counters, stats=stats)
        norm = layer.post_attention_layernorm
        act = cpk.norm_gate_up(h, norm.weight, mlp.fused_weight(), norm.eps, counters, stats=stats)  # [B, I]
        return cpk.linear_residual(act, mlp.down_proj.weight, h, counters, stats=stats)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: DecodeContext
                ) -> torch.Tensor:
        """x [B, H] (one token per row) at positions [B], K/V to ctx's pages -> final-normed hidden
        [B, H]: the contract of `DecoderStack.forward` under a `DecodeContext`."""
        stack = self.stack
        assert isinstance(ctx, DecodeContext), f"FusedTalker: decode only, got {type(ctx).__name__}"
        counters, stats = self._workspace(x.shape[0], x)
        rope = stack.rope(x.device, x.dtype)  # cos, sin [max_pos, D]
        h = x
        for n, layer in enumerate(stack.layers):
            h = self._layer(layer, h, positions, rope, ctx, counters, stats, n > 0)
        return kernels.rms_norm(h, stack.norm.weight, stack.norm.eps)
