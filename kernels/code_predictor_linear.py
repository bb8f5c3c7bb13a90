"""The code predictor's plain skinny GEMMs, one launch each (see code_predictor_gemm.py):

    project        out = X @ W^T + b (the first pass's input projection)
    linear_residual out = residual + X @ W^T          (o-proj + residual, down + residual)
    norm_gate_up   out = silu(g) * u, [g | u] = RMSNorm(X) @ W_gate_up^T   (one weight tile holds
                   gate row j and up row j side by side, so one dot feeds both halves)
    norm_head      logits = (RMSNorm(X[T-1::T]) @ W^T) as fp32 (final norm + lm_head)
    linear         out = X @ W^T (+ b), any M, one K slice (F.linear for the engine's GEMMs)

Roundings are the eager model's: each GEMM result rounds to the weight dtype before the residual add
/ SiLU / the fp32 logits; the bias joins before that rounding (as cuBLAS adds it).
Launch configs: `select_config` (per weight shape and row class; per weight shape only under
`autotune.batch_invariant()`).
"""

from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

from ._cast import cast
from ._launch import device_guard
from .autotune import batch_invariant, choose, pick
from .code_predictor_gemm import (BLOCK_M, FEW_ROWS, MIN_BLOCK_N, NORM, PLAIN, GemmConfig,
                                  interpret_config, arrive, candidates, counters_needed, dot_precision, few_rows,
                                  held_launch, held_rows, held_rstd, k_slice, load_sum, mainloop, row_blocks,
                                  row_class, row_offsets, check_stats, stats_width, store_partial, store_stats,
                                  weights_before_wait)
from .swiglu import silu_times

BIAS, RESIDUAL, SWIGLU, ROUND = 0, 1, 2, 3  # epilogues (ROUND: the product in the weight dtype)
_PROLOGUE_NAMES = {PLAIN: "plain", NORM: "norm"}  # in tuning keys
_EPILOGUE_NAMES = {BIAS: "bias", RESIDUAL: "residual", SWIGLU: "swiglu", ROUND: "round"}


@triton.jit
def _epilogue(acc, rows, row_mask, tile, b_ptr, res_ptr, out_ptr, st_ptr, stride_res, stride_out, stride_st,
              DT: tl.constexpr, EPILOGUE: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, STATS: tl.constexpr):
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    r64 = rows.to(tl.int64)
    if EPILOGUE == 2:  # acc columns interleave (gate j, up j)
        gate, up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
        y = silu_times(cast(gate, DT).to(tl.float32), cast(up, DT).to(tl.float32), DT)
    elif EPILOGUE == 0:
        y = acc + tl.load(b_ptr + cols).to(tl.float32)[None, :]
    elif EPILOGUE == 1:
        res = tl.load(res_ptr + r64[:, None] * stride_res + cols[None, :], mask=row_mask[:, None],
                      other=0.0)
        y = cast(acc, DT).to(tl.float32) + res.to(tl.float32)
    else:
        y = cast(acc, DT).to(tl.float32)
    y = cast(y, out_ptr.dtype.element_ty)
    tl.store(out_ptr + r64[:, None] * stride_out + cols[None, :], y, mask=row_mask[:, None])
    if (STATS > 0) and (EPILOGUE == 1):
        store_stats(st_ptr, y.to(tl.float32), rows, row_mask, tile, stride_st, BLOCK_M, BLOCK_N)


