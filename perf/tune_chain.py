"""Tune the code predictor's launch configs on the chain they run in, not one launch at a time.

`kernels.autotune.pick` times each candidate config of a key alone (`triton.testing.do_bench`: a launch at a
time, the L2 flushed before each) at whatever row count reaches the key first. Two fresh tunings of one commit
picked differently, and the 15 fused passes of a frame took 3.162 and 3.450 ms at one row with their picks
(RESULTS.md, twenty-fourth session). This tunes on the objective itself: the device time of the 15 fused
passes of a frame captured in one CUDA graph (weights streamed as in the step: 160 MB a pass, past the L2),
summed over --batches. Coordinate descent over the keys the passes use (each fused GEMM's weight shape and
row class, the attention launch, the draw): for each key, every candidate in turn with the other keys held;
a candidate replaces the incumbent only when the chain is faster by more than --margin; rounds until one
changes nothing (at most --rounds). The table goes to --out in the engine's format (`save_tuned`:
EngineConfig.tune_cache, $Q3TTS_TUNE_CACHE), keys the passes do not use included as they were.

H200: python3 perf/tune_chain.py --batches 1 16 --out /tmp/chain.pkl [--start table.pkl]
    --start: begin from a saved table (an engine's), else from `pick`'s own choices made in the warm-up.
    Prints each change and the chain's time per batch before and after; writes $OUT/tune_chain.md when
    OUT is set. Then: Q3TTS_TUNE_CACHE=/tmp/chain.pkl python3 perf/bench_engine.py (the engine tunes only
    the keys the file lacks: the talker's, the codec's).
CUDA only (the CPU times nothing); tests/perf/test_tune_chain.py checks the descent on a made-up cost.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_code_predictor import Inputs, random_code_predictor, tuned_capture  # noqa: E402
from profile_step import Timer, capture  # noqa: E402
from report import emit  # noqa: E402

from q3tts.kernels import autotune  # noqa: E402
from q3tts.models.code_predictor_fused import FusedCodePredictor  # noqa: E402


def descend(keys: dict[tuple, Sequence[Any]], table: dict[tuple, Any],
            cost: Callable[[dict[tuple, Any]], float], rounds: int, margin: float,
            progress: Callable[[str], None] = lambda line: None) -> tuple[dict[tuple, Any], list[str]]:
    """Coordinate descent of `cost(table)` over `keys` (key -> its candidates; `table` holds a choice for
    each). Per key: the incumbent is timed afresh, then every other candidate with the rest held; the
    fastest replaces it when it beats it by more than `margin` (a fraction). Stops after a round with no
    change or `rounds` rounds. Returns the new table and one line per change; `progress` gets a line per
    key tried."""
    table, changes = dict(table), []
    for round_ in range(1, rounds + 1):
        changed = False
        for key, choices in keys.items():
            base = cost(table)
            trials = [(cost({**table, key: c}), i, c) for i, c in enumerate(choices) if c != table[key]]
            if not trials:
                continue
            best, _, config = min(trials, key=lambda t: t[:2])
            progress(f"round {round_}: {key}: {table[key]} {base:.4f}, best rival {config} {best:.4f}")
            if best < base * (1 - margin):
                changes.append(f"round {round_}: {key}: {table[key]} -> {config} ({base:.4f} -> {best:.4f})")
                table[key], changed = config, True
        if not changed:
            break
    return table, changes


class Chain:
    """The fused code predictor's 15 passes at each batch size, as the step runs them (one CUDA graph)."""

    def __init__(self, scale: str, batches: Sequence[int], iters: int, device: str = "cuda"):
        self.cp = FusedCodePredictor(random_code_predictor(scale, torch.bfloat16, device))
        self.inputs = {b: Inputs(self.cp.cp, b, greedy=False) for b in batches}
        self.timer = Timer(torch.device(device), iters, eager_iters=1)

    def warm_up(self) -> None:
        """Each batch's passes once inside `kernels.tuning()` (as the engine's graph warm-up): every key they
        use gets `pick`'s choice (or keeps the one a loaded table gave it)."""
        with torch.no_grad():
            for inp in self.inputs.values():
                tuned_capture(lambda inp=inp: inp.run(self.cp.generate))

    def times(self, table: dict[tuple, Any]) -> dict[int, float]:
        """ms of one replay of each batch's captured passes, with `table`'s configs."""
        for key, config in table.items():
            autotune.set_tuned(key, config)
        out = {}
        with torch.no_grad():
            for b, inp in self.inputs.items():
                graph = capture(lambda inp=inp: inp.run(self.cp.generate))
                out[b] = self.timer.graph(graph.replay)
                del graph
        return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--scale", choices=("full", "tiny"), default="full")
    p.add_argument("--start", help="a saved tuning table to start from (else pick's choices in the warm-up)")
    p.add_argument("--out", required=True, help="where the tuned table is written (save_tuned)")
    p.add_argument("--rounds", type=int, default=1, help="rounds over every key (each candidate: two graph "
                   "captures and their timed replays at --batches 1 16)")
    p.add_argument("--margin", type=float, default=0.01, help="the least fraction a change must win by")
    p.add_argument("--iters", type=int, default=10, help="replays timed per graph (their median)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("tune_chain times CUDA graphs: it needs a GPU")
    device = torch.device("cuda")
    loaded = autotune.load_tuned(args.start, device) if args.start else 0
    chain = Chain(args.scale, args.batches, args.iters)
    chain.warm_up()
    seen, table = autotune.seen_candidates(), autotune.tuned_configs()
    keys = {k: c for k, c in seen.items() if len(c) > 1 and k in table}
    before = chain.times(table)
    cost = lambda t: sum(chain.times(t).values())  # noqa: E731
    tuned, changes = descend(keys, {k: table[k] for k in keys}, cost, args.rounds, args.margin,
                             lambda line: print(line, flush=True))
    after = chain.times(tuned)
    autotune.save_tuned(args.out, device)
    lines = [f"# Chain tuning of the fused code predictor ({args.scale}, bf16, {torch.cuda.get_device_name()})",
             "", f"{len(keys)} keys, {sum(len(c) for c in keys.values())} candidates; start: "
             f"{f'{loaded} configs from {args.start}' if loaded else 'pick in the warm-up'}; "
             f"table written to {args.out}", "", "| batch | 15 passes before (ms) | after (ms) |",
             "|---:|---:|---:|", *(f"| {b} | {before[b]:.3f} | {after[b]:.3f} |" for b in args.batches),
             "", "Changes:", "", *(f"- {c}" for c in changes or ["none"]), ""]
    emit("\n".join(lines), "tune_chain.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
