"""Batched sampling in the reference's processor order (spec d.2, d.3), with counter-based uniforms.

Every parameter is a per-row tensor so one call (and one CUDA graph) serves mixed requests.
Talker: fp32 logits -> repetition penalty over the row's generated c0 -> EOS blocked while fewer than
`min_new_tokens` frames were generated -> control ids suppressed -> temperature -> top-k -> top-p ->
inverse-CDF draw with a uniform (greedy rows: argmax after the first three processors).
Code predictor: temperature -> top-k -> top-p -> draw, nothing else.
Three equivalent implementations of temperature -> top-k -> top-p -> draw, picked by a host-side
`mode` of the `SamplingTensors` (static, so each is graph-capturable): FULL sorts the vocabulary
twice (any parameters: the reference); TOPK takes the k-th largest from `topk(TOPK_CAP)` and skips
top-p (valid when every row has top_p >= 1 and, unless greedy, 1 <= top_k <= TOPK_CAP); GREEDY is
a plain argmax (valid when every row is greedy with top_p >= 1). `sampling_mode` picks the cheapest
valid one from the rows' Python values.
Uniforms come from `uniforms(seeds, counters)`: a splitmix64 hash on the device (one kernel, or int64 tensor
ops), no host RNG, so a sequence's draws depend only on its seed and frame index.
Batch invariance (EngineConfig.batch_invariant): given a row's logits, its draw depends on no other row.
The processors are elementwise; argmax, amax, sort and topk select (exact in any order); softmax and
cumsum reduce within a row, torch's CUDA kernels in a per-row order set by the vocabulary size alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import dataclasses
from dataclasses import dataclass

import torch

from q3tts import kernels
from q3tts.core import SamplingParams

NUM_UNIFORMS = 16  # column 0: talker c0; column g: code group g (1..15)
UniformSource = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

FULL, TOPK, GREEDY = "full", "topk", "greedy"  # sampling modes, slowest (always valid) first
TOPK_CAP = 64  # static k of the TOPK mode's torch.topk


def row_mode(greedy: bool, top_k: int, top_p: float) -> str:
    """The cheapest mode valid for one row's parameters (see the module docstring)."""
    if top_p < 1:
        return FULL  # top-p can drop tied maxima (even of a greedy row): needs the sorted row
    if greedy:
        return GREEDY
    return TOPK if 1 <= top_k <= TOPK_CAP else FULL


def sampling_mode(modes) -> str:
    """The cheapest mode valid for every row, given each row's `row_mode`."""
    modes = set(modes)
    return FULL if FULL in modes else TOPK if TOPK in modes else GREEDY


GRAPH_VARIANTS = (TOPK, FULL)  # the modes captured graphs are made in (GREEDY rows take TOPK's)


def graph_variant(modes) -> str:
    """The captured variant (of GRAPH_VARIANTS) that serves rows of these `row_mode`s."""
    return FULL if sampling_mode(modes) == FULL else TOPK


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row parameters, all `[B]`: temperature f32, top_k i64 (0 = off), top_p f32,
    repetition_penalty f32, greedy bool."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    repetition_penalty: torch.Tensor
    greedy: torch.Tensor
    # host-side, static: which implementation warp_and_draw runs (FULL unless the builder knows better)
    mode = FULL  # not annotated: not a dataclass field

    def with_mode(self, mode: str) -> SamplingTensors:
        """The same tensors with `mode` (the caller vouches that it is valid for every row)."""
        assert mode in (FULL, TOPK, GREEDY), mode
        out = dataclasses.replace(self)
        object.__setattr__(out, "mode", mode)
        return out

    @classmethod
    def talker(cls, params: Sequence[SamplingParams], device: torch.device | str = "cpu"
               ) -> SamplingTensors:
        """The first-codebook parameters of each request."""
        return cls._build([(p.temperature, p.top_k, p.top_p, p.repetition_penalty, p.greedy)
                           for p in params], device)

    @classmethod
    def subtalker(cls, params: Sequence[SamplingParams], device: torch.device | str = "cpu"
                  ) -> SamplingTensors:
        """The code-predictor parameters of each request (no repetition penalty)."""
        return cls._build([(p.subtalker_temperature, p.subtalker_top_k, p.subtalker_top_p, 1.0,
                            p.cp_greedy) for p in params], device)

    @classmethod
    def _build(cls, rows: list[tuple], device) -> SamplingTensors:
        temp, top_k, top_p, rep, greedy = zip(*rows)
        f32 = dict(dtype=torch.float32, device=device)
        out = cls(torch.tensor(temp, **f32), torch.tensor(top_k, dtype=torch.int64, device=device),
                  torch.tensor(top_p, **f32), torch.tensor(rep, **f32),
                  torch.tensor(greedy, dtype=torch.bool, device=device))
        # decided on the float32 top_p the tensors hold, as the processors see it
        top_p32 = torch.tensor(top_p, dtype=torch.float32).tolist()
        return out.with_mode(sampling_mode(row_mode(bool(g), int(k), p)
                                           for g, k, p in zip(greedy, top_k, top_p32)))