@triton.jit(do_not_specialize=["M", "row_step", "row_first", "M_PAD"])
def _linear_kernel(
    # pointers
    x_ptr, nw_ptr, w_ptr, b_ptr, res_ptr, out_ptr, part_ptr, cnt_ptr, st_ptr,
    # sizes
    M, N, K, row_step, row_first, eps, M_PAD,
    # strides
    stride_xm, stride_w, stride_res, stride_out, stride_st,
    # meta
    PROLOGUE: tl.constexpr, EPILOGUE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, ROWS: tl.constexpr, HOLD: tl.constexpr, STATS: tl.constexpr,
):
    """STATS > 0 (`stats_width`): the NORM prologue reads X's row statistics at st_ptr, or the RESIDUAL
    epilogue writes its output's there (`store_stats`)."""
    m, tile, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if EPILOGUE == 2:  # weight tile rows: gate j, up j, gate j+1, ...
        W_TILE: tl.constexpr = 2 * BLOCK_N
        j = tl.arange(0, W_TILE)
        w_rows = tile * BLOCK_N + j // 2 + (j % 2) * N
    else:
        W_TILE: tl.constexpr = BLOCK_N
        w_rows = tile * BLOCK_N + tl.arange(0, W_TILE)
    w_off = w_rows.to(tl.int64) * stride_w
    k_lo, k_hi = k_slice(split, K, SPLIT, BLOCK_K)
    held = weights_before_wait(w_ptr, w_off, k_lo, k_hi, HOLD)
    rows = m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    x_off = row_offsets(x_ptr, x_ptr, rows, row_mask, row_step, row_first, stride_xm, 0, PROLOGUE)
    if PROLOGUE == 2:  # ROWS: the rows its statistics hold (`held_rows`)
        rstd = held_rstd(x_ptr, x_ptr, st_ptr, x_off, row_mask, m, M, K, eps, row_step, row_first, stride_xm, 0,
                         stride_st, PROLOGUE, BLOCK_M, ROWS, STATS)
    else:
        rstd = tl.zeros([BLOCK_M], tl.float32)
    acc = mainloop(x_ptr, x_off, row_mask, w_ptr, w_off, k_lo, k_hi, nw_ptr, rstd, held, PROLOGUE, BLOCK_M,
                   W_TILE, BLOCK_K, DOT_PRECISION, HOLD)
    DT: tl.constexpr = w_ptr.dtype.element_ty
    if SPLIT > 1:
        cols = tile * W_TILE + tl.arange(0, W_TILE)
        num_cols = tl.num_programs(1) * W_TILE
        store_partial(part_ptr, acc, split, rows, row_mask, cols, M_PAD, num_cols)
        if arrive(cnt_ptr + m * tl.num_programs(1) + tile, SPLIT):
            _epilogue(load_sum(part_ptr, rows, row_mask, cols, M_PAD, num_cols, SPLIT), rows,
                      row_mask, tile, b_ptr, res_ptr, out_ptr, st_ptr, stride_res, stride_out, stride_st, DT,
                      EPILOGUE, BLOCK_M, BLOCK_N, STATS)
    else:
        _epilogue(acc, rows, row_mask, tile, b_ptr, res_ptr, out_ptr, st_ptr, stride_res, stride_out, stride_st,
                  DT, EPILOGUE, BLOCK_M, BLOCK_N, STATS)


def _launch(cfg: GemmConfig, *, x, w, out, counters, prologue, epilogue, rows, n, norm_w=None, bias=None,
            residual=None, row_step=1, row_first=0, eps=0.0, stats=None) -> None:
    tiles = n // cfg.block_n
    m_pad = row_blocks(rows, cfg.block_m) * cfg.block_m
    w_tile = cfg.block_n * (2 if epilogue == SWIGLU else 1)
    part = out
    if cfg.split > 1:
        part = torch.empty(cfg.split, m_pad, tiles * w_tile, dtype=torch.float32, device=x.device)
        assert counters is not None and counters.dtype == torch.int32, \
            "counters must be int32 zeros for a split-K config"
        assert counters.numel() >= counters_needed(rows, tiles, cfg.block_m), "counters too small"
    cnt = counters if counters is not None else out  # never read with one K slice
    _linear_kernel[(row_blocks(rows, cfg.block_m), tiles, cfg.split)](
        x, norm_w if norm_w is not None else w, w,
        bias if bias is not None else w, residual if residual is not None else out, out, part,
        cnt, stats if stats is not None else out,
        rows, n, w.shape[1], row_step, row_first, eps, m_pad,
        x.stride(0), w.stride(0),
        residual.stride(0) if residual is not None else 0, out.stride(0),
        stats.stride(0) if stats is not None else 0,
        PROLOGUE=prologue, EPILOGUE=epilogue, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, SPLIT=cfg.split, DOT_PRECISION=dot_precision(w.dtype),
        ROWS=held_rows(rows, cfg.block_m) if prologue == NORM else cfg.block_m,
        STATS=0 if stats is None else stats_width(w.shape[1] if prologue == NORM else n),
        **held_launch(cfg, w_tile, w.shape[1], w),
    )


def tuning_key(name: str, weight: torch.Tensor, n: int, rows: int) -> tuple:
    """The tuning-cache key of a launch of `name` on `weight` with n output columns and `rows` rows:
    (name, N, K, dtype, row class); the class is BLOCK_M's for every M under batch_invariant(), else FEW_ROWS for a
    launch that holds only its rows (`few_rows`) and `row_class(rows)` above."""
    rc = FEW_ROWS if few_rows(rows) else BLOCK_M if batch_invariant() else row_class(rows)
    return name, n, weight.shape[1], weight.dtype, rc


