"""`q3tts synth`: offline synthesis without Triton.

One request (`--text`): prefill one sequence, then loop `q3tts.models.step.decode_step` (B = 1)
over explicit state in a single-sequence page pool. Writes codes int64 [frames, 16] (`--codes-out`)
and/or a 24 kHz wav (`--out`), decoded as the official wrapper does (`decode_audio`): one full pass
(the reference's 300-frame chunking beyond that), and for Base ICL the decoder input is
ref_codes ⧺ generated with the output cut at int(ref_len / total_len × n_samples) (spec e.1).
`--stream` decodes each frame with the streaming codec as it is generated and prints per-frame
timing.
`--ref-audio` (Base) encodes a reference recording into ref_codes + x-vector (`q3tts.codec.voice`).

Many requests (`--requests FILE.jsonl`): run together through the engine (`q3tts.engine.batch`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import soundfile as sf
import torch

from q3tts.codec.audio import SAMPLE_RATE, read_wav, write_wav
from q3tts.checkpoint.loader import CheckpointError, load_checkpoint
from q3tts.codec.decoder import CodecDecoder
from q3tts.codec.streaming import StreamingDecoder
from q3tts.core import EngineError, SamplingParams, VoiceSpec
from q3tts.models.attention import PagedKVCache
from q3tts.models.step import DecodeBatch, decode_step, prefill
from q3tts.models.tts_model import Qwen3TTS
from q3tts.models.prompt import Prompt, PromptBuilder
from q3tts.models.sampling import SamplingTensors, UniformSource, uniforms

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


# --- command line ---------------------------------------------------------------------------------

class UsageError(ValueError):
    """A bad combination of command-line options."""


def _voice(args: argparse.Namespace) -> VoiceSpec:
    return VoiceSpec(
        speaker=args.speaker, language=args.language, instruct=args.instruct, ref_text=args.ref_text,
        ref_codes=np.load(args.ref_codes) if args.ref_codes else None,
        xvector=np.load(args.xvector) if args.xvector else None, xvector_only=args.xvector_only,
        text_mode=args.text_mode)


def _with_ref_audio(voice: VoiceSpec, path: Path, model: Qwen3TTS, ckpt) -> VoiceSpec:
    """Fill the absent ref_codes / xvector from the reference recording (as Engine.add does)."""
    from q3tts.codec.encoder import CodecEncoder
    from q3tts.codec.voice import encode_reference

    if not path.is_file():
        raise UsageError(f"--ref-audio {path}: no such file")
    try:
        wav, sr = read_wav(path)
    except (RuntimeError, sf.LibsndfileError) as err:
        raise UsageError(f"--ref-audio {path}: cannot read: {err}") from err
    p = next(model.parameters())
    encoder = CodecEncoder.from_weights(ckpt.codec_config, ckpt.codec_weights, p.dtype, p.device)
    codes, xvector = encode_reference(model, encoder, wav, sr)
    return dataclasses.replace(
        voice, ref_codes=codes if voice.ref_codes is None else voice.ref_codes,
        xvector=xvector if voice.xvector is None else voice.xvector)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from q3tts.engine import batch

    parser.add_argument("--model", required=True, help="checkpoint folder or Hub id")
    parser.add_argument("--text", help="the text to speak (or --requests)")
    parser.add_argument("--requests", type=Path,
                        help="JSONL of requests run together through the engine (see "
                             "q3tts.engine.batch); per-request fields and outputs live in the file")
    parser.add_argument("--speaker")
    parser.add_argument("--language", default="auto")
    parser.add_argument("--instruct")
    parser.add_argument("--ref-audio", type=Path,
                        help="reference recording (Base): encoded into ref codes + x-vector")
    parser.add_argument("--ref-codes", help=".npy int [F, 16] reference codes (Base ICL)")
    parser.add_argument("--ref-text", help="transcript of the reference (Base ICL)")
    parser.add_argument("--xvector", help=".npy float [H] speaker x-vector (Base)")
    parser.add_argument("--xvector-only", action="store_true")
    parser.add_argument("--text-mode", choices=("whole", "incremental"), default=None,
                        help="default: the variant's reference default")
    parser.add_argument("--greedy", action="store_true")
    parser.add_argument("--seed", type=int, default=None, help="default 0")
    parser.add_argument("--max-frames", type=int, default=None,
                        help=f"default {SamplingParams.max_frames}")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="default float32 (with --requests: bfloat16 on cuda, float32 on cpu)")
    parser.add_argument("--codes-out", type=Path, help=".npy int64 [frames, 16]")
    parser.add_argument("--out", type=Path, help="24 kHz wav")
    parser.add_argument("--stream", action="store_true",
                        help="decode frame by frame while generating; print per-frame timing")
    batch.add_arguments(parser)


def _params(args: argparse.Namespace, gen: dict) -> SamplingParams:
    """Command-line choices over the checkpoint's generation_config.json."""
    return SamplingParams(
        greedy=args.greedy or not gen.get("do_sample", True),
        temperature=gen.get("temperature", 0.9), top_k=gen.get("top_k", 50),
        top_p=gen.get("top_p", 1.0), repetition_penalty=gen.get("repetition_penalty", 1.05),
        subtalker_greedy=args.greedy or not gen.get("subtalker_dosample", True),
        subtalker_temperature=gen.get("subtalker_temperature", 0.9),
        subtalker_top_k=gen.get("subtalker_top_k", 50),
        subtalker_top_p=gen.get("subtalker_top_p", 1.0),
        seed=0 if args.seed is None else args.seed,
        max_frames=SamplingParams.max_frames if args.max_frames is None else args.max_frames)


