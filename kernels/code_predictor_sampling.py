"""One draw per row from fp32 logits (the code predictor's and the talker's), one program per row: the
GREEDY and TOPK modes of `q3tts.models.sampling.warp_and_draw` in one launch (its torch reference:
`warp_and_draw_reference`; `warp_and_draw` calls this kernel where the kernels serve the logits).

GREEDY: argmax (first index of the maximum, as torch). TOPK: temperature (an exact division, so
the same scaled values) -> keep scores >= the row's k-th largest (k clamped to [1, cap]; found by a
radix select of 16 rounds on order-preserving integer keys of the scores, no sort: the same threshold and
ties as `apply_top_k_capped`) -> softmax -> inverse-CDF draw with the row's uniform, clamped to the
last id of non-zero probability; greedy rows take the argmax. The kept set is exactly the
reference's; the probabilities are summed in another order, so a draw can differ from the reference
only where u * total lands within fp32 rounding of a CDF step.
Each program's warp count is tuned once per vocabulary and mode (`warp_candidates`). Values that need not wait
for each other share a reduction (each is a dependent round through shared memory): the row's argmax, maximum
and NaN count; the CDF's total and its last id of non-zero probability.
The finite guard is the reference's (`guard_ids`): a row whose scores (after temperature) hold a NaN
or +inf, or are all -inf, draws id 0 and is or-ed into `faults`.
The talker's draw (`TalkerScores`) first runs its processors on the row, as `models.sampling.sample_talker`
does in torch (about 15 launches): the repetition penalty on the ids the row generated (s / p if s > 0 else
s * p; an exact division), EOS at -inf while fewer than min_new_tokens frames were generated, and every id
from suppress_start on at -inf but EOS.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._cast import _INTERPRET
from ._launch import device_guard, programmatic_launch
from .autotune import pick
from .code_predictor_gemm import wait_for_previous


class TalkerScores(NamedTuple):
    """The talker's processors before its draw: generated [B, V] bool (the row's history), penalty [B] float
    (repetition penalty), num_generated [B] int, and the codec's ids."""

    generated: torch.Tensor
    penalty: torch.Tensor
    num_generated: torch.Tensor
    eos_id: int
    min_new_tokens: int
    suppress_start: int


@triton.jit
def _talker_scores(x, idx, valid, r, gen_ptr, pen_ptr, ngen_ptr, stride_gen, stride_pen, stride_ngen, eos_id,
                   min_new, suppress_start):
    """The row x [BLOCK_V] after the repetition penalty, the EOS block and the suppressed range."""
    generated = tl.load(gen_ptr + r * stride_gen + idx, mask=valid, other=0) != 0
    p = tl.zeros_like(x) + tl.load(pen_ptr + r * stride_pen).to(tl.float32)
    x = tl.where(generated, tl.where(x > 0, tl.math.div_rn(x, p), x * p), x)
    blocked = tl.load(ngen_ptr + r * stride_ngen) < min_new
    x = tl.where(blocked & (idx == eos_id), float("-inf"), x)
    return tl.where((idx >= suppress_start) & (idx != eos_id), float("-inf"), x)


# NOTE: the interpreter runs a reduction with a combine function of ours lane by lane in Python (minutes a row at
# 2048 lanes); there the same values come from its own sums and maxima, one reduction each (ints sum exactly;
# maxima and first indices do not depend on the order)
_ONE_REDUCTION = tl.constexpr(not _INTERPRET.value)


@triton.jit
def _first_max(v1, i1, n1, v2, i2, n2):
    """`_summary`'s combine: the larger value and the first index on ties (tl.argmax's tie_break_left), and the
    NaN count."""
    first = (v1 > v2) | ((v1 == v2) & (i1 < i2))
    return tl.where(first, v1, v2), tl.where(first, i1, i2), n1 + n2


@triton.jit
def _summary(x, idx):
    """In one reduction, of a row x [BLOCK_V]: the first index of its maximum (torch's argmax), the maximum, and
    whether the row is not finite: a NaN or +inf, or all -inf (torch: ~isfinite(amax)). Where the row holds a
    NaN only the last is meaningful."""
    nan = (x != x).to(tl.int32)
    if _ONE_REDUCTION:
        top, best, nans = tl.reduce((x, idx, nan), 0, _first_max)
    else:
        best, top, nans = tl.argmax(x, 0, tie_break_left=True), tl.max(x, 0), tl.sum(nan, 0)
    return best, top, (nans > 0) | (top == float("inf")) | (top == float("-inf"))


@triton.jit
def _maxima(a1, b1, a2, b2):
    return tl.maximum(a1, a2), tl.maximum(b1, b2)


