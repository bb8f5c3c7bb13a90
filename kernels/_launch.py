"""Launch utilities every kernel wrapper shares: the device a launch goes to, the SM count, and programmatic
dependent launch.

Programmatic dependent launch (PDL, Hopper and later; `set_programmatic_launch(True)`, process-wide, off until set:
an engine sets it from `EngineConfig.programmatic_launch`, on by default): a kernel launched with it may start while
the kernel before it in the stream still runs. The GEMM launches that take it are those whose programs can hold
their whole weight tile in registers (code_predictor_gemm.held_columns): they load it, then wait at
`griddepcontrol.wait` until the previous kernel has finished and its writes are visible, then let the next kernel
launch (`griddepcontrol.launch_dependents`). So a chain of small launches (the code predictor's 22-23 a pass) has
each launch's start-up and weight fetch under the kernel before it, inside CUDA graphs too. Kernels without weights
that take it (attention, the draw) wait first. A GEMM whose tile does not fit launches as usual (waiting with
nothing in flight only holds SM slots), and a kernel without PDL code before or after one with it is ordered as
usual: its successor only starts once it completes.
"""

from __future__ import annotations

import contextlib
import functools

import torch

_PDL = [False]


def device_guard(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Launch on `t`'s device (otherwise Triton launches from cuda:0)."""
    return torch.cuda.device(t.device.index) if t.is_cuda else contextlib.nullcontext()


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device`; a small stand-in for the CPU interpreter."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter on CPU: keep split counts (and test time) small


def set_programmatic_launch(on: bool) -> None:
    """Process-wide: the kernels that support it launch with PDL on devices that have it (see the module
    docstring). Set it before the kernels are warmed up and graphs captured: it selects other compiled variants."""
    _PDL[0] = bool(on)


@functools.lru_cache(maxsize=None)
def _has_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def programmatic_launch(t: torch.Tensor) -> bool:
    """Whether a launch on `t`'s device may use PDL: switched on, and a CUDA device of compute capability >= 9."""
    return (_PDL[0] and t.is_cuda and _has_pdl(t.device.index if t.device.index is not None
                                                else torch.cuda.current_device()))
