"""perf/tune_chain.py, the chain tuner's command line: it times CUDA graphs, so a machine without a GPU is
refused with one clear error (the tuning itself: tests/engine/test_chain_tuning.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))


def test_the_tool_refuses_a_machine_without_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    import tune_chain

    with pytest.raises(SystemExit):
        tune_chain.main(["--out", "/dev/null"])
    assert "needs a GPU" in capsys.readouterr().err
