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


_KERNEL_MODULES = ("_cast", "rmsnorm", "rotary", "store_kv", "paged_attention", "conv1d", "snake", "swiglu", "rvq",
                   "ring_attention")


def _is_interpreted(module) -> bool:
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    jitted = [v for v in vars(module).values() if isinstance(v, (JITFunction, InterpretedFunction))]
    return all(isinstance(v, InterpretedFunction) for v in jitted)


def kernel_module(name: str):
    """q3tts.kernels.<name>, imported by path (the package re-binds `store_kv` to its wrapper).

    Skips the test module when triton is missing, or on CPU when triton was imported before
    TRITON_INTERPRET=1 was set (another suite imported q3tts.kernels first): the interpreter must be
    chosen before triton's own jit functions (tl.sum, ...) are decorated: nothing can be reloaded.
    """
    pytest.importorskip("triton", reason="triton is not installed")
    modules = [importlib.import_module(f"q3tts.kernels.{m}") for m in _KERNEL_MODULES]
    if DEVICE == "cpu" and not all(_is_interpreted(m) for m in modules):
        pytest.skip("no CUDA, and triton was imported before TRITON_INTERPRET=1 could be set: run "
                    "`pytest tests/kernels` on its own, or set TRITON_INTERPRET=1 in "
                    "tests/conftest.py",
                    allow_module_level=True)
    return importlib.import_module(f"q3tts.kernels.{name}")


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
