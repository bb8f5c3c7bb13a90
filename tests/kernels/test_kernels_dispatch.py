"""q3tts.kernels wrappers: torch reference on plain CPU tensors, Triton when asked (or on CUDA)."""

from __future__ import annotations

import pytest
import torch

import q3tts.kernels as K
from q3tts.kernels import reference as R


def _inputs():
    torch.manual_seed(0)
    x = torch.randn(3, 4, 16)
    w = torch.randn(16)
    q, k = torch.randn(3, 4, 16), torch.randn(3, 2, 16)
    cos, sin = torch.randn(8, 16), torch.randn(8, 16)
    pos = torch.tensor([0, 7, 3])
    cache = torch.randn(4, 4, 2, 16)
    tables = torch.tensor([[0, 1], [2, 3], [1, 0]], dtype=torch.int32)
    lens = torch.tensor([5, 0, 8], dtype=torch.int32)
    return x, w, q, k, cos, sin, pos, cache, tables, lens


@pytest.fixture
def no_triton(monkeypatch):
    """Make every Triton wrapper explode, so that reaching one fails the test."""
    if not K.HAS_TRITON:
        return

    def boom(*args, **kwargs):
        raise RuntimeError("dispatched to Triton")

    for mod, name in ((K._rn, "rms_norm"), (K._rt, "apply_rotary"), (K._kv, "store_kv"),
                      (K._pa, "paged_decode_attention")):
        monkeypatch.setattr(mod, name, boom)


def test_cpu_tensors_use_the_references(no_triton, monkeypatch):
    monkeypatch.delenv("Q3TTS_TRITON_ON_CPU", raising=False)
    x, w, q, k, cos, sin, pos, cache, tables, lens = _inputs()
    assert not K.use_triton(x)
    assert torch.equal(K.rms_norm(x, w, 1e-6), R.rms_norm_ref(x, w, 1e-6))
    out, res = K.rms_norm(x, w, 1e-6, residual=x)
    assert torch.equal(res, x + x) and torch.equal(out, R.rms_norm_ref(x + x, w, 1e-6))
    q_rot, k_rot = K.apply_rotary(q, k, pos, cos, sin)
    ref_q, ref_k = R.apply_rotary_ref(q, k, pos, cos, sin)
    assert torch.equal(q_rot, ref_q) and torch.equal(k_rot, ref_k)
    q2, k2 = q.clone(), k.clone()
    q_in, k_in = K.apply_rotary(q2, k2, pos, cos, sin, inplace=True)
    assert q_in is q2 and torch.equal(q2, ref_q) and torch.equal(k2, ref_k)
    kc, vc, kc_ref, vc_ref = (torch.zeros_like(cache) for _ in range(4))
    slots = torch.tensor([3, -1, 9])
    K.store_kv(k, k, kc, vc, slots)
    R.store_kv_ref(k, k, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    qa = torch.randn(3, 4, 16)
    assert torch.equal(K.paged_decode_attention(qa, cache, cache, tables, lens, 0.25),
                       R.paged_decode_attention_ref(qa, cache, cache, tables, lens, 0.25))
    K.warmup(num_heads=4, num_kv_heads=2, head_dim=16, hidden_sizes=(32,), page_size=4,
             dtype=torch.float32, device="cpu")  # no-op on CPU


@pytest.mark.skipif(not K.HAS_TRITON, reason="triton is not installed")
def test_interpreter_flag_dispatches_to_triton(no_triton, monkeypatch):
    x, w = _inputs()[:2]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("Q3TTS_TRITON_ON_CPU", "1")
    assert K.use_triton(x)
    with pytest.raises(RuntimeError, match="dispatched to Triton"):
        K.rms_norm(x, w, 1e-6)
    monkeypatch.setenv("Q3TTS_KERNELS", "torch")  # forced reference wins
    assert not K.use_triton(x)
    assert torch.equal(K.rms_norm(x, w, 1e-6), R.rms_norm_ref(x, w, 1e-6))


def test_public_wrappers_run_the_kernels_when_asked(monkeypatch):
    from kernel_checks import DEVICE, kernel_module

    if DEVICE != "cpu":
        pytest.skip("CPU interpreter path only")
    kernel_module("rmsnorm")  # skips unless the kernels are interpreted
    monkeypatch.setenv("Q3TTS_TRITON_ON_CPU", "1")
    x, w, q, k, cos, sin, pos, cache, tables, lens = _inputs()
    torch.testing.assert_close(K.rms_norm(x, w, 1e-6), R.rms_norm_ref(x, w, 1e-6))
    pairs = zip(K.apply_rotary(q, k, pos, cos, sin), R.apply_rotary_ref(q, k, pos, cos, sin))
    for got, want in pairs:
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(K.paged_decode_attention(q, cache, cache, tables, lens, 0.25),
                               R.paged_decode_attention_ref(q, cache, cache, tables, lens, 0.25))
    K.warmup(num_heads=4, num_kv_heads=2, head_dim=16, hidden_sizes=(32,), page_size=4,
             dtype=torch.float32, device="cpu", batch_sizes=(1, 3))


def test_programmatic_launch_only_on_a_device_that_has_it():
    """PDL is off by default and never on CPU tensors even when switched on."""
    from q3tts.kernels._launch import programmatic_launch

    w = torch.zeros(64, 1024, dtype=torch.bfloat16)
    assert not programmatic_launch(w)
    K.set_programmatic_launch(True)
    try:
        assert not programmatic_launch(w)  # CPU
    finally:
        K.set_programmatic_launch(False)
