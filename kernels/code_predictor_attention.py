"""The first launch of a code-predictor layer: RMSNorm -> QKV GEMM -> QK-norm -> RoPE -> K/V cache
write -> attention over the row's <= 16 cached positions, all in one kernel.

Its GEMM programs (row blocks fastest, then QKV column tiles, then K slices) run the split-K GEMM of
code_predictor_gemm.py into fp32 partials and take a ticket on their (row block, kv head) group (its GROUP q heads,
its k and v columns, every slice). The group's epilogue: sum the partials, round to the model dtype, QK-norm, RoPE
from the [positions, D] tables, store k and v at the row's position of the small contiguous cache [B, P, KVH, D],
then attention of the GROUP heads over positions 0..pos (no paging), written to `out`. Who runs it:
- a launch of at most FEW_ROWS rows (`held_rows`: the 1-row step's passes after the first): the group's last GEMM
  program, holding only those rows: it loads every head's partial sums and the earlier positions' k and v before
  its first store and attends from registers (`_attend_few`: nothing read back, one round of loads in all); its
  norm statistics read the row in one round;
- a launch of one token a row over more rows (`spread`): row programs, one a (row, kv group), started after the
  GEMM programs (`_row_program`): each waits for its group's tickets, then runs the one-row epilogue above for its
  row, so a row block's 16 rows x 8 groups take 128 programs, not 8;
- a first pass (two tokens a row): the group's last GEMM program over the row block, the rotated q parked in `out`
  and attended head by head, CHUNK positions at a time (`_attend`). As the 16-row launches' epilogue it made them
  4.5-10 µs longer than their GEMM on an H100 (11.9 / 17.7 µs at pass 2 / 15, the GEMM alone 7.4: the program's
  own arithmetic, not L2 round trips, since attending both heads of a group on one k/v load made it slower,
  perf/results/RESULTS.md, forty-fifth session).
Rows are (batch row b, token t) = (r // T, r % T) at position pos0 + t: T = 2 on the first pass
(past hidden and c0 at positions 0, 1: a row block holds both tokens of a batch row, so position 1
sees position 0's k/v written by the same program), T = 1 after.
Roundings follow the eager layer (models/layers.py): bf16 GEMM output, rms_norm_ref's two roundings,
rotary products rounded when the tables have the activation dtype (kernels/rotary.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._cast import cast
from ._launch import device_guard
from .autotune import batch_invariant, choose, pick
from .code_predictor_gemm import (BLOCK_M, GATHER, NORM, GemmConfig, arrive, interpret_config,
                                  candidates, counters_needed, dot_precision, held_launch, held_rows,
                                  held_rstd, k_slice, load_sum, mainloop, row_blocks, row_offsets,
                                  store_partial, wait_for_previous, weights_before_wait)

_NEG = tl.constexpr(-1.0e30)  # finite "-inf": the first update has no inf - inf
# a jit function reads globals only as constexpr (the interpreter does not check)
_NORM, _GATHER = tl.constexpr(NORM), tl.constexpr(GATHER)
_CHUNK = tl.constexpr(4)  # cache positions the attention reads per step


@triton.jit
def _halves(part_ptr, rows, row_mask, cols, M_PAD, NP, DT: tl.constexpr, HALF: tl.constexpr,
            SPLIT: tl.constexpr):
    """The heads starting at columns `cols` [H] of the GEMM result, summed over the K slices and rounded to DT:
    their first and second halves [BLOCK_M, H, HALF], fp32."""
    d = tl.arange(0, HALF)
    at = tl.reshape(cols[:, None] + d[None, :], [cols.shape[0] * HALF])  # [H * HALF]
    shape: tl.constexpr = [rows.shape[0], cols.shape[0], HALF]
    x1 = cast(load_sum(part_ptr, rows, row_mask, at, M_PAD, NP, SPLIT), DT).to(tl.float32)
    x2 = cast(load_sum(part_ptr, rows, row_mask, at + HALF, M_PAD, NP, SPLIT), DT).to(tl.float32)
    return tl.reshape(x1, shape), tl.reshape(x2, shape)


@triton.jit
def _weight_halves(nw_ptr, HALF: tl.constexpr):
    """A QK-norm weight [2 * HALF] as its two halves [HALF], fp32."""
    d = tl.arange(0, HALF)
    return tl.load(nw_ptr + d).to(tl.float32), tl.load(nw_ptr + HALF + d).to(tl.float32)


@triton.jit
def _norm_rope_halves(x1, x2, w1, w2, c1, c2, s1, s2, eps, DT: tl.constexpr, HALF: tl.constexpr,
                      ROUND: tl.constexpr):
    """Heads x1, x2 [R, H, HALF] (`_halves`) or [R, HALF] (one head, `_head_sums`) RMS-normed over each head
    (weight halves w1, w2 [HALF]) and rotated (cos / sin halves c1, c2, s1, s2 [R, 1, HALF] or [R, HALF]).
    Returns the two halves, shaped as x1, in DT."""
    AXIS: tl.constexpr = len(x1.shape) - 1
    rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, AXIS) + tl.sum(x2 * x2, AXIS)) / (2 * HALF) + eps)  # [R, H] or [R]
    rstd = tl.expand_dims(rstd, AXIS)
    n1 = cast(cast(x1 * rstd, DT).to(tl.float32) * w1, DT).to(tl.float32)
    n2 = cast(cast(x2 * rstd, DT).to(tl.float32) * w2, DT).to(tl.float32)
    a1, b1, a2, b2 = n1 * c1, n2 * s1, n2 * c2, n1 * s2
    if ROUND:
        a1 = cast(a1, DT).to(tl.float32)
        b1 = cast(b1, DT).to(tl.float32)
        a2 = cast(a2, DT).to(tl.float32)
        b2 = cast(b2, DT).to(tl.float32)
    return cast(a1 - b1, DT), cast(a2 + b2, DT)


@triton.jit
def _group_heads(part_ptr, rows, row_mask, g, qn_ptr, kn_ptr, c1, c2, s1, s2, eps, M_PAD, NP, DT: tl.constexpr,
                 NUM_HEADS: tl.constexpr, NUM_KV: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr,
                 ROUND: tl.constexpr):
    """kv group g of the GEMM result, every load issued before any store: its GROUP q heads and its k head
    QK-normed and rotated, as halves [R, GROUP, D/2] and [R, 1, D/2] in DT, and its v head [R, D] (fp32 sums).
    Head by head between the stores, each head's loads cost a dependent round trip to L2 (a load placed after a
    store is issued after it: the compiler cannot tell the partials from the outputs apart); over BLOCK_M rows
    the heads' loads at once would spill, so only the few-rows epilogues take this."""
    GROUP: tl.constexpr = NUM_HEADS // NUM_KV
    HALF: tl.constexpr = D // 2
    j = tl.arange(0, GROUP)
    q1, q2 = _halves(part_ptr, rows, row_mask, (g * GROUP + j) * D, M_PAD, NP, DT, HALF, SPLIT)
    k1, k2 = _halves(part_ptr, rows, row_mask, (NUM_HEADS + g) * D + tl.zeros([1], tl.int32), M_PAD, NP, DT, HALF,
                     SPLIT)
    v = load_sum(part_ptr, rows, row_mask, (NUM_HEADS + NUM_KV + g) * D + tl.arange(0, D), M_PAD, NP, SPLIT)
    qw1, qw2 = _weight_halves(qn_ptr, HALF)
    kw1, kw2 = _weight_halves(kn_ptr, HALF)
    c1, c2, s1, s2 = c1[:, None, :], c2[:, None, :], s1[:, None, :], s2[:, None, :]
    q1, q2 = _norm_rope_halves(q1, q2, qw1, qw2, c1, c2, s1, s2, eps, DT, HALF, ROUND)
    k1, k2 = _norm_rope_halves(k1, k2, kw1, kw2, c1, c2, s1, s2, eps, DT, HALF, ROUND)
    return q1, q2, k1, k2, v


