"""GPTQ checkpoints (`quant_method: gptq`, 4-bit, group 128, with or without desc_act).

Tensors per linear: `qweight` [K / 8, N] int32, eight 4-bit values per word along K (input row
8r + i in bits 4i of word r); `qzeros` [groups, N / 8] int32, eight values per word along N in the
same order; `scales` [groups, N] fp16; `g_idx` [K] int32, the group of each input column (in
order, k // 128, without desc_act; in the order the columns were quantized with it). The original
format (`checkpoint_format: gptq`, "v1") stores each zero point minus one, gptq_v2 the zero point;
w = (q - zero) * scale.
"""

from __future__ import annotations

import torch

from kernels.quant_reference import pack_int4
from models.quant.scheme import QuantScheme, refuse


def scheme(qcfg: dict) -> QuantScheme:
    what = "GPTQ"
    bits, group = qcfg.get("bits"), qcfg.get("group_size")
    if bits != 4 or group != 128:
        raise refuse(f"{what} with {bits}-bit weights, group size {group} is not supported")
    fmt = str(qcfg.get("checkpoint_format") or qcfg.get("format") or "gptq").lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise refuse(f"{what} checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
    if qcfg.get("dynamic"):
        raise refuse(f"{what} with per-module 'dynamic' overrides is not supported")
    act = "desc_act" if qcfg.get("desc_act") else "no desc_act"
    sym = "symmetric" if qcfg.get("sym", True) else "asymmetric"
    return QuantScheme("gptq", f"GPTQ (4-bit, group 128, {act}, {sym})", "int4", 128, "none",
                       gptq_v1_zeros=fmt == "gptq", g_idx=bool(qcfg.get("desc_act")))


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """[rows, cols] int32 -> [rows, cols, 8] values 0..15: value i of each word in bits 4i."""
    return (packed[:, :, None] >> (4 * torch.arange(8, dtype=torch.int32, device=packed.device))) & 0xF


def canonical(tensors: dict[str, torch.Tensor], s: QuantScheme, device: torch.device) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf == "qweight":  # repacked on the device: seconds of CPU per billion weights otherwise
            t = t.to(device)
            k8, n = t.shape
            q = _unpack(t).permute(0, 2, 1).reshape(k8 * 8, n)  # [K, N]
            out[name] = pack_int4(q.t().contiguous())
            zeros = _unpack(tensors[f"{prefix}.qzeros"].to(device)).reshape(-1, n)  # [groups, N]
            if s.gptq_v1_zeros:
                zeros = (zeros + 1) & 0xF  # 0xF stored for a zero of 0 wraps, as GPTQ's own kernels read it
            out[f"{prefix}.zeros"] = zeros.t().to(torch.uint8).contiguous()
            out[f"{prefix}.scales"] = tensors[f"{prefix}.scales"].float().t().contiguous()
            g_idx = tensors.get(f"{prefix}.g_idx")
            if s.g_idx:
                out[f"{prefix}.g_idx"] = g_idx.to(torch.int32).contiguous()
            elif g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k8 * 8) // s.group):
                raise ValueError(f"{prefix}: g_idx out of order in a GPTQ checkpoint without desc_act")
        elif leaf not in ("qzeros", "scales", "g_idx"):
            out[name] = t
    return out