def select_config(name: str, weight: torch.Tensor, n: int, rows: int,
                  launch: Callable[[GemmConfig, int], None], split_k: bool = True) -> GemmConfig:
    """The launch config of `name` for `rows` rows; launch(cfg, m) runs it on the first m rows.

    The row class 16 config is tuned per weight shape at its first call on CUDA, on one row block
    (the batch-1 shape), whatever batch comes first; it serves every M under batch_invariant().
    Otherwise another row class (one row, or 17+) takes its own config, tuned (among the class's candidates and
    the class-16 config) only inside `autotune.tuning()` (the CUDA-graph warm-up of each bucket),
    on the call's rows; untuned, the class-16 config."""
    fits = lambda bn: n // bn if n % bn == 0 else None  # noqa: E731
    k, device = weight.shape[1], weight.device
    base = pick(tuning_key(name, weight, n, BLOCK_M), candidates(fits, k, device, BLOCK_M, split_k),
                lambda c: launch(c, min(rows, BLOCK_M)), device)
    key = tuning_key(name, weight, n, rows)
    if key[-1] == BLOCK_M:
        return base
    return choose(key, [base, *(c for c in candidates(fits, k, device, key[-1], split_k) if c != base)],
                  lambda c: launch(c, rows), device, default=base)


def _run(name: str, config: GemmConfig | None, split_k: bool = True, **kw) -> None:
    """Launch with `config`, else `select_config`'s (the interpreter's off CUDA)."""
    x, w, n = kw["x"], kw["w"], kw["n"]
    for label, t in (("x", x), ("weight", w), ("out", kw["out"])):
        assert t.stride(-1) == 1, f"{name}: {label} last dim must be contiguous"
        assert t.device == w.device, f"{name}: {label} on {t.device}, weight on {w.device}"
    assert x.dtype == w.dtype, f"{name}: x {x.dtype} and weight {w.dtype} differ"
    assert kw["counters"] is None or kw["counters"].dtype == torch.int32, \
        f"{name}: counters must be int32 (zeros)"
    if kw["rows"] == 0:
        return
    with device_guard(w):
        if config is None and w.is_cuda:
            # NOTE: one tuning key per kernel variant: a wrapper that runs two (linear with and
            # without bias) must not hand a row class's pick for one to the other, a compile its
            # warm-up may never have made
            variant = f"{name}/{_PROLOGUE_NAMES[kw['prologue']]}+{_EPILOGUE_NAMES[kw['epilogue']]}"
            config = select_config(variant, w, n, kw["rows"],
                                   lambda c, m: _launch(c, **dict(kw, rows=m)), split_k)
        config = config or interpret_config(n)
        assert n % config.block_n == 0, f"{name}: {n} columns not a multiple of {config.block_n}"
        assert split_k or config.split == 1, f"{name}: takes one K slice, config has {config.split}"
        _launch(config, **kw)


