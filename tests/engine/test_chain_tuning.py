"""engine/chain_tuning.py: the coordinate descent on a made-up cost (the GPU chain it times has no CPU form), the
candidates `kernels.autotune.pick` remembers for it, and when an engine chain-tunes (EngineConfig.chain_tune):
once per tuning table, only with the fused code predictor, at the batches the config names."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from q3tts.engine import Engine, EngineConfig, chain_tuning
from q3tts.engine.chain_tuning import ChainResult, descend, mark_key
from q3tts.engine.timing import Startup
from q3tts.kernels import autotune

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


def test_tune_on_descends_over_the_keys_the_chain_asks_for_first(monkeypatch):
    monkeypatch.setattr(autotune, "_BEST", {("old",): "p"})
    monkeypatch.setattr(autotune, "_SEEN", {("old",): ("p", "q")})  # asked for by other work before
    result = chain_tuning.tune_on(FakeChain())
    assert autotune.tuned_configs() == {("old",): "p", ("new",): "y", ("single",): "s"}
    assert (result.keys, result.candidates) == (1, 2) and result.before == {1: 2.0, 16: 4.0}
    assert result.after == {1: 1.0, 16: 2.0} and result.changes == ["round 1: ('new',): x -> y (6.0000 -> 3.0000)"]


@pytest.mark.parametrize("fields, batches", [({}, (1, 16)), ({"fused_code_predictor": 4}, (1, 4)),
                                             ({"fused_code_predictor": 1}, (1,)),
                                             ({"fused_code_predictor": 64}, (1, 16)),
                                             ({"fused_code_predictor": 0}, ()), ({"chain_tune": False}, ())])
def test_the_batches_an_engine_chain_tunes_at(fields, batches):
    assert EngineConfig(**fields).chain_tune_batches == batches


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

    def tune(fused, batches):
        calls.append((fused, batches))
        autotune.set_tuned(mark_key(fused, batches), {b: 1.0 for b in batches})
        return ChainResult({1: 2.0, 2: 3.0}, {1: 1.0, 2: 2.5}, ["round 1: a change"], 1, 2)

    monkeypatch.setattr(chain_tuning, "tune", tune)
    return calls


def tiny_engine(ckpt, **fields) -> Engine:
    return Engine(ckpt, EngineConfig(device="cpu", dtype="float32", max_slots=2, num_pages=64, **fields))


def test_an_engine_chain_tunes_once_per_table(fake_tune, tiny_ckpt, tmp_path, caplog):
    pytest.importorskip("triton")  # the fused code predictor needs it
    runner, startup = tiny_engine(tiny_ckpt).runner, Startup()
    fused = runner.talker.code_predictor.fused
    assert fused is not None
    with caplog.at_level(logging.INFO, logger="q3tts.engine.start"):
        runner._chain_tune(startup)
    assert ("chain tuning of the code predictor: 1 keys, 2 candidates; B=1 2.000 -> 1.000 ms, "
            "B=2 3.000 -> 2.500 ms; round 1: a change") in caplog.text
    assert fake_tune == [(fused, (1, 2))] and "chain tuning" in startup.phases  # max_slots 2: the bucket 2
    runner._chain_tune(startup)
    assert len(fake_tune) == 1  # the table holds the mark
    path = tmp_path / "tuning.pkl"
    autotune.save_tuned(path, CPU)
    autotune._BEST.clear()
    runner._chain_tune(startup)
    assert len(fake_tune) == 2  # a table without the mark: tuned again
    autotune._BEST.clear()
    assert autotune.load_tuned(path, CPU) == 1
    runner._chain_tune(startup)
    assert len(fake_tune) == 2  # a table that was saved with it: not again


@pytest.mark.parametrize("fields", [{"chain_tune": False}, {"fused_code_predictor": 0}, {"fp32_residual": True}])
def test_no_chain_tuning_when_off_or_without_the_fused_code_predictor(fake_tune, tiny_ckpt, fields):
    """Off; no fused passes; or fused passes that do not serve the step (an fp32 residual stream)."""
    runner, startup = tiny_engine(tiny_ckpt, **fields).runner, Startup()
    runner._chain_tune(startup)
    assert fake_tune == [] and "chain tuning" not in startup.phases


def fake_fused(hidden: int, dtype=torch.bfloat16):
    """What mark_key reads of a FusedCodePredictor: its code predictor's sizes and head weight."""
    cfg = SimpleNamespace(hidden_size=hidden, intermediate_size=3 * hidden, num_layers=5)
    head = torch.empty(2048, hidden, dtype=dtype)
    return SimpleNamespace(cp=SimpleNamespace(model=SimpleNamespace(cfg=cfg), lm_head=[SimpleNamespace(weight=head)],
                                              num_groups=16))


