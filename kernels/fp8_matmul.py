"""FP8 x FP8 GEMM with scales per row and per group of K: the 128x128-block checkpoints (Qwen3-FP8,
DeepSeek's layout), and per-channel FP8 where torch._scaled_mm's modes do not fit (an fp16 output).

Contract (semantics = ``kernels.quant_reference.fp8_matmul_ref`` up to the order of the fp32 sums):
  a         [M, K] float8_e4m3fn, last dim contiguous (row stride free), any M >= 0
  a_scale   [M, ceil(K / group)] fp32, last dim contiguous: a's scale per row and group of columns
  b         [N, K] float8_e4m3fn contiguous (nn.Linear's layout)
  b_scale   [N, ceil(K / group)] fp32 contiguous (a 128x128 block's scale repeated over its rows)
  group     a multiple of the config's BLOCK_K (128: the 128x128-block checkpoints), or >= K for one
            scale per row
  bias      [N] out_dtype, or None
  returns   out [M, N] out_dtype (float16 / bfloat16 / float32):
            out[m, n] = sum_g a_scale[m, g] * b_scale[n, g] * sum_{k in g} a[m, k] * b[n, k] (+ bias),
            the dot of each group on fp8 tensor cores into fp32, scaled and summed in fp32, rounded
            once to nearest-even.

Grid: (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N), splits) programs, grouped along M so that consecutive
programs share b's tiles in L2. With block scales each K step is one group (BLOCK_K = 128). Decode
rows (2 to 16; one row is kernels/gemv.py's) split K where the tiles alone are too few to keep every
SM streaming b: fp32 partials, added in split order by each tile's last program (kernels/tiles.py).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.tiles import finish_tile, grouped_tile, k_range, split_buffers, split_plan, splits_for

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


class Fp8MatmulConfig(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    block_k: int = 128  # with block scales, at most the group (one group per step)
    split_k: int = 1  # 0: from the shape (kernels.tiles.splits_for)


def config(m: int, n: int, per_group: bool = False) -> Fp8MatmulConfig:
    """Tiles by row count: decode rows stream b (small tiles, many programs, 256-column K steps: the
    best of benchmarks/quant/bench_quant.py's sweep on an H100 at the Llama-3.1-8B shape, 128-wide tiles
    for the 28672-row gate/up projection; K split where the tiles are fewer than four a SM), prefill
    is compute bound. With block scales the prefill tile is 64 x 128 on 4 warps (vLLM's default for
    these checkpoints): compiled for sm_90, 128 x 128 on 8 warps needs 255 registers and spills, its
    second accumulator (the group's dot before its scales) being another 64 a thread."""
    if _INTERPRET:  # few, large tiles: the interpreter's cost is per program and per step
        return Fp8MatmulConfig(16, 64, 1, 1)
    if m <= 16:
        return Fp8MatmulConfig(16, 128 if n > 8192 else 64, 4, 4, 256, 0)
    if m <= 64:
        return Fp8MatmulConfig(64, 64, 4, 4)
    return Fp8MatmulConfig(64, 128, 4, 3) if per_group else Fp8MatmulConfig(128, 128, 8, 3)


@triton.jit
def _fp8_matmul_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, c_ptr, part_ptr, count_ptr, M, N, K, k_per_split, group,
                       stride_am, stride_as, stride_bs, stride_cm, HAS_BIAS: tl.constexpr, PER_GROUP: tl.constexpr,
                       SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    k_lo, k_hi = k_range(tl.program_id(1), K, k_per_split)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am
    b_rows = b_ptr + offs_n.to(tl.int64)[:, None] * K
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_ok = (k0 + offs_k) < k_hi
        a = tl.load(a_rows + (k0 + offs_k)[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_rows + (k0 + offs_k)[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        part = tl.dot(a, tl.trans(b), out_dtype=tl.float32)
        if PER_GROUP:
            g = k0 // group
            sa = tl.load(as_ptr + offs_m * stride_as + g, mask=m_ok, other=0.0)
            sb = tl.load(bs_ptr + offs_n * stride_bs + g, mask=n_ok, other=0.0)
            acc += part * sa[:, None] * sb[None, :]
        else:
            acc += part
    if not PER_GROUP:
        sa = tl.load(as_ptr + offs_m * stride_as, mask=m_ok, other=0.0)
        sb = tl.load(bs_ptr + offs_n * stride_bs, mask=n_ok, other=0.0)
        acc = acc * sa[:, None] * sb[None, :]
    finish_tile(acc, bias_ptr, c_ptr, offs_m, offs_n, m_ok, n_ok, stride_cm, part_ptr, count_ptr, SPLIT, HAS_BIAS,
                BLOCK_M, BLOCK_N)


def fp8_matmul(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, group: int,
               out_dtype: torch.dtype, bias: torch.Tensor | None = None,
               cfg: Fp8MatmulConfig | None = None) -> torch.Tensor:
    """a [M, K] fp8 @ b[N, K].T with per-row/per-group scales -> [M, N] out_dtype. See the module docstring."""
    m, k = a.shape
    n = b.shape[0]
    assert a.dtype == b.dtype == torch.float8_e4m3fn and a.stride(1) == 1 and b.is_contiguous() and b.shape[1] == k
    groups = -(-k // group) if group < k else 1
    assert a_scale.shape == (m, groups) and b_scale.shape == (n, groups), "scales: [rows, ceil(K / group)]"
    assert a_scale.dtype == b_scale.dtype == torch.float32 and a_scale.stride(1) == 1 and b_scale.is_contiguous()
    per_group = groups > 1
    cfg = cfg or config(m, n, per_group)
    if per_group:
        cfg = cfg._replace(block_k=min(cfg.block_k, 128))
    assert not per_group or group % cfg.block_k == 0, "group: a multiple of BLOCK_K, or >= K"
    assert bias is None or (bias.shape == (n,) and bias.dtype == out_dtype)
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m and n:
        tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
        per, splits = split_plan(k, cfg.block_k, cfg.split_k or splits_for(tiles, k, cfg.block_k, a.device))
        part, count = split_buffers(a.device, tiles, splits, cfg.block_m * cfg.block_n) if splits > 1 else (out, out)
        _fp8_matmul_kernel[(tiles, splits)](a, a_scale, b, b_scale, bias if bias is not None else out, out, part, count,
                                            m, n, k, per, group, a.stride(0), a_scale.stride(0), b_scale.stride(0),
                                            out.stride(0), HAS_BIAS=bias is not None, PER_GROUP=per_group,
                                            SPLIT=splits > 1, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                                            BLOCK_K=cfg.block_k, GROUP_M=8, num_warps=cfg.num_warps,
                                            num_stages=cfg.num_stages)
    return out
