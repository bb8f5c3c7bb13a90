"""bf16 fidelity: the engine's low-precision model and codec against the fp32 eager reference.

H200:      python3 perf/fidelity.py --gates      (real-size random 1.7B CustomVoice, or --model DIR)
CPU check: python3 perf/fidelity.py --scale tiny --device cpu --dtype float32 --frames 20

One checkpoint, one CustomVoice request (its first speaker, the benchmark text), B = 1, `--frames`
frames (default 200). Two sides, each its own copy of the same weights:
  reference  float32, every `q3tts.kernels` call on its torch reference (Q3TTS_KERNELS=torch), no
             TF32 in matmuls or cuDNN convs, the eager code predictor, the torch codec.
  low        `--dtype` (bfloat16 on CUDA) through the kernels the engine runs on that device: the
             Triton kernels of the talker and code-predictor stacks, the fused code predictor and
             the codec kernels when `--fused-code-predictor` / `--codec-kernels` (default:
             EngineConfig's), each kernel tuned on its first launch as in the engine's graph
             warm-up. The model-level step (models/step.py `prefill`, `CodePredictor.generate`,
             `Talker.forward` / `logits`) runs eagerly: the kernels a captured step replays,
             without the graph.
The reference runs greedy on its own: c0[t] = argmax of the talker head's scores over the codebook
ids (control ids, EOS included, are never chosen: every run makes `--frames` frames), c1..c15 =
argmax of the code-predictor heads. Its codes drive the figures:
  cosine     cosine similarity of the talker head logits [vocab] (the scores c0[t] is drawn from),
             low vs reference, teacher-forced: the low side is fed the reference's codes of every
             frame (c0, and c1..c15 through its code predictor's sampler), so position t compares
             like with like. Min and mean over the frames; gate: min >= 0.9999.
  agreement  share of positions where the low logits' codebook argmax equals the reference's, same
             teacher forcing; gate >= 99 %. Free-running agreement (the low side greedy on its own
             codes; c0 compared position by position, with the first divergence) is information.
  codec SNR  the reference's codes through the streaming codec frame by frame (each frame decoded
             once, as the engine decodes), low vs reference: 10·log10(Σ ref² / Σ (low − ref)²) over
             the concatenated PCM, in dB (inf: bit-equal); gate >= 35 dB.
`--perturb S` adds S·std(w) Gaussian noise to every weight of the low side (talker and codec): the
gates' own check. `--fp32-residual`: the low side with EngineConfig.fp32_residual (the residual stream
in fp32, the normed rows that feed the GEMMs in the low dtype; the fused code predictor does not serve
it), instead of the stream rounded to the low dtype as the official model rounds it. `--fp32-logits`: the low
side's talker head scores left in fp32 (the GEMM's fp32 accumulator, not rounded to the low dtype as the
eager head rounds them): how many of the c0 disagreements are ties that the head's rounding makes. Each
teacher-forced disagreement is listed with the reference's gap between its top two codebook scores and the
low side's scores of the two codes (information). `--gates`: exit 1
when a gate fails. Prints a markdown table ($OUT/fidelity.md when OUT is set); on CUDA appends a row to
perf/results/fidelity.csv (and $OUT/fidelity.csv).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from bench_engine import TEXT, make_model
from report import append_csv, emit

from q3tts import kernels
from q3tts.checkpoint.loader import load_checkpoint
from q3tts.codec.decoder import CodecDecoder
from q3tts.codec.streaming import StreamingDecoder
from q3tts.core import SamplingParams, VoiceSpec
from q3tts.engine.config import EngineConfig
from q3tts.models.attention import DecodeContext, PagedKVCache
from q3tts.models.prompt import Prompt, PromptBuilder
from q3tts.models.sampling import NUM_UNIFORMS, SamplingTensors, SubtalkerSampler, uniforms
from q3tts.models.step import prefill, talker_rules
from q3tts.models.tts_model import Qwen3TTS

GATES = {"cos_min": 0.9999, "agree_forced": 0.99, "snr_db": 35.0}  # figure -> lowest passing value
CSV_COLUMNS = ("frames", "dtype", "config", "checkpoint", "cos_min", "cos_mean", "agree_forced",
               "agree_free", "snr_db", "gpu", "commit", "date")
GREEDY = SamplingParams(greedy=True)


@dataclass
class Side:
    """One precision's copy of the checkpoint: model, streaming codec (one stream), the prompt."""

    model: Qwen3TTS
    codec: StreamingDecoder
    prompt: Prompt


