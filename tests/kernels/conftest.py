"""Kernel tests run on CUDA when present, else on CPU through the Triton interpreter.

Importing kernel_checks sets TRITON_INTERPRET=1 on CPU-only machines at collection time, before any
kernel module is decorated (see kernel_checks.py).
"""

import pytest

import kernel_checks


@pytest.fixture
def device() -> str:
    return kernel_checks.DEVICE


@pytest.fixture
def invariant(switch):
    """kernels.set_batch_invariant(True) for one test (process-wide), then as it was before (`switch`)."""
    switch(True)
