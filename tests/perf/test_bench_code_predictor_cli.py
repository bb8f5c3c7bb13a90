"""perf/bench_code_predictor.py's command line: a pass it cannot time is refused before any work (a full-size
run builds the model and benches every batch before it reaches the attention passes); the run starts from a
saved tuning table, so it measures the configs an engine picked, and writes the table back."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from q3tts.kernels import autotune
from q3tts.kernels.code_predictor_gemm import GemmConfig

PERF = Path(__file__).resolve().parents[2] / "perf"
sys.path.insert(0, str(PERF))
import bench_code_predictor  # noqa: E402


@pytest.mark.parametrize("bad", ["0", "15"])
def test_an_attention_pass_out_of_range_is_refused_at_once(bad, capsys, monkeypatch):
    monkeypatch.setattr(bench_code_predictor, "random_code_predictor",
                        lambda *a: pytest.fail("the model was built before the arguments were checked"))
    with pytest.raises(SystemExit) as exit_:
        bench_code_predictor.main(["--device", "cpu", "--scale", "tiny", "--attention-passes", "1", bad])
    assert exit_.value.code == 2
    assert f"--attention-passes: invalid choice: {bad}" in capsys.readouterr().err


def test_the_run_starts_from_the_tuning_table_and_saves_it_back(tmp_path, capsys, monkeypatch):
    """--tune-cache: the configs of a saved table (an engine's) are the ones the run reports, and the table is
    written back (with what the run tuned; nothing on the CPU)."""
    monkeypatch.setenv("Q3TTS_TRITON_ON_CPU", "1")  # what the CPU run sets, undone after the test
    cpu, key = torch.device("cpu"), ("cp_test/plain", 7, 9, torch.float32, 16)  # a key no kernel looks up
    monkeypatch.setattr(autotune, "_BEST", {key: GemmConfig(32, 128, 2, 4, 4, 16)})
    path = tmp_path / "tuning.pkl"
    autotune.save_tuned(path, cpu)
    autotune._BEST.clear()
    before = path.stat().st_mtime_ns
    bench_code_predictor.main(["--device", "cpu", "--scale", "tiny", "--batches", "1", "--tune-cache", str(path)])
    report = capsys.readouterr().out
    assert f"(1 configs from {path}; chain-tuned: none)" in report
    assert "| cp_test/plain | 7 | 9 | 16 | 16 | 32 | 128 | 2 | 4 | 4 |" in report
    assert path.stat().st_mtime_ns > before and autotune.load_tuned(path, cpu) == 1


def test_importing_the_bench_switches_no_cpu_engine_to_the_interpreter():
    """The CPU run's switch (Q3TTS_TRITON_ON_CPU: the fused kernels through the Triton interpreter) is set by its
    main, not at import: set at import, it sent every CPU engine of the test session that imported the module
    (at collection) through the interpreter: one e2e test ran past 14 minutes instead of 7 seconds."""
    env = {k: v for k, v in os.environ.items() if k != "Q3TTS_TRITON_ON_CPU"}
    code = ("import os, sys; sys.path.insert(0, sys.argv[1]); import bench_code_predictor; "
            "print(os.environ.get('Q3TTS_TRITON_ON_CPU'))")
    out = subprocess.run([sys.executable, "-c", code, str(PERF)], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "None"


def test_the_config_table_lists_gemms_and_passes_over_the_chain_tuning_marks(monkeypatch):
    """An engine's table holds the chain-tuned marks (engine/chain_tuning.py `Part.mark`: the code predictor's
    a "cp_..." key, whose values are not launch configs); the report lists the GEMMs' configs, the qkv launches'
    (one config per weight shape, the gathering launch's under a key of its own: a 4-part key, which the H100 run
    of the thirty-fifth session failed on; the launches with row programs under a 5-part one) and passes over the marks."""
    gemm = ("cp_test/plain", 7, 9, torch.float32, 16)
    qkv = ("cp_qkv_attention", (4096, 1024), 8, torch.bfloat16)
    gather = ("cp_qkv_attention/gather", (4096, 1024), 8, torch.bfloat16)
    spread = ("cp_qkv_attention", (4096, 1024), 8, torch.bfloat16, "rows")
    mark = ("cp_chain_tuned", (1024, 3072, 5, 2048, 16), torch.bfloat16, (1, 16))
    talker = ("talker_chain_tuned", (2048, 6144, 28, 16, 8), torch.bfloat16, (1, 16), 300, 640)
    monkeypatch.setattr(autotune, "_BEST", {gemm: GemmConfig(32, 128, 2, 4, 4, 16), mark: {1: 2.9, 16: 3.8},
                                            talker: {1: 1.7, 16: 2.0}, qkv: GemmConfig(16, 128, 4, 4, 4, 16),
                                            gather: GemmConfig(32, 128, 2, 4, 4, 16),
                                            spread: GemmConfig(32, 128, 1, 4, 4, 16)})
    rows = bench_code_predictor.gemm_config_table()[2:]
    assert rows == ["| cp_qkv_attention | 4096 | 1024 | all | 16 | 16 | 128 | 4 | 4 | 4 |",
                    "| cp_qkv_attention | 4096 | 1024 | row programs | 16 | 32 | 128 | 1 | 4 | 4 |",
                    "| cp_qkv_attention/gather | 4096 | 1024 | all | 16 | 32 | 128 | 2 | 4 | 4 |",
                    "| cp_test/plain | 7 | 9 | 16 | 16 | 32 | 128 | 2 | 4 | 4 |"]
