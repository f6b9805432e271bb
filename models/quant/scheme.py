"""What a checkpoint's weights are: `QuantScheme`, read from config.json's `quantization_config` (or
asked for with `--quantization fp8`), and how a quantized linear computes on a device.

Every format family is one module here (compressed_tensors.py, fp8.py, awq.py, gptq.py) with two
functions: `scheme(quantization_config)` says which variant a checkpoint is and refuses, by name,
any variant flashpage does not serve; `canonical(tensors, scheme)` turns the checkpoint's tensors
into the layout the linear methods (methods.py) and kernels read, keeping each linear's name:

  fp8   `<linear>.weight` [N, K] float8_e4m3fn, `<linear>.weight_scale` [N, groups] fp32 (groups = 1
        per output channel, or K / 128 for 128x128 blocks, each block's scale repeated over its
        rows), `<linear>.input_scale` [1] fp32 for static activation scales;
  int4  `<linear>.qweight` [N, K / 8] int32, `<linear>.scales` [N, K / group] fp32,
        `<linear>.zeros` [N, K / group] uint8 (8 for symmetric), `<linear>.g_idx` [K] int32 where the
        columns' groups are not in order (GPTQ with desc_act).

Every tensor has the output features first, so a family merges q/k/v or gate/up by stacking its
parts (models/linear.py `merge_parts`): per-channel scales concatenate, and a per-tensor weight
scale is made per channel (each part keeps its own scale: exact, where requantizing every part to
the largest scale, as vLLM does for its per-tensor GEMM, rounds the weights a second time; the
rowwise FP8 GEMM costs the same). Only the input side cannot stack: the parts of a merged
projection read one input, so their static activation scales merge to the largest (nothing
clips) and their g_idx must agree.
"""

from __future__ import annotations

from dataclasses import dataclass

PER_CHANNEL = 1 << 30  # a weight group "wider than any K": one scale per output channel

# vLLM's --quantization names, each a `quant_method` of config.json; fp8 also quantizes a 16-bit
# checkpoint at load.
METHODS = ("fp8", "compressed-tensors", "awq", "gptq")


@dataclass(frozen=True)
class QuantScheme:
    method: str  # quant_method, one of METHODS
    name: str  # the variant, as the start-up log and /v1/models show it
    weights: str  # "fp8" | "int4"
    group: int  # weight columns per scale: PER_CHANNEL, or 128
    activations: str  # "token" (dynamic per token) | "group" (dynamic per token and 128 columns) | "static" | "none"
    online: bool = False  # quantized at load from a 16-bit checkpoint (--quantization fp8)
    gptq_v1_zeros: bool = False  # GPTQ's original format stores each zero point minus one
    g_idx: bool = False  # each input column's group from a g_idx tensor (GPTQ's desc_act)

    @property
    def activation_group(self) -> int:
        return 128 if self.activations == "group" else PER_CHANNEL


def refuse(what: str) -> ValueError:
    return ValueError(f"{what}; flashpage serves compressed-tensors FP8_DYNAMIC, FP8 (static per-tensor) and "
                      "W4A16 (pack-quantized, group 128), quant_method fp8 with 128x128 blocks, AWQ (GEMM, 4-bit, "
                      "group 128), GPTQ (4-bit, group 128) and --quantization fp8 of a 16-bit checkpoint")


def check_ignored(names: list[str] | None, method: str) -> None:
    """Unquantized modules are served only where they are the LM head (flashpage's head is never
    quantized); a checkpoint that leaves other linears in 16 bits is refused by name."""
    for name in names or []:
        if "lm_head" not in name:
            raise refuse(f"{method} checkpoint leaving {name!r} unquantized is not supported (only the LM head may be)")


def compute_mode(device_type: str, capability: tuple[int, int] | None, deterministic: bool, weights: str) -> str:
    """How quantized linears compute on a device:
    'dequant': weights dequantized to the model dtype at load (the CPU, whose path is the
    correctness reference CI runs, and --deterministic, whose batch-invariant GEMM is 16-bit);
    'w8a8': FP8 weights times FP8 activations on FP8 tensor cores (compute capability >= 8.9);
    'weight_only': 16-bit activations, weights dequantized in the GEMM's registers (int4 on every
    GPU; FP8 on GPUs without FP8 tensor cores, e.g. the A100's 8.0)."""
    if device_type != "cuda" or deterministic:
        return "dequant"
    if weights == "fp8" and capability is not None and capability >= (8, 9):
        return "w8a8"
    return "weight_only"
