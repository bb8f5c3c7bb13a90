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


# the flat tiling (columns = (batch row, position) flattened, BLOCK_N wide): (batch, c_in, c_out, kernel,
# dilation, T_out, BLOCK_N). T_out < BLOCK_N with tiles that start mid-row (5 rows of 5 in tiles of 16),
# T_out == BLOCK_N, T_out > BLOCK_N not dividing it (rows straddle tiles), K=1 with 6 rows per tile,
# T_out = 1, channels off the block sizes, a long dilated history
FLAT_CASES = [(5, 24, 20, 7, 3, 5, 16), (3, 16, 20, 7, 1, 16, 16), (2, 17, 33, 7, 9, 20, 16),
              (5, 24, 16, 1, 1, 5, 32), (3, 20, 24, 3, 2, 1, 16), (2, 16, 16, 7, 9, 40, 32)]


def _flat_inputs(case, dtype, residual: bool, bias: bool, split: bool):
    """-> (full x, kwargs of the call under test: x (new samples when split), history=, w, b, d, r)."""
    bsz, c_in, c_out, k, d, t, _ = case
    full, history, new, w, b, d, r = _split((bsz, c_in, c_out, k, d, t), dtype, residual)
    call = dict(x=new, history=history) if split and k > 1 else dict(x=full)
    return full, dict(call, weight=w, bias=b if bias else None, dilation=d, residual=r)


