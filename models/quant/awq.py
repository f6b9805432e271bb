"""AWQ checkpoints (AutoAWQ's GEMM packing; `quant_method: awq`, 4-bit, group 128, with zero points).

Tensors per linear: `qweight` [K, N / 8] int32 and `qzeros` [K / 128, N / 8] int32, eight 4-bit
values per word along N in AWQ's interleaved order (output column 8c + j in bits 4 * REVERSE[j] of
word c), `scales` [K / 128, N] fp16; w = (q - zero) * scale, unsigned values and zeros.
"""

from __future__ import annotations

import torch

from kernels.quant_reference import pack_int4
from models.quant.scheme import QuantScheme, check_ignored, refuse

REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # the nibble holding column j of each word's eight


def scheme(qcfg: dict) -> QuantScheme:
    what = "AWQ"
    if str(qcfg.get("version", "gemm")).lower() != "gemm":
        raise refuse(f"{what} version {qcfg.get('version')!r} is not supported (GEMM packing only)")
    bits, group = qcfg.get("bits", qcfg.get("w_bit")), qcfg.get("group_size", qcfg.get("q_group_size"))
    if bits != 4 or group != 128:
        raise refuse(f"{what} with {bits}-bit weights, group size {group} is not supported")
    if not qcfg.get("zero_point", True):
        raise refuse(f"{what} without zero points is not supported")
    check_ignored(qcfg.get("modules_to_not_convert"), what)
    return QuantScheme("awq", "AWQ (4-bit, group 128)", "int4", 128, "none")


def unpack_columns(packed: torch.Tensor) -> torch.Tensor:
    """[rows, N / 8] int32 in AWQ's order -> [rows, N] values 0..15 (int32)."""
    shifts = 4 * torch.tensor(REVERSE_ORDER, dtype=torch.int32, device=packed.device)
    return ((packed[:, :, None] >> shifts) & 0xF).reshape(packed.shape[0], -1)


def canonical(tensors: dict[str, torch.Tensor], s: QuantScheme, device: torch.device) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf == "qweight":  # repacked on the device: seconds of CPU per billion weights otherwise
            out[name] = pack_int4(unpack_columns(t.to(device)).t().contiguous())
            zeros = unpack_columns(tensors[f"{prefix}.qzeros"].to(device))
            out[f"{prefix}.zeros"] = zeros.t().to(torch.uint8).contiguous()
            out[f"{prefix}.scales"] = tensors[f"{prefix}.scales"].float().t().contiguous()
        elif leaf not in ("qzeros", "scales"):
            out[name] = t
    return out
