"""engine/chain_tuning.py: the coordinate descent on a made-up cost (the GPU chain it times has no CPU form), the
candidates `kernels.autotune.pick` remembers for it, and when an engine chain-tunes (EngineConfig.chain_tune):
once per tuning table and part (the fused code predictor, the fused talker), only where the part is fused, at the
batches the config names and launch mode; the talker's chain over the engine's KV cache leaves its pages as it found
them; the marks a table holds, named for the benches' reports."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from q3tts.engine import Engine, EngineConfig, chain_tuning
from q3tts.engine.chain_tuning import ChainResult, CodePredictorPasses, DecodeInputs, TalkerDecode, descend
from q3tts.engine.timing import Startup
from q3tts.kernels import autotune
from q3tts.models.attention import PagedKVCache

CPU = torch.device("cpu")
# two keys whose best choices interact: b's best is 2 when a is 3, else 1
KEYS = {"a": (1, 2, 3), "b": (0, 1, 2)}


def cost(table) -> float:
    a, b = table["a"], table["b"]
    return 10.0 - 2 * a + (abs(b - 2) if a == 3 else abs(b - 1))


def test_descent_reaches_the_joint_best_and_logs_each_change():
    calls = []
    tuned, changes = descend(KEYS, {"a": 1, "b": 0}, lambda t: calls.append(dict(t)) or cost(t), 3, 0.01)
    assert tuned == {"a": 3, "b": 2} and cost(tuned) == 4.0
    assert len(changes) == 2 and changes[0].startswith("round 1: a: 1 -> 3")
    assert all(set(t) == {"a", "b"} for t in calls)


def test_a_change_must_win_by_the_margin_and_a_quiet_round_stops():
    flat = lambda t: 5.0 - 0.01 * t["a"]  # noqa: E731 - a's candidates 0.2 % apart
    calls = []
    tuned, changes = descend(KEYS, {"a": 1, "b": 0}, lambda t: calls.append(1) or flat(t), 5, 0.01)
    assert tuned == {"a": 1, "b": 0} and changes == []
    assert len(calls) == 1 + 2 + 1 + 2  # one round: per key the incumbent and its two rivals


def test_pick_remembers_the_candidates_of_every_key_it_is_asked_for(monkeypatch):
    monkeypatch.setattr(autotune, "_SEEN", {})
    monkeypatch.setattr(autotune, "_BEST", {("k2",): "y"})
    launched = []
    assert autotune.pick(("k1",), ["x", "z"], launched.append, CPU) == "x"  # CPU: no timing
    assert autotune.pick(("k2",), ["z", "y"], launched.append, CPU) == "y"  # a tuned key
    assert autotune.seen_candidates() == {("k1",): ("x", "z"), ("k2",): ("z", "y")} and not launched
    autotune.set_tuned(("k1",), "z")
    assert autotune.pick(("k1",), ["x", "z"], launched.append, CPU) == "z"


class FakeChain:
    """A chain whose warm-up asks for three keys as `pick` would (one with a single candidate) and whose time
    depends on the configs of two: "new" is faster at "y", "old" would be faster at "q"."""

    def warm_up(self):
        for key, cands in ((("new",), ("x", "y")), (("single",), ("s",)), (("old",), ("p", "q"))):
            autotune._SEEN.setdefault(key, cands)
            autotune._BEST.setdefault(key, cands[0])

    def times(self, table):
        for key, config in table.items():
            autotune.set_tuned(key, config)
        best = autotune.tuned_configs()
        ms = 2.0 - (best[("new",)] == "y") - 0.5 * (best[("old",)] == "q")
        return {1: ms, 16: 2 * ms}

    def restore(self):
        self.restored = True


def test_tune_on_descends_over_the_keys_the_chain_asks_for_first(monkeypatch):
    monkeypatch.setattr(autotune, "_BEST", {("old",): "p"})
    monkeypatch.setattr(autotune, "_SEEN", {("old",): ("p", "q")})  # asked for by other work before
    chain = FakeChain()
    result = chain_tuning.tune_on(chain)
    assert chain.restored
    assert autotune.tuned_configs() == {("old",): "p", ("new",): "y", ("single",): "s"}
    assert (result.keys, result.candidates) == (1, 2) and result.before == {1: 2.0, 16: 4.0}
    assert result.after == {1: 1.0, 16: 2.0} and result.changes == ["round 1: ('new',): x -> y (6.0000 -> 3.0000)"]


@pytest.mark.parametrize("fields, cp_batches, talker_batches", [
    ({}, (1, 16), (1, 16)), ({"fused_code_predictor": 4, "fused_talker": 2}, (1, 4), (1, 2)),
    ({"fused_code_predictor": 1}, (1,), (1, 16)), ({"fused_code_predictor": 64, "fused_talker": 64}, (1, 16), (1, 16)),
    ({"fused_code_predictor": 0, "fused_talker": 0}, (), ()), ({"chain_tune": False}, (), ()),
    ({"graph_batch_sizes": (1, 2, 4), "max_slots": 4}, (1, 4), (1, 4))])
def test_the_batches_an_engine_chain_tunes_at(fields, cp_batches, talker_batches):
    cfg = EngineConfig(**fields)
    assert cfg.chain_tune_batches(cfg.fused_code_predictor_batch) == cp_batches
    assert cfg.chain_tune_batches(cfg.fused_talker_batch) == talker_batches


def test_chain_tune_must_be_a_bool():
    with pytest.raises(ValueError, match="chain_tune must be true or false, got 'yes'"):
        EngineConfig(chain_tune="yes")


@pytest.fixture
def fake_tune(monkeypatch):
    """chain_tuning.tune replaced by a recorder that leaves the mark as the real one does; the process's table
    emptied for the test; the fused kernels serving the CPU (through the interpreter), as they serve CUDA."""
    monkeypatch.setattr(autotune, "_BEST", {})
    monkeypatch.setenv("Q3TTS_TRITON_ON_CPU", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = []

    def tune(part, batches):
        calls.append((part, batches))
        autotune.set_tuned(part.mark(batches), {b: 1.0 for b in batches})
        return ChainResult({1: 2.0, 2: 3.0}, {1: 1.0, 2: 2.5}, ["round 1: a change"], 1, 2)

    monkeypatch.setattr(chain_tuning, "tune", tune)
    return calls


def tiny_engine(ckpt, **fields) -> Engine:
    return Engine(ckpt, EngineConfig(device="cpu", dtype="float32", max_slots=2, num_pages=64, **fields))


def tuned_parts(calls) -> list[tuple[str, tuple]]:
    """(part name, batches) of each chain tuning the fake `tune` recorded."""
    return [(part.name, batches) for part, batches in calls]


def test_an_engine_chain_tunes_each_part_once_per_table(fake_tune, tiny_ckpt, tmp_path, caplog):
    pytest.importorskip("triton")  # the fused parts need it
    runner, startup = tiny_engine(tiny_ckpt).runner, Startup()
    assert runner.talker.code_predictor.fused is not None and runner.talker.fused is not None
    with caplog.at_level(logging.INFO, logger="q3tts.engine.start"):
        runner._chain_tune(startup)
    for name in ("code predictor", "talker"):
        assert (f"chain tuning of the {name}: 1 keys, 2 candidates; B=1 2.000 -> 1.000 ms, "
                "B=2 3.000 -> 2.500 ms; round 1: a change") in caplog.text
    # max_slots 2: the bucket 2; the talker's chain over the runner's own KV cache
    assert tuned_parts(fake_tune) == [("code predictor", (1, 2)), ("talker", (1, 2))]
    assert fake_tune[0][0].fused is runner.talker.code_predictor.fused
    talker = fake_tune[1][0]
    assert talker.fused is runner.talker.fused and talker.cache is runner.kv
    assert talker.width == runner.meta.max_pages  # block tables as wide as the step's: its split count
    assert "chain tuning" in startup.phases
    runner._chain_tune(startup)
    assert len(fake_tune) == 2  # the table holds both marks
    path = tmp_path / "tuning.pkl"
    autotune.save_tuned(path, CPU)
    autotune._BEST.clear()
    runner._chain_tune(startup)
    assert len(fake_tune) == 4  # a table without the marks: tuned again
    autotune._BEST.clear()
    assert autotune.load_tuned(path, CPU) == 2
    del autotune._BEST[fake_tune[1][0].mark((1, 2))]
    runner._chain_tune(startup)
    assert tuned_parts(fake_tune[4:]) == [("talker", (1, 2))]  # a table saved with the code predictor's only


@pytest.mark.parametrize("fields, parts", [
    ({"chain_tune": False}, []), ({"fused_code_predictor": 0}, ["talker"]), ({"fused_talker": 0}, ["code predictor"]),
    ({"fp32_residual": True}, []), ({"batch_invariant": True}, ["code predictor"])])
def test_no_chain_tuning_of_a_part_off_or_not_fused(fake_tune, tiny_ckpt, fields, parts, monkeypatch):
    """Off; a part not fused; fused parts that do not serve the step (an fp32 residual stream); the eager talker
    at every bucket (batch_invariant: its engine turns the kernels' process-wide switch on, undone after)."""
    monkeypatch.setattr(autotune, "_INVARIANT", [autotune.batch_invariant()])
    runner, startup = tiny_engine(tiny_ckpt, **fields).runner, Startup()
    runner._chain_tune(startup)
    assert [name for name, _ in tuned_parts(fake_tune)] == parts
    assert ("chain tuning" in startup.phases) == bool(parts)


def fake_cp(hidden: int, dtype=torch.bfloat16) -> CodePredictorPasses:
    """What CodePredictorPasses.mark reads of a FusedCodePredictor: its code predictor's sizes and head weight."""
    cfg = SimpleNamespace(hidden_size=hidden, intermediate_size=3 * hidden, num_layers=5)
    head = torch.empty(2048, hidden, dtype=dtype)
    return CodePredictorPasses(SimpleNamespace(cp=SimpleNamespace(
        model=SimpleNamespace(cfg=cfg), lm_head=[SimpleNamespace(weight=head)], num_groups=16)))


def fake_talker(hidden: int, dtype=torch.bfloat16, context: int = 300, width: int = 640) -> TalkerDecode:
    """What TalkerDecode.mark reads of a FusedTalker: its stack's sizes and dtype."""
    cfg = SimpleNamespace(hidden_size=hidden, intermediate_size=3 * hidden, num_layers=28, num_heads=16,
                          num_kv_heads=8)
    stack = SimpleNamespace(cfg=cfg, norm=SimpleNamespace(weight=torch.empty(hidden, dtype=dtype)))
    return TalkerDecode(SimpleNamespace(stack=stack), None, context, width)


def test_no_chain_tuning_where_the_kernels_are_off(fake_tune, tiny_ckpt, monkeypatch):
    monkeypatch.setenv("Q3TTS_KERNELS", "torch")
    runner = tiny_engine(tiny_ckpt).runner
    runner._chain_tune(Startup())
    assert fake_tune == []


@pytest.mark.parametrize("make", [fake_cp, fake_talker])
def test_the_mark_holds_for_one_part_model_shape_and_dtype_only(make, monkeypatch):
    monkeypatch.setattr(autotune, "_BEST", {})
    autotune.set_tuned(make(1024).mark((1, 16)), {1: 2.9, 16: 3.8})
    assert not chain_tuning.needs_tuning(make(1024), (16, 1))
    others = [(make(2048), (1, 16)), (make(1024, torch.float16), (1, 16)), (make(1024), (1, 8)),
              ((fake_talker if make is fake_cp else fake_cp)(1024), (1, 16))]
    if make is fake_talker:
        others += [(fake_talker(1024, context=600), (1, 16)), (fake_talker(1024, width=320), (1, 16))]
    for other, batches in others:
        assert chain_tuning.needs_tuning(other, batches)
    monkeypatch.setattr(chain_tuning.kernels, "programmatic_launch", lambda t: True)  # the other launch mode
    assert chain_tuning.needs_tuning(make(1024), (1, 16))


def test_the_table_names_the_parts_chain_tuned_in_it(monkeypatch):
    monkeypatch.setattr(autotune, "_BEST", {("cp_linear", 1024): "a launch config", "cp_chain_tuned_x": {}})
    assert chain_tuning.chain_tuned_parts() == []
    autotune.set_tuned(fake_talker(1024).mark((16, 1)), {1: 1.7, 16: 2.2})
    monkeypatch.setattr(chain_tuning.kernels, "programmatic_launch", lambda t: True)
    autotune.set_tuned(fake_cp(1024).mark((1,)), {1: 2.7})
    assert chain_tuning.chain_tuned_parts() == ["code predictor at B 1 (PDL)", "talker at B 1, 16"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_engine_chain_tunes_once_and_its_table_spares_the_next(tiny_ckpt_dir, tmp_path, monkeypatch):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))
    from bench_engine import graph_vs_eager

    monkeypatch.setattr(autotune, "_BEST", {})  # as a fresh process: nothing tuned, no key asked for yet
    monkeypatch.setattr(autotune, "_SEEN", {})
    path = tmp_path / "tuning.pkl"
    cfg = EngineConfig(device="cuda", dtype="bfloat16", num_pages=256, max_slots=4, max_frames=64,
                       max_prompt_tokens=256, max_text_tokens=128, graph_batch_sizes=(1, 2, 4), tune_cache=str(path))
    first = Engine(str(tiny_ckpt_dir), cfg)
    runner = first.runner
    parts = (CodePredictorPasses(runner.talker.code_predictor.fused),
             TalkerDecode(runner.talker.fused, runner.kv, width=runner.meta.max_pages))  # the engine's table width
    assert "chain tuning" in first.startup.phases
    assert not any(chain_tuning.needs_tuning(part, (1, 4)) for part in parts)
    # the talker's chain left the sequences' pages as it found them (the graphs' padding rows write the dummy page)
    assert not any(kv[:, :runner.dummy_page].any() for kv in (runner.kv.k, runner.kv.v))
    assert graph_vs_eager(first, 3)
    autotune._BEST.clear()
    second = Engine(str(tiny_ckpt_dir), cfg)
    assert "chain tuning" not in second.startup.phases and second.startup.cached_configs > 0
    assert graph_vs_eager(second, 3)


