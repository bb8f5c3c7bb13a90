"""Codec bench: bf16 streaming decode quality and per-frame latency of the streaming decoder.

    python perf/bench_codec.py                      # H200: real-size random codec (scale full)
    OUT=/some/dir python perf/bench_codec.py        # also writes $OUT/codec_bench.md
    python perf/bench_codec.py --kernels            # convs / SnakeBeta through q3tts.kernels
    python perf/bench_codec.py --scale tiny --batches 1,4 --frames 30   # CPU smoke run
    python perf/bench_codec.py --kernels --stages --batches 1,64         # + where a call's time goes

Quality: SNR (dB) of the bf16 frame-by-frame streaming decode against the fp32 full decode of the
same codes (one stream, `--frames` frames), and the fp32 streaming-vs-full max error as a sanity check.
Latency: one `decode_frame` call for a batch of B streams (bf16), after the streams hold a full
attention window; CUDA events around `--iters` calls, eager and CUDA-graph replayed. "RTF" is the
audio produced per second of decoding: B · 80 ms / time per call.
--stages: then, per batch, each part of one call (the state gather and scatter, the quantizer and pre-conv,
the transformer, each upsampler, each decoder block) captured as its own CUDA graph (eager on CPU) and timed,
and the kernels of one eager call under torch.profiler by CUDA time (`codec_stages.md`).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable

from report import emit
import torch
from torch.profiler import ProfilerActivity, profile

from q3tts import kernels
from q3tts.codec import CodecDecoder, StreamingDecoder, read_speech_tokenizer, write_speech_tokenizer

FRAME_MS = 80.0


def _snr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    noise = (got.double() - ref.double()).pow(2).sum()
    return float(10 * torch.log10(ref.double().pow(2).sum() / noise.clamp(min=1e-30)))


def _stream(decoder: CodecDecoder, codes: torch.Tensor, dtype: torch.dtype, use_kernels: bool = False) -> torch.Tensor:
    """Frame-by-frame decode of codes [1, 16, T] -> pcm [T·1920] (float32)."""
    stream = StreamingDecoder(decoder, 1, dtype, codes.device, use_kernels=use_kernels)
    slots = torch.zeros(1, dtype=torch.int64, device=codes.device)
    frames = [stream.decode_frame(slots, codes[:, :, t]) for t in range(codes.shape[-1])]
    return torch.cat(frames, dim=1)[0].float()


def quality(cfg, weights, frames: int, device: str, use_kernels: bool = False) -> dict[str, float]:
    codes = torch.randint(0, cfg.decoder.codebook_size, (1, 16, frames), device=device)
    full = CodecDecoder.from_weights(cfg, weights, torch.float32, device).decode(codes)[0]
    fp32 = _stream(CodecDecoder.from_weights(cfg, weights, torch.float32, device), codes, torch.float32, use_kernels)
    bf16 = _stream(CodecDecoder.from_weights(cfg, weights, torch.float32, device), codes, torch.bfloat16, use_kernels)
    return {"snr_bf16_db": _snr_db(full, bf16), "fp32_max_err": float((fp32 - full).abs().max())}


def _time_ms(fn: Callable[[], object], iters: int, cuda: bool) -> float:
    """Mean ms per call of fn()."""
    if not cuda:
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) * 1e3 / iters
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / iters


def _graphed(fn: Callable[[], object]) -> Callable[[], object]:
    """Capture fn() in a CUDA graph (after a side-stream warm-up); returns the replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def latency(decoder: CodecDecoder, batch: int, iters: int, device: str, use_graph: bool,
            use_kernels: bool = False) -> dict[str, float]:
    cuda = device.startswith("cuda")
    stream = StreamingDecoder(decoder, batch, torch.bfloat16, device, use_kernels=use_kernels)
    slots = torch.arange(batch, device=device)
    codes = torch.randint(0, decoder.config.codebook_size, (batch, 16), device=device)
    stream.reset(slots)
    window = decoder.config.sliding_window
    with kernels.tuning():  # the engine tunes shape-specialised kernel choices in its graph warm-up
        for _ in range(window):  # fill the attention window: steady-state cost
            stream.decode_frame(slots, codes)
    row = {"eager_ms": _time_ms(lambda: stream.decode_frame(slots, codes), iters, cuda)}
    if cuda and use_graph:
        row["graph_ms"] = _time_ms(_graphed(lambda: stream.decode_frame(slots, codes)), iters, cuda)
    return row


