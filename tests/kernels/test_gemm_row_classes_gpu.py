"""GPU: the skinny GEMMs tuned per row class at the real 1.7B code-predictor shapes (hidden 1024,
intermediate 3072, projection from 2048), `linear` at the talker's (2048 -> 2048 / 6144), and the
batch-invariant switch: under it a row's output is bit-equal alone and among 63 others.

The tuning runs inside `kernels.tuning()`, as in the engine's graph warm-up, so the row classes of
batch 64 and 256 take their own tuned configs (tolerance: kernel_checks.assert_close_3way).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from code_predictor_cases import EPS, REAL, Inputs, check_gemms
from kernel_checks import assert_close_3way, kernel_module

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
cpk = kernel_module("code_predictor")  # skips the module without triton
import q3tts.kernels as kernels  # noqa: E402
from q3tts.kernels.autotune import tuned_configs  # noqa: E402
from q3tts.kernels.code_predictor_gemm import row_class  # noqa: E402

BF16 = torch.bfloat16


@pytest.mark.parametrize("rows", [1, 16, 64, 256])
def test_gemm_kernels_tuned_per_row_class(rows):
    with kernels.tuning():
        check_gemms(cpk, REAL, rows, BF16, Inputs("cuda", 21, rows), None)
    tuned = [k for k in tuned_configs() if k[0] == "cp_norm_gate_up/norm+swiglu"]
    assert any(k[-1] == row_class(rows) for k in tuned), f"row class of {rows} not tuned: {tuned}"
    assert any(k[-1] == 1 for k in tuned) == (rows == 1), f"one-row class: {tuned}"  # a launch of one row's own


@pytest.mark.parametrize("rows", [1, 16, 64, 256, 2000])
@pytest.mark.parametrize("n", [2048, 6144])
def test_linear_matches_f_linear(n, rows):
    inp = Inputs("cuda", 22, n, rows)
    x, w, b = inp.randn(rows, 2048, dtype=BF16), inp.weight(n, 2048, BF16), \
        inp.randn(n, scale=0.5, dtype=BF16)
    with kernels.tuning():
        for bias in (None, b):
            out = kernels.linear(x, w, bias)
            want32 = F.linear(x.float(), w.float(), None if bias is None else bias.float())
            assert_close_3way(out, F.linear(x, w, bias), want32, BF16,
                              f"linear {rows} x {n} (bias={bias is not None})")


def _row_alone_equals_row_in_batch(fn, *batched) -> None:
    """fn on 64 rows vs fn on the first row alone: row 0 bit-equal (inside tuning(): a row class
    would be tuned here if the switch let one be used)."""
    with kernels.tuning():
        together = fn(*batched)
        alone = fn(*(t[:1] for t in batched))
    assert torch.equal(alone[0], together[0]), \
        f"max |diff| {(alone[0].float() - together[0].float()).abs().max().item():.3g}"


def test_gemms_are_batch_invariant_under_the_switch(invariant):
    inp, s = Inputs("cuda", 23), REAL
    counters = torch.zeros(4096, dtype=torch.int32, device="cuda")
    h = inp.randn(64, s.hidden, scale=2, dtype=BF16)
    x_in = inp.randn(64, s.talker_hidden, dtype=BF16)
    act = inp.randn(64, s.inter, dtype=BF16)
    proj_w, proj_b = inp.weight(s.hidden, s.talker_hidden, BF16), inp.randn(s.hidden, dtype=BF16)
    down_w, nw = inp.weight(s.hidden, s.inter, BF16), inp.norm_weight(s.hidden, BF16)
    gate_up_w = inp.weight(2 * s.inter, s.hidden, BF16)
    _row_alone_equals_row_in_batch(lambda x: kernels.linear(x, proj_w, proj_b), x_in)
    _row_alone_equals_row_in_batch(lambda x: cpk.project(x, proj_w, proj_b, counters), x_in)
    _row_alone_equals_row_in_batch(lambda x, r: cpk.linear_residual(x, down_w, r, counters), act, h)
    _row_alone_equals_row_in_batch(lambda x: cpk.norm_gate_up(x, nw, gate_up_w, EPS, counters), h)
    assert not counters.any()


def test_paged_attention_is_batch_invariant_under_the_switch(invariant):
    """64 rows over 32 pages of 16 each, contexts 1..512: row 0 alone == row 0 among them (off,
    batch 64 splits each context in 2, batch 1 in 4 or more)."""
    inp = Inputs("cuda", 24)
    pages = inp.randn(2048, 16, 8, 128, dtype=BF16)  # [pages, page size, KVH, D]
    q = inp.randn(64, 16, 128, dtype=BF16)
    tables = torch.arange(2048, dtype=torch.int32, device="cuda").view(64, 32)
    lens = torch.randint(1, 513, (64,), generator=inp.gen, device="cuda", dtype=torch.int32)
    lens[0] = 500  # long enough to span several splits
    _row_alone_equals_row_in_batch(
        lambda q, t, n: kernels.paged_decode_attention(q, pages, pages, t, n, 128 ** -0.5),
        q, tables, lens)


def test_codec_conv_is_batch_invariant_under_the_switch(invariant):
    """A K = 7 conv the tuning could hand to cuDNN: under the switch the kernel, row 0 bit-equal."""
    inp = Inputs("cuda", 25)
    x = inp.randn(64, 512, 46, dtype=BF16)
    w = inp.weight(512, 512 * 7, BF16).view(512, 512, 7)  # [C_out, C_in, K]
    b = inp.randn(512, scale=0.1, dtype=BF16)
    _row_alone_equals_row_in_batch(lambda x: kernels.causal_conv1d(x, w, b), x)
