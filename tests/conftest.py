"""Suite-wide setup: one CPU thread for tiny shapes, the Triton interpreter where there is no CUDA
device (it must be chosen before triton is first imported), the `gpu` marker's skip, and the kernels'
batch-invariance switch for a test (`switch`)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(1)  # tiny shapes: a second thread only contends on the 2-core CI machine


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none here)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def switch():
    """kernels.set_batch_invariant, off when the test starts and as it was when it ends: an engine with
    EngineConfig.batch_invariant turns the process-wide switch on and leaves it on, so a later engine without it
    would run the invariant paths."""
    from q3tts import kernels

    before = kernels.batch_invariant()
    kernels.set_batch_invariant(False)
    yield kernels.set_batch_invariant
    kernels.set_batch_invariant(before)
