"""Engine decode-step benchmark: per-step ms, frames/s and audio-s/s per batch size (graph replay).

H200 (the default): python3 perf/bench_engine.py
    makes a real-size random 1.7B CustomVoice checkpoint (or --model DIR), captures the decode step as
    CUDA graphs, fills the engine with B sequences for each B in --batches and times --steps steps.
CPU check:          python3 perf/bench_engine.py --scale tiny --device cpu --batches 1 2 --steps 3

Also checks: one graph replay per decode step (replay counter vs steps), and graph replay == eager on
one batch (same padded bucket, greedy, bit-exact codes). Then the anatomy of time to first audio inside
the engine: n sequences (--arrivals) arrive on an idle engine; the step that prefills them and makes their
first frame, as host time and the device time of its prefill and decode. Writes $OUT/engine_bench.md
when OUT is set.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from pathlib import Path

from floor import H200_BYTES_PER_S, StepBytes, context_tokens
from report import append_csv, emit
import torch

from q3tts.core import SamplingParams, UnknownSequence, VoiceSpec
from q3tts.engine.chain_tuning import chain_tuned_parts
from q3tts.engine.config import EngineConfig
from q3tts.engine.engine import Engine
from q3tts.engine.timing import log_start_phases

TEXT = "Hello world, this is a benchmark of the streaming speech engine running many voices at once."


def make_model(args) -> Path:
    if args.model:
        return Path(args.model)
    from q3tts.checkpoint.maker import make_checkpoint

    out = Path(tempfile.mkdtemp(prefix="q3tts_bench_")) / f"cv_{args.scale}"
    t0 = time.perf_counter()
    make_checkpoint(out, "custom_voice", "1.7b", args.scale, seed=0)
    print(f"checkpoint {out} in {time.perf_counter() - t0:.1f} s")
    return out


def fill(engine: Engine, batch: int, tag: str, greedy: bool = False, frames: int = 1000) -> list[str]:
    """Add `batch` sequences (all text up front, no EOS: max_frames large) and prefill them."""
    spk = sorted(engine.checkpoint.config.talker.speaker_ids)[0]
    ids = [f"{tag}{i}" for i in range(batch)]
    for i, sid in enumerate(ids):
        engine.add(sid, VoiceSpec(speaker=spk), SamplingParams(greedy=greedy, seed=i, max_frames=frames),
                   TEXT, True)
    while engine.stats()["active"] < batch:  # prefill (max_prefill_tokens may split it) + decode
        assert engine.stats()["queued"] > 0, engine.stats()
        engine.step()
    return ids


def drain(engine: Engine, ids: list[str]) -> None:
    for sid in ids:
        with contextlib.suppress(UnknownSequence):  # already finished (EOS or max_frames)
            engine.abort(sid)
    while engine.has_work():
        engine.step()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench_batch(engine: Engine, batch: int, steps: int, device: str) -> dict:
    ids = fill(engine, batch, f"b{batch}_", frames=steps + 8)
    engine.step()  # warm
    replays0, decode0 = engine.stats()["graph_replays"], engine.stats()["decode_steps"]
    ctx0 = context_tokens(engine)
    sync(device)
    made = 0
    t0 = time.perf_counter()
    for _ in range(steps):
        made += sum(o.codes.shape[0] for o in engine.step())  # random weights may emit EOS early
    sync(device)
    dt = (time.perf_counter() - t0) / steps
    ctx = (ctx0 + context_tokens(engine)) / 2  # the rows' contexts grow by one token a step
    s = engine.stats()
    replays, decodes = s["graph_replays"] - replays0, s["decode_steps"] - decode0
    kernels = kernels_per_step(engine, device)
    drain(engine, ids)
    fps = made / (dt * steps)
    return dict(batch=batch, bucket=engine.config.bucket_for(batch), ms=dt * 1e3, fps=fps,
                audio=fps * 0.08, replays=replays, decodes=decodes, rows=made / steps, kernels=kernels,
                floor=StepBytes.of_runner(engine.runner).floor_ms(batch, round(ctx)))


def kernels_per_step(engine: Engine, device: str) -> int | None:
    """GPU kernels one decode step launches (= the nodes its graph replays): one eager step under the
    profiler, memcpy/memset excluded. None on CPU."""
    if not device.startswith("cuda"):
        return None
    from torch.profiler import ProfilerActivity, profile

    graphs = bool(engine.runner.graph_buckets)
    engine.runner.use_graphs(False)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.step()
        sync(device)
    engine.runner.use_graphs(graphs)
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(1 for n in names if not n.lower().startswith(("memcpy", "memset")))


def first_step(engine: Engine, n: int, device: str, repeats: int = 3) -> dict:
    """TTFA anatomy on an idle engine: `n` sequences arrive at once; the step that prefills them and makes
    their first frame (pipelined codec: until the next step() call returns that frame with its audio),
    split into host time and the GPU time of its prefill and decode (engine stats).
    Medians over `repeats` arrivals."""
    spk = sorted(engine.checkpoint.config.talker.speaker_ids)[0]
    samples = []
    for r in range(repeats):
        ids = [f"first{n}_{r}_{i}" for i in range(n)]
        s0 = engine.stats()
        sync(device)
        t0 = time.perf_counter()
        for i, sid in enumerate(ids):
            engine.add(sid, VoiceSpec(speaker=spk), SamplingParams(seed=i, max_frames=4), TEXT, True)
        t1 = time.perf_counter()
        outs = engine.step()
        if engine.launches_ahead:  # the first frames land, with their audio, at the next call
            outs += engine.step()
        sync(device)
        t2 = time.perf_counter()
        s1 = engine.stats()
        samples.append(dict(add=t1 - t0, step=t2 - t1, prefill=s1["prefill_seconds"] - s0["prefill_seconds"],
                            decode=s1["decode_seconds"] - s0["decode_seconds"],
                            frames=sum(o.codes.shape[0] for o in outs)))
        drain(engine, ids)
    med = {k: 1e3 * statistics.median(x[k] for x in samples) for k in ("add", "step", "prefill", "decode")}
    return dict(n=n, add_ms=med["add"], step_ms=med["step"], prefill_ms=med["prefill"], decode_ms=med["decode"],
                host_ms=med["step"] - med["prefill"] - med["decode"], frames=min(x["frames"] for x in samples))


def graph_vs_eager(engine: Engine, batch: int, steps: int = 4) -> bool:
    """Run the same greedy batch with graph replay and with the eager step body; compare codes."""
    results = []
    for use_graph in (True, False):
        engine.runner.use_graphs(use_graph)
        try:
            ids = fill(engine, batch, f"cmp{int(use_graph)}_", greedy=True, frames=steps + 4)
            frames = [sorted((o.seq_id[5:], o.codes.tobytes()) for o in engine.step()) for _ in range(steps)]
            drain(engine, ids)
        finally:
            engine.runner.use_graphs(True)
        results.append(frames)
    return results[0] == results[1]


ENGINE_CSV_COLUMNS = ("batch", "ms_per_step", "audio_s_per_s", "kernels_per_step", "gpu", "commit", "date")


def config_name(args) -> str:
    """The EngineConfig switches a row ran with (default = today's defaults)."""
    changed = [(n, getattr(args, n)) for n in ("codec_kernels", "codec_fusion", "codec_pipeline", "codec_sms",
                                                "fused_code_predictor", "fused_talker", "fp32_residual", "batch_invariant",
                                                "programmatic_launch", "steps_in_flight", "launch_at_frames", "chain_tune")
               if getattr(args, n) != getattr(EngineConfig, n)]
    return "+".join(n if v is True else f"no_{n}" if v is False else f"{n}={v}" for n, v in changed) or "default"


def add_model_arguments(p: argparse.ArgumentParser, batches: list[int]) -> None:
    """The checkpoint / device / batch flags shared by the engine benchmarks."""
    p.add_argument("--model", help="checkpoint folder (default: make a random one)")
    p.add_argument("--scale", choices=("tiny", "full"), default="full")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--batches", type=int, nargs="+", default=batches)
    p.add_argument("--codec-kernels", action=argparse.BooleanOptionalAction, default=EngineConfig.codec_kernels,
                   help="EngineConfig.codec_kernels (Triton conv/SnakeBeta)")
    p.add_argument("--codec-fusion", action=argparse.BooleanOptionalAction, default=EngineConfig.codec_fusion,
                   help="EngineConfig.codec_fusion (SnakeBeta and phase interleaves in conv epilogues, one-launch "
                        "codebook lookups)")
    p.add_argument("--codec-pipeline", action=argparse.BooleanOptionalAction, default=EngineConfig.codec_pipeline,
                   help="EngineConfig.codec_pipeline (each frame's audio one step behind; default: with graphs "
                        "and one step in flight)")
    p.add_argument("--codec-sms", type=int, default=EngineConfig.codec_sms,
                   help="EngineConfig.codec_sms (the pipelined codec on a green context of N SMs; 0: all)")
    p.add_argument("--steps-in-flight", type=int, choices=(1, 2), default=EngineConfig.steps_in_flight,
                   help="EngineConfig.steps_in_flight (2: the next decode step launched before the last one lands)")
    p.add_argument("--launch-at-frames", action=argparse.BooleanOptionalAction,
                   default=EngineConfig.launch_at_frames,
                   help="EngineConfig.launch_at_frames (two in flight: launch once the last step's frames are made)")
    p.add_argument("--fused-code-predictor", type=int, default=EngineConfig.fused_code_predictor,
                   metavar="MAX_BATCH", help="EngineConfig.fused_code_predictor: the largest bucket whose code "
                   "predictor runs its fused Triton kernels (0: never)")
    p.add_argument("--fused-talker", type=int, default=EngineConfig.fused_talker,
                   help="EngineConfig.fused_talker: the largest bucket whose talker decode layers run in 5 "
                        "Triton launches each (0: none)")
    p.add_argument("--fp32-residual", action=argparse.BooleanOptionalAction, default=EngineConfig.fp32_residual,
                   help="EngineConfig.fp32_residual (the residual stream in fp32)")
    p.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction,
                   default=EngineConfig.batch_invariant,
                   help="EngineConfig.batch_invariant (a row's bits independent of the batch)")
    add_programmatic_launch_argument(p)
    p.add_argument("--chain-tune", action=argparse.BooleanOptionalAction, default=EngineConfig.chain_tune,
                   help="EngineConfig.chain_tune (the code predictor's configs tuned on its passes' graph time)")


