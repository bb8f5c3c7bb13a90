"""Where the decode step's time goes: talker / code predictor / sampling / codec, graph and eager.

H200 (the default): python3 perf/profile_step.py            (~2-4 min with the checkpoint build)
    builds the engine exactly like perf/bench_engine.py (real-size random 1.7B CustomVoice checkpoint,
    or --model DIR), fills it with B live sequences for each B in --batches (1 8 64), and times, on the
    live state of the last decode step (same rows, positions, pages, padding):
      talker_layers   28 layers + final norm over the paged KV        (one decode token per row)
      talker_head     codec head -> fp32 logits
      talker_sample   sample_talker (rep. penalty, EOS/suppress, temp, top-k, top-p, draw)
      cp_generate     code predictor: 15 passes + 15 subtalker samples (what the step runs)
      cp_passes       the same 15 passes with greedy draws (an argmax: the passes nearly alone)
      sub_sample_x15  15 x warp_and_draw on [B, codebook] logits (subtalker sampling alone, the
                      step's sampling mode: TOPK for default parameters)
      sub_sample_full_x15  the same with the reference FULL (two-sort) sampling
      uniforms        the counter-based uniform draws (x2)
      codec_frame     StreamingDecoder.decode_frame (gather state, chunk decode, scatter)
      full_step       the engine's own captured step graph / its eager body (reference)
      overlap         (CUDA) the frame's work (cp_generate + talker_layers/head/sample) as one graph and
                      codec_frame as another, replayed --iters times one after the other on one stream vs
                      the codec on a second stream that waits only for its own frame's work (the next
                      frame's work does not wait for the codec): ms per frame each way, what running the
                      codec off the critical path can give; and both in one graph, forked and joined as
                      the engine's step graph holds them. --probe-sms N ...: the same with the codec
                      captured on a stream of a CUDA green context of N SMs (its kernels then run on those
                      N SMs only, so they cannot hold the SMs the frame's chain of small kernels waits
                      for), and the codec alone there
    each as its own captured CUDA graph (replay timed with CUDA events, median of --iters) and eager
    (wall clock around a synchronized call, median), plus graph == eager (bit-exact) per component;
    then (CUDA graphs) --timeline-replays replays of the engine's step graph under torch.profiler, read by
    perf/graph_timeline.py: how long no kernel runs inside a replay, how much its branches overlap, the
    kernels' time inside the graph; then a torch.profiler trace of one eager step aggregated by kernel name
    (top 25 by CUDA time, with launch counts). Writes $OUT/profile_step.md when OUT is set.
CPU check:          python3 perf/profile_step.py --scale tiny --device cpu --batches 1 3 --iters 3
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import emit  # noqa: E402
from graph_timeline import REPLAY_GAP_US, kernel_events, split_replays, summarize, timeline_table  # noqa: E402
from bench_engine import add_model_arguments, build_engine, configs_line, drain, fill, sync  # noqa: E402

from q3tts.engine.audio_pipeline import green_context  # noqa: E402
from q3tts.engine.chain_tuning import capture_graph, replay_ms  # noqa: E402
from q3tts.engine.cuda_graph import DecodeMeta  # noqa: E402
from q3tts.engine.engine import Engine  # noqa: E402
from q3tts.models import step as model_step  # noqa: E402
from q3tts.models.attention import DecodeContext  # noqa: E402
from q3tts.models.sampling import FULL, GREEDY, SubtalkerSampler, sample_talker, warp_and_draw  # noqa: E402


# --------------------------------------------------------------------------- timing

class Timer:
    def __init__(self, device: torch.device, iters: int, eager_iters: int):
        self.cuda = device.type == "cuda"
        self.iters, self.eager_iters = iters, eager_iters

    def graph(self, replay: Callable[[], None]) -> float:
        """Median ms of one graph replay (CUDA events around each `replay()`)."""
        return replay_ms(replay, self.iters)

    def eager(self, fn: Callable[[], None]) -> float:
        """Median ms of one synchronized eager call (wall clock: includes launch overhead)."""
        fn()
        return self._wall(fn, wait=True)

    def host(self, fn: Callable[[], None]) -> float:
        """Median ms the host spends inside fn() alone, the device idle when each call starts (its work is
        waited for only after the clock stops): for a graph replay, the cost of launching it."""
        return self._wall(fn, wait=False)

    def _wall(self, fn: Callable[[], None], wait: bool) -> float:
        """Median wall ms of fn() over `eager_iters` calls, each started on an idle device; the clock stops
        after the device finished its work (`wait`) or when fn returns."""
        times = []
        for _ in range(self.eager_iters):
            self._sync()
            t0 = time.perf_counter()
            fn()
            if wait:
                self._sync()
            times.append((time.perf_counter() - t0) * 1e3)
        self._sync()
        return statistics.median(times)

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


capture = capture_graph  # the engine's recipe (engine/chain_tuning.py)


# --------------------------------------------------------------------------- components

class Component:
    """fn() writes its results into `outs` (static tensors); `state` = tensors fn mutates that must
    be restored between the graph and the eager run for the bit-exact comparison."""

    def __init__(self, name: str, fn: Callable[[], None], outs: list[torch.Tensor],
                 state: list[torch.Tensor] | None = None):
        self.name, self.fn, self.outs, self.state = name, fn, outs, state or []


def components(engine: Engine, bs: int) -> list[Component]:
    """Static inputs from the live state of rows [:bs] of the last decode step."""
    runner = engine.runner
    talker, kv, st, buf = runner.talker, runner.kv, runner.state, runner.buf
    cp = talker.code_predictor
    row = DecodeMeta.columns(buf.meta[:bs].clone())
    sl, pos, frame, smap, ctx_lens = row.slot, row.position, row.frame, row.slot_mapping, row.context_len.int()
    tables = buf.tables[:bs].clone()
    seeds = st.seed[sl].clone()
    c0 = st.last_c0[sl].clone()
    past = st.past_hidden[sl].clone()
    generated = st.rep_mask[sl].clone()
    num_gen = frame + 1
    mode = runner.step_mode(sl.tolist())  # the engine step's sampling mode on these rows
    sampling = runner.state.sampling_rows(sl)
    tparams, sparams = runner.talker_params(sampling, mode), runner.sub_params(sampling, mode)
    rules = model_step.talker_rules(talker)
    uni = runner.uniform_source
    with torch.no_grad():
        u_frame = uni(seeds, frame)  # [B, 16]
        u_next = uni(seeds, frame + 1)[:, 0].contiguous()
        codes0, next_input = cp.generate(past, c0, SubtalkerSampler(sparams, u_frame))
        queue_row = frame.clamp(max=st.text_queue.shape[1] - 1)
        text = torch.where((frame < st.text_len[sl])[:, None], st.text_queue[sl, queue_row],
                           runner.pad_row[None, :])
        x = (next_input + text).contiguous()
        hidden0 = talker(x, pos, DecodeContext(kv, smap, tables, ctx_lens, talker.attn_scale))
        logits0 = talker.logits(hidden0)
        gen = torch.Generator(device=past.device).manual_seed(0)
        cp_logits = torch.randn(cp.num_groups - 1, bs, cp.lm_head[0].out_features, generator=gen,
                                device=past.device, dtype=torch.float32)  # [15, B, codebook]
        frames0 = torch.cat((c0[:, None], codes0), 1)

    o_hidden, o_logits = torch.empty_like(hidden0), torch.empty_like(logits0)
    o_c0 = torch.empty_like(c0)
    o_codes, o_next = torch.empty_like(codes0), torch.empty_like(next_input)
    o_codes2 = torch.empty_like(codes0)
    o_sub = torch.empty(cp.num_groups - 1, bs, dtype=torch.int64, device=c0.device)
    o_u = torch.empty_like(u_frame)
    o_u2 = torch.empty_like(u_next)

    def talker_layers():
        ctx = DecodeContext(kv, smap, tables, ctx_lens, talker.attn_scale)
        o_hidden.copy_(talker(x, pos, ctx))

    def talker_head():
        o_logits.copy_(talker.logits(hidden0))

    def talker_sample():
        o_c0.copy_(sample_talker(logits0, tparams, rules, generated, num_gen, u_next))

    def cp_generate():
        codes, nxt = cp.generate(past, c0, SubtalkerSampler(sparams, u_frame))
        o_codes.copy_(codes)
        o_next.copy_(nxt)

    greedy = dataclasses.replace(sparams, greedy=torch.ones_like(sparams.greedy)).with_mode(GREEDY)

    def cp_passes():  # greedy draws: an argmax per pass (fused or eager, as the step runs it)
        codes, _ = cp.generate(past, c0, SubtalkerSampler(greedy, u_frame))
        o_codes2.copy_(codes)

    def sub_sample():
        for j in range(cp.num_groups - 1):
            o_sub[j].copy_(warp_and_draw(cp_logits[j], sparams, u_frame[:, j + 1]))

    sparams_full = sparams.with_mode(FULL)
    o_sub_full = torch.empty_like(o_sub)

    def sub_sample_full():  # the reference two-sort path, for comparison
        for j in range(cp.num_groups - 1):
            o_sub_full[j].copy_(warp_and_draw(cp_logits[j], sparams_full, u_frame[:, j + 1]))

    def uniforms():
        o_u.copy_(uni(seeds, frame))
        o_u2.copy_(uni(seeds, frame + 1)[:, 0])

    comps = [Component("talker_layers", talker_layers, [o_hidden]),
             Component("talker_head", talker_head, [o_logits]),
             Component("talker_sample", talker_sample, [o_c0]),
             Component("cp_generate", cp_generate, [o_codes, o_next]),
             Component("cp_passes", cp_passes, [o_codes2]),
             Component("sub_sample_x15", sub_sample, [o_sub]),
             Component("sub_sample_full_x15", sub_sample_full, [o_sub_full]),
             Component("uniforms", uniforms, [o_u, o_u2])]
    if runner.codec is not None:
        codec = runner.codec
        o_pcm = torch.empty(bs, runner.samples_per_frame, dtype=torch.float32, device=c0.device)

        def codec_frame():
            o_pcm.copy_(codec.decode_frame(sl, frames0).float())

        comps.append(Component("codec_frame", codec_frame, [o_pcm], list(codec.pool)))
    return comps


def profile_components(engine: Engine, bs: int, timer: Timer) -> list[dict]:
    rows = []
    cuda = engine.runner.device.type == "cuda"
    with torch.no_grad():
        for comp in components(engine, bs):
            r = dict(name=comp.name, graph=None, eager=None, same=None)
            snap = [t.clone() for t in comp.state]
            if cuda:
                try:
                    g = capture(comp.fn)
                    for t, s in zip(comp.state, snap):
                        t.copy_(s)
                    g.replay()
                    torch.cuda.synchronize()
                    got = [o.clone() for o in comp.outs]
                    for t, s in zip(comp.state, snap):
                        t.copy_(s)
                    comp.fn()
                    r["same"] = all(torch.equal(a, b) for a, b in zip(got, comp.outs))
                    if not r["same"]:
                        r["diff"] = max(_maxdiff(a, b) for a, b in zip(got, comp.outs))
                    r["graph"] = timer.graph(g.replay)
                    del g
                except Exception as exc:  # noqa: BLE001 - report and go on: one bad capture must not cost the run
                    r["error"] = f"{type(exc).__name__}: {exc}"[:200]
                    print(f"  {comp.name}: graph failed: {r['error']}", flush=True)
                    torch.cuda.synchronize()
            r["eager"] = timer.eager(comp.fn)
            for t, s in zip(comp.state, snap):
                t.copy_(s)
            rows.append(r)
    return rows


def _ms_per_frame(iters: int, frame: Callable[[], None], side: torch.cuda.Stream | None = None) -> float:
    """ms per frame of `iters` calls of frame() (each enqueues one frame's work), the current stream
    waiting for `side` at the end; the best of 3 timings after one warm-up."""
    main = torch.cuda.current_stream()

    def once() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record(main)
        for _ in range(iters):
            frame()
        if side is not None:
            main.wait_stream(side)
        end.record(main)
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters

    once()
    return min(once() for _ in range(3))


def _on(stream: torch.cuda.Stream, fn: Callable[[], None]) -> None:
    """Enqueue fn() on `stream` after the work enqueued so far on the current stream."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()


def _forked(work: Callable[[], None], codec: Callable[[], None], side: torch.cuda.Stream) -> Callable[[], None]:
    """One frame as the engine's step graph runs it: fork to `side` for the codec, the frame's work on
    the current stream, join."""
    return lambda: (_on(side, codec), work(), torch.cuda.current_stream().wait_stream(side))


def _beside(iters: int, g_work: torch.cuda.CUDAGraph, work: Callable[[], None], codec: Callable[[], None],
            stream: torch.cuda.Stream) -> tuple[torch.cuda.CUDAGraph, float, float]:
    """The codec captured on `stream`; ms per frame with it replayed there beside the frame's work (waiting for
    that frame's work only), and with both in one graph forked and joined as the engine's step graph holds them."""
    with torch.no_grad():
        g_codec, g_both = capture(codec, stream), capture(_forked(work, codec, stream))
    overlapped = _ms_per_frame(iters, lambda: (g_work.replay(), _on(stream, g_codec.replay)), stream)
    return g_codec, overlapped, _ms_per_frame(iters, g_both.replay)


def overlap_probe(engine: Engine, bs: int, iters: int, codec_sms: tuple[int, ...] = ()) -> dict | None:
    """ms per frame of (frame work; codec): serial on one stream, and the codec on a second stream that
    waits for its own frame's work only (values are not checked: state is overwritten repeatedly).
    For each N of codec_sms, with the codec on a stream of a green context of N SMs: the codec alone
    (`alone_N`), overlapped as above (`overlapped_N`), and both in one graph forked and joined as the
    engine's step graph holds them (`forked_N`, against `forked` on a plain stream); or the error
    that stopped it (`error_N`)."""
    if engine.runner.device.type != "cuda" or engine.runner.codec is None:
        return None
    comps = {c.name: c for c in components(engine, bs)}
    parts = [comps[n].fn for n in ("cp_generate", "talker_layers", "talker_head", "talker_sample")]
    work, codec = (lambda: [fn() for fn in parts]), comps["codec_frame"].fn
    with torch.no_grad():
        g_work = capture(work)
    g_codec, overlapped, forked = _beside(iters, g_work, work, codec, torch.cuda.Stream())
    result = dict(serial=_ms_per_frame(iters, lambda: (g_work.replay(), g_codec.replay())),
                  overlapped=overlapped, forked=forked)
    for n in codec_sms:
        try:
            ctx = green_context(n, engine.runner.device)
            green = ctx.Stream()
            g_green, result[f"overlapped_{n}"], result[f"forked_{n}"] = _beside(iters, g_work, work, codec, green)
            result[f"alone_{n}"] = _ms_per_frame(iters, lambda: _on(green, g_green.replay), green)
            torch.cuda.synchronize()
            del g_green, green, ctx  # the graphs before the context they run in
        except Exception as exc:  # noqa: BLE001 - a probe: report why it did not run
            result[f"error_{n}"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return result


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.is_floating_point():
        return float((a.float() - b.float()).abs().max())
    return float((a != b).sum())  # integer outputs: count of differing entries


def _step_mode(engine: Engine, bs: int) -> str:
    """The sampling mode of the engine's step on the rows [:bs] loaded now."""
    return engine.runner.step_mode(DecodeMeta.columns(engine.runner.buf.meta[:bs]).slot.tolist())


def _live_rows(engine: Engine, bs: int) -> tuple[Callable[[], None], str]:
    """(restore, mode): `restore()` puts back the meta rows and block tables [:bs] of the last decode step (as they
    are now) for the step to run again on them; mode: the step's sampling mode on those rows."""
    buf = engine.runner.buf
    meta, tables = buf.meta[:bs].clone(), buf.tables[:bs].clone()

    def restore():
        buf.meta[:bs].copy_(meta)
        buf.tables[:bs].copy_(tables)

    return restore, _step_mode(engine, bs)


def full_step(engine: Engine, bs: int, timer: Timer) -> dict:
    """The engine's own step on the current meta rows: its captured graph and its eager body. For the graph also
    `synced` (ms, wall clock of synchronize, replay, synchronize: the launch not hidden behind earlier work, as
    in an engine step launched once the last one landed) and `launch` (ms of host time in the replay call)."""
    runner = engine.runner
    r = dict(name="full_step", graph=None, eager=None, same=None, synced=None, launch=None)
    restore, mode = _live_rows(engine, bs)
    with torch.no_grad():
        if bs in runner.graph_buckets:
            restore()
            replay = lambda: runner.run_step(bs, mode)  # noqa: E731
            r["graph"], r["synced"], r["launch"] = timer.graph(replay), timer.eager(replay), timer.host(replay)
        restore()
        r["eager"] = timer.eager(lambda: runner.decode_rows(bs, mode))
    return r


# --------------------------------------------------------------------------- profiler

def trace_step(engine: Engine, bs: int, top: int = 25) -> tuple[list[str], str]:
    """torch.profiler over one eager step; kernels (CUDA) or ops (CPU) by name, top `top`."""
    from torch.profiler import ProfilerActivity, profile

    runner = engine.runner
    cuda = runner.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    mode = _step_mode(engine, bs)
    with torch.no_grad():
        runner.decode_rows(bs, mode)  # warm
        sync(str(runner.device))
        with profile(activities=acts) as prof:
            runner.decode_rows(bs, mode)
            sync(str(runner.device))
    return kernel_table(prof, cuda, "in one eager step", top)


def graph_trace(engine: Engine, bs: int, replays: int) -> list[str]:
    """torch.profiler over `replays` replays of the engine's step graph of bucket `bs` on the live rows, the
    device idle between them -> perf/graph_timeline.py's table (idle, overlap, kernels inside the graph)."""
    from torch.profiler import ProfilerActivity, profile

    restore, mode = _live_rows(engine, bs)
    with torch.no_grad():
        restore()
        engine.runner.run_step(bs, mode)  # warm
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                restore()
                engine.runner.run_step(bs, mode)
                torch.cuda.synchronize()
                time.sleep(2 * REPLAY_GAP_US / 1e6)  # the device idles: split_replays cuts here
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    return timeline_table(summarize(split_replays(kernel_events(trace))))


def kernel_table(prof, cuda: bool, where: str, top: int = 25) -> tuple[list[str], str]:
    """A finished torch.profiler run's kernels (CUDA) or ops (CPU) by name, the top `top` by time: table
    lines and a summary (launches, total time `where`, aten op calls)."""
    kernels, ops = [], []
    for e in prof.key_averages():
        dev_t = _first_attr(e, ("self_device_time_total", "self_cuda_time_total"))
        is_kernel = str(getattr(e, "device_type", "")).endswith("CUDA") or (
            cuda and dev_t > 0 and _first_attr(e, ("self_cpu_time_total",)) == 0)
        if is_kernel:
            kernels.append((e.key, e.count, dev_t))
        elif not e.key.startswith("ProfilerStep"):
            ops.append((e.key, e.count, _first_attr(e, ("self_cpu_time_total",))))
    if cuda and kernels:
        items, unit = kernels, "CUDA"
    else:
        items, unit = ops, "self CPU"
    total_t = sum(t for _, _, t in items) or 1.0
    total_n = sum(n for _, n, _ in items)
    aten_launches = sum(n for k, n, _ in ops if k.startswith("aten::"))
    items = sorted(items, key=lambda t: -t[2])[:top]
    lines = [f"| kernel ({unit}) | count | total us | us/launch | % |", "|---|---:|---:|---:|---:|"]
    for name, n, t in items:
        short = name if len(name) <= 90 else name[:87] + "..."
        short = short.replace("|", "/")
        lines.append(f"| `{short}` | {n} | {t:.0f} | {t / max(n, 1):.1f} | {100 * t / total_t:.1f} |")
    summary = (f"{'kernels' if unit == 'CUDA' else 'ops'}: {total_n} launches, {total_t / 1e3:.2f} ms "
               f"{unit} time {where}; aten op calls {aten_launches}")
    return lines, summary


def _first_attr(e, names) -> float:
    for n in names:
        v = getattr(e, n, None)
        if v is not None:
            return float(v)
    return 0.0


# --------------------------------------------------------------------------- main

def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(p, [1, 8, 64])
    p.add_argument("--iters", type=int, default=50, help="graph replays per timing (median)")
    p.add_argument("--eager-iters", type=int, default=None, help="default iters // 5, at least 3")
    p.add_argument("--frames", type=int, default=64, help="max_frames of the filled sequences")
    p.add_argument("--warm-steps", type=int, default=8, help="engine steps before profiling a batch")
    p.add_argument("--trace-batches", type=int, nargs="*", default=None,
                   help="batches to trace with torch.profiler (default: all)")
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--timeline-replays", type=int, default=5,
                   help="replays of the step graph under torch.profiler for its device timeline (0: none)")
    p.add_argument("--probe-sms", type=int, nargs="*", default=[],
                   help="overlap probe: also confine the codec to a green context of N SMs, for each N")
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    engine = build_engine(args, args.frames)
    timer = Timer(engine.runner.device, args.iters, args.eager_iters or max(3, args.iters // 5))
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    md = [f"# Decode step profile ({args.scale} 1.7B CustomVoice, {args.dtype}, {dev})", "",
          "Per component: ms per call, graph = one captured CUDA graph (replay, CUDA events, median), "
          "eager = synchronized wall clock (median). `==` graph output bit-equal to eager on the same "
          "inputs. Components run on the live state of the last decode step of B filled sequences.", "",
          configs_line(), ""]
    trace_b = args.batches if args.trace_batches is None else args.trace_batches
    ok = True
    for b in args.batches:
        t0 = time.perf_counter()
        ids = fill(engine, b, f"p{b}_", frames=args.frames)
        for _ in range(args.warm_steps):
            engine.step()
        bucket = engine.config.bucket_for(b) or b
        active = engine.stats()["active"]
        rows = profile_components(engine, bucket, timer)
        rows.append(full_step(engine, bucket, timer))
        print(f"B={b}: components and full step in {time.perf_counter() - t0:.1f} s", flush=True)
        ok &= all(r["same"] in (True, None) for r in rows) and not any("error" in r for r in rows)
        parts = {r["name"]: r for r in rows}
        md.append(f"## B={b} (bucket {bucket}, {active} active after {args.warm_steps} warm steps)")
        md.append("")
        md.append("| component | graph ms | eager ms | eager/graph | % of step (graph) | graph==eager |")
        md.append("|---|---:|---:|---:|---:|---|")
        step_g = parts["full_step"]["graph"]
        for r in rows:
            ratio = (r["eager"] / r["graph"]) if r["graph"] else None
            share = (100 * r["graph"] / step_g) if (r["graph"] and step_g) else None
            same = "-" if r["same"] is None else ("yes" if r["same"] else f"NO (diff {r.get('diff', 0):.3g})")
            if "error" in r:
                same = f"capture error: {r['error']}"
            md.append(f"| {r['name']} | {_fmt(r['graph'])} | {_fmt(r['eager'])} | "
                      f"{'-' if ratio is None else f'{ratio:.1f}x'} | "
                      f"{'-' if share is None else f'{share:.1f}'} | {same} |")
        g = {k: (v["graph"] if v["graph"] is not None else v["eager"]) for k, v in parts.items()}
        mode = "graph" if step_g is not None else "eager"
        if "cp_generate" in g:
            parts_sum = (g["talker_layers"] + g["talker_head"] + g["talker_sample"] + g["cp_generate"]
                         + g["uniforms"] + g.get("codec_frame", 0.0))
            md.append("")
            md.append(f"sum of parts ({mode}: talker_layers + talker_head + talker_sample + cp_generate + "
                      f"uniforms + codec_frame) = {parts_sum:.3f} ms vs full_step {g['full_step']:.3f} ms; "
                      f"cp_generate - cp_passes ~ subtalker sampling in the CP = "
                      f"{g['cp_generate'] - g['cp_passes']:.3f} ms")
        launched = parts["full_step"]
        if launched["synced"] is not None:
            md.append("")
            md.append(f"full_step's graph: {launched['graph']:.3f} ms of device time with replays queued back to "
                      f"back, {launched['synced']:.3f} ms synchronized (synchronize, replay, synchronize: its "
                      f"launch exposed), {launched['launch']:.3f} ms of host time in the replay call")
        probe = overlap_probe(engine, bucket, args.iters, tuple(args.probe_sms))
        if probe is not None:
            lines = [f"overlap (frame work ‖ codec on a second stream, {args.iters} frames): serial "
                     f"{probe['serial']:.3f} ms/frame, overlapped {probe['overlapped']:.3f} ms/frame",
                     f"- both in one graph, forked and joined as in the step graph: {probe['forked']:.3f} ms/frame"]
            lines += [f"- codec on a green context of {n} SMs: " + (
                      probe[f"error_{n}"] if f"error_{n}" in probe else
                      f"alone {probe[f'alone_{n}']:.3f} ms/frame, overlapped {probe[f'overlapped_{n}']:.3f}, "
                      f"forked in one graph {probe[f'forked_{n}']:.3f}")
                      for n in args.probe_sms]
            md += [""] + lines
            print(f"B={b}:", *lines, sep="\n", flush=True)
        if args.timeline_replays and bucket in engine.runner.graph_buckets:
            try:
                lines = graph_trace(engine, bucket, args.timeline_replays)
                md += ["", f"The step graph on the device (B={b}, bucket {bucket}; perf/graph_timeline.py):", ""] + lines
                print(f"B={b}:", lines[0], flush=True)
            except Exception as exc:  # noqa: BLE001 - the trace is extra: keep the timings
                md += ["", f"graph trace failed: {type(exc).__name__}: {exc}"]
        if b in trace_b:
            try:
                lines, summary = trace_step(engine, bucket)
                md += ["", f"torch.profiler, one eager step at B={b}: {summary}", ""] + lines
            except Exception as exc:  # noqa: BLE001 - the trace is extra: keep the timings
                md += ["", f"torch.profiler failed: {type(exc).__name__}: {exc}"]
        md.append("")
        drain(engine, ids)
        print(f"B={b}: done in {time.perf_counter() - t0:.1f} s", flush=True)
    md.append(f"total wall {time.perf_counter() - t_start:.1f} s")
    text = "\n".join(md) + "\n"
    emit(text, "profile_step.md")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
