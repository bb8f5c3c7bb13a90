"""Code-predictor bench: the 15 passes of a frame, fused kernels vs today's eager passes.

H200: python3 perf/bench_code_predictor.py   [--batches 1 16 64 256] [--iters 50] [--greedy]
                                               [--batch-invariant]
    a real-size 1.7B code predictor (hidden 1024, 5 layers, 16/8 heads x 128, intermediate 3072,
    input projection 2048 -> 1024, 15 heads of 2048) with the checkpoint maker's random weights,
    bf16, default sampling (TOPK: temperature 0.9, top-k 50) or --greedy. For each batch size:
      correctness  greedy codes of the fused passes vs the eager ones (share of equal codes; bf16
                   rounding differs, so not all), and the fused passes graph-replayed == eager
      15-pass ms   device time of one CUDA-graph replay of each (CUDA events, median of --iters);
                   per pass = / 15
      kernels      launches per pass (torch.profiler over one eager call, / 15)
      per kernel   each fused launch of a middle pass, REPEAT times in its own graph: us per launch
                   and achieved GB/s
                   (compulsory bytes: weights once + activations, caches, logits); qkv_attention
                   also at the --attention-passes (its attention reads positions 0..j+1)
    Every warm-up runs inside kernels.tuning(), as the engine's graph warm-up: batches of 17+ rows
    take the GEMM configs tuned for their row class (listed at the end); --batch-invariant runs
    with kernels.set_batch_invariant(True) (one config per weight shape) to measure its cost.
    The kernel configs start from the tuning table --tune-cache (default $Q3TTS_TUNE_CACHE, as
    bench_engine: an engine's table gives the engine's picks) and what this run tunes is saved
    back to it; --tune-cache '' tunes every config afresh (`pick` times one launch at a time, so
    two fresh runs may pick differently: RESULTS.md, twenty-fourth session).
    Writes $OUT/code_predictor_bench.md when OUT is set.
CPU check: python3 perf/bench_code_predictor.py --scale tiny --device cpu --batches 2 --iters 1
    (the kernels through the Triton interpreter: correctness only, no timing).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable

import torch
from torch import nn

if not torch.cuda.is_available():  # before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import (add_programmatic_launch_argument, add_tune_cache_argument, chain_tuned_note,  # noqa: E402
                          tuning_table)
from profile_step import Timer, capture  # noqa: E402
from report import emit  # noqa: E402

from q3tts.checkpoint.maker import _init_tensor  # noqa: E402
from q3tts.checkpoint.presets import model_config_dict  # noqa: E402
from q3tts.config import TalkerConfig  # noqa: E402
from q3tts import kernels  # noqa: E402
from q3tts.engine.chain_tuning import FrameInputs  # noqa: E402
from q3tts.kernels import code_predictor as cpk  # noqa: E402
from q3tts.kernels.autotune import tuned_configs  # noqa: E402
from q3tts.models.code_predictor import CodePredictor  # noqa: E402
from q3tts.models.code_predictor_fused import FusedCodePredictor  # noqa: E402

TEXT_IDS = dict(im_start=1, im_end=2, assistant=3, tts_pad=4, tts_bos=5, tts_eos=6)


def fused_kernels_on(device: torch.device) -> None:
    """A bench's CPU run takes the fused kernels through the Triton interpreter (Q3TTS_TRITON_ON_CPU). Its
    main sets that, not its import: set at import, every CPU engine of an importing test session took them
    (one e2e test ran past 14 minutes instead of 7 seconds)."""
    if device.type != "cuda":
        os.environ.setdefault("Q3TTS_TRITON_ON_CPU", "1")


def random_code_predictor(scale: str, dtype: torch.dtype, device: str, seed: int = 0
                          ) -> CodePredictor:
    """The 1.7B code predictor (with its talker codec embedding as embed_c0) at `scale`, weights
    drawn by the checkpoint maker's recipe, projections fused."""
    cfg = TalkerConfig.from_dict(
        model_config_dict("custom_voice", "1.7b", scale, TEXT_IDS, 100)["talker_config"])
    cp = CodePredictor(cfg, nn.Embedding(cfg.vocab_size, cfg.hidden_size))  # `_embed_c0` here
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in cp.named_parameters():
            p.copy_(_init_tensor(name.replace("_embed_c0", "codec_embedding"), p.shape, gen))
    cp = cp.to(device=device, dtype=dtype).eval()
    cp.model.fuse_()
    return cp


# ------------------------------------------------------------------------------------ timing

