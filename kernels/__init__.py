"""Public kernel wrappers: the OpenAI Triton kernel for CUDA tensors, the torch reference otherwise.

Same signatures as `q3tts.kernels.reference` (plus the fused-residual / in-place options).
Dispatch: Triton when the tensor is on CUDA and triton imports (`Q3TTS_KERNELS=torch` forces the
reference), or on CPU when `TRITON_INTERPRET=1` and `Q3TTS_TRITON_ON_CPU=1` (tests, debugging).
Call `warmup(...)` once before CUDA-graph capture so that nothing compiles or tunes inside it.

Batch invariance (`set_batch_invariant(True)`, process-wide; off by default): a row's result then
depends neither on how many rows share a launch nor on what they hold. Per kernel:
  by construction  rms_norm (a row's statistics inside one program, tiles set by the feature dim), silu_mul,
                   apply_rotary (with its QK-norm) and store_kv (one program per token, no reduction
                   across tokens),
                   snake_beta (elementwise), rvq_sum and the code predictor's sample (one program per row),
                   scatter_rows (a copy),
                   prefill_attention (a program takes rows of one prompt only; key blocks start at
                   the prompt's first row, so a prompt's rows never see where it sits in the pack),
                   qkv_attention / talker_qkv (BLOCK_M 16, config per weight shape; attention over
                   the row's own positions or pages)
  under the switch the skinny GEMMs (project, linear_residual, norm_gate_up, norm_head, linear):
                   BLOCK_M 16 and the config per weight shape, where off a batch of 17+ rows takes
                   its row class's tiles and split count; paged_decode_attention and the talker's
                   decode attention: batch 1's split count of each row's context (off, it shrinks
                   as the batch grows); causal_conv1d: always the row-tiled Triton kernel (tiles
                   set by channels and length, one batch row per program), never cuDNN or the flat
                   tiling (its tiles span batch rows)

Programmatic dependent launch (`set_programmatic_launch(True)`, process-wide; off until set, which an engine does
from `EngineConfig.programmatic_launch`): the code predictor's and the fused talker's kernels start while the
kernel before them runs (kernels/_launch.py).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from . import reference
from ._launch import programmatic_launch, set_programmatic_launch
from .autotune import batch_invariant, set_batch_invariant
from .reference import PagedPrefix, QKNorm, interleave_phases

try:
    from . import code_predictor_linear as _cpl
    from . import conv1d as _cv
    from . import paged_attention as _pa
    from . import prefill_attention as _pf
    from . import ring_attention as _ra
    from . import rmsnorm as _rn
    from . import rotary as _rt
    from . import rvq as _rv
    from . import scatter as _sc
    from . import snake as _sn
    from . import store_kv as _kv
    from . import swiglu as _sw
    from . import splitmix as _un
    from .autotune import tuning as _tuning
    from .warmup import warmup as _warmup

    HAS_TRITON = True
except ImportError:  # CPU-only install without triton: the references serve every call
    HAS_TRITON = False

__all__ = ["HAS_TRITON", "PagedPrefix", "QKNorm", "apply_rotary", "batch_invariant", "causal_conv1d",
           "linear", "paged_decode_attention", "prefill_attention", "programmatic_launch", "ring_attention",
           "interleave_phases", "rms_norm", "conv_kernel_weight", "rvq_sum", "scatter_rows",
           "set_batch_invariant", "set_programmatic_launch", "silu_mul", "snake_beta", "store_kv", "tuning",
           "uniforms", "use_triton", "warmup"]


def use_triton(t: torch.Tensor) -> bool:
    """Whether a call on tensor `t` goes to the Triton kernel."""
    if not HAS_TRITON or os.environ.get("Q3TTS_KERNELS", "") == "torch":
        return False
    if t.is_cuda:
        return True
    return (os.environ.get("TRITON_INTERPRET", "0") == "1"
            and os.environ.get("Q3TTS_TRITON_ON_CPU", "0") == "1")


def uniforms(seeds: torch.Tensor, counters: torch.Tensor, lanes: int) -> torch.Tensor:
    """[B, lanes] float32 uniforms in [0, 1) from seeds, counters [B] int (`reference.uniforms_ref`'s bits)."""
    if use_triton(seeds):
        return _un.uniforms(seeds, counters, lanes)
    return reference.uniforms_ref(seeds, counters, lanes)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in weight.dtype, rounded as F.linear (the
    reference) rounds it; any M, N a multiple of 16. Its launch config depends on M only through
    the row class, and not at all under `batch_invariant()`. See code_predictor_linear.py."""
    if use_triton(x):
        return _cpl.linear(x, weight, bias)
    return F.linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """RMSNorm over the last dim of x [..., D] (weight [D]); with residual (x.dtype or float32), returns
    (rms_norm(x + residual), x + residual). See kernels/rmsnorm.py."""
    if use_triton(x):
        return _rn.rms_norm(x, weight, eps, residual)
    if residual is None:
        return reference.rms_norm_ref(x, weight, eps)
    return reference.add_rms_norm_ref(x, residual, weight, eps)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, inplace: bool = False, norm: QKNorm | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """rotate_half RoPE of q [N, NH, D], k [N, KVH, D] at positions [N] from cos/sin tables
    [max_pos, D], after their QK-norm when `norm` is given (one launch); returns (q_rot, k_rot) (q and k
    themselves when inplace). See kernels/rotary.py."""
    if use_triton(q):
        return _rt.apply_rotary(q, k, positions, cos, sin, inplace, norm)
    q_rot, k_rot = reference.apply_rotary_ref(q, k, positions, cos, sin, norm)
    if not inplace:
        return q_rot, k_rot
    q.copy_(q_rot)
    k.copy_(k_rot)
    return q, k


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate: x [..., 2I] = gate | up -> silu(gate) * up [..., I] in one pass. See kernels/swiglu.py."""
    if use_triton(x):
        return _sw.silu_mul(x)
    return reference.silu_mul_ref(x)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter k, v [N, KVH, D] into the paged caches by slot_mapping [N] (-1 = skip)."""
    if use_triton(k):
        return _kv.store_kv(k, v, k_cache, v_cache, slot_mapping)
    return reference.store_kv_ref(k, v, k_cache, v_cache, slot_mapping)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """Decode attention of q [B, NH, D] over paged caches [num_pages, page_size, KVH, D] via
    block_tables [B, max_pages] int32 and context_lens [B] int32 -> [B, NH, D]."""
    if use_triton(q):
        return _pa.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
    return reference.paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens,
                                                scale)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_ring: torch.Tensor, v_ring: torch.Tensor,
                   rows: torch.Tensor, pos: torch.Tensor, scale: float) -> torch.Tensor:
    """One frame's attention per stream: q [B, H, D] at positions pos [B] over the rings k_ring / v_ring
    [N, W, KVH, D] at rows [B] (position p in ring row p % W; W = the window) after writing k, v [B, KVH, D]
    into ring row pos % W -> [B, H, D]. See kernels/ring_attention.py."""
    if use_triton(q):
        return _ra.ring_attention(q, k, v, k_ring, v_ring, rows, pos, scale)
    return reference.ring_attention_ref(q, k, v, k_ring, v_ring, rows, pos, scale)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                      scale: float, prefix: PagedPrefix | None = None) -> torch.Tensor:
    """Causal attention of q [T, NH, D] over k, v [T, KVH, D] within each packed sequence
    (cu_seqlens [S+1]; rows >= cu_seqlens[S] are padding, never written by the kernel) -> [T, NH, D];
    prefix: sequence 0's earlier keys in a paged cache (chunked prefill). See kernels/prefill_attention.py."""
    if use_triton(q):
        return _pf.prefill_attention(q, k, v, cu_seqlens, scale, prefix=prefix)
    return reference.prefill_attention_ref(q, k, v, cu_seqlens, scale, prefix)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dilation: int = 1,
                  residual: torch.Tensor | None = None, weight_oik: torch.Tensor | None = None,
                  history: torch.Tensor | None = None, snake: tuple[torch.Tensor, torch.Tensor] | None = None,
                  keep_conv: bool = False, phases: int = 1) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Valid conv1d of x [B, C_in, L] (history included), weight [C_out, C_in, K], bias [C_out] or None
    -> [B, C_out, L - (K-1)·dilation] (+ residual); weight_oik: `conv_kernel_weight(weight)`, optional.
    history [B, C_in, (K-1)·dilation]: the samples before x (then new samples only): the conv of
    cat(history, x) -> [B, C_out, L], the same bits, without the cat on the kernel path.
    snake (alpha, beta) [C_out]: `snake_beta` of that output instead (keep_conv: (output, snake)), on the kernel
    path made in the conv's epilogue. phases: channel o·phases + r is phase r of output channel o, interleaved in
    time -> [B, C_out / phases, L'·phases] (a transposed conv). See kernels/conv1d.py."""
    if use_triton(x):
        return _cv.causal_conv1d(x, weight, bias, dilation, residual, weight_oik, history=history, snake=snake,
                                 keep_conv=keep_conv, phases=phases)
    if history is not None:
        x = torch.cat([history, x], dim=-1)
    out = reference.interleave_phases(reference.causal_conv1d_ref(x, weight, bias, dilation, residual), phases)
    if snake is None:
        return out
    act = reference.snake_beta_ref(out, *snake)
    return (out, act) if keep_conv else act


def conv_kernel_weight(weight: torch.Tensor) -> torch.Tensor:
    """The conv kernel's weight layout (input channels fastest) for `causal_conv1d(weight_oik=...)`."""
    return weight.detach().permute(2, 0, 1).contiguous().permute(1, 2, 0)


def tuning():
    """Context in which shape-specialised kernel choices are timed (wrap CUDA-graph warm-ups in it)."""
    if not HAS_TRITON:
        return contextlib.nullcontext()
    return _tuning()


def rvq_sum(codes: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """A residual VQ's codebook lookups summed: codes [B, n, T], tables [n, size, dim] -> [B, T, dim], each add
    rounded as torch rounds it (one launch on the kernel path). See kernels/rvq.py."""
    if use_triton(tables):
        return _rv.rvq_sum(codes, tables)
    return reference.rvq_sum_ref(codes, tables)


def scatter_rows(dsts: Sequence[torch.Tensor], rows: torch.Tensor, srcs: Sequence[torch.Tensor]) -> None:
    """dsts[i][rows[b]] = srcs[i][b] for each pair (dsts[i] [S, ...], srcs[i] [B, ...], rows of at most 2 dims, one
    dtype): one launch on the kernel path, one `index_copy_` a pair on the reference's. See kernels/scatter.py."""
    if use_triton(dsts[0]):
        return _sc.scatter_rows(dsts, rows, srcs)
    return reference.scatter_rows_ref(dsts, rows, srcs)


def snake_beta(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor, channels_last: bool = False) -> torch.Tensor:
    """SnakeBeta of x [B, C, T] with log-parameters alpha, beta [C]; `channels_last`: the kernel stores it [B, T, C]
    (a view is returned; the reference's layout is torch's). See kernels/snake.py."""
    if use_triton(x):
        return _sn.snake_beta(x, alpha, beta, channels_last)
    return reference.snake_beta_ref(x, alpha, beta)


def warmup(*, num_heads: int, num_kv_heads: int, head_dim: int, hidden_sizes, page_size: int,
           dtype: torch.dtype, device="cuda", max_pages: int = 4, batch_sizes=(1,),
           intermediate_sizes=()) -> None:
    """Compile and tune every kernel key before CUDA-graph capture (see kernels/warmup.py); no-op
    when the kernels would not be used on `device`."""
    probe = torch.empty(0, device=device)
    if not use_triton(probe):
        return
    _warmup(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            hidden_sizes=hidden_sizes, page_size=page_size, dtype=dtype, device=device,
            max_pages=max_pages, batch_sizes=batch_sizes, intermediate_sizes=intermediate_sizes)
