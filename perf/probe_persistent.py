"""Probe: would one persistent kernel beat the code predictor's chain of small launches?

At one row a code-predictor pass is 23 dependent launches (kernels/code_predictor.py) and takes about 212 µs on
the H200 for about 160 MB of weights (5 layers): the launches, not the bytes, set its time (RESULTS.md, twenty-third
session). Before building a persistent code predictor, this measures the two ways to run the same chain of
one-row GEMVs, with the same tile code (BLOCK_N weight rows x all of K per tile, fp32 sums, bf16 out):
  launches    one launch per GEMV, all captured in one CUDA graph
  persistent  one launch of P programs (--per-sm of them on each SM, all resident) that walk each GEMV's tiles
              in turn, a grid barrier between GEMVs (an arrival counter and a spin on it); `+prefetch`: before it
              waits, each program prefetches its tiles of the next GEMV into L2 (weights never depend on the
              barrier)
  barriers    the persistent kernel with no tiles: the grid barriers alone
The chain: --layers code-predictor layers of the 1.7B model (qkv 4096x1024, o 1024x2048, gate_up 6144x1024,
down 1024x3072); GEMV l reads the first K_l values of GEMV l-1's output. Values: each mode's last output
bit-equal to the launches' on the CPU (same tiles, same sums; on the GPU each kernel's own register layout may
order a tile's sum otherwise), and against a torch chain of the same roundings (max |diff|: other summation
orders, amplified along the chain).
At 832b75c (H200, one program per SM): launches 108.8 µs a chain (1445 GB/s), persistent 516.7, + prefetch 373.4,
barriers alone 24.9 (1.25 µs each). A program walks its tiles one load of BLOCK_N x BLOCK_K at a time, so one
program per SM keeps about 8 KB in flight there, where the HBM wants tens of KB: hence --per-sm.
H200: python3 perf/probe_persistent.py [--layers 5] [--iters 50] [--per-sm 1 4 8]
    (writes $OUT/probe_persistent.md when OUT is set)
CPU check: python3 perf/probe_persistent.py --device cpu --scale tiny  (the interpreter, one program: values only)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_step import Timer, capture  # noqa: E402
from report import emit  # noqa: E402

LAYER = {"full": [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)],  # (N, K) of qkv, o, gate_up, down
         "tiny": [(64, 32), (32, 32), (96, 32), (32, 64)]}
BLOCK_K = {"full": 512, "tiny": 32}
BLOCK_N = 8  # weight rows per tile: 128-768 tiles a GEMV at full size, about one per SM for the smallest
# programs per SM the grid barrier may count on being resident: the persistent kernel compiles for sm_90 to 40
# registers a thread and 4 warps (tests/kernels/sm90.py's way), so 12 fit an SM's 64K registers
MAX_PER_SM = 8


@triton.jit
def _prefetch_l2(ptrs, nbytes):
    """Bulk-prefetch nbytes [N] (a multiple of 16) from each 16-byte aligned address ptrs [N] into L2."""
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; // dummy $0", "=r,l,r",
                              [ptrs, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _gemv_tile(w_ptr, x_ptr, y_ptr, tile, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[tile's BLOCK_N rows] = W[rows, :K] @ x[:K] in fp32, stored in y's dtype (K a multiple of BLOCK_K).
    NOTE: x is read at L2 (.cg): in the persistent kernel other programs wrote it."""
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :]).to(tl.float32)
        x = tl.load(x_ptr + ks, cache_modifier=".cg").to(tl.float32)
        acc += tl.sum(w * x[None, :], 1)
    tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty))


