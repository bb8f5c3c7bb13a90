"""Talker decode bench: the fused decode forward (models/talker_fused.py) vs the eager one.

H200: python3 perf/bench_talker.py   [--batches 1 16 64 256] [--context 300] [--table-pages N] [--layers 28]
                                       [--iters 50] [--batch-invariant]
    a real-size 1.7B talker stack (hidden 2048, 16/8 heads x 128, intermediate 6144; --layers of
    its 28) with the checkpoint maker's random weights, bf16, every row at --context keys over
    pages of 16, in block tables --table-pages wide (a default engine's: the attention's split count
    follows the width). For each batch size:
      correctness  fused vs eager hidden (max |diff| / max |eager|); fused graph replay == eager
      forward ms   device time of one CUDA-graph replay of each (CUDA events, median of --iters),
                   and per layer
      kernels      launches per forward (torch.profiler over one eager call)
      per kernel   each fused launch of a layer after the first (the norms from row statistics, the
                   residual launches writing them), once per layer of the stack in one graph (each
                   launch on its own layer's weights and cache, as the forward reads them: not from L2,
                   and no graph launch in the figure), / layers: us, compulsory MB (weights once +
                   activations + the K/V read), achieved GB/s and % of the HBM line
      per layer    the fused forward's compulsory bytes per layer / its time per layer
    HBM line: a 1 GiB device-to-device copy (bytes read + written / time).
    Warm-ups run inside kernels.tuning() (bench_code_predictor.tuned_capture): batches of 17+ rows
    take the GEMM configs tuned for their row class (listed at the end); --batch-invariant runs
    with kernels.set_batch_invariant(True) to measure its cost. The configs start from the tuning table
    --tune-cache (default $Q3TTS_TUNE_CACHE: an engine's, or perf/tune_chain.py --part talker's) and what this
    run tunes is saved back to it.
    Writes $OUT/talker_bench.md when OUT is set.
CPU check: python3 perf/bench_talker.py --scale tiny --device cpu --batches 2 --iters 1
    (the kernels through the Triton interpreter: correctness only, no timing).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import Callable

import torch

if not torch.cuda.is_available():  # before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_code_predictor import (TEXT_IDS, capture_with_outputs, config_report,  # noqa: E402
                                  fused_kernels_on, kernels_launched, tuned_capture)
from bench_engine import add_programmatic_launch_argument, add_tune_cache_argument, tuning_table  # noqa: E402
from profile_step import Timer, capture  # noqa: E402
from report import emit  # noqa: E402

from q3tts.checkpoint.maker import _init_tensor  # noqa: E402
from q3tts.checkpoint.presets import model_config_dict  # noqa: E402
from q3tts.config import TalkerConfig  # noqa: E402
from q3tts.engine import EngineConfig  # noqa: E402
from q3tts.engine.chain_tuning import DecodeInputs  # noqa: E402
from q3tts import kernels  # noqa: E402
from q3tts.kernels import code_predictor as cpk  # noqa: E402
from q3tts.kernels.talker_attention import decode_attention  # noqa: E402
from q3tts.kernels.talker_qkv import qkv_rope_store  # noqa: E402
from q3tts.models.attention import DecodeContext, PagedKVCache  # noqa: E402
from q3tts.models.layers import DecoderStack  # noqa: E402
from q3tts.models.talker_fused import FusedTalker  # noqa: E402

PAGE_SIZE = 16  # the engine's default


def random_stack(scale: str, layers: int | None, dtype: torch.dtype, device: str,
                 seed: int = 0) -> DecoderStack:
    """The 1.7B talker's decoder stack at `scale` (`layers` of its layers), weights drawn by the
    checkpoint maker's recipe, projections fused."""
    cfg = TalkerConfig.from_dict(
        model_config_dict("custom_voice", "1.7b", scale, TEXT_IDS, 100)["talker_config"]).layers
    if layers is not None:
        cfg = dataclasses.replace(cfg, num_layers=layers)
    stack = DecoderStack(cfg, max_positions=cfg.max_position_embeddings)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in stack.named_parameters():
            p.copy_(_init_tensor(name, p.shape, gen))
    return stack.to(device=device, dtype=dtype).eval().fuse_()


def random_cache(stack: DecoderStack, pages: int, seed: int = 0) -> PagedKVCache:
    """A paged KV cache of `pages` pages of PAGE_SIZE for the stack, every K/V drawn at random."""
    cfg, w = stack.cfg, stack.norm.weight
    cache = PagedKVCache(cfg.num_layers, pages, PAGE_SIZE, cfg.num_kv_heads, cfg.head_dim, w.dtype, w.device)
    gen = torch.Generator(w.device).manual_seed(seed)
    for kv in (cache.k, cache.v):
        kv.copy_(torch.randn(kv.shape, generator=gen, device=w.device))
    return cache