@pytest.fixture
def counted_graphs(monkeypatch):
    """Each CUDA graph of chain_tuning replaced by a plain call and its time by the rows run in it (the list the
    work appends its row counts to, returned); the process's tuning table emptied for the test."""
    pytest.importorskip("triton")
    monkeypatch.setattr(autotune, "_BEST", {})
    runs = []

    def replay_ms(replay, iters):
        before = len(runs)
        replay()
        return float(sum(runs[before:]))

    monkeypatch.setattr(chain_tuning, "capture_graph", lambda fn: SimpleNamespace(replay=fn))
    monkeypatch.setattr(chain_tuning, "replay_ms", replay_ms)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    return runs


def test_tune_runs_the_passes_largest_batch_first_and_marks_the_table(tiny_ckpt, counted_graphs, monkeypatch):
    """`tune`'s plumbing on the CPU (`counted_graphs`), the fused passes replaced by the eager ones (the kernels'
    own tests run them through the interpreter): the chain's inputs run a frame at every batch, largest first,
    and the mark holds the times measured."""
    runs = counted_graphs
    fused = tiny_engine(tiny_ckpt, chain_tune=False).runner.talker.code_predictor.fused
    generate = fused.cp.generate  # on the CPU: the eager passes

    def counted(past_hidden, c0, sampler):
        runs.append(c0.shape[0])
        codes, nxt = generate(past_hidden, c0, sampler)
        assert codes.shape == (c0.shape[0], 15) and nxt.shape == past_hidden.shape
        return codes, nxt

    monkeypatch.setattr(fused, "generate", counted)
    result = chain_tuning.tune(CodePredictorPasses(fused), (1, 2))
    assert runs == [2, 1, 2, 1, 2, 1]  # warm-up, the times before, the times after
    assert result.before == result.after == {2: 2.0, 1: 1.0} and result.changes == []
    assert autotune.tuned_configs()[CodePredictorPasses(fused).mark((1, 2))] == {2: 2.0, 1: 1.0}
    # tuned again under the other launch mode: that mode's mark replaces this one (its picks are gone)
    plain = CodePredictorPasses(fused).mark((1, 2))
    monkeypatch.setattr(chain_tuning.kernels, "programmatic_launch", lambda t: True)
    chain_tuning.tune(CodePredictorPasses(fused), (1, 2))
    marks = [k for k in autotune.tuned_configs() if k[0] == "cp_chain_tuned"]
    assert marks == [CodePredictorPasses(fused).mark((1, 2))] and marks != [plain]


