"""GPU: the code-predictor kernels and the fused predictor at the real 1.7B shapes (hidden 1024,
16/8 heads x 128, intermediate 3072, codebook 2048, projection from 2048), tuned launch configs.

Kernels vs their references (same checks as the interpreter tests: poisoned outputs, counters left
zero, tolerance from the dtype); the fused passes vs the eager ones (fp32: the same greedy codes;
bf16, teacher-forced: no further from fp32 than the eager bf16 passes); graph replay == eager; a
row's codes do not depend on the batch around it; no compile after the first call, whatever the
batch size.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from code_predictor_cases import (REAL, AttentionFrame, Inputs, assert_as_faithful, check_gather,
                                  check_gemms, forced_logits)
from q3tts.engine.chain_tuning import FrameInputs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def cpk():
    from q3tts.kernels import code_predictor

    return code_predictor


def _bench():
    """perf/bench_code_predictor.py: the real-size model builder, frame inputs, graph capture."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))
    import bench_code_predictor

    return bench_code_predictor


@pytest.fixture(scope="module")
def code_predictor_fp32():
    return _bench().random_code_predictor("full", torch.float32, "cuda")


@pytest.mark.parametrize("rows", [1, 64])
def test_gemm_kernels_at_real_shapes(cpk, rows):
    check_gemms(cpk, REAL, rows, BF16, Inputs("cuda", 1, rows), None)


@pytest.mark.parametrize("bsz", [1, 64])
def test_qkv_attention_at_real_shapes(cpk, bsz):
    frame = AttentionFrame(cpk, REAL, bsz, BF16, Inputs("cuda", 2, bsz))
    frame.run_frame(None, passes=((0, 2), *((pos, 1) for pos in range(2, REAL.positions))))


@pytest.mark.parametrize("bsz", [1, 16])
def test_qkv_attention_gathers_its_rows_by_id_at_real_shapes(cpk, bsz):
    """On each launch config the tuner may pick: the gathering launch is tuned under a key of its own, so with
    config=None the two sides may sum their K slices differently (16 rows failed so on an H100)."""
    from q3tts.kernels.code_predictor_attention import qkv_candidates

    qkv_shape = ((REAL.heads + 2 * REAL.kv_heads) * REAL.head_dim, REAL.hidden)
    for config in qkv_candidates(torch.empty(qkv_shape, dtype=BF16, device="cuda"), REAL.head_dim):
        check_gather(cpk, REAL, bsz, BF16, Inputs("cuda", 4, bsz), config)


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=str)
def test_next_input_sum_is_torchs_cuda_sum(cpk, dtype):
    """embed_sum at the 1.7B's shapes (64 rows, 15 tables [2048, 2048]) gives the bits of the eager
    torch.stack(rows, 1).sum(1) on the GPU (the order kernels/code_predictor_embed.py says torch takes)."""
    inp = Inputs("cuda", 5)
    first, tables = inp.randn(64, 2048, dtype=dtype), tuple(inp.randn(2048, 2048, dtype=dtype) for _ in range(15))
    ids = torch.randint(0, 2048, (64, 15), generator=inp.gen, device="cuda")
    want = torch.stack([first] + [t[ids[:, g]] for g, t in enumerate(tables)], 1).sum(1)
    assert torch.equal(cpk.embed_sum(first, tables, ids), want)


def _inputs(cp, bsz: int, greedy: bool, seed: int = 0):
    return FrameInputs(cp, bsz, greedy, seed)


@torch.no_grad()
def test_fused_fp32_gives_the_eager_greedy_codes(code_predictor_fp32):
    from q3tts.models.code_predictor_fused import FusedCodePredictor

    cp = code_predictor_fp32
    inputs = _inputs(cp, 8, greedy=True)
    want_codes, want_next = inputs.run(cp.generate)
    got_codes, got_next = inputs.run(FusedCodePredictor(cp).generate)
    assert torch.equal(got_codes, want_codes)
    torch.testing.assert_close(got_next, want_next, rtol=0, atol=0)


@torch.no_grad()
def test_fused_bf16_is_as_close_to_fp32_as_the_eager_bf16_passes(code_predictor_fp32):
    """256 rows, all 15 passes teacher-forced to the same random codes (ForcedDraws): the fused
    bf16 logits are no further from the fp32 eager logits than the eager bf16 logits are.

    Not free-running greedy codes: there one flipped near-tie changes every later pass's input, and
    on 64 rows the eager bf16 passes' agreement with fp32 moves by 3.5 points (standard
    deviation; -4.9 to +8.8 over 10 seeds, random 1.7B weights) when only the order of fp32
    accumulation or the attention's bf16 rounding of probabilities changes. Forced, 3,840
    independent argmaxes put the 2-point margin at about 3 standard errors."""
    import copy

    from q3tts.models.code_predictor_fused import FusedCodePredictor

    cp32 = code_predictor_fp32
    cp16 = copy.deepcopy(cp32).to(BF16)
    inputs = _inputs(cp32, 256, greedy=True)
    codes = torch.randint(0, cp32.lm_head[0].out_features, (256, 15), device="cuda",
                          generator=torch.Generator("cuda").manual_seed(0))
    ref = forced_logits(cp32.generate, inputs.past_hidden, inputs.c0, codes)
    args = (inputs.past_hidden.to(BF16), inputs.c0, codes)
    eager = forced_logits(cp16.generate, *args)
    fused = forced_logits(FusedCodePredictor(cp16).generate, *args)
    assert_as_faithful(fused, eager, ref)


