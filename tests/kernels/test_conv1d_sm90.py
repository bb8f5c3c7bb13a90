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


def test_an_unpipelined_config_loads_its_tiles_through_l1(usage):
    """The pipelined config copies its tiles asynchronously (LDGSTS: cp.async.cg, L2 only, so each tap reads its input
    tile from L2 again); num_stages 1 loads them into registers (LDG, cached in L1, where the next tap, the same rows
    shifted by the dilation, finds most of them: the `_CL_CONFIGS` that are not pipelined)."""
    (staged,), (plain,) = usage["cl k7 history"], usage["cl k7 history L1"]
    assert staged["after_ticket"]["LDGSTS"] > 0 and plain["after_ticket"]["LDGSTS"] == 0, usage
    assert plain["after_ticket"]["LDG"] > staged["after_ticket"]["LDG"], usage
    assert plain["stack"] == 0, usage
