"""Sampling processors against hand-computed expectations, and the counter-based uniforms."""

from __future__ import annotations

import torch

from q3tts.core import SamplingParams
from q3tts.models.sampling import (
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
    from q3tts.models.sampling import warp_and_draw  # noqa: PLC0415

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


def _modes_agree(logits, params, u):
    """warp_and_draw in every mode valid for `params` equals the FULL (two-sort) reference."""
    from q3tts.models.sampling import FULL, warp_and_draw  # noqa: PLC0415

    ref = warp_and_draw(logits, params.with_mode(FULL), u)
    got = warp_and_draw(logits, params, u)
    assert torch.equal(got, ref), (params.mode, got, ref)
    return ref


def test_topk_mode_equals_full_sort_on_random_logits():
    from q3tts.models.sampling import TOPK, TOPK_CAP  # noqa: PLC0415

    gen = torch.Generator().manual_seed(0)
    for vocab, scale in ((2048, 3.0), (3072, 0.05), (50, 1.0)):
        rows = [SamplingParams(temperature=t, top_k=k, greedy=g)
                for t, k, g in ((0.9, 50, False), (1.3, 1, False), (0.7, TOPK_CAP, False),
                                (1.0, 7, False), (0.9, 50, True), (0.5, 0, True), (2.0, 2, False))]
        params = SamplingTensors.subtalker([SamplingParams(subtalker_temperature=p.temperature,
                                                           subtalker_top_k=p.top_k, greedy=p.greedy)
                                            for p in rows])
        assert params.mode == TOPK
        for trial in range(20):
            logits = torch.randn(len(rows), vocab, generator=gen) * scale
            if trial % 2:  # bf16 logits: many exact ties, also at the k-th value
                logits = logits.bfloat16().float()
            u = torch.rand(len(rows), generator=gen)
            _modes_agree(logits, params, u)
    # ties wider than the cap at the k-th value: all of them stay candidates, as in the full sort
    flat = torch.zeros(2, 300)
    flat[:, :3] = 1.0
    params = SamplingTensors.subtalker([SamplingParams(subtalker_top_k=5)] * 2)
    for uu in (0.0, 0.3, 0.6, 0.99):
        got = _modes_agree(flat, params, torch.full((2,), uu))
        assert got.max() < 300


def test_greedy_mode_equals_full_and_mode_selection():
    from q3tts.models.sampling import FULL, GREEDY, TOPK  # noqa: PLC0415

    gen = torch.Generator().manual_seed(1)
    params = SamplingTensors.talker([SamplingParams(greedy=True, top_k=k) for k in (0, 3, 100)])
    assert params.mode == GREEDY
    for _ in range(10):
        logits = (torch.randn(3, 3072, generator=gen)).bfloat16().float()
        logits[:, 5] = logits.max()  # a tied maximum: argmax takes the first copy in every mode
        _modes_agree(logits, params, torch.rand(3, generator=gen))
    mode = lambda ps: SamplingTensors.talker(ps).mode  # noqa: E731
    assert mode([SamplingParams(), SamplingParams(greedy=True)]) == TOPK
    assert mode([SamplingParams(), SamplingParams(top_k=0)]) == FULL
    assert mode([SamplingParams(top_k=65)]) == FULL
    assert mode([SamplingParams(top_p=0.9)]) == FULL
    assert mode([SamplingParams(greedy=True, top_p=0.9)]) == FULL  # top-p may drop a tied max
    # FULL rows in a batch still match their single-row results
    mixed = SamplingTensors.talker([SamplingParams(top_k=0, top_p=0.8), SamplingParams()])
    logits = torch.randn(2, 3072, generator=gen)
    _modes_agree(logits, mixed, torch.rand(2, generator=gen))


def test_sample_talker_modes_agree():
    from q3tts.models.sampling import FULL  # noqa: PLC0415

    gen = torch.Generator().manual_seed(2)
    rules = TalkerRules(eos_id=2150, suppress_start=2048)
    for greedy in (False, True):
        params = SamplingTensors.talker([SamplingParams(greedy=greedy, repetition_penalty=1.05)] * 4)
        for _ in range(10):
            logits = torch.randn(4, 3072, generator=gen).bfloat16().float()
            hist = torch.rand(4, 3072, generator=gen) < 0.01
            n = torch.tensor([0, 1, 2, 30])
            u = torch.rand(4, generator=gen)
            got = sample_talker(logits, params, rules, hist, n, u)
            ref = sample_talker(logits, params.with_mode(FULL), rules, hist, n, u)
            assert torch.equal(got, ref)
