"""Kernel bench: each Triton kernel vs its torch reference at real Qwen3-TTS talker shapes.

    python perf/bench_kernels.py            # H200: correctness at real shapes, then µs and GB/s
    OUT=/some/dir python perf/bench_kernels.py   # also writes $OUT/kernels_bench.md
    python perf/bench_kernels.py --quick    # fewer shapes

Without CUDA it runs the same correctness checks on tiny shapes through the Triton interpreter
and times nothing. Bytes are the compulsory HBM traffic (inputs read once, outputs written once);
GB/s = bytes / time of the Triton kernel replayed in a CUDA graph (launch overhead excluded, as in
the engine); "eager" columns include the launch. The torch reference of paged attention
materialises [B, S, NH, D] fp32 copies, so it is timed only where that fits a memory budget.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from report import emit
import torch

GPU = torch.cuda.is_available()
if not GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("Q3TTS_TRITON_ON_CPU", "1")

import q3tts.kernels as K  # noqa: E402
from q3tts.kernels import reference as R  # noqa: E402
from q3tts.kernels.autotune import tuned_configs  # noqa: E402
from q3tts.kernels.paged_attention import num_splits_for  # noqa: E402

NH, KVH, D, PAGE, HIDDEN, EPS = 16, 8, 128, 16, 2048, 1e-6
REF_BUDGET_BYTES = 6 << 30  # skip timing the attention reference above this footprint


def _bench(fn, graph: bool) -> float | None:
    """Mean µs of fn(); None on CPU or if the call cannot be captured."""
    if not GPU:
        return None
    from triton.testing import do_bench, do_bench_cudagraph

    try:
        ms = do_bench_cudagraph(fn, rep=50) if graph else do_bench(fn, warmup=10, rep=50)
    except Exception as exc:  # noqa: BLE001 - e.g. host sync in a reference under capture
        print(f"  (timing failed: {type(exc).__name__}: {str(exc)[:80]})", file=sys.stderr)
        return None
    return ms * 1e3


def _check(name: str, got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> None:
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol,
                               msg=lambda m: f"{name}: {m}")


def _check3(name: str, got: torch.Tensor, want: torch.Tensor, want32: torch.Tensor, atol: float) -> None:
    """Kernel error vs fp32 must stay within 2x the same-dtype torch error (+atol): FMA contraction on
    the GPU rounds differently from eager's separately rounded products, but never worse."""
    err = (got.float() - want32).abs().max().item()
    err_pt = (want.float() - want32).abs().max().item()
    assert err <= 2 * err_pt + atol, f"{name}: error {err:.3g} > 2 x torch {err_pt:.3g} + {atol}"


class Table:
    def __init__(self) -> None:
        self.rows: list[str] = []

    def add(self, kernel: str, shape: str, nbytes: int, t_graph, t_eager, t_ref) -> None:
        fmt = lambda t: "-" if t is None else f"{t:.1f}"  # noqa: E731
        gbs = "-" if t_graph is None else f"{nbytes / (t_graph * 1e-6) / 1e9:.0f}"
        speed = "-" if t_ref is None or t_eager is None else f"{t_ref / t_eager:.1f}x"
        self.rows.append(f"| {kernel} | {shape} | {nbytes / 1e6:.3f} | {fmt(t_graph)} | "
                         f"{gbs} | {fmt(t_eager)} | {fmt(t_ref)} | {speed} |")
        print(self.rows[-1], flush=True)

    def markdown(self, header: str) -> str:
        head = ("| kernel | shape | MB | triton graph µs | GB/s | triton eager µs "
                "| torch ref µs | ref/triton (eager) |\n|---|---|---:|---:|---:|---:|---:|---:|")
        return "\n".join([header, "", head, *self.rows, ""])