@triton.jit
def _gemv_kernel(w_ptr, x_ptr, y_ptr, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    _gemv_tile(w_ptr, x_ptr, y_ptr, tl.program_id(0), K, BLOCK_N, BLOCK_K)


@triton.jit
def _meta(meta_ptr, g):
    """GEMV g's weight, input and output offsets, N and K (elements; 5 int64 a GEMV in `Chain.meta`)."""
    base = meta_ptr + g * 5
    return tl.load(base), tl.load(base + 1), tl.load(base + 2), tl.load(base + 3), tl.load(base + 4)


@triton.jit
def _grid_barrier(bar_ptr, target):
    """Arrive, then spin until `target` programs in all have arrived (every program resident: MAX_PER_SM).
    NOTE: the block barrier orders every thread's stores before the release; the acquire orders the reads after."""
    tl.debug_barrier()
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _persistent_kernel(w_ptr, act_ptr, meta_ptr, bar_ptr, G, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       WORK: tl.constexpr, PREFETCH: tl.constexpr):
    """The G GEMVs in turn over all programs (tiles pid, pid + P, ...), a grid barrier after each but the last;
    the last program to arrive after the last GEMV resets the counter for the next launch."""
    pid, P = tl.program_id(0), tl.num_programs(0)
    for g in range(G):
        w_off, x_off, y_off, n, k = _meta(meta_ptr, g)
        if WORK:
            for tile in range(pid, n // BLOCK_N, P):
                _gemv_tile(w_ptr + w_off, act_ptr + x_off, act_ptr + y_off, tile, k, BLOCK_N, BLOCK_K)
        if g + 1 < G:
            if PREFETCH:
                nw_off, _, _, nn, nk = _meta(meta_ptr, g + 1)
                for tile in range(pid, nn // BLOCK_N, P):
                    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
                    _prefetch_l2(w_ptr + nw_off + rows.to(tl.int64) * nk,
                                 tl.zeros([BLOCK_N], tl.int32) + nk * 2)
            _grid_barrier(bar_ptr, (g + 1) * P)
        else:
            tl.debug_barrier()
            if tl.atomic_add(bar_ptr, 1, sem="acq_rel", scope="gpu") == G * P - 1:
                tl.atomic_xchg(bar_ptr, 0)


class Chain:
    """The GEMVs' weights (one bf16 buffer), activations (input, then each output) and offsets."""

    def __init__(self, shapes: list[tuple[int, int]], device: str, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.shapes = shapes
        self.weights = [(torch.randn(n, k, generator=gen) / k ** 0.5).to(torch.bfloat16) for n, k in shapes]
        self.w = torch.cat([w.flatten() for w in self.weights]).to(device)
        rows, meta, w_off, y_off = [shapes[0][1]], [], 0, 0
        for n, k in shapes:
            x_off = y_off  # GEMV g reads the first K values of the previous output (the input for g = 0)
            y_off = sum(rows)
            meta.append((w_off, x_off, y_off, n, k))
            rows.append(n)
            w_off += n * k
        self.act = torch.zeros(sum(rows), dtype=torch.bfloat16, device=device)
        self.act[:shapes[0][1]] = torch.randn(shapes[0][1], generator=gen).to(torch.bfloat16)
        self.meta = torch.tensor(meta, dtype=torch.int64, device=device)
        self.offsets = meta
        self.bar = torch.zeros(1, dtype=torch.int32, device=device)

    def reference(self) -> torch.Tensor:
        """The last GEMV's output by torch: fp32 products and sums, each output rounded to bf16."""
        x = self.act[:self.shapes[0][1]].float().cpu()
        for w, (n, k) in zip(self.weights, self.shapes):
            x = (w.float() @ x[:k]).to(torch.bfloat16).float()
        return x

    def last(self) -> torch.Tensor:
        _, _, y_off, n, _ = self.offsets[-1]
        return self.act[y_off:y_off + n].float().cpu()

    def launches(self, block_k: int) -> None:
        for w_off, x_off, y_off, n, k in self.offsets:
            _gemv_kernel[(n // BLOCK_N,)](self.w[w_off:], self.act[x_off:], self.act[y_off:], k,
                                          BLOCK_N=BLOCK_N, BLOCK_K=min(block_k, k))

    def persistent(self, programs: int, block_k: int, work: bool = True, prefetch: bool = False) -> None:
        assert all(k % min(block_k, k) == 0 for _, k in self.shapes)
        _persistent_kernel[(programs,)](self.w, self.act, self.meta, self.bar, len(self.shapes),
                                        BLOCK_N=BLOCK_N, BLOCK_K=min(block_k, min(k for _, k in self.shapes)),
                                        WORK=work, PREFETCH=prefetch)


def run_chain(chain: Chain, run) -> torch.Tensor:
    """The last GEMV's output [N] (fp32, CPU) after `run()` over zeroed outputs."""
    chain.act[chain.shapes[0][1]:].zero_()
    run()
    return chain.last()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--scale", choices=tuple(LAYER), default="full")
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--per-sm", type=int, nargs="+", default=[1, 4, 8], choices=range(1, MAX_PER_SM + 1),
                   metavar="N", help="persistent programs per SM (every program must be resident)")
    args = p.parse_args()
    chain = Chain(LAYER[args.scale] * args.layers, args.device)
    block_k = BLOCK_K[args.scale]
    cuda = args.device.startswith("cuda")
    sms = torch.cuda.get_device_properties(args.device).multi_processor_count if cuda else 1
    programs = [sms * n for n in args.per_sm] if cuda else [1]
    modes = {"launches": lambda: chain.launches(block_k)}
    for n in programs:
        modes[f"persistent, P = {n}"] = lambda n=n: chain.persistent(n, block_k)
        modes[f"persistent + prefetch, P = {n}"] = lambda n=n: chain.persistent(n, block_k, prefetch=cuda)
    mb = sum(n * k for n, k in chain.shapes) * 2 / 1e6
    lines = [f"# Persistent kernel probe ({args.layers} code-predictor layers, {len(chain.shapes)} one-row GEMVs, "
             f"{mb:.1f} MB of bf16 weights, {sms} SMs, {args.device})", "",
             "| mode | == launches | max abs diff vs torch | µs per chain | µs per GEMV | GB/s |",
             "|---|---|---:|---:|---:|---:|"]
    timer = Timer(torch.device(args.device), args.iters, 3)
    want, first = chain.reference(), run_chain(chain, modes["launches"])
    for name, run in modes.items():
        got = run_chain(chain, run)
        same, diff = torch.equal(got, first), (got - want).abs().max().item()
        timing = "- | - | -"
        if cuda:
            us = timer.graph(capture(run).replay) * 1e3
            timing = f"{us:.1f} | {us / len(chain.shapes):.2f} | {mb / us * 1e3:.0f}"
        lines.append(f"| {name} | {same} | {diff:.3g} | {timing} |")
    for n in programs if cuda else []:
        us = timer.graph(capture(lambda: chain.persistent(n, block_k, work=False)).replay) * 1e3
        lines.append(f"| barriers only, P = {n} | - | - | {us:.1f} | {us / len(chain.shapes):.2f} | - |")
    emit("\n".join(lines) + "\n", "probe_persistent.md")


if __name__ == "__main__":
    main()