def add_programmatic_launch_argument(p: argparse.ArgumentParser) -> None:
    """--[no-]programmatic-launch, default an engine's (EngineConfig.programmatic_launch: the fused kernels start
    while the one before runs); the kernel benches pass it to kernels.set_programmatic_launch."""
    p.add_argument("--programmatic-launch", action=argparse.BooleanOptionalAction,
                   default=EngineConfig.programmatic_launch,
                   help="EngineConfig.programmatic_launch (the fused kernels start while the one before runs)")


def bench_tune_cache() -> str | None:
    """EngineConfig.tune_cache of the benchmarked engines: $Q3TTS_TUNE_CACHE when set, else none (each run
    tunes afresh). perf/gpu_round.sh sets it and carries the file between device calls, so a cold machine's
    engine times no kernel configs again, and both sides of an A/B on the same kernels run the same picks."""
    return os.environ.get("Q3TTS_TUNE_CACHE") or None


def chain_tuned_note() -> str:
    """The parts chain-tuned in the process's tuning table, by this run or by an earlier process that saved to
    the same file (`--no-chain-tune` keeps those picks: it only tunes nothing new)."""
    return f"chain-tuned: {'; '.join(chain_tuned_parts()) or 'none'}"


def configs_line() -> str:
    """Where an engine bench's launch configs came from: its tuning table (`bench_tune_cache`), and
    `chain_tuned_note`."""
    path = bench_tune_cache()
    table = f"tuning table {path}" if path else "no table (tuned in this run)"
    return f"launch configs: {table}; {chain_tuned_note()}"


