"""What the GEMMs of the quantized linears (kernels/fp8_matmul.py, wo_matmul.py, gemv.py) share:
where a program's output tile is, grouped along M so that consecutive programs share the weight's
tiles in L2 (the ordering of Triton's matmul tutorial); and split-K, for decode shapes whose output
tiles alone are too few to keep every SM streaming the weight: each of `splits` programs of a tile
sums one range of K into fp32 partials, [splits, M, N], and `reduce_splits` adds them up in split
order (deterministic: the same bits every run, graph or eager), adds the bias and rounds once.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kernels.rounding import round_to

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


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


@triton.jit
def k_range(pid_k, K, k_per_split):
    """[lo, hi) of K that split `pid_k` sums (all of K without a split: k_per_split >= K)."""
    lo = pid_k * k_per_split
    return lo, tl.minimum(K, lo + k_per_split)


@functools.cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def splits_for(tiles: int, k: int, block_k: int, device: torch.device, waves: int = 4) -> int:
    """Splits of K (a power of two) that bring `tiles` output tiles up to `waves` programs per SM,
    each split keeping at least two K steps; 1 on the CPU (the interpreter's cost is per program)."""
    if _INTERPRET or device.type != "cuda":
        return 1
    target, steps, s = waves * sm_count(device.index or 0), triton.cdiv(k, block_k), 1
    while tiles * s < target and steps >= 4 * s:
        s *= 2
    return s


def split_plan(k: int, block_k: int, splits: int) -> tuple[int, int]:
    """(K per split, a multiple of block_k; the number of non-empty splits)."""
    per = triton.cdiv(triton.cdiv(k, block_k), max(splits, 1)) * block_k
    return per, max(1, triton.cdiv(k, per))


@triton.jit
def _reduce_kernel(part_ptr, bias_ptr, out_ptr, M, N, splits, stride_om, HAS_BIAS: tl.constexpr,
                   BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(splits):  # in split order, always
        acc += tl.load(part_ptr + (s * M + row) * N + cols, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + cols, round_to(acc, out_ptr.dtype.element_ty), mask=ok)


def reduce_splits(partials: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """out [M, N] = round(sum over s of partials[s] (+ bias)), partials [S, M, N] fp32 contiguous."""
    s, m, n = partials.shape
    assert partials.dtype == torch.float32 and partials.is_contiguous() and out.shape == (m, n) and out.stride(1) == 1
    if m and n:
        block = min(triton.next_power_of_2(n), 1024)
        _reduce_kernel[(m, triton.cdiv(n, block))](partials, bias if bias is not None else out, out, m, n, s,
                                                   out.stride(0), HAS_BIAS=bias is not None, BLOCK=block,
                                                   num_warps=1 if _INTERPRET else 4)
    return out