def test_no_chain_tuning_where_the_kernels_are_off(fake_tune, tiny_ckpt, monkeypatch):
    monkeypatch.setenv("Q3TTS_KERNELS", "torch")
    runner = tiny_engine(tiny_ckpt).runner
    runner._chain_tune(Startup())
    assert fake_tune == []


def test_the_mark_holds_for_one_model_shape_and_dtype_only(monkeypatch):
    monkeypatch.setattr(autotune, "_BEST", {})
    autotune.set_tuned(mark_key(fake_fused(1024), (1, 16)), {1: 2.9, 16: 3.8})
    assert not chain_tuning.needs_tuning(fake_fused(1024), (16, 1))
    for other, batches in ((fake_fused(2048), (1, 16)), (fake_fused(1024, torch.float16), (1, 16)),
                           (fake_fused(1024), (1, 8))):
        assert chain_tuning.needs_tuning(other, batches)


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
    fused = first.runner.talker.code_predictor.fused
    assert "chain tuning" in first.startup.phases and not chain_tuning.needs_tuning(fused, (1, 4))
    assert graph_vs_eager(first, 3)
    autotune._BEST.clear()
    second = Engine(str(tiny_ckpt_dir), cfg)
    assert "chain tuning" not in second.startup.phases and second.startup.cached_configs > 0
    assert graph_vs_eager(second, 3)


def test_tune_runs_the_passes_largest_batch_first_and_marks_the_table(tiny_ckpt, monkeypatch):
    """`tune`'s plumbing on the CPU, each CUDA graph replaced by a plain call and its timing by a count of the
    rows it ran, the fused passes by the eager ones (the kernels' own tests run them through the interpreter):
    the chain's inputs run a frame at every batch, largest first, and the mark holds the times measured."""
    pytest.importorskip("triton")
    monkeypatch.setattr(autotune, "_BEST", {})
    runs = []

    def capture(fn):
        return SimpleNamespace(replay=fn)

    def replay_ms(replay, iters):
        before = len(runs)
        replay()
        return float(sum(runs[before:]))

    monkeypatch.setattr(chain_tuning, "capture_graph", capture)
    monkeypatch.setattr(chain_tuning, "replay_ms", replay_ms)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    fused = tiny_engine(tiny_ckpt, chain_tune=False).runner.talker.code_predictor.fused
    generate = fused.cp.generate  # on the CPU: the eager passes

    def counted(past_hidden, c0, sampler):
        runs.append(c0.shape[0])
        codes, nxt = generate(past_hidden, c0, sampler)
        assert codes.shape == (c0.shape[0], 15) and nxt.shape == past_hidden.shape
        return codes, nxt

    monkeypatch.setattr(fused, "generate", counted)
    result = chain_tuning.tune(fused, (1, 2))
    assert runs == [2, 1, 2, 1, 2, 1]  # warm-up, the times before, the times after
    assert result.before == result.after == {2: 2.0, 1: 1.0} and result.changes == []
    assert autotune.tuned_configs()[mark_key(fused, (1, 2))] == {2: 2.0, 1: 1.0}
