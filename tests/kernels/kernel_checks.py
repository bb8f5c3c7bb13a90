"""Shared helpers of the kernel tests: device choice, kernel-module import, three-way tolerance.

NOTE: TRITON_INTERPRET must be set before the kernel modules are decorated (first import of
q3tts.kernels.*), so it is set here, at collection time, and only on machines without CUDA (on a GPU
machine the same tests launch the compiled kernels, and other suites keep compiled kernels).
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# per-dtype slack on top of "2x the same-dtype torch error" (flash-attn's three-way rule)
ATOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-3}


def kernel_module(name: str):
    """q3tts.kernels.<name> (the package re-binds `store_kv` etc. to the wrappers, so import by path).

    Skips when triton is missing, or when the kernels were compiled for a GPU path but no GPU exists
    (another suite imported them before this conftest could set TRITON_INTERPRET).
    """
    pytest.importorskip("triton", reason="triton is not installed")
    module = importlib.import_module(f"q3tts.kernels.{name}")
    if DEVICE == "cpu":
        from triton.runtime.interpreter import InterpretedFunction

        jitted = [v for v in vars(module).values() if hasattr(v, "fn") and hasattr(v, "arg_names")
                  or isinstance(v, InterpretedFunction)]
        if not all(isinstance(v, InterpretedFunction) for v in jitted):
            pytest.skip("q3tts.kernels was imported before TRITON_INTERPRET=1 was set; "
                        "run tests/kernels on its own on a CPU-only machine")
    return module


def assert_close_3way(out: torch.Tensor, out_pt: torch.Tensor, out_ref: torch.Tensor,
                      dtype: torch.dtype, what: str = "") -> None:
    """|out - ref| <= 2 |out_pt - ref| + atol(dtype) * max(1, |ref|), all maxima over elements.

    out: the kernel; out_pt: the same computation in torch at the kernel's dtype; out_ref: fp32.
    """
    ref = out_ref.float()
    err = (out.float() - ref).abs().max().item() if out.numel() else 0.0
    err_pt = (out_pt.float() - ref).abs().max().item() if out.numel() else 0.0
    scale = max(1.0, ref.abs().max().item()) if out.numel() else 1.0
    bound = 2 * err_pt + ATOL[dtype] * scale
    assert err <= bound, f"{what}: kernel error {err:.3g} > bound {bound:.3g} (torch {err_pt:.3g})"
