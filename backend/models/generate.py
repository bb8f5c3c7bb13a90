"""One request the reference way, outside the engine: `q3tts synth` and the parity tests share it.

`generate_codes`: prefill one sequence, then loop `q3tts.models.step.decode_step` (B = 1) over explicit
state in a single-sequence page pool, up to `max_frames` frames or EOS. `decode_audio`: the codes' audio
as the official wrapper decodes them (one full pass, the reference's 300-frame chunking beyond that;
Base ICL: the decoder input is ref_codes ⧺ generated and the output is cut at
int(ref_len / total_len × n_samples), spec e.1). `StreamingSink`: the same audio frame by frame with the
streaming codec as the frames are made, with per-frame timing.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import numpy as np
import torch

from q3tts.codec.audio import SAMPLE_RATE
from q3tts.codec.decoder import CodecDecoder
from q3tts.codec.streaming import StreamingDecoder
from q3tts.core import SamplingParams
from q3tts.models.attention import PagedKVCache
from q3tts.models.prompt import Prompt
from q3tts.models.sampling import SamplingTensors, UniformSource, uniforms
from q3tts.models.step import DecodeBatch, decode_step, prefill
from q3tts.models.tts_model import Qwen3TTS

PAGE_SIZE = 16


def _cache_for(model: Qwen3TTS, tokens: int, dtype: torch.dtype, device) -> PagedKVCache:
    cfg = model.config.talker.layers
    return PagedKVCache(cfg.num_layers, math.ceil(tokens / PAGE_SIZE), PAGE_SIZE, cfg.num_kv_heads,
                        cfg.head_dim, dtype, device)


@torch.no_grad()
def generate_codes(model: Qwen3TTS, prompt: Prompt, params: SamplingParams,
                   uniform_source: UniformSource = uniforms,
                   on_frame: Callable[[int, torch.Tensor], None] | None = None) -> torch.Tensor:
    """Codes [frames, 16] int64 of one request: up to `params.max_frames` frames, fewer on EOS.

    `on_frame(t, codes [1, 16])`, when given, is called as soon as frame t exists (streaming)."""
    talker = model.talker
    device, dtype = prompt.prefill.device, prompt.prefill.dtype
    length = prompt.prefill.shape[0]
    cache = _cache_for(model, length + params.max_frames, dtype, device)
    pages = torch.arange(cache.num_pages, dtype=torch.int32, device=device)[None]  # [1, P]
    talker_p = SamplingTensors.talker([params], device)
    cp_p = SamplingTensors.subtalker([params], device)
    seeds = torch.tensor([params.seed], dtype=torch.int64, device=device)
    c0, hidden = prefill(talker, cache, prompt.prefill, torch.arange(length, device=device),
                         talker_p, seeds, uniform_source)
    generated = torch.zeros(1, talker.cfg.vocab_size, dtype=torch.bool, device=device)
    frames = []
    for t in range(params.max_frames):
        if int(c0) == talker.cfg.codec_eos_id:
            break
        generated[0, c0] = True
        pos = torch.tensor([length + t], device=device)
        text = prompt.trailing[t:t + 1] if t < prompt.trailing.shape[0] else prompt.pad[None]
        batch = DecodeBatch(c0=c0, past_hidden=hidden, text=text, positions=pos, slot_mapping=pos,
                            block_tables=pages, context_lens=(pos + 1).int(), generated=generated,
                            num_generated=torch.tensor([t + 1], device=device), seeds=seeds,
                            counters=torch.tensor([t], device=device))
        result = decode_step(talker, cache, batch, talker_p, cp_p, uniform_source)
        frames.append(result.codes)
        if on_frame is not None:
            on_frame(t, result.codes)
        c0, hidden = result.next_c0, result.hidden
    if not frames:
        return torch.zeros(0, talker.cfg.num_code_groups, dtype=torch.int64)
    return torch.cat(frames).cpu()


# --- audio ----------------------------------------------------------------------------------------

def _cut_reference(pcm: torch.Tensor, ref_len: int, total_len: int) -> torch.Tensor:
    """The official wrapper's ICL cut: drop the first int(ref_len / total_len × n) samples."""
    if not ref_len:
        return pcm
    return pcm[int(ref_len / max(total_len, 1) * pcm.shape[0]):]


