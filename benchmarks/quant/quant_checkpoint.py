"""Quantized copies of a 16-bit Hugging Face checkpoint, in each format flashpage serves, written
in the format's own layout (round-to-nearest quantization: the layout and arithmetic of a real
checkpoint, not the calibration of llm-compressor, AutoAWQ or GPTQ):

  fp8-dynamic   compressed-tensors FP8_DYNAMIC: per-channel FP8 weights, dynamic per-token activations
  fp8-static    compressed-tensors FP8: per-tensor FP8 weights, static per-tensor activation scales
  w4a16         compressed-tensors W4A16, symmetric (w4a16-asym: with zero points); packed by
                compressed-tensors' own pack_to_int32, its config written by its QuantizationConfig
  fp8-block     quant_method fp8, 128x128 blocks (Qwen3-FP8's layout: weight_scale_inv)
  awq           AutoAWQ GEMM: 4-bit, group 128, zero points, AWQ's interleaved packing
  gptq          GPTQ (v1 zeros), 4-bit, group 128, symmetric; gptq-desc-act: a g_idx in a random
                column order, asymmetric

    python -m benchmarks.quant.quant_checkpoint SRC DST --format awq [--device cuda]

Every linear of the transformer blocks is quantized (not the embedding, not the LM head). On a GPU
an 8B checkpoint takes seconds. `quantize_checkpoint` also returns the dequantized weights under the
source's names, from which tests build the reference model.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FORMATS = ("fp8-dynamic", "fp8-static", "w4a16", "w4a16-asym", "fp8-block", "awq", "gptq", "gptq-desc-act")
GROUP = 128
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "c_attn", "c_proj", "c_fc")
_GPT2_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
STATIC_INPUT_SCALE = 16.0 / 448  # fp8-static: activations up to 16 in magnitude are represented


def is_linear(name: str, t: torch.Tensor) -> bool:
    return name.endswith(".weight") and t.dim() == 2 and name.rsplit(".", 2)[-2] in _LINEARS


def _int4_groups(w: torch.Tensor, symmetric: bool, order: torch.Tensor | None = None):
    """Round-to-nearest int4 per group of 128 columns (of `order`'s permutation where given): q
    [N, K] 0..15, scale [N, G] fp32, zero [N, G] 0..15, and the dequantized w (fp32)."""
    n, k = w.shape
    wp = w.float() if order is None else w.float()[:, order]
    g = wp.reshape(n, k // GROUP, GROUP)
    if symmetric:
        scale = (g.abs().amax(-1) / 7.5).clamp(min=1e-8)
        zero = torch.full_like(scale, 8)
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        zero = torch.round(-lo / scale).clamp(0, 15)
    return g, scale, zero


def _int4(w: torch.Tensor, symmetric: bool, scale_dtype: torch.dtype, order: torch.Tensor | None = None):
    n, k = w.shape
    g, scale, zero = _int4_groups(w, symmetric, order)
    scale = scale.to(scale_dtype).float()  # as stored
    q = torch.clamp(torch.round(g / scale[..., None]) + zero[..., None], 0, 15)
    deq = ((q - zero[..., None]) * scale[..., None]).reshape(n, k)
    q = q.reshape(n, k)
    if order is not None:  # back to column order
        inv = torch.argsort(order)
        q, deq = q[:, inv], deq[:, inv]
    return q.to(torch.int32), scale, zero.to(torch.int32), deq


def _pack_rows(q: torch.Tensor, order=range(8)) -> torch.Tensor:
    """[R, C] values 0..15 -> [R, C / 8] int32: eight consecutive columns a word, column j of eight
    in nibble order[j]."""
    r, c = q.shape
    shifts = torch.tensor([4 * o for o in order], dtype=torch.int64, device=q.device)
    words = (q.to(torch.int64).reshape(r, c // 8, 8) << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _fp8_dynamic(w):
    from models.quant.fp8 import quantize_per_channel

    q, scale = quantize_per_channel(w)
    return {"weight": q, "weight_scale": scale}, q.float() * scale


def _fp8_static(w):
    scale = (w.float().abs().amax() / 448).clamp(min=1e-12).reshape(1)
    q = (w.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale, "input_scale": torch.tensor([STATIC_INPUT_SCALE])}, q.float() * scale


def _fp8_block(w):
    n, k = w.shape
    pn, pk = -n % GROUP, -k % GROUP
    wp = torch.nn.functional.pad(w.float(), (0, pk, 0, pn)).reshape((n + pn) // GROUP, GROUP, (k + pk) // GROUP, GROUP)
    scale = (wp.abs().amax(dim=(1, 3)) / 448).clamp(min=1e-12)  # [N / 128, K / 128]
    full = scale.repeat_interleave(GROUP, 0).repeat_interleave(GROUP, 1)[:n, :k]
    q = (w.float() / full).clamp(-448, 448).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale_inv": scale.contiguous()}, q.float() * full


def _w4a16(w, symmetric):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    q, scale, zero, deq = _int4(w, symmetric, torch.bfloat16)
    out = {"weight_packed": pack_to_int32((q - 8).to(torch.int8), 4), "weight_scale": scale.to(torch.bfloat16),
           "weight_shape": torch.tensor(list(w.shape), dtype=torch.int64)}
    if not symmetric:
        out["weight_zero_point"] = pack_to_int32((zero - 8).to(torch.int8), 4, packed_dim=0)
    return out, deq


def _awq(w):
    q, scale, zero, deq = _int4(w, False, torch.float16)
    awq_order = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i holds column awq_order[i]: column j in nibble REVERSE[j]
    nibble = [awq_order.index(j) for j in range(8)]
    return {"qweight": _pack_rows(q.t().contiguous(), nibble), "qzeros": _pack_rows(zero.t().contiguous(), nibble),
            "scales": scale.t().to(torch.float16).contiguous()}, deq


def _gptq(w, desc_act):
    n, k = w.shape
    order = torch.randperm(k, generator=torch.Generator().manual_seed(k)).to(w.device) if desc_act else None
    q, scale, zero, deq = _int4(w, not desc_act, torch.float16, order)
    g_idx = torch.arange(k, device=w.device) // GROUP
    if order is not None:
        g_idx = torch.empty_like(g_idx)
        g_idx[order] = torch.arange(k, device=w.device) // GROUP
    # word (r, n) holds input rows 8r .. 8r + 7 of column n, row 8r + i in bits 4i
    qweight = _pack_rows(q.t().reshape(k // 8, 8, n).permute(0, 2, 1).reshape(-1, 8)).reshape(k // 8, n)
    return {"qweight": qweight, "qzeros": _pack_rows(((zero - 1) & 0xF).t().contiguous()),
            "scales": scale.t().to(torch.float16).contiguous(), "g_idx": g_idx.to(torch.int32)}, deq


def _config(fmt: str) -> dict:
    if fmt.startswith(("fp8-dynamic", "fp8-static", "w4a16")):
        from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

        if fmt.startswith("w4a16"):
            weights = QuantizationArgs(num_bits=4, type="int", symmetric=fmt == "w4a16", strategy="group",
                                       group_size=GROUP)
            scheme, form = QuantizationScheme(targets=["Linear"], weights=weights), "pack-quantized"
        else:
            static = fmt == "fp8-static"
            weights = QuantizationArgs(num_bits=8, type="float", symmetric=True,
                                       strategy="tensor" if static else "channel")
            acts = QuantizationArgs(num_bits=8, type="float", symmetric=True, dynamic=not static,
                                    strategy="tensor" if static else "token")
            scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=acts)
            form = "float-quantized"
        cfg = QuantizationConfig(config_groups={"group_0": scheme}, format=form, ignore=["lm_head"],
                                 quantization_status="compressed")
        return {"quant_method": "compressed-tensors", **json.loads(cfg.model_dump_json())}
    if fmt == "fp8-block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
    desc_act = fmt == "gptq-desc-act"
    return {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": desc_act, "sym": not desc_act,
            "checkpoint_format": "gptq"}


def quantize_tensors(tensors: dict[str, torch.Tensor], fmt: str, conv1d: bool = False, keep: bool = True):
    """(the quantized checkpoint's tensors, the dequantized weights by source name, if `keep`)."""
    quantize = {"fp8-dynamic": _fp8_dynamic, "fp8-static": _fp8_static, "fp8-block": _fp8_block,
                "w4a16": lambda w: _w4a16(w, True), "w4a16-asym": lambda w: _w4a16(w, False), "awq": _awq,
                "gptq": lambda w: _gptq(w, False), "gptq-desc-act": lambda w: _gptq(w, True)}[fmt]
    out, deq = {}, {}
    for name, t in tensors.items():
        if not is_linear(name, t):
            out[name] = t
            continue
        transposed = conv1d and name.endswith(_GPT2_CONV1D)
        w = t.t() if transposed else t  # [out, in], as every quantized format stores a linear
        parts, d = quantize(w)
        prefix = name.removesuffix(".weight")
        out.update({f"{prefix}.{leaf}": v.contiguous() for leaf, v in parts.items()})
        if keep:
            deq[name] = (d.t() if transposed else d).contiguous()
    return out, deq


def quantize_checkpoint(src: str | Path, dst: str | Path, fmt: str, device: str = "cpu",
                        dequantized: bool = True) -> dict[str, torch.Tensor]:
    """Write `fmt`'s quantized copy of the 16-bit checkpoint at `src` to `dst` (config with its
    quantization_config, one safetensors file, the tokenizer and generation config copied); returns
    the dequantized weights (fp32, on the CPU) under the source's names, unless not `dequantized`."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    files = sorted(src.glob("*.safetensors"))
    tensors = {}
    for f in files:
        tensors.update(load_file(f, device=device))
    config = json.loads((src / "config.json").read_text())
    out, deq = quantize_tensors(tensors, fmt, conv1d=config.get("model_type") == "gpt2", keep=dequantized)
    save_file({k: v.contiguous().cpu() for k, v in out.items()}, dst / "model.safetensors", metadata={"format": "pt"})
    config["quantization_config"] = _config(fmt)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, dst / f.name)
    return {k: v.float().cpu() for k, v in deq.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", help="a 16-bit Hugging Face checkpoint directory (benchmarks/shared/checkpoint.py makes them)")
    ap.add_argument("dst")
    ap.add_argument("--format", required=True, choices=FORMATS)
    ap.add_argument("--device", default="cpu", help="where to quantize (cuda: seconds for an 8B model)")
    args = ap.parse_args(argv)
    quantize_checkpoint(args.src, args.dst, args.format, args.device, dequantized=False)
    print(f"{args.format} checkpoint written to {args.dst}")


if __name__ == "__main__":
    main()