def _out(out, rows: int, cols: int, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if out is None:
        return torch.empty(rows, cols, dtype=dtype, device=like.device)
    assert out.shape == (rows, cols) and out.dtype == dtype, \
        f"out {tuple(out.shape)}/{out.dtype} != ({rows}, {cols})/{dtype}"
    return out


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, counters: torch.Tensor,
            out: torch.Tensor | None = None, config: GemmConfig | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T + bias [N] -> [M, N] in weight.dtype.
    counters: int32 zeros, >= counters_needed(M, N // 16) (left zero)."""
    rows = x.shape[0]
    assert x.shape[1] == weight.shape[1] and bias.shape == (weight.shape[0],), \
        f"project: x {tuple(x.shape)}, weight {tuple(weight.shape)}, bias {tuple(bias.shape)}"
    out = _out(out, rows, weight.shape[0], x, weight.dtype)
    _run("cp_project", config, x=x, w=weight, out=out, counters=counters,
         prologue=PLAIN, epilogue=BIAS, rows=rows, n=weight.shape[0], bias=bias)
    return out


def linear_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                    counters: torch.Tensor, out: torch.Tensor | None = None,
                    config: GemmConfig | None = None, stats: torch.Tensor | None = None) -> torch.Tensor:
    """residual [M, N] + x [M, K] @ weight [N, K]^T (the product rounded to weight.dtype first).
    stats (`check_stats`): where the output's row statistics go, for the norm of the next launch."""
    rows, n = x.shape[0], weight.shape[0]
    assert x.shape[1] == weight.shape[1] and residual.shape == (rows, n), \
        f"linear_residual: x {tuple(x.shape)}, weight {tuple(weight.shape)}, " \
        f"residual {tuple(residual.shape)}"
    assert residual.stride(-1) == 1, "linear_residual: residual last dim must be contiguous"
    out = _out(out, rows, n, x, weight.dtype)
    if stats is not None:
        check_stats(stats, rows, n, x)
    _run("cp_linear_residual", config, x=x, w=weight, out=out, counters=counters,
         prologue=PLAIN, epilogue=RESIDUAL, rows=rows, n=n, residual=residual, stats=stats)
    return out


def norm_gate_up(x: torch.Tensor, norm_weight: torch.Tensor, gate_up_weight: torch.Tensor,
                 eps: float, counters: torch.Tensor, out: torch.Tensor | None = None,
                 config: GemmConfig | None = None, stats: torch.Tensor | None = None) -> torch.Tensor:
    """silu(g) * u with [g | u] = rms_norm(x [M, K]) @ gate_up_weight [2I, K]^T -> [M, I].
    stats: x's row statistics (`linear_residual`'s), read instead of x's rows for the norm."""
    rows, inter = x.shape[0], gate_up_weight.shape[0] // 2
    assert gate_up_weight.shape == (2 * inter, x.shape[1]) and norm_weight.shape == (x.shape[1],), \
        f"norm_gate_up: x {tuple(x.shape)}, gate_up {tuple(gate_up_weight.shape)}, " \
        f"norm {tuple(norm_weight.shape)}"
    out = _out(out, rows, inter, x, gate_up_weight.dtype)
    if stats is not None:
        check_stats(stats, rows, x.shape[1], x)
    _run("cp_norm_gate_up", config, x=x, w=gate_up_weight, out=out, counters=counters,
         prologue=NORM, epilogue=SWIGLU, rows=rows, n=inter, norm_w=norm_weight, eps=eps, stats=stats)
    return out


def norm_head(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, eps: float,
              counters: torch.Tensor, tokens_per_row: int = 1, out: torch.Tensor | None = None,
              config: GemmConfig | None = None) -> torch.Tensor:
    """fp32 logits [M // T, V] of rms_norm(x[T-1::T]) @ weight [V, K]^T (rounded to weight.dtype
    first, as the eager head), T = tokens_per_row: the last token of each batch row."""
    t = tokens_per_row
    assert x.shape[0] % t == 0, f"norm_head: {x.shape[0]} rows not a multiple of {t} tokens"
    assert x.shape[1] == weight.shape[1] and norm_weight.shape == (x.shape[1],), \
        f"norm_head: x {tuple(x.shape)}, weight {tuple(weight.shape)}"
    rows = x.shape[0] // t
    out = _out(out, rows, weight.shape[0], x, torch.float32)
    _run("cp_norm_head", config, x=x, w=weight, out=out, counters=counters, prologue=NORM,
         epilogue=ROUND, rows=rows, n=weight.shape[0], norm_w=norm_weight, eps=eps, row_step=t,
         row_first=t - 1)
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None, config: GemmConfig | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> [M, N] in weight.dtype, as F.linear rounds it
    (fp32 accumulation, the bias added before the one rounding); any M (prefill: thousands), N a
    multiple of 16. One K slice: no counters, no partials, so it needs no workspace."""
    assert x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1], \
        f"linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} are not [M, K] and [N, K]"
    rows, n = x.shape[0], weight.shape[0]
    assert n % MIN_BLOCK_N == 0, f"linear: weight rows {n} not a multiple of {MIN_BLOCK_N}"
    assert bias is None or (bias.shape == (n,) and bias.dtype == weight.dtype
                            and bias.device == weight.device), \
        f"linear: bias {tuple(bias.shape)}/{bias.dtype} must be [{n}] in {weight.dtype}"
    out = _out(out, rows, n, x, weight.dtype)
    _run("linear", config, split_k=False, x=x, w=weight, out=out, counters=None, prologue=PLAIN,
         epilogue=ROUND if bias is None else BIAS, rows=rows, n=n, bias=bias)
    return out
