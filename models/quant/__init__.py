"""Quantized weights: FP8 and 4-bit checkpoints, and --quantization fp8 of a 16-bit one.

The loader (models/loader.py) asks `detect` what a checkpoint's weights are, builds the model with
its linears' 16-bit weights left unallocated (`models.linear.storage_later`), `attach`es a linear
method (methods.py) to every `models.linear.Linear` (under tensor parallelism with the Shards of its
rank's part of each tensor: shards.py), turns the checkpoint's tensors into the
canonical layout (`convert`), lets the family's load_weights copy them as usual, then `finish`es
the linears. Families take part in three places only: merged projections stack their parts'
tensors with `merge_parts`, the Llama family's RMSNorm and silu_mul quantize the next linear's
input in their own launches where it reads FP8 (`add_rmsnorm_for`, `silu_mul_for`; not one row:
gemms.ONE_ROW_W8A16), and GPT-2 transposes only its
16-bit Conv1D weights. `weights_info`
reports the weights' real bytes and format (the KV cache sizing, /v1/models, the start-up log).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from models.quant import awq, compressed_tensors, fp8, gptq
from models.quant.methods import ActivationFormat, QuantizedInput, make_method, merge_parts
from models.quant.scheme import METHODS, PER_CHANNEL, QuantScheme, compute_mode, refuse
from models.quant.shards import shard_quantized

FORMATS = {"compressed-tensors": compressed_tensors, "fp8": fp8, "awq": awq, "gptq": gptq}


@dataclass(frozen=True)
class WeightsInfo:
    quantization: str | None  # the scheme's name, None for 16-bit weights
    bytes: int  # every parameter and buffer of the model as it sits on its device


def detect(path: Path, quantization: str | None = None) -> QuantScheme | None:
    """The checkpoint's scheme from config.json's quantization_config; `quantization` is the
    --quantization flag (vLLM's): "fp8" quantizes a 16-bit checkpoint at load, and any value must
    agree with a quantized checkpoint's own method."""
    qcfg = json.loads((path / "config.json").read_text()).get("quantization_config")
    if quantization is not None and quantization not in METHODS:
        raise ValueError(f"--quantization {quantization!r} is not supported; choose from {', '.join(METHODS)}")
    if qcfg is None:
        if quantization in (None, "fp8"):
            return fp8.ONLINE if quantization else None
        raise ValueError(f"--quantization {quantization} needs a checkpoint quantized with it; this one is "
                         "16-bit (only fp8 quantizes at load)")
    method = qcfg.get("quant_method")
    if method not in FORMATS:
        raise refuse(f"quant_method {method!r} is not supported")
    if quantization is not None and quantization != method:
        raise ValueError(f"the checkpoint is quantized with {method}, which does not match "
                         f"--quantization {quantization}")
    return FORMATS[method].scheme(qcfg)


def attach(model: nn.Module, scheme: QuantScheme, device: torch.device, dtype: torch.dtype,
           deterministic: bool) -> None:
    """Every models.linear.Linear of `model` gets the scheme's method and its storage."""
    from models.linear import Linear

    device = torch.device(device)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    method = make_method(scheme, compute_mode(device.type, capability, deterministic, scheme.weights), dtype)
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            module.quant = method
            method.create(module, device)
            shard_quantized(name, module, scheme)  # a rank's part of each tensor, under tensor parallelism
    model.quant_scheme = scheme


def convert(tensors: dict[str, torch.Tensor], scheme: QuantScheme,
            device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """The checkpoint's tensors in the canonical layout (scheme.py), under the same linear names;
    repacking runs on `device`."""
    return tensors if scheme.online else FORMATS[scheme.method].canonical(tensors, scheme, torch.device(device))


def finish(model: nn.Module) -> None:
    from models.linear import Linear

    for module in model.modules():
        if isinstance(module, Linear) and module.quant is not None:
            module.quant.finish(module)


def bound_norm_inputs(model: nn.Module) -> None:
    """Each quantized linear that reads an RMSNorm's output (a module's `norm_consumers()`: pairs of
    norm and linear) gets `input_bound`, a bound on every |x| it can be given: RMSNorm(x)_i =
    x_i / rms(x) * w_i and x_i^2 <= K * mean(x^2), so |RMSNorm(x)_i| <= sqrt(K) * max|w| whatever
    x is (the eps only lowers it). gemms.weight_only_linear picks the int4 GEMV's half2 loop by it."""
    for module in model.modules():
        for norm, linear in getattr(module, "norm_consumers", lambda: ())():
            if linear.quant is not None:
                linear.input_bound = math.sqrt(linear.in_features) * norm.weight.detach().abs().max().item()


def weights_info(model: nn.Module) -> WeightsInfo:
    scheme = getattr(model, "quant_scheme", None)
    tensors = list(model.parameters()) + list(model.buffers())
    return WeightsInfo(scheme.name if scheme else None, sum(t.numel() * t.element_size() for t in tensors))


def _activation_format(consumer: nn.Module | None, rows: int) -> ActivationFormat | None:
    if consumer is None or consumer.quant is None:
        return None
    return consumer.quant.activation_format(consumer, rows)


def takes_16_bit(consumer: nn.Module | None, rows: int) -> bool:
    """Whether `consumer` (a linear, or None before the LM head) reads `rows` rows in 16 bits (not FP8)."""
    return _activation_format(consumer, rows) is None


def add_rmsnorm_for(consumer: nn.Module | None, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor | QuantizedInput]:
    """x += y, then (x, RMSNorm(x)) in the form `consumer` (the next linear, or None) reads: quantized
    to FP8 in the same launch where its method quantizes activations, else 16-bit (CUDA only)."""
    from kernels.fp8_quant import add_rmsnorm_fp8
    from kernels.rms_norm import add_rmsnorm

    fmt = _activation_format(consumer, x.shape[0])
    if fmt is None:
        return add_rmsnorm(x, y, weight, eps)
    x, q, scale = add_rmsnorm_fp8(x, y, weight, eps, fmt.group, fmt.static_scale)
    return x, QuantizedInput(q, scale)


def silu_mul_for(consumer: nn.Module, gate_up: torch.Tensor) -> torch.Tensor | QuantizedInput:
    """silu(gate) * up of a merged gate/up projection's output, in the form `consumer` (the down
    projection) reads: quantized to FP8 in the same launch where its method quantizes activations,
    else 16-bit (CUDA only)."""
    from kernels.fp8_quant import silu_mul_fp8
    from kernels.silu_mul import silu_mul

    fmt = _activation_format(consumer, gate_up.shape[0])
    if fmt is None:
        return silu_mul(gate_up)
    return QuantizedInput(*silu_mul_fp8(gate_up, fmt.group, fmt.static_scale))


__all__ = ["METHODS", "PER_CHANNEL", "QuantScheme", "QuantizedInput", "ActivationFormat", "WeightsInfo", "detect",
           "attach", "convert", "finish", "bound_norm_inputs", "weights_info", "merge_parts", "add_rmsnorm_for", "takes_16_bit",
           "silu_mul_for", "compute_mode"]
