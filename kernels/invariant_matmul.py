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
configs that give the same bits (see _BUCKETS). No split-K: a K split would need a reduction
whose order is fixed too, and at small M the N tiles alone keep enough programs busy for these
shapes.

Grid: (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),), grouped along M so that consecutive programs share
weight tiles in L2. Tile sizes from a sweep on an H100 (benchmarks/results/invariant_kernels_h100.json).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


class MatmulConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 8


# (most rows, config) by the launch's row count. Every config is a 64- or 128-row tile of Hopper's
# wgmma, whose k16 steps accumulate each output element in the same order whatever the tile's M, N,
# BLOCK_K, warps or stages; measured bitwise equal on an H100 (bench_invariant_kernels.py,
# config_equivalence: 40 of 40 shapes x row counts, 7 configs) and checked again at start-up by
# ``check_buckets``, which falls back to the first config for every M where it fails.
_BUCKETS = ((128, MatmulConfig(64, 64, 128, 4, 3)),  # decode: weight-bandwidth bound, many programs
            (1024, MatmulConfig(64, 128, 64, 4, 3)),
            (1 << 62, MatmulConfig(128, 128, 64, 8, 3)))  # prefill: compute bound, big tiles
_buckets_ok = True
# No FMA contraction: the epilogue (bias, GELU) is then the same IEEE operations in every config's
# compiled kernel by construction, not by the compiler fusing alike per tile shape (on the H100 the
# buckets measured bitwise equal with contraction on as well).
FP_FUSION = False


def config(n: int, k: int, m: int = 1) -> MatmulConfig:
    """The launch configuration of a weight [n, k] for m rows (only ever one config per weight
    if the start-up check found that the buckets differ in bits)."""
    if _INTERPRET:  # programs run one by one in numpy: few, large tiles
        return MatmulConfig(64, 64, 128, 1, 1)
    if not _buckets_ok:
        return _BUCKETS[0][1]
    return next(cfg for most, cfg in _BUCKETS if m <= most)


def check_buckets(device: torch.device, shapes: tuple = ((2304, 768), (3072, 768), (768, 3072), (4096, 4096))
                  ) -> bool:
    """Whether every bucket's config gives the same bits as the first on this GPU, with and without
    bias and GELU (it has on the H100); if not, one config serves every M from now on. Run once at
    start-up, before graphs."""
    global _buckets_ok
    if _INTERPRET or device.type != "cuda":
        return True
    g = torch.Generator(device=device).manual_seed(0)
    ok = True
    for n, k in shapes:
        w = (torch.randn(n, k, device=device, generator=g) / k**0.5).half()
        b = torch.randn(n, device=device, generator=g).half()
        x = torch.randn(512, k, device=device, generator=g).half()
        for bias, gelu in ((None, False), (b, True)):
            outs = [invariant_linear(x, w, bias, gelu, cfg=cfg) for _, cfg in _BUCKETS]
            ok &= all(torch.equal(o.view(torch.int16), outs[0].view(torch.int16)) for o in outs[1:])
    _buckets_ok = ok
    return ok


@triton.jit
def _gelu_tanh(y):
    # 0.5 * y * (1 + tanh(sqrt(2 / pi) * (y + 0.044715 * y^3))), tanh(z) = 1 - 2 / (exp(2z) + 1)
    z = 0.7978845608028654 * (y + 0.044715 * y * y * y)
    z = tl.minimum(tl.maximum(z, -20.0), 20.0)  # tanh is +-1 in fp32 well before; exp stays finite
    return 0.5 * y * (2.0 - 2.0 / (tl.exp(2.0 * z) + 1.0))


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_om,
                   HAS_BIAS: tl.constexpr, GELU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, UPCAST_DOT: tl.constexpr):
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
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k + k0 < K
        a = tl.load(x_ptrs + k0, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptrs + k0, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        if UPCAST_DOT:  # the interpreter has no bf16 matmul
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
        else:
            acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if GELU:
        acc = _gelu_tanh(acc)
    o_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, gelu: bool = False,
                     out: torch.Tensor | None = None, cfg: MatmulConfig | None = None) -> torch.Tensor:
    """act(x @ weight.T + bias), each row bitwise independent of the batch (see the module docstring).
    `cfg`: a launch configuration other than ``config``'s (the start-up check, benchmarks)."""
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
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    # One row's stride is never read, and torch keeps a parent's (say a padded one) on a one-row
    # slice: pass the dense one so that M = 1 compiles the variant every other M uses.
    stride_xm, stride_om = (k, n) if m == 1 else (x.stride(0), out.stride(0))
    _linear_kernel[grid](x, weight, bias if bias is not None else weight, out, m, n, k, stride_xm, stride_om,
                         HAS_BIAS=bias is not None, GELU=gelu, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                         BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, UPCAST_DOT=_INTERPRET and x.dtype == torch.bfloat16,
                         num_warps=cfg.num_warps,
                         num_stages=cfg.num_stages, enable_fp_fusion=FP_FUSION)
    return out
