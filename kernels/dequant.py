"""A quantized weight dequantized into memory, for the weight-only linears' prefill-sized GEMMs: at
many rows the 16-bit GEMM of cuBLAS on the dequantized weight (a transient [N, K] buffer) is far
faster than dequantizing in registers once per row tile (kernels/wo_matmul.py took 14 ms for the
Llama-3.1-8B gate/up projection at 2048 rows on an H100, bf16 cuBLAS 0.6 ms), and the result is the
CPU path's: the weight the CPU dequantizes at load, times x, in one 16-bit GEMM.

Contract (semantics = ``kernels.quant_reference.dequant_int4`` / ``dequant_fp8``, bit for bit):
  weight  int4 [N, K // 8] int32 (kernels/wo_matmul.py's layout) with zero [N, groups] uint8, or fp8
          [N, K] float8_e4m3fn (decoded from its bits) with zero None; contiguous
  scale   [N, groups] fp32 contiguous, groups = ceil(K / group) (group >= K: one per output channel)
  g_idx   optional [K] int32: column k's group (GPTQ's desc_act), else k // group; with it, scale and
          zero may hold any number of groups G > max(g_idx) (a row-parallel rank's share keeps all)
  dtype   float16 / bfloat16 / float32
  returns [N, K] dtype: round((q - zero) * scale) (int4) or round(weight * scale) (fp8), computed in
          fp32 and rounded once to nearest-even (kernels/rounding.py)

Grid: (cdiv(N, BLOCK_N), cdiv(K, BLOCK_K)); each int4 word loaded once, its eight values spread
along K in registers.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.rounding import round_to
from kernels.wo_matmul import dequant_tile

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, z_ptr, gidx_ptr, out_ptr, N, K, group, groups, INT4: tl.constexpr,
                    HAS_GIDX: tl.constexpr, STEP_GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    kk = k0 + tl.arange(0, BLOCK_K)
    n64 = offs_n.to(tl.int64)[:, None]
    n_ok = offs_n < N
    w = dequant_tile(w_ptr, s_ptr, z_ptr, gidx_ptr, n64, n_ok, k0, kk, K, K, group, groups, INT4, HAS_GIDX, STEP_GROUP,
                     BLOCK_N, BLOCK_K)
    m = n_ok[:, None] & (kk < K)[None, :]
    tl.store(out_ptr + n64 * K + kk[None, :], round_to(w, out_ptr.dtype.element_ty), mask=m)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int,
               dtype: torch.dtype, g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """The int4 (zero given) or fp8 layout's weight [N, K] in `dtype`. See the module docstring."""
    int4 = zero is not None
    n = weight.shape[0]
    k = weight.shape[1] * 8 if int4 else weight.shape[1]
    assert weight.is_contiguous() and (weight.dtype == torch.int32 if int4 else weight.dtype == torch.float8_e4m3fn)
    groups = scale.shape[1] if g_idx is not None else triton.cdiv(k, group) if group < k else 1  # g_idx: any
    assert scale.shape == (n, groups) and scale.dtype == torch.float32 and scale.is_contiguous()
    assert zero is None or (zero.shape == scale.shape and zero.dtype == torch.uint8 and zero.is_contiguous())
    assert g_idx is None or (g_idx.shape == (k,) and g_idx.dtype == torch.int32)
    out = torch.empty((n, k), dtype=dtype, device=weight.device)
    if n and k:
        bn, bk = (16, 128) if _INTERPRET else (32, 128)
        _dequant_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk))](
            weight if int4 else weight.view(torch.uint8), scale, zero if int4 else scale,
            g_idx if g_idx is not None else scale, out, n, k, min(group, max(k, 1)), groups, INT4=int4,
            HAS_GIDX=g_idx is not None, STEP_GROUP=g_idx is None and (group >= k or group % bk == 0), BLOCK_N=bn,
            BLOCK_K=bk, num_warps=1 if _INTERPRET else 4)
    return out
