"""FP8 KV-cache scales a checkpoint carries, under the names the quantization tools write them.

- llm-compressor / compressed-tensors (`kv_cache_scheme` in the quantization config):
  `model.layers.N.self_attn.k_scale` and `.v_scale`, one value (strategy "tensor") or one per KV
  head (strategy "attn_head");
- NVIDIA ModelOpt: `model.layers.N.self_attn.k_proj.k_scale` and `.v_proj.v_scale`;
- the older single scale for both: `model.layers.N.self_attn.kv_scale` (vLLM uses it for K and V).

A checkpoint's scale is what its values are divided by before the fp8 cast (amax / 448 for e4m3),
the meaning kvcache/fp8.py gives a scale. The layer is the first integer in the name, whatever the
family's module names. The FP8 attention scales some checkpoints carry beside them (`q_scale`,
`prob_scale`) are not used: queries and probabilities stay in the model's dtype.

Under tensor parallelism a rank's cache holds its own K/V heads (models/parallel `kv_heads`: a
slice of them, or one head shared with the ranks whose query heads use it), and so do its scales: a
per-KV-head scale is read for the whole model's heads and sliced to the rank's.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

from models.parallel.group import TensorParallel, kv_heads

log = logging.getLogger("flashpage.loader")

_KV = {".k_scale": "k", ".v_scale": "v", ".kv_scale": "kv"}
_UNUSED = (".q_scale", ".prob_scale")
_LAYER = re.compile(r"\.(\d+)\.")


def is_attention_scale(name: str) -> bool:
    """A name of a KV-cache (or FP8-attention) scale: not a model weight, load_weights never sees it."""
    return name.endswith(tuple(_KV)) or name.endswith(_UNUSED)


def _files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        return [path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return [path / "model.safetensors"] if (path / "model.safetensors").exists() else []


def _scale_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's attention-scale tensors alone (safetensors: read by name, nothing else)."""
    found = {}
    files = _files(path)
    if not files and (path / "pytorch_model.bin").exists():
        state = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
        return {k: t for k, t in state.items() if is_attention_scale(k)}
    for file in files:
        with safe_open(file, framework="pt") as f:
            found.update({k: f.get_tensor(k) for k in f.keys() if is_attention_scale(k)})
    return found


def checkpoint_kv_scales(path: Path, num_layers: int, num_kv_heads: int,
                         tp: TensorParallel | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(k, v) fp32 [num_layers, heads] from the checkpoint's scale tensors for the KV heads of rank
    `tp` (default: this process's group; all `num_kv_heads`, the whole model's, without tensor
    parallelism), or None when it has none. A per-tensor scale fills its layer's heads; a layer with
    one of K's and V's scales (or the older kv_scale) uses it for both, as vLLM does. Raises if only
    some layers have scales, or a scale is neither one value nor one per KV head."""
    per_layer: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in _scale_tensors(path).items():
        kind = next((k for suffix, k in _KV.items() if name.endswith(suffix)), None)
        layer = _LAYER.search(name)
        if kind is None or layer is None:
            continue
        t = t.detach().float().flatten()
        if t.numel() not in (1, num_kv_heads):
            raise ValueError(f"{name} has {t.numel()} values: a KV-cache scale is one value or one per KV head "
                             f"({num_kv_heads})")
        if not bool((t > 0).all() and t.isfinite().all()):
            raise ValueError(f"{name} holds a scale that is not a positive number: {t.tolist()}")
        per_layer.setdefault(int(layer.group(1)), {})[kind] = t.expand(num_kv_heads)
    if not per_layer:
        return None
    missing = sorted(set(range(num_layers)) - set(per_layer))
    if missing or max(per_layer) >= num_layers:
        raise ValueError(f"the checkpoint has KV-cache scales for layers {sorted(per_layer)[:8]}... but not for "
                         f"{missing[:8] or 'its layer numbers'} of its {num_layers} layers")
    k = torch.empty(num_layers, num_kv_heads)
    v = torch.empty(num_layers, num_kv_heads)
    for i, found in per_layer.items():
        one = found.get("k", found.get("v", found.get("kv")))
        k[i] = found.get("k", one)
        v[i] = found.get("v", one)
        if "kv" in found and len(found) == 1:
            log.warning("layer %d: the checkpoint's kv_scale (a format vLLM deprecated) is used for K and V", i)
    first, count = kv_heads(num_kv_heads, tp)
    return k[:, first : first + count].contiguous(), v[:, first : first + count].contiguous()
