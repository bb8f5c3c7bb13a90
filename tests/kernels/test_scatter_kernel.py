"""kernels/scatter.py vs reference.scatter_rows_ref: many tensors' rows scattered in one launch, bit for bit."""

from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, kernel_module
from q3tts.kernels.reference import scatter_rows_ref

scatter = kernel_module("scatter")


def _pairs(dtype: torch.dtype, slots: int, bsz: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Destinations as the codec's pool holds its states (views into one packed buffer [slots, n]: channels-last
    histories [hist, C], depthwise ones [C, hist], a transposed conv's [C, 1], one wider than a program's chunk) and
    sources as a frame leaves them (the tail of a channels-last input, a transposed slice, a fresh tensor)."""
    gen = torch.Generator().manual_seed(5)
    shapes = [(6, 24), (24, 6), (24, 1), (3, 1000), (7,)]
    sizes = [torch.Size(s).numel() for s in shapes]
    packed = torch.zeros(slots, sum(sizes) + 16 * len(shapes), dtype=dtype, device=DEVICE)
    dsts, at = [], 0
    for shape, n in zip(shapes, sizes):
        dsts.append(packed[:, at:at + n].view(slots, *shape))
        at += n + 16
    x = torch.randn(bsz, 24, 40, generator=gen).to(DEVICE, dtype).transpose(1, 2).contiguous().transpose(1, 2)
    srcs = [x[..., -6:].transpose(1, 2),  # [B, 6, 24] of a channels-last [B, 24, 40]: rows 48 elements apart
            torch.randn(bsz, 6, 24, generator=gen).to(DEVICE, dtype).transpose(1, 2),  # [B, 24, 6], column stride 24
            x[..., -1:],  # [B, 24, 1]
            torch.randn(bsz, 3, 1000, generator=gen).to(DEVICE, dtype),
            torch.randn(bsz, 14, generator=gen).to(DEVICE, dtype)[:, ::2]]  # [B, 7], stride 2
    return dsts, srcs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_scatter_rows_writes_index_copys_bits(dtype):
    """Every pair's rows land where `index_copy_` puts them, the other slots untouched."""
    rows = torch.tensor([4, 0, 2], device=DEVICE)
    dsts, srcs = _pairs(dtype, 6, 3)
    want = [d.clone() for d in dsts]
    scatter_rows_ref(want, rows, srcs)
    scatter.scatter_rows(dsts, rows, srcs)
    for got, ref in zip(dsts, want):
        assert torch.equal(got, ref)
    assert not dsts[0][1].any() and not dsts[3][5].any()


def test_scatter_rows_of_an_int64_counter():
    """The codec's frame counter: rows of no dims, int64, read from a strided column."""
    pos = torch.zeros(5, dtype=torch.int64, device=DEVICE)
    src = torch.arange(10, dtype=torch.int64, device=DEVICE)[::5] + 7  # [2], stride 5
    scatter.scatter_rows([pos], torch.tensor([3, 1], device=DEVICE), [src])
    assert pos.tolist() == [0, 12, 0, 7, 0]


def test_scatter_rows_takes_one_dtype():
    dsts, srcs = _pairs(torch.float32, 4, 2)
    with pytest.raises(AssertionError, match="one dtype"):
        scatter.scatter_rows(dsts, torch.tensor([0, 1], device=DEVICE), srcs[:-1] + [srcs[-1].double()])