@pytest.mark.parametrize("split", [False, True], ids=["concat", "history"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("case", FLAT_CASES, ids=lambda c: "b{}_ci{}_co{}_k{}_d{}_t{}_n{}".format(*c))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_flat_tiling_gives_the_row_tilings_bits(dtype, case, residual, bias, split):
    """With the row tiling's BLOCK_O and BLOCK_I (same products, same order) the flat tiling gives the
    row kernel's bits, whichever batch rows and positions share its tiles."""
    full, call = _flat_inputs(case, dtype, residual, bias, split)
    bsz, c_in, c_out, _, _, t, block_n = case
    block_o, block_i = conv1d._blocks(c_in, c_out, t)[:2]
    want = conv1d.causal_conv1d(full, call["weight"], call["bias"], call["dilation"], call["residual"], impl="triton")
    got = conv1d.causal_conv1d(**call, impl=conv1d.FlatTiles(block_o, block_i, block_n, 4, 2))
    assert got.shape == want.shape == (bsz, c_out, t) and got.dtype == dtype
    assert torch.equal(got, want), f"max diff {(got.float() - want.float()).abs().max().item()}"


def _channels_last(t: torch.Tensor | None) -> torch.Tensor | None:
    """The same values stored [B, L, C] (a [B, C, L] view with channel stride 1)."""
    return None if t is None else t.transpose(1, 2).contiguous().transpose(1, 2)


# the channels-last tiling: (batch, c_in, c_out, kernel, dilation, T_out, BLOCK_M) as FLAT_CASES, plus channel
# counts past two input blocks and a history longer than a tile
CL_CASES = [*FLAT_CASES, (2, 80, 24, 7, 3, 9, 16), (1, 16, 16, 3, 30, 70, 16)]


@pytest.mark.parametrize("split", [False, True], ids=["concat", "history"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("case", CL_CASES, ids=lambda c: "b{}_ci{}_co{}_k{}_d{}_t{}_m{}".format(*c))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_channels_last_tiling_matches_the_reference(dtype, case, residual, bias, split):
    """x (and its history) stored channels-last take the channels-last tiling: within the reference's tolerance,
    and the split history gives the bits of the concatenated input, whichever rows share a tile."""
    full, call = _flat_inputs(case, dtype, residual, bias, split)
    bsz, c_in, c_out, _, _, t, block_m = case
    call = dict(call, x=_channels_last(call["x"]), history=_channels_last(call.get("history")))
    assert conv1d.is_channels_last(call["x"], call["history"])
    tiles = conv1d.ChannelsLastTiles(block_m, *conv1d._cl_configs(c_in, c_out)[0][1:])
    got = conv1d.causal_conv1d(**call, impl=tiles)
    w, b, d, r = call["weight"], call["bias"], call["dilation"], call["residual"]
    out_pt = causal_conv1d_ref(full, w, b, d, r)
    out_ref = causal_conv1d_ref(full.double(), w.double(), None if b is None else b.double(), d,
                                None if r is None else r.double())
    assert got.shape == (bsz, c_out, t) and got.dtype == dtype and got.stride(-1) == 1
    assert_close_3way(got, out_pt, out_ref, dtype, f"conv1d channels-last {dtype} {case}")
    concat = conv1d.causal_conv1d(_channels_last(full), w, b, d, r, impl=tiles)
    assert torch.equal(got, concat), f"max diff {(got.float() - concat.float()).abs().max().item()}"


def test_channels_last_rows_do_not_depend_on_the_batch():
    """A batch row's output from the channels-last default is the same alone and among other rows (tiles span rows)."""
    _, history, new, w, b, d, r = _split((5, 24, 20, 7, 3, 3), torch.bfloat16, True)
    x, h = _channels_last(new), _channels_last(history)
    together = conv1d.causal_conv1d(x, w, b, d, r, impl="triton", history=h)
    for row in range(5):
        alone = conv1d.causal_conv1d(x[row:row + 1], w, b, d, r[row:row + 1], impl="triton", history=h[row:row + 1])
        assert torch.equal(alone, together[row:row + 1]), f"row {row}"


def test_channels_last_calls_time_their_own_candidates(monkeypatch):
    """A channels-last call offers the tuner cuDNN and the channels-last configs (its own key); a time-contiguous
    x with a channels-last history is refused."""
    import contextlib

    _, history, new, w, b, d, r = _split((3, 16, 20, 7, 3, 4), torch.float32, True)
    offered, keys = [], []

    def fake_choose(key, impls, launch, device, default):
        offered.append(impls)
        keys.append(key)
        return impls[-1]

    monkeypatch.setattr(conv1d, "choose", fake_choose)
    monkeypatch.setattr(conv1d, "batch_invariant", lambda: False)
    monkeypatch.setattr(conv1d, "device_guard", lambda t: contextlib.nullcontext())
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
        tuned = conv1d.causal_conv1d(_channels_last(new), w, b, d, r, history=_channels_last(history))
        conv1d.causal_conv1d(new, w, b, d, r, history=history)
    impls = conv1d.candidates(16, 20, 4, channels_last=True)
    assert offered[0] == impls and impls[:2] == ("cudnn", "triton") and len(impls) > 2
    assert all(isinstance(c, conv1d.ChannelsLastTiles) for c in impls[2:])
    assert keys[0][-1] == "channels_last" and keys[1][-1] is True  # the history flag closes the other key
    assert torch.equal(tuned, conv1d.causal_conv1d(_channels_last(new), w, b, d, r, impl=impls[-1],
                                                   history=_channels_last(history)))
    with pytest.raises(AssertionError, match="contiguous"):
        conv1d.causal_conv1d(new, w, b, d, r, history=_channels_last(history))


# T_out = 1 (flat candidates: one column tile; two, with a partial second), longer (cuDNN and rows only)
CANDIDATE_CASES = [(3, 40, 72, 3, 1, 1), (70, 24, 20, 7, 3, 1), (4, 96, 20, 3, 1, 160), (3, 24, 1, 7, 1, 200)]


@pytest.mark.parametrize("channels_last", [False, True], ids=["time_contiguous", "channels_last"])
@pytest.mark.parametrize("case", CANDIDATE_CASES, ids=lambda c: "b{}_ci{}_co{}_k{}_d{}_t{}".format(*c))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_tuning_candidate_matches_the_reference(dtype, case, channels_last):
    """Each of `candidates()` (their own BLOCK_I: other sums than the row kernel's) within the reference's
    tolerance, on the history-split form the codec runs, residual fused; time-contiguous and channels-last."""
    full, history, new, w, b, d, r = _split(case, dtype, True)
    out_pt = causal_conv1d_ref(full, w, b, d, r)
    out_ref = causal_conv1d_ref(full.double(), w.double(), b.double(), d, r.double())
    impls = conv1d.candidates(case[1], case[2], case[5], channels_last)
    if channels_last:
        new, history = _channels_last(new), _channels_last(history)
        assert impls[:2] == ("cudnn", "triton") and all(isinstance(c, conv1d.ChannelsLastTiles) for c in impls[2:])
    else:
        rows, flat = ([c for c in impls if isinstance(c, kind)] for kind in (conv1d.RowTiles, conv1d.FlatTiles))
        assert impls == ("cudnn", "triton", *rows, *flat) and rows and bool(flat) == (case[5] == 1)  # flat: T_out = 1
    for impl in impls:
        out = conv1d.causal_conv1d(new, w, b, d, r, impl=impl, history=history)
        assert_close_3way(out, out_pt, out_ref, dtype, f"conv1d {impl} {dtype} {case}")


def test_flat_configs_survive_the_tuning_tables_pickle():
    """A tuned table holding a `FlatTiles` is saved with pickle and read back by autotune's restricted
    unpickler (only q3tts.kernels classes)."""
    import io
    import pickle

    from q3tts.kernels import autotune

    cfg = conv1d.candidates(512, 1024, 1)[-1]
    assert hash(cfg) == hash(conv1d.FlatTiles(*cfg))
    assert autotune._TableUnpickler(io.BytesIO(pickle.dumps({"k": cfg}, protocol=5))).load() == {"k": cfg}


def test_conv1d_tunes_the_candidates_and_keeps_rows_when_batch_invariant(monkeypatch):
    """On CUDA (faked) the tuner gets `candidates()`; under batch_invariant() it is not asked and the row kernel
    runs."""
    import contextlib

    full, history, new, w, b, d, r = _split((3, 16, 20, 7, 3, 1), torch.float32, True)
    offered = []

    def fake_choose(key, impls, launch, device, default):
        offered.append(impls)
        return impls[-1]

    monkeypatch.setattr(conv1d, "choose", fake_choose)
    monkeypatch.setattr(conv1d, "device_guard", lambda t: contextlib.nullcontext())
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
        m.setattr(conv1d, "batch_invariant", lambda: False)
        tuned = conv1d.causal_conv1d(new, w, b, d, r, history=history)
        m.setattr(conv1d, "batch_invariant", lambda: True)
        invariant = conv1d.causal_conv1d(new, w, b, d, r, history=history)
    assert offered == [conv1d.candidates(16, 20, 1)] and isinstance(offered[0][-1], conv1d.FlatTiles)
    assert torch.equal(tuned, conv1d.causal_conv1d(new, w, b, d, r, history=history, impl=offered[0][-1]))
    assert torch.equal(invariant, conv1d.causal_conv1d(full, w, b, d, r, impl="triton"))


def test_conv1d_rejects_an_unknown_impl():
    x = torch.randn(1, 8, 10, device=DEVICE)
    with pytest.raises(AssertionError, match="impl"):
        conv1d.causal_conv1d(x, torch.randn(8, 8, 3, device=DEVICE), None, impl="flat")


# one streamed frame of the full codec (perf/bench_codec_layers.py lists them): (c_in, c_out, kernel, dilation,
# T_out, residual): pre_conv, the first decoder conv, each decoder block's k7 d1/3/9 and k1 (+ residual), the output
CODEC_FRAME = [(512, 1024, 3, 1, 1, False), (1024, 1536, 7, 1, 4, False),
               *((c, c, 7, d, t, False) for c, t in ((768, 32), (384, 160), (192, 640), (96, 1920)) for d in (1, 3, 9)),
               *((c, c, 1, 1, t, True) for c, t in ((768, 32), (384, 160), (192, 640), (96, 1920))),
               (96, 1, 7, 1, 1920, False)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("shape", CODEC_FRAME, ids=lambda s: "ci{}_co{}_k{}_d{}_t{}_r{:d}".format(*s))
def test_every_candidate_at_the_codec_frame_shapes_batch64(shape):
    """Each tuning candidate at batch 64 (bf16, history split, kernel weight layout, as the engine runs
    them; time-contiguous and channels-last) within the reference's tolerance."""
    import q3tts.kernels as K

    c_in, c_out, k, d, t, residual = shape
    bsz, dtype, hist = 64, torch.bfloat16, (k - 1) * d
    gen = torch.Generator(device="cuda").manual_seed(sum(shape))
    full = torch.randn(bsz, c_in, hist + t, device="cuda", generator=gen).to(dtype)
    w = (torch.randn(c_out, c_in, k, device="cuda", generator=gen) / (c_in * k) ** 0.5).to(dtype)
    b = torch.randn(c_out, device="cuda", generator=gen).to(dtype)
    r = torch.randn(bsz, c_out, t, device="cuda", generator=gen).to(dtype) if residual else None
    history, new = (full[..., :hist].contiguous(), full[..., hist:].contiguous()) if hist else (None, full)
    out_pt = causal_conv1d_ref(full, w, b, d, r)
    out_ref = causal_conv1d_ref(full.double(), w.double(), b.double(), d, None if r is None else r.double())
    oik = K.conv_kernel_weight(w)
    for channels_last in (False, True):
        x, h = (_channels_last(new), _channels_last(history)) if channels_last else (new, history)
        for impl in conv1d.candidates(c_in, c_out, t, channels_last):
            out = conv1d.causal_conv1d(x, w, b, d, r, oik, impl=impl, history=h)
            assert_close_3way(out, out_pt, out_ref, dtype, f"conv1d {impl} {shape}")


def _tilings(case) -> list:
    """Every launch form of a case: the row tiling's default and other configs, the flat tiling, cuDNN (time-contiguous
    x), and the channels-last tilings (x stored channels-last)."""
    _, c_in, c_out, _, _, t = case
    rows = ["triton", *conv1d._row_configs(c_in, c_out, t), conv1d.FlatTiles(*conv1d._blocks(c_in, c_out, t)[:2], 16),
            "cudnn"]
    return [(False, impl) for impl in rows] + [(True, impl) for impl in conv1d._cl_configs(c_in, c_out)]


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("case", [(2, 24, 20, 7, 3, 9), (1, 17, 33, 1, 1, 70)],
                         ids=lambda c: "b{}_ci{}_co{}_k{}_d{}_t{}".format(*c))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_snake_in_the_epilogue_gives_the_two_calls_bits(dtype, case, residual):
    """`snake=` (and `keep_conv=`) on every tiling: the conv's output and the snake kernel's channels-last output of
    it, bit for bit, the activation stored channels-last. The snake is of the rounded output, residual included (one
    of the unrounded sum differs in bf16)."""
    snake = kernel_module("snake")
    x, w, b, d, r = _inputs(case, dtype, residual)
    gen = torch.Generator().manual_seed(7)
    alpha, beta = ((0.5 * torch.randn(case[2], generator=gen)).to(DEVICE, dtype) for _ in range(2))
    for cl, impl in _tilings(case):
        xi = _channels_last(x) if cl else x
        out = conv1d.causal_conv1d(xi, w, b, d, r, impl=impl)
        want = snake.snake_beta(out, alpha, beta, channels_last=True)
        act = conv1d.causal_conv1d(xi, w, b, d, r, impl=impl, snake=(alpha, beta))
        kept, act2 = conv1d.causal_conv1d(xi, w, b, d, r, impl=impl, snake=(alpha, beta), keep_conv=True)
        assert act.stride(1) == 1 and act2.stride(1) == 1 and kept.stride(-1) == 1, impl
        assert torch.equal(act, want) and torch.equal(act2, want) and torch.equal(kept, out), impl



@pytest.mark.parametrize("phases", [2, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_phases_interleave_a_transposed_convs_outputs_in_the_epilogue(dtype, phases):
    """`phases=`: conv channel o·phases + r stored at position t·phases + r of output channel o, on every tiling, bit
    for bit the plain conv's output interleaved; with a snake of the output channels (`keep_conv`), the snake
    kernel's channels-last output of the interleaved conv."""
    snake = kernel_module("snake")
    case = (2, 24, 4 * phases, 2, 1, 6)  # a k = 2s transposed conv as a conv: 2 taps over (history, x)
    x, w, b, d, _ = _inputs(case, dtype, False)
    bsz, t, c_out = case[0], case[-1], case[2] // phases
    gen = torch.Generator().manual_seed(phases)
    alpha, beta = ((0.5 * torch.randn(c_out, generator=gen)).to(DEVICE, dtype) for _ in range(2))
    for cl, impl in _tilings(case):
        xi = _channels_last(x) if cl else x
        plain = conv1d.causal_conv1d(xi, w, b, d, impl=impl)
        want = plain.view(bsz, c_out, phases, t).transpose(2, 3).reshape(bsz, c_out, t * phases)
        got = conv1d.causal_conv1d(xi, w, b, d, impl=impl, phases=phases)
        kept, act = conv1d.causal_conv1d(xi, w, b, d, impl=impl, phases=phases, snake=(alpha, beta), keep_conv=True)
        assert got.shape == kept.shape == act.shape == (bsz, c_out, t * phases) and act.stride(1) == 1, impl
        assert torch.equal(got, want) and torch.equal(kept, want), impl
        assert torch.equal(act, snake.snake_beta(want, alpha, beta, channels_last=True)), impl