def tuned_capture(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """`profile_step.capture` of fn inside kernels.tuning(): its warm-up tunes the kernels' keys of
    this batch (row classes included), as the engine's graph warm-up does."""
    with kernels.tuning():
        return capture(fn)


def capture_with_outputs(fn: Callable[[], object]) -> tuple[torch.cuda.CUDAGraph, object]:
    """`tuned_capture` of fn, and the captured call's outputs (static tensors the replays
    rewrite)."""
    outs: list[object] = []
    graph = tuned_capture(lambda: outs.append(fn()))
    return graph, outs[-1]


def gemm_config_table() -> list[str]:
    """The skinny GEMMs' tuned launch configs, one row per (kernel, weight shape, row class); the table's other
    entries (other kernels' choices, the chain-tuned mark) are passed over."""
    lines = ["| GEMM | N | K | row class | BLOCK_M | BLOCK_N | BLOCK_K | split | warps | stages |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for key, c in sorted(tuned_configs().items(), key=str):
        if not isinstance(c, cpk.GemmConfig):
            continue
        if key[0].startswith("cp_qkv_attention"):  # (name, weight shape, kv heads, dtype[, "rows"]): /gather too
            name, (n, k), rows = key[0], key[1], "row programs" if key[-1] == "rows" else "all"
        elif key[0].startswith(("cp_", "linear/")):
            name, n, k, _, rows = key[:5]
        else:
            continue
        lines.append(f"| {name} | {n} | {k} | {rows} | {c.block_m} | {c.block_n} | "
                     f"{c.block_k} | {c.split} | {c.num_warps} | {c.num_stages} |")
    return lines


def config_report(loaded: int, path: str | None) -> list[str]:
    """A kernel bench's last section: where its configs came from (`tuning_table`'s count of the table at
    `path`) and `gemm_config_table`."""
    source = f"{loaded} configs from {path}" if loaded else "none from a table"
    return ["### tuned GEMM configs", "", f"({source}; {chain_tuned_note()})", "", *gemm_config_table(), ""]


def kernels_launched(fn: Callable[[], object]) -> int:
    """CUDA kernels one eager call of fn launches (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith(("Memcpy", "Memset")))


# ------------------------------------------------------------------------ per-kernel launches

def pass_launches(cp: CodePredictor, bsz: int, j: int = 7) -> list[tuple[str, int, Callable]]:
    """The fused launches of pass j (one token per row), each with its compulsory bytes."""
    model, layer = cp.model, cp.model.layers[0]
    cfg, dtype, dev = model.cfg, cp.lm_head[0].weight.dtype, cp.lm_head[0].weight.device
    esz = torch.empty((), dtype=dtype).element_size()
    hid, inter, nkv, d = cfg.hidden_size, cfg.intermediate_size, cfg.num_kv_heads, cfg.head_dim
    widest = max(inter, layer.self_attn.fused_weight().shape[0])  # gate_up's units or the qkv GEMM's columns
    counters = torch.zeros(cpk.counters_needed(bsz, widest // cpk.MIN_BLOCK_N), dtype=torch.int32, device=dev)
    h = torch.randn(bsz, hid, device=dev, dtype=dtype)
    k_cache, v_cache = (torch.randn(bsz, cp.num_groups, nkv, d, device=dev, dtype=dtype)
                        for _ in range(2))
    attn = torch.randn(bsz, cfg.num_heads * d, device=dev, dtype=dtype)
    act = torch.randn(bsz, inter, device=dev, dtype=dtype)
    logits = torch.randn(bsz, cp.lm_head[j].out_features, device=dev)
    table = FusedCodePredictor(cp)._pass_tables()[j - 1]  # [V, Hc]
    ids = torch.randint(0, table.shape[0], (bsz,), device=dev)
    sampler = FrameInputs(cp, bsz, greedy=False).sampler
    p = sampler.params
    nbytes = lambda *ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    kv_read = 2 * bsz * (j + 2) * nkv * d * esz  # k and v of positions 0..j+1
    qkv = (layer.input_layernorm.weight, layer.self_attn.fused_weight(), layer.self_attn.q_norm.weight,
           layer.self_attn.k_norm.weight, *model.rope(dev, dtype), k_cache, v_cache, j + 1, 1, 1e-6, d ** -0.5,
           counters)
    return [
        ("qkv_attention, rows by id (a pass's first)",
         nbytes(layer.self_attn.fused_weight(), attn, h) + 2 * bsz * table.shape[1] * esz + kv_read,
         lambda: cpk.qkv_attention(table, *qkv, ids=ids, rows_out=h)),
        ("qkv_attention", nbytes(layer.self_attn.fused_weight(), h, attn) + kv_read,
         lambda: cpk.qkv_attention(h, *qkv)),
        # the same norm + GEMM without the epilogue (norm_head's launch: fp32 out): what the group's
        # epilogue (partial sums, QK-norm, RoPE, cache write, attention) adds to the qkv_attention launch
        ("norm + qkv GEMM alone (no epilogue)", nbytes(layer.self_attn.fused_weight(), h) + 4 * bsz * qkv[1].shape[0],
         lambda: cpk.norm_head(h, layer.input_layernorm.weight, qkv[1], 1e-6, counters)),
        ("o_proj + residual", nbytes(layer.self_attn.o_proj.weight, attn, h, h),
         lambda: cpk.linear_residual(attn, layer.self_attn.o_proj.weight, h, counters)),
        ("norm + gate_up + silu", nbytes(layer.mlp.fused_weight(), h, act),
         lambda: cpk.norm_gate_up(h, layer.post_attention_layernorm.weight,
                                  layer.mlp.fused_weight(), 1e-6, counters)),
        ("down + residual", nbytes(layer.mlp.down_proj.weight, act, h, h),
         lambda: cpk.linear_residual(act, layer.mlp.down_proj.weight, h, counters)),
        ("norm + head", nbytes(cp.lm_head[j].weight, h, logits),
         lambda: cpk.norm_head(h, model.norm.weight, cp.lm_head[j].weight, 1e-6, counters)),
        ("sample (topk)", nbytes(logits),
         lambda: cpk.sample(logits, p.temperature, p.top_k, p.greedy, sampler.u[:, j], True, 64)),
    ]


# ------------------------------------------------------------------------------------ report

# launches per timed graph: one launch alone measures the graph launch (~23 us on the H200); the
# repeats re-read one layer's weights from L2, so a launch's time here is a lower bound
REPEAT = 20


def launch_us(timer: Timer, fn: Callable[[], object]) -> float:
    """Device time of one launch of fn, in us: a graph of REPEAT launches back to back, / REPEAT."""
    return 1e3 * timer.graph(tuned_capture(lambda: [fn() for _ in range(REPEAT)]).replay) / REPEAT

def bench_batch(cp: CodePredictor, bsz: int, args) -> list[str]:
    fused = FusedCodePredictor(cp)
    greedy = FrameInputs(cp, bsz, greedy=True)
    with torch.no_grad():
        want, _ = greedy.run(cp.generate)
        got, _ = greedy.run(fused.generate)
    agree = (got == want).float().mean().item()
    lines = [f"### batch {bsz}", "", f"greedy codes fused == eager: {100 * agree:.1f} %"]
    if not torch.cuda.is_available():
        return lines + ["(no CUDA: correctness only)", ""]
    inputs = FrameInputs(cp, bsz, greedy=args.greedy)
    with torch.no_grad():
        eager_graph, _ = capture_with_outputs(lambda: inputs.run(cp.generate))
        fused_graph, fused_out = capture_with_outputs(lambda: inputs.run(fused.generate))
        fused_graph.replay()
        replayed = fused_out[0].clone()
        eager_codes = inputs.run(fused.generate)[0]
        timer = Timer(torch.device("cuda"), args.iters, eager_iters=1)
        ms = {"eager": timer.graph(eager_graph.replay), "fused": timer.graph(fused_graph.replay)}
        launches = {"eager": kernels_launched(lambda: inputs.run(cp.generate)),
                    "fused": kernels_launched(lambda: inputs.run(fused.generate))}
    lines += [f"fused graph replay == fused eager: {torch.equal(replayed, eager_codes)}", "",
              "| passes | 15-pass ms | per pass ms | kernels / pass |", "|---|---:|---:|---:|"]
    for name in ("eager", "fused"):
        per_pass = launches[name] / 15
        lines.append(f"| {name} | {ms[name]:.3f} | {ms[name] / 15:.4f} | {per_pass:.1f} |")
    lines += ["", f"| fused launch (pass 8, {REPEAT} in a row in a graph) | us each | MB | GB/s |",
              "|---|---:|---:|---:|"]
    with torch.no_grad():
        for name, nbytes, fn in pass_launches(cp, bsz):
            us = launch_us(timer, fn)
            lines.append(f"| {name} | {us:.1f} | {nbytes / 1e6:.2f} | {nbytes / us / 1e3:.0f} |")
        for j in args.attention_passes:  # the attention's cost grows with the positions it reads
            name, nbytes, fn = pass_launches(cp, bsz, j)[1]
            us = launch_us(timer, fn)
            lines.append(f"| {name}, pass {j + 1} (positions 0..{j + 1}) | {us:.1f} | "
                         f"{nbytes / 1e6:.2f} | {nbytes / us / 1e3:.0f} |")
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", choices=("full", "tiny"), default="full")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--greedy", action="store_true", help="time greedy draws (default: TOPK)")
    p.add_argument("--attention-passes", type=int, nargs="*", default=[1, 14], choices=range(1, 15),
                   metavar="J", help="passes j (1..14) whose qkv_attention launch is also timed alone")
    p.add_argument("--batch-invariant", action="store_true",
                   help="kernels.set_batch_invariant(True): one GEMM config per weight shape")
    add_programmatic_launch_argument(p)
    add_tune_cache_argument(p)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    fused_kernels_on(device)
    kernels.set_batch_invariant(args.batch_invariant)
    kernels.set_programmatic_launch(args.programmatic_launch)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cp = random_code_predictor(args.scale, dtype, args.device)
    with tuning_table(args.tune_cache, device) as loaded:
        lines = [line for bsz in args.batches for line in bench_batch(cp, bsz, args)]
    head = [f"# code predictor: fused kernels vs eager passes ({args.scale}, {dtype}, "
            f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}, "
            f"{'greedy' if args.greedy else 'topk'} sampling"
            f"{', batch-invariant' if args.batch_invariant else ''}"
            f"{', programmatic launch' if args.programmatic_launch else ''})", ""]
    lines = head + lines + config_report(loaded, args.tune_cache)
    emit("\n".join(lines), "code_predictor_bench.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
