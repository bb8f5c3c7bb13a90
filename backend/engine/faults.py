"""Device faults: which errors leave the device context unusable, what a row's non-finite scores are
called, and the test-only hook that causes a real device fault.

A CUDA device-side assert (an out-of-range gather, for example), an illegal address or an ECC event
poisons the process's CUDA context: every later CUDA call fails with the same error, so the engine
cannot go on in that process (the serving layer runs it in a child process and replaces the process,
serving/engine_process.py). A non-finite sampling row is not such a fault: the sampler's finite guard
(models/sampling.py) draws a valid id and flags the row, and the engine ends only that sequence.
"""

from __future__ import annotations

import torch

from q3tts.core import EngineError

POISON_MARKERS = ("CUDA error", "device-side assert", "illegal memory access", "unspecified launch failure",
                  "ECC error")


def context_usable(device: torch.device) -> bool:
    """Whether the device still runs work: on CUDA a synchronize, which fails on a poisoned context."""
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
        return True
    except Exception:  # noqa: BLE001 - any failure here means the context cannot be trusted
        return False


def is_device_fault(exc: BaseException, device: torch.device) -> bool:
    """Whether `exc` (raised by engine work on `device`) left the device context unusable. A request error
    (q3tts.core.EngineError) never does; anything else is checked with a synchronize on CUDA."""
    if isinstance(exc, torch.AcceleratorError) or any(m in str(exc) for m in POISON_MARKERS):
        return True
    return not isinstance(exc, EngineError) and not context_usable(device)


def inject_device_fault(device: torch.device) -> None:
    """The test hook (`EngineConfig.fault_injection_seed`): on CUDA an out-of-range index_select, a real
    device-side assert that poisons the context (raised here by the synchronize); on CPU, where an
    out-of-range index is an ordinary IndexError, the error class a CUDA fault raises."""
    if device.type == "cuda":
        table = torch.zeros(4, device=device)
        table.index_select(0, torch.full((1,), 1 << 20, dtype=torch.int64, device=device))
        torch.cuda.synchronize(device)
    raise torch.AcceleratorError("CUDA error: device-side assert triggered (injected on the CPU by "
                                 "EngineConfig.fault_injection_seed)")


def check_token_ids(tokenizer_vocab: int, text_vocab: int) -> None:
    """Every text token id the tokenizer can make indexes the talker's text embedding (checked once at load,
    so no per-step device check is needed)."""
    if tokenizer_vocab > text_vocab:
        raise ValueError(f"the tokenizer makes ids up to {tokenizer_vocab - 1}, but the talker's text embedding "
                         f"has {text_vocab} rows: the checkpoint's tokenizer and weights do not match")


def nonfinite_error(sampling) -> str:
    """The error of a sequence whose sampling scores went non-finite (the finite guard flagged its row)."""
    return ("sampling produced non-finite scores (temperature="
            f"{sampling.temperature}, top_p={sampling.top_p}, repetition_penalty={sampling.repetition_penalty}, "
            f"subtalker_temperature={sampling.subtalker_temperature}, subtalker_top_p={sampling.subtalker_top_p})")
