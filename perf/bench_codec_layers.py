"""Per-layer codec bench: each distinct conv of one streamed frame, every launch choice the conv tuner times
(cuDNN, the row-tiled kernel's default and other configs, at T = 1 the flat-tiled kernel's; with x stored
channels-last, as the codec runs them, the channels-last tiling's: `kernels.conv1d.candidates`), and SnakeBeta
torch vs kernel, per batch size. Shows which choice wins where
(cuDNN's slow heuristics drove `EngineConfig.codec_kernels`; the tuner keeps the fastest per shape and batch
bucket).

    python perf/bench_codec_layers.py                 # H200: real-size random codec, batches 1 8 64 256
    python perf/bench_codec_layers.py --batches 1 64
    OUT=/some/dir python perf/bench_codec_layers.py   # also writes $OUT/codec_layers.md

The convs run as the streaming decoder runs them: new samples T plus the layer's history in place
(`history=`; cuDNN gets the cat, as the tuner times it), the residual unit's k1 conv with its residual fused,
the weights in the kernel layout. µs per call: a CUDA graph of 20 calls, replayed; "max |diff|" = the largest
over the kernel choices of kernel vs fp32 torch on the same bf16 inputs; "HBM floor" = the conv's input, weights,
output and residual moved once at the H200's 4.8 TB/s (`floor_us`). SnakeBeta's channels-last output at each tile
the tuner times (`kernels.snake.CL_POSITIONS`).
"""

from __future__ import annotations

import argparse
import tempfile

from report import emit
import torch

from bench_codec import _graphed, _time_ms
from floor import H200_BYTES_PER_S
from q3tts.codec import CodecDecoder, StreamingDecoder, read_speech_tokenizer, write_speech_tokenizer
from q3tts.codec.layers import CausalConv1d, SnakeBeta, channels_last
from q3tts.kernels import reference as R
from q3tts.kernels.conv1d import candidates, causal_conv1d
from q3tts.kernels.snake import CL_POSITIONS, snake_beta


def frame_layers(decoder: CodecDecoder, device: str = "cuda") -> tuple[dict, dict]:
    """Shapes of one streamed frame: {(c_in, c_out, k, dilation, T new samples, residual?): conv}, {(C, T): snake}."""
    convs, snakes = {}, {}

    def on_conv(m, args, kwargs):
        x = args[0]
        if m.conv.groups == 1:
            convs[(m.conv.in_channels, m.conv.out_channels, m.conv.kernel_size[0], m.conv.dilation[0],
                   x.shape[-1], kwargs.get("residual") is not None)] = m

    def on_snake(m, args):
        snakes[tuple(args[0].shape[1:])] = m

    hooks = [m.register_forward_pre_hook(on_conv, with_kwargs=True) if isinstance(m, CausalConv1d)
             else m.register_forward_pre_hook(on_snake)
             for m in decoder.modules() if isinstance(m, (CausalConv1d, SnakeBeta))]
    stream = StreamingDecoder(decoder, 1, next(decoder.parameters()).dtype, device)
    slots = torch.zeros(1, dtype=torch.int64, device=device)
    stream.decode_frame(slots, torch.zeros(1, 16, dtype=torch.int64, device=device))
    for h in hooks:
        h.remove()
    return convs, snakes


def us_per_call(fn, calls: int = 20) -> float:
    return _time_ms(_graphed(lambda: [fn() for _ in range(calls)]), 10, True) * 1e3 / calls


