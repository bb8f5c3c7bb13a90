"""`warmup()`: compile every kernel variant the model uses and tune the shape-class keys, before capture.

A CUDA graph must neither compile nor time anything while it is captured, and the capture's own warm-up runs
on padding rows (empty contexts), on which timing paged attention would pick a config at random. This runs
each kernel once per specialisation on real-sized data instead: RMSNorm per feature dim (with and without
the fused residual), the SwiGLU gate per intermediate size, QK-norm + RoPE and the KV store per index dtype,
and paged decode attention over distinct pages (the call that tunes its launch config).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .paged_attention import paged_decode_attention
from .reference import QKNorm
from .rmsnorm import rms_norm
from .rotary import apply_rotary
from .store_kv import store_kv
from .swiglu import silu_mul


def warmup(*, num_heads: int, num_kv_heads: int, head_dim: int, hidden_sizes: Sequence[int],
           page_size: int, dtype: torch.dtype, device: torch.device | str = "cuda",
           max_pages: int = 4, batch_sizes: Sequence[int] = (1,),
           intermediate_sizes: Sequence[int] = ()) -> None:
    """Compile (and tune) every kernel variant the model uses; call before CUDA-graph capture.

    hidden_sizes: every feature dim RMSNorm runs on (e.g. (2048, 1024) for talker + code predictor; the
    QK-norm over head_dim runs inside the RoPE kernel); intermediate_sizes: the MLPs' (the SwiGLU gate).
    max_pages: block-table width of the decode step (the split count of paged attention depends on it).
    batch_sizes only pick which split counts are exercised; the kernels themselves are specialised on
    none of them.
    """
    device = torch.device(device)
    _warm_norms(hidden_sizes, dtype, device)
    for inter in intermediate_sizes:
        silu_mul(torch.randn(2, 2 * inter, dtype=dtype, device=device))
    q = torch.randn(2, num_heads, head_dim, dtype=dtype, device=device)  # [2, NH, D]
    k = torch.randn(2, num_kv_heads, head_dim, dtype=dtype, device=device)  # [2, KVH, D]
    _warm_qk_norm_rope_store(q, k, page_size, max_pages)
    _tune_paged_attention(num_heads, num_kv_heads, head_dim, page_size, max_pages, batch_sizes,
                          dtype, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _warm_norms(dims: Sequence[int], dtype: torch.dtype, device: torch.device) -> None:
    """RMSNorm of [2, dim] rows, alone and with the fused residual add, for every dim."""
    for dim in dims:
        w = torch.ones(dim, dtype=dtype, device=device)
        x = torch.randn(2, dim, dtype=dtype, device=device)
        rms_norm(x, w, 1e-6)
        rms_norm(x, w, 1e-6, residual=x)


def _warm_qk_norm_rope_store(q: torch.Tensor, k: torch.Tensor, page_size: int, max_pages: int) -> None:
    """QK-norm + RoPE of q [N, NH, D] and k [N, KVH, D] (the layers' one call) and the KV store, with
    positions / slot mappings of both index dtypes the callers pass."""
    head_dim = q.shape[-1]
    w = torch.ones(head_dim, dtype=q.dtype, device=q.device)
    table = torch.randn(8, head_dim, dtype=q.dtype, device=q.device)  # cos / sin [max_pos, D]
    cache = torch.zeros(max_pages * 2, page_size, *k.shape[1:], dtype=q.dtype, device=q.device)
    for index_dtype in (torch.int32, torch.int64):
        pos = torch.zeros(q.shape[0], dtype=index_dtype, device=q.device)
        apply_rotary(q, k, pos, table, table, norm=QKNorm(w, w, 1e-6))
        slots = torch.tensor([0, -1], dtype=index_dtype, device=q.device)
        store_kv(k, k, cache, cache.clone(), slots)


def _tune_paged_attention(num_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                          max_pages: int, batch_sizes: Sequence[int], dtype: torch.dtype,
                          device: torch.device) -> None:
    """Paged decode attention over distinct pages: the first call on CUDA times the launch configs over
    `tuning_context` keys a row (on empty contexts they would all measure the same), then one call per
    batch size."""
    tune_rows = 8 if device.type == "cuda" else 1
    pages = torch.randn(tune_rows * max_pages, page_size, num_kv_heads, head_dim, dtype=dtype,
                        device=device)  # [rows * P, page, KVH, D]
    for bsz in (tune_rows, *batch_sizes):
        q = torch.randn(bsz, num_heads, head_dim, dtype=dtype, device=device)
        tables = torch.arange(bsz * max_pages, dtype=torch.int32, device=device)
        tables = (tables % pages.shape[0]).view(bsz, max_pages)  # [B, P]
        lens = torch.full((bsz,), tuning_context(max_pages * page_size), dtype=torch.int32, device=device)
        paged_decode_attention(q, pages, pages, tables, lens, head_dim ** -0.5)


TUNING_KEYS = 256  # a row's context while tuning: ~17 s of audio (12.5 frames/s) after its prompt


def tuning_context(width: int) -> int:
    """Keys a row holds while paged attention is tuned for block tables of `width` keys: the typical serving
    context, not the table's worst case (10,240 keys by default, which no step of a short utterance comes near). The
    pick matters: two engines tuned over full 304-key tables took 128- and 32-key blocks, and on the step's short
    contexts at 64 rows the first cost 20.9 us a launch against 12.4 (H200). A one-page table (the code
    predictor's 16 keys) is tuned full."""
    return min(width, TUNING_KEYS)
