"""Paged KV cache: block allocator, page tables, cache tensors. Depends on torch and numpy only."""

from kvcache.block_manager import BlockAllocator, BlockManager, SeqBlocks, block_hash, blocks_for, slot_of, slots_of
from kvcache.cache import CacheSpec, allocate_kv_cache, scratch_slot
from kvcache.fp8 import KV_CACHE_DTYPES, KVScales, cache_scales, dtype_name, is_fp8_cache, resolve_cache_dtype

__all__ = ["BlockAllocator", "BlockManager", "SeqBlocks", "block_hash", "blocks_for", "slot_of", "slots_of", "CacheSpec",
           "allocate_kv_cache", "scratch_slot", "KV_CACHE_DTYPES", "KVScales", "cache_scales", "dtype_name",
           "is_fp8_cache", "resolve_cache_dtype"]
