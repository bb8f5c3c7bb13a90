"""kernels/swiglu.py vs silu_mul_ref (SwiGLU's gate from the fused gate|up projection)."""

from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, assert_close_3way, kernel_module
from q3tts.kernels.reference import silu_mul_ref

swiglu = kernel_module("swiglu")

SHAPES = [  # x shapes [..., 2I]
    (3, 2 * 1200),       # a row spans two programs and a partial third (BLOCK 1024)
    (1, 2 * 16),
    (2, 5, 2 * 48),      # the codec transformer's [B, T, 2I]
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_silu_mul_matches_reference(dtype, shape):
    torch.manual_seed(0)
    x = (3 * torch.randn(shape, device=DEVICE)).to(dtype)
    out = swiglu.silu_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype and out.is_contiguous()
    assert_close_3way(out, silu_mul_ref(x), silu_mul_ref(x.float()), dtype)


def test_strided_rows_and_empty():
    """Rows of a wider buffer (a row stride past 2I) and an empty batch."""
    torch.manual_seed(1)
    x = torch.randn(4, 2 * 40 + 8, device=DEVICE)[:, :80]  # rows 88 elements apart
    assert_close_3way(swiglu.silu_mul(x), silu_mul_ref(x), silu_mul_ref(x.double()), torch.float32)
    assert swiglu.silu_mul(torch.empty(0, 32, device=DEVICE)).shape == (0, 16)
