"""Launch utilities every kernel wrapper shares: the device a launch goes to and the SM count."""

from __future__ import annotations

import contextlib

import torch


def device_guard(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Launch on `t`'s device (otherwise Triton launches from cuda:0)."""
    return torch.cuda.device(t.device.index) if t.is_cuda else contextlib.nullcontext()


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device`; a small stand-in for the CPU interpreter."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter on CPU: keep split counts (and test time) small
