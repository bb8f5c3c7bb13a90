"""Tune fused launch configs on the chain they run in, not one launch at a time.

`kernels.autotune.pick` times each candidate config of a key alone (`triton.testing.do_bench`: a launch at a
time, the L2 flushed before each) at whatever row count reaches the key first. Two fresh tunings of one commit
picked differently, and the 15 fused passes of a frame took 3.162 and 3.450 ms at one row with their picks
(perf/results/RESULTS.md, twenty-fourth session; what this tuning gains: EngineConfig.chain_tune).

This tunes on the objective itself: the device time of a part of the decode step captured in one CUDA graph
(weights streamed as in the step, past the L2), summed over a few batch sizes. Two parts (`Part`):
`CodePredictorPasses`, the 15 fused passes of a frame (160 MB a pass at the released size), and `TalkerDecode`,
the fused talker's decode forward (2.8 GB over 28 layers, every row attending over its own pages). Coordinate
descent over the keys the part's launches ask for (each fused GEMM's weight shape and row class, the attention
launch, the draw): for each key, every candidate in turn with the other keys held; a candidate replaces the
incumbent only when the chain is faster by more than a margin; rounds until one changes nothing.

The engine runs it once per tuning table and part (`EngineConfig.chain_tune`, before its decode graphs are
captured): the table then holds the part's mark (`Part.mark`) and an engine that loads it
(`EngineConfig.tune_cache`) times nothing again. The mark names the launch mode it was tuned under (programmatic
dependent launch or not: `EngineConfig.programmatic_launch` picks other configs), and a tuning under one mode drops
the part's mark of the other, whose picks it replaced. perf/tune_chain.py runs it on random weights and prints what
changed. CUDA only.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch

from q3tts.core import SamplingParams
from q3tts import kernels
from q3tts.kernels import autotune
from q3tts.models.attention import DecodeContext, PagedKVCache
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


class DecodeInputs:
    """One talker decode step's inputs for `bsz` rows over `cache`: each row at `context` keys on pages of its
    own (row r: pages r * P .. r * P + P - 1, P = context / page size, wrapping around a cache with fewer pages),
    writing its new K/V at position context - 1; hidden inputs x [B, H] random, from `seed`. The attention reads
    what the pages hold (its time does not depend on it). `width`: the block table's pages per row (default P;
    the engine's is its longest sequence's, and the attention's split count follows it), entries past P the row's
    last page (never read)."""

    def __init__(self, stack, cache: PagedKVCache, bsz: int, context: int, seed: int = 0,
                 width: int | None = None):
        cfg, w = stack.cfg, stack.norm.weight
        pages = -(-context // cache.page_size)
        own = (torch.arange(bsz * pages) % cache.num_pages).view(bsz, pages)  # [B, P]
        table = torch.cat([own, own[:, -1:].expand(bsz, max(width or pages, pages) - pages)], 1)  # [B, width]
        pos = torch.full((bsz,), context - 1)
        slots = own[:, -1] * cache.page_size + pos % cache.page_size  # [B]
        self.positions = pos.to(w.device)
        self.ctx = DecodeContext(cache, slots.to(w.device), table.int().to(w.device), (pos + 1).int().to(w.device),
                                 cfg.head_dim ** -0.5)
        self.written_pages = own[:, -1].to(w.device)  # [B]: the pages the step writes K/V to
        gen = torch.Generator(w.device).manual_seed(seed)
        self.x = torch.randn(bsz, cfg.hidden_size, generator=gen, device=w.device).to(w.dtype)  # [B, H]

    def run(self, forward: Callable) -> torch.Tensor:
        """forward(x, positions, ctx): the stack's decode contract (`DecoderStack.forward`) -> hidden [B, H]."""
        return forward(self.x, self.positions, self.ctx)


class Chain:
    """Work run at each of `batches` rows (`run(b)`), each captured in one CUDA graph and timed with a given table
    of launch configs; `restore()` undoes what the work wrote where others read (once, when tuning ends)."""

    def __init__(self, run: Callable[[int], object], batches: Sequence[int], iters: int,
                 restore: Callable[[], None] = lambda: None):
        self.run, self.iters, self.restore = run, iters, restore
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


class Part(Protocol):
    """A part of the decode step that chain tuning tunes (the engine's start log names it)."""

    name: str
    mark_name: str  # the first field of its marks

    def chain(self, batches: Sequence[int], iters: int) -> Chain:
        """The part's work at each of `batches` rows."""

    def mark(self, batches: Sequence[int]) -> tuple:
        """The table entry that says the part's keys were chain-tuned at `batches`: (mark_name, the part's shapes,
        dtype, the sorted batches, ..., whether its kernels launch with PDL) (another model size has other keys)."""


