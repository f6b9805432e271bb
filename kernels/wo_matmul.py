"""Weight-only quantized GEMM: 16-bit activations times int4 (AWQ, GPTQ, compressed-tensors W4A16)
or fp8 weights (FP8 checkpoints on GPUs without FP8 tensor cores, compute capability < 8.9),
dequantized in registers, never in memory. At small M (decode) the weight bytes are the whole cost,
so a 4-bit weight is read in a quarter of a 16-bit one's time.

Contract (semantics = ``kernels.quant_reference.wo_matmul_ref`` up to the order of the fp32 sums):
  x       [M, K] float16 / bfloat16, last dim contiguous (row stride free), any M >= 0
  weight  int4: [N, K // 8] int32 (K a multiple of 8; element k of row n in bits 4*(k % 8) of word
          k // 8, unsigned 0..15); fp8: [N, K] float8_e4m3fn. Contiguous.
  scale   [N, ceil(K / group)] fp32 contiguous; group >= K means one scale per output channel
  zero    int4: [N, ceil(K / group)] uint8 contiguous (0..15); fp8: None
  g_idx   optional [K] int32: the group of each input column (GPTQ's desc_act: the groups are not in
          column order), which indexes scale and zero, of any number of groups G > max(g_idx) (a
          row-parallel rank's share of the columns keeps every group's); None: column k is in
          group k // group
  bias    [N] x's dtype, or None
  returns out [M, N] x's dtype: out[m, n] = sum_k x[m, k] * w[n, k] (+ bias), where
          w = round_to_x_dtype((q - zero) * scale) (int4, scale and zero of column k's group) or
          round_to_x_dtype(weight * scale) (fp8)
          is the weight the CPU path dequantizes at load, summed in fp32 on 16-bit tensor cores.

fp8 is decoded from its bits with integer arithmetic (exact, and no fp8 instruction: the point of
this path is GPUs that have none); each int4 word is loaded once and its eight values spread along
K in registers. Grid: (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N), splits), grouped along M; decode rows
(2 to 16; one row is kernels/gemv.py's) split K where the tiles alone are too few to keep every SM
streaming the weight (kernels/tiles.py). Where a K step lies in
one group (BLOCK_K divides the group, no g_idx) each row's scale and zero are loaded once a step;
otherwise the group of each column is computed (or read from g_idx) per element, so BLOCK_K need
not divide the group size and a K past the last full group is masked.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.rounding import round_to
from kernels.tiles import finish_tile, grouped_tile, k_range, split_buffers, split_plan, splits_for

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


class WoConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1  # 0: from the shape (kernels.tiles.splits_for)


def config(m: int, n: int, k: int) -> WoConfig:
    """Decode rows: narrow N tiles (enough programs to fill the SMs); prefill rows: 16-bit GEMM
    tiles. On an H100 at the Llama-3.1-8B shape (benchmarks/results/quant_h100.json) 64-wide decode
    tiles of 128-column K steps took 7.8 ms on the 28672 x 4096 gate/up projection at one row, and
    32 x 64 tiles were the fastest of the sweep (73-213 us on the four linears, still slower than
    bf16 cuBLAS); 32 x 128 is the decode tile the GPU tests ran."""
    if _INTERPRET:  # few, large tiles: the interpreter's cost is per program and per step
        return WoConfig(16, 64, 128, 1, 1)
    if m <= 16:
        return WoConfig(16, 32, 128, 4, 4, 0)
    if m <= 64:
        return WoConfig(64, 64, 128, 4, 3)
    return WoConfig(128, 128, 64, 8, 3)


@triton.jit
def fp8_bits_to_f32(b):
    """float8_e4m3fn bits (int32 0..255) -> fp32, exactly (NaN, 0x7F/0xFF, never occurs in weights)."""
    sign = (b & 0x80) << 24
    e = (b >> 3) & 0xF
    m = b & 0x7
    normal = (sign | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125  # 2^-9
    sub = tl.where(sign != 0, -sub, sub)
    return tl.where(e == 0, sub, normal)


@triton.jit
def dequant_tile(w_ptr, s_ptr, z_ptr, gidx_ptr, n64, n_ok, k0, kk, k_end, K, group, groups, INT4: tl.constexpr,
                 HAS_GIDX: tl.constexpr, STEP_GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The weight's rows n64 ([BLOCK_N, 1] int64; n_ok: [BLOCK_N]) at columns kk = k0 + arange(BLOCK_K)
    (those from k_end on masked), dequantized in fp32 (also kernels/dequant.py's tile): (q - zero) *
    scale for int4, weight * scale for fp8."""
    k_ok = kk < k_end
    mask = n_ok[:, None] & k_ok[None, :]
    if STEP_GROUP:  # the whole step inside one group: one scale (and zero) per row
        g = n64 * groups + k0 // group
        smask = n_ok[:, None]
    else:
        if HAS_GIDX:
            col_group = tl.load(gidx_ptr + kk, mask=k_ok, other=0)
        else:
            col_group = kk // group
        g = n64 * groups + col_group[None, :]
        smask = mask
    s = tl.load(s_ptr + g, mask=smask, other=0.0)
    if INT4:
        # each packed word loaded once, then its eight values spread along K in registers
        kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        words = tl.load(w_ptr + n64 * (K // 8) + kw[None, :], mask=n_ok[:, None] & (kw < k_end // 8)[None, :], other=0)
        words = tl.reshape(tl.broadcast_to(words[:, :, None], [BLOCK_N, BLOCK_K // 8, 8]), [BLOCK_N, BLOCK_K])
        q = (words >> ((kk % 8) * 4)[None, :]) & 0xF
        return (q.to(tl.float32) - tl.load(z_ptr + g, mask=smask, other=0).to(tl.float32)) * s
    bits = tl.load(w_ptr + n64 * K + kk[None, :], mask=mask, other=0).to(tl.int32) & 0xFF
    return fp8_bits_to_f32(bits) * s


@triton.jit
def _wo_matmul_kernel(x_ptr, w_ptr, s_ptr, z_ptr, gidx_ptr, bias_ptr, c_ptr, part_ptr, count_ptr, M, N, K,
                      k_per_split, group, groups, stride_xm, stride_cm, INT4: tl.constexpr, HAS_GIDX: tl.constexpr,
                      STEP_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, UPCAST_DOT: tl.constexpr, SPLIT: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    dt = x_ptr.dtype.element_ty
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    k_lo, k_hi = k_range(tl.program_id(1), K, k_per_split)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    n64 = offs_n.to(tl.int64)[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < k_hi
        x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = round_to(dequant_tile(w_ptr, s_ptr, z_ptr, gidx_ptr, n64, n_ok, k0, kk, k_hi, K, group, groups, INT4,
                                  HAS_GIDX, STEP_GROUP, BLOCK_N, BLOCK_K), dt)
        if UPCAST_DOT:  # the interpreter holds bf16 as bits: its dot takes fp32 (exact products)
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)))
        else:
            acc += tl.dot(x, tl.trans(w), out_dtype=tl.float32)
    finish_tile(acc, bias_ptr, c_ptr, offs_m, offs_n, m_ok, n_ok, stride_cm, part_ptr, count_ptr, SPLIT, HAS_BIAS,
                BLOCK_M, BLOCK_N)


def wo_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int,
              bias: torch.Tensor | None = None, g_idx: torch.Tensor | None = None,
              cfg: WoConfig | None = None) -> torch.Tensor:
    """x [M, K] @ dequant(weight)[N, K].T -> [M, N] in x's dtype. See the module docstring."""
    m, k = x.shape
    n = weight.shape[0]
    int4 = zero is not None
    assert x.dtype in (torch.float16, torch.bfloat16) and x.stride(1) == 1 and weight.is_contiguous()
    if int4:
        assert weight.dtype == torch.int32 and k % 8 == 0 and weight.shape == (n, k // 8), "int4: [N, K // 8] int32"
        assert zero.dtype == torch.uint8 and zero.shape == scale.shape and zero.is_contiguous()
    else:
        assert weight.dtype == torch.float8_e4m3fn and weight.shape == (n, k), "fp8: [N, K]"
        weight = weight.view(torch.uint8)
    # with g_idx the scales are gathered by it: any number of groups (a row-parallel rank's share of a
    # desc_act layer keeps every group's)
    groups = scale.shape[1] if g_idx is not None else -(-k // group) if group < k else 1
    assert scale.shape == (n, groups) and scale.dtype == torch.float32 and scale.is_contiguous()
    assert bias is None or (bias.shape == (n,) and bias.dtype == x.dtype)
    assert g_idx is None or (g_idx.shape == (k,) and g_idx.dtype == torch.int32)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m and n:
        cfg = cfg or config(m, n, k)
        tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
        per, splits = split_plan(k, cfg.block_k, cfg.split_k or splits_for(tiles, k, cfg.block_k, x.device))
        part, count = split_buffers(x.device, tiles, splits, cfg.block_m * cfg.block_n) if splits > 1 else (out, out)
        _wo_matmul_kernel[(tiles, splits)](x, weight, scale, zero if int4 else scale,
                                           g_idx if g_idx is not None else scale, bias if bias is not None else out,
                                           out, part, count, m, n, k, per, min(group, max(k, 1)), groups, x.stride(0),
                                           out.stride(0), INT4=int4, HAS_GIDX=g_idx is not None,
                                           STEP_GROUP=g_idx is None and (group >= k or group % cfg.block_k == 0),
                                           HAS_BIAS=bias is not None, UPCAST_DOT=_INTERPRET, SPLIT=splits > 1,
                                           BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=8,
                                           num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
