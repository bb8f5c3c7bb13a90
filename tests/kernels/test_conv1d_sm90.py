"""The channels-last conv compiled for the H200 (sm_90; tests/kernels/sm90.py in a fresh interpreter without
TRITON_INTERPRET: it compiles, it does not interpret): reading its input's history in place costs no more
shared memory than reading one tensor that holds history and new samples together. Each tap is one load whose
rows start in the history or in x (kernels/conv1d.py `_cl_x_tile`); two masked loads and a select per tap
staged three tiles a pipeline stage instead of two and took twice as long at the codec frame's 64-row shapes
on the H200 (perf/results/RESULTS.md, twenty-second session)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed")


@pytest.fixture(scope="module")
def usage() -> dict[str, list[dict]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("sm90.py")), "conv"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_a_split_history_stages_no_more_than_one_input(usage):
    (split,), (whole,) = usage["cl k7 history"], usage["cl k7"]
    assert split["kernel"] == whole["kernel"] == "_conv1d_cl_kernel"
    assert split["shared"] == whole["shared"], usage
    assert split["stack"] == 0, usage
