"""The sampler's finite guard: whatever the logits or parameters, every drawn id is a valid id, and the
rows that went non-finite (and only those) are flagged so the engine can end them with an error."""

from __future__ import annotations

import pytest
import torch

from q3tts.core import SamplingParams
from q3tts.models.sampling import (FULL, GREEDY, TOPK, SamplingTensors, SubtalkerSampler, TalkerRules,
                                   sample_talker, warp_and_draw)

NAN, INF = float("nan"), float("inf")
V = 40  # vocabulary of these tests
RULES = TalkerRules(eos_id=V - 8, suppress_start=V - 10)


def _params(rows: list[SamplingParams], mode: str) -> SamplingTensors:
    return SamplingTensors.talker(rows).with_mode(mode)


def _healthy(n: int, greedy: bool) -> list[SamplingParams]:
    return [SamplingParams(greedy=greedy, temperature=0.7 + 0.1 * i, top_k=5 + i) for i in range(n)]


# (what breaks the row, a sampling-parameter change or a logits change) -> the row must be flagged.
# (An infinite temperature gives finite all-zero scores, a uniform draw: host validation refuses it.)
POISONS = {
    "temperature nan": (dict(temperature=NAN), None),
    "temperature tiny": (dict(temperature=1e-45), None),
    "temperature -0": (dict(temperature=-0.0), None),
    "logits nan": ({}, NAN),
    "logits +inf": ({}, INF),
    "logits all -inf": ({}, -INF),
}


@pytest.mark.parametrize("mode", [FULL, TOPK])
@pytest.mark.parametrize("poison", list(POISONS))
def test_poisoned_row_draws_id_0_is_flagged_and_leaves_the_others_alone(mode, poison):
    change, fill = POISONS[poison]
    gen = torch.Generator().manual_seed(hash(poison) % 1000)
    logits = torch.randn(4, V, generator=gen)
    u = torch.rand(4, generator=gen)
    rows = _healthy(4, greedy=False)
    ref = warp_and_draw(logits, _params(rows, mode), u)  # all healthy
    rows[2] = SamplingParams(**{**vars(rows[2]), **change})
    if fill is not None:
        logits[2] = fill
    faults = torch.zeros(4, dtype=torch.bool)
    got = warp_and_draw(logits, _params(rows, mode), u, faults=faults)
    assert faults.tolist() == [False, False, True, False]
    assert got[2].item() == 0
    assert torch.equal(got[[0, 1, 3]], ref[[0, 1, 3]])


def test_greedy_mode_guards_nan_activations():
    logits = torch.randn(3, V)
    logits[1, 7] = NAN  # argmax would pick the NaN's index
    faults = torch.zeros(3, dtype=torch.bool)
    got = warp_and_draw(logits, _params(_healthy(3, greedy=True), GREEDY), torch.zeros(3), faults=faults)
    assert faults.tolist() == [False, True, False]
    assert got[1].item() == 0
    assert got[[0, 2]].tolist() == logits[[0, 2]].argmax(-1).tolist()


def test_guard_without_a_faults_tensor_still_returns_valid_ids():
    logits = torch.full((2, V), NAN)
    got = warp_and_draw(logits, _params(_healthy(2, greedy=False), FULL), torch.rand(2))
    assert got.tolist() == [0, 0]


@pytest.mark.parametrize("mode", [FULL, TOPK])
def test_talker_never_draws_a_suppressed_id_from_a_poisoned_row(mode):
    """Before the guard a NaN temperature made the inverse-CDF draw land on the last id (a control id
    the codec cannot embed: 'index out of range' on the CPU, a device-side assert on CUDA)."""
    logits = torch.randn(3, V)
    rows = _healthy(3, greedy=False)
    rows[0] = SamplingParams(temperature=NAN)
    faults = torch.zeros(3, dtype=torch.bool)
    hist = torch.zeros(3, V, dtype=torch.bool)
    c0 = sample_talker(logits, _params(rows, mode), RULES, hist, torch.tensor([5, 5, 5]), torch.rand(3),
                       faults=faults)
    assert faults.tolist() == [True, False, False]
    assert c0[0].item() == 0
    assert all(i < RULES.suppress_start or i == RULES.eos_id for i in c0.tolist())


def test_subtalker_sampler_accumulates_faults_over_groups():
    rows = _healthy(3, greedy=False)
    sampler = SubtalkerSampler(SamplingTensors.subtalker(rows), torch.rand(3, 16),
                               faults=torch.zeros(3, dtype=torch.bool))
    logits = torch.randn(3, V)
    sampler(logits, 1)
    assert not sampler.faults.any()
    logits[1, 3] = INF  # one group of one row goes bad
    assert sampler(logits, 2)[1].item() == 0
    sampler(torch.randn(3, V), 3)  # a later healthy group does not clear the flag
    assert sampler.faults.tolist() == [False, True, False]
