"""Chain-tune launch configs on random weights and print what changed (q3tts/engine/chain_tuning.py: coordinate
descent on the device time of a chain of launches captured in one CUDA graph, summed over --batches).

H200: python3 perf/tune_chain.py [--part code_predictor|talker] --batches 1 16 --out /tmp/chain.pkl
                                 [--start table.pkl] [--context 300]
    code_predictor (default): the 15 fused passes of a frame; talker: the fused talker's decode forward (28
    layers, every row at --context keys on its own pages, in block tables --table-pages wide: the engine's, whose
    width sets the attention's split count; models/talker_fused.py). The engine does each once per tuning table
    (EngineConfig.chain_tune): the table gets the part's chain-tuned mark (the talker's names --context and
    --table-pages; the engine's, 300 and its own; both name the launch mode, --[no-]programmatic-launch, default
    the engine's), so an engine that loads it does not chain-tune that part again.
    --start: begin from a saved table (an engine's), else from `pick`'s own choices made in the warm-up.
    Prints each key tried, each change and the chain's time per batch before and after; writes
    $OUT/tune_chain.md when OUT is set. The table goes to --out in the engine's format (`save_tuned`:
    EngineConfig.tune_cache, $Q3TTS_TUNE_CACHE): Q3TTS_TUNE_CACHE=/tmp/chain.pkl perf/bench_engine.py runs with it.
CUDA only (the CPU times nothing); tests/engine/test_chain_tuning.py checks the descent on a made-up cost.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_code_predictor import random_code_predictor  # noqa: E402
from bench_engine import add_programmatic_launch_argument  # noqa: E402
from report import emit  # noqa: E402

from q3tts import kernels  # noqa: E402
from q3tts.engine import EngineConfig, chain_tuning  # noqa: E402
from q3tts.kernels import autotune  # noqa: E402
from q3tts.models.code_predictor_fused import FusedCodePredictor  # noqa: E402


def talker_part(args) -> chain_tuning.TalkerDecode:
    """The fused talker's decode forward over bench_talker's random stack, every row at --context keys on its own
    pages of random K/V, in block tables --table-pages wide."""
    from bench_talker import PAGE_SIZE, random_cache, random_stack
    from q3tts.models.talker_fused import FusedTalker

    stack = random_stack(args.scale, None, torch.bfloat16, "cuda")
    cache = random_cache(stack, max(args.batches) * -(-args.context // PAGE_SIZE))
    return chain_tuning.TalkerDecode(FusedTalker(stack), cache, args.context, args.table_pages)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("code_predictor", "talker"), default="code_predictor")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--context", type=int, default=300, help="talker: keys each row attends over")
    p.add_argument("--table-pages", type=int, default=EngineConfig().sequence_pages,
                   help="talker: block-table width in pages (default: a default engine's; the attention's split "
                   "count follows it)")
    p.add_argument("--scale", choices=("full", "tiny"), default="full")
    p.add_argument("--start", help="a saved tuning table to start from (else pick's choices in the warm-up)")
    p.add_argument("--out", required=True, help="where the tuned table is written (save_tuned)")
    p.add_argument("--rounds", type=int, default=1, help="rounds over every key (each candidate: two graph "
                   "captures and their timed replays at --batches 1 16)")
    p.add_argument("--margin", type=float, default=0.01, help="the least fraction a change must win by")
    p.add_argument("--iters", type=int, default=10, help="replays timed per graph (their median)")
    add_programmatic_launch_argument(p)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("tune_chain times CUDA graphs: it needs a GPU")
    kernels.set_programmatic_launch(args.programmatic_launch)  # the mark names the mode it was tuned under
    device = torch.device("cuda")
    loaded = autotune.load_tuned(args.start, device) if args.start else 0
    progress = lambda line: print(line, flush=True)  # noqa: E731
    part = (talker_part(args) if args.part == "talker" else
            chain_tuning.CodePredictorPasses(FusedCodePredictor(random_code_predictor(args.scale, torch.bfloat16,
                                                                                      "cuda"))))
    res = chain_tuning.tune(part, args.batches, args.rounds, args.margin, args.iters, progress)
    autotune.save_tuned(args.out, device)
    what = (f"the fused talker's decode forward, context {args.context}, tables {args.table_pages} pages wide"
            if args.part == "talker"
            else "the fused code predictor's 15 passes")
    lines = [f"# Chain tuning of {what} ({args.scale}, bf16, {torch.cuda.get_device_name()}"
             f"{', programmatic launch' if args.programmatic_launch else ''})",
             "", f"{res.keys} keys, {res.candidates} candidates; start: "
             f"{f'{loaded} configs from {args.start}' if loaded else 'pick in the warm-up'}; "
             f"table written to {args.out}", "", "| batch | chain before (ms) | after (ms) |",
             "|---:|---:|---:|", *(f"| {b} | {res.before[b]:.3f} | {res.after[b]:.3f} |" for b in sorted(args.batches)),
             "", "Changes:", "", *(f"- {c}" for c in res.changes or ["none"]), ""]
    emit("\n".join(lines), "tune_chain.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