class CodePredictorPasses:
    """A FusedCodePredictor's 15 passes of a frame (sampled draws), on random inputs."""

    name, mark_name = "code predictor", "cp_chain_tuned"

    def __init__(self, fused):
        self.fused = fused

    def chain(self, batches: Sequence[int], iters: int) -> Chain:
        inputs = {b: FrameInputs(self.fused.cp, b, greedy=False) for b in batches}
        return Chain(lambda b: inputs[b].run(self.fused.generate), batches, iters)

    def mark(self, batches: Sequence[int]) -> tuple:
        cfg, head = self.fused.cp.model.cfg, self.fused.cp.lm_head[0].weight
        shape = (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, head.shape[0], self.fused.cp.num_groups)
        return self.mark_name, shape, head.dtype, tuple(sorted(batches)), kernels.programmatic_launch(head)


class TalkerDecode:
    """A FusedTalker's decode forward, each row attending over `context` keys on its own pages of `cache` in a
    block table `width` pages wide (`DecodeInputs`). The engine passes its own KV cache before any sequence holds
    a page, and its block tables' width; the pages written (each row's last) are zeroed when tuning ends, as a
    fresh cache holds them."""

    name, mark_name = "talker", "talker_chain_tuned"

    def __init__(self, fused, cache: PagedKVCache, context: int = 300, width: int | None = None):
        self.fused, self.cache, self.context, self.width = fused, cache, context, width

    def chain(self, batches: Sequence[int], iters: int) -> Chain:
        inputs = {b: DecodeInputs(self.fused.stack, self.cache, b, self.context, width=self.width)
                  for b in batches}
        written = torch.cat([i.written_pages for i in inputs.values()])

        def restore():
            for kv in (self.cache.k, self.cache.v):
                kv[:, written] = 0

        return Chain(lambda b: inputs[b].run(self.fused.forward), batches, iters, restore)

    def mark(self, batches: Sequence[int]) -> tuple:
        cfg, w = self.fused.stack.cfg, self.fused.stack.norm.weight
        shape = (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads)
        return (self.mark_name, shape, w.dtype, tuple(sorted(batches)), self.context, self.width,
                kernels.programmatic_launch(w))


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


def tune_on(chain: Chain, rounds: int = 1, margin: float = 0.01,
            progress: Progress = lambda line: None) -> ChainResult:
    """Chain-tune the keys `chain`'s work asks for first and leave the result in the process's tuning table
    (`kernels.autotune`); keys other launches asked for earlier (an engine's prefill; a part tuned before that
    shares a weight shape) are left as they are. CUDA, outside any graph capture; its graphs are freed and
    `chain.restore()` has run when it returns."""
    earlier = autotune.seen_candidates()
    try:
        chain.warm_up()
        seen, table = autotune.seen_candidates(), autotune.tuned_configs()
        keys = {k: c for k, c in seen.items() if len(c) > 1 and k in table and k not in earlier}
        before = chain.times(table)
        cost = lambda t: sum(chain.times(t).values())  # noqa: E731
        tuned, changes = descend(keys, {k: table[k] for k in keys}, cost, rounds, margin, progress)
        after = chain.times(tuned)
    finally:
        chain.restore()
    return ChainResult(before, after, changes, len(keys), sum(len(c) for c in keys.values()))


def tune(part: Part, batches: Sequence[int], rounds: int = 1, margin: float = 0.01, iters: int = 10,
         progress: Progress = lambda line: None) -> ChainResult:
    """`tune_on` the chain of `part` (its fused kernels on CUDA) at `batches`, then mark the table
    (`part.mark(batches)`), in place of a mark of the other launch mode."""
    result = tune_on(part.chain(batches, iters), rounds, margin, progress)
    mark = part.mark(batches)
    for key in autotune.tuned_configs():
        if isinstance(key, tuple) and key[:-1] == mark[:-1] and key != mark:
            autotune.forget(key)
    autotune.set_tuned(mark, {b: round(ms, 4) for b, ms in result.after.items()})
    return result


def needs_tuning(part: Part, batches: Sequence[int]) -> bool:
    """Whether the process's tuning table lacks the mark of `part`'s chain tuning at `batches`."""
    return part.mark(batches) not in autotune.tuned_configs()


def chain_tuned_parts() -> list[str]:
    """The parts whose marks the process's tuning table holds, as "<part> at B <batches>": a table an engine
    chain-tuned keeps those picks for every later process that loads it, `EngineConfig.chain_tune` off or on (the
    benches print this beside their figures)."""
    names = {part.mark_name: part.name for part in (CodePredictorPasses, TalkerDecode)}
    return sorted(f"{names[key[0]]} at B {', '.join(map(str, key[3]))}{' (PDL)' if key[-1] is True else ''}"
                  for key in autotune.tuned_configs() if isinstance(key, tuple) and key and key[0] in names)
