"""kernels/rvq.py vs reference.rvq_sum_ref: a residual VQ's lookups and their sum, bit for bit."""

from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, kernel_module
from q3tts.kernels.reference import rvq_sum_ref

rvq = kernel_module("rvq")


def _case(bsz: int, n: int, length: int, size: int, dim: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    tables = (3 * torch.randn(n, size, dim, generator=gen)).to(DEVICE, dtype)
    codes = torch.randint(0, size, (bsz, n, length), generator=gen).to(DEVICE)
    return codes, tables


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bsz,n,length,dim", [(3, 15, 1, 24), (2, 1, 4, 16), (1, 6, 3, 40)])
def test_rvq_sum_matches_reference(dtype, bsz, n, length, dim):
    """Each add rounded to the dtype in codebook order, as torch's adds: the same bits (a sum kept in fp32 and
    rounded once differs in bf16 at 15 codebooks)."""
    codes, tables = _case(bsz, n, length, 11, dim, dtype, seed=n)
    out = rvq.rvq_sum(codes, tables)
    assert out.shape == (bsz, length, dim) and out.dtype == dtype
    assert torch.equal(out, rvq_sum_ref(codes, tables))


def test_rounded_once_would_differ():
    """The case above is sensitive to where the sum rounds: the fp32 sum rounded once is not the reference."""
    codes, tables = _case(3, 15, 1, 11, 24, torch.bfloat16, seed=15)
    once = rvq_sum_ref(codes, tables.float()).to(torch.bfloat16)
    assert not torch.equal(once, rvq_sum_ref(codes, tables))


def test_rvq_sum_reads_a_strided_code_slice():
    """The quantizer passes codes[:, 1:] of the frame's [B, 16, T]: rows read by stride, not copied."""
    codes, tables = _case(2, 16, 2, 9, 16, torch.bfloat16, seed=3)
    rest = codes[:, 1:]
    assert not rest.is_contiguous()
    assert torch.equal(rvq.rvq_sum(rest, tables[1:]), rvq_sum_ref(rest, tables[1:]))
