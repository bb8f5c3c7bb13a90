"""Inputs, references and checks of the code-predictor kernel tests at any shapes: TINY for the
interpreter tests, REAL (the 1.7B code predictor) for the GPU tests.

Every output is poisoned (NaN) before the kernel writes it and every launch must leave its ticket
counters at zero. Tolerance: kernel_checks.assert_close_3way (2x the same-dtype torch error against
the fp32 reference, plus the dtype's atol). The fused code predictor's bf16 fidelity: every pass
teacher-forced to the same codes (`forced_logits`), its logits against the eager passes'.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from kernel_checks import assert_close_3way
from q3tts.core import SamplingParams
from q3tts.kernels import code_predictor_reference as R
from q3tts.kernels.reference import rope_cos_sin
from q3tts.models.sampling import NUM_UNIFORMS, SamplingTensors, SubtalkerSampler

EPS = 1e-6


class Shapes(NamedTuple):
    hidden: int
    inter: int
    heads: int
    kv_heads: int
    head_dim: int
    positions: int
    vocab: int
    talker_hidden: int  # input width of the projection


TINY = Shapes(48, 96, 4, 2, 16, 16, 64, 64)  # the 'tiny' preset (a smaller head for speed)
REAL = Shapes(1024, 3072, 16, 8, 128, 16, 2048, 2048)


class Inputs:
    """Seeded random tensors on one device."""

    def __init__(self, device: str, *seed: int):
        self.device = device
        self.gen = torch.Generator(device=device).manual_seed(hash(seed) % (1 << 31))

    def randn(self, *shape, scale=1.0, dtype=torch.float32) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.gen, device=self.device) * scale).to(dtype)

    def weight(self, rows, cols, dtype) -> torch.Tensor:
        return self.randn(rows, cols, scale=cols ** -0.5, dtype=dtype)

    def norm_weight(self, dim, dtype) -> torch.Tensor:
        return (1 + self.randn(dim, scale=0.1)).to(dtype)

    def ids(self, rows, high) -> torch.Tensor:
        """A strided column of ids, as the fused predictor passes its codes table."""
        return torch.randint(0, high, (rows, 3), generator=self.gen, device=self.device)[:, 1]

    def poisoned(self, *shape, dtype) -> torch.Tensor:
        return torch.full(shape, float("nan"), dtype=dtype, device=self.device)

    def counters(self) -> torch.Tensor:
        return torch.zeros(4096, dtype=torch.int32, device=self.device)


def row_stats(x: torch.Tensor) -> torch.Tensor:
    """The row statistics of x [M, K] as `linear_residual` writes them: fp32 sums of squares over each
    STAT_COLS columns [M, K / STAT_COLS]."""
    from q3tts.kernels.code_predictor_gemm import STAT_COLS
    return (x.float() ** 2).unflatten(1, (-1, STAT_COLS)).sum(-1)


def _f32(to32: bool, *ts):
    return [t.float() if to32 and t.is_floating_point() else t for t in ts]


class GemmCase(NamedTuple):
    name: str
    run: Callable  # (counters, config, out) -> out
    ref: Callable  # (to32: bool) -> the reference output (fp32 inputs when to32)
    out_shape: tuple
    out_dtype: torch.dtype


def gemm_cases(cpk, s: Shapes, rows: int, dtype: torch.dtype, inp: Inputs) -> list[GemmCase]:
    """One case per GEMM kernel use of a pass, for `rows` batch rows."""
    h, hidden, inter = inp.randn(rows, s.hidden, scale=2, dtype=dtype), s.hidden, s.inter
    x_in = inp.randn(rows, s.talker_hidden, dtype=dtype)
    proj_w, proj_b = inp.weight(hidden, s.talker_hidden, dtype), inp.randn(hidden, scale=0.02, dtype=dtype)
    o_x, o_w = inp.randn(rows, s.heads * s.head_dim, dtype=dtype), \
        inp.weight(hidden, s.heads * s.head_dim, dtype)
    act, down_w = inp.randn(rows, inter, dtype=dtype), inp.weight(hidden, inter, dtype)
    nw, gate_up_w, head_w = inp.norm_weight(hidden, dtype), inp.weight(2 * inter, hidden, dtype), \
        inp.weight(s.vocab, hidden, dtype)
    h2 = inp.randn(2 * rows, hidden, scale=2, dtype=dtype)  # two tokens per row (pass 0)
    f = _f32
    return [
        GemmCase("project",
                 lambda c, cfg, o: cpk.project(x_in, proj_w, proj_b, c, config=cfg, out=o),
                 lambda t: R.project_ref(*f(t, x_in, proj_w, proj_b)), (rows, hidden), dtype),
        GemmCase("o_proj + residual",
                 lambda c, cfg, o: cpk.linear_residual(o_x, o_w, h, c, config=cfg, out=o),
                 lambda t: R.linear_residual_ref(*f(t, o_x, o_w, h)), (rows, hidden), dtype),
        GemmCase("down + residual",
                 lambda c, cfg, o: cpk.linear_residual(act, down_w, h, c, config=cfg, out=o),
                 lambda t: R.linear_residual_ref(*f(t, act, down_w, h)), (rows, hidden), dtype),
        GemmCase("norm + gate_up",
                 lambda c, cfg, o: cpk.norm_gate_up(h, nw, gate_up_w, EPS, c, config=cfg, out=o),
                 lambda t: R.norm_gate_up_ref(*f(t, h, nw, gate_up_w), EPS), (rows, inter), dtype),
        GemmCase("norm + head",
                 lambda c, cfg, o: cpk.norm_head(h, nw, head_w, EPS, c, config=cfg, out=o),
                 lambda t: R.norm_head_ref(*f(t, h, nw, head_w), EPS), (rows, s.vocab),
                 torch.float32),
        GemmCase("norm + head, last of 2 tokens",
                 lambda c, cfg, o: cpk.norm_head(h2, nw, head_w, EPS, c, 2, config=cfg, out=o),
                 lambda t: R.norm_head_ref(*f(t, h2, nw, head_w), EPS, 2), (rows, s.vocab),
                 torch.float32),
        GemmCase("norm + gate_up from row statistics",
                 lambda c, cfg, o: cpk.norm_gate_up(h, nw, gate_up_w, EPS, c, config=cfg, out=o, stats=row_stats(h)),
                 lambda t: R.norm_gate_up_ref(*f(t, h, nw, gate_up_w), EPS), (rows, inter), dtype),
    ]


def check_gemms(cpk, s: Shapes, rows: int, dtype: torch.dtype, inp: Inputs, config) -> None:
    """Every case against its references, then the residual launch's row statistics."""
    for case in gemm_cases(cpk, s, rows, dtype, inp):
        counters = inp.counters()
        out = case.run(counters, config, inp.poisoned(*case.out_shape, dtype=case.out_dtype))
        assert out.dtype == case.out_dtype
        assert_close_3way(out, case.ref(False), case.ref(True), dtype, f"{case.name} ({rows} rows)")
        assert not counters.any(), f"{case.name}: counters left non-zero"
    check_stats_written(cpk, s, rows, dtype, inp, config)


