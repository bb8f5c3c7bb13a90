"""Suite-wide setup: one CPU thread for tiny shapes, the Triton interpreter where there is no CUDA
device (it must be chosen before triton is first imported), and the `gpu` marker's skip."""

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
