"""PyTorch references of the quantized-weight kernels (kernels/fp8_quant.py, fp8_matmul.py,
wo_matmul.py), and the dequantization of the layouts they read. They run the math in fp32 and are
slow and plainly right; the models' CPU path dequantizes weights at load with the same functions
(``dequant_int4``, ``dequant_fp8``), so what the CPU serves is what these references define.

Layouts (all [N, ...] with N, the output features, first, as nn.Linear keeps its weight):
  int4    qweight [N, K // 8] int32: element k of row n is bits 4*(k % 8) .. 4*(k % 8) + 3 of
          word k // 8, an unsigned value 0..15; scale [N, ceil(K / group)] fp32 and zero
          [N, ceil(K / group)] uint8 (0..15; 8 for symmetric checkpoints): w = (q - zero) * scale;
          with a g_idx [K] (GPTQ's desc_act), column k's group is g_idx[k], of any number of groups.
  fp8     weight [N, K] float8_e4m3fn; scale [N, ceil(K / group)] fp32 (group >= K: one scale per
          output channel; 128 for the 128x128-block checkpoints, each block's scale repeated over
          its rows): w = weight * scale.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def _per_column(t: torch.Tensor, group: int, k: int, g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """[N, ceil(K / group)] -> [N, K]: each group's value over its columns (column k's group is
    g_idx[k] where given, else k // group)."""
    if g_idx is not None:
        return t[:, g_idx.long()]
    return t.repeat_interleave(min(group, k), dim=1)[:, :k]


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] integers 0..15 (K a multiple of 8) -> [N, K // 8] int32 in the int4 layout above."""
    n, k = q.shape
    words = (q.to(torch.int64).reshape(n, k // 8, 8) << (4 * torch.arange(8, device=q.device))).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the bits, as int32


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """[N, K // 8] int32 -> [N, K] uint8 values 0..15."""
    shifts = 4 * torch.arange(8, device=qweight.device, dtype=torch.int32)
    return ((qweight[:, :, None] >> shifts) & 0xF).reshape(qweight.shape[0], -1).to(torch.uint8)


def dequant_int4(qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int, dtype: torch.dtype,
                 g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """The int4 layout's weight [N, K] in `dtype`: (q - zero) * scale in fp32, rounded once; column
    k's scale and zero those of group g_idx[k] where given (GPTQ's desc_act), else k // group."""
    q = unpack_int4(qweight).float()
    k = q.shape[1]
    return ((q - _per_column(zero.float(), group, k, g_idx)) * _per_column(scale.float(), group, k, g_idx)).to(dtype)


def dequant_fp8(weight: torch.Tensor, scale: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """The fp8 layout's weight [N, K] in `dtype`: weight * scale in fp32, rounded once."""
    return (weight.float() * _per_column(scale.float(), group, weight.shape[1])).to(dtype)


def quant_fp8_ref(x: torch.Tensor, group: int = 1 << 30,
                  static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q float8_e4m3fn [M, K], scale fp32 [M, ceil(K / group)]): per row and group of
    `group` columns, scale = max(amax|x| / 448, MIN_SCALE) (or static_scale for every row) and
    q = clamp(x / scale, -448, 448) rounded to nearest-even."""
    m, k = x.shape
    xf = x.float()
    if static_scale is not None:
        scale = static_scale.float().reshape(1, 1).expand(m, 1).contiguous()
        group = max(k, 1)
    else:
        group = min(group, max(k, 1))
        pad = -k % group
        g = torch.nn.functional.pad(xf.abs(), (0, pad)).reshape(m, (k + pad) // group, group)
        scale = torch.clamp(g.amax(-1) / FP8_MAX, min=MIN_SCALE)
    q = (xf / _per_column(scale, group, k)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def fp8_matmul_ref(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, group: int,
                   out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """sum over k of (a * a_scale)[m, k] * (b * b_scale)[n, k] (+ bias) in fp32, rounded once to
    out_dtype: a [M, K] fp8 with a_scale [M, ceil(K / group)], b [N, K] fp8 with b_scale
    [N, ceil(K / group)] (group >= K: one scale per row of each)."""
    k = a.shape[1]
    y = (a.float() * _per_column(a_scale, group, k)) @ (b.float() * _per_column(b_scale, group, k)).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def wo_matmul_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                  group: int, bias: torch.Tensor | None = None, g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w.T (+ bias) in fp32, rounded once to x's dtype, where w is the int4 (zero given)
    or fp8 (zero None) layout's weight dequantized to x's dtype (``dequant_int4``/``dequant_fp8``)."""
    w = dequant_int4(weight, scale, zero, group, x.dtype, g_idx) if zero is not None else \
        dequant_fp8(weight, scale, group, x.dtype)
    y = x.float() @ w.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