def bench_rms_norm(table: Table, sizes, dtype, dev) -> None:
    for n in sizes:
        for dim, heads in ((HIDDEN, None), (D, NH)):  # hidden norm, QK-norm over head_dim
            shape = (n, dim) if heads is None else (n, heads, dim)
            x = torch.randn(shape, device=dev, dtype=dtype)
            w = torch.randn(dim, device=dev, dtype=dtype)
            r = torch.randn_like(x)
            fused = heads is None
            out, res = (K.rms_norm(x, w, EPS, residual=r) if fused
                        else (K.rms_norm(x, w, EPS), None))
            want = R.add_rms_norm_ref(x, r, w, EPS) if fused else (R.rms_norm_ref(x, w, EPS), None)
            _check("rms_norm", out, want[0], 1.6e-2, 1e-2)
            if fused:
                assert torch.equal(res, want[1]), "fused residual differs from the eager add"
            call = (lambda: K.rms_norm(x, w, EPS, residual=r)) if fused else (
                lambda: K.rms_norm(x, w, EPS))
            ref = (lambda: R.add_rms_norm_ref(x, r, w, EPS)) if fused else (
                lambda: R.rms_norm_ref(x, w, EPS))
            nbytes = x.numel() * x.element_size() * (4 if fused else 2) + w.numel() * 2
            name = "add+rms_norm" if fused else "qk_norm"
            table.add(name, "x".join(map(str, shape)), nbytes, _bench(call, True),
                      _bench(call, False), _bench(ref, False))


def bench_rotary(table: Table, sizes, dtype, dev) -> None:
    max_pos = 8192
    cos = torch.randn(max_pos, D, device=dev, dtype=dtype)
    sin = torch.randn(max_pos, D, device=dev, dtype=dtype)
    for n in sizes:
        q = torch.randn(n, NH, D, device=dev, dtype=dtype)
        k = torch.randn(n, KVH, D, device=dev, dtype=dtype)
        pos = torch.randint(0, max_pos, (n,), device=dev)
        got = K.apply_rotary(q, k, pos, cos, sin)
        want = R.apply_rotary_ref(q, k, pos, cos, sin)
        want32 = R.apply_rotary_ref(q.float(), k.float(), pos, cos.float(), sin.float())
        for g, w, w32 in zip(got, want, want32):
            _check3("rotary", g, w, w32, 1e-2)
        call = lambda: K.apply_rotary(q, k, pos, cos, sin, inplace=True)  # noqa: E731
        ref = lambda: R.apply_rotary_ref(q, k, pos, cos, sin)  # noqa: E731
        nbytes = 2 * (q.numel() + k.numel()) * q.element_size() + 2 * n * D * 2 * cos.element_size()
        table.add("rotary (in place)", f"N={n} q{NH}/k{KVH}x{D}", nbytes, _bench(call, True),
                  _bench(call, False), _bench(ref, False))


def bench_store_kv(table: Table, sizes, dtype, dev) -> None:
    num_pages = 4096 if GPU else 8
    k_cache = torch.zeros(num_pages, PAGE, KVH, D, device=dev, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    for n in sizes:
        k = torch.randn(n, KVH, D, device=dev, dtype=dtype)
        v = torch.randn_like(k)
        slots = torch.randperm(num_pages * PAGE, device=dev)[:n]
        slots[-1] = -1
        K.store_kv(k, v, k_cache, v_cache, slots)
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        R.store_kv_ref(k, v, k_ref, v_ref, slots)
        assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref), "store_kv mismatch"
        call = lambda: K.store_kv(k, v, k_cache, v_cache, slots)  # noqa: E731
        ref = lambda: R.store_kv_ref(k, v, k_cache, v_cache, slots)  # noqa: E731
        nbytes = 4 * k.numel() * k.element_size()
        table.add("store_kv", f"N={n} {KVH}x{D} page {PAGE}", nbytes, _bench(call, True),
                  _bench(call, False), _bench(ref, False))


