"""Rounding an fp32 value to a model dtype inside a kernel, bit-for-bit as torch rounds it.

The elementwise kernels in this folder (rope.py, rms_norm.py, silu_mul.py) reproduce a chain of
torch operations in fp16/bf16, where torch rounds after every operation. They compute each step in
fp32 and round it with ``round_to``: round-to-nearest-even, the rounding torch uses.

fp16 uses Triton's conversion (round-to-nearest-even both on the GPU and under the interpreter).
bf16 uses it on a GPU too (cvt.rn.bf16.f32, one instruction); under the interpreter, which truncates
fp32 -> bf16 instead of rounding, it is rounded with integer arithmetic on the bits (torch's own
``round_to_nearest_even``): the same value for every non-NaN input, so kernels and their CPU tests
share one rounding. NaN stays NaN (on the bits: its sign and top payload bits kept, the quiet bit
set; on a GPU the instruction's canonical NaN). The bits' version took ~9 instructions a value: the
GPU's bf16 SiLU-and-multiply ran 9.2 -> 7.2 µs at 256 rows of the 8B shape without it (H200,
benchmarks/results/experiments/act_quant_llama-3.1-8b_round-bits_h200.json against _e4m3-bits_).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# The bits' arithmetic only where Triton's conversion truncates (the interpreter); FLASHPAGE_BF16_ROUND_BITS=1
# keeps it on a GPU too (an A/B of the two: benchmarks/quant/bench_act_quant.py)
_BF16_BITS = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1"
                          or os.environ.get("FLASHPAGE_BF16_ROUND_BITS", "0") == "1")


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """x (fp32) rounded to nearest-even in `dtype` (float32, float16 or bfloat16); returns `dtype`."""
    if dtype == tl.bfloat16 and not _BF16_BITS:
        return x.to(tl.bfloat16)  # cvt.rn.bf16.f32: round-to-nearest-even, one instruction
    elif dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        hi = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16
        hi = tl.where(x != x, (bits >> 16) | 0x40, hi)
        return hi.to(tl.int16).to(tl.bfloat16, bitcast=True)
    elif dtype == tl.float16:
        return x.to(tl.float16)
    else:
        return x.to(dtype)