def decode_audio(decoder: CodecDecoder, codes: torch.Tensor,
                 ref_codes: np.ndarray | None = None) -> torch.Tensor:
    """24 kHz pcm [n] float32 of generated `codes` [T, 16], as the official wrapper decodes them.

    Full decode (`decode_like_reference`: one pass up to 300 frames). With `ref_codes` [F, 16] (Base
    ICL) the decoder input is ref_codes ⧺ codes and the output is cut at int(F / (F + T) × n)."""
    p = next(decoder.parameters())
    codes = codes.to(device=p.device, dtype=torch.int64)
    ref_len = 0 if ref_codes is None else int(np.asarray(ref_codes).shape[0])
    if ref_len:
        ref = torch.as_tensor(np.asarray(ref_codes), dtype=torch.int64, device=p.device)
        codes = torch.cat((ref, codes))
    if codes.shape[0] == 0:
        return torch.zeros(0)
    pcm = decoder.decode_like_reference(codes.T[None])[0]
    return _cut_reference(pcm, ref_len, codes.shape[0]).float().cpu()


class StreamingSink:
    """`generate_codes(on_frame=...)` callback: decodes each new frame with the streaming codec and
    prints per-frame timing (LM step, codec frame, time to first audio since `t0`).

    With `ref_codes` (Base ICL) the stream is first primed with the reference frames, so the audio
    is the full decode of ref_codes ⧺ generated; `pcm()` applies the same cut as `decode_audio`."""

    def __init__(self, decoder: CodecDecoder, ref_codes: np.ndarray | None, t0: float,
                 log: Callable[[str], None] | None = print) -> None:
        p = next(decoder.parameters())
        self.device = p.device
        self.codec = StreamingDecoder(decoder, 1, p.dtype, p.device)
        self.slots = torch.zeros(1, dtype=torch.int64, device=p.device)
        self.codec.reset(self.slots)
        self.log = log or (lambda line: None)
        self.t0 = t0
        self.ref_len = 0 if ref_codes is None else int(np.asarray(ref_codes).shape[0])
        self.pieces: list[torch.Tensor] = []
        self.lm_ms: list[float] = []
        self.codec_ms: list[float] = []
        self.first_audio_s: float | None = None
        if self.ref_len:
            ref = torch.as_tensor(np.asarray(ref_codes), dtype=torch.int64, device=p.device)
            start = time.perf_counter()
            self.pieces.append(self.codec.decode_chunk(self.slots, ref.T[None])[0].float().cpu())
            self.log(f"primed the codec with {self.ref_len} reference frames in "
                     f"{(time.perf_counter() - start) * 1e3:.1f} ms")
        self.last = time.perf_counter()

    def start(self) -> None:
        """Mark the start of generation (prefill): frame 0's LM time includes the prefill."""
        self.last = time.perf_counter()

    def __call__(self, t: int, codes: torch.Tensor) -> None:
        now = time.perf_counter()
        pcm = self.codec.decode_frame(self.slots, codes.to(self.device))[0].float().cpu()
        done = time.perf_counter()
        self.pieces.append(pcm)
        self.lm_ms.append((now - self.last) * 1e3)
        self.codec_ms.append((done - now) * 1e3)
        note = ""
        if self.first_audio_s is None:
            self.first_audio_s = done - self.t0
            note = f"  first audio at {self.first_audio_s * 1e3:.1f} ms"
        self.log(f"frame {t:4d}: lm {self.lm_ms[-1]:8.2f} ms  codec {self.codec_ms[-1]:8.2f} ms"
                 f"{note}")
        self.last = time.perf_counter()

    def pcm(self) -> torch.Tensor:
        if not self.pieces:
            return torch.zeros(0)
        pcm = torch.cat(self.pieces)
        return _cut_reference(pcm, self.ref_len, self.ref_len + len(self.lm_ms))

    def summary(self) -> str:
        n = len(self.lm_ms)
        if not n:
            return "no frames generated"
        return (f"{n} frames: lm {sum(self.lm_ms) / n:.2f} ms/frame (first, with prefill: "
                f"{self.lm_ms[0]:.2f} ms), codec {sum(self.codec_ms) / n:.2f} ms/frame, "
                f"time to first audio {self.first_audio_s * 1e3:.1f} ms, "
                f"audio {n * self.codec.samples_per_frame / SAMPLE_RATE:.2f} s")
