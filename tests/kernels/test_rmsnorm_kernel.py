"""kernels/rmsnorm.py vs rms_norm_ref / add_rms_norm_ref."""

from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, assert_close_3way, kernel_module
from q3tts.kernels.reference import add_rms_norm_ref, rms_norm_ref

rmsnorm = kernel_module("rmsnorm")

SHAPES = [(3, 80), (7, 1024), (2, 2048), (4, 16, 128), (5, 8, 80), (1, 1, 16), (2, 3, 2, 64)]


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_norm_matches_reference(dtype, shape, residual):
    torch.manual_seed(0)
    x = torch.randn(shape, device=DEVICE).mul(3).to(dtype)
    w = torch.randn(shape[-1], device=DEVICE).to(dtype)
    r = torch.randn(shape, device=DEVICE).to(dtype) if residual else None
    if residual:
        out, res = rmsnorm.rms_norm(x, w, 1e-6, residual=r)
        out_pt, res_pt = add_rms_norm_ref(x, r, w, 1e-6)
        out_ref, _ = add_rms_norm_ref(x.float(), r.float(), w.float(), 1e-6)
        # the residual stream must be bit-identical to the eager add
        assert torch.equal(res, res_pt) and res.dtype == dtype
    else:
        out = rmsnorm.rms_norm(x, w, 1e-6)
        out_pt, out_ref = rms_norm_ref(x, w, 1e-6), rms_norm_ref(x.float(), w.float(), 1e-6)
    assert out.shape == x.shape and out.dtype == out_pt.dtype
    assert_close_3way(out, out_pt, out_ref, dtype, f"rms_norm {dtype} {shape}")


@pytest.mark.parametrize("shape", [(3, 80), (2, 2048)], ids=lambda s: "x".join(map(str, s)))
def test_fp32_residual_stream_with_bf16_activations(shape):
    """EngineConfig.fp32_residual: bf16 x + an fp32 residual -> the new residual in fp32, bit-equal to the
    reference's unrounded sum (a kernel that rounds it to bf16, as the plain stream does, fails here), and
    the normed rows in bf16 as the reference rounds them."""
    torch.manual_seed(3)
    x = torch.randn(shape, device=DEVICE).mul(3).to(torch.bfloat16)
    w = torch.randn(shape[-1], device=DEVICE).to(torch.bfloat16)
    r = torch.randn(shape, device=DEVICE).div(7)  # fp32, not representable in bf16
    out, res = rmsnorm.rms_norm(x, w, 1e-6, residual=r)
    out_pt, res_pt = add_rms_norm_ref(x, r, w, 1e-6)
    assert res.dtype == res_pt.dtype == torch.float32 and torch.equal(res, res_pt)
    assert not torch.equal(res, res.bfloat16().float())  # the stream really kept fp32 bits
    out_ref, _ = add_rms_norm_ref(x.float(), r, w.float(), 1e-6)
    assert out.dtype == out_pt.dtype == torch.bfloat16
    assert_close_3way(out, out_pt, out_ref, torch.bfloat16, f"fp32-residual rms_norm {shape}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_qk_norm_on_strided_head_view(dtype):
    """QK-norm on q = a [N, NH, D] view of a fused qkv projection (row stride != NH * D)."""
    torch.manual_seed(1)
    n, nh, kvh, d = 3, 4, 2, 80
    qkv = torch.randn(n, (nh + 2 * kvh) * d, device=DEVICE).to(dtype)
    q = qkv[:, : nh * d].view(n, nh, d)
    k = qkv[:, nh * d: (nh + kvh) * d].view(n, kvh, d)
    w = torch.rand(d, device=DEVICE).add(0.5).to(dtype)
    for t in (q, k):
        assert not t.is_contiguous()
        out = rmsnorm.rms_norm(t, w, 1e-6)
        assert_close_3way(out, rms_norm_ref(t, w, 1e-6), rms_norm_ref(t.float(), w.float(), 1e-6),
                          dtype, "qk-norm view")


def test_bf16_activations_with_fp32_weight_promote_like_torch():
    torch.manual_seed(2)
    x = torch.randn(4, 128, device=DEVICE).to(torch.bfloat16)
    w = torch.randn(128, device=DEVICE)
    out = rmsnorm.rms_norm(x, w, 1e-6)
    ref = rms_norm_ref(x, w, 1e-6)
    assert out.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_contract_violations_raise():
    x = torch.randn(2, 64, device=DEVICE)
    with pytest.raises(AssertionError, match="weight"):
        rmsnorm.rms_norm(x, torch.ones(32, device=DEVICE), 1e-6)
    with pytest.raises(AssertionError, match="residual"):
        rmsnorm.rms_norm(x, torch.ones(64, device=DEVICE), 1e-6, residual=x[:1])
