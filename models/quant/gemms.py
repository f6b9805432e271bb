"""Which kernel a quantized linear's GEMM runs, by its row count (the linear methods of methods.py
call these; benchmarks/quant/bench_quant.py times them as "ours"):

  rows       fp8 weights, FP8 activations (w8a8)             int4 (or fp8) weights, 16-bit activations
  1          kernels/gemv.py fp8_gemv of the 16-bit row as      kernels/gemv.py wo_gemv (int4 in
             it is (ONE_ROW_W8A16), else of the row quantized   fp16 pairs where x's bound allows)
             by the norm or silu_mul before, or in the GEMV
  2 - 16     kernels/fp8_matmul.py, K split to fill the SMs     kernels/wo_matmul.py, K split likewise
  more       torch._scaled_mm (rowwise scales, bf16 out,        kernels/dequant.py into a transient
             aligned), else kernels/fp8_matmul.py               16-bit weight, then cuBLAS

At up to 16 rows a GEMM streams its weight once and its cost is the weight's bytes; from there on
it is compute bound, where cuBLAS (and cuBLASLt's FP8 GEMM) beat in-register dequantization once
per row tile. The row count alone decides, so a decode step of 13 rows and its CUDA graph, padded
to 16, run the same kernels with the same tiles: a row's bits do not depend on the padding.

An int4 GEMV takes kernels/gemv_int4.py's half2 loop (two weights an instruction: at one row of
the Llama-3.1-8B shape on an H100, qkv_proj 14.3 -> 9.3 us, gate_up_proj 53.6 -> 30.7;
benchmarks/results/quant_h100.json) where the linear's `input_bound` (models/quant
bound_norm_inputs: an RMSNorm's output) keeps every |x| within its fp16 range. Other int4 linears
(o_proj, down_proj: their inputs have no such bound) keep the fp32 loop, or with HALF2_PRESCALE the
half2 loop with each K step scaled by a power of two; g_idx layers keep the fp32 loop.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels.dequant import dequantize
from kernels.fp8_matmul import fp8_matmul
from kernels.fp8_quant import quant_fp8
from kernels.gemv import fp8_gemv, wo_gemv
from kernels.gemv_int4 import HALF2_X_BOUND
from kernels.wo_matmul import wo_matmul

DECODE_ROWS = 16  # rows up to which the weight is streamed by the decode kernels
# int4 GEMVs of unbounded inputs (o_proj, down_proj) through the half2 loop with its per-step power
# of two (PRESCALE): ~5.5 SASS instructions a weight where the plain half2 loop takes 4.5 and the
# fp32 loop 9.9 (sm_90, triton 3.6: benchmarks/kernels/gemv_ir.py). The AWQ engine's batch-1 TPOT
# on the Llama-3.1-8B shape 3.706 -> 3.186 ms with it (H200, both with PDL on, bench_quant
# awq+pdl against awq+prescale+pdl, 2026-11-28)
HALF2_PRESCALE = True
# an FP8 GEMV of a 16-bit row (o_proj's input: no launch before quantizes it) after its own quant_fp8
# launch, instead of quantizing inside the GEMV, where each program reduces the whole row for its
# scale: o_proj at one row 16.4 us against 9.3 us pre-quantized (H100, quant_h100.json). The same
# bits either way (gemv.py's contract). The FP8_DYNAMIC engine's batch-1 TPOT 3.856 -> 3.453 ms with
# it (H200, with PDL on, bench_quant fp8-dynamic+pdl against fp8-dynamic+quantfirst+pdl, 2026-11-28).
# (With ONE_ROW_W8A16 on, the default, a 16-bit row is not quantized at all: this applies off only.)
FP8_GEMV_QUANT_FIRST = True
# At one row a w8a8 linear's GEMV reads its input unquantized (w8a16). FP8 activations exist for FP8
# tensor-core GEMMs; a GEMV's products run on CUDA cores in fp32 either way, so quantizing a row
# there costs launches (the norms' and silu_mul's amax passes, o_proj's quant_fp8) and adds an error
# the checkpoint's dequantized-weight reference does not have. Rows 2 - 16 and up keep FP8
# activations (fp8_matmul, torch._scaled_mm). Read through `quantizes_input`, so the norm and
# silu_mul before the linear produce 16-bit rows at one row. One exception to "the row count alone
# decides": a prefill CUDA graph pads a one-token step to its smallest size (16 tokens), so there such
# a step reads FP8 activations, where run eagerly (prompt_logprobs, no graphs) it reads 16 bits; the
# two differ by FP8 activations' error, as w8a8 and the dequantized reference do.
ONE_ROW_W8A16 = True


class QuantizedInput(NamedTuple):
    """A linear's input already quantized to FP8 (by the norm or silu_mul before it): q [M, K],
    scale [M, groups]."""
    q: torch.Tensor
    scale: torch.Tensor


def quantizes_input(rows: int) -> bool:
    """Whether a w8a8 linear reads `rows` rows in FP8 (else 16-bit: ONE_ROW_W8A16)."""
    return rows != 1 or not ONE_ROW_W8A16


def fp8_linear(x: torch.Tensor | QuantizedInput, weight: torch.Tensor, weight_scale: torch.Tensor, group: int,
               act_group: int, input_scale: torch.Tensor | None, dtype: torch.dtype, bias: torch.Tensor | None,
               scaled_mm: bool) -> torch.Tensor:
    """x [M, K] (16-bit, or quantized) @ the FP8 weight [N, K].T, activations in FP8: per token
    (act_group >= K), per act_group columns (128-block weights, group == act_group == 128), or
    with input_scale; except one 16-bit row, read unquantized (ONE_ROW_W8A16); `scaled_mm`:
    torch._scaled_mm's rowwise mode fits this weight."""
    quantized = isinstance(x, QuantizedInput)
    rows = x.q.shape[0] if quantized else x.shape[0]
    if rows == 1:
        if quantized:
            return fp8_gemv(x.q, x.scale, weight, weight_scale, group, dtype, bias)
        if ONE_ROW_W8A16 and x.dtype in (torch.float16, torch.bfloat16):
            return fp8_gemv(x, None, weight, weight_scale, group, dtype, bias, weight_only=True)
        if FP8_GEMV_QUANT_FIRST:
            return fp8_gemv(*quant_fp8(x, act_group, input_scale), weight, weight_scale, group, dtype, bias)
        return fp8_gemv(x, None, weight, weight_scale, group, dtype, bias, act_group, input_scale)
    q, scale = x if quantized else quant_fp8(x, act_group, input_scale)
    if scaled_mm and rows > DECODE_ROWS:
        out = torch._scaled_mm(q, weight.t(), scale_a=scale, scale_b=weight_scale.view(1, -1), out_dtype=dtype)
        return out if bias is None else out.add_(bias)
    return fp8_matmul(q, scale, weight, weight_scale, group, dtype, bias)


def weight_only_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                       group: int, bias: torch.Tensor | None, g_idx: torch.Tensor | None = None,
                       input_bound: float = math.inf) -> torch.Tensor:
    """x [M, K] (16-bit) @ the int4 (zero given) or fp8 weight dequantized, [N, K].T; `input_bound`:
    a bound on every |x| the linear can be given (an int4 GEMV within HALF2_X_BOUND takes the half2
    loop)."""
    rows = x.shape[0]
    if rows == 1:
        bounded = input_bound <= HALF2_X_BOUND
        return wo_gemv(x, weight, scale, zero, group, bias, g_idx, half2=bounded or HALF2_PRESCALE, prescale=not bounded)
    if rows <= DECODE_ROWS:
        return wo_matmul(x, weight, scale, zero, group, bias, g_idx)
    return F.linear(x, dequantize(weight, scale, zero, group, x.dtype, g_idx), bias)


__all__ = ["DECODE_ROWS", "QuantizedInput", "fp8_linear", "quantizes_input", "weight_only_linear"]
