"""kernels/splitmix.py vs uniforms_ref (the sampler's counter-based uniforms): the same bits, and the dispatch."""

from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, kernel_module
from q3tts import kernels
from q3tts.kernels.reference import uniforms_ref

splitmix = kernel_module("splitmix")

EDGES = [0, 1, -1, 7, 2**31, 2**32 + 5, 2**62, 2**63 - 1, -2**63, 123456789012345]


@pytest.mark.parametrize("lanes", [16, 4])
def test_uniforms_are_the_references_bits(lanes):
    """Every pair of edge seeds and counters (negative, int64 min and max, past 32 bits: the uint64
    arithmetic wraps where the reference's int64 does), 100 rows (programs of 16 rows and a partial one),
    strided and int32 inputs."""
    seeds = torch.tensor(EDGES, device=DEVICE).repeat_interleave(len(EDGES))
    counters = torch.tensor(EDGES, device=DEVICE).repeat(len(EDGES))
    got = splitmix.uniforms(seeds, counters, lanes)
    assert got.shape == (100, lanes) and got.dtype == torch.float32
    assert torch.equal(got, uniforms_ref(seeds, counters, lanes))
    table = torch.stack((seeds, counters), 1)  # [B, 2]: strided columns, as the engine's slot tables hold them
    assert torch.equal(splitmix.uniforms(table[:, 0], table[:, 1], lanes), got)
    small = torch.arange(-40, 60, device=DEVICE, dtype=torch.int32)
    assert torch.equal(splitmix.uniforms(small, small.flip(0), lanes), uniforms_ref(small, small.flip(0), lanes))
    assert splitmix.uniforms(seeds[:0], counters[:0], lanes).shape == (0, lanes)


def test_the_wrapper_runs_the_kernel_where_the_kernels_serve(monkeypatch):
    """kernels.uniforms: the kernel where kernels serve the device (CUDA; the interpreter with
    Q3TTS_TRITON_ON_CPU=1), else the reference, with the same bits."""
    calls = []
    launch = splitmix.uniforms
    monkeypatch.setattr(splitmix, "uniforms", lambda *a: calls.append(1) or launch(*a))
    seeds, counters = torch.arange(5, device=DEVICE), torch.full((5,), 9, device=DEVICE)
    monkeypatch.setenv("Q3TTS_TRITON_ON_CPU", "1")
    assert torch.equal(kernels.uniforms(seeds, counters, 16), uniforms_ref(seeds, counters, 16)) and calls == [1]
    if DEVICE == "cpu":
        monkeypatch.setenv("Q3TTS_TRITON_ON_CPU", "0")
        assert torch.equal(kernels.uniforms(seeds, counters, 16), uniforms_ref(seeds, counters, 16))
        assert calls == [1]
