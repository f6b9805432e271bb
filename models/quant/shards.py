"""Quantized linears under tensor parallelism: which part of each canonical tensor (scheme.py) a rank
holds, named in the linear's `tp_shards` beside its 16-bit weight's Shard (models/parallel/layers.py),
so that the loader's `load_shard` cuts them as it cuts a 16-bit weight; and the splits refused, by
the layer's name, because they would cut a weight block or group (as vLLM refuses them).

`convert` has turned every format into the canonical layout before any rank cuts: each tensor has the
output features first, and int4 weights are packed eight input columns a word, whatever the
checkpoint's own packing (AWQ packs eight output columns a word, GPTQ and compressed-tensors eight
input rows). So one rule serves every format:

- column-parallel (merged q/k/v, gate/up; GPT-2's c_attn, c_fc): every tensor of the output features
  (the FP8 weight and its per-channel or block scales, the int4 words, scales and zero points) is cut
  by the rows the 16-bit weight is cut by; what belongs to the input (a static activation scale,
  GPTQ's g_idx) is whole. 128x128 blocks: each rank's rows must be whole 128-row blocks.
- row-parallel (o_proj, down_proj; GPT-2's c_proj): cut along the input features: FP8 columns, int4
  words (8 columns each), block and group scales and zero points by their 128-column groups, so a
  rank's share must be whole groups. A per-channel weight scale (per-tensor ones are per channel in
  the canonical layout) and a static activation scale are whole on every rank.
- GPTQ with desc_act, row-parallel: a column's group may lie anywhere in the layer (g_idx), so each
  rank keeps every group's scales and zero points and the slice of g_idx for its columns (vLLM
  does the same: its Marlin kernels repeat the scales on every rank for act-order, its exllama path
  keeps them whole). The GEMMs gather a column's scale through g_idx from any number of groups.
- Activations: a dynamic per-token scale is a rank's own, over the columns it holds (vLLM's too), so
  a row-parallel projection's FP8 input differs from one GPU's within that quantization's error;
  per-128-column scales (block checkpoints) cover the same columns as on one GPU.
- `--quantization fp8` loads the rank's 16-bit shard as usual and quantizes it at `finish` (a
  row-parallel shard's per-channel scales are its own columns'), as vLLM does.
"""

from __future__ import annotations

from torch import nn

from models.parallel.group import tensor_parallel
from models.parallel.layers import Shard
from models.quant.scheme import PER_CHANNEL, QuantScheme

OUTPUT_LEAVES = ("weight", "weight_scale", "qweight", "scales", "zeros")  # [N, ...]: cut like the weight's rows


def whole_in_features(linear: nn.Module) -> int:
    """The layer's input features over every rank (a row-parallel rank holds a share of them)."""
    weight = getattr(linear, "tp_shards", {}).get("weight")
    return weight.total if weight is not None and weight.dim == 1 else linear.in_features


def shard_quantized(name: str, linear: nn.Module, scheme: QuantScheme) -> None:
    """Add the Shards of `linear`'s canonical tensors to its tp_shards (a parallel linear of a group
    larger than one; others are whole), or refuse the split naming `name`."""
    weight = getattr(linear, "tp_shards", {}).get("weight")
    held = weight is not None and sum(n for _, n in weight.pieces) < weight.total
    if not held or scheme.online:  # whole; or 16-bit weights, cut as usual and quantized at finish
        return
    size, group = tensor_parallel().size, scheme.group
    what = f"{name} ({scheme.name})"
    if weight.dim == 0:
        if scheme.weights == "fp8" and group < PER_CHANNEL:
            for start, length in weight.pieces:
                if start % group or length % group:
                    raise ValueError(f"{what}: --tensor-parallel-size {size} gives a rank output rows {start} to "
                                     f"{start + length} of this projection, which are not whole {group}x{group} "
                                     f"weight blocks (each rank's share of every part, q/k/v or gate/up, must be a "
                                     f"multiple of {group} rows)")
        linear.tp_shards.update(dict.fromkeys(OUTPUT_LEAVES, weight))
        return
    ((start, share),) = weight.pieces
    k = weight.total
    if group < PER_CHANNEL and share % group:
        raise ValueError(f"{what}: --tensor-parallel-size {size} gives each rank {share} of its {k} input features, "
                         f"which is not a whole number of the weights' {group}-column groups (K / {group} = "
                         f"{k / group:g} groups; the size must divide them)")

    def along_k(per: int) -> Shard:  # the rank's columns of a tensor holding one element per `per` of K's
        return Shard(((start // per, share // per),), 1, -(-k // per))

    if scheme.weights == "fp8":  # its columns cut as a 16-bit weight's are; a per-channel scale is whole
        cut = {"weight_scale": along_k(group)} if group < PER_CHANNEL else {}
    elif scheme.g_idx:  # every group's scales and zero points on every rank, g_idx for its columns
        cut = {"qweight": along_k(8), "g_idx": Shard(((start, share),), 0, k)}
    else:
        cut = {"qweight": along_k(8), "scales": along_k(group), "zeros": along_k(group)}
    linear.tp_shards.update(cut)


__all__ = ["OUTPUT_LEAVES", "shard_quantized", "whole_in_features"]
