"""Many requests through one `Engine` together, from a JSONL file (`q3tts synth --requests FILE`).

One JSON object per line, fields named like the `q3tts synth` flags (dashes or underscores):
    text (required), id, speaker, language, instruct, ref_codes / ref_text / xvector (paths to .npy),
    ref_audio (path to a reference recording, Base: the engine encodes it), xvector_only, text_mode,
    greedy, seed, max_frames, temperature, top_k, top_p, repetition_penalty, codes_out (.npy int64
    [F, 16]), out (.wav), start_step (the engine step at which the request joins the running batch;
    default 0).
Relative paths are resolved against the JSONL file's folder. Generation defaults come from the
checkpoint's generation_config.json, as in `q3tts synth`.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from q3tts.codec.audio import SAMPLE_RATE
from q3tts.codec.voice import read_reference
from q3tts.core import SamplingParams, VoiceSpec

from .config import EngineConfig

_SAMPLING = {"greedy": bool, "seed": int, "max_frames": int, "temperature": float, "top_k": int, "top_p": float,
             "repetition_penalty": float}  # field -> type; over the checkpoint's generation_config.json
_KNOWN = {"id", "text", "speaker", "language", "instruct", "ref_codes", "ref_text", "xvector",
          "ref_audio", "xvector_only", "text_mode", "codes_out", "out", "start_step", *_SAMPLING}


@dataclass
class BatchRequest:
    seq_id: str
    text: str
    voice: VoiceSpec
    sampling: SamplingParams
    start_step: int = 0
    codes_out: Path | None = None
    out: Path | None = None


@dataclass
class BatchResult:
    seq_id: str
    codes: np.ndarray
    pcm: np.ndarray
    reason: str | None
    error: str | None
    stats: dict[str, Any] = field(default_factory=dict)


def parse_requests(path: str | Path, generation: dict | None = None) -> list[BatchRequest]:
    """Read and validate a requests JSONL file (errors name the line)."""
    path = Path(path)
    requests = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            d = {k.replace("-", "_"): v for k, v in json.loads(line).items()}
            unknown = sorted(set(d) - _KNOWN)
            if unknown:
                raise ValueError(f"unknown fields {unknown}")
            requests.append(_request(d, path.parent, generation, f"req{lineno}"))
        except (ValueError, KeyError, OSError) as exc:
            raise ValueError(f"{path}:{lineno}: {exc}") from exc
    ids = [r.seq_id for r in requests]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: duplicate request ids")
    return requests


def _request(d: dict, root: Path, gen: dict | None, default_id: str) -> BatchRequest:
    def path(key: str) -> Path | None:
        return None if d.get(key) is None else (root / d[key])

    def npy(key: str):
        p = path(key)
        return None if p is None else np.load(p)

    ref_audio, ref_sr = None, SAMPLE_RATE
    if d.get("ref_audio") is not None:
        ref_audio, ref_sr = read_reference(path("ref_audio"))
    sampling = SamplingParams.from_generation_config(
        gen, **{k: cast(d[k]) for k, cast in _SAMPLING.items() if d.get(k) is not None})
    voice = VoiceSpec(speaker=d.get("speaker"), language=d.get("language", "auto"),
                      instruct=d.get("instruct"), ref_text=d.get("ref_text"), ref_codes=npy("ref_codes"),
                      xvector=npy("xvector"), ref_audio=ref_audio, ref_sample_rate=ref_sr,
                      xvector_only=bool(d.get("xvector_only", False)),
                      text_mode=d.get("text_mode"))
    return BatchRequest(seq_id=str(d.get("id", default_id)), text=d["text"], voice=voice,
                        sampling=sampling, start_step=int(d.get("start_step", 0)),
                        codes_out=path("codes_out"), out=path("out"))


def run_requests(engine, requests: list[BatchRequest], write: bool = True) -> dict[str, BatchResult]:
    """Run `requests` through `engine`, each joining at its start_step; returns id -> result.

    A request the engine rejects (InvalidRequest / AdmissionRejected) gets reason 'rejected' and its
    error; the others still run. With `write`, codes_out / out files are written.
    """
    from q3tts.core import EngineError

    pending = sorted(requests, key=lambda r: r.start_step)
    codes: dict[str, list] = {}
    pcm: dict[str, list] = {}
    results: dict[str, BatchResult] = {}
    first_audio: dict[str, float] = {}
    t0, step = time.perf_counter(), 0
    while pending or engine.has_work():
        while pending and pending[0].start_step <= step:
            r = pending.pop(0)
            try:
                engine.add(r.seq_id, r.voice, r.sampling, r.text, True)
                codes[r.seq_id], pcm[r.seq_id] = [], []
            except EngineError as exc:
                results[r.seq_id] = BatchResult(r.seq_id, np.zeros((0, 16), np.int64),
                                                np.zeros(0, np.float32), "rejected", str(exc))
        for out in engine.step() if engine.has_work() else []:
            codes[out.seq_id].append(out.codes)
            pcm[out.seq_id].append(out.pcm)
            if len(out.codes) and out.seq_id not in first_audio:
                first_audio[out.seq_id] = time.perf_counter() - t0
            if out.finished:
                results[out.seq_id] = BatchResult(
                    out.seq_id, np.concatenate(codes.pop(out.seq_id)), np.concatenate(pcm.pop(out.seq_id)),
                    out.reason, out.error, {"first_frame_s": first_audio.get(out.seq_id, float("nan"))})
        step += 1
    if write:
        for r in requests:
            _write(r, results[r.seq_id], engine.sample_rate)
    return results


def _write(req: BatchRequest, res: BatchResult, sample_rate: int) -> None:
    if req.codes_out is not None and res.reason != "rejected":
        req.codes_out.parent.mkdir(parents=True, exist_ok=True)
        np.save(req.codes_out, res.codes.astype(np.int64))
    if req.out is not None and res.pcm.size:
        from q3tts.codec.audio import write_wav  # noqa: PLC0415  (soundfile only when a wav is asked for)

        req.out.parent.mkdir(parents=True, exist_ok=True)
        write_wav(req.out, res.pcm, sample_rate, subtype="FLOAT")


# --- CLI helpers (the lead wires these into `q3tts synth --requests FILE.jsonl`) ------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine flags for batched synthesis (`--requests` itself is added by the caller)."""
    g = parser.add_argument_group("engine (with --requests)")
    g.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    g.add_argument("--max-slots", type=int, default=64)
    g.add_argument("--page-size", type=int, default=16)
    g.add_argument("--num-pages", type=int, default=None)
    g.add_argument("--kv-policy", choices=("reserve", "on_demand"), default="on_demand")
    g.add_argument("--no-cuda-graphs", action="store_true")


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(args, "dtype", None) or ("bfloat16" if device.startswith("cuda") else "float32")
    return EngineConfig(device=device, dtype=dtype, max_slots=args.max_slots, page_size=args.page_size,
                        num_pages=args.num_pages, kv_policy=args.kv_policy,
                        use_cuda_graphs=not args.no_cuda_graphs)


def run_file(model: str | Path, requests_path: str | Path, config: EngineConfig) -> int:
    """Load the engine, run every request of the file, print one line per request; exit code."""
    from .engine import Engine

    engine = Engine(model, config)
    requests = parse_requests(requests_path, engine.checkpoint.generation)
    results = run_requests(engine, requests)
    bad = 0
    for r in requests:
        res = results[r.seq_id]
        bad += res.reason not in ("eos", "max_frames")
        print(f"{r.seq_id}: {res.codes.shape[0]} frames, {res.reason}" + (f" ({res.error})" if res.error else ""))
    return 1 if bad else 0
