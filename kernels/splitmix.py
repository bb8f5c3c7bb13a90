"""The sampler's counter-based uniforms in one launch: `reference.uniforms_ref` (splitmix64 of the seed, then
of that key xor counter * lanes + lane; the top 24 bits, times 2^-24), which a decode step ran twice as 32
int64 torch ops each. uint64 arithmetic here, so the bits are the reference's exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import device_guard
from .reference import SPLITMIX64

_GOLDEN, _MIX1, _MIX2 = (tl.constexpr(c) for c in SPLITMIX64)  # int64 bit patterns of the uint64 constants
BLOCK_B = 16  # rows per program


@triton.jit
def _u64(bits: tl.constexpr):
    """The uint64 whose bit pattern is the int64 `bits`."""
    return tl.full([], bits, tl.int64).to(tl.uint64, bitcast=True)


@triton.jit
def _splitmix64(x):
    z = x + _u64(_GOLDEN)
    z = (z ^ (z >> 30)) * _u64(_MIX1)
    z = (z ^ (z >> 27)) * _u64(_MIX2)
    return z ^ (z >> 31)


@triton.jit(do_not_specialize=["B"])  # one build for every batch: B = 1 would be a build of its own
def _uniforms_kernel(seeds_ptr, counters_ptr, out_ptr, B, stride_s, stride_c, stride_out,
                     LANES: tl.constexpr, BLOCK_B: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    mask = rows < B
    r64 = rows.to(tl.int64)
    seed = tl.load(seeds_ptr + r64 * stride_s, mask=mask, other=0).to(tl.int64).to(tl.uint64, bitcast=True)
    counter = tl.load(counters_ptr + r64 * stride_c, mask=mask, other=0).to(tl.int64).to(tl.uint64, bitcast=True)
    lane = tl.arange(0, LANES)
    bits = _splitmix64(_splitmix64(seed)[:, None] ^ (counter[:, None] * LANES + lane.to(tl.uint64)[None, :]))
    u = (bits >> 40).to(tl.float32) * (1.0 / 16777216.0)  # [BLOCK_B, LANES]: 24 bits, exact in fp32
    tl.store(out_ptr + r64[:, None] * stride_out + lane[None, :], u, mask=mask[:, None])


def uniforms(seeds: torch.Tensor, counters: torch.Tensor, lanes: int) -> torch.Tensor:
    """[B, lanes] float32 uniforms for seeds, counters [B] (int, any stride); lanes a power of 2."""
    assert seeds.dim() == 1 and counters.shape == seeds.shape and not seeds.is_floating_point() \
        and not counters.is_floating_point() and counters.device == seeds.device, \
        f"uniforms: seeds {tuple(seeds.shape)}/{seeds.dtype} and counters {tuple(counters.shape)}/{counters.dtype} " \
        f"must be int [B] on one device"
    assert lanes & (lanes - 1) == 0, f"uniforms: {lanes} lanes is not a power of 2"
    out = torch.empty(seeds.shape[0], lanes, dtype=torch.float32, device=seeds.device)
    if seeds.shape[0]:
        with device_guard(seeds):
            _uniforms_kernel[(triton.cdiv(seeds.shape[0], BLOCK_B),)](
                seeds, counters, out, seeds.shape[0], seeds.stride(0), counters.stride(0), out.stride(0),
                LANES=lanes, BLOCK_B=BLOCK_B)
    return out
