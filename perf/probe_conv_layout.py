"""Probe: the codec's causal convs with channels-last activations, against what the engine runs today.

The codec's conv kernels (`kernels.conv1d`) read x [B, C, T] (time contiguous): tap k reads x at t + k·dilation,
an address 2·k·dilation bytes off a 16-byte boundary for most taps, so those loads cannot be vectorized or copied
asynchronously by the pipeliner. With x channels-last, [B, L, C], every tap reads whole channel rows starting at
a multiple of C (a multiple of 16 elements for every codec conv): aligned. This times an implicit-GEMM kernel over
channels-last x (M = the flattened (batch row, position) columns, so the short early layers fill their tiles too),
output channels-first as the decoder consumes it, at each conv shape of one streamed frame, beside cuDNN and the
best of the engine's current candidates (`kernels.conv1d.candidates`) on the same bf16 inputs.

    python perf/probe_conv_layout.py --batches 1 64      # H200: real-size random codec
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from bench_codec_layers import frame_layers, us_per_call
from report import emit
from q3tts.codec import CodecDecoder, read_speech_tokenizer, write_speech_tokenizer
from q3tts.kernels import reference as R
from q3tts.kernels.conv1d import candidates, causal_conv1d


@triton.jit
def _conv_cl_kernel(x_ptr, w_ptr, b_ptr, r_ptr, out_ptr, c_in, c_out, t_out, n_cols,
                    stride_xb, stride_xt, stride_rb, stride_rc, stride_ob, stride_oc,
                    K: tl.constexpr, DILATION: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr):
    """Program (column tile, output channel tile); x [B, L, C_in] channels-last, w [K, C_in, C_out], out [B, C_out, T]."""
    n = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # columns b·T + t
    o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    n_ok, o_ok = n < n_cols, o < c_out
    b = (n // t_out).to(tl.int64)
    t = n - (n // t_out) * t_out
    rows = x_ptr + b * stride_xb + t * stride_xt  # [BLOCK_M]: each column's input row at tap 0
    chunks = tl.cdiv(c_in, BLOCK_I)
    acc = tl.zeros((BLOCK_M, BLOCK_O), dtype=tl.float32)
    for step in range(0, K * chunks):
        k = step // chunks
        i = (step - k * chunks) * BLOCK_I + tl.arange(0, BLOCK_I)
        i_ok = i < c_in
        x = tl.load(rows[:, None] + k * DILATION * stride_xt + i[None, :], mask=n_ok[:, None] & i_ok[None, :],
                    other=0.0)  # [BLOCK_M, BLOCK_I]
        w = tl.load(w_ptr + (k * c_in + i)[:, None] * c_out + o[None, :], mask=i_ok[:, None] & o_ok[None, :],
                    other=0.0)  # [BLOCK_I, BLOCK_O]
        acc += tl.dot(x, w)
    acc += tl.load(b_ptr + o, mask=o_ok, other=0.0).to(tl.float32)[None, :]
    mask = n_ok[:, None] & o_ok[None, :]
    if HAS_RESIDUAL:
        acc += tl.load(r_ptr + b[:, None] * stride_rb + o[None, :] * stride_rc + t[:, None], mask=mask,
                       other=0.0).to(tl.float32)
    tl.store(out_ptr + b[:, None] * stride_ob + o[None, :] * stride_oc + t[:, None],
             acc.to(out_ptr.dtype.element_ty), mask=mask)


def conv_cl(x_cl: torch.Tensor, w_kio: torch.Tensor, bias: torch.Tensor, dilation: int, t_out: int,
            residual: torch.Tensor | None, cfg: tuple) -> torch.Tensor:
    """x_cl [B, L, C_in] (history first), w_kio [K, C_in, C_out] -> [B, C_out, t_out] channels-first."""
    bsz, _, c_in = x_cl.shape
    k, _, c_out = w_kio.shape
    block_m, block_o, block_i, warps, stages = cfg
    out = torch.empty(bsz, c_out, t_out, dtype=x_cl.dtype, device=x_cl.device)
    r = residual if residual is not None else out
    grid = (triton.cdiv(bsz * t_out, block_m), triton.cdiv(c_out, block_o))
    _conv_cl_kernel[grid](x_cl, w_kio, bias, r, out, c_in, c_out, t_out, bsz * t_out, x_cl.stride(0),
                          x_cl.stride(1), r.stride(0), r.stride(1), out.stride(0), out.stride(1), K=k,
                          DILATION=dilation, HAS_RESIDUAL=residual is not None, BLOCK_M=block_m, BLOCK_O=block_o,
                          BLOCK_I=block_i, num_warps=warps, num_stages=stages)
    return out


def configs(c_in: int, c_out: int) -> list[tuple]:
    """(BLOCK_M, BLOCK_O, BLOCK_I, warps, stages) candidates, blocks clamped to the shape."""
    fit = lambda block, size: min(block, max(16, triton.next_power_of_2(size)))  # noqa: E731
    raw = [(128, 64, 32, 4, 3), (128, 64, 64, 4, 3), (128, 128, 32, 8, 3), (128, 128, 64, 8, 3),
           (64, 64, 64, 4, 4), (64, 128, 64, 4, 3), (256, 64, 32, 8, 3), (128, 64, 32, 4, 4), (64, 32, 64, 4, 3)]
    return list(dict.fromkeys((m, fit(o, c_out), fit(i, c_in), w, s) for m, o, i, w, s in raw))


def probe_row(m, bsz: int, t: int, residual: bool) -> str:
    w, b, d = m.conv.weight, m.conv.bias, m.conv.dilation[0]
    (c_out, c_in, k), hist, like = w.shape, m.history, dict(device=w.device, dtype=w.dtype)
    x = torch.randn(bsz, c_in, t, **like)
    h = torch.randn(bsz, c_in, hist, **like) if hist else None
    r = torch.randn(bsz, c_out, t, **like) if residual else None
    full = x if h is None else torch.cat([h, x], dim=-1)  # [B, C, L]
    ref = R.causal_conv1d_ref(full.float(), w.float(), b.float(), d, None if r is None else r.float())
    x_cl = full.transpose(1, 2).contiguous()  # [B, L, C]
    w_kio = w.permute(2, 1, 0).contiguous()  # [K, C_in, C_out]
    now = {impl: us_per_call(lambda impl=impl: causal_conv1d(x, w, b, d, r, m.weight_oik, impl=impl, history=h))
           for impl in candidates(c_in, c_out, t)}
    best_now = min(now, key=now.get)
    cudnn_cl = us_per_call(lambda: F.conv1d(x_cl.transpose(1, 2), w, b, dilation=d))
    probe, diff = {}, 0.0
    for cfg in configs(c_in, c_out):
        call = lambda cfg=cfg: conv_cl(x_cl, w_kio, b, d, t, r, cfg)  # noqa: E731
        try:
            diff = max(diff, (call().float() - ref).abs().max().item())
            probe[cfg] = us_per_call(call)
        except Exception as exc:  # noqa: BLE001 - a config the compiler refuses (shared memory) is skipped
            print(f"skip {cfg}: {type(exc).__name__}")
    best = min(probe, key=probe.get)
    return (f"| {c_in}→{c_out} k{k} d{d} T{t}{' +res' if residual else ''} | {bsz} | {now['cudnn']:.1f} | "
            f"{now[best_now]:.1f} ({best_now}) | {cudnn_cl:.1f} | **{probe[best]:.1f}** ({best}) | "
            f"{now[best_now] / probe[best]:.2f} | {diff:.3g} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    args = p.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        cfg, weights = read_speech_tokenizer(write_speech_tokenizer(tmp, "full", seed=0))
    decoder = CodecDecoder.from_weights(cfg, weights, torch.bfloat16, "cuda")
    convs, _ = frame_layers(decoder)
    decoder.use_kernels(True)
    lines = ["| conv | batch | cuDNN µs | best engine candidate µs | cuDNN, channels-last view µs | "
             "channels-last kernel µs | speed-up | max abs diff |", "|---|---:|---:|---|---:|---|---:|---:|"]
    for bsz in args.batches:
        for (*_, t, residual), m in sorted(convs.items()):
            line = probe_row(m, bsz, t, residual)
            print(line, flush=True)
            lines.append(line)
    emit(f"# Conv layouts, one streamed frame ({torch.cuda.get_device_name()})\n\n" + "\n".join(lines) + "\n",
         "conv_layout.md")


if __name__ == "__main__":
    main()