# ---------------------------------------------------------------- processors, each [B, V] -> [B, V]

def apply_repetition_penalty(logits: torch.Tensor, generated: torch.Tensor,
                             penalty: torch.Tensor) -> torch.Tensor:
    """s/p if s > 0 else s*p, on ids in the row's history. generated [B, V] bool, penalty [B]."""
    p = penalty[:, None]
    penalized = torch.where(logits > 0, logits / p, logits * p)
    return torch.where(generated, penalized, logits)


def block_eos(logits: torch.Tensor, num_generated: torch.Tensor, eos_id: int,
              min_new_tokens: int) -> torch.Tensor:
    """EOS logit = -inf on rows with fewer than `min_new_tokens` generated (num_generated [B])."""
    blocked = (num_generated < min_new_tokens)[:, None]  # [B, 1]
    is_eos = torch.arange(logits.shape[-1], device=logits.device)[None, :] == eos_id  # [1, V]
    return logits.masked_fill(blocked & is_eos, float("-inf"))


def suppress_range(logits: torch.Tensor, start: int, keep_id: int) -> torch.Tensor:
    """ids >= start are -inf, except `keep_id`."""
    ids = torch.arange(logits.shape[-1], device=logits.device)
    return logits.masked_fill(((ids >= start) & (ids != keep_id))[None, :], float("-inf"))


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor,
                      greedy: torch.Tensor) -> torch.Tensor:
    return logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None]


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep scores >= the row's k-th largest (ties kept); top_k 0 or >= V = off."""
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))  # [B]
    sorted_desc = logits.sort(dim=-1, descending=True).values  # [B, V]
    kth = sorted_desc.gather(-1, (k - 1)[:, None])  # [B, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """HF nucleus: drop the ascending-sorted prefix whose cumulative mass <= 1 - top_p (keep >= 1)."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False)  # [B, V]
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [B, V]
    remove = cum <= (1 - top_p)[:, None]
    remove[:, -1] = False
    mask = remove.scatter(-1, sorted_idx, remove)
    return logits.masked_fill(mask, float("-inf"))


