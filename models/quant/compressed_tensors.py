"""compressed-tensors checkpoints (llm-compressor's output): FP8_DYNAMIC (per-channel FP8 weights,
dynamic per-token FP8 activations), FP8 (per-tensor FP8 weights, static per-tensor activations)
and W4A16 (pack-quantized int4, group 128, symmetric or asymmetric), parsed and unpacked with the
compressed-tensors library's own config model and packing functions.

Tensors per linear: float-quantized `weight` (fp8), `weight_scale` ([N, 1] per channel, one
element per tensor), `input_scale` (static); pack-quantized `weight_packed` [N, K / 8] int32
(signed values offset by 8, element k in bits 4 * (k % 8): the canonical int4 layout already),
`weight_scale` [N, K / 128], `weight_zero_point` [N / 8, K / 128] int32 packed along N (asymmetric
only), `weight_shape`.

A `kv_cache_scheme` (llm-compressor's FP8 KV cache: `k_scale` / `v_scale` per layer, per tensor or
per KV head) is not the weights' business: its scales are read by models/kv_scales.py and used with
--kv-cache-dtype fp8, as vLLM does; a config with it alone quantizes no weight.
"""

from __future__ import annotations

import torch

from models.quant.scheme import PER_CHANNEL, QuantScheme, check_ignored, refuse


def scheme(qcfg: dict) -> QuantScheme | None:
    from compressed_tensors.quantization import QuantizationConfig

    what = "compressed-tensors"
    try:
        cfg = QuantizationConfig.model_validate(qcfg)
    except ValueError as e:  # pydantic's ValidationError: a config this compressed-tensors does not read
        raise refuse(f"{what} quantization_config that compressed-tensors cannot read is not supported ({e})") from e
    kv = cfg.kv_cache_scheme
    if kv is not None and not (str(getattr(kv.type, "value", kv.type)) == "float" and kv.num_bits == 8 and
                               str(getattr(kv.strategy, "value", kv.strategy)) in ("tensor", "attn_head")):
        raise refuse(f"{what} with a kv_cache_scheme other than 8-bit float per tensor or per attention head "
                     f"({kv.type}{kv.num_bits} {kv.strategy}) is not supported")
    if not cfg.config_groups and kv is not None:  # scales of an FP8 KV cache alone: 16-bit weights
        return None
    if getattr(cfg, "sparsity_config", None) or qcfg.get("sparsity_config"):
        raise refuse(f"{what} with sparsity is not supported")
    schemes = {s.model_dump_json(exclude={"targets"}) for s in cfg.config_groups.values()}
    if len(schemes) != 1:
        raise refuse(f"{what} with {len(cfg.config_groups)} different config groups is not supported")
    group = next(iter(cfg.config_groups.values()))
    if sorted(group.targets) != ["Linear"]:
        raise refuse(f"{what} targeting {group.targets} is not supported (targets must be ['Linear'])")
    check_ignored(cfg.ignore, what)
    w, a = group.weights, group.input_activations
    if w is None or group.output_activations is not None:
        raise refuse(f"{what} without quantized weights, or with output activations, is not supported")
    fmt = str(getattr(cfg.format, "value", cfg.format))
    if w.type == "float" and w.num_bits == 8 and fmt in ("float-quantized", "naive-quantized"):
        if w.strategy not in ("channel", "tensor") or not w.symmetric:
            raise refuse(f"{what} FP8 weights with strategy {w.strategy!r} are not supported")
        if a is not None and a.type == "float" and a.num_bits == 8 and a.symmetric:
            if a.dynamic is True and a.strategy == "token":
                return QuantScheme("compressed-tensors", "compressed-tensors FP8_DYNAMIC", "fp8", PER_CHANNEL, "token")
            if not a.dynamic and a.strategy == "tensor":
                return QuantScheme("compressed-tensors", "compressed-tensors FP8 (static)", "fp8", PER_CHANNEL,
                                   "static")
        act = None if a is None else f"{a.type}{a.num_bits} {a.strategy} dynamic={a.dynamic}"
        raise refuse(f"{what} FP8 weights with activations {act} are not supported")
    if w.type == "int" and w.num_bits == 4 and fmt == "pack-quantized":
        if w.strategy != "group" or w.group_size != 128:
            raise refuse(f"{what} W4A16 with strategy {w.strategy!r}, group size {w.group_size} is not supported")
        if a is not None:
            raise refuse(f"{what} int4 weights with quantized activations ({a.type}{a.num_bits}) are not supported")
        if w.actorder not in (None, "weight"):
            raise refuse(f"{what} W4A16 with actorder {w.actorder!r} (a g_idx per column) is not supported")
        kind = "symmetric" if w.symmetric else "asymmetric"
        return QuantScheme("compressed-tensors", f"compressed-tensors W4A16 ({kind})", "int4", 128, "none")
    raise refuse(f"{what} format {fmt!r} with {w.type}{w.num_bits} weights ({w.strategy}) is not supported")


def canonical(tensors: dict[str, torch.Tensor], s: QuantScheme, device: torch.device) -> dict[str, torch.Tensor]:
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    out = {}
    for name, t in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        if s.weights == "fp8" and leaf == "weight_scale":
            n = tensors[f"{prefix}.weight"].shape[0]
            out[name] = t.float().reshape(-1, 1).expand(n, 1).contiguous() if t.numel() == 1 else \
                t.float().reshape(n, 1)
        elif s.weights == "fp8" and leaf == "input_scale":
            out[name] = t.float().reshape(1)
        elif s.weights == "int4" and leaf == "weight_packed":
            n, k = (int(v) for v in tensors[f"{prefix}.weight_shape"])
            if k % 8 or t.shape != (n, k // 8):
                raise ValueError(f"{name}: packed shape {tuple(t.shape)} for a [{n}, {k}] weight is not supported")
            out[f"{prefix}.qweight"] = t.contiguous()
            scale = tensors[f"{prefix}.weight_scale"]
            out[f"{prefix}.scales"] = scale.float().contiguous()
            zp = tensors.get(f"{prefix}.weight_zero_point")
            zero = torch.full(scale.shape, 8, dtype=torch.uint8) if zp is None else \
                (unpack_from_int32(zp, 4, torch.Size(scale.shape), packed_dim=0).to(torch.int16) + 8).to(torch.uint8)
            out[f"{prefix}.zeros"] = zero.contiguous()
        elif s.weights == "int4" and leaf in ("weight_shape", "weight_scale", "weight_zero_point"):
            continue
        else:
            out[name] = t
    return out