def check_stats_written(cpk, s: Shapes, rows: int, dtype: torch.dtype, inp: Inputs, config) -> None:
    """linear_residual's row statistics are its output's (`row_stats`, up to the fp32 summation order), every
    entry of the rows written and none past them."""
    x, w, h = inp.randn(rows, s.inter, dtype=dtype), inp.weight(s.hidden, s.inter, dtype), \
        inp.randn(rows, s.hidden, scale=2, dtype=dtype)
    stats = inp.poisoned(rows + 1, row_stats(h).shape[1], dtype=torch.float32)
    out = cpk.linear_residual(x, w, h, inp.counters(), config=config, stats=stats)
    torch.testing.assert_close(stats[:rows], row_stats(out), rtol=1e-5, atol=0.0)
    assert stats[rows:].isnan().all(), "linear_residual: statistics written past the rows"


def check_gather(cpk, s: Shapes, bsz: int, dtype: torch.dtype, inp: Inputs, config) -> None:
    """A later pass's first layer: rows by id from a table (a strided column of ids, as the codes table gives
    them) make the same output and cache entries, bit for bit, as the gathered rows passed in, and land in
    rows_out (the layer's residual input)."""
    table, ids = inp.randn(50, s.hidden, scale=2, dtype=dtype), inp.ids(bsz, 50)
    weights = (inp.norm_weight(s.hidden, dtype), inp.weight((s.heads + 2 * s.kv_heads) * s.head_dim, s.hidden, dtype),
               inp.norm_weight(s.head_dim, dtype), inp.norm_weight(s.head_dim, dtype))
    rope = rope_cos_sin(torch.arange(s.positions, device=inp.device), s.head_dim, 1e6, dtype)
    cache = [inp.randn(bsz, s.positions, s.kv_heads, s.head_dim, dtype=dtype) for _ in range(2)]  # earlier passes'
    given, gathered = [c.clone() for c in cache], [c.clone() for c in cache]
    args = (3, 1, EPS, s.head_dim ** -0.5)
    want = cpk.qkv_attention(table[ids], *weights, *rope, *given, *args, inp.counters(), config=config)
    rows_out, counters = inp.poisoned(bsz, s.hidden, dtype=dtype), inp.counters()
    got = cpk.qkv_attention(table, *weights, *rope, *gathered, *args, counters, config=config, ids=ids,
                            rows_out=rows_out, out=inp.poisoned(bsz, s.heads * s.head_dim, dtype=dtype))
    assert torch.equal(got, want) and torch.equal(rows_out, table[ids])
    assert all(torch.equal(a, b) for a, b in zip(gathered, given)) and not counters.any()


