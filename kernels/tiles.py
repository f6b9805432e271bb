"""What the GEMMs of the quantized linears (kernels/fp8_matmul.py, wo_matmul.py, gemv.py) share:
where a program's output tile is, grouped along M so that consecutive programs share the weight's
tiles in L2 (the ordering of Triton's matmul tutorial); and split-K, for decode shapes whose output
tiles alone are too few to keep every SM streaming the weight. Each of a tile's `splits` programs
sums one range of K, writes its fp32 partial, and the tile's last program to arrive (an atomic
count) adds the partials in split order and stores the tile: one launch, the same bits every run
(graph or eager) whichever program arrives last. kernels/invariant_matmul.py folds its K segments
the same way; the partials and counters are kernels/scratch.py buffers, made before any capture.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kernels.rounding import round_to
from kernels.scratch import has_scratch, scratch, scratch_size

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


COUNTERS = 1 << 16  # arrival counters kept per device: more than any split launch's tiles


@triton.jit
def split_arrive(acc, part_ptr, count_ptr, tile, block, TILE_ELEMS: tl.constexpr):
    """Store `acc` (the tile's elements at offsets `block`) as split program_id(1)'s partial of
    `tile` (program_id(0)); whether this program is the tile's last to arrive."""
    tl.store(part_ptr + (tl.program_id(1) * tl.num_programs(0) + tile).to(tl.int64) * TILE_ELEMS + block, acc)
    tl.debug_barrier()  # every thread's partial is written before the count says so
    done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
    return done == tl.num_programs(1) - 1


@triton.jit
def split_total(acc, part_ptr, count_ptr, tile, block, TILE_ELEMS: tl.constexpr):
    """The tile's partials added in split order (by its last program; `acc`: any of them, for the shape)."""
    total = tl.zeros_like(acc)
    for s in range(0, tl.num_programs(1)):  # ascending, whichever program arrived last
        total += tl.load(part_ptr + (s * tl.num_programs(0) + tile).to(tl.int64) * TILE_ELEMS + block,
                         cache_modifier=".cg")
    tl.atomic_xchg(count_ptr + tile, 0)  # ready for the next launch (and graph replay)
    return total


@triton.jit
def finish_tile(acc, bias_ptr, c_ptr, offs_m, offs_n, m_ok, n_ok, stride_cm, part_ptr, count_ptr, SPLIT: tl.constexpr,
                HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Store a [BLOCK_M, BLOCK_N] fp32 output tile plus the bias, rounded once to c's dtype; split: by
    the tile's last program to arrive, the splits' partials added in split order."""
    if SPLIT:
        block = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        if split_arrive(acc, part_ptr, count_ptr, tl.program_id(0), block, BLOCK_M * BLOCK_N):
            acc = split_total(acc, part_ptr, count_ptr, tl.program_id(0), block, BLOCK_M * BLOCK_N)
            _store_tile(acc, bias_ptr, c_ptr, offs_m, offs_n, m_ok, n_ok, stride_cm, HAS_BIAS)
    else:
        _store_tile(acc, bias_ptr, c_ptr, offs_m, offs_n, m_ok, n_ok, stride_cm, HAS_BIAS)


@triton.jit
def _store_tile(acc, bias_ptr, c_ptr, offs_m, offs_n, m_ok, n_ok, stride_cm, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    c = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c, round_to(acc, c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def split_buffers(device: torch.device, tiles: int, splits: int, tile_elems: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 partials for `splits` x `tiles` tiles, the per-tile arrival counters): kept between
    launches, shared by the split launches on a device (one stream orders them); the counters are
    zero between launches. They must exist before a CUDA graph is captured (the warm-up's eager
    steps make them): made or grown during a capture, they would be the graph's memory."""
    assert tiles <= COUNTERS
    n = splits * tiles * tile_elems
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        grown = not has_scratch(("split-partials", device)) or scratch_size(("split-partials", device)) < n
        if grown or not has_scratch(("split-counters", device)):
            raise RuntimeError("a split-K GEMM's buffers must be made before capture: run the shape eagerly first")
    return (scratch(("split-partials", device), n, torch.float32, device),
            scratch(("split-counters", device), tiles, torch.int32, device, min_size=COUNTERS, zeroed=True))


GEMV_PER_CHANNEL = tl.constexpr(0)  # the GEMVs' GROUP for one scale per output channel


@triton.jit
def _gemv_store(acc, offs_n, n_ok, bias_ptr, out_ptr, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, round_to(acc, out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def gemv_finish(acc, offs_n, n_ok, bias_ptr, out_ptr, part_ptr, count_ptr, SPLIT: tl.constexpr,
                HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
    """A GEMV program's sums (kernels/gemv.py, gemv_int4.py) stored with the bias, rounded once;
    split: by the tile's last program, all splits' partials added in split order."""
    if SPLIT:
        block = tl.arange(0, BLOCK_N)
        if split_arrive(acc, part_ptr, count_ptr, tl.program_id(0), block, BLOCK_N):
            _gemv_store(split_total(acc, part_ptr, count_ptr, tl.program_id(0), block, BLOCK_N), offs_n, n_ok,
                        bias_ptr, out_ptr, HAS_BIAS)
    else:
        _gemv_store(acc, offs_n, n_ok, bias_ptr, out_ptr, HAS_BIAS)


@triton.jit
def gemv_span(N, K, k_per_split, BLOCK_N: tl.constexpr):
    """A GEMV program's output channels (offsets, in range, int64) and its split's [k_lo, k_hi)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lo, k_hi = k_range(tl.program_id(1), K, k_per_split)
    return offs_n, offs_n < N, offs_n.to(tl.int64), k_lo, k_hi
