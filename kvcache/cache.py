"""The KV cache tensors and their sizing.

Per layer, K and V are `[num_blocks + 1, block_size, num_kv_heads, head_dim]` views into one
allocation. The extra last block is scratch that the allocator never hands out: padding rows of a
batch (CUDA-graph padding, slot -1) can be pointed at it by backends that cannot skip a write.
`CacheSpec.dtype` is the storage dtype: the model's, or fp8 (kvcache/fp8.py), one byte an element,
so the same budget holds twice the blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcache.fp8 import KVScales, is_fp8_cache, with_scale


@dataclass(frozen=True)
class CacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """K and V of every layer for one block."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def blocks_for_budget(self, budget_bytes: int) -> int:
        # One block of the budget pays for the scratch block.
        return max(0, budget_bytes // self.bytes_per_block - 1)


def allocate_kv_cache(spec: CacheSpec, num_blocks: int, device: torch.device | str,
                      scales: KVScales | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (k_cache, v_cache) pair per layer. Contents are uninitialised: kernels never read a slot
    that no sequence has written. An fp8 cache's pairs are `ScaledCache`s carrying their layer's
    row of `scales` (all 1.0 when none are given)."""
    shape = (spec.num_layers, 2, num_blocks + 1, spec.block_size, spec.num_kv_heads, spec.head_dim)
    storage = torch.empty(shape, dtype=spec.dtype, device=device)
    if not is_fp8_cache(spec.dtype):
        return [(storage[i, 0], storage[i, 1]) for i in range(spec.num_layers)]
    if scales is None:
        scales = KVScales.filled(spec.num_layers, spec.num_kv_heads, device, "1.0")
    return [(with_scale(storage[i, 0], scales.k[i]), with_scale(storage[i, 1], scales.v[i]))
            for i in range(spec.num_layers)]


def scratch_slot(k_cache: torch.Tensor) -> int:
    """Flat index of the first slot of the scratch block."""
    return (k_cache.shape[0] - 1) * k_cache.shape[1]