@triton.jit
def _max2(a, b):
    """The maxima of a and b (both [BLOCK_V]) in one reduction."""
    if _ONE_REDUCTION:
        return tl.reduce((a, b), 0, _maxima)
    else:
        return tl.max(a, 0), tl.max(b, 0)


_COUNT_BITS = tl.constexpr(21)  # a field of _kth_largest's packed counts: a row holds fewer lanes than 2**21
_FIELD = tl.constexpr((1 << _COUNT_BITS.value) - 1)


@triton.jit
def _kth_largest(x, valid, k):
    """The k-th largest of x [BLOCK_V] where valid (duplicates counted; 1 <= k <= count).

    Keys map fp32 order onto uint32 order (negatives: bits inverted, others: the sign bit set); the largest
    key T with #(key >= T) >= k is found two bits a round from the top, and is the key of the k-th largest
    value. A round counts the keys >= prefix | v << shift for v = 1, 2, 3 in one reduction (each count in its
    own _COUNT_BITS field of an int64 sum) and keeps the largest v whose count reaches k (the counts fall as v
    grows): the bit-by-bit search's T in 16 dependent reductions, not 32.
    Invalid lanes take key 0, which no candidate T (>= 1) counts."""
    bits = x.to(tl.uint32, bitcast=True)
    key = tl.where(bits >= 0x80000000, ~bits, bits | 0x80000000)
    key = tl.where(valid, key, 0)
    prefix = tl.zeros([], tl.uint32)
    for shift in tl.static_range(30, -1, -2):
        packed = tl.sum((key >= (prefix | (1 << shift))).to(tl.int64)
                        + ((key >= (prefix | (2 << shift))).to(tl.int64) << _COUNT_BITS)
                        + ((key >= (prefix | (3 << shift))).to(tl.int64) << 2 * _COUNT_BITS), 0)
        best = (((packed & _FIELD) >= k).to(tl.uint32)
                + (((packed >> _COUNT_BITS) & _FIELD) >= k).to(tl.uint32)
                + ((packed >> 2 * _COUNT_BITS) >= k).to(tl.uint32))  # the largest v (0..3) whose count reaches k
        prefix = prefix | (best << shift)
    bits = tl.where(prefix >= 0x80000000, prefix & 0x7FFFFFFF, ~prefix)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _sample_kernel(
    # pointers
    logits_ptr, temp_ptr, topk_ptr, greedy_ptr, u_ptr, out_ptr, faults_ptr, gen_ptr, pen_ptr, ngen_ptr,
    # sizes
    cap, eos_id, min_new, suppress_start,
    # strides (parameters and outputs may be strided columns of the engine's tables)
    stride_l, stride_t, stride_k, stride_g, stride_u, stride_o, stride_f, stride_gen, stride_pen, stride_ngen,
    # meta
    V: tl.constexpr, BLOCK_V: tl.constexpr, TOPK: tl.constexpr, HAS_FAULTS: tl.constexpr,
    TALKER: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)  # every input may come from the kernel before
    r = tl.program_id(0).to(tl.int64)
    idx = tl.arange(0, BLOCK_V)
    valid = idx < V
    x = tl.load(logits_ptr + r * stride_l + idx, mask=valid, other=float("-inf"))
    if TALKER:
        x = _talker_scores(x, idx, valid, r, gen_ptr, pen_ptr, ngen_ptr, stride_gen, stride_pen, stride_ngen,
                           eos_id, min_new, suppress_start)
    if TOPK:
        greedy = tl.load(greedy_ptr + r * stride_g) != 0
        temp = tl.where(greedy, 1.0, tl.load(temp_ptr + r * stride_t).to(tl.float32))
        scaled = tl.math.div_rn(x, tl.zeros_like(x) + temp)
        best, top, bad = _summary(scaled, idx)  # a greedy row's scaled scores are its scores
        k = tl.minimum(tl.maximum(tl.load(topk_ptr + r * stride_k), 1), tl.minimum(cap, V))
        kept = tl.where(scaled < _kth_largest(scaled, valid, k), float("-inf"), scaled)
        e = tl.where(valid, tl.exp(kept - top), 0.0)  # top: the kept maximum (k >= 1), where the row is finite
        probs = e / tl.sum(e, 0)
        cdf = tl.cumsum(probs, 0)
        total, last = _max2(cdf, tl.where((probs > 0) & valid, idx, -1))
        drawn = tl.sum(((cdf <= tl.load(u_ptr + r * stride_u).to(tl.float32) * total) & valid).to(tl.int32), 0)
        best = tl.where(greedy, best, tl.minimum(drawn, last))
    else:
        best, _, bad = _summary(x, idx)
    if HAS_FAULTS:
        fault = tl.load(faults_ptr + r * stride_f) != 0
        tl.store(faults_ptr + r * stride_f, fault | bad)
    tl.store(out_ptr + r * stride_o, tl.where(bad, 0, best).to(tl.int64))


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
           greedy: torch.Tensor, u: torch.Tensor, topk: bool, cap: int,
           out: torch.Tensor | None = None, faults: torch.Tensor | None = None,
           talker: TalkerScores | None = None) -> torch.Tensor:
    """ids [B] int64 from fp32 logits [B, V] (last dim contiguous).

    topk False: argmax of every row (GREEDY mode). topk True (TOPK mode; valid when every
    non-greedy row has 1 <= top_k <= cap): temperature [B] f32, top_k [B] int, greedy [B] bool,
    u [B] f32 uniforms. faults [B] bool: or-ed with the rows the finite guard sent to id 0.
    talker: the talker's processors run on the logits first (`TalkerScores`).
    Parameter tensors, `out` and `faults` may be strided views."""
    bsz, vocab = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(-1) == 1, \
        f"sample: logits must be fp32 with a contiguous last dim, got {logits.dtype}"
    assert vocab < 1 << _COUNT_BITS.value, f"sample: {vocab} ids overflow the top-k search's packed counts"
    rows = (("temperature", temperature), ("top_k", top_k), ("greedy", greedy), ("u", u))
    if talker is not None:
        rows += (("penalty", talker.penalty), ("num_generated", talker.num_generated))
        assert talker.generated.shape == (bsz, vocab) and talker.generated.dtype == torch.bool \
            and talker.generated.stride(-1) == 1 and talker.generated.device == logits.device, \
            f"sample: generated must be bool [{bsz}, {vocab}] on {logits.device}, last dim contiguous"
    for name, t in rows:
        assert t.shape == (bsz,), f"sample: {name} {tuple(t.shape)} != ({bsz},)"
        assert t.device == logits.device, f"sample: {name} on {t.device}, logits on {logits.device}"
    assert greedy.dtype == torch.bool and not top_k.is_floating_point(), \
        f"sample: greedy must be bool, top_k int; got {greedy.dtype}, {top_k.dtype}"
    if out is None:
        out = torch.empty(bsz, dtype=torch.int64, device=logits.device)
    assert out.shape == (bsz,) and out.dtype == torch.int64, "sample: out must be int64 [B]"
    assert faults is None or (faults.shape == (bsz,) and faults.dtype == torch.bool), \
        "sample: faults must be bool [B]"
    if bsz == 0:
        return out
    block_v = triton.next_power_of_2(vocab)
    pdl = programmatic_launch(logits)

    t = talker or TalkerScores(greedy, u, u, 0, 0, 0)  # unread without talker

    def launch(num_warps: int) -> None:  # idempotent: out overwritten, faults or-ed
        _sample_kernel[(bsz,)](
            logits, temperature, top_k, greedy, u, out, faults if faults is not None else greedy,
            t.generated, t.penalty, t.num_generated,
            cap, t.eos_id, t.min_new_tokens, t.suppress_start,
            logits.stride(0), temperature.stride(0), top_k.stride(0), greedy.stride(0),
            u.stride(0), out.stride(0), faults.stride(0) if faults is not None else 0,
            t.generated.stride(0), t.penalty.stride(0), t.num_generated.stride(0),
            V=vocab, BLOCK_V=block_v, TOPK=topk, HAS_FAULTS=faults is not None, TALKER=talker is not None,
            PDL=pdl, num_warps=num_warps, launch_pdl=pdl,
        )

    # NOTE: the talker's draw is its own kernel: its own key (a warp count timed without the processors may
    # never have compiled with them)
    key = ("sample" + ("/talker" if talker is not None else ""), block_v, topk)
    with device_guard(logits):
        launch(pick(key, warp_candidates(block_v, topk, talker is not None), launch, logits.device))
    return out


def warp_candidates(block_v: int, topk: bool, talker: bool = False) -> list[int]:
    """The warps a draw's program may run with, the heuristic first (the CPU's; the GPU times them once per
    vocabulary and mode, never per batch). One program is one row's chain of reductions (GREEDY: one; TOPK: 16
    select rounds and 5 more), each across the program's warps, with 2+ warps through shared memory and a
    barrier: fewer warps hold more of the row each, and one warp reduces by shuffles alone. TOPK, and the
    talker's processors (which hold its history too), offer 1 warp only up to a 2048-wide row: on sm_90 TOPK
    holds that row in 255 registers, none spilled, and both spill from a 4096-wide one (96 and 352 bytes a
    thread when last measured)."""
    first = 8 if block_v >= 4096 else 4
    one = (1,) if not (topk or talker) or block_v <= 2048 else ()
    return [first] + [w for w in (*one, 2, 8) if w != first]
