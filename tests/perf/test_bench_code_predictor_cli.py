"""perf/bench_code_predictor.py's command line: a pass it cannot time is refused before any work (a full-size
run builds the model and benches every batch before it reaches the attention passes)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))
import bench_code_predictor  # noqa: E402


@pytest.mark.parametrize("bad", ["0", "15"])
def test_an_attention_pass_out_of_range_is_refused_at_once(bad, capsys, monkeypatch):
    monkeypatch.setattr(bench_code_predictor, "random_code_predictor",
                        lambda *a: pytest.fail("the model was built before the arguments were checked"))
    with pytest.raises(SystemExit) as exit_:
        bench_code_predictor.main(["--device", "cpu", "--scale", "tiny", "--attention-passes", "1", bad])
    assert exit_.value.code == 2
    assert f"--attention-passes: invalid choice: {bad}" in capsys.readouterr().err
