"""The fused qkv kernels compiled for the H200 (sm_90) spill no registers: every launch config their
tuner times there (4 candidates of 132-SM split counts, each kernel and token count; the code predictor's also
at one row, which attends in one round of loads), with the alignment a real launch specializes on (tests/kernels/sm90.py, run in a fresh
interpreter without TRITON_INTERPRET: it compiles, it does not interpret). A spill puts a thread's
values in local memory, whose round trips every program of these kernels would wait on."""

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
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("sm90.py"))], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_every_qkv_spec_compiles_once(usage):
    # 4 configs x (code predictor: T = 1 and 2 over 4 rows, T = 1 at one row; talker)
    assert len(usage) == 16 and all(len(kernels) == 1 for kernels in usage.values()), usage


def test_no_qkv_spec_spills(usage):
    spilled = {spec: k for spec, (k,) in usage.items() if k["stack"] > 0}
    assert not spilled, spilled
