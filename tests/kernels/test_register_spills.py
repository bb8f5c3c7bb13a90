"""Kernels compiled for the H200 (sm_90) spill no registers (tests/kernels/sm90.py, run in a fresh interpreter
without TRITON_INTERPRET: it compiles, it does not interpret; the alignment a real launch specializes on).
The fused qkv kernels: every launch config their tuner times there (4 candidates of 132-SM split counts, each
kernel and token count; the code predictor's also at one row, which attends in one round of loads, and with its
rows gathered by id). The talker's next input (`embed_sum`: a tuple of 15 tables) and the uniforms. The draw
kernel: every warp count its tuner times. The decode attention: every config its tuner times. The row-normalising
GEMMs (norm + gate_up, norm + head): every config their tuner times, at one row and at 4; the one-row ones also
built as under programmatic launch (weight tiles held in registers across the wait). A spill puts a thread's
values in local memory, whose round trips every program of these kernels would wait on. The multi-row qkv
epilogues, read in the SASS: no layout conversion through shared memory."""

import pytest

pytest.importorskip("triton", reason="triton is not installed")
from sm90 import compiled  # noqa: E402


@pytest.fixture(scope="module")
def usage() -> dict[str, list[dict]]:
    return compiled("qkv")


def test_every_qkv_spec_compiles_once(usage):
    # 4 configs x (code predictor: T = 1 and 2 over 4 rows, T = 1 at one row, rows by id at 4 and at one;
    # talker at 4 rows and at one, each from the rows and from row statistics)
    assert len(usage) == 36 and all(len(kernels) == 1 for kernels in usage.values()), usage


def spilled(usage: dict[str, list[dict]]) -> dict[str, dict]:
    """The specs whose one kernel keeps values in local memory."""
    return {spec: k for spec, (k,) in usage.items() if k["stack"] > 0}


def test_no_qkv_spec_spills(usage):
    assert not spilled(usage), spilled(usage)


def test_no_draw_warp_candidate_spills():
    """The draw kernel's warp counts the tuner times (kernels/code_predictor_sampling.py `warp_candidates`):
    none spills (one warp does in TOPK mode, and with the talker's processors, on the talker's 4096-wide row, so
    it is not offered there)."""
    usage = compiled("sample")
    # the code predictor's 2048 (greedy and TOPK: 4 counts each) and the talker's 3072, a 4096-wide row (greedy: 3,
    # TOPK: 2), that one also with the talker's processors (greedy 2, TOPK 2: no one-warp program, which spills)
    assert len(usage) == 17, usage
    assert not spilled(usage), spilled(usage)


def test_the_small_step_kernels_compile_without_spilling():
    usage = compiled("small")
    assert {spec: [k["kernel"] for k in kernels] for spec, kernels in usage.items()} == \
        {"embed_sum": ["_embed_sum_kernel"], "uniforms": ["_uniforms_kernel"],
         "scatter_rows": ["_scatter_kernel"]}, usage
    assert not spilled(usage), spilled(usage)


def test_no_decode_attention_config_spills():
    """The decode attention's configs the tuner times (paged_attention._CANDIDATES), the talker's one launch and
    the two of paged_decode_attention, at the talker's heads over the engine's one-row block table: each compiles
    to its kernels and none spills."""
    usage = compiled("attention")
    assert len(usage) == 24, usage  # 12 configs x (one launch, two launches)
    assert all([k["kernel"] for k in kernels] == (["_attention_kernel"] if spec.startswith("talker") else
                                                  ["_decode_split_kernel", "_decode_reduce_kernel"])
               for spec, kernels in usage.items()), usage
    stack = {spec: [k["stack"] for k in kernels] for spec, kernels in usage.items() if any(k["stack"] for k in kernels)}
    assert not stack, stack


def test_no_norm_linear_config_spills():
    """norm + gate_up + SiLU and norm + head at the code predictor's and the talker's shapes, each config the tuner
    times, at one row (`held_rows`: its norm statistics over that row alone, one round of loads) and at 4."""
    usage = compiled("norm_linear")
    assert len(usage) == 32 and all([k["kernel"] for k in kernels] == ["_linear_kernel"]
                                    for kernels in usage.values()), usage  # 2 models x 2 kernels x 4 configs x 2
    assert not spilled(usage), spilled(usage)


def test_the_multi_row_qkv_epilogues_move_nothing_through_shared_memory(usage):
    """After its ticket the qkv epilogue over a row block (both models, every config, 4 rows) works on [BLOCK_M,
    HALF] head halves in the layout its loads give: no layout conversion through shared memory (b47a5a2 ran it on
    [BLOCK_M, 1, HALF] halves from a reshape: 40 barriers and 13 shared stores after the ticket instead of 3 and 1,
    2.5x the global loads, and the 16-row qkv launches of both models took 9 us more each on the H200). What is left
    is the ticket's broadcast (one shared store and load) and the attention's barrier. (The code predictor's
    one-token launches of several rows run the one-row epilogue in row programs instead: `spread`.)"""
    epilogues = {spec: k["after_ticket"] for spec, (k,) in usage.items()
                 if "rows=4" in spec and "T=1" not in spec}
    assert len(epilogues) == 12, epilogues  # 4 configs x (code predictor T = 2; talker x 2)
    moved = {spec: n for spec, n in epilogues.items() if n["BAR"] > 3 or n["STS"] > 1 or n["LDS"] > 1}
    assert not moved, moved


def test_no_held_tile_build_spills():
    """The one-row qkv and row-normalising GEMM launches built as under programmatic launch, where each program
    holds its whole weight tile in registers across the wait (`held_columns`, up to HOLD_MAX elements): none
    spills (4 configs x (code predictor qkv, gathered, talker qkv x 2; norm + gate_up, norm + head, o_proj and
    down of both models))."""
    usage = compiled("held")
    assert len(usage) == 48, usage
    assert not spilled(usage), spilled(usage)


def test_row_statistics_cost_the_row_block_builds_no_registers():
    """The talker's row-block (16-row) qkv and norm + gate_up builds under programmatic launch, each norm from row
    statistics (`stats_rstd`, every layer after the first) against the same build from its rows: none from
    statistics spills, and none takes more than 32 registers more (the statistics read as an [R, STATS] tile made
    the compiler normalise the rows in the dot operand's layout: the talker's qkv 157 -> 255 registers, two
    programs an SM)."""
    usage = compiled("held_block")
    from_stats = {spec: kernels for spec, kernels in usage.items() if " stats " in spec}
    # 4 configs x (qkv, norm + gate_up), each from statistics and from the rows
    assert len(usage) == 16 and len(from_stats) == 8, usage
    assert not spilled(from_stats), spilled(from_stats)
    costly = {spec: (k["regs"], usage[spec.replace(" stats ", " ")][0]["regs"])
              for spec, (k,) in from_stats.items() if k["regs"] > usage[spec.replace(" stats ", " ")][0]["regs"] + 32}
    assert not costly, costly
