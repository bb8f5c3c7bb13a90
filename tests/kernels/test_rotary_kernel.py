"""kernels/rotary.py vs apply_rotary_ref (rotate_half RoPE, tables gathered by position)."""

from __future__ import annotations

import os

import pytest
import torch

from kernel_checks import DEVICE, assert_close_3way, kernel_module
from q3tts.kernels.reference import QKNorm, apply_rotary_ref

rotary = kernel_module("rotary")

MAX_POS = 37

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def _tables(head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's tables: fp32 angles, cat(freqs, freqs), cast to dtype. [MAX_POS, head_dim]."""
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2, device=DEVICE).float() / head_dim))
    freqs = torch.arange(MAX_POS, device=DEVICE).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


CASES = [  # (n, num_heads, num_kv_heads, head_dim)
    (5, 16, 8, 128), (3, 4, 4, 80), (1, 3, 1, 16), (6, 2, 2, 64),
]


@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "n{}_h{}_kv{}_d{}".format(*c))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rotary_matches_reference(dtype, case, inplace):
    n, nh, kvh, d = case
    torch.manual_seed(0)
    # q, k as strided views of one fused projection output, as in the model
    qkv = torch.randn(n, (nh + kvh) * d + 8, device=DEVICE).to(dtype)
    q = qkv[:, : nh * d].view(n, nh, d)
    k = qkv[:, nh * d: (nh + kvh) * d].view(n, kvh, d)
    positions = torch.randint(0, MAX_POS, (n,), device=DEVICE)
    positions[0] = MAX_POS - 1
    cos, sin = _tables(d, dtype)
    q_pt, k_pt = apply_rotary_ref(q, k, positions, cos, sin)
    q_ref, k_ref = apply_rotary_ref(q.float(), k.float(), positions, cos.float(), sin.float())
    tail = qkv[:, (nh + kvh) * d:].clone()
    q_out, k_out = rotary.apply_rotary(q, k, positions.to(torch.int32), cos, sin, inplace=inplace)
    if inplace:
        assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()
        assert torch.equal(qkv[:, (nh + kvh) * d:], tail), "in-place RoPE wrote past k"
    assert q_out.dtype == dtype and k_out.shape == k.shape
    assert_close_3way(q_out, q_pt, q_ref, dtype, "q")
    assert_close_3way(k_out, k_pt, k_ref, dtype, "k")
    if dtype == torch.bfloat16 and INTERPRETING:
        # The interpreter rounds each product like eager bf16: bit-exact. Compiled for the GPU, the
        # mul+add contracts into an FMA (one rounding fewer), so only the 3-way bound above applies.
        assert torch.equal(q_out, q_pt) and torch.equal(k_out, k_pt)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "n{}_h{}_kv{}_d{}".format(*c))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_qk_norm_then_rotary_matches_reference(dtype, case):
    """`norm=QKNorm(...)`: each head RMS-normalised (its own q / k weight) before the rotation, one launch."""
    n, nh, kvh, d = case
    torch.manual_seed(2)
    qkv = (4 * torch.randn(n, (nh + 2 * kvh) * d, device=DEVICE)).to(dtype)  # rows stride (NH + 2 KVH) D
    q, k = qkv[:, : nh * d].view(n, nh, d), qkv[:, nh * d: (nh + kvh) * d].view(n, kvh, d)
    norm = QKNorm((1 + torch.rand(d, device=DEVICE)).to(dtype), (0.5 + torch.rand(d, device=DEVICE)).to(dtype), 1e-6)
    norm32 = QKNorm(norm.q_weight.float(), norm.k_weight.float(), norm.eps)
    positions = torch.randint(0, MAX_POS, (n,), device=DEVICE)
    cos, sin = _tables(d, dtype)
    before = qkv.clone()
    q_out, k_out = rotary.apply_rotary(q, k, positions, cos, sin, norm=norm)
    assert torch.equal(qkv, before), "the copy form wrote its input"
    q_pt, k_pt = apply_rotary_ref(q, k, positions, cos, sin, norm)
    q_ref, k_ref = apply_rotary_ref(q.float(), k.float(), positions, cos.float(), sin.float(), norm32)
    assert q_out.dtype == dtype and q_out.is_contiguous() and k_out.shape == k.shape
    assert_close_3way(q_out, q_pt, q_ref, dtype, "q")
    assert_close_3way(k_out, k_pt, k_ref, dtype, "k")


def test_fp32_tables_with_bf16_activations():
    torch.manual_seed(1)
    q = torch.randn(4, 4, 32, device=DEVICE).to(torch.bfloat16)
    k = torch.randn(4, 2, 32, device=DEVICE).to(torch.bfloat16)
    positions = torch.tensor([0, 5, 36, 5], device=DEVICE)
    cos, sin = _tables(32, torch.float32)
    q_out, k_out = rotary.apply_rotary(q, k, positions, cos, sin)
    q_ref, k_ref = apply_rotary_ref(q.float(), k.float(), positions, cos, sin)
    assert q_out.dtype == torch.bfloat16
    # one rounding of the fp32 result
    torch.testing.assert_close(q_out, q_ref.to(torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(k_out, k_ref.to(torch.bfloat16), rtol=0, atol=0)


def test_empty_batch_and_contract():
    cos, sin = _tables(16, torch.float32)
    q = torch.empty(0, 2, 16, device=DEVICE)
    q_out, _ = rotary.apply_rotary(q, q, torch.empty(0, dtype=torch.long, device=DEVICE), cos, sin)
    assert q_out.shape == (0, 2, 16)
    q = torch.randn(2, 2, 16, device=DEVICE)
    with pytest.raises(AssertionError, match="positions"):
        rotary.apply_rotary(q, q, torch.zeros(2, device=DEVICE), cos, sin)
    with pytest.raises(AssertionError, match="tables"):
        rotary.apply_rotary(q, q, torch.zeros(2, dtype=torch.long, device=DEVICE), cos[:, :8], sin)