@contextlib.contextmanager
def reference_math():
    """The fp32 eager reference: kernels on their torch references, no TF32 (matmul, cuDNN)."""
    saved = (os.environ.get("Q3TTS_KERNELS"), torch.backends.cuda.matmul.allow_tf32,
             torch.backends.cudnn.allow_tf32)
    os.environ["Q3TTS_KERNELS"] = "torch"
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        if saved[0] is None:
            del os.environ["Q3TTS_KERNELS"]
        else:
            os.environ["Q3TTS_KERNELS"] = saved[0]
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[1:]


@torch.no_grad()
def perturb_(module: torch.nn.Module, scale: float, seed: int = 0) -> None:
    """Add scale·std(w)·N(0, 1) to every floating parameter w of `module`, in place (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        if p.is_floating_point() and p.numel() > 1:
            noise = torch.randn(p.shape, generator=gen)  # on the host: the same on any device
            p.add_((scale * p.float().std() * noise.to(p.device)).to(p.dtype))


def load_side(path: Path, dtype: torch.dtype, device: str, fused_code_predictor: int = 0,
              codec_kernels: bool = False, perturb: float = 0.0, fp32_residual: bool = False,
              fp32_logits: bool = False) -> Side:
    """The checkpoint at `dtype` on `device` (the switches: see the module docstring)."""
    ckpt = load_checkpoint(path, dtype, device)
    model = Qwen3TTS.from_checkpoint(ckpt)
    decoder = CodecDecoder.from_weights(ckpt.codec_config, ckpt.codec_weights, dtype, device)
    if perturb:
        perturb_(model, perturb)
        perturb_(decoder, perturb, seed=1)
    model.talker.keep_fp32_residual(fp32_residual)
    if fp32_logits:
        head = model.talker.codec_head.weight  # [V, H]
        model.talker.logits = lambda hidden: unrounded_linear(hidden, head)
    model.talker.code_predictor.use_fused(fused_code_predictor)
    speakers = sorted(model.config.talker.speaker_ids)
    if not speakers:
        raise SystemExit(f"--model {path}: no speakers; fidelity.py needs a CustomVoice checkpoint")
    prompt = PromptBuilder(model, ckpt.tokenizer).build(TEXT, VoiceSpec(speaker=speakers[0]))
    codec = StreamingDecoder(decoder, 1, dtype, device, use_kernels=codec_kernels)
    return Side(model, codec, prompt)


def unrounded_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [B, K] @ weight [N, K]^T as float32, never rounded to x's dtype: cuBLAS with an fp32 output
    on CUDA; on the CPU (which has no such GEMM) in float32 from the low-precision values."""
    if x.is_cuda:
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    return F.linear(x.float(), weight.float())