def conv_row(m: CausalConv1d, bsz: int, t: int, residual: bool, cl: bool) -> str:
    """One table row: µs per call of each `candidates` choice for conv `m` (bf16) at batch `bsz`, T new samples,
    x and its history time-contiguous or (`cl`) channels-last."""
    w, b, d = m.conv.weight, m.conv.bias, m.conv.dilation[0]
    (c_out, c_in, k), hist, like = w.shape, m.history, dict(device=w.device, dtype=w.dtype)
    x = torch.randn(bsz, c_in, t, **like)
    h = torch.randn(bsz, c_in, hist, **like) if hist else None
    r = torch.randn(bsz, c_out, t, **like) if residual else None
    full = x if h is None else torch.cat([h, x], dim=-1)
    ref = R.causal_conv1d_ref(full.float(), w.float(), b.float(), d, None if r is None else r.float())
    if cl:
        x, h = channels_last(x), None if h is None else channels_last(h)
    us, diff = {}, 0.0
    for impl in candidates(c_in, c_out, t, cl):
        call = lambda impl=impl: causal_conv1d(x, w, b, d, r, m.weight_oik, impl=impl, history=h)  # noqa: E731
        us[impl] = us_per_call(call)
        diff = diff if impl == "cudnn" else max(diff, (call().float() - ref).abs().max().item())
    others = "; ".join(f"{impl}: {v:.1f}" for impl, v in us.items() if impl not in ("cudnn", "triton"))
    best = min(us, key=us.get)
    return (f"| {c_in}→{c_out} k{k} d{d} T{t}{' +res' if residual else ''} | {bsz} | "
            f"{'channels-last' if cl else 'time'} | {floor_us(m, bsz, t, residual):.1f} | {us['cudnn']:.1f} | "
            f"{us['triton']:.1f} | {others} | {best} | {diff:.3g} |")


def floor_us(m: CausalConv1d, bsz: int, t: int, residual: bool) -> float:
    """The conv's HBM floor in µs at the H200's line: its input (history included), weights, output and residual
    read or written once, in bf16 (what a kernel that re-reads nothing moves; the taps' re-reads come from L2/L1)."""
    (c_out, c_in, k), hist = m.conv.weight.shape, m.history
    elements = bsz * c_in * (t + hist) + c_out * c_in * k + bsz * c_out * t * (2 if residual else 1)
    return 2 * elements / H200_BYTES_PER_S * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", default="full", choices=["tiny", "full"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    args = p.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        cfg, weights = read_speech_tokenizer(write_speech_tokenizer(tmp, args.scale, seed=0))
    decoder = CodecDecoder.from_weights(cfg, weights, torch.bfloat16, "cuda")
    convs, snakes = frame_layers(decoder)
    decoder.use_kernels(True)  # the convs' weights in the kernel layout, as the engine runs them
    lines = ["| conv c_in→c_out k d T | batch | x stored | HBM floor µs | cuDNN µs | default kernel µs | "
             "other kernel configs µs | best | max abs diff |", "|---|---:|---|---:|---:|---:|---|---|---:|"]
    for (*_, t, residual), m in sorted(convs.items()):
        lines += [conv_row(m, bsz, t, residual, cl) for bsz in args.batches for cl in (False, True)]
    lines += ["", "| SnakeBeta C×T | batch | torch µs | kernel µs | kernel, channels-last output µs (positions a "
              f"program: {' / '.join(map(str, CL_POSITIONS))}) |", "|---|---:|---:|---:|---:|"]
    for (ch, t), m in sorted(snakes.items()):
        for bsz in args.batches:
            x = torch.randn(bsz, ch, t, device="cuda", dtype=torch.bfloat16)
            cl = " / ".join(f"{us_per_call(lambda n=n: snake_beta(x, m.alpha, m.beta, True, n)):.1f}"
                            for n in CL_POSITIONS)
            lines.append(f"| {ch}×{t} | {bsz} | {us_per_call(lambda: R.snake_beta_ref(x, m.alpha, m.beta)):.1f} | "
                         f"{us_per_call(lambda: snake_beta(x, m.alpha, m.beta)):.1f} | {cl} |")
    report = f"# Codec layers, one streamed frame ({args.scale} codec, {torch.cuda.get_device_name()})\n\n" + "\n".join(lines) + "\n"
    emit(report, "codec_layers.md")


if __name__ == "__main__":
    main()
