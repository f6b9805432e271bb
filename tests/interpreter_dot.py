"""tl.dot in Triton's CPU interpreter, summed the same way for every row of the tile.

The batch-invariant kernels (kernels/invariant_matmul.py, invariant_attention.py) promise that a
row's bits do not depend on where it sits in its tile: on the GPU each output element is summed by
the same sequence of tensor-core steps, whatever its row. The interpreter stands in for those
steps with numpy's matmul, and numpy's BLAS promises no such thing: OpenBLAS's Haswell kernels
(what it picks on an AMD EPYC, seen 2026-11-26) sum rows 6-15 of every 16 in another order than
rows 0-5, so the invariance tests failed there, where CI on earlier machines had passed them (on
that EPYC, OpenBLAS forced to its SkylakeX kernels gave every row the same bits). Here the
interpreter's dot is numpy's einsum without BLAS, which sums every element over k in one order:
~10x slower than BLAS per 64x128x64 dot, yet the invariance and deterministic-engine tests took
59.6 s with it against 61.5 s without (the interpreter's own work dominates). Only float16/32/64 operands take this path; the product is in the accumulator's type, as
the interpreter's own dot computes it.
"""

from __future__ import annotations

import numpy as np


def install() -> bool:
    """Replace the interpreter's create_dot; False (and nothing changed) if it has none."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    builder = getattr(interpreter, "InterpreterBuilder", None)
    original = getattr(builder, "create_dot", None)
    if original is None:
        return False

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if not all(x.data.dtype in (np.float16, np.float32, np.float64) for x in (a, b)):
            # fp8 and bf16 (held as integer bits), and integers: as shipped. The kernels upcast bf16
            # to fp32 before a dot under the interpreter (UPCAST_DOT in kernels/invariant_*.py).
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        acc = d.data.dtype
        out = np.einsum("...ik,...kj->...ij", a.data.astype(acc), b.data.astype(acc), optimize=False)
        return interpreter.TensorHandle(out + d.data, d.dtype.scalar)

    builder.create_dot = create_dot
    return True