@triton.jit
def _store_halves(ptr, offs, x1, x2, mask, HALF: tl.constexpr):
    """Halves x1, x2 ([R, H, HALF] or [R, HALF]) to ptr + offs (each head's first half, shaped as x1) and
    offs + HALF."""
    tl.store(ptr + offs, x1, mask=mask)
    tl.store(ptr + offs + HALF, x2, mask=mask)


@triton.jit
def _store_heads_in_turn(part_ptr, q_ptr, stride_q, k_ptr, k_rows, k_mask, rows, row_mask, g, qn_ptr, kn_ptr, c1,
                         c2, s1, s2, eps, M_PAD, NP, DT: tl.constexpr, NUM_HEADS: tl.constexpr,
                         NUM_KV: tl.constexpr, D: tl.constexpr, SPLIT: tl.constexpr, ROUND: tl.constexpr):
    """kv group g of the GEMM result over BLOCK_M rows, head by head (`_group_heads` would spill there): its GROUP
    q heads QK-normed and rotated to q_ptr (row stride stride_q), its k head to k_ptr + k_rows [R] where k_mask
    [R, 1]. Returns its v head [R, D] (fp32 sums).
    Two heads deep: each head's sums are loaded before the store of the head before it (a load placed after a store
    is issued after it: the compiler cannot tell the partials from the outputs apart), so the group's loads cost 2
    dependent round trips to L2, not GROUP + 2. Timed at 16 rows on an H100 (perf/results/RESULTS.md, thirty-fifth
    session): 6.94 ms a step against 6.96 without it, within a run's spread."""
    GROUP: tl.constexpr = NUM_HEADS // NUM_KV
    HALF: tl.constexpr = D // 2
    d = tl.arange(0, HALF)[None, :]
    q_rows = rows.to(tl.int64)[:, None] * stride_q
    w1, w2 = _weight_halves(qn_ptr, HALF)
    x1, x2 = _head_sums(part_ptr, rows, row_mask, g * GROUP * D, M_PAD, NP, DT, HALF, SPLIT)
    for j in tl.static_range(GROUP):
        head = g * GROUP + j
        nxt = (head + 1) * D if j + 1 < GROUP else (NUM_HEADS + g) * D  # the next q head, or the k head
        n1, n2 = _head_sums(part_ptr, rows, row_mask, nxt, M_PAD, NP, DT, HALF, SPLIT)
        r1, r2 = _norm_rope_halves(x1, x2, w1, w2, c1, c2, s1, s2, eps, DT, HALF, ROUND)
        _store_halves(q_ptr, q_rows + head * D + d, r1, r2, row_mask[:, None], HALF)
        x1, x2 = n1, n2
    v = load_sum(part_ptr, rows, row_mask, (NUM_HEADS + NUM_KV + g) * D + tl.arange(0, D), M_PAD, NP, SPLIT)
    w1, w2 = _weight_halves(kn_ptr, HALF)
    r1, r2 = _norm_rope_halves(x1, x2, w1, w2, c1, c2, s1, s2, eps, DT, HALF, ROUND)
    _store_halves(k_ptr, k_rows[:, None] + d, r1, r2, k_mask, HALF)
    return v