def draw(logits: torch.Tensor, u: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw of one id per row from softmax(logits) with `u [B]` in [0, 1); greedy rows
    take the argmax. Returns [B] int64."""
    probs = logits.softmax(dim=-1)  # [B, V]
    cdf = probs.cumsum(dim=-1)  # [B, V]
    target = (u.to(cdf.dtype) * cdf[:, -1])[:, None]  # [B, 1]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)  # [B]
    last_nonzero = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(-1)  # [B]
    sampled = torch.minimum(idx, last_nonzero)
    return torch.where(greedy, logits.argmax(dim=-1), sampled)


def apply_top_k_capped(logits: torch.Tensor, top_k: torch.Tensor, cap: int) -> torch.Tensor:
    """`apply_top_k` for rows with 1 <= top_k <= cap: the k-th largest comes from `topk(cap)` (exact
    copies of the row's values, so the same threshold, ties kept) instead of a full sort. Rows with
    top_k outside that range get some threshold: only valid where the result is not used (greedy)."""
    cap = min(cap, logits.shape[-1])
    top = logits.topk(cap, dim=-1).values  # [B, cap], descending
    kth = top.gather(-1, (top_k.clamp(1, cap) - 1)[:, None])  # [B, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def nonfinite_rows(scores: torch.Tensor) -> torch.Tensor:
    """[B] bool: rows with no usable candidate — a NaN or +inf anywhere, or every score -inf.

    One reduction: amax propagates NaN, is +inf when any score is, and -inf when all are."""
    return ~torch.isfinite(scores.amax(dim=-1))


def guard_ids(ids: torch.Tensor, bad: torch.Tensor, faults: torch.Tensor | None) -> torch.Tensor:
    """The finite guard: `bad` rows [B] get id 0 (valid in every talker, code-predictor and codec table,
    so no embedding or gather downstream can read out of bounds, on any device) and are or-ed into
    `faults` [B] bool (in place, graph-safe) so the engine can end exactly those rows with an error."""
    if faults is not None:
        faults |= bad
    return torch.where(bad, torch.zeros_like(ids), ids)


def warp_and_draw(logits: torch.Tensor, params: SamplingTensors, u: torch.Tensor,
                  faults: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """temperature -> top-k -> top-p -> draw (the shared tail of both samplers), by `params.mode`,
    then the finite guard (`guard_ids`): a row whose scores are not finite after temperature (NaN
    activations, a non-finite or extreme parameter) draws id 0 and is flagged in `faults`. Returns
    ids [B] int64, written into `out` [B] (a strided view may do) when given.

    TOPK equals FULL on its rows: with top_p >= 1 the nucleus step only masks ids whose probability
    is already 0, which the draw never picks. GREEDY equals FULL on its rows: temperature is 1,
    top-k keeps every copy of the maximum and top-p (>= 1) keeps it too, so argmax is unchanged.
    Where the kernels serve fp32 logits, GREEDY and TOPK are one launch of the sampling kernel
    (kernels/code_predictor_sampling.py) instead of ~20 torch ops (`warp_and_draw_reference`)."""
    if logits.dtype == torch.float32 and _kernel_draws(logits, params):
        return _kernel_draw(logits, params, u, faults, out=out)
    ids = warp_and_draw_reference(logits, params, u, faults)
    return ids if out is None else out.copy_(ids)


def _kernel_draws(logits: torch.Tensor, params: SamplingTensors) -> bool:
    """Whether the sampling kernel draws from `logits`: GREEDY and TOPK modes where the kernels serve them."""
    return params.mode != FULL and kernels.use_triton(logits)


def _kernel_draw(logits: torch.Tensor, params: SamplingTensors, u: torch.Tensor, faults: torch.Tensor | None,
                 out: torch.Tensor | None = None, talker=None) -> torch.Tensor:
    """The sampling kernel's draw from fp32 `logits` (talker: `TalkerScores`, its processors run first)."""
    from q3tts.kernels.code_predictor_sampling import sample  # imports triton

    return sample(logits, params.temperature, params.top_k, params.greedy, u, params.mode == TOPK, TOPK_CAP,
                  out=out, faults=faults, talker=talker)


def warp_and_draw_reference(logits: torch.Tensor, params: SamplingTensors, u: torch.Tensor,
                            faults: torch.Tensor | None = None) -> torch.Tensor:
    """`warp_and_draw` in torch ops, on any device: the sampling kernel's reference."""
    if params.mode == GREEDY:
        return guard_ids(logits.argmax(dim=-1), nonfinite_rows(logits), faults)
    logits = apply_temperature(logits, params.temperature, params.greedy)
    bad = nonfinite_rows(logits)
    if params.mode == TOPK:
        ids = draw(apply_top_k_capped(logits, params.top_k, TOPK_CAP), u, params.greedy)
    else:
        ids = draw(apply_top_p(apply_top_k(logits, params.top_k), params.top_p), u, params.greedy)
    return guard_ids(ids, bad, faults)


@dataclass(frozen=True)
class TalkerRules:
    """Codec-id constants of the talker processors (from the config)."""

    eos_id: int
    suppress_start: int  # vocab_size - 1024: control/language/speaker ids
    min_new_tokens: int = 2


def sample_talker(logits: torch.Tensor, params: SamplingTensors, rules: TalkerRules,
                  generated: torch.Tensor, num_generated: torch.Tensor,
                  u: torch.Tensor, faults: torch.Tensor | None = None) -> torch.Tensor:
    """First-codebook draw. logits [B, V] (any float dtype); generated [B, V] bool history mask;
    num_generated [B] int; u [B]. Returns c0 [B] int64: always a speech id (< suppress_start) or EOS —
    a non-finite row draws speech id 0 (valid for the codec too: never EOS, which a prefill row may not
    draw and the codec cannot embed) and is flagged in `faults` [B] bool (see `warp_and_draw`).
    Where `warp_and_draw` would run the sampling kernel, the processors run inside it (one launch)."""
    if _kernel_draws(logits, params):
        from q3tts.kernels.code_predictor_sampling import TalkerScores  # imports triton

        return _kernel_draw(logits.float(), params, u, faults,
                            talker=TalkerScores(generated, params.repetition_penalty, num_generated, rules.eos_id,
                                                rules.min_new_tokens, rules.suppress_start))
    scores = apply_repetition_penalty(logits.float(), generated, params.repetition_penalty)
    scores = block_eos(scores, num_generated, rules.eos_id, rules.min_new_tokens)
    scores = suppress_range(scores, rules.suppress_start, rules.eos_id)
    return warp_and_draw(scores, params, u, faults=faults)


class SubtalkerSampler:
    """Code-predictor sampler: `sampler(logits [B, V], group, out=None) -> ids [B]` using `u[:, group]`
    (written into `out` [B] when given).

    Rows whose scores were not finite draw id 0 and are or-ed into `faults` [B] bool when given."""

    def __init__(self, params: SamplingTensors, u: torch.Tensor, faults: torch.Tensor | None = None):
        self.params = params
        self.u = u  # [B, NUM_UNIFORMS]
        self.faults = faults

    def __call__(self, logits: torch.Tensor, group: int,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        return warp_and_draw(logits.float(), self.params, self.u[:, group], faults=self.faults, out=out)


# ---------------------------------------------------------------- counter-based uniforms

def uniforms(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """[B, 16] float32 uniforms in [0, 1) for (seed, counter) pairs (seeds, counters: [B] int64): a splitmix64
    hash (`kernels.uniforms`: one launch where the kernels serve, else int64 torch ops; the same bits)."""
    return kernels.uniforms(seeds, counters, NUM_UNIFORMS)
