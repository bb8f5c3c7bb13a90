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


# (batch, c_in, c_out, kernel, dilation, new samples T): T < history, T == history, T > history, k1, one
# sample, channel counts off the block sizes; several time tiles (BLOCK_T 128): tiles wholly in x, and
# (history 140) a second tile that still reaches into the history
HISTORY_CASES = [(2, 16, 20, 7, 3, 5), (1, 17, 24, 7, 1, 6), (2, 24, 16, 3, 1, 1), (2, 16, 16, 7, 9, 70),
                 (1, 20, 33, 3, 2, 4), (2, 16, 16, 1, 1, 9), (1, 24, 1, 7, 1, 1), (1, 16, 16, 7, 1, 300),
                 (1, 16, 16, 3, 70, 200)]


def _split(case, dtype, residual: bool):
    """`_inputs`, with x split into its history [B, C_in, (K-1)·d] and the new samples [B, C_in, T]."""
    x, w, b, d, r = _inputs(case, dtype, residual)
    hist = (w.shape[-1] - 1) * d
    return x, x[..., :hist].contiguous(), x[..., hist:].contiguous(), w, b, d, r


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("case", HISTORY_CASES, ids=lambda c: "b{}_ci{}_co{}_k{}_d{}_t{}".format(*c))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_conv1d_with_history_equals_conv1d_of_the_concatenation(dtype, case, residual, bias):
    """history= reads the samples before x in place: bit for bit the kernel on cat(history, x)."""
    full, history, new, w, b, d, r = _split(case, dtype, residual)
    b = b if bias else None
    want = conv1d.causal_conv1d(full, w, b, d, r, impl="triton")
    got = conv1d.causal_conv1d(new, w, b, d, r, impl="triton", history=history)
    assert got.shape == want.shape == (case[0], case[2], case[5]) and got.dtype == dtype
    assert torch.equal(got, want), f"max diff {(got.float() - want.float()).abs().max().item()}"
    oik = conv1d.causal_conv1d(new, w, b, d, r, impl="triton", history=history,
                               weight_oik=w.permute(2, 0, 1).contiguous().permute(1, 2, 0))
    assert torch.equal(oik, want)
    # the cuDNN choice concatenates, then runs the reference
    assert torch.equal(conv1d.causal_conv1d(new, w, b, d, r, impl="cudnn", history=history),
                       causal_conv1d_ref(full, w, b, d, r))


def test_conv1d_history_as_strided_views():
    """history and x as time-slices of wider buffers (the streaming states are views of a packed pool)."""
    full, _, _, w, b, d, r = _split((2, 16, 16, 7, 3, 8), torch.float32, True)
    gen = torch.Generator().manual_seed(11)
    pool = torch.randn(2, 16, 50, generator=gen).to(DEVICE)
    pool[..., 7:25] = full[..., :18]
    wide = torch.randn(2, 16, 20, generator=gen).to(DEVICE)
    wide[..., 3:11] = full[..., 18:]
    got = conv1d.causal_conv1d(wide[..., 3:11], w, b, d, r, impl="triton", history=pool[..., 7:25])
    assert torch.equal(got, conv1d.causal_conv1d(full, w, b, d, r, impl="triton"))


def test_conv1d_wrapper_passes_history_on_both_paths(monkeypatch):
    """kernels.causal_conv1d: the Triton path (the kernel in the interpreter) and the reference path
    (cat + F.conv1d)."""
    import q3tts.kernels as K

    full, history, new, w, b, d, r = _split((2, 16, 20, 7, 3, 4), torch.float32, True)
    monkeypatch.setenv("Q3TTS_TRITON_ON_CPU", "1")
    assert K.use_triton(new)
    assert torch.equal(K.causal_conv1d(new, w, b, d, r, history=history),  # on CUDA: untuned, so cuDNN
                       conv1d.causal_conv1d(full, w, b, d, r))
    monkeypatch.setenv("Q3TTS_KERNELS", "torch")
    assert not K.use_triton(new)
    got = K.causal_conv1d(new, w, b, d, r, history=history)
    assert got.shape == (2, 20, 4) and torch.equal(got, causal_conv1d_ref(full, w, b, d, r))


def test_conv1d_history_tuning_key_says_split(monkeypatch):
    """The tuner keys the split form apart from the concatenated one (their costs differ: cuDNN's cat).
    Runs on CPU by making the wrapper believe x is on CUDA; the fake tuner records the key and stops."""
    import contextlib

    class Tuned(Exception):
        pass

    keys = []

    def fake_choose(key, impls, launch, device, default):
        keys.append(key)
        raise Tuned

    _, history, new, w, _, d, _ = _split((1, 16, 16, 3, 1, 4), torch.float32, False)  # new: [1, 16, 4]
    monkeypatch.setattr(conv1d, "batch_invariant", lambda: False)
    monkeypatch.setattr(conv1d, "choose", fake_choose)
    monkeypatch.setattr(conv1d, "device_guard", lambda t: contextlib.nullcontext())
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
        for args, kw in (((new, w, None, d), {"history": history}), ((new, w, None, d), {})):
            with pytest.raises(Tuned):
                conv1d.causal_conv1d(*args, **kw)
    # the same x shape [1, 16, 4]: only the flag tells them apart
    assert len(keys) == 2 and keys[0][1] == keys[1][1]
    assert keys[0][-1] is True and keys[1][-1] is False and keys[0][:-1] == keys[1][:-1]


def test_conv1d_rejects_a_history_of_the_wrong_length():
    x = torch.randn(1, 8, 4, device=DEVICE)
    with pytest.raises(AssertionError, match="history"):
        conv1d.causal_conv1d(x, torch.randn(8, 8, 3, device=DEVICE), None, dilation=2,
                             history=torch.randn(1, 8, 3, device=DEVICE))
