"""`quant_method: fp8` checkpoints with 128x128 weight blocks (Qwen3's -FP8 releases, DeepSeek's
layout), and `--quantization fp8` of a 16-bit checkpoint (as vLLM's flag: per-channel FP8 weights
made at load, activations quantized per token at run time).

Tensors per linear: `weight` [N, K] float8_e4m3fn and `weight_scale_inv` [ceil(N / 128),
ceil(K / 128)] fp32, the factor each block's weights are multiplied by (despite its name, the
scale itself, not its inverse); activations are quantized per token in groups of 128 columns.
"""

from __future__ import annotations

import torch

from models.quant.scheme import PER_CHANNEL, QuantScheme, check_ignored, refuse

BLOCK = 128
ONLINE = QuantScheme("fp8", "fp8 (quantized at load: per-channel weights, dynamic per-token activations)", "fp8",
                     PER_CHANNEL, "token", online=True)


def scheme(qcfg: dict) -> QuantScheme:
    what = "quant_method fp8"
    if qcfg.get("fmt", "e4m3") != "e4m3":
        raise refuse(f"{what} with fmt {qcfg.get('fmt')!r} is not supported (e4m3 only)")
    if qcfg.get("activation_scheme", "dynamic") != "dynamic":
        raise refuse(f"{what} with activation_scheme {qcfg.get('activation_scheme')!r} is not supported")
    if list(qcfg.get("weight_block_size") or []) != [BLOCK, BLOCK]:
        raise refuse(f"{what} with weight_block_size {qcfg.get('weight_block_size')} is not supported "
                     f"([128, 128] only)")
    check_ignored((qcfg.get("modules_to_not_convert") or []) + (qcfg.get("ignored_layers") or []), what)
    return QuantScheme("fp8", "fp8 (128x128 blocks)", "fp8", BLOCK, "group")


def canonical(tensors: dict[str, torch.Tensor], s: QuantScheme, device: torch.device) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf == "weight_scale_inv":
            n = tensors[f"{prefix}.weight"].shape[0]
            out[f"{prefix}.weight_scale"] = t.float().repeat_interleave(BLOCK, dim=0)[:n].contiguous()
        else:
            out[name] = t
    return out


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A 16-bit weight [N, K] -> (fp8 [N, K], scale fp32 [N, 1]): each row's largest magnitude
    maps to 448 (--quantization fp8, as vLLM quantizes at load)."""
    wf = w.float()
    scale = (wf.abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-12)
    return (wf / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale
