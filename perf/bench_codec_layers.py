"""Per-layer codec bench: each distinct conv of one streamed frame, cuDNN (torch) vs the Triton kernel, and
SnakeBeta torch vs kernel, per batch size. Finds the (layer, batch) pairs where cuDNN's heuristics pick a slow
algorithm (they drove `EngineConfig.codec_kernels`).

    python perf/bench_codec_layers.py                 # H200: real-size random codec, batches 1 8 64 256
    OUT=/some/dir python perf/bench_codec_layers.py   # also writes $OUT/codec_layers.md

µs per call: a CUDA graph of 20 calls, replayed; "max |diff|" = kernel vs fp32 torch on the same bf16 inputs.
"""

from __future__ import annotations

import argparse
import tempfile

from report import emit
import torch

from bench_codec import _graphed, _time_ms
from q3tts.codec import CodecDecoder, StreamingDecoder, read_speech_tokenizer, write_speech_tokenizer
from q3tts.codec.layers import CausalConv1d, SnakeBeta
from q3tts.kernels import reference as R
from q3tts.kernels.conv1d import causal_conv1d
from q3tts.kernels.snake import snake_beta


def frame_layers(decoder: CodecDecoder, device: str = "cuda") -> tuple[dict, dict]:
    """Input shapes of one streamed frame: {(c_in, c_out, k, dilation, L): conv}, {(C, T): snake}."""
    convs, snakes = {}, {}

    def on_conv(m, args):
        x = args[0]
        if m.conv.groups == 1:
            convs[(m.conv.in_channels, m.conv.out_channels, m.conv.kernel_size[0], m.conv.dilation[0],
                   x.shape[-1] + m.history)] = m

    def on_snake(m, args):
        snakes[tuple(args[0].shape[1:])] = m

    hooks = [m.register_forward_pre_hook(on_conv if isinstance(m, CausalConv1d) else on_snake)
             for m in decoder.modules() if isinstance(m, (CausalConv1d, SnakeBeta))]
    stream = StreamingDecoder(decoder, 1, next(decoder.parameters()).dtype, device)
    slots = torch.zeros(1, dtype=torch.int64, device=device)
    stream.decode_frame(slots, torch.zeros(1, 16, dtype=torch.int64, device=device))
    for h in hooks:
        h.remove()
    return convs, snakes


def us_per_call(fn, calls: int = 20) -> float:
    return _time_ms(_graphed(lambda: [fn() for _ in range(calls)]), 10, True) * 1e3 / calls


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
    lines = ["| conv c_in→c_out k d L | batch | cuDNN µs | kernel µs | max abs diff |", "|---|---:|---:|---:|---:|"]
    for (c_in, c_out, k, d, length), m in sorted(convs.items()):
        w, b = m.conv.weight, m.conv.bias
        for bsz in args.batches:
            x = torch.randn(bsz, c_in, length, device="cuda", dtype=torch.bfloat16)
            torch_us = us_per_call(lambda: R.causal_conv1d_ref(x, w, b, d))
            kernel_us = us_per_call(lambda: causal_conv1d(x, w, b, d, impl="triton", weight_oik=m.weight_oik))
            ref = R.causal_conv1d_ref(x.float(), w.float(), b.float(), d)
            diff = (causal_conv1d(x, w, b, d, impl="triton").float() - ref).abs().max().item()
            lines.append(f"| {c_in}→{c_out} k{k} d{d} L{length} | {bsz} | {torch_us:.1f} | {kernel_us:.1f} | {diff:.3g} |")
    lines += ["", "| SnakeBeta C×T | batch | torch µs | kernel µs |", "|---|---:|---:|---:|"]
    for (ch, t), m in sorted(snakes.items()):
        for bsz in args.batches:
            x = torch.randn(bsz, ch, t, device="cuda", dtype=torch.bfloat16)
            lines.append(f"| {ch}×{t} | {bsz} | {us_per_call(lambda: R.snake_beta_ref(x, m.alpha, m.beta)):.1f} | "
                         f"{us_per_call(lambda: snake_beta(x, m.alpha, m.beta)):.1f} |")
    report = f"# Codec layers, one streamed frame ({args.scale} codec, {torch.cuda.get_device_name()})\n\n" + "\n".join(lines) + "\n"
    emit(report, "codec_layers.md")


if __name__ == "__main__":
    main()
