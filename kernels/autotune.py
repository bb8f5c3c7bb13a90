"""The tuning cache: the best launch config per key, timed once on the device.

`pick` keys are shape classes (head_dim, page size, GQA group, dtypes, a block table's width), never batch or
sequence length, so a CUDA-graph sweep over batch sizes compiles nothing new once `kernels.warmup()` has run (a graph
must not compile or time anything while it is captured).
`choose` keys are whole shapes (the codec conv: kernel vs cuDNN per batch bucket) and are tuned only
inside `tuning()`, i.e. in each bucket's graph warm-up; an untuned shape takes its default.
Tuning runs only on CUDA, outside graph capture, and only for idempotent launches; elsewhere the
first (heuristic) candidate is used. `Q3TTS_TUNE=0` disables tuning.
`set_batch_invariant(True)` (process-wide) makes the kernels that would key a choice on the batch
(the skinny GEMMs' row classes, the codec conv's kernel-vs-cuDNN choice, paged attention's split
count) take their batch-independent choice instead (see q3tts.kernels' docstring).
`save_tuned` / `load_tuned` keep the table in a file between processes (an engine process that replaces one
after a device fault tunes nothing again), valid only for the same device name, torch, triton and kernel sources.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

_BEST: dict[tuple, Any] = {}
_SEEN: dict[tuple, tuple] = {}  # every key `pick` was asked for -> its candidates (for engine/chain_tuning.py)
_INVARIANT = [False]
_TUNED_S = [0.0]  # seconds this process spent timing candidates (compiling them included)


def set_batch_invariant(on: bool) -> None:
    """Process-wide: when on, every kernel computes each row with arithmetic that depends neither on
    how many rows share the launch nor on what they hold (default off: faster configs per batch)."""
    _INVARIANT[0] = bool(on)


def batch_invariant() -> bool:
    """Whether `set_batch_invariant(True)` is in force."""
    return _INVARIANT[0]


def _can_tune(device: torch.device) -> bool:
    return (device.type == "cuda" and os.environ.get("Q3TTS_TUNE", "1") != "0"
            and not torch.cuda.is_current_stream_capturing())


def pick(key: tuple, candidates: Sequence[Any], launch: Callable[[Any], None],
         device: torch.device) -> Any:
    """Best of `candidates` for `key` (cached). `launch(cfg)` must be idempotent (it is re-run)."""
    if key not in _SEEN:
        _SEEN[key] = tuple(candidates)
    if key in _BEST:
        return _BEST[key]
    if len(candidates) == 1 or not _can_tune(device):
        return candidates[0]  # NOTE: not cached, so a later eager call on CUDA still tunes
    from triton.testing import do_bench

    start = time.perf_counter()
    timings = []
    for cfg in candidates:
        try:
            timings.append((do_bench(lambda: launch(cfg), warmup=5, rep=20), cfg))
        except Exception:  # noqa: BLE001 - a config the device rejects (shared memory, registers)
            continue
    assert timings, f"no launch config ran for {key}"
    _BEST[key] = min(timings, key=lambda t: t[0])[1]
    _TUNED_S[0] += time.perf_counter() - start
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


def seen_candidates() -> dict[tuple, tuple]:
    """Every key `pick` was asked for in this process, with the candidates it was given (tuned or not)."""
    return dict(_SEEN)


def set_tuned(key: tuple, config: Any) -> None:
    """Make `config` the tuned choice for `key` (a tuner that times whole chains: engine/chain_tuning.py). Launches
    already captured in a CUDA graph keep the config they were captured with."""
    _BEST[key] = config


def forget(key: tuple) -> None:
    """Drop `key`'s tuned choice (a chain tuner's mark that a newer tuning replaced); absent, nothing."""
    _BEST.pop(key, None)


def tuning_seconds() -> float:
    """Seconds this process spent timing launch configs so far (their compiles included)."""
    return _TUNED_S[0]


def fingerprint(device: torch.device) -> tuple[str, str, str, str]:
    """What a saved table holds for: the device's name, torch, triton, and a digest of the kernels' sources."""
    import triton

    digest = hashlib.sha256()
    for source in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(source.read_bytes())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return name, str(torch.__version__), str(triton.__version__), digest.hexdigest()


def save_tuned(path: str | os.PathLike, device: torch.device) -> None:
    """Write the tuned table, with `fingerprint(device)`, to `path` (replaced whole, never half-written). It
    is only a cache: a failure to write is a warning."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(pickle.dumps({"fingerprint": fingerprint(device), "best": dict(_BEST)}, protocol=5))
        os.replace(tmp, path)
    except OSError as e:
        warnings.warn(f"the kernel tuning cache was not saved to {path}: {e}", stacklevel=2)
        tmp.unlink(missing_ok=True)


def load_tuned(path: str | os.PathLike, device: torch.device) -> int:
    """Take the table saved at `path` when it was saved with this `fingerprint(device)` -> how many entries
    it held (0: no file, or one for another device or version). A file that cannot be read is a warning."""
    try:
        with open(path, "rb") as f:
            saved = _TableUnpickler(f).load()
    except FileNotFoundError:
        return 0
    except Exception as e:  # noqa: BLE001 - only a cache: any unreadable file is skipped
        warnings.warn(f"the kernel tuning cache {path} was not read: {e}", stacklevel=2)
        return 0
    if not isinstance(saved, dict) or saved.get("fingerprint") != fingerprint(device):
        return 0
    _BEST.update(saved["best"])
    return len(saved["best"])


class _TableUnpickler(pickle.Unpickler):
    """Unpickles a tuned table and nothing else: its keys and configs are built from tuples, strings, numbers,
    torch dtypes and sizes, and the kernels' own config classes."""

    def find_class(self, module: str, name: str):
        if module.startswith("q3tts.kernels.") or (module == "torch" and (
                name == "Size" or isinstance(getattr(torch, name, None), torch.dtype))):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} has no place in a tuning table")
