"""The channels-last conv compiled for the H200 (sm_90; tests/kernels/sm90.py in a fresh interpreter without
TRITON_INTERPRET: it compiles, it does not interpret): reading its input's history in place costs no more
shared memory than reading one tensor that holds history and new samples together. Each tap is one load whose
rows start in the history or in x (kernels/conv1d.py `_cl_x_tile`); two masked loads and a select per tap
staged three tiles a pipeline stage instead of two and took twice as long at the codec frame's 64-row shapes
on the H200 (perf/results/RESULTS.md, twenty-second session)."""

import pytest

pytest.importorskip("triton", reason="triton is not installed")
from sm90 import compiled  # noqa: E402


@pytest.fixture(scope="module")
def usage() -> dict[str, list[dict]]:
    return compiled("conv")


def test_a_split_history_stages_no_more_than_one_input(usage):
    (split,), (whole,) = usage["cl k7 history"], usage["cl k7"]
    assert split["kernel"] == whole["kernel"] == "_conv1d_cl_kernel"
    assert split["shared"] == whole["shared"], usage
    assert split["stack"] == 0, usage
