"""Launch configs, the config cache and `warmup()`: compile and tune every kernel before capture.

`pick` keys are shape classes (head_dim, page size, GQA group, dtypes), never batch or sequence length,
so a CUDA-graph sweep over batch sizes compiles nothing new once `warmup()` has run (rule 11).
`choose` keys are whole shapes (the codec conv: kernel vs cuDNN per batch bucket) and are tuned only
inside `tuning()`, i.e. in each bucket's graph warm-up; an untuned shape takes its default.
Tuning runs only on CUDA, outside graph capture, and only for idempotent launches; elsewhere the
first (heuristic) candidate is used. `Q3TTS_TUNE=0` disables tuning.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Sequence

import torch

_BEST: dict[tuple, Any] = {}


def device_guard(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Launch on `t`'s device (otherwise Triton launches from cuda:0)."""
    return torch.cuda.device(t.device.index) if t.is_cuda else contextlib.nullcontext()


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter on CPU: keep split counts (and test time) small


def _can_tune(device: torch.device) -> bool:
    return (device.type == "cuda" and os.environ.get("Q3TTS_TUNE", "1") != "0"
            and not torch.cuda.is_current_stream_capturing())


def pick(key: tuple, candidates: Sequence[Any], launch: Callable[[Any], None],
         device: torch.device) -> Any:
    """Best of `candidates` for `key` (cached). `launch(cfg)` must be idempotent (it is re-run)."""
    if key in _BEST:
        return _BEST[key]
    if len(candidates) == 1 or not _can_tune(device):
        return candidates[0]  # NOTE: not cached, so a later eager call on CUDA still tunes
    from triton.testing import do_bench

    timings = []
    for cfg in candidates:
        try:
            timings.append((do_bench(lambda: launch(cfg), warmup=5, rep=20), cfg))
        except Exception:  # noqa: BLE001 - a config the device rejects (shared memory, registers)
            continue
    assert timings, f"no launch config ran for {key}"
    _BEST[key] = min(timings, key=lambda t: t[0])[1]
    return _BEST[key]


_TUNING = [0]  # depth of open `tuning()` blocks


@contextlib.contextmanager
def tuning():
    """Within this block `choose` tunes shapes it has not seen (CUDA-graph warm-up); outside, an
    unseen shape takes the default without timing anything (full decodes, reference priming)."""
    _TUNING[0] += 1
    try:
        yield
    finally:
        _TUNING[0] -= 1


def choose(key: tuple, candidates: Sequence[Any], launch: Callable[[Any], None], device: torch.device,
           default: Any) -> Any:
    """`pick` for a shape-specialised key inside `tuning()` (or when already tuned), else `default`."""
    if key in _BEST or (_TUNING[0] and _can_tune(device)):
        return pick(key, candidates, launch, device)
    return default


def tuned_configs() -> dict[tuple, Any]:
    """A copy of the tuned table (for logs and the bench report)."""
    return dict(_BEST)


def warmup(*, num_heads: int, num_kv_heads: int, head_dim: int, hidden_sizes: Sequence[int],
           page_size: int, dtype: torch.dtype, device: torch.device | str = "cuda",
           max_pages: int = 4, batch_sizes: Sequence[int] = (1,)) -> None:
    """Compile (and tune) every kernel variant the model uses; call before CUDA-graph capture.

    hidden_sizes: every feature dim RMSNorm runs on (e.g. (2048, 1024) for talker + code predictor);
    head_dim is added for QK-norm. batch_sizes only pick which split counts are exercised; the
    kernels themselves are specialised on none of them.
    """
    # NOTE: by full module path: the package re-binds the names `store_kv` etc. to its wrappers
    from .paged_attention import paged_decode_attention
    from .rmsnorm import rms_norm
    from .rotary import apply_rotary
    from .store_kv import store_kv

    device = torch.device(device)
    for dim in (*hidden_sizes, head_dim):
        w = torch.ones(dim, dtype=dtype, device=device)
        x = torch.randn(2, dim, dtype=dtype, device=device)
        rms_norm(x, w, 1e-6)
        rms_norm(x, w, 1e-6, residual=x)
    qk = torch.randn(2, num_heads, head_dim, dtype=dtype, device=device)
    rms_norm(qk, torch.ones(head_dim, dtype=dtype, device=device), 1e-6)
    kk = torch.randn(2, num_kv_heads, head_dim, dtype=dtype, device=device)
    rms_norm(kk, torch.ones(head_dim, dtype=dtype, device=device), 1e-6)
    table = torch.randn(8, head_dim, dtype=dtype, device=device)
    cache = torch.zeros(max_pages * 2, page_size, num_kv_heads, head_dim, dtype=dtype,
                        device=device)
    for index_dtype in (torch.int32, torch.int64):  # positions / slots come in either
        pos = torch.zeros(2, dtype=index_dtype, device=device)
        apply_rotary(qk, kk, pos, table, table, inplace=False)
        apply_rotary(qk.clone(), kk.clone(), pos, table, table, inplace=True)
        slots = torch.tensor([0, -1], dtype=index_dtype, device=device)
        store_kv(kk, kk, cache, cache.clone(), slots)
    # NOTE: the first call tunes (on CUDA): give it full, distinct pages so configs differ for real
    tune_rows = 8 if device.type == "cuda" else 1
    big = torch.randn(tune_rows * max_pages, page_size, num_kv_heads, head_dim, dtype=dtype,
                      device=device)
    for bsz in (tune_rows, *batch_sizes):
        q = torch.randn(bsz, num_heads, head_dim, dtype=dtype, device=device)
        tables = torch.arange(bsz * max_pages, dtype=torch.int32, device=device)
        tables = (tables % big.shape[0]).view(bsz, max_pages)
        lens = torch.full((bsz,), max_pages * page_size, dtype=torch.int32, device=device)
        paged_decode_attention(q, big, big, tables, lens, head_dim ** -0.5)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
