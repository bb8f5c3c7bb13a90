"""kernels/snake.py vs snake_beta_ref."""

from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, assert_close_3way, kernel_module
from q3tts.kernels.reference import snake_beta_ref

snake = kernel_module("snake")


@pytest.mark.parametrize("shape", [(2, 3, 7), (1, 5, 1920), (3, 4, 33), (2, 40, 4), (1, 3, 2000)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_snake_matches_reference(dtype, shape):
    gen = torch.Generator().manual_seed(shape[-1])
    x = (3 * torch.randn(shape, generator=gen)).to(DEVICE, dtype)
    alpha = (0.5 * torch.randn(shape[1], generator=gen)).to(DEVICE, dtype)
    beta = (0.5 * torch.randn(shape[1], generator=gen)).to(DEVICE, dtype)
    out = snake.snake_beta(x, alpha, beta)
    out_pt = snake_beta_ref(x, alpha, beta)
    out_ref = snake_beta_ref(x.float(), alpha.float(), beta.float())
    assert out.shape == x.shape and out.dtype == dtype
    assert_close_3way(out, out_pt, out_ref, dtype, f"snake {dtype} {shape}")


def test_snake_on_a_time_slice():
    """The decoder feeds views trimmed in time (transposed-conv output); rows are read by stride."""
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(2, 3, 20, generator=gen).to(DEVICE)
    x = wide[:, :, 4:15]
    alpha, beta = torch.randn(3, generator=gen).to(DEVICE), torch.randn(3, generator=gen).to(DEVICE)
    torch.testing.assert_close(snake.snake_beta(x, alpha, beta), snake_beta_ref(x, alpha, beta), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("positions", [None, *snake.CL_POSITIONS[1:]], ids=lambda p: f"positions{p}")
@pytest.mark.parametrize("shape", [(2, 40, 7), (3, 5, 130), (1, 33, 4)], ids=lambda s: "x".join(map(str, s)))
def test_snake_writes_channels_last(shape, positions):
    """channels_last: the kernel's values (bit for bit) stored [B, T, C], returned as the [B, C, T] view, with each
    tiling the tuner times."""
    gen = torch.Generator().manual_seed(shape[1])
    x = (3 * torch.randn(shape, generator=gen)).to(DEVICE, torch.bfloat16)
    alpha = (0.5 * torch.randn(shape[1], generator=gen)).to(DEVICE, torch.bfloat16)
    beta = (0.5 * torch.randn(shape[1], generator=gen)).to(DEVICE, torch.bfloat16)
    out = snake.snake_beta(x, alpha, beta, channels_last=True, positions=positions)
    assert out.shape == x.shape and out.stride(1) == 1 and out.transpose(1, 2).is_contiguous()
    assert torch.equal(out, snake.snake_beta(x, alpha, beta))
