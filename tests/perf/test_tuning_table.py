"""perf/bench_engine.py `tuning_table`, the kernel benches' --tune-cache: the block runs with the saved table's
configs, and the table is written back with what the block tuned; no path, no file; perf/retag_table.py gives a table
another tree's fingerprint; the H200 table kept in perf/results (a device call's cold start retags it instead of
tuning) still loads under this tree's kernels; the line an engine bench prints of its table and the parts chain-tuned in
it."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from q3tts.kernels import autotune
from q3tts.kernels.code_predictor_gemm import GemmConfig

PERF = Path(__file__).resolve().parents[2] / "perf"
sys.path.insert(0, str(PERF))
from bench_engine import configs_line, tuning_table  # noqa: E402

CPU = torch.device("cpu")
SAVED, TUNED = ("bench_test", 1), ("bench_test", 2)  # keys no kernel looks up


def test_the_block_runs_on_the_saved_table_and_writes_back_what_it_tuned(tmp_path, monkeypatch):
    monkeypatch.setattr(autotune, "_BEST", {SAVED: GemmConfig(32, 128, 2, 4, 4, 16)})
    path = tmp_path / "tuning.pkl"
    autotune.save_tuned(path, CPU)
    autotune._BEST.clear()
    with tuning_table(str(path), CPU) as loaded:
        assert loaded == 1 and autotune.tuned_configs() == {SAVED: GemmConfig(32, 128, 2, 4, 4, 16)}
        autotune.set_tuned(TUNED, "cudnn")
    autotune._BEST.clear()
    assert autotune.load_tuned(path, CPU) == 2 and autotune.tuned_configs()[TUNED] == "cudnn"


def test_no_path_no_table(tmp_path, monkeypatch):
    monkeypatch.setattr(autotune, "_BEST", {})
    monkeypatch.chdir(tmp_path)
    for path in ("", None):
        with tuning_table(path, CPU) as loaded:
            assert loaded == 0
    assert list(tmp_path.iterdir()) == []


def test_a_retagged_table_loads_under_other_kernel_sources(tmp_path, monkeypatch):
    from retag_table import main as retag

    monkeypatch.setattr(autotune, "_BEST", {SAVED: GemmConfig(32, 128, 2, 4, 4, 16)})
    path, out = tmp_path / "tuning.pkl", tmp_path / "retagged.pkl"
    autotune.save_tuned(path, CPU)
    autotune._BEST.clear()
    other_sources = (*autotune.fingerprint(CPU)[:3], "another commit's kernels")
    monkeypatch.setattr(autotune, "fingerprint", lambda device: other_sources)
    assert autotune.load_tuned(path, CPU) == 0
    assert retag([str(path), str(out), "--device", "cpu"]) == 0
    assert autotune.load_tuned(out, CPU) == 1 and autotune.tuned_configs() == {SAVED: GemmConfig(32, 128, 2, 4, 4, 16)}


def test_a_table_retagged_without_chain_marks_keeps_every_pick_but_the_marks(tmp_path, monkeypatch):
    """--drop-chain-marks: the picks stay, the chain tuning's marks go, so an engine on the table chain-tunes again
    (chain_tuning.needs_tuning) from those picks."""
    from retag_table import main as retag

    mark = ("cp_chain_tuned", (1024, 3072, 5, 2048, 16), torch.bfloat16, (1, 16), True)
    monkeypatch.setattr(autotune, "_BEST", {SAVED: GemmConfig(32, 128, 2, 4, 4, 16), mark: {1: 2.1, 16: 3.0}})
    path, out = tmp_path / "tuning.pkl", tmp_path / "retagged.pkl"
    autotune.save_tuned(path, CPU)
    assert retag([str(path), str(out), "--device", "cpu", "--drop-chain-marks"]) == 0
    autotune._BEST.clear()
    assert autotune.load_tuned(out, CPU) == 1 and autotune.tuned_configs() == {SAVED: GemmConfig(32, 128, 2, 4, 4, 16)}


def test_the_kept_h200_table_loads_under_this_tree(tmp_path, monkeypatch):
    """Every entry of perf/results/tuning-h200-0d29c93.pkl unpickles into this tree's config classes and loads once
    retagged (a renamed or removed config class would leave the next device session to tune from scratch)."""
    from retag_table import main as retag

    monkeypatch.setattr(autotune, "_BEST", {})
    out = tmp_path / "retagged.pkl"
    assert retag([str(PERF / "results" / "tuning-h200-0d29c93.pkl"), str(out), "--device", "cpu"]) == 0
    assert autotune.load_tuned(out, CPU) == 196
    assert any(isinstance(config, GemmConfig) for config in autotune.tuned_configs().values())


def test_a_bench_names_its_table_and_what_was_chain_tuned_in_it(monkeypatch):
    monkeypatch.setattr(autotune, "_BEST", {SAVED: GemmConfig(32, 128, 2, 4, 4, 16)})
    monkeypatch.delenv("Q3TTS_TUNE_CACHE", raising=False)
    assert configs_line() == "launch configs: no table (tuned in this run); chain-tuned: none"
    autotune.set_tuned(("cp_chain_tuned", (1024, 3072, 5, 2048, 16), torch.bfloat16, (1, 16)), {1: 2.7, 16: 3.5})
    monkeypatch.setenv("Q3TTS_TUNE_CACHE", "/tmp/t.pkl")
    assert configs_line() == "launch configs: tuning table /tmp/t.pkl; chain-tuned: code predictor at B 1, 16"