def _check_replays(fused, inputs, graph, out, seeds) -> None:
    """Replays of `graph` (the fused passes captured on `inputs`, outputs `out`) with the past hidden and c0 of
    fresh sampled inputs per seed give the eager fused call's codes and next input bit for bit."""
    cp, bsz = fused.cp, inputs.c0.shape[0]
    for seed in seeds:
        fresh = _inputs(cp, bsz, greedy=False, seed=seed)
        inputs.past_hidden.copy_(fresh.past_hidden)
        inputs.c0.copy_(fresh.c0)
        graph.replay()
        want_codes, want_next = fresh.run(fused.generate)
        assert torch.equal(out[0], want_codes) and torch.equal(out[1], want_next), f"seed {seed}"


@pytest.fixture(scope="module")
def fused_bf16(code_predictor_fp32):
    import copy

    from q3tts.models.code_predictor_fused import FusedCodePredictor

    cp = copy.deepcopy(code_predictor_fp32).to(BF16)
    return cp, FusedCodePredictor(cp)


@torch.no_grad()
def test_fused_graph_replay_equals_eager_and_nothing_compiles_after_warmup(fused_bf16):
    """After one call in each row class (the engine runs every graph bucket eagerly before capturing it), no
    batch size compiles anything: the launches take their batch as a runtime value, never specialised on."""
    import triton

    cp, fused = fused_bf16
    compiled: list[tuple[str, str]] = []  # (kernel, specialisation key) of every compile
    old = triton.knobs.runtime.jit_cache_hook
    triton.knobs.runtime.jit_cache_hook = \
        lambda *, fn, **kw: compiled.append((fn.name, str(kw.get("key")))) or False
    try:
        _inputs(cp, 64, greedy=True).run(fused.generate)  # the GREEDY draw's variant compiled too
        inputs = _inputs(cp, 64, greedy=False)  # the largest batch first: buffers never grow later
        graph, out = _bench().capture_with_outputs(lambda: inputs.run(fused.generate))
        _check_replays(fused, inputs, graph, out, seeds=(1, 2))
        # row classes 32 and 16 (code_predictor_gemm.row_class): their own tuned configs; 1 row: FEW_ROWS, its
        # own variants (`held_rows`)
        for bsz in (17, 16, 1):
            _inputs(cp, bsz, greedy=False).run(fused.generate)
        warm = len(compiled)
        for bsz in (1, 2, 3, 5, 24, 64):
            _inputs(cp, bsz, greedy=bsz % 2 == 0).run(fused.generate)
        torch.cuda.synchronize()
    finally:
        triton.knobs.runtime.jit_cache_hook = old
    late = compiled[warm:]
    seen = {name: [k for n, k in compiled[:warm] if n == name] for name, _ in late}
    assert late == [], f"kernels compiled after the first calls: {late}; the warm-up's: {seen}"


@torch.no_grad()
def test_a_rows_codes_do_not_depend_on_the_batch(fused_bf16):
    """Batch invariance: rows run alone give bit-identical codes and next input to the same rows
    among 16 others (under kernels.set_batch_invariant: fixed row blocks, launch configs chosen per
    weight shape, whatever row classes earlier tests tuned)."""
    from q3tts import kernels

    cp, fused = fused_bf16
    kernels.set_batch_invariant(True)
    try:
        batch = _inputs(cp, 16, greedy=False, seed=5)
        codes, nxt = batch.run(fused.generate)
        for row in (0, 9, 15):
            alone = _inputs(cp, 1, greedy=False)
            alone.past_hidden.copy_(batch.past_hidden[row:row + 1])
            alone.c0.copy_(batch.c0[row:row + 1])
            alone.sampler.u.copy_(batch.sampler.u[row:row + 1])
            alone_codes, alone_next = alone.run(fused.generate)
            assert torch.equal(alone_codes[0], codes[row]) and torch.equal(alone_next[0], nxt[row])
    finally:
        kernels.set_batch_invariant(False)


@torch.no_grad()
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs compute capability >= 9")
@pytest.mark.parametrize("bsz", [1, 16])
def test_programmatic_launch_gives_the_plain_launches_bits(fused_bf16, bsz):
    """kernels.set_programmatic_launch: the 15 passes captured in a graph with PDL (each kernel starts while
    the one before runs, holding its weight tile) give the plain launches' codes and next input bit for bit,
    over replays with new inputs (a kernel reading its input before the previous one finished would differ)."""
    from q3tts import kernels

    cp, fused = fused_bf16
    _inputs(cp, 64, greedy=False).run(fused.generate)  # buffers for the largest batch first
    kernels.set_programmatic_launch(True)
    try:
        inputs = _inputs(cp, bsz, greedy=False)
        inputs.run(fused.generate)  # compile and tune the PDL variants outside the capture
        graph, out = _bench().capture_with_outputs(lambda: inputs.run(fused.generate))
    finally:
        kernels.set_programmatic_launch(False)
    _check_replays(fused, inputs, graph, out, seeds=range(1, 9))
