"""Prefill device time: one ~60-token prompt and 16 arrivals, captured prefill graphs vs the eager path.

H200 (the default): python3 perf/bench_prefill.py [--icl]
    makes a real-size random 1.7B checkpoint (CustomVoice; Base with in-context-learning voices under
    --icl) or takes --model DIR, builds one engine with prefill graphs, then for each n in --arrivals:
    n sequences arrive on an idle engine and the step that starts them prefills them (one packed
    talker forward + first c0 draw: one graph replay, or today's eager `prefill_batch` when the
    runner's prefill graphs are set aside). Device time of that prefill from the engine's CUDA events
    (stats()['prefill_seconds']; it includes the codec priming of ICL voices), median of --repeats
    arrivals after one warm-up, graph and eager interleaved.
CPU check:          python3 perf/bench_prefill.py --scale tiny --device cpu --repeats 2
--max-slots N sizes the engine as bench_engine.py does (64), to compare the two benches' 16-arrival prefill.
--phases: then one more graph arrival of each n, its step's phases timed (`phase_table`): host ms and the
stream's span (CUDA events at entry and exit: GPU work plus any wait for the host) of the prefill, its parts
(sampling load, codec reset, the graph run) and of what follows it before the decode (each sequence's text);
and the kernels of one run of its token bucket's graph under torch.profiler, top 15 by time.

Appends `tokens,sequences,mode,device_ms,gpu,commit,date` rows to perf/results/prefill.csv (tokens =
prompt rows of the step; commit: LOADTEST_COMMIT, else git) and copies that file to $OUT/prefill.csv
when OUT is set (the device tool brings $OUT back; the repository copy there does not come back).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from bench_engine import bench_tune_cache, drain
from profile_step import kernel_table
from report import append_csv, commit, emit, gpu_name, save
from q3tts.core import SamplingParams, VoiceSpec
from q3tts.engine.config import EngineConfig
from q3tts.engine.engine import Engine
from q3tts.models.prompt import PromptBuilder

# 61 prompt rows with the random checkpoints' tokenizer
TEXT = "Hello world, this is a short benchmark sentence for the prefill of the speech engine."
REF_TEXT = "This reference recording is about three seconds long."
REF_FRAMES = 36  # 3 s of reference codes at 12 Hz
CSV = Path(__file__).resolve().parent / "results" / "prefill.csv"
FIELDS = ("tokens", "sequences", "mode", "device_ms", "gpu", "commit", "date")


def make_engine(args) -> Engine:
    variant = "base" if args.icl else "custom_voice"
    path = Path(args.model) if args.model else None
    if path is None:
        from q3tts.checkpoint.maker import make_checkpoint

        t0 = time.perf_counter()
        out = Path(tempfile.mkdtemp(prefix="q3tts_prefill_")) / f"{variant}_{args.scale}"
        path = make_checkpoint(out, variant, "1.7b", args.scale, seed=0)
        print(f"checkpoint {path} in {time.perf_counter() - t0:.1f} s", flush=True)
    most = args.max_slots or max(args.arrivals)
    cuda = args.device.startswith("cuda")
    cfg = EngineConfig(device=args.device, dtype="bfloat16" if cuda else "float32", max_slots=most,
                       max_queue=most, max_frames=64, max_prompt_tokens=512, max_text_tokens=256,
                       num_pages=None if cuda else most * 40,
                       graph_batch_sizes=tuple(b for b in (1, 2, 4, 8, 16, 32, 64) if b < 2 * most),
                       tune_cache=bench_tune_cache())
    engine = Engine(path, cfg)
    graphs = engine.runner.prefill_graphs
    print(f"engine up in {engine.startup}; prefill graphs "
          f"{sorted(graphs.graphs.graphs) if graphs and graphs.graphs else 'off (eager)'}", flush=True)
    return engine


def voices(engine: Engine, n: int, icl: bool) -> list[VoiceSpec]:
    """n CustomVoice speakers, or n Base voices cloned in context (random reference codes)."""
    if not icl:
        spk = sorted(engine.checkpoint.config.talker.speaker_ids)
        return [VoiceSpec(speaker=spk[i % len(spk)]) for i in range(n)]
    rng = np.random.default_rng(0)
    hidden = engine.checkpoint.config.talker.hidden_size
    cloned = [VoiceSpec(ref_codes=rng.integers(0, 2048, (REF_FRAMES, 16)), ref_text=REF_TEXT,
                        xvector=rng.standard_normal(hidden).astype(np.float32)) for _ in range(n)]
    for voice in cloned:  # kept on the device now, as a served voice is after its first request: an add of a
        engine.voices.get_or_prepare(voice)  # voice not kept yet is prepared off-thread, steps later
    return cloned


def prefill_ms(engine: Engine, batch: list[VoiceSpec], graph: bool, tag: str) -> float:
    """Device ms of the prefill of `batch` arriving at once on an idle engine (one step starts all)."""
    runner = engine.runner
    saved = runner.prefill_graphs
    runner.prefill_graphs = saved if graph else None
    try:
        ids = [f"{tag}_{i}" for i in range(len(batch))]
        before = engine.stats()
        for i, (sid, voice) in enumerate(zip(ids, batch)):
            engine.add(sid, voice, SamplingParams(seed=i, max_frames=2), TEXT, True)
        engine.step()
        queued = engine.stats()["queued"]
        drain(engine, ids)  # a pipelined step's prefill time is read when it lands, at the next call
        after = engine.stats()
    finally:
        runner.prefill_graphs = saved
    started = after["prefilled_sequences"] - before["prefilled_sequences"]
    assert queued == 0 and started == len(batch), \
        f"{len(batch) - queued} of {len(batch)} arrivals started in the first step, {started} in all"
    return 1e3 * (after["prefill_seconds"] - before["prefill_seconds"])


# (label, object path from the engine, method): the first step's phases, in the order the step runs them
PHASES = (("prefill (engine._prefill)", "", "_prefill"),
          ("  runner.start_batch", "runner", "start_batch"),
          ("    load sampling params", "runner", "_load_sampling"),
          ("    codec reset", "runner", "_prime_codec"),
          ("    pack + graph (runner._prefill)", "runner", "_prefill"),
          ("push text (each sequence)", "", "_push_text"),
          ("decode launch", "runner", "launch"))


class _Phase:
    """Wraps one method on its instance: host seconds and (CUDA) event pairs of every call."""

    def __init__(self, obj, name: str, cuda: bool):
        self.obj, self.name, self.cuda, self.calls = obj, name, cuda, []
        inner = getattr(obj, name)

        def timed(*a, **kw):
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if self.cuda else None
            t0 = time.perf_counter()
            if ev:
                ev[0].record()
            try:
                return inner(*a, **kw)
            finally:
                if ev:
                    ev[1].record()
                self.calls.append((time.perf_counter() - t0, ev))

        setattr(obj, name, timed)

    def restore(self) -> None:
        delattr(self.obj, self.name)  # the class's method again

    def row(self, label: str) -> str:
        host = 1e3 * sum(h for h, _ in self.calls)
        span = (sum(e[0].elapsed_time(e[1]) for _, e in self.calls) if self.cuda else float("nan"))
        return f"| {label} | {len(self.calls)} | {host:.2f} | {span:.2f} |"


def phase_table(engine: Engine, batch: list[VoiceSpec], tokens: int, tag: str) -> list[str]:
    """The phases (`PHASES`) of the step that starts `batch` (`tokens` prompt rows) on an idle engine, graph
    prefill: one table row each (calls, host ms, stream span ms), the engine's own prefill stamp, and the
    kernels of the token bucket that holds them (`bucket_kernels`)."""
    cuda = engine.runner.device.type == "cuda"
    phases = [(label, _Phase(engine if not path else getattr(engine, path), name, cuda))
              for label, path, name in PHASES]
    try:
        ms = prefill_ms(engine, batch, True, tag)
    finally:
        for _, phase in reversed(phases):
            phase.restore()
    if cuda:
        torch.cuda.synchronize()
    return ["| phase | calls | host ms | stream span ms |", "|---|---:|---:|---:|",
            *(phase.row(label) for label, phase in phases),
            f"| engine prefill stamps (t_prefill -> t_decode) | 1 | | {ms:.2f} |", *bucket_kernels(engine, tokens)]


def bucket_kernels(engine: Engine, tokens: int) -> list[str]:
    """torch.profiler over one run of the prefill bucket that holds `tokens` rows (`PrefillGraphs.run_filler`:
    its graph replay once captured): its kernels by name (on CPU: its ops), top 15 by time; [] without the
    prefill graphs."""
    graphs = engine.runner.prefill_graphs
    bucket = graphs.bucket_for(tokens, 1) if graphs is not None else None
    if bucket is None:
        return []
    cuda = engine.runner.device.type == "cuda"
    graphs.run_filler(bucket)  # warm
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        graphs.run_filler(bucket)
        if cuda:
            torch.cuda.synchronize()
    lines, summary = kernel_table(prof, cuda, f"in one run of the {bucket}-row bucket", top=15)
    return ["", f"torch.profiler: {summary}", "", *lines]


def measure(engine: Engine, batch: list[VoiceSpec], repeats: int) -> dict[str, float]:
    """Median ms per mode (graph: only when captured) over `repeats` arrivals after one warm-up each,
    modes interleaved."""
    modes = ("graph", "eager") if engine.runner.prefill_graphs is not None else ("eager",)
    samples: dict[str, list[float]] = {mode: [] for mode in modes}
    for r in range(repeats + 1):
        for mode in samples:
            ms = prefill_ms(engine, batch, mode == "graph", f"{mode}{len(batch)}_{r}")
            if r:
                samples[mode].append(ms)
    return {mode: statistics.median(x) for mode, x in samples.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint folder (default: make a random one)")
    p.add_argument("--scale", choices=("tiny", "full"), default="full")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--icl", action="store_true", help="Base checkpoint, in-context-learning voices")
    p.add_argument("--arrivals", type=int, nargs="+", default=[1, 16])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--max-slots", type=int, default=None,
                   help="EngineConfig.max_slots (default: the most arrivals); the prefill's sampling head "
                        "has this many rows, and bench_engine.py runs 64 (CSV mode gets _slots<N>)")
    p.add_argument("--phases", action="store_true", help="also time the phases of one graph arrival per n")
    args = p.parse_args(argv)
    assert args.max_slots is None or args.max_slots >= max(args.arrivals), "--max-slots below --arrivals"
    engine = make_engine(args)
    builder = PromptBuilder(engine.model, engine.checkpoint.tokenizer)
    gpu = gpu_name() if args.device.startswith("cuda") else "cpu"
    rows, lines, phases = [], [], []
    for n in args.arrivals:
        batch = voices(engine, n, args.icl)
        tokens = sum(builder.build(TEXT, v).prefill.shape[0] for v in batch)
        ms = measure(engine, batch, args.repeats)
        for mode, value in ms.items():
            rows.append(dict(tokens=tokens, sequences=n, device_ms=value,
                             mode=mode + ("_icl" if args.icl else "")
                             + (f"_slots{args.max_slots}" if args.max_slots else "")))
        graph = ms.get("graph", float("nan"))
        eager = ms["eager"]
        lines.append(f"| {n} | {tokens} | {graph:.2f} | {eager:.2f} | {eager / graph:.1f}x |")
        if args.phases:
            phases += ["", f"Phases of the step that starts {n} arrivals ({tokens} rows):", "",
                       *phase_table(engine, batch, tokens, f"phases{n}")]
    kind = "Base ICL" if args.icl else "CustomVoice"
    emit(f"# Prefill device time ({args.scale} 1.7B {kind}, {engine.config.dtype}, {gpu}, {commit()}, "
         f"max_slots {engine.config.max_slots}; "
         f"medians of {args.repeats})\n\n| arrivals | prompt rows | graph ms | eager ms | speed-up |\n"
         "|---:|---:|---:|---:|---:|\n" + "\n".join(lines + phases) + "\n",
         "prefill_bench_icl.md" if args.icl else "prefill_bench.md")
    append_csv(CSV, rows, gpu, columns=FIELDS)
    save(CSV.read_text(), "prefill.csv")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
