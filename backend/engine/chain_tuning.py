"""Tune the fused code predictor's launch configs on the chain they run in, not one launch at a time.

`kernels.autotune.pick` times each candidate config of a key alone (`triton.testing.do_bench`: a launch at a
time, the L2 flushed before each) at whatever row count reaches the key first. Two fresh tunings of one commit
picked differently, and the 15 fused passes of a frame took 3.162 and 3.450 ms at one row with their picks
(perf/results/RESULTS.md, twenty-fourth session; what this tuning gains: EngineConfig.chain_tune).

This tunes on the objective itself: the device time of the 15 fused passes of a frame captured in one CUDA graph
(weights streamed as in the step: 160 MB a pass at the released size, past the L2), summed over a few batch
sizes. Coordinate descent over the keys the passes use (each fused GEMM's weight shape and row class, the
attention launch, the draw): for each key, every candidate in turn with the other keys held; a candidate
replaces the incumbent only when the chain is faster by more than a margin; rounds until one changes nothing.

The engine runs it once per tuning table (`EngineConfig.chain_tune`, before its decode graphs are captured):
the table then holds a mark (`mark_key`) and an engine that loads it (`EngineConfig.tune_cache`) times
nothing again. perf/tune_chain.py runs it on random weights and prints what changed. CUDA only.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from q3tts.core import SamplingParams
from q3tts.kernels import autotune
from q3tts.models.sampling import SamplingTensors, SubtalkerSampler, uniforms

Progress = Callable[[str], None]


def descend(keys: dict[tuple, Sequence[Any]], table: dict[tuple, Any],
            cost: Callable[[dict[tuple, Any]], float], rounds: int, margin: float,
            progress: Progress = lambda line: None) -> tuple[dict[tuple, Any], list[str]]:
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


def capture_graph(fn: Callable[[], object], stream: torch.cuda.Stream | None = None) -> torch.cuda.CUDAGraph:
    """Warm `fn` up on a side stream (or `stream`), then capture it into a CUDA graph (the recipe of
    GraphRunner.capture; on `stream` when given: the graph's kernels keep that stream's green context)."""
    side = stream or torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    torch.cuda.synchronize()
    return graph


def replay_ms(replay: Callable[[], None], iters: int) -> float:
    """Median ms of one `replay()` of a captured graph (CUDA events around each of `iters`, after 3 untimed)."""
    for _ in range(3):
        replay()
    torch.cuda.synchronize()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in pairs:
        a.record()
        replay()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in pairs)


class FrameInputs:
    """One frame's code-predictor inputs for `bsz` rows: the talker's past hidden [B, H], c0 [B] and a sampler
    (default sampling, or greedy) with fixed uniforms. Random, from `seed`."""

    def __init__(self, code_predictor, bsz: int, greedy: bool, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        ref = code_predictor.lm_head[0].weight
        hidden = code_predictor.model.codec_embedding[0].weight.shape[1]
        codebook = code_predictor.lm_head[0].out_features
        self.past_hidden = torch.randn(bsz, hidden, generator=gen).to(ref.device, ref.dtype)  # [B, H]
        self.c0 = torch.randint(0, codebook, (bsz,), generator=gen).to(ref.device)  # [B]
        params = SamplingTensors.subtalker([SamplingParams(greedy=greedy, seed=i) for i in range(bsz)], ref.device)
        rows = torch.arange(bsz, device=ref.device)
        self.sampler = SubtalkerSampler(params, uniforms(rows, torch.zeros_like(rows)))

    def run(self, generate) -> tuple[torch.Tensor, torch.Tensor]:
        """generate(past_hidden, c0, sampler): codes [B, 15], next input [B, H]."""
        return generate(self.past_hidden, self.c0, self.sampler)


class Chain:
    """Work run at each of `batches` rows (`run(b)`), each captured in one CUDA graph and timed with a given table
    of launch configs."""

    def __init__(self, run: Callable[[int], object], batches: Sequence[int], iters: int):
        self.run, self.iters = run, iters
        self.batches = sorted(batches, reverse=True)  # largest first: lazily sized workspaces grow once

    def warm_up(self) -> None:
        """Each batch once inside `kernels.tuning()` (as the engine's graph warm-up): every key the work uses gets
        `pick`'s choice, or keeps a loaded table's."""
        with torch.no_grad(), autotune.tuning():
            for b in self.batches:
                self.run(b)
        torch.cuda.synchronize()

    def times(self, table: dict[tuple, Any]) -> dict[int, float]:
        """ms of one replay of each batch's captured work, with `table`'s configs (they stay set)."""
        for key, config in table.items():
            autotune.set_tuned(key, config)
        out = {}
        with torch.no_grad():
            for b in self.batches:
                graph = capture_graph(lambda b=b: self.run(b))
                out[b] = replay_ms(graph.replay, self.iters)
                del graph
        return out


def passes_chain(fused, batches: Sequence[int], iters: int) -> Chain:
    """A FusedCodePredictor's 15 passes of a frame at each of `batches` rows, on random inputs."""
    inputs = {b: FrameInputs(fused.cp, b, greedy=False) for b in batches}
    return Chain(lambda b: inputs[b].run(fused.generate), batches, iters)


@dataclass
class ChainResult:
    """What `tune` did: the chain's ms per batch before and after, one line per change, the keys tuned."""

    before: dict[int, float]
    after: dict[int, float]
    changes: list[str]
    keys: int
    candidates: int

    def summary(self) -> str:
        """One line: how many keys were tuned, the chain's ms per batch before -> after, each change."""
        ms = ", ".join(f"B={b} {self.before[b]:.3f} -> {self.after[b]:.3f} ms" for b in sorted(self.before))
        return f"{self.keys} keys, {self.candidates} candidates; {ms}; {'; '.join(self.changes) or 'no change'}"


def mark_key(fused, batches: Sequence[int]) -> tuple:
    """The table entry that says the keys of `fused`'s code predictor (its shapes and dtype: another model size
    has other keys) were chain-tuned at `batches`; a tuning table that holds it, loaded, is not tuned again."""
    cfg, head = fused.cp.model.cfg, fused.cp.lm_head[0].weight
    shape = (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, head.shape[0], fused.cp.num_groups)
    return "cp_chain_tuned", shape, head.dtype, tuple(sorted(batches))


def tune_on(chain: Chain, rounds: int = 1, margin: float = 0.01,
            progress: Progress = lambda line: None) -> ChainResult:
    """Chain-tune the keys `chain`'s work asks for first and leave the result in the process's tuning table
    (`kernels.autotune`); keys other launches asked for earlier (an engine's prefill: the talker's) are left as
    they are. CUDA, outside any graph capture; its graphs are freed before it returns."""
    earlier = autotune.seen_candidates()
    chain.warm_up()
    seen, table = autotune.seen_candidates(), autotune.tuned_configs()
    keys = {k: c for k, c in seen.items() if len(c) > 1 and k in table and k not in earlier}
    before = chain.times(table)
    cost = lambda t: sum(chain.times(t).values())  # noqa: E731
    tuned, changes = descend(keys, {k: table[k] for k in keys}, cost, rounds, margin, progress)
    after = chain.times(tuned)
    return ChainResult(before, after, changes, len(keys), sum(len(c) for c in keys.values()))


def tune(fused, batches: Sequence[int], rounds: int = 1, margin: float = 0.01, iters: int = 10,
         progress: Progress = lambda line: None) -> ChainResult:
    """`tune_on` the 15 passes of `fused` (a FusedCodePredictor on CUDA) at `batches`, then mark the table
    (`mark_key(fused, batches)`)."""
    result = tune_on(passes_chain(fused, batches, iters), rounds, margin, progress)
    autotune.set_tuned(mark_key(fused, batches), {b: round(ms, 4) for b, ms in result.after.items()})
    return result


def needs_tuning(fused, batches: Sequence[int]) -> bool:
    """Whether the process's tuning table lacks the mark of `fused`'s chain tuning at `batches`."""
    return mark_key(fused, batches) not in autotune.tuned_configs()
