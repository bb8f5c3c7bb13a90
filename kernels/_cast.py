"""`cast(x, dtype)` and `dot(a, b)` with GPU numerics on the GPU and in the interpreter.

NOTE: the Triton interpreter (TRITON_INTERPRET=1, triton 3.6) truncates fp32 -> bf16 casts, while
GPUs and torch round to nearest even; this helper rounds by hand there so CPU tests see GPU
numerics.
On the GPU the branch is compiled out.
"""

import os

import triton
import triton.language as tl

_INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def cast(x, dtype: tl.constexpr):
    if _INTERPRET and dtype == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(dtype)
    else:
        return x.to(dtype)


@triton.jit
def dot(a, b, DOT_PRECISION: tl.constexpr):
    """tl.dot with fp32 accumulation. NOTE: the triton 3.6 interpreter multiplies the raw uint16
    bits of bf16 operands, so there the (exact) fp32 upcast is done first."""
    if _INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=DOT_PRECISION)