def bench_paged_attention(table: Table, sizes, contexts, dtype, dev) -> None:
    for bsz in sizes:
        for ctx in contexts:
            max_pages = triton_cdiv(ctx, PAGE)
            num_pages = bsz * max_pages
            k_cache = torch.randn(num_pages, PAGE, KVH, D, device=dev, dtype=dtype)
            v_cache = torch.randn_like(k_cache)
            q = torch.randn(bsz, NH, D, device=dev, dtype=dtype)
            tables = torch.randperm(num_pages, device=dev).to(torch.int32).view(bsz, max_pages)
            lens = torch.full((bsz,), ctx, device=dev, dtype=torch.int32)
            lens[-1] = max(0, ctx - PAGE // 2 - 1)  # a partially filled last page
            out = K.paged_decode_attention(q, k_cache, v_cache, tables, lens, D ** -0.5)
            rows = sorted({0, bsz - 1})  # rows are independent: check a few at full size
            want = R.paged_decode_attention_ref(q[rows].float(), k_cache.float(), v_cache.float(),
                                                tables[rows], lens[rows], D ** -0.5)
            _check("paged_decode_attention", out[rows], want, 2e-2, 2e-2)
            call = lambda: K.paged_decode_attention(q, k_cache, v_cache, tables, lens,  # noqa: E731
                                                    D ** -0.5)
            ref = lambda: R.paged_decode_attention_ref(q, k_cache, v_cache, tables,  # noqa: E731
                                                       lens, D ** -0.5)
            ref_bytes = bsz * max_pages * PAGE * NH * D * 4 * 4
            nbytes = (int(lens.sum()) * KVH * D * 2 * k_cache.element_size()
                      + 2 * q.numel() * q.element_size() + tables.numel() * 4)
            splits = num_splits_for(bsz, KVH, max_pages, PAGE, 64, q.device)
            table.add("paged_decode_attention", f"B={bsz} ctx={ctx} splits≈{splits}", nbytes,
                      _bench(call, True), _bench(call, False),
                      _bench(ref, False) if ref_bytes <= REF_BUDGET_BYTES else None)
            del k_cache, v_cache


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="B in (1, 64), contexts (128, 4096)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    dev = torch.device("cuda" if GPU else "cpu")
    torch.manual_seed(0)
    if GPU:
        sizes = (1, 64) if args.quick else (1, 8, 64, 256)
        contexts = (128, 4096) if args.quick else (128, 512, 1024, 2048, 4096)
        t0 = time.perf_counter()
        K.warmup(num_heads=NH, num_kv_heads=KVH, head_dim=D, hidden_sizes=(HIDDEN, 1024),
                 page_size=PAGE, dtype=dtype, device=dev, max_pages=contexts[-1] // PAGE,
                 batch_sizes=sizes)
        print(f"warmup (compile + tune): {time.perf_counter() - t0:.1f} s", flush=True)
        header = (f"# Kernel bench: {torch.cuda.get_device_name(dev)}, {args.dtype}, "
                  f"torch {torch.__version__}, NH={NH} KVH={KVH} D={D} page={PAGE}")
    else:
        sizes, contexts = (1, 3), (5, 40)
        header = "# Kernel bench (CPU, Triton interpreter): correctness only, tiny shapes"
    table = Table()
    print(header, flush=True)
    bench_rms_norm(table, sizes, dtype, dev)
    bench_rotary(table, sizes, dtype, dev)
    bench_store_kv(table, sizes, dtype, dev)
    bench_paged_attention(table, sizes, contexts, dtype, dev)
    print("All results match the references.")
    report = table.markdown(header)
    tuned = "\n".join(f"- `{key}` -> {cfg}" for key, cfg in tuned_configs().items())
    report += f"\nTuned configs:\n{tuned or '- (none: not on CUDA or Q3TTS_TUNE=0)'}\n"
    emit(report, "kernels_bench.md")


if __name__ == "__main__":
    main()
