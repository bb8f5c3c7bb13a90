"""kernels/conv1d.py vs causal_conv1d_ref (F.conv1d) — the codec decoder's convs, shapes kept tiny."""

from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, assert_close_3way, kernel_module
from q3tts.kernels.reference import causal_conv1d_ref

conv1d = kernel_module("conv1d")

# (batch, c_in, c_out, kernel, dilation, new samples T): dilated k7 residual units, k1 pointwise,
# the 1-channel output conv, the k3 pre-conv on one frame, channel counts off the block sizes
CASES = [(2, 24, 24, 7, 3, 10), (3, 16, 20, 7, 9, 5), (2, 20, 1, 7, 1, 33), (1, 40, 72, 3, 1, 1),
         (2, 24, 24, 1, 1, 130), (1, 17, 33, 7, 1, 70)]


def _inputs(case, dtype, residual: bool):
    bsz, c_in, c_out, k, d, t = case
    gen = torch.Generator().manual_seed(sum(case))
    x = torch.randn(bsz, c_in, t + (k - 1) * d, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(c_out, c_in, k, generator=gen) / (c_in * k) ** 0.5).to(DEVICE, dtype)
    b = torch.randn(c_out, generator=gen).to(DEVICE, dtype)
    r = torch.randn(bsz, c_out, t, generator=gen).to(DEVICE, dtype) if residual else None
    return x, w, b, d, r


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}_ci{}_co{}_k{}_d{}_t{}".format(*c))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_conv1d_matches_reference(dtype, case, residual):
    x, w, b, d, r = _inputs(case, dtype, residual)
    out = conv1d.causal_conv1d(x, w, b, d, r, impl="triton")
    out_pt = causal_conv1d_ref(x, w, b, d, r)
    # float64: on the GPU cuDNN runs fp32 convs in TF32, which is no reference for an fp32 kernel
    out_ref = causal_conv1d_ref(x.double(), w.double(), b.double(), d, None if r is None else r.double())
    assert out.shape == out_pt.shape and out.dtype == dtype
    assert_close_3way(out, out_pt, out_ref, dtype, f"conv1d {dtype} {case}")


def test_conv1d_strided_views_and_no_bias():
    """x with history as a slice of a wider buffer, residual as a time-slice view, no bias."""
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(2, 16, 40, generator=gen).to(DEVICE)
    x = wide[:, :, 5:31]  # [2, 16, 26]: not contiguous, time stride 1
    w = torch.randn(16, 16, 7, generator=gen).to(DEVICE) / 10
    r_wide = torch.randn(2, 16, 30, generator=gen).to(DEVICE)
    r = r_wide[:, :, 4:24]  # [2, 16, 20]
    out = conv1d.causal_conv1d(x, w, None, 1, r, impl="triton")
    want = causal_conv1d_ref(x.double(), w.double(), None, 1, r.double()).float()
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_conv1d_kernel_weight_layout_gives_the_same_result():
    """weight_oik (input channels fastest, the layout the codec caches) reads the same weights."""
    import q3tts.kernels as K

    x, w, b, d, r = _inputs((2, 24, 20, 7, 3, 9), torch.float32, True)
    oik = K.conv_kernel_weight(w)
    assert oik.shape == w.shape and oik.stride(1) == 1
    torch.testing.assert_close(conv1d.causal_conv1d(x, w, b, d, r, weight_oik=oik, impl="triton"),
                               conv1d.causal_conv1d(x, w, b, d, r, impl="triton"), atol=1e-6, rtol=1e-6)


def test_conv1d_rejects_what_it_cannot_do():
    x = torch.randn(1, 8, 10, device=DEVICE)
    with pytest.raises(AssertionError, match="input channels"):
        conv1d.causal_conv1d(x, torch.randn(8, 4, 3, device=DEVICE), None)
    with pytest.raises(AssertionError, match="receptive field"):
        conv1d.causal_conv1d(x, torch.randn(8, 8, 7, device=DEVICE), None, dilation=3)
