"""Host-to-device copies that do not wait for the device.

A copy from pageable host memory (`torch.tensor(ids, device="cuda")`, `t.to("cuda")`) synchronises with the
stream: between the engine's steps that stream holds a decode step in flight (engine/audio_pipeline.py), and
right after a prefill launch it holds the prefill, so every such copy made the host wait for them.
"""

from __future__ import annotations

import torch


def upload(t: torch.Tensor, device: torch.device | str, out: torch.Tensor | None = None) -> torch.Tensor:
    """Host tensor `t` on `device` (into `out` when given, a tensor there of t's shape and dtype), without
    waiting for the work queued there: on CUDA through a pinned copy of t, copied in stream order (t itself
    when it is pinned already: do not refill it before the copy has run). Elsewhere (or from a tensor
    already on a device) a plain copy."""
    assert out is None or out.dtype == t.dtype, f"upload into {out.dtype} from {t.dtype}: a conversion would wait"
    if torch.device(device).type != "cuda" or t.device.type != "cpu":
        return t.to(device) if out is None else out.copy_(t)
    pinned = t.pin_memory()
    return pinned.to(device, non_blocking=True) if out is None else out.copy_(pinned, non_blocking=True)
