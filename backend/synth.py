"""`q3tts synth`: offline synthesis without Triton (the command line; the work is done elsewhere).

One request (`--text`): `q3tts.models.generate` makes its codes the reference way (one sequence,
explicit state, no engine) and its audio as the official wrapper decodes it. Writes codes int64
[frames, 16] (`--codes-out`) and/or a 24 kHz wav (`--out`). `--stream` decodes each frame with the
streaming codec as it is generated and prints per-frame timing. `--ref-audio` (Base) encodes a
reference recording into ref_codes + x-vector (`q3tts.codec.voice.resolve_voice`).

Many requests (`--requests FILE.jsonl`): run together through the engine (`q3tts.engine.batch`).
Generation defaults come from the checkpoint's generation_config.json (`SamplingParams.from_generation_config`).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np
import torch

from q3tts.checkpoint.loader import CheckpointError, load_checkpoint
from q3tts.codec.audio import SAMPLE_RATE, write_wav
from q3tts.codec.decoder import CodecDecoder
from q3tts.codec.voice import read_reference, resolve_voice
from q3tts.core import EngineError, SamplingParams, VoiceSpec
from q3tts.engine.config import EngineConfig
from q3tts.models.generate import StreamingSink, decode_audio, generate_codes
from q3tts.models.prompt import PromptBuilder
from q3tts.models.tts_model import Qwen3TTS


# --- command line ---------------------------------------------------------------------------------

class UsageError(ValueError):
    """A bad combination of command-line options."""


def _voice(args: argparse.Namespace, model: Qwen3TTS, ckpt) -> VoiceSpec:
    """The voice the options describe; a --ref-audio recording encoded into what it lacks."""
    from q3tts.codec.encoder import CodecEncoder

    wav, sr = read_reference(args.ref_audio) if args.ref_audio is not None else (None, SAMPLE_RATE)
    voice = VoiceSpec(
        speaker=args.speaker, language=args.language, instruct=args.instruct, ref_text=args.ref_text,
        ref_codes=np.load(args.ref_codes) if args.ref_codes else None,
        xvector=np.load(args.xvector) if args.xvector else None, ref_audio=wav, ref_sample_rate=sr,
        xvector_only=args.xvector_only, text_mode=args.text_mode)
    p = next(model.parameters())
    return resolve_voice(voice, model, lambda: CodecEncoder.from_weights(
        ckpt.codec_config, ckpt.codec_weights, p.dtype, p.device))


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
                        help="default: follows the text (EngineConfig.text_frame_cap, the engine's "
                             "runaway guard)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="default float32 (with --requests: bfloat16 on cuda, float32 on cpu)")
    parser.add_argument("--codes-out", type=Path, help=".npy int64 [frames, 16]")
    parser.add_argument("--out", type=Path, help="24 kHz wav")
    parser.add_argument("--stream", action="store_true",
                        help="decode frame by frame while generating; print per-frame timing")
    batch.add_arguments(parser)


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
        params = SamplingParams.from_generation_config(  # command-line choices over the checkpoint's
            ckpt.generation, greedy=args.greedy or None, seed=args.seed, max_frames=args.max_frames)
        params.validate()
        decoder = None
        if args.out is not None or args.stream:
            decoder = CodecDecoder.from_weights(ckpt.codec_config, ckpt.codec_weights,
                                                getattr(torch, args.dtype or "float32"), device)
        t0 = time.perf_counter()
        voice = _voice(args, model, ckpt)
        builder = PromptBuilder(model, ckpt.tokenizer)
        prompt = builder.build(args.text, voice)
        if params.max_frames is None:
            cap = EngineConfig().text_frame_cap(len(ckpt.tokenizer.encode(args.text)))
            params = dataclasses.replace(params, max_frames=cap)
    except (CheckpointError, EngineError, UsageError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    ref_codes = np.asarray(voice.ref_codes) if builder.is_icl(voice) else None
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
