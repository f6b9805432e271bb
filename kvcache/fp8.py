"""The FP8 KV cache (`--kv-cache-dtype fp8`): its storage dtypes, the scales that say what a stored
byte means, and cache tensors that carry their scales to the attention backends.

A layer's fp8 K (or V) cache holds x of KV head h as fp8(x / scale[h]) and is read back as
stored * scale[h] (kernels/fp8.py has the exact rounding), with one fp32 scale per KV head for K
and one for V in every layer (a per-tensor scale is one value repeated over the heads). `KVScales`
holds them all, [num_layers, num_kv_heads] each, and says where they came from (the checkpoint, a
calibration pass, or 1.0) for the start-up log.

`allocate_kv_cache` hands each layer's caches out as `ScaledCache` views whose `scale` is that
layer's row of the scales: a model passes a layer's (k_cache, v_cache) to its attention backend as
it always has, and the backend reads the scales off them (`cache_scales`); a 16-bit cache is a plain
tensor without any. The scales are device tensors written in place, so CUDA graphs captured after
start-up read whatever a calibration pass wrote.

vLLM's names and meanings: `fp8` is `fp8_e4m3` (float8_e4m3fn, largest value 448); `fp8_e5m2`
(float8_e5m2, up to 57344, fp16's range) is stored unscaled, as vLLM runs it (its scales stay 1.0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_NAMES = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}


def resolve_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """--kv-cache-dtype to the cache's storage dtype: `auto` stores the model's own dtype."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown KV cache dtype {kv_cache_dtype!r}; choose auto or {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[kv_cache_dtype]


def is_fp8_cache(dtype: torch.dtype) -> bool:
    return dtype in _NAMES


def dtype_name(dtype: torch.dtype) -> str:
    """The cache dtype as the logs, /debug/kv and /metrics name it: fp8_e4m3, fp8_e5m2, bfloat16, ..."""
    return _NAMES.get(dtype) or str(dtype).removeprefix("torch.")


def scaled(dtype: torch.dtype) -> bool:
    """Whether this cache dtype uses scales (e4m3 does; e5m2, like vLLM's, is stored unscaled)."""
    return dtype == torch.float8_e4m3fn


@dataclass
class KVScales:
    """Per-layer, per-KV-head fp32 scales of an fp8 cache: value = stored * k[layer, head] (K) or
    v[layer, head] (V). Each layer's row starts 16-byte aligned (the decode kernel's cached launch
    plans require aligned pointers)."""

    k: torch.Tensor  # [num_layers, num_kv_heads] fp32
    v: torch.Tensor
    source: str  # where they came from, for the start-up log

    @classmethod
    def filled(cls, num_layers: int, num_kv_heads: int, device: torch.device | str, source: str,
               k: torch.Tensor | float = 1.0, v: torch.Tensor | float = 1.0) -> KVScales:
        """Scales on `device` from k and v (anything broadcastable to [num_layers, num_kv_heads])."""
        width = -(-num_kv_heads // 4) * 4  # 16-byte rows
        store = torch.ones(2, num_layers, width, dtype=torch.float32, device=device)[:, :, :num_kv_heads]
        store[0].copy_(torch.as_tensor(k, dtype=torch.float32).expand(num_layers, num_kv_heads))
        store[1].copy_(torch.as_tensor(v, dtype=torch.float32).expand(num_layers, num_kv_heads))
        return cls(store[0], store[1], source)

    def per_head(self) -> bool:
        """Whether any layer's heads have scales of their own (else they are per-tensor)."""
        return bool((self.k != self.k[:, :1]).any() or (self.v != self.v[:, :1]).any())

    def describe(self) -> str:
        """One line for the start-up log: where the scales came from and their spread."""
        kind = "per KV head" if self.per_head() else "per layer"
        return (f"{self.source} ({kind}; k_scale {self.k.min().item():.3g}..{self.k.max().item():.3g}, "
                f"v_scale {self.v.min().item():.3g}..{self.v.max().item():.3g})")


class ScaledCache(torch.Tensor):
    """One layer's fp8 K or V cache (a view of the cache allocation) with `scale`, its fp32
    [num_kv_heads] dequantization scales. Torch operations on it return plain tensors."""

    __torch_function__ = torch._C._disabled_torch_function_impl
    scale: torch.Tensor


def with_scale(cache: torch.Tensor, scale: torch.Tensor) -> ScaledCache:
    out = cache.as_subclass(ScaledCache)
    out.scale = scale
    return out


def cache_scales(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(k_scale, v_scale) of a layer's caches: the fp8 cache's scales, (None, None) for 16-bit ones."""
    if type(k_cache) is not ScaledCache:
        return None, None
    return k_cache.scale, v_cache.scale
