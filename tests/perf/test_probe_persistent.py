"""perf/probe_persistent.py on the CPU (Triton interpreter, one program): the persistent chain computes exactly
what the chain of launches computes (same tiles, same sums), and both follow torch's chain to bf16 rounding."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))
from probe_persistent import BLOCK_K, LAYER, Chain, run_chain  # noqa: E402


def test_persistent_chain_equals_the_launches_and_follows_torch():
    chain = Chain(LAYER["tiny"] * 2, "cpu")
    launched = run_chain(chain, lambda: chain.launches(BLOCK_K["tiny"]))
    persistent = run_chain(chain, lambda: chain.persistent(1, BLOCK_K["tiny"]))
    assert torch.equal(persistent, launched)
    assert launched.abs().max() > 0.1  # a real signal reached the last GEMV
    want = chain.reference()
    # each of the 8 GEMVs rounds its output to bf16 on both sides (2^-8 relative each), in other summation orders
    assert (launched - want).abs().max() <= len(chain.shapes) * 2 ** -7 * want.abs().max()