class ForcedCodes(SubtalkerSampler):
    """Teacher forcing of the code predictor: its draws are the given c1..c15 `codes` [1, 15]."""

    def __init__(self, codes: torch.Tensor):
        params = SamplingTensors.subtalker([GREEDY], codes.device)
        super().__init__(params, torch.zeros(1, NUM_UNIFORMS, device=codes.device))
        self.codes = codes

    def __call__(self, logits: torch.Tensor, group: int,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        ids = self.codes[:, group - 1]
        return ids if out is None else out.copy_(ids)


def code_sampler(frame: torch.Tensor | None, device: torch.device) -> SubtalkerSampler:
    """The code predictor's draws of one frame: forced to frame [1, 16]'s c1..c15, or greedy."""
    if frame is not None:
        return ForcedCodes(frame[:, 1:])
    params = SamplingTensors.subtalker([GREEDY], device)
    return SubtalkerSampler(params, torch.zeros(1, NUM_UNIFORMS, device=device))


def kv_cache(side: Side, tokens: int) -> PagedKVCache:
    """A talker cache for `tokens` positions of one sequence, in the engine's page size."""
    layers, page, ref = side.model.talker.cfg.layers, EngineConfig.page_size, side.prompt.prefill
    return PagedKVCache(layers.num_layers, math.ceil(tokens / page), page, layers.num_kv_heads,
                        layers.head_dim, ref.dtype, ref.device)


@torch.no_grad()
def run_talker(side: Side, frames: int, forced: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Talker head logits [frames, vocab] float32 (row t: the scores c0[t] is drawn from) and codes
    [frames, 16] int64 of `frames` frames, on the host: greedy on its own (see the module
    docstring), or teacher-forced to `forced` [frames, 16]."""
    talker, prompt = side.model.talker, side.prompt
    device, length = prompt.prefill.device, prompt.prefill.shape[0]
    cache = kv_cache(side, length + frames)
    pages = torch.arange(cache.num_pages, dtype=torch.int32, device=device)[None]  # [1, P]
    seeds = torch.zeros(1, dtype=torch.int64, device=device)
    _, hidden = prefill(talker, cache, prompt.prefill, torch.arange(length, device=device),
                        SamplingTensors.talker([GREEDY], device), seeds, uniforms)  # [1, H]
    codebook = talker_rules(talker).suppress_start  # ids below: codes; from it on: control ids
    forced = None if forced is None else forced.to(device)
    logits, codes = [], []
    for t in range(frames):
        scores = talker.logits(hidden)  # [1, V]
        frame = None if forced is None else forced[t:t + 1]  # [1, 16]
        c0 = scores[:, :codebook].argmax(-1) if frame is None else frame[:, 0]  # [1]
        rest, next_input = talker.code_predictor.generate(hidden, c0, code_sampler(frame, device))
        logits.append(scores)
        codes.append(torch.cat((c0[:, None], rest), dim=1))
        pos = torch.tensor([length + t], device=device)
        text = prompt.trailing[t:t + 1] if t < prompt.trailing.shape[0] else prompt.pad[None]
        ctx = DecodeContext(cache, pos, pages, (pos + 1).int(), talker.attn_scale)
        hidden = talker(next_input + text, pos, ctx)  # [1, H]
    return torch.cat(logits).cpu(), torch.cat(codes).cpu()


@torch.no_grad()
def stream_pcm(codec: StreamingDecoder, codes: torch.Tensor) -> torch.Tensor:
    """pcm [frames·1920] float64 (host) of codes [frames, 16], decoded frame by frame on a fresh
    stream."""
    device = codec.pool[0].device
    slots = torch.zeros(1, dtype=torch.int64, device=device)
    codec.reset(slots)
    pieces = [codec.decode_frame(slots, frame[None].to(device)) for frame in codes]  # [1, 1920]
    return torch.cat(pieces, dim=1)[0].double().cpu()


def snr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    """10·log10(Σ ref² / Σ (x − ref)²); inf when x == ref."""
    noise = (x - ref).pow(2).sum().item()
    return math.inf if noise == 0 else 10 * math.log10(ref.pow(2).sum().item() / noise)


def figures(ref_logits: torch.Tensor, forced_logits: torch.Tensor, ref_codes: torch.Tensor,
            free_codes: torch.Tensor, ref_pcm: torch.Tensor, low_pcm: torch.Tensor,
            codebook: int) -> dict:
    """The fidelity figures (module docstring) of logits [T, V], codes [T, 16] and pcm [n]."""
    cos = F.cosine_similarity(forced_logits.double(), ref_logits.double(), dim=-1)  # [T]
    agree = forced_logits[:, :codebook].argmax(-1) == ref_logits[:, :codebook].argmax(-1)  # [T]
    same = free_codes[:, 0] == ref_codes[:, 0]  # [T]
    differ = (~same).nonzero()
    return dict(disagreements=disagreements(ref_logits[:, :codebook], forced_logits[:, :codebook]),
                cos_min=cos.min().item(), cos_mean=cos.mean().item(),
                agree_forced=agree.double().mean().item(), agree_free=same.double().mean().item(),
                first_divergence=int(differ[0]) if len(differ) else None,
                snr_db=snr_db(ref_pcm, low_pcm))


def disagreements(ref: torch.Tensor, low: torch.Tensor) -> list[tuple[int, float, float]]:
    """(frame, reference's top-2 gap, the low side's score of its own pick minus its score of the
    reference's pick) of each frame whose argmax differs; ref, low [T, C] codebook scores."""
    top2 = ref.topk(2, dim=-1).values  # [T, 2]
    ref_pick, low_pick = ref.argmax(-1), low.argmax(-1)  # [T]
    rows = (ref_pick != low_pick).nonzero().flatten().tolist()
    return [(t, (top2[t, 0] - top2[t, 1]).item(), (low[t, low_pick[t]] - low[t, ref_pick[t]]).item())
            for t in rows]


def verdict(name: str, f: dict) -> str:
    """PASS / FAIL of gate `name` (a key of GATES) on figures `f`."""
    return "PASS" if f[name] >= GATES[name] else "FAIL"


def table(f: dict, frames: int) -> str:
    """The figures as a markdown table with each gate's verdict."""
    div = "none" if f["first_divergence"] is None else f"frame {f['first_divergence']}"
    rows = [("talker logits cosine, min (teacher-forced)", f"{f['cos_min']:.6f}", "≥ 0.9999",
             verdict("cos_min", f)),
            ("talker logits cosine, mean", f"{f['cos_mean']:.6f}", "", ""),
            ("greedy c0 agreement (teacher-forced)", f"{100 * f['agree_forced']:.2f} %", "≥ 99 %",
             verdict("agree_forced", f)),
            (f"greedy c0 agreement (free-running; first divergence: {div})",
             f"{100 * f['agree_free']:.2f} %", "information", ""),
            ("streamed codec SNR", f"{f['snr_db']:.2f} dB", "≥ 35 dB", verdict("snr_db", f))]
    head = [f"over {frames} frames", "", "| figure | value | gate | result |",
            "|---|---:|---:|---|"]
    ties = [f"frame {t}: reference top-2 gap {gap:.4g}, low side prefers its pick by {margin:.4g}"
            for t, gap, margin in f["disagreements"]]
    notes = ["", "teacher-forced c0 disagreements:" if ties else "no teacher-forced c0 disagreement"]
    return "\n".join(head + [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows] + notes
                     + [f"- {t}" for t in ties])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring); `dtype` filled in per device."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="CustomVoice checkpoint folder (default: make a random one)")
    p.add_argument("--scale", choices=("tiny", "full"), default="full",
                   help="of the random checkpoint")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None,
                   help="the low side's; default bfloat16 on cuda, float32 on cpu")
    p.add_argument("--frames", type=int, default=200)
    p.add_argument("--fused-code-predictor", type=int, default=EngineConfig.fused_code_predictor,
                   metavar="MAX_BATCH", help="low side: EngineConfig.fused_code_predictor (0: the eager passes)")
    p.add_argument("--codec-kernels", action=argparse.BooleanOptionalAction,
                   default=EngineConfig.codec_kernels, help="low side: EngineConfig.codec_kernels")
    p.add_argument("--perturb", type=float, default=0.0,
                   help="noise scale on the low side's weights (the gates' check)")
    p.add_argument("--fp32-residual", action=argparse.BooleanOptionalAction, default=EngineConfig.fp32_residual,
                   help="low side: EngineConfig.fp32_residual")
    p.add_argument("--fp32-logits", action="store_true",
                   help="low side: the talker head's scores unrounded (fp32 accumulator)")
    p.add_argument("--gates", action="store_true", help="exit 1 when a gate fails")
    args = p.parse_args(argv)
    if args.frames < 1:
        p.error(f"--frames must be >= 1, got {args.frames}")
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if not isinstance(getattr(torch, args.dtype, None), torch.dtype):
        p.error(f"--dtype {args.dtype}: not a torch dtype")
    return args


def measure(args: argparse.Namespace, path: Path) -> dict:
    """Both sides' runs (the reference first, freed before the low side loads) -> `figures`."""
    t0 = time.perf_counter()
    with reference_math():
        ref = load_side(path, torch.float32, args.device)
        ref_logits, ref_codes = run_talker(ref, args.frames)
        ref_pcm = stream_pcm(ref.codec, ref_codes)
    codebook = talker_rules(ref.model.talker).suppress_start
    del ref
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    t1 = time.perf_counter()
    print(f"fp32 reference: {args.frames} frames + codec in {t1 - t0:.1f} s", flush=True)
    low = load_side(path, getattr(torch, args.dtype), args.device, args.fused_code_predictor,
                    args.codec_kernels, args.perturb, args.fp32_residual, args.fp32_logits)
    with kernels.tuning():
        forced_logits, _ = run_talker(low, args.frames, forced=ref_codes)
        _, free_codes = run_talker(low, args.frames)
        low_pcm = stream_pcm(low.codec, ref_codes)
    print(f"{args.dtype}: forced + free runs + codec in {time.perf_counter() - t1:.1f} s",
          flush=True)
    return figures(ref_logits, forced_logits, ref_codes, free_codes, ref_pcm, low_pcm, codebook)


def config_name(args: argparse.Namespace) -> str:
    """The low side's switches that are on (and the perturbation), or "default"."""
    on = [n for n in ("codec_kernels",) if getattr(args, n)]
    if args.fused_code_predictor:
        on.append(f"fused_code_predictor={args.fused_code_predictor}")
    if args.perturb:
        on.append(f"perturb{args.perturb:g}")
    on += [n for n in ("fp32_residual", "fp32_logits") if getattr(args, n)]
    return "+".join(on) or "default"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    path = make_model(args)
    f = measure(args, path)
    config = config_name(args)
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    emit(f"# fidelity: {args.dtype} vs fp32 eager ({path.name}, {config}, {dev})\n\n"
         f"{table(f, args.frames)}\n", "fidelity.md")
    if args.device.startswith("cuda"):
        cosines = {k: f"{f[k]:.6f}" for k in ("cos_min", "cos_mean")}  # the CSV's 3 decimals would read 1
        row = dict(f, **cosines, frames=args.frames, dtype=args.dtype, config=config,
                   checkpoint=args.model or args.scale)
        results = Path(__file__).resolve().parent / "results"
        for folder in (results, Path(os.environ.get("OUT", "/tmp"))):
            append_csv(folder / "fidelity.csv", [row], columns=CSV_COLUMNS)
    failed = [name for name in GATES if verdict(name, f) == "FAIL"]
    return 1 if args.gates and failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
