"""Paged KV cache: block allocator, page tables, cache tensors. Depends on torch and numpy only."""

from kvcache.block_manager import BlockAllocator, BlockManager, SeqBlocks, block_hash, blocks_for, slot_of, slots_of
from kvcache.cache import CacheSpec, allocate_kv_cache, scratch_slot

__all__ = ["BlockAllocator", "BlockManager", "SeqBlocks", "block_hash", "blocks_for", "slot_of", "slots_of", "CacheSpec", "allocate_kv_cache", "scratch_slot"]
