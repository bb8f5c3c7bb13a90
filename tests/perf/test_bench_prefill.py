"""perf/bench_prefill.py's phase table on CPU with a tiny 1.7B CustomVoice checkpoint: each phase of the step
that starts the arrivals is timed once per call (the text push once per sequence), and the engine's methods are
its own again afterwards."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))
import bench_prefill  # noqa: E402

from q3tts.checkpoint.maker import make_checkpoint  # noqa: E402


def test_phase_table_times_the_first_steps_phases_and_restores_the_methods(tmp_path):
    ckpt = make_checkpoint(tmp_path / "cv", "custom_voice", "1.7b", "tiny", seed=0)
    args = argparse.Namespace(model=str(ckpt), scale="tiny", device="cpu", icl=False, arrivals=[3],
                              max_slots=None)
    engine = bench_prefill.make_engine(args)
    engine.runner.prefill_graphs = engine.runner.packed_prefill()  # run eagerly, as on CUDA before capture
    table = bench_prefill.phase_table(engine, bench_prefill.voices(engine, 3, False), 150, "t")
    cells = {row.split("|")[1].strip(): [c.strip() for c in row.split("|")[2:-1]] for row in table[2:]
             if row.startswith("|")}
    assert cells["prefill (engine._prefill)"][0] == "1" and cells["push text (each sequence)"][0] == "3"
    assert float(cells["pack + graph (runner._prefill)"][1]) > 0
    # the parts fit inside the whole: host ms of the graph run <= that of start_batch <= that of _prefill
    host = [float(cells[k][1]) for k in ("pack + graph (runner._prefill)", "runner.start_batch",
                                         "prefill (engine._prefill)")]
    assert host == sorted(host)
    assert any("torch.profiler" in row and "256-row bucket" in row for row in table)  # 150 rows: bucket 256
    assert "`aten::mm`" in cells  # the bucket's talker forward, on CPU as ops
    for obj, name in ((engine, "_prefill"), (engine, "_push_text"), (engine.runner, "_prefill"),
                      (engine.runner, "launch")):
        assert name not in vars(obj), f"{name} still wrapped"


def test_icl_arrivals_start_in_the_timed_step(tmp_path):
    """--icl: the cloned voices are kept on the device before timing, so each arrival is admitted by the step that
    prefills it (an add of a voice not kept yet is prepared on the reference thread and started steps later, which
    `prefill_ms` refuses as an arrival that missed its step)."""
    ckpt = make_checkpoint(tmp_path / "base", "base", "1.7b", "tiny", seed=0)
    args = argparse.Namespace(model=str(ckpt), scale="tiny", device="cpu", icl=True, arrivals=[2], max_slots=None)
    engine = bench_prefill.make_engine(args)
    assert bench_prefill.prefill_ms(engine, bench_prefill.voices(engine, 2, True), False, "icl") > 0