# options that describe one request: with --requests they belong in the JSONL file
_SINGLE_ONLY = ("text", "speaker", "instruct", "ref_audio", "ref_codes", "ref_text", "xvector",
                "xvector_only", "text_mode", "greedy", "seed", "max_frames", "codes_out", "out",
                "stream")


def _check_usage(args: argparse.Namespace) -> None:
    if args.requests is not None:
        given = [f"--{k.replace('_', '-')}" for k in _SINGLE_ONLY
                 if getattr(args, k) not in (None, False)]
        if given:
            raise UsageError(f"{', '.join(given)} cannot be combined with --requests (give "
                             f"per-request fields and outputs in the JSONL file)")
        return
    if not args.text:
        raise UsageError("give --text (one request) or --requests FILE.jsonl (many)")
    if args.codes_out is None and args.out is None:
        raise UsageError("give at least one output: --codes-out FILE.npy and/or --out FILE.wav")


def _run_requests(args: argparse.Namespace) -> int:
    from q3tts.engine.batch import config_from_args, run_file

    if not args.requests.is_file():
        raise UsageError(f"--requests {args.requests}: no such file")
    return run_file(args.model, args.requests, config_from_args(args))


def run(args: argparse.Namespace) -> int:
    try:
        _check_usage(args)
        if args.requests is not None:
            return _run_requests(args)
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        ckpt = load_checkpoint(args.model, dtype=getattr(torch, args.dtype or "float32"),
                               device=device)
        model = Qwen3TTS.from_checkpoint(ckpt)
        params = _params(args, ckpt.generation)
        params.validate()
        decoder = None
        if args.out is not None or args.stream:
            decoder = CodecDecoder.from_weights(ckpt.codec_config, ckpt.codec_weights,
                                                getattr(torch, args.dtype or "float32"), device)
        t0 = time.perf_counter()
        voice = _voice(args)
        if args.ref_audio is not None:
            voice = _with_ref_audio(voice, args.ref_audio, model, ckpt)
        prompt = PromptBuilder(model, ckpt.tokenizer).build(args.text, voice)
    except (CheckpointError, EngineError, UsageError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    icl = model.config.variant == "base" and not voice.xvector_only
    ref_codes = np.asarray(voice.ref_codes) if icl else None
    sink = StreamingSink(decoder, ref_codes, t0) if args.stream else None
    if sink is not None:
        sink.start()
    codes = generate_codes(model, prompt, params, on_frame=sink)
    if sink is not None:
        print(sink.summary())
    if args.codes_out is not None:
        np.save(args.codes_out, codes.numpy().astype(np.int64))
        print(f"wrote {args.codes_out}: {codes.shape[0]} frames")
    if args.out is not None:
        pcm = sink.pcm() if sink is not None else decode_audio(decoder, codes, ref_codes)
        write_wav(args.out, pcm, SAMPLE_RATE)
        print(f"wrote {args.out}: {codes.shape[0]} frames, {pcm.shape[0] / SAMPLE_RATE:.2f} s")
    return 0
