"""The code predictor's kernels: one code-predictor pass in 23 launches (4 per layer).

    project          input rows (or codec-embedding rows by id) @ small_to_mtp_projection + bias
    per layer (x5):
      qkv_attention  RMSNorm + QKV + QK-norm + RoPE + K/V cache write + attention (<= 16 positions)
      linear_residual o_proj + residual
      norm_gate_up   RMSNorm + gate/up + SiLU * up
      linear_residual down_proj + residual
    norm_head        final RMSNorm + lm_head[j] -> fp32 logits
    sample           the GREEDY / TOPK draw (the FULL mode stays with models/sampling.py)

Every GEMM is a split-K skinny GEMM whose last program per unit runs the epilogue
(code_predictor_gemm.py); the launch config is tuned per weight shape and row class (per weight
shape only under `set_batch_invariant(True)`).
Each kernel's torch reference is in code_predictor_reference.py (sampling: models/sampling.warp_and_draw_reference).
`counters` (int32 zeros, left zero by every launch) is the tickets' workspace: size it with
`counters_needed(rows, units)`, units = the largest output width / MIN_BLOCK_N.
"""

from __future__ import annotations

from .code_predictor_attention import qkv_attention
from .code_predictor_gemm import MIN_BLOCK_N, GemmConfig, counters_needed
from .code_predictor_linear import linear_residual, norm_gate_up, norm_head, project
from .code_predictor_sampling import sample

__all__ = ["GemmConfig", "MIN_BLOCK_N", "counters_needed", "linear_residual", "norm_gate_up",
           "norm_head", "project", "qkv_attention", "sample"]