class AttentionFrame:
    """One layer's qkv_attention inputs and three caches that evolve pass by pass: the kernel's,
    the reference's in the same dtype, and the fp32 reference's. In the kernel's cache, positions no
    pass has written yet and rows past the batch hold NaN (it must never read them); the references
    read every slot of a page and mask, so theirs start at zero (as the eager cache does)."""

    def __init__(self, cpk, s: Shapes, bsz: int, dtype: torch.dtype, inp: Inputs):
        self.cpk, self.s, self.bsz, self.dtype, self.inp = cpk, s, bsz, dtype, inp
        self.weights = (inp.norm_weight(s.hidden, dtype),
                        inp.weight((s.heads + 2 * s.kv_heads) * s.head_dim, s.hidden, dtype),
                        inp.norm_weight(s.head_dim, dtype), inp.norm_weight(s.head_dim, dtype))
        positions = torch.arange(s.positions, device=inp.device)
        self.rope = rope_cos_sin(positions, s.head_dim, 1e6, dtype)
        shape = (bsz + 1, s.positions, s.kv_heads, s.head_dim)
        self.kernel = [inp.poisoned(*shape, dtype=dtype) for _ in range(2)]
        self.ref = [torch.zeros_like(c) for c in self.kernel]
        self.ref32 = [c.float() for c in self.ref]

    def run_pass(self, pos0: int, tokens: int, counters: torch.Tensor, config) -> None:
        """One pass: output and every cache entry written so far match the references."""
        s, dtype, rows = self.s, self.dtype, self.bsz * tokens
        x = self.inp.randn(rows, s.hidden, scale=2, dtype=dtype)
        args = (pos0, tokens, EPS, s.head_dim ** -0.5)
        out = self.cpk.qkv_attention(x, *self.weights, *self.rope, *self.kernel, *args, counters,
                                     config=config,
                                     out=self.inp.poisoned(rows, s.heads * s.head_dim, dtype=dtype))
        ref = R.qkv_attention_ref(x, *self.weights, *self.rope, *self.ref, *args)
        ref32 = R.qkv_attention_ref(*_f32(True, x, *self.weights, *self.rope), *self.ref32, *args)
        assert_close_3way(out, ref, ref32, dtype, f"attention at {pos0}")
        seen = slice(0, pos0 + tokens)
        for got, want, want32 in zip(self.kernel, self.ref, self.ref32):
            assert_close_3way(got[:self.bsz, seen], want[:self.bsz, seen], want32[:self.bsz, seen],
                              dtype, f"cache after {pos0}")
            assert got[:self.bsz, pos0 + tokens:].isnan().all() and got[self.bsz:].isnan().all()
        assert not counters.any(), "qkv_attention: counters left non-zero"

    def run_frame(self, config, passes=((0, 2), (2, 1), (3, 1), (4, 1), (5, 1))) -> None:
        """Pass 0 (2 tokens per row at positions 0, 1), then one-token passes (through position 5:
        the attention reads the cache in chunks of 4 positions, so the last two passes span two)."""
        counters = self.inp.counters()
        for pos0, tokens in passes:
            self.run_pass(pos0, tokens, counters, config)


class ForcedDraws(SubtalkerSampler):
    """Teacher forcing: draws the given codes [B, 15] (c1..c15) and keeps each group's logits.

    The eager and the fused passes call it at every pass, so they see the same inputs at every pass
    and their logits compare pass by pass (free-running greedy codes do not: one flipped near-tie
    changes every later pass's input)."""

    def __init__(self, codes: torch.Tensor):
        bsz = codes.shape[0]
        params = SamplingTensors.subtalker([SamplingParams(greedy=True)] * bsz, codes.device)
        super().__init__(params, torch.zeros(bsz, NUM_UNIFORMS, device=codes.device))
        self.codes = codes
        self.logits: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, group: int,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        self.logits.append(logits.float().clone())
        ids = self.codes[:, group - 1]
        return ids if out is None else out.copy_(ids)


def forced_logits(generate, past_hidden: torch.Tensor, c0: torch.Tensor,
                  codes: torch.Tensor) -> torch.Tensor:
    """fp32 logits [15, B, V] of `generate`'s passes (a `CodePredictor.generate` contract) fed the
    codes [B, 15]."""
    sampler = ForcedDraws(codes)
    generate(past_hidden, c0, sampler)
    return torch.stack(sampler.logits)


def _fidelity(logits: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(relative error ||logits - ref|| / ||ref||, share of (group, row) argmaxes equal to
    ref's)."""
    rel = ((logits - ref).norm() / ref.norm()).item()
    return rel, (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()


def assert_as_faithful(fused: torch.Tensor, eager: torch.Tensor, ref: torch.Tensor) -> None:
    """Forced logits [15, B, V] of the fused passes no further from the fp32 reference's than the
    eager passes' in the same dtype: relative error within 5 %, argmax agreement within 2 points."""
    fused_err, fused_agree = _fidelity(fused, ref)
    eager_err, eager_agree = _fidelity(eager, ref)
    assert fused_err <= 1.05 * eager_err and fused_agree >= eager_agree - 0.02, \
        f"vs fp32: fused error {fused_err:.4f}, argmax agreement {fused_agree:.3f}; eager " \
        f"{eager_err:.4f}, {eager_agree:.3f}"
