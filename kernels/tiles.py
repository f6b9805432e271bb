"""Where a GEMM program's output tile is: grouped along M, so that consecutive programs share the
weight's tiles in L2 (the ordering of Triton's matmul tutorial), for the GEMMs of the quantized
linears (kernels/fp8_matmul.py, kernels/wo_matmul.py)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of program `pid` over cdiv(M, BLOCK_M) x cdiv(N, BLOCK_N) tiles, GROUP_M rows of
    tiles at a time."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * tiles_n
    first_m = (pid // width) * GROUP_M
    rows = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % width) % rows, (pid % width) // rows
