"""The code predictor's kernels: a frame's 15 passes in 23 launches for the first, 22 for each later one
(4 per layer), and one more for the talker's next input.

    project          input rows @ small_to_mtp_projection + bias (the first pass: past hidden, C(c0))
    per layer (x5):
      qkv_attention  RMSNorm + QKV + QK-norm + RoPE + K/V cache write + attention (<= 16 positions);
                     on the later passes' first layer its input rows are gathered by code id from a table
                     (the codec embedding, through the projection once per weights: models/code_predictor_fused.py)
      linear_residual o_proj + residual
      norm_gate_up   RMSNorm + gate/up + SiLU * up
      linear_residual down_proj + residual
    norm_head        final RMSNorm + lm_head[j] -> fp32 logits
    sample           the GREEDY / TOPK draw (the FULL mode stays with models/sampling.py)
    embed_sum        C(c0) + the 15 codes' embeddings: the talker's next input

Every GEMM is a split-K skinny GEMM whose last program per unit runs the epilogue
(code_predictor_gemm.py); the launch config is tuned per weight shape and row class (per weight
shape only under `set_batch_invariant(True)`).
Each kernel's torch reference is in code_predictor_reference.py (sampling: models/sampling.warp_and_draw_reference).
`counters` (int32 zeros, left zero by every launch) is the tickets' workspace: size it with
`counters_needed(rows, units)`, units = the largest output width / MIN_BLOCK_N.
`stats` (`row_stats_buffer`): the residual stream's row statistics, partial sums of squares that
linear_residual writes with its output and the next launch's RMSNorm reads instead of the rows (at 16 rows a
norm's programs read their rows whole: 32 MB from L2 in the talker's qkv launch, twice its weights). The
talker's fused layers use them (norm + gate_up, and its qkv launch, talker_qkv.py); the code predictor's passes
norm from their rows: with statistics its 15 passes at 16 rows took 3.47 ms against 3.16 on an H100
(perf/results/RESULTS.md, forty-second session).
"""

from __future__ import annotations

from .code_predictor_attention import qkv_attention
from .code_predictor_embed import embed_sum
from .code_predictor_gemm import MIN_BLOCK_N, STAT_COLS, GemmConfig, counters_needed, row_stats_buffer
from .code_predictor_linear import linear_residual, norm_gate_up, norm_head, project
from .code_predictor_sampling import sample

__all__ = ["GemmConfig", "MIN_BLOCK_N", "STAT_COLS", "counters_needed", "embed_sum", "linear_residual",
           "norm_gate_up", "norm_head", "project", "qkv_attention", "row_stats_buffer", "sample"]
