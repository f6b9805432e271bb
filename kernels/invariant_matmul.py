"""Batch-invariant linear layer: out = act(x @ weight.T + bias), each row computed the same way
whatever the other rows and however many there are (the deterministic mode's GEMM).

Contract (semantics = ``kernels.reference.linear_ref`` up to the order of the fp32 sum over K):
  x         [M, K] float16 / bfloat16, last dim contiguous (row stride free), any M >= 0
  weight    [N, K], x's dtype, contiguous (nn.Linear's layout)
  bias      [N] x's dtype, or None
  gelu      False, or True for GELU with the tanh approximation applied in fp32 before rounding
            (what cuBLASLt's GELU epilogue computes, and GPT-2's MLP)
  out       optional [M, N] x's dtype, contiguous
  returns   out[m, n] = round(act(sum_k x[m, k] * weight[n, k] + bias[n])), the sum in fp32.

Invariance, the point of this kernel: row m of the result is a function of row m of x (and the
weights) only, bit for bit. cuBLAS picks its tiles, its tensor-core instruction and whether to
split K from M, so the same row comes out in different bits at batch 1, 7 and 256. Here the launch
configuration never changes how an element is summed: every row goes through the same sequence
of k16 tensor-core steps accumulated in fp32 in ascending k; rows past M are masked to zero and
never stored. M is not specialised on (Triton would otherwise compile a separate
variant for M == 1 and for M a multiple of 16). The tile shape does follow M (``config``), within
configs that give the same bits (see CONFIGS).

K segments: a weight wider than ONE_SEGMENT_MAX_K columns is summed as SEGMENT_K-column segments
at fixed positions, each from zero, the segment sums added in ascending order. That order is a
function of K alone, and it lets a small batch spread the segments over programs (``split_k``):
each writes its fp32 partial tile, and the tile's last program to finish (an atomic arrival
count) adds the partials in the same ascending order, so split and unsplit give the same bits.

Grid: (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N), segments if split else 1), grouped along M so that
consecutive programs share weight tiles in L2. Tile sizes from a sweep on an H100 (``config``).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.scratch import has_scratch, scratch

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


class MatmulConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8


# The tile configs, all 64- or 128-row tiles of Hopper's wgmma, whose k16 steps accumulate each
# output element in the same order whatever the tile's M, N, BLOCK_K, warps or stages: measured
# bitwise equal on an H100 (bench_invariant_kernels.py, config_equivalence) and checked again at
# start-up by ``check_configs``, which falls back to SMALL for every launch where they differ.
SMALL = MatmulConfig(64, 64, 128, 4, 3)  # decode: weight-bandwidth bound, many programs
NARROW = MatmulConfig(64, 32, 128, 4, 3)  # twice SMALL's programs, for launches that would idle SMs
MEDIUM = MatmulConfig(128, 128, 64, 8, 4)  # compute bound; the large tile of segmented weights
LARGE = MatmulConfig(128, 256, 64, 8, 3)  # compute bound, unsegmented weights (LM heads, gate/up, QKV)
CONFIGS = (SMALL, NARROW, MEDIUM, LARGE)
# Which one: the largest tile that still gives the launch at least MIN_TILES output tiles (about
# 3/4 of the H100's 132 SMs), else SMALL, or NARROW while that gives under NARROW_MAX_PROGRAMS
# programs (~2 per SM). Rows up to DECODE_MAX_ROWS always take a small tile. The H100 sweep these
# come from (10 weights of GPT-2 small and Llama-3.2-1B x 256..4096 rows x 12 configs; totals in
# units of cuBLAS time, the best config per case 115.3, this rule 117.6, the old row-count buckets
# 148.2): GPT-2's MLP projection at 256 rows went from 21.7 to 11.3 us, Llama's LM head from 418
# to 316 us (cuBLAS 6.9 and 240). 128x256 tiles lost to 128x128 on segmented weights (K > 2048).
MIN_TILES = 96
NARROW_MAX_PROGRAMS = 256
DECODE_MAX_ROWS = 128
_configs_ok = True
_split_ok = True
# No FMA contraction: the epilogue (bias, GELU) is then the same IEEE operations in every config's
# compiled kernel by construction, not by the compiler fusing alike per tile shape (on the H100 the
# configs measured bitwise equal with contraction on as well).
FP_FUSION = False
# K segments: a weight wider than ONE_SEGMENT_MAX_K is summed as SEGMENT_K-column segments, each
# from zero, added in ascending order; segments can then be spread over programs at small batch
# (their fp32 partials folded in the same order) without a bit changing.
# Segments cost large batches a little (each restarts the software pipeline) and save small ones a
# lot; measured on an H100 in graph replays when these constants were chosen: 1024-column segments
# cost +4 to 8% at 8192 rows (512-column ones +15%), and took Llama-3.2-1B's down projection at one
# row from 28.9 to 13.9 us, GPT-2's from 11.7 to 8.3; weights up to 2048 columns gained little at
# one row and stay one segment. The benchmark's figures for the code as it is, against cuBLAS:
# benchmarks/results/experiments/invariant_kernels_gemm_h100.txt.
ONE_SEGMENT_MAX_K = 2048
SEGMENT_K = 1024
SPLIT_MAX_TILES = 64  # split launches of at most this many output tiles (the H100 has 132 SMs)
COUNTERS = 1 << 16  # arrival counters kept per device: more than any split launch's tiles


def config(n: int, k: int, m: int = 1) -> MatmulConfig:
    """The launch configuration of a weight [n, k] for m rows (SMALL for every launch if the
    start-up check found that the configs differ in bits)."""
    if _INTERPRET:  # programs run one by one in numpy: few, large tiles
        return MatmulConfig(64, 64, 128, 1, 1)
    if not _configs_ok:
        return SMALL
    segments = triton.cdiv(k, segment_k(k))
    if m > DECODE_MAX_ROWS:
        for cfg in (MEDIUM, ) if segments > 1 else (LARGE, MEDIUM):
            if triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n) >= MIN_TILES:
                return cfg
    narrow = triton.cdiv(m, NARROW.block_m) * triton.cdiv(n, NARROW.block_n) * segments
    return NARROW if narrow < NARROW_MAX_PROGRAMS else SMALL


class ConfigCheck(NamedTuple):
    """What check_configs found on this GPU."""
    configs_agree: bool  # every tile config gave SMALL's bits (else SMALL from now on)
    split_agrees: bool  # the K split gave the unsplit bits (else no launch splits from now on)


def check_configs(device: torch.device, shapes: tuple = ((2304, 768), (3072, 768), (768, 3072), (4096, 4096))
                  ) -> ConfigCheck:
    """Whether every config gives the same bits as SMALL on this GPU, with and without bias and
    GELU, and the split path the same bits as the unsplit one (both have on the H100); what fails
    is turned off, and so is a config this GPU cannot run (shared memory). Run once at start-up,
    before graphs (it also makes the split path's counters)."""
    global _configs_ok, _split_ok
    if _INTERPRET or device.type != "cuda":
        return ConfigCheck(True, True)
    g = torch.Generator(device=device).manual_seed(0)
    ok = split_ok = True
    for n, k in shapes:
        w = (torch.randn(n, k, device=device, generator=g) / k**0.5).half()
        b = torch.randn(n, device=device, generator=g).half()
        x = torch.randn(512, k, device=device, generator=g).half()
        for bias, gelu in ((None, False), (b, True)):
            first = invariant_linear(x, w, bias, gelu, cfg=SMALL)
            for cfg in CONFIGS[1:]:
                try:
                    ok &= torch.equal(invariant_linear(x, w, bias, gelu, cfg=cfg).view(torch.int16), first.view(torch.int16))
                except triton.runtime.errors.OutOfResources:
                    ok = False
            # two row tiles; 256-column segments so that every shape has several
            whole = invariant_linear(x[:70], w, bias, gelu, split=False, seg_k=256)
            split = invariant_linear(x[:70], w, bias, gelu, split=True, seg_k=256)
            split_ok &= torch.equal(whole.view(torch.int16), split.view(torch.int16))
    _configs_ok, _split_ok = ok, split_ok
    return ConfigCheck(ok, split_ok)


@triton.jit
def _gelu_tanh(y):
    # 0.5 * y * (1 + tanh(sqrt(2 / pi) * (y + 0.044715 * y^3))), tanh(z) = 1 - 2 / (exp(2z) + 1)
    z = 0.7978845608028654 * (y + 0.044715 * y * y * y)
    z = tl.minimum(tl.maximum(z, -20.0), 20.0)  # tanh is +-1 in fp32 well before; exp stays finite
    return 0.5 * y * (2.0 - 2.0 / (tl.exp(2.0 * z) + 1.0))


@triton.jit
def _segment_dot(x_ptrs, w_ptrs, m_ok, n_ok, offs_k, lo, hi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """sum over k in [lo, hi) of x[m, k] * w[n, k] for the tile, from zero, in ascending k16 steps."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(lo, hi, BLOCK_K):
        k_ok = offs_k + k0 < hi
        a = tl.load(x_ptrs + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptrs + k0, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        if UPCAST_DOT:  # the interpreter has no bf16 matmul
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
        else:
            acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _epilogue(acc, b_ptr, out_ptr, offs_m, offs_n, m_ok, n_ok, stride_om, HAS_BIAS: tl.constexpr,
              GELU: tl.constexpr):
    """bias, GELU, rounding and the store: one helper, so both paths do the same operations."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if GELU:
        acc = _gelu_tanh(acc)
    o_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, count_ptr, M, N, K, stride_xm, stride_om,
                   HAS_BIAS: tl.constexpr, GELU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SEGMENT_K: tl.constexpr, SPLIT: tl.constexpr,
                   UPCAST_DOT: tl.constexpr):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * tiles_n
    first_m = (pid // in_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_m
    pid_n = (pid % in_group) // group_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * K + offs_k[:, None]
    num_seg = tl.cdiv(K, SEGMENT_K)
    if SPLIT:  # this program: segment program_id(1); the last of the tile's programs to finish folds
        seg = tl.program_id(1)
        acc = _segment_dot(x_ptrs, w_ptrs, m_ok, n_ok, offs_k, seg * SEGMENT_K, tl.minimum(K, seg * SEGMENT_K + SEGMENT_K),
                           BLOCK_M, BLOCK_N, BLOCK_K, UPCAST_DOT)
        # partials [num_seg, tiles, BLOCK_M, BLOCK_N] fp32, a tile's block contiguous
        tile = pid_m * tiles_n + pid_n
        block = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tl.store(part_ptr + (seg * tiles_m * tiles_n + tile).to(tl.int64) * BLOCK_M * BLOCK_N + block, acc)
        tl.debug_barrier()  # every thread's partial is written before the count says so
        done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if done == num_seg - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(0, num_seg):  # ascending, whichever program arrived last
                total += tl.load(part_ptr + (s * tiles_m * tiles_n + tile).to(tl.int64) * BLOCK_M * BLOCK_N + block,
                                 cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + tile, 0)  # ready for the next launch (and graph replay)
            _epilogue(total, b_ptr, out_ptr, offs_m, offs_n, m_ok, n_ok, stride_om, HAS_BIAS, GELU)
    elif SEGMENT_K >= K:  # one segment: no fold
        acc = _segment_dot(x_ptrs, w_ptrs, m_ok, n_ok, offs_k, 0, K, BLOCK_M, BLOCK_N, BLOCK_K, UPCAST_DOT)
        _epilogue(acc, b_ptr, out_ptr, offs_m, offs_n, m_ok, n_ok, stride_om, HAS_BIAS, GELU)
    else:  # every segment in this program, folded in the same order
        total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for s in range(0, num_seg):
            total += _segment_dot(x_ptrs, w_ptrs, m_ok, n_ok, offs_k, s * SEGMENT_K,
                                  tl.minimum(K, s * SEGMENT_K + SEGMENT_K), BLOCK_M, BLOCK_N, BLOCK_K, UPCAST_DOT)
        _epilogue(total, b_ptr, out_ptr, offs_m, offs_n, m_ok, n_ok, stride_om, HAS_BIAS, GELU)


def _arrival_counts(device: torch.device, tiles: int) -> torch.Tensor:
    """Per-tile arrival counters of the split path: zero between launches (a tile's last program
    puts its counter back), shared by the split launches on a device, which one stream orders.
    Made before graphs are captured (check_configs at start-up makes them): made during a capture,
    they would be the graph's memory."""
    assert tiles <= COUNTERS
    key = ("linear-counters", device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing() and not has_scratch(key):
        raise RuntimeError("invariant_linear: run check_configs (or any split launch) before capturing graphs")
    return scratch(key, tiles, torch.int32, device, min_size=COUNTERS, zeroed=True)


def segment_k(k: int) -> int:
    """Columns per K segment of a weight with k columns: a function of the weight alone, so a row's
    summation order never depends on the batch."""
    return k if k <= ONE_SEGMENT_MAX_K else SEGMENT_K


def split_k(m: int, n: int, k: int, cfg: MatmulConfig, seg_k: int) -> bool:
    """Whether to spread the K segments over programs: when the output tiles alone leave most of
    the GPU idle (small batches on narrow weights). Either way gives the same bits."""
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    return _split_ok and seg_k < k and tiles <= SPLIT_MAX_TILES


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gelu: bool = False,
                     out: torch.Tensor | None = None, cfg: MatmulConfig | None = None,
                     split: bool | None = None, seg_k: int | None = None) -> torch.Tensor:
    """act(x @ weight.T + bias), each row bitwise independent of the batch (see the module docstring).
    `cfg`, `split`, `seg_k`: other than the defaults (the start-up check, tests, benchmarks); `seg_k`
    changes the bits, `cfg` and `split` do not."""
    assert x.dim() == 2 and x.stride(1) == 1, "x: [M, K], last dim contiguous"
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape == (n, k) and weight.is_contiguous() and weight.dtype == x.dtype
    assert x.dtype in (torch.float16, torch.bfloat16), "fp16 or bf16"
    if out is None:
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    assert out.shape == (m, n) and out.stride(1) == 1
    if m == 0:
        return out
    cfg = cfg or config(n, k, m)
    seg_k = seg_k or segment_k(k)
    assert seg_k >= k or seg_k % cfg.block_k == 0, "segments of whole K tiles"
    split = split_k(m, n, k, cfg, seg_k) if split is None else split and seg_k < k
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    num_seg = triton.cdiv(k, seg_k)
    if split:
        part = torch.empty(num_seg * tiles * cfg.block_m * cfg.block_n, device=x.device, dtype=torch.float32)
        counts = _arrival_counts(x.device, tiles)
    else:
        part = counts = out
    # One row's stride is never read, and torch keeps a parent's (say a padded one) on a one-row
    # slice: pass the dense one so that M = 1 compiles the variant every other M uses.
    stride_xm, stride_om = (k, n) if m == 1 else (x.stride(0), out.stride(0))
    _linear_kernel[(tiles, num_seg if split else 1)](
        x, weight, bias if bias is not None else weight, out, part, counts, m, n, k, stride_xm, stride_om,
        HAS_BIAS=bias is not None, GELU=gelu, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, SEGMENT_K=seg_k, SPLIT=split, UPCAST_DOT=_INTERPRET and x.dtype == torch.bfloat16,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=FP_FUSION)
    return out