def test_tune_runs_the_talker_on_its_own_pages_of_the_cache_and_zeroes_what_it_wrote(tiny_ckpt, counted_graphs,
                                                                                     monkeypatch):
    """The talker's chain over an engine's KV cache (`counted_graphs`; the eager stack in place of the fused
    forward): every row at the context on pages of its own, its new K/V on its last page, which is zeroed when
    tuning ends; no other page changes."""
    runs, contexts = counted_graphs, []
    runner = tiny_engine(tiny_ckpt, chain_tune=False).runner
    fused, kv = runner.talker.fused, runner.kv
    for t in (kv.k, kv.v):
        t.fill_(0.5)  # what earlier work left

    def counted(x, positions, ctx):
        runs.append(x.shape[0])
        contexts.append(ctx)
        return fused.stack(x, positions, ctx)  # on the CPU: the eager stack

    monkeypatch.setattr(fused, "forward", counted)
    result = chain_tuning.tune(TalkerDecode(fused, kv, context=40), (1, 2))
    assert runs == [2, 1, 2, 1, 2, 1] and result.before == {2: 2.0, 1: 1.0}
    ps = kv.page_size
    pages = -(-40 // ps)
    ctx = contexts[0]  # two rows
    assert ctx.block_tables.tolist() == [list(range(pages)), list(range(pages, 2 * pages))]
    assert ctx.context_lens.tolist() == [40, 40] and contexts[1].block_tables.tolist() == [list(range(pages))]
    assert ctx.slot_mapping.tolist() == [(pages - 1) * ps + 39 % ps, (2 * pages - 1) * ps + 39 % ps]
    for t in (kv.k, kv.v):
        zeroed = [p for p in range(kv.num_pages) if not t[:, p].any()]
        assert zeroed == [pages - 1, 2 * pages - 1]
        assert all(bool((t[:, p] == 0.5).all()) for p in range(kv.num_pages) if p not in zeroed)
    assert not chain_tuning.needs_tuning(TalkerDecode(fused, kv, context=40), (2, 1))


def test_decode_inputs_wrap_around_a_cache_with_fewer_pages_and_fill_a_wider_table():
    stack = SimpleNamespace(cfg=SimpleNamespace(head_dim=4, hidden_size=8),
                            norm=SimpleNamespace(weight=torch.ones(8)))
    cache = PagedKVCache(1, 4, 16, 1, 4, torch.float32)
    inputs = DecodeInputs(stack, cache, 2, 40)
    assert inputs.ctx.block_tables.tolist() == [[0, 1, 2], [3, 0, 1]]
    assert inputs.positions.tolist() == [39, 39] and inputs.x.shape == (2, 8)
    wide = DecodeInputs(stack, cache, 2, 40, width=5)
    assert wide.ctx.block_tables.tolist() == [[0, 1, 2, 2, 2], [3, 0, 1, 1, 1]]
    assert wide.ctx.slot_mapping.tolist() == [2 * 16 + 39 % 16, 1 * 16 + 39 % 16]
    assert wide.written_pages.tolist() == [2, 1] and wide.ctx.context_lens.tolist() == [40, 40]
