"""Shared by tests/unit/test_prompt.py and tests/engine/test_host_reads.py (tests/ is on sys.path): the ops a block
dispatches, and those that read a tensor back to the host as a Python number."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HOST_READ = torch.ops.aten._local_scalar_dense.default  # item(), int(t), a 0-dim tensor index, `if t:`


class HostReads(TorchDispatchMode):
    """`with HostReads() as host:` records every op dispatched inside (`host.ops`) and the device of each tensor read
    back to the host among them (`host.reads`, e.g. "cpu", "cuda:0"). On CUDA a host read waits for the caller's
    stream: on the step or admission path it stalls the engine's loop behind the work queued there."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        if func is HOST_READ:
            self.reads.append(str(args[0].device))
        return func(*args, **(kwargs or {}))