class Step(DecodeInputs):
    """One decode step's inputs for B rows, each at `context` keys on its own pages of random K/V (`cache`), in
    block tables `width` pages wide."""

    def __init__(self, stack: DecoderStack, bsz: int, context: int, width: int):
        self.cache = random_cache(stack, bsz * -(-context // PAGE_SIZE))
        super().__init__(stack, self.cache, bsz, context, width=width)


def layer_launches(stack: DecoderStack, step: Step, i: int) -> list[tuple[str, int, Callable]]:
    """The fused launches of a layer after the first on layer i's weights and cache, each with its compulsory
    bytes: the norms read the residual stream's row statistics, the residual launches write them. Then, not one
    of them, the qkv launch whose norm reads its rows (layer 0's: no residual launch came before it)."""
    cfg, layer, ctx = stack.cfg, stack.layers[i], step.ctx
    attn, mlp, x = layer.self_attn, layer.mlp, step.x
    bsz, esz = x.shape[0], x.element_size()
    q_width, kv_width = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    counters = torch.zeros(cpk.counters_needed(bsz, cfg.intermediate_size // cpk.MIN_BLOCK_N),
                           dtype=torch.int32, device=x.device)
    rope = stack.rope(x.device, x.dtype)
    q = torch.randn(bsz, q_width, device=x.device, dtype=x.dtype)
    act = torch.randn(bsz, cfg.intermediate_size, device=x.device, dtype=x.dtype)
    stats = (x.float() ** 2).unflatten(1, (-1, cpk.STAT_COLS)).sum(-1)  # x's, as a residual launch writes them
    written = torch.empty_like(stats)
    nbytes = lambda *ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    rows = lambda width: bsz * width * esz  # noqa: E731
    kv_read = 2 * int(ctx.context_lens.sum()) * kv_width * esz
    norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
    qkv = lambda st: qkv_rope_store(x, norm1.weight, attn.fused_weight(), attn.q_norm.weight,  # noqa: E731
                                    attn.k_norm.weight, *rope, step.positions, ctx.slot_mapping, ctx.cache.k[i],
                                    ctx.cache.v[i], norm1.eps, counters, stats=st)
    qkv_bytes = nbytes(attn.fused_weight()) + rows(cfg.hidden_size + q_width + 2 * kv_width)
    return [
        ("norm + qkv + qk-norm + rope + K/V store", qkv_bytes, lambda: qkv(stats)),
        ("paged attention", kv_read + rows(2 * q_width),
         lambda: decode_attention(q.view(bsz, cfg.num_heads, -1), ctx.cache.k[i], ctx.cache.v[i],
                                  ctx.block_tables, ctx.context_lens, ctx.scale, counters)),
        ("o_proj + residual", nbytes(attn.o_proj.weight) + rows(q_width + 2 * cfg.hidden_size),
         lambda: cpk.linear_residual(q, attn.o_proj.weight, x, counters, stats=written)),
        ("norm + gate_up + silu", nbytes(mlp.fused_weight()) + rows(cfg.hidden_size
                                                                    + cfg.intermediate_size),
         lambda: cpk.norm_gate_up(x, norm2.weight, mlp.fused_weight(), norm2.eps, counters, stats=stats)),
        ("down + residual", nbytes(mlp.down_proj.weight)
         + rows(cfg.intermediate_size + 2 * cfg.hidden_size),
         lambda: cpk.linear_residual(act, mlp.down_proj.weight, x, counters, stats=written)),
        ("norm + qkv + ... from its rows (layer 0; not in the layer)", qkv_bytes, lambda: qkv(None)),
    ]


def qkv_gemm_alone(stack: DecoderStack, step: Step, i: int) -> tuple[str, int, Callable]:
    """Layer i's norm + qkv GEMM without the epilogue (norm_head's launch, fp32 out): beside the qkv launch, what
    the kv groups' epilogue (partial sums, QK-norm, RoPE, K/V store) adds to it. Not one of the layer's launches."""
    cfg, layer, x = stack.cfg, stack.layers[i], step.x
    weight, norm = layer.self_attn.fused_weight(), layer.input_layernorm
    counters = torch.zeros(cpk.counters_needed(x.shape[0], weight.shape[0] // cpk.MIN_BLOCK_N), dtype=torch.int32,
                           device=x.device)
    nbytes = weight.numel() * weight.element_size() + x.numel() * x.element_size() + 4 * x.shape[0] * weight.shape[0]
    return ("norm + qkv GEMM alone (no epilogue; not in the layer)", nbytes,
            lambda: cpk.norm_head(x, norm.weight, weight, norm.eps, counters))


def launch_times(timer: Timer, stack: DecoderStack, step: Step) -> list[tuple[str, int, float]]:
    """(name, compulsory bytes, us) of each launch of `layer_launches` and `qkv_gemm_alone`: the launch once per
    layer of the stack, on that layer's weights and cache, back to back in one graph, / layers. Each reads its
    weights from HBM as the forward does, and the graph's own launch (~20 us) is spread over the layers."""
    per_layer = [[*layer_launches(stack, step, i), qkv_gemm_alone(stack, step, i)] for i in range(len(stack.layers))]
    out = []
    for column in zip(*per_layer):  # one launch, every layer
        graph = tuned_capture(lambda: [fn() for _, _, fn in column])
        out.append((column[0][0], column[0][1], 1e3 * timer.graph(graph.replay) / len(column)))
    return out


def hbm_gbps(timer: Timer) -> float:
    """GB/s of a 1 GiB device-to-device copy (read + write)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = timer.graph(capture(lambda: dst.copy_(src)).replay)
    return 2 * src.numel() / ms / 1e6


def bench_batch(stack: DecoderStack, bsz: int, args, hbm: float | None) -> list[str]:
    fused, step = FusedTalker(stack), Step(stack, bsz, args.context, args.table_pages)
    start = (step.cache.k.clone(), step.cache.v.clone())
    with torch.no_grad():
        want, got = step.run(stack), step.run(fused.forward)
    rel = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    lines = [f"### batch {bsz} (context {args.context}, tables {args.table_pages} pages wide)", "",
             f"fused vs eager hidden: max |diff| / max |eager| = {rel:.2e}"]
    if not torch.cuda.is_available():
        return lines + ["(no CUDA: correctness only)", ""]
    timer = Timer(torch.device("cuda"), args.iters, eager_iters=1)
    with torch.no_grad():
        eager_graph, _ = capture_with_outputs(lambda: step.run(stack))
        fused_graph, fused_out = capture_with_outputs(lambda: step.run(fused.forward))
        for cache, saved in zip((step.cache.k, step.cache.v), start):
            cache.copy_(saved)
        fused_graph.replay()
        replayed = fused_out.clone()
        same = torch.equal(replayed, step.run(fused.forward))
        ms = {"eager": timer.graph(eager_graph.replay), "fused": timer.graph(fused_graph.replay)}
        launches = {"eager": kernels_launched(lambda: step.run(stack)),
                    "fused": kernels_launched(lambda: step.run(fused.forward))}
        per_kernel = launch_times(timer, stack, step)
    *per_kernel, first, alone = per_kernel
    layers = stack.cfg.num_layers
    lines += [f"fused graph replay == fused eager: {same}", "",
              "| forward | ms | ms / layer | kernels |", "|---|---:|---:|---:|"]
    lines += [f"| {k} | {ms[k]:.3f} | {ms[k] / layers:.4f} | {launches[k]} |" for k in ms]
    pct = lambda gbps: f"{100 * gbps / hbm:.0f} %" if hbm else "-"  # noqa: E731
    lines += ["", "| fused launch (a layer after the first, once per layer in a graph) | us | MB | GB/s | "
              f"of HBM ({hbm:.0f} GB/s) |", "|---|---:|---:|---:|---:|"]
    for name, n, us in (*per_kernel, first, alone):
        lines.append(f"| {name} | {us:.1f} | {n / 1e6:.2f} | {n / us / 1e3:.0f} | "
                     f"{pct(n / us / 1e3)} |")
    layer_bytes = sum(n for _, n, _ in per_kernel)
    us_layer = 1e3 * ms["fused"] / layers
    lines += [f"| per layer, in the fused forward | {us_layer:.1f} | {layer_bytes / 1e6:.2f} | "
              f"{layer_bytes / us_layer / 1e3:.0f} | {pct(layer_bytes / us_layer / 1e3)} |", ""]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", choices=("full", "tiny"), default="full")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--context", type=int, default=300, help="keys each row attends over")
    p.add_argument("--table-pages", type=int, default=EngineConfig().sequence_pages,
                   help="block-table width in pages (default: a default engine's; the attention's split count "
                   "follows it)")
    p.add_argument("--layers", type=int, default=None, help="layers of the stack (default: all)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--batch-invariant", action="store_true",
                   help="kernels.set_batch_invariant(True): one GEMM config per weight shape")
    add_programmatic_launch_argument(p)
    add_tune_cache_argument(p)
    args = p.parse_args(argv)
    fused_kernels_on(torch.device(args.device))
    kernels.set_batch_invariant(args.batch_invariant)
    kernels.set_programmatic_launch(args.programmatic_launch)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    stack = random_stack(args.scale, args.layers, dtype, args.device)
    cuda = torch.cuda.is_available()
    hbm = hbm_gbps(Timer(torch.device("cuda"), args.iters, eager_iters=1)) if cuda else None
    head = [f"# talker decode: fused kernels vs eager ({args.scale}, {stack.cfg.num_layers} layers,"
            f" {dtype}, {torch.cuda.get_device_name() if cuda else 'cpu'}"
            f"{', batch-invariant' if args.batch_invariant else ''}"
            f"{', programmatic launch' if args.programmatic_launch else ''})", ""]
    with tuning_table(args.tune_cache, torch.device(args.device)) as loaded:
        lines = head + [line for bsz in args.batches for line in bench_batch(stack, bsz, args, hbm)]
    lines += config_report(loaded, args.tune_cache)
    emit("\n".join(lines), "talker_bench.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