@triton.jit
def _head_sums(part_ptr, rows, row_mask, col, M_PAD, NP, DT: tl.constexpr, HALF: tl.constexpr, SPLIT: tl.constexpr):
    """One head of the GEMM result (columns col..col+2*HALF), summed over the K slices and rounded to DT: its halves
    [BLOCK_M, HALF], fp32. Two-dimensional on purpose: as [BLOCK_M, 1, HALF] halves (`_halves`) the sm_90 build of
    the 16-row epilogue converted layouts through shared memory (BAR.SYNC 3 -> 40 after the ticket, LDG 78 -> 192),
    and the 16-row qkv launches of both models took 8-10 us more on the H200 (thirty-third session)."""
    d = tl.arange(0, HALF)
    x1 = cast(load_sum(part_ptr, rows, row_mask, col + d, M_PAD, NP, SPLIT), DT).to(tl.float32)
    x2 = cast(load_sum(part_ptr, rows, row_mask, col + HALF + d, M_PAD, NP, SPLIT), DT).to(tl.float32)
    return x1, x2


@triton.jit
def _attend(out_ptr, k_ptr, v_ptr, rows, row_mask, cache_rows, pos, last_pos, head, scale,
            stride_out, stride_kp, stride_vp, BLOCK_M: tl.constexpr, D: tl.constexpr):
    """Head `head` of each row over cache positions 0..pos (q read from, result written to out),
    CHUNK positions per step: their k and v loads are issued together (one dependent L2 round trip
    per chunk instead of per position); positions past a row's pos are neither read nor weighed."""
    d = tl.arange(0, D)
    o_offs = rows.to(tl.int64)[:, None] * stride_out + head * D + d[None, :]
    q = tl.load(out_ptr + o_offs, mask=row_mask[:, None], other=0.0).to(tl.float32)
    m_i = tl.full([BLOCK_M], _NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for p0 in range(0, last_pos + 1, _CHUNK):
        p = p0 + tl.arange(0, _CHUNK)  # [CHUNK]
        valid = p[None, :] <= pos[:, None]  # [BLOCK_M, CHUNK]
        read = (row_mask[:, None] & valid)[:, :, None]  # rows past M weigh zeros (no 0 / 0)
        at = cache_rows[:, None] + p.to(tl.int64)[None, :] * stride_kp  # [BLOCK_M, CHUNK]
        k = tl.load(k_ptr + at[:, :, None] + d[None, None, :], mask=read,
                    other=0.0).to(tl.float32)  # [BLOCK_M, CHUNK, D]
        at = cache_rows[:, None] + p.to(tl.int64)[None, :] * stride_vp
        v = tl.load(v_ptr + at[:, :, None] + d[None, None, :], mask=read, other=0.0).to(tl.float32)
        s = tl.where(valid, tl.sum(q[:, None, :] * k, 2) * scale, _NEG)  # [BLOCK_M, CHUNK]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        w = tl.where(valid, tl.exp(s - m_new[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(w, 1)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * v, 1)
        m_i = m_new
    tl.store(out_ptr + o_offs, cast(acc / l_i[:, None], out_ptr.dtype.element_ty),
             mask=row_mask[:, None])


@triton.jit
def _joined(x1, x2):
    """Halves [R, H, HALF] of heads -> the heads [R, H, 2 * HALF] (first half, then second), fp32."""
    x = tl.permute(tl.join(x1.to(tl.float32), x2.to(tl.float32)), (0, 1, 3, 2))  # [R, H, 2, HALF]
    return tl.reshape(x, [x1.shape[0], x1.shape[1], 2 * x1.shape[2]])


@triton.jit
def _cached_kv(k_ptr, v_ptr, b, g, pos, row_mask, stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh,
               P: tl.constexpr, D: tl.constexpr):
    """k and v [R, P, D] of kv head g at each row's positions before pos (earlier launches wrote them; zeros
    elsewhere), as stored."""
    d, p = tl.arange(0, D), tl.arange(0, P)
    read = (row_mask[:, None] & (p[None, :] < pos[:, None]))[:, :, None]  # [R, P, 1]
    at = (b * stride_kb + g * stride_kh)[:, None] + p.to(tl.int64)[None, :] * stride_kp
    k = tl.load(k_ptr + at[:, :, None] + d[None, None, :], mask=read, other=0.0)
    at = (b * stride_vb + g * stride_vh)[:, None] + p.to(tl.int64)[None, :] * stride_vp
    return k, tl.load(v_ptr + at[:, :, None] + d[None, None, :], mask=read, other=0.0)


@triton.jit
def _attend_few(out_ptr, q1, q2, k1, k2, v, k_old, v_old, rows, row_mask, pos, g, scale, stride_out,
                GROUP: tl.constexpr, P: tl.constexpr, D: tl.constexpr):
    """The group's GROUP heads of a few-rows launch's rows (all of them, one token each) over all their positions
    at once, from registers: q and this position's k and v as the epilogue made them (halves [R, GROUP | 1,
    D/2] in the model dtype, v [R, D] fp32 sums), the earlier positions' k and v as loaded with the partial sums
    (`_cached_kv`); one softmax over the row's positions. Positions past a row's pos are neither read nor
    weighed. (`_attend`, over BLOCK_M rows, reads everything back from the cache after the stores: a dependent
    round trip per CHUNK positions and per head.)"""
    p = tl.arange(0, P)
    valid = p[None, :] <= pos[:, None]  # [R, P]
    here = (p[None, :] == pos[:, None])[:, :, None]  # [R, P, 1]: this launch's position
    q = _joined(q1, q2)  # [R, GROUP, D]
    k = tl.where(here, _joined(k1, k2), k_old.to(tl.float32))  # [R, P, D]
    v = tl.where(here, cast(v, k_old.dtype).to(tl.float32)[:, None, :], v_old.to(tl.float32))
    s = tl.sum(q[:, :, None, :] * k[:, None, :, :], 3) * scale  # [R, GROUP, P]
    s = tl.where(valid[:, None, :], s, _NEG)
    w = tl.where(valid[:, None, :], tl.exp(s - tl.max(s, 2)[:, :, None]), 0.0)
    acc = tl.sum(w[:, :, :, None] * v[:, None, :, :], 2)  # [R, GROUP, D]
    q_offs = (rows.to(tl.int64)[:, None, None] * stride_out + ((g * GROUP + tl.arange(0, GROUP)) * D)[None, :, None]
              + tl.arange(0, D)[None, None, :])  # [R, GROUP, D]
    tl.store(out_ptr + q_offs, cast(acc / tl.sum(w, 2)[:, :, None], out_ptr.dtype.element_ty),
             mask=row_mask[:, None, None])


@triton.jit
def rope_halves(cos_ptr, sin_ptr, pos, row_mask, stride_cos, stride_sin, HALF: tl.constexpr):
    """The RoPE tables' rows at positions pos [R] (zeros where not row_mask): cos and sin halves c1, c2, s1, s2
    [R, HALF], fp32."""
    d = tl.arange(0, HALF)
    c_offs = pos.to(tl.int64)[:, None] * stride_cos + d[None, :]
    s_offs = pos.to(tl.int64)[:, None] * stride_sin + d[None, :]
    mask = row_mask[:, None]
    c1 = tl.load(cos_ptr + c_offs, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + c_offs + HALF, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + s_offs, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + s_offs + HALF, mask=mask, other=0.0).to(tl.float32)
    return c1, c2, s1, s2


@triton.jit
def wait_for_count(cnt_ptr, count):
    """Spin until the counter at cnt_ptr holds at least `count`, then acquire it: the program's later loads see
    what every program stored before its ticket (`arrive` releases them). Polled with plain loads, not atomics,
    so the waiting programs do not queue in front of the arrivals' tickets."""
    seen = tl.load(cnt_ptr, volatile=True)
    while seen < count:
        seen = tl.load(cnt_ptr, volatile=True)
    tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _group_epilogue(part_ptr, out_ptr, k_ptr, v_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, cnt_ptr, count,
                    rows, row_mask, g, pos0, eps, scale, M_PAD, NP,
                    stride_out, stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh,
                    stride_cos, stride_sin,
                    DT: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_KV: tl.constexpr,
                    D: tl.constexpr, T: tl.constexpr, SPLIT: tl.constexpr, ROUND: tl.constexpr,
                    BLOCK_M: tl.constexpr, HELD: tl.constexpr, P: tl.constexpr, WAIT: tl.constexpr):
    """kv group g's epilogue for rows [R]: a row block's BLOCK_M rows, or (HELD) the few rows the program holds
    (a few-rows launch's, or a spread launch's one row), which load everything before the first store. WAIT (a
    spread launch's row program): the partial sums are complete once the counter at cnt_ptr holds `count`; the
    loads that do not depend on them go first."""
    GROUP: tl.constexpr = NUM_HEADS // NUM_KV
    HALF: tl.constexpr = D // 2
    pos = pos0 + rows % T  # [R]
    b = (rows // T).to(tl.int64)
    d = tl.arange(0, HALF)
    c1, c2, s1, s2 = rope_halves(cos_ptr, sin_ptr, pos, row_mask, stride_cos, stride_sin, HALF)
    k_rows = b * stride_kb + pos.to(tl.int64) * stride_kp + g * stride_kh
    v_rows = b * stride_vb + pos.to(tl.int64) * stride_vp + g * stride_vh
    dd = tl.arange(0, D)
    if HELD:  # every load (the earlier positions' k and v too) before the first store
        tl.static_assert(T == 1, "a program that holds its rows takes one token a row")
        k_old, v_old = _cached_kv(k_ptr, v_ptr, b, g, pos, row_mask, stride_kb, stride_kp, stride_kh, stride_vb,
                                  stride_vp, stride_vh, P, D)
        if WAIT:
            wait_for_count(cnt_ptr, count)
        q1, q2, k1, k2, v = _group_heads(part_ptr, rows, row_mask, g, qn_ptr, kn_ptr, c1, c2, s1, s2, eps, M_PAD,
                                         NP, DT, NUM_HEADS, NUM_KV, D, SPLIT, ROUND)
        _store_halves(k_ptr, k_rows[:, None, None] + d[None, None, :], k1, k2, row_mask[:, None, None], HALF)
        tl.store(v_ptr + v_rows[:, None] + dd[None, :], cast(v, DT), mask=row_mask[:, None])
        _attend_few(out_ptr, q1, q2, k1, k2, v, k_old, v_old, rows, row_mask, pos, g, scale, stride_out, GROUP,
                    P, D)
    else:  # the rotated q is parked in out, where its attention output goes
        v = _store_heads_in_turn(part_ptr, out_ptr, stride_out, k_ptr, k_rows, row_mask[:, None], rows,
                                 row_mask, g, qn_ptr, kn_ptr, c1, c2, s1, s2, eps, M_PAD, NP, DT, NUM_HEADS, NUM_KV,
                                 D, SPLIT, ROUND)
        tl.store(v_ptr + v_rows[:, None] + dd[None, :], cast(v, DT), mask=row_mask[:, None])
        tl.debug_barrier()  # this program's k/v and q stores are read below by its other threads
        for j in tl.static_range(GROUP):
            _attend(out_ptr, k_ptr, v_ptr, rows, row_mask, b * stride_kb + g * stride_kh, pos,
                    pos0 + T - 1, g * GROUP + j, scale, stride_out, stride_kp, stride_vp,
                    BLOCK_M, D)


@triton.jit
def _copy_rows(x_ptr, x_off, row_mask, out_ptr, rows, stride_out, K, BLOCK_M: tl.constexpr):
    """out[rows] = the rows of x at element offsets x_off [BLOCK_M] (all K columns)."""
    CHUNK: tl.constexpr = 8192 // BLOCK_M
    out_off = rows.to(tl.int64) * stride_out
    for k0 in range(0, K, CHUNK):
        ks = k0 + tl.arange(0, CHUNK)
        mask = row_mask[:, None] & (ks < K)[None, :]
        tl.store(out_ptr + out_off[:, None] + ks[None, :],
                 tl.load(x_ptr + x_off[:, None] + ks[None, :], mask=mask), mask=mask)


@triton.jit
def qkv_group_partials(x_ptr, ids_ptr, nw_ptr, w_ptr, part_ptr, cnt_ptr, st_ptr, m, tile, split, later, M, K, eps,
                       M_PAD, stride_xm, stride_ids, stride_w, stride_st, NUM_HEADS: tl.constexpr,
                       NUM_KV: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       GATHER: tl.constexpr, ROWS: tl.constexpr, HOLD: tl.constexpr, STATS: tl.constexpr):
    """Program (row block m, column tile, K slice split)'s share of RMSNorm(X) @ W_qkv^T, stored as an fp32
    partial [SPLIT, M_PAD, (NH + 2 KVH) D], then a ticket on its (row block, kv head g) group: q heads g*GROUP..,
    k head g, v head g; `later` more tickets follow the group's GEMM programs' (a spread launch's row programs).
    HOLD: see `weights_before_wait`. GATHER: row m of X is row ids[m] of the table at x_ptr. ROWS: the rows the
    norm statistics hold (`held_rows`). STATS > 0: the statistics come from X's row-statistics buffer at st_ptr
    (`held_rstd`).
    Returns rows, row_mask [BLOCK_M], the rows' element offsets in x [BLOCK_M], g, and whether this
    is the group's last program (which runs the group's epilogue; never, with later tickets)."""
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    w_off = cols.to(tl.int64) * stride_w
    k_lo, k_hi = k_slice(split, K, SPLIT, BLOCK_K)
    held = weights_before_wait(w_ptr, w_off, k_lo, k_hi, HOLD)
    rows = m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    ROWS_FROM: tl.constexpr = _GATHER if GATHER else _NORM
    x_off = row_offsets(x_ptr, ids_ptr, rows, row_mask, 1, 0, stride_xm, stride_ids, ROWS_FROM)
    rstd = held_rstd(x_ptr, ids_ptr, st_ptr, x_off, row_mask, m, M, K, eps, 1, 0, stride_xm, stride_ids,
                     stride_st, ROWS_FROM, BLOCK_M, ROWS, STATS)
    acc = mainloop(x_ptr, x_off, row_mask, w_ptr, w_off, k_lo, k_hi, nw_ptr, rstd, held, _NORM, BLOCK_M,
                   BLOCK_N, BLOCK_K, DOT_PRECISION, HOLD)
    store_partial(part_ptr, acc, split, rows, row_mask, cols, M_PAD, (NUM_HEADS + 2 * NUM_KV) * D)
    g = _group_of(tile, NUM_HEADS, NUM_KV, D, BLOCK_N)
    return rows, row_mask, x_off, g, arrive(cnt_ptr + m * NUM_KV + g, _group_programs(NUM_HEADS, NUM_KV, D, BLOCK_N,
                                                                                      SPLIT) + later)


@triton.jit
def _group_of(tile, NUM_HEADS: tl.constexpr, NUM_KV: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr):
    """The kv group of column tile `tile`: its q heads' columns, or its k or v head's."""
    GROUP: tl.constexpr = NUM_HEADS // NUM_KV
    col0 = tile * BLOCK_N
    return tl.where(col0 < NUM_HEADS * D, col0 // (GROUP * D), (col0 - NUM_HEADS * D) // D % NUM_KV)


@triton.jit
def _group_programs(NUM_HEADS: tl.constexpr, NUM_KV: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                    SPLIT: tl.constexpr):
    """The GEMM programs of one (row block, kv group): its column tiles x the K slices."""
    return (NUM_HEADS // NUM_KV + 2) * D // BLOCK_N * SPLIT


@triton.jit
def _block_rows(M, m, BLOCK_M: tl.constexpr):
    """The rows of row block m: a spread launch's row programs of that block, whose tickets its groups' counters
    take after the GEMM programs'."""
    return tl.minimum(M - m * BLOCK_M, BLOCK_M)


@triton.jit
def _gemm_program(x_ptr, ids_ptr, nw_ptr, w_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, out_ptr,
                  rows_out_ptr, part_ptr, cnt_ptr, pid, blocks, M, K, pos0, eps, scale, M_PAD,
                  stride_xm, stride_ids, stride_w, stride_out, stride_rows_out, stride_kb, stride_kp, stride_kh,
                  stride_vb, stride_vp, stride_vh, stride_cos, stride_sin,
                  NUM_HEADS: tl.constexpr, NUM_KV: tl.constexpr, D: tl.constexpr, T: tl.constexpr,
                  ROUND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, ATT_ROWS: tl.constexpr,
                  P: tl.constexpr, GATHER: tl.constexpr, HOLD: tl.constexpr, SPREAD: tl.constexpr):
    """GEMM program pid: row block pid % blocks (row blocks fastest, so the programs that share a weight tile run
    together and re-read it from L2), then column tiles, then K slices; the last of its group runs the group's
    epilogue, unless SPREAD (the row programs run it)."""
    NP: tl.constexpr = (NUM_HEADS + 2 * NUM_KV) * D
    TILES: tl.constexpr = NP // BLOCK_N
    m, tile, split = pid % blocks, pid // blocks % TILES, pid // blocks // TILES
    later = _block_rows(M, m, BLOCK_M) if SPREAD else 0
    rows, row_mask, x_off, g, last = qkv_group_partials(  # the norm from the rows (no row statistics: STATS 0)
        x_ptr, ids_ptr, nw_ptr, w_ptr, part_ptr, cnt_ptr, x_ptr, m, tile, split, later, M, K, eps, M_PAD,
        stride_xm, stride_ids, stride_w, 0, NUM_HEADS, NUM_KV, D, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, DOT_PRECISION,
        GATHER, ATT_ROWS, HOLD, 0)
    if GATHER:  # the gathered rows are the layer's residual input: one program per row block keeps them
        if (tile == 0) & (split == 0):
            _copy_rows(x_ptr, x_off, row_mask, rows_out_ptr, rows, stride_rows_out, K, BLOCK_M)
    if not SPREAD:
        if last:  # the row block's rows, or (ATT_ROWS < BLOCK_M) the few rows a few-rows launch holds
            held = m * BLOCK_M + tl.arange(0, ATT_ROWS)
            _group_epilogue(part_ptr, out_ptr, k_ptr, v_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, cnt_ptr, 0,
                            held, held < M, g, pos0, eps, scale, M_PAD, NP,
                            stride_out, stride_kb, stride_kp, stride_kh, stride_vb, stride_vp,
                            stride_vh, stride_cos, stride_sin,
                            w_ptr.dtype.element_ty, NUM_HEADS, NUM_KV, D, T, SPLIT, ROUND, BLOCK_M,
                            ATT_ROWS < BLOCK_M, P, False)


@triton.jit
def _row_program(part_ptr, out_ptr, k_ptr, v_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, cnt_ptr, e, M, pos0, eps,
                 scale, M_PAD, stride_out, stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh,
                 stride_cos, stride_sin, DT: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_KV: tl.constexpr,
                 D: tl.constexpr, T: tl.constexpr, SPLIT: tl.constexpr, ROUND: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, P: tl.constexpr, PDL: tl.constexpr, SPREAD: tl.constexpr):
    """Row program e of a spread launch: row e // NUM_KV's epilogue in kv group e % NUM_KV, once the group's GEMM
    programs have all stored their partials (the one-row epilogue, `_attend_few`); the group's last row program
    resets its counter. Nothing without SPREAD (a launch with no row programs)."""
    if SPREAD:
        wait_for_previous(PDL)
        NP: tl.constexpr = (NUM_HEADS + 2 * NUM_KV) * D
        r, g = e // NUM_KV, e % NUM_KV
        m = r // BLOCK_M
        cnt = cnt_ptr + m * NUM_KV + g
        gemm = _group_programs(NUM_HEADS, NUM_KV, D, BLOCK_N, SPLIT)
        rows = r + tl.arange(0, 1)
        _group_epilogue(part_ptr, out_ptr, k_ptr, v_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, cnt, gemm, rows,
                        rows < M, g, pos0, eps, scale, M_PAD, NP, stride_out, stride_kb, stride_kp, stride_kh,
                        stride_vb, stride_vp, stride_vh, stride_cos, stride_sin, DT, NUM_HEADS, NUM_KV, D, T, SPLIT,
                        ROUND, BLOCK_M, True, P, True)
        arrive(cnt, gemm + _block_rows(M, m, BLOCK_M))


@triton.jit(do_not_specialize=["M", "pos0", "M_PAD"])
def _qkv_attention_kernel(
    # pointers
    x_ptr, ids_ptr, nw_ptr, w_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, out_ptr,
    rows_out_ptr, part_ptr, cnt_ptr,
    # sizes
    M, K, pos0, eps, scale, M_PAD,
    # strides
    stride_xm, stride_ids, stride_w, stride_out, stride_rows_out, stride_kb, stride_kp, stride_kh,
    stride_vb, stride_vp, stride_vh, stride_cos, stride_sin,
    # meta
    NUM_HEADS: tl.constexpr, NUM_KV: tl.constexpr, D: tl.constexpr, T: tl.constexpr,
    ROUND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, ATT_ROWS: tl.constexpr,
    P: tl.constexpr, GATHER: tl.constexpr, HOLD: tl.constexpr, SPREAD: tl.constexpr,
):
    # a one-dimensional grid: the GEMM programs, then (SPREAD) M * NUM_KV row programs, which the GPU starts after
    # every GEMM program (blocks start in order) and the interpreter runs after them, so a row program that waits
    # never holds back a program it waits for
    pid, blocks = tl.program_id(0), tl.cdiv(M, BLOCK_M)
    gemm = blocks * ((NUM_HEADS + 2 * NUM_KV) * D // BLOCK_N) * SPLIT
    if pid >= gemm:
        _row_program(part_ptr, out_ptr, k_ptr, v_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, cnt_ptr, pid - gemm, M,
                     pos0, eps, scale, M_PAD, stride_out, stride_kb, stride_kp, stride_kh, stride_vb, stride_vp,
                     stride_vh, stride_cos, stride_sin, w_ptr.dtype.element_ty, NUM_HEADS, NUM_KV, D, T, SPLIT,
                     ROUND, BLOCK_M, BLOCK_N, P, HOLD > 0, SPREAD)
    else:
        _gemm_program(x_ptr, ids_ptr, nw_ptr, w_ptr, qn_ptr, kn_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, out_ptr,
                      rows_out_ptr, part_ptr, cnt_ptr, pid, blocks, M, K, pos0, eps, scale, M_PAD, stride_xm,
                      stride_ids, stride_w, stride_out, stride_rows_out, stride_kb, stride_kp, stride_kh, stride_vb,
                      stride_vp, stride_vh, stride_cos, stride_sin, NUM_HEADS, NUM_KV, D, T, ROUND, BLOCK_M, BLOCK_N,
                      BLOCK_K, SPLIT, DOT_PRECISION, ATT_ROWS, P, GATHER, HOLD, SPREAD)


def qkv_candidates(qkv_weight: torch.Tensor, head_dim: int) -> list[GemmConfig]:
    """The launch configs `pick` times for a fused qkv kernel (this one and the talker's) on
    qkv_weight [(NH + 2 KVH) D, H]: column tiles that stay within one head."""
    fits = lambda bn: qkv_weight.shape[0] // bn if head_dim % bn == 0 else None  # noqa: E731
    return candidates(fits, qkv_weight.shape[1], qkv_weight.device)


def spread(rows: int, tokens: int) -> bool:
    """Whether a launch of `rows` rows of `tokens` tokens each runs its epilogues in row programs (`_row_program`,
    one a row and kv group, after the GEMM programs): one token a row, and rows it does not hold (`held_rows`;
    under `batch_invariant()` every launch of one token a row, so a row's arithmetic is one whatever the batch)."""
    return tokens == 1 and held_rows(rows) == BLOCK_M


def _launch(cfg: GemmConfig, x, ids, rows_out, norm_w, qkv_w, q_norm_w, k_norm_w, cos, sin, k_cache,
            v_cache, out, counters, pos0, tokens, eps, scale) -> None:
    rows, num_heads, (num_kv, d) = out.shape[0], out.shape[1] // k_cache.shape[3], k_cache.shape[2:]
    m_pad = row_blocks(rows) * BLOCK_M
    part = torch.empty(cfg.split, m_pad, qkv_w.shape[0], dtype=torch.float32, device=x.device)
    gather, spreads = ids is not None, spread(rows, tokens)
    programs = row_blocks(rows) * qkv_w.shape[0] // cfg.block_n * cfg.split + (rows * num_kv if spreads else 0)
    _qkv_attention_kernel[(programs,)](
        x, ids if gather else x, norm_w, qkv_w, q_norm_w, k_norm_w, cos, sin, k_cache, v_cache, out,
        rows_out if gather else out, part, counters,
        rows, x.shape[1], pos0, eps, scale, m_pad,
        x.stride(0), ids.stride(0) if gather else 0, qkv_w.stride(0), out.stride(0),
        rows_out.stride(0) if gather else 0, *k_cache.stride()[:3], *v_cache.stride()[:3],
        cos.stride(0), sin.stride(0),
        NUM_HEADS=num_heads, NUM_KV=num_kv, D=d, T=tokens,
        ROUND=cos.dtype == x.dtype and x.dtype != torch.float32,
        BLOCK_M=BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=cfg.split,
        DOT_PRECISION=dot_precision(qkv_w.dtype), ATT_ROWS=held_rows(rows),
        P=triton.next_power_of_2(k_cache.shape[1]), GATHER=gather, SPREAD=spreads,
        **held_launch(cfg, cfg.block_n, qkv_w.shape[1], x),
    )


def _tuned(args: tuple) -> GemmConfig:
    """The launch config of `_launch(cfg, *args)`. One key per weight shape (and gathering or not: its own
    kernel), timed on the launch's first row block, or on its first batch row when the launch runs row programs
    (so the key's config is the one-row step's); a launch with row programs (`spread`) outside
    `batch_invariant()` takes its own config among the key's and the candidates, timed on the launch's first row
    block inside `autotune.tuning()` (the CUDA-graph warm-up; before it, the key's): at 16 rows the row programs
    sit beside the GEMM programs, so the tile that fills the GPU alone need not be theirs (forty-eighth session).
    Under `batch_invariant()` one config serves every launch of one token a row."""
    x, ids, rows_out, *weights, out, counters, pos0, t, eps, scale = args
    (_, qkv_w, *_, k_cache, _), rows = weights, out.shape[0]
    (num_kv, d), gather, spreads = k_cache.shape[2:], ids is not None, spread(rows, t)
    first = lambda m: (x if gather else x[:m], ids[:m] if gather else None,  # noqa: E731
                       rows_out[:m] if gather else None, *weights, out[:m], counters, pos0, t, eps, scale)
    cands = qkv_candidates(qkv_w, d)
    key = ("cp_qkv_attention" + ("/gather" if gather else ""), qkv_w.shape, num_kv, qkv_w.dtype)
    one = first(t if spreads else min(rows, BLOCK_M))
    config = pick(key, cands, lambda c: _launch(c, *one), x.device)
    if not spreads or batch_invariant():
        return config
    block = first(min(rows, BLOCK_M))
    return choose(key + ("rows",), [config, *(c for c in cands if c != config)], lambda c: _launch(c, *block),
                  x.device, default=config)


def qkv_attention(x: torch.Tensor, norm_weight: torch.Tensor, qkv_weight: torch.Tensor,
                  q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos0: int,
                  tokens_per_row: int, eps: float, scale: float, counters: torch.Tensor,
                  out: torch.Tensor | None = None, config: GemmConfig | None = None,
                  ids: torch.Tensor | None = None, rows_out: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """Attention half of a code-predictor layer for rows x [M, H], M = B * T (T = tokens_per_row;
    row r is batch row r // T at position pos0 + r % T).

    qkv_weight [(NH + 2 KVH) D, H] (rows q | k | v); q/k_norm_weight [D]; cos, sin [P, D] RoPE
    tables; k_cache, v_cache [>= B, P, KVH, D] (written at each row's position; positions < pos0
    must hold this frame's earlier k/v). counters: int32 zeros, >= counters_needed(M, KVH).
    ids [M] (int, any stride): row m is x[ids[m]] (x is then a table [V, H]), and those rows are
    also written to rows_out [M, H] (the layer's residual input), so no launch gathers them first.
    Returns attention output [M, NH * D] in x.dtype (before o_proj).
    """
    rows, hidden = x.shape if ids is None else (ids.shape[0], x.shape[1])
    _, positions, num_kv, d = k_cache.shape
    num_heads = qkv_weight.shape[0] // d - 2 * num_kv
    t = tokens_per_row
    assert qkv_weight.shape == ((num_heads + 2 * num_kv) * d, hidden) and num_heads % num_kv == 0, \
        f"qkv_attention: qkv_weight {tuple(qkv_weight.shape)} vs cache {tuple(k_cache.shape)}"
    assert v_cache.shape == k_cache.shape and k_cache.dtype == v_cache.dtype == x.dtype \
        == qkv_weight.dtype, \
        f"qkv_attention: caches {tuple(k_cache.shape)}/{k_cache.dtype}, x {x.dtype}, weight " \
        f"{qkv_weight.dtype}"
    assert d >= 16 and d & (d - 1) == 0, f"qkv_attention: head_dim {d} must be a power of 2 >= 16"
    assert rows % t == 0 and rows // t <= k_cache.shape[0], \
        f"qkv_attention: {rows} rows, {t} tokens per row, cache for {k_cache.shape[0]} rows"
    assert 0 <= pos0 and pos0 + t <= min(positions, cos.shape[0]) \
        and cos.shape == sin.shape == (cos.shape[0], d), \
        f"qkv_attention: positions {pos0}..{pos0 + t - 1} out of range"
    assert BLOCK_M % t == 0, f"qkv_attention: {t} tokens per row must divide {BLOCK_M}"
    assert (ids is None) == (rows_out is None), "qkv_attention: ids and rows_out come together"
    gathered = () if ids is None else (("rows_out", rows_out),)
    for name, ten in (("x", x), ("qkv_weight", qkv_weight), ("cos", cos), ("sin", sin),
                      ("k_cache", k_cache), ("v_cache", v_cache), *gathered):
        assert ten.stride(-1) == 1, f"qkv_attention: {name} last dim must be contiguous"
        assert ten.device == x.device, f"qkv_attention: {name} on {ten.device}, x on {x.device}"
    if ids is not None:
        assert ids.dim() == 1 and not ids.is_floating_point() and ids.device == x.device, \
            f"qkv_attention: ids must be int [M] on {x.device}"
        assert rows_out.shape == (rows, hidden) and rows_out.dtype == x.dtype, \
            f"qkv_attention: rows_out {tuple(rows_out.shape)}/{rows_out.dtype} != ({rows}, {hidden})/{x.dtype}"
    assert counters.dtype == torch.int32 and counters.numel() >= counters_needed(rows, num_kv), \
        "qkv_attention: counters must be int32 zeros, counters_needed(M, KVH) long"
    if out is None:
        out = torch.empty(rows, num_heads * d, dtype=x.dtype, device=x.device)
    assert out.shape == (rows, num_heads * d) and out.stride(-1) == 1, "qkv_attention: bad out"
    if rows == 0:
        return out
    weights = (norm_weight, qkv_weight, q_norm_weight, k_norm_weight, cos, sin, k_cache, v_cache)
    args = (x, ids, rows_out, *weights, out, counters, pos0, t, eps, scale)
    with device_guard(x):
        if config is None and x.is_cuda:
            config = _tuned(args)
        config = config or interpret_config(d)
        assert d % config.block_n == 0, f"qkv_attention: block_n {config.block_n} must divide {d}"
        _launch(config, *args)
    return out
