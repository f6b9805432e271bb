"""The linear methods: how a `models.linear.Linear` stores a quantized weight and computes with it.

A method `create`s the linear's storage (the canonical tensors of scheme.py, under the names the
checkpoint's linear has, so the family's load_weights copies them as it copies a 16-bit weight),
`finish`es it after loading (quantizes a 16-bit weight for --quantization fp8, or dequantizes for
the 'dequant' mode: the linear is then a plain 16-bit Linear again), and `apply`s it:

  fp8, w8a8         activations quantized to FP8 (per token, per 128-column group, or with the
                    checkpoint's static scale; by the RMSNorm or silu_mul before the linear where
                    the family fuses it: `QuantizedInput`), except at one row, which the GEMV
                    reads in 16 bits (gemms.ONE_ROW_W8A16), then
                    the GEMM gemms.py picks by row count (torch._scaled_mm with rowwise scales
                    where its modes fit: one scale per row and channel, bf16 out, N and K multiples
                    of 16);
  fp8, weight_only  gemms.py's weight-only GEMMs (GPUs without FP8 tensor cores);
  int4              gemms.py's weight-only GEMMs: dequantized in registers up to 16 rows, into a
                    transient 16-bit weight for cuBLAS beyond.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from kernels.quant_reference import dequant_fp8, dequant_int4
from models.quant.fp8 import quantize_per_channel
from models.quant.gemms import QuantizedInput, fp8_linear, quantizes_input, weight_only_linear
from models.quant.scheme import PER_CHANNEL, QuantScheme
from models.quant.shards import whole_in_features


class ActivationFormat(NamedTuple):
    """What a w8a8 linear wants its input quantized as: `group` columns per scale, or one static scale."""
    group: int
    static_scale: torch.Tensor | None


def _param(linear: nn.Module, name: str, t: torch.Tensor) -> None:
    if name in linear._parameters:
        delattr(linear, name)
    setattr(linear, name, nn.Parameter(t, requires_grad=False))


def _groups(k: int, group: int) -> int:
    return 1 if group >= k else -(-k // group)


def _to_dense(linear: nn.Module, weight: torch.Tensor, drop: tuple[str, ...]) -> None:
    """The 'dequant' mode's end: a plain 16-bit Linear with the dequantized weight."""
    for name in drop:
        if name in linear._parameters:
            delattr(linear, name)
    _param(linear, "weight", weight)
    linear.quant = None


class Fp8Method:
    def __init__(self, scheme: QuantScheme, mode: str, dtype: torch.dtype) -> None:
        self.scheme, self.mode, self.dtype = scheme, mode, dtype

    def create(self, linear: nn.Module, device: torch.device) -> None:
        if self.scheme.online:
            return  # the checkpoint's 16-bit weight loads into the usual parameter; finish quantizes it
        n, k = linear.out_features, linear.in_features
        _param(linear, "weight", torch.empty(n, k, dtype=torch.float8_e4m3fn, device=device))
        _param(linear, "weight_scale", torch.empty(n, _groups(k, self.scheme.group), device=device))
        if self.scheme.activations == "static":
            _param(linear, "input_scale", torch.empty(1, device=device))

    def finish(self, linear: nn.Module) -> None:
        if self.scheme.online:
            q, scale = quantize_per_channel(linear.weight)
            _param(linear, "weight", q)
            _param(linear, "weight_scale", scale)
        if self.mode == "dequant":
            w = dequant_fp8(linear.weight, linear.weight_scale, self.scheme.group, self.dtype)
            _to_dense(linear, w, ("weight_scale", "input_scale"))
            return
        n, k = linear.weight.shape
        # torch._scaled_mm's rowwise mode: per-row and per-channel scales, bf16 out, 16-aligned shapes
        linear.scaled_mm = (self.mode == "w8a8" and self.scheme.group >= k and self.dtype == torch.bfloat16
                            and n % 16 == 0 and k % 16 == 0)

    def activation_format(self, linear: nn.Module, rows: int) -> ActivationFormat | None:
        """The FP8 format the linear reads `rows` rows in, or None: 16-bit (gemms.quantizes_input)."""
        if self.mode != "w8a8" or not quantizes_input(rows):
            return None
        return ActivationFormat(self.scheme.activation_group, getattr(linear, "input_scale", None))

    def apply(self, linear: nn.Module, x: torch.Tensor | QuantizedInput) -> torch.Tensor:
        if self.mode == "weight_only":
            return weight_only_linear(x, linear.weight, linear.weight_scale, None, self.scheme.group, linear.bias)
        return fp8_linear(x, linear.weight, linear.weight_scale, self.scheme.group, self.scheme.activation_group,
                          getattr(linear, "input_scale", None), self.dtype, linear.bias, linear.scaled_mm)


class Int4Method:
    def __init__(self, scheme: QuantScheme, mode: str, dtype: torch.dtype) -> None:
        self.scheme, self.mode, self.dtype = scheme, mode, dtype

    def create(self, linear: nn.Module, device: torch.device) -> None:
        n, k = linear.out_features, linear.in_features
        if k % 8:
            raise ValueError(f"int4 weights need input features divisible by 8 ({k})")
        # a row-parallel rank's share of a desc_act layer keeps every group's scales and zero points
        # (shards.py: its columns' groups lie anywhere in the layer)
        groups = _groups(whole_in_features(linear) if self.scheme.g_idx else k, self.scheme.group)
        if "weight" in linear._parameters:
            delattr(linear, "weight")
        _param(linear, "qweight", torch.empty(n, k // 8, dtype=torch.int32, device=device))
        _param(linear, "scales", torch.empty(n, groups, device=device))
        _param(linear, "zeros", torch.empty(n, groups, dtype=torch.uint8, device=device))
        if self.scheme.g_idx:
            _param(linear, "g_idx", torch.empty(k, dtype=torch.int32, device=device))

    def finish(self, linear: nn.Module) -> None:
        if self.mode == "dequant":
            w = dequant_int4(linear.qweight, linear.scales, linear.zeros, self.scheme.group, self.dtype,
                             getattr(linear, "g_idx", None))
            _to_dense(linear, w, ("qweight", "scales", "zeros", "g_idx"))

    def activation_format(self, linear: nn.Module, rows: int) -> ActivationFormat | None:
        return None

    def apply(self, linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return weight_only_linear(x, linear.qweight, linear.scales, linear.zeros, self.scheme.group, linear.bias,
                                  getattr(linear, "g_idx", None), getattr(linear, "input_bound", math.inf))


def make_method(scheme: QuantScheme, mode: str, dtype: torch.dtype) -> Fp8Method | Int4Method:
    return (Fp8Method if scheme.weights == "fp8" else Int4Method)(scheme, mode, dtype)


def merge_parts(leaf: str, pieces: list[torch.Tensor]) -> torch.Tensor:
    """One tensor of a merged projection (QKV, gate/up) from its parts', in order: stacked along the
    output features, except the input side's, which the parts share (they read one input): the
    static activation scale is the largest part's (nothing clips), g_idx must be the same."""
    if leaf == "input_scale":
        return torch.stack([p.reshape(()) for p in pieces]).max().reshape(1)
    if leaf == "g_idx":
        if any(not torch.equal(p, pieces[0]) for p in pieces[1:]):
            raise ValueError("the parts of a merged projection have different g_idx (GPTQ desc_act): not supported")
        return pieces[0]
    return torch.cat(pieces, dim=0)


__all__ = ["PER_CHANNEL", "QuantizedInput", "ActivationFormat", "Fp8Method", "Int4Method", "make_method",
           "merge_parts"]
