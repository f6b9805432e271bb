"""Block allocator and page tables for the paged KV cache.

A sequence's page table (`block_table`) is a plain list of block ids: token i lives in block
`block_table[i // block_size]` at offset `i % block_size`. The allocator hands out fixed-size
blocks from a free list and counts references, so that sequences sharing a prompt prefix can share
full blocks (prefix caching). A full block is identified by a hash chained over its parent block's
hash and its own token ids; the ids are stored too and compared on a hit, so a hash collision can
never serve another prompt's KV. Cached blocks whose ref count drops to zero are kept (evictable)
and reused least-recently-freed first, only when the free list is empty.

Every operation is O(1) per block. Nothing here knows about the model, torch or HTTP.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from itertools import count

import numpy as np


def block_hash(parent: int | None, token_ids: tuple[int, ...]) -> int:
    """Chained content hash of one full block (module-level so tests can force collisions)."""
    return hash((parent, token_ids))


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks a sequence of `num_tokens` tokens occupies."""
    return -(-num_tokens // block_size)


def slot_of(block_table: list[int], position: int, block_size: int) -> int:
    """Flat cache slot of token `position` of a sequence with this page table."""
    return block_table[position // block_size] * block_size + position % block_size


def slots_of(block_table: list[int], positions: np.ndarray, block_size: int) -> np.ndarray:
    """slot_of for an array of positions (int64)."""
    return np.asarray(block_table, dtype=np.int64)[positions // block_size] * block_size + positions % block_size


@dataclass
class _Block:
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()


@dataclass
class PrefixStats:
    queries: int = 0  # full prompt blocks looked up
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockAllocator:
    """Free list + ref counts + content-addressed cache of full blocks."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [_Block() for _ in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, ref 0, oldest first
        self.by_hash: dict[int, int] = {}
        self.stats = PrefixStats()

    @property
    def num_free(self) -> int:
        return len(self.free_ids) + len(self.evictable)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self) -> int:
        if self.free_ids:
            bid = self.free_ids.popleft()
        elif self.evictable:
            bid, _ = self.evictable.popitem(last=False)
            self._uncache(bid)
        else:
            raise RuntimeError("out of KV blocks: check can_allocate() first")
        self.blocks[bid].ref_count = 1
        return bid

    def free(self, bid: int) -> None:
        block = self.blocks[bid]
        if block.ref_count <= 0:
            raise RuntimeError(f"double free of KV block {bid}")
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash is not None:
                self.evictable[bid] = None
            else:
                self.free_ids.append(bid)

    def lookup(self, h: int, token_ids: tuple[int, ...]) -> int | None:
        """Take a reference to the cached block holding exactly `token_ids` under hash `h`."""
        self.stats.queries += 1
        bid = self.by_hash.get(h)
        if bid is None or self.blocks[bid].token_ids != token_ids:
            return None
        self.stats.hits += 1
        if self.blocks[bid].ref_count == 0:
            del self.evictable[bid]
        self.blocks[bid].ref_count += 1
        return bid

    def register(self, bid: int, h: int, token_ids: tuple[int, ...]) -> None:
        """Publish a block whose KV is now computed. First writer wins for a given hash."""
        if not self.enable_prefix_caching or h in self.by_hash or self.blocks[bid].hash is not None:
            return
        self.blocks[bid].hash, self.blocks[bid].token_ids = h, token_ids
        self.by_hash[h] = bid

    def _uncache(self, bid: int) -> None:
        block = self.blocks[bid]
        if block.hash is not None and self.by_hash.get(block.hash) == bid:
            del self.by_hash[block.hash]
        block.hash, block.token_ids = None, ()


# Page-table versions: unique across all sequences, so a version names one page table's contents.
_versions = count(1)


@dataclass(slots=True)
class SeqBlocks:
    """Per-sequence page table plus how many of its leading blocks are hashed.

    `version` changes whenever `block_table` does (the BlockManager is its only writer) and is
    never the same for two different page tables, of this sequence or any other: a runner that
    keeps copies of page tables (the CUDA-graph inputs) compares versions to know which rows to
    copy again."""

    block_table: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # hashes of the leading full, computed blocks
    version: int = field(default_factory=lambda: next(_versions))


class BlockManager:
    """Page tables over a BlockAllocator: what the scheduler calls."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks, enable_prefix_caching)

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        # Conservative: ignores possible prefix hits, so admission never over-commits.
        return self.allocator.can_allocate(self.blocks_for(num_tokens))

    def allocate(self, seq: SeqBlocks, token_ids: list[int], reuse: bool = True) -> int:
        """Give a new sequence blocks for all of `token_ids`; returns how many leading tokens are
        already cached. Hits stop before the block holding the last token: that token is always
        recomputed (its logits are needed) and must not be written into a shared block. `reuse`
        False: take no hits (the caller needs every position computed, e.g. to score the prompt)."""
        assert not seq.block_table, "sequence already has blocks"
        bs, alloc = self.block_size, self.allocator
        num_cached, parent = 0, None
        hit_limit = (len(token_ids) - 1) // bs if alloc.enable_prefix_caching and reuse else 0
        for i in range(hit_limit):
            ids = tuple(token_ids[i * bs : (i + 1) * bs])
            h = block_hash(parent, ids)
            bid = alloc.lookup(h, ids)
            if bid is None:
                break
            seq.block_table.append(bid)
            seq.hashes.append(h)
            parent, num_cached = h, num_cached + bs
        for _ in range(len(seq.block_table), self.blocks_for(len(token_ids))):
            seq.block_table.append(alloc.allocate())
        seq.version = next(_versions)
        return num_cached

    def blocks_missing(self, seq: SeqBlocks, num_tokens: int) -> int:
        """New blocks the sequence needs to hold `num_tokens` tokens in total."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_append(self, seq: SeqBlocks, num_tokens: int) -> bool:
        """Room for the sequence to hold `num_tokens` tokens in total?"""
        return self.allocator.can_allocate(self.blocks_missing(seq, num_tokens))

    def append_slot(self, seq: SeqBlocks, num_tokens: int) -> None:
        while len(seq.block_table) < self.blocks_for(num_tokens):
            seq.block_table.append(self.allocator.allocate())
        seq.version = next(_versions)

    def trim(self, seq: SeqBlocks, num_tokens: int) -> None:
        """Give back the blocks past the first `num_tokens` tokens' (the slots a speculative step
        wrote for proposals that were rejected). They hold no published block: only full blocks of
        computed tokens are published, and these lie past the sequence's computed tokens."""
        keep = self.blocks_for(num_tokens)
        if len(seq.block_table) <= keep:
            return
        assert len(seq.hashes) <= keep, "a published block would be given back"
        for bid in reversed(seq.block_table[keep:]):
            self.allocator.free(bid)
        del seq.block_table[keep:]
        seq.version = next(_versions)

    def cache_computed(self, seq: SeqBlocks, token_ids: list[int], num_computed: int) -> None:
        """Register the full blocks among the first `num_computed` tokens, now that their KV exists."""
        if not self.allocator.enable_prefix_caching:
            return
        bs = self.block_size
        parent = seq.hashes[-1] if seq.hashes else None
        for i in range(len(seq.hashes), num_computed // bs):
            ids = tuple(token_ids[i * bs : (i + 1) * bs])
            h = block_hash(parent, ids)
            self.allocator.register(seq.block_table[i], h, ids)
            seq.hashes.append(h)
            parent = h

    def free(self, seq: SeqBlocks) -> None:
        # Tail first, so that eviction (oldest first) drops a prefix's leaves before its root.
        for bid in reversed(seq.block_table):
            self.allocator.free(bid)
        seq.block_table.clear()
        seq.hashes.clear()
        seq.version = next(_versions)

    def slot(self, seq: SeqBlocks, position: int) -> int:
        return slot_of(seq.block_table, position, self.block_size)

    def check_all_free(self) -> bool:
        """True when no block is referenced (what leak tests assert)."""
        return self.allocator.num_free == self.allocator.num_blocks
