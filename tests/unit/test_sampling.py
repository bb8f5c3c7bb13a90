"""Sampling processors against hand-computed expectations, and the counter-based uniforms."""

from __future__ import annotations

import torch

from q3tts.engine.api import SamplingParams
from q3tts.sampling import (
    SamplingTensors,
    TalkerRules,
    apply_repetition_penalty,
    apply_top_k,
    apply_top_p,
    block_eos,
    draw,
    sample_talker,
    suppress_range,
    uniforms,
)

NEG = float("-inf")


def test_repetition_penalty_divides_positive_multiplies_negative():
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    out = apply_repetition_penalty(logits, torch.tensor([[True, True, False]]), torch.tensor([2.0]))
    assert out.tolist() == [[1.0, -4.0, 1.0]]


def test_block_eos_and_suppression():
    logits = torch.zeros(2, 6)
    out = block_eos(logits, torch.tensor([1, 2]), eos_id=4, min_new_tokens=2)
    assert out[0, 4] == NEG and out[1, 4] == 0
    out = suppress_range(torch.zeros(1, 6), start=3, keep_id=4)
    assert out.tolist() == [[0, 0, 0, NEG, 0, NEG]]


def test_top_k_keeps_ties_and_zero_disables():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [1.0, 3.0, 3.0, 2.0]])
    out = apply_top_k(logits, torch.tensor([1, 0]))
    assert out[0].tolist() == [NEG, 3.0, 3.0, NEG]
    assert out[1].tolist() == logits[1].tolist()


def test_top_p_matches_hf_rule():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    out = apply_top_p(probs.log(), torch.tensor([0.75]))  # drops the 0.05 + 0.15 tail
    assert torch.isinf(out[0, 2:]).all() and torch.isfinite(out[0, :2]).all()
    assert torch.equal(apply_top_p(probs.log(), torch.tensor([1.0])), probs.log())


def test_draw_inverse_cdf_and_greedy():
    logits = torch.tensor([[0.25, 0.25, 0.5]]).log().repeat(3, 1)
    got = draw(logits, torch.tensor([0.1, 0.3, 0.9]), torch.tensor([False, False, False]))
    assert got.tolist() == [0, 1, 2]
    assert draw(logits, torch.tensor([0.1, 0.1, 0.1]), torch.ones(3, dtype=torch.bool)).tolist() == [2] * 3
    masked = torch.tensor([[0.0, NEG, NEG]])
    assert draw(masked, torch.tensor([0.999999]), torch.tensor([False])).item() == 0


def test_sample_talker_order_blocks_eos_and_control_ids():
    params = SamplingTensors.talker([SamplingParams(greedy=True)])
    logits = torch.zeros(1, 3072)
    logits[0, 2150], logits[0, 3000] = 10.0, 20.0
    rules = TalkerRules(eos_id=2150, suppress_start=2048)
    no_hist = torch.zeros(1, 3072, dtype=torch.bool)
    early = sample_talker(logits, params, rules, no_hist, torch.tensor([1]), torch.zeros(1))
    assert early.item() < 2048
    late = sample_talker(logits, params, rules, no_hist, torch.tensor([2]), torch.zeros(1))
    assert late.item() == 2150


def test_rows_are_independent_in_a_batch():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingTensors.subtalker([SamplingParams(top_k=5), SamplingParams(greedy=True),
                                        SamplingParams(temperature=0.5, top_p=0.7)])
    u = torch.tensor([0.2, 0.5, 0.8])
    from q3tts.sampling import warp_and_draw  # noqa: PLC0415

    batched = warp_and_draw(logits, params, u)
    for i in range(3):
        row = SamplingTensors(*(getattr(params, f)[i:i + 1] for f in params.__dataclass_fields__))
        assert warp_and_draw(logits[i:i + 1], row, u[i:i + 1]).item() == batched[i].item()


def test_uniforms_depend_only_on_seed_and_counter():
    u = uniforms(torch.tensor([1, 2, 1]), torch.tensor([5, 5, 5]))
    assert u.shape == (3, 16) and u.dtype == torch.float32
    assert torch.equal(u[0], u[2]) and not torch.equal(u[0], u[1])
    assert torch.equal(uniforms(torch.tensor([2]), torch.tensor([5]))[0], u[1])
    big = uniforms(torch.arange(4096), torch.zeros(4096, dtype=torch.int64))
    assert 0.0 <= big.min() and big.max() < 1.0
    assert abs(big.mean().item() - 0.5) < 0.01
