"""`q3tts synth`: offline synthesis of one request to codes (no Triton, no engine).

Prefill one sequence, then loop `q3tts.models.step.decode_step` (B = 1) over explicit state in a
single-sequence page pool. Writes codes int64 [frames, 16].
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
import torch

from q3tts.checkpoint.loader import CheckpointError, load_checkpoint
from q3tts.engine.api import EngineError, SamplingParams, VoiceSpec
from q3tts.models.attention import PagedKVCache
from q3tts.models.step import DecodeBatch, decode_step, prefill
from q3tts.models.tts_model import Qwen3TTS
from q3tts.prompt import Prompt, PromptBuilder
from q3tts.sampling import SamplingTensors, UniformSource, uniforms

PAGE_SIZE = 16


def _cache_for(model: Qwen3TTS, tokens: int, dtype: torch.dtype, device) -> PagedKVCache:
    cfg = model.config.talker.layers
    return PagedKVCache(cfg.num_layers, math.ceil(tokens / PAGE_SIZE), PAGE_SIZE, cfg.num_kv_heads,
                        cfg.head_dim, dtype, device)


@torch.no_grad()
def generate_codes(model: Qwen3TTS, prompt: Prompt, params: SamplingParams,
                   uniform_source: UniformSource = uniforms) -> torch.Tensor:
    """Codes [frames, 16] int64 of one request: up to `params.max_frames` frames, fewer on EOS."""
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
        c0, hidden = result.next_c0, result.hidden
    if not frames:
        return torch.zeros(0, talker.cfg.num_code_groups, dtype=torch.int64)
    return torch.cat(frames).cpu()


def _voice(args: argparse.Namespace) -> VoiceSpec:
    return VoiceSpec(
        speaker=args.speaker, language=args.language, instruct=args.instruct, ref_text=args.ref_text,
        ref_codes=np.load(args.ref_codes) if args.ref_codes else None,
        xvector=np.load(args.xvector) if args.xvector else None, xvector_only=args.xvector_only,
        text_mode=args.text_mode)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint folder or Hub id")
    parser.add_argument("--text", required=True)
    parser.add_argument("--speaker")
    parser.add_argument("--language", default="auto")
    parser.add_argument("--instruct")
    parser.add_argument("--ref-codes", help=".npy int [F, 16] reference codes (Base ICL)")
    parser.add_argument("--ref-text")
    parser.add_argument("--xvector", help=".npy float [H] speaker x-vector (Base)")
    parser.add_argument("--xvector-only", action="store_true")
    parser.add_argument("--text-mode", choices=("whole", "incremental"), default=None,
                        help="default: the variant's reference default")
    parser.add_argument("--greedy", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-frames", type=int, default=SamplingParams.max_frames)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--codes-out", required=True, type=Path)


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
        seed=args.seed, max_frames=args.max_frames)


def run(args: argparse.Namespace) -> int:
    try:
        ckpt = load_checkpoint(args.model, dtype=getattr(torch, args.dtype))
        model = Qwen3TTS.from_checkpoint(ckpt)
        prompt = PromptBuilder(model, ckpt.tokenizer).build(args.text, _voice(args))
        params = _params(args, ckpt.generation)
        params.validate()
    except (CheckpointError, EngineError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    codes = generate_codes(model, prompt, params)
    np.save(args.codes_out, codes.numpy().astype(np.int64))
    print(f"wrote {args.codes_out}: {codes.shape[0]} frames")
    return 0