def add_tune_cache_argument(p: argparse.ArgumentParser) -> None:
    """--tune-cache of the kernel benches (not engines): the table they start from and save to."""
    p.add_argument("--tune-cache", default=bench_tune_cache(),
                   help="tuning table to start from and save to (default $Q3TTS_TUNE_CACHE; '': none)")


@contextlib.contextmanager
def tuning_table(path: str | None, device: torch.device):
    """Load the tuning table at `path` (none: '' or None) for the block -> how many configs it gave; save the
    table back to it afterwards (with what the block tuned)."""
    from q3tts.kernels.autotune import load_tuned, save_tuned

    yield load_tuned(path, device) if path else 0
    if path:
        save_tuned(path, device)


def build_engine(args, frames: int) -> Engine:
    """The benchmarked engine: slots for the largest batch, every power-of-two bucket up to it,
    sequences of `frames` frames; sets `args.dtype` to the dtype it chose."""
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    max_b = max(args.batches)
    buckets = tuple(sorted({1, 2, 4, 8, 16, 32, 64, 128, 256, *args.batches}))
    buckets = tuple(b for b in buckets if b <= max(256, max_b))
    cfg = EngineConfig(device=args.device, dtype=args.dtype, max_slots=max_b, max_queue=max_b,
                       max_frames=frames + 16, max_prompt_tokens=256, max_text_tokens=256,
                       kv_memory_fraction=0.5, graph_batch_sizes=buckets,
                       num_pages=None if args.device.startswith("cuda") else 2 * max_b * (frames + 300) // 16,
                       use_cuda_graphs=not args.no_cuda_graphs, codec_kernels=args.codec_kernels,
                       codec_fusion=args.codec_fusion,
                       codec_pipeline=args.codec_pipeline, codec_sms=args.codec_sms,
                       fused_code_predictor=args.fused_code_predictor, fused_talker=args.fused_talker,
                       fp32_residual=args.fp32_residual, batch_invariant=args.batch_invariant,
                       programmatic_launch=args.programmatic_launch, steps_in_flight=args.steps_in_flight,
                       launch_at_frames=args.launch_at_frames, chain_tune=args.chain_tune,
                       tune_cache=bench_tune_cache())
    model = make_model(args)
    log_start_phases("engine start: %(message)s")  # a cold H200 start takes minutes: a run cut off says where
    engine = Engine(model, cfg)
    print(f"engine up in {engine.startup}: {engine.config.num_pages} KV pages, graphs "
          f"{list(engine.runner.graph_buckets) or 'off (eager)'}", flush=True)
    return engine


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p, [1, 8, 32, 64, 128, 256])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--arrivals", type=int, nargs="+", default=[1, 4, 16],
                   help="sequences arriving at once, for the first-step (TTFA anatomy) table")
    args = p.parse_args(argv)
    engine = build_engine(args, args.steps)
    dtype = args.dtype
    rows = []
    for b in args.batches:
        r = bench_batch(engine, b, args.steps, args.device)
        rows.append(r)
        print(f"B={b:4d} bucket={r['bucket']} {r['ms']:8.2f} ms/step {r['fps']:9.1f} frames/s "
              f"{r['audio']:8.2f} audio-s/s  rows/step {r['rows']:.1f}  graph replays {r['replays']}/{r['decodes']} steps")
    graphs_on = bool(engine.runner.graph_buckets)
    one_launch = all(r["replays"] == r["decodes"] for r in rows) if graphs_on else None
    same = graph_vs_eager(engine, min(8, max(args.batches))) if graphs_on else None
    print(f"one graph replay per decode step: {one_launch}; graph == eager (greedy, bit-exact): {same}")
    first = [first_step(engine, n, args.device) for n in args.arrivals if n <= engine.config.max_slots]
    table = ["| batch | bucket | ms/step | frames/s | audio-s/s | RTF/stream | replays/steps | kernels/step | "
             "floor ms (× away) |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        table.append(f"| {r['batch']} | {r['bucket']} | {r['ms']:.2f} | {r['fps']:.1f} | {r['audio']:.2f} | "
                     f"{r['ms'] / 80:.4f} | {r['replays']}/{r['decodes']} | {r['kernels']} | "
                     f"{r['floor']:.2f} ({r['ms'] / r['floor']:.1f}×) |")
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    codec = f", {config_name(args)}" if config_name(args) != "default" else ""
    md = (f"# Engine decode step ({args.scale} 1.7B CustomVoice, {dtype}, {dev}{codec})\n\n" + "\n".join(table)
          + "\n\nfloor: the bytes the step must read (weights once, each row's KV and codec state; perf/floor.py) "
          f"at the H200's {H200_BYTES_PER_S / 1e12:.1f} TB/s\n\n{configs_line()}"
          + f"\n\none graph replay per decode step: {one_launch}; graph == eager: {same}\n\n"
          + "First step after n arrivals on an idle engine (prefill + first frame; medians of 3; device times from"
          " the engine's CUDA events (wall clock on CPU), host = step wall − both):\n\n"
          + "| arrivals | first frames made (min) | add() ms | step ms | prefill device ms | decode device ms | host ms |\n"
          + "|---:|---:|---:|---:|---:|---:|---:|\n"
          + "".join(f"| {f['n']} | {f['frames']} | {f['add_ms']:.2f} | {f['step_ms']:.2f} | {f['prefill_ms']:.2f} | "
                    f"{f['decode_ms']:.2f} | {f['host_ms']:.2f} |\n" for f in first))
    emit(md, f"engine_bench_{config_name(args)}.md")
    if args.device.startswith("cuda"):
        csv_rows = [dict(batch=r["batch"], ms_per_step=r["ms"], audio_s_per_s=r["audio"],
                         kernels_per_step=r["kernels"]) for r in rows]
        name = "engine.csv" if config_name(args) == "default" else f"engine-{config_name(args)}.csv"
        for folder in (Path(__file__).resolve().parent / "results", Path(os.environ.get("OUT", "/tmp"))):
            append_csv(folder / name, csv_rows, columns=ENGINE_CSV_COLUMNS)
    return 0 if (one_launch in (True, None) and same in (True, None)) else 1


if __name__ == "__main__":
    raise SystemExit(main())