def _parts(stream: StreamingDecoder, slots: torch.Tensor, codes: torch.Tensor
           ) -> list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]]:
    """`decode_frame`'s work for slots [B] and codes [B, 16] as named steps x -> y, each step's input the output
    of the one before (the first takes the codes): the state gather, `CodecDecoder.chunk_steps`, the scatter."""
    states: list[torch.Tensor] = []

    def gather(_: torch.Tensor) -> torch.Tensor:
        states[:] = stream.gather_states(slots)
        return codes[:, :, None]  # [B, 16, 1]

    def scatter(pcm: torch.Tensor) -> torch.Tensor:
        stream.scatter_states(slots, states)
        return pcm

    return [("gather states", gather), *stream.decoder.chunk_steps(states, slots), ("scatter states", scatter)]


def stages(stream: StreamingDecoder, batch: int, iters: int, device: str) -> tuple[str, str]:
    """Markdown: ms per part of one `decode_frame` call of `batch` warm streams (see `_parts`), and the
    call's kernels under torch.profiler (CUDA) or ops (CPU) by time."""
    from profile_step import kernel_table  # the step profiler's table (a heavier import: only here)

    cuda = device.startswith("cuda")
    slots = torch.arange(batch, device=device)
    codes = torch.randint(0, stream.decoder.config.codebook_size, (batch, 16), device=device)
    rows, x, total = [], codes, 0.0
    with torch.no_grad():
        for name, fn in _parts(stream, slots, codes):
            inp = x
            x = fn(inp)
            call = (lambda f=fn, i=inp: f(i))
            ms = _time_ms(_graphed(call) if cuda else call, iters, cuda)
            rows.append((name, tuple(x.shape), ms))
            total += ms
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        stream.decode_frame(slots, codes)
        with profile(activities=acts) as prof:
            stream.decode_frame(slots, codes)
            if cuda:
                torch.cuda.synchronize()
    lines = [f"### B={batch}: the parts of one call ({'graph' if cuda else 'eager'} ms each)", "",
             "| part | output shape | ms | % of the parts' sum |", "|---|---|---:|---:|"]
    lines += [f"| {n} | {list(s)} | {ms:.3f} | {100 * ms / total:.1f} |" for n, s, ms in rows]
    lines.append(f"| sum of the parts | | {total:.3f} | 100.0 |")
    table, summary = kernel_table(prof, cuda, "in one eager call")
    return "\n".join(lines) + "\n", "\n".join([summary, "", *table]) + "\n"


def _table(scale: str, device: str, q: dict[str, float], rows: dict[int, dict[str, float]], kernels_on: bool) -> str:
    lines = [f"# Codec bench ({scale} codec, {device}, convs/SnakeBeta: {'q3tts.kernels' if kernels_on else 'torch'})", "",
             f"- bf16 streaming vs fp32 full decode: SNR {q['snr_bf16_db']:.1f} dB",
             f"- fp32 streaming vs fp32 full decode: max |err| {q['fp32_max_err']:.2e}", "",
             "| batch | eager ms/call | graph ms/call | µs per stream-frame | RTF (audio s / s) |",
             "|---:|---:|---:|---:|---:|"]
    for b, r in rows.items():
        best = r.get("graph_ms", r["eager_ms"])
        graph = f"{r['graph_ms']:.3f}" if "graph_ms" in r else "-"
        lines.append(f"| {b} | {r['eager_ms']:.3f} | {graph} | {best * 1e3 / b:.1f} | "
                     f"{b * FRAME_MS / best:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", default="full", choices=["tiny", "full"])
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--frames", type=int, default=200, help="frames for the SNR measurement")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--no-graph", action="store_true", help="skip CUDA-graph timing")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--kernels", action="store_true", help="convs and SnakeBeta through q3tts.kernels")
    parser.add_argument("--stages", action="store_true", help="also time each part of a call (codec_stages.md)")
    args = parser.parse_args()

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        cfg, weights = read_speech_tokenizer(write_speech_tokenizer(tmp, args.scale, seed=0))
    q = quality(cfg, weights, args.frames, args.device, args.kernels)
    decoder = CodecDecoder.from_weights(cfg, weights, torch.bfloat16, args.device)
    rows = {b: latency(decoder, b, args.iters, args.device, not args.no_graph, args.kernels)
            for b in map(int, args.batches.split(","))}
    emit(_table(args.scale, args.device, q, rows, args.kernels),
         "codec_bench_kernels.md" if args.kernels else "codec_bench.md")
    if args.stages:
        md = []
        for b in map(int, args.batches.split(",")):
            stream = StreamingDecoder(decoder, b, torch.bfloat16, args.device, use_kernels=args.kernels)
            latency(decoder, b, 3, args.device, False, args.kernels)  # tunes the kernel choices of this batch
            parts, kernels_md = stages(stream, b, args.iters, args.device)
            md += [parts, f"torch.profiler: {kernels_md}"]
        emit(f"# Codec call by part ({args.scale} codec, {args.device}, "
             f"convs/SnakeBeta: {'q3tts.kernels' if args.kernels else 'torch'})\n\n" + "\n".join(md),
             "codec_stages.md")


if __name__ == "__main__":
    main()
