import random

import numpy as np
import pytest
import torch

import kvcache.block_manager as bm_mod
from kvcache import BlockAllocator, BlockManager, CacheSpec, SeqBlocks, allocate_kv_cache, slots_of


def test_allocate_free_refcounts():
    a = BlockAllocator(4, enable_prefix_caching=False)
    ids = [a.allocate() for _ in range(4)]
    assert sorted(ids) == [0, 1, 2, 3] and a.num_free == 0
    assert not a.can_allocate(1)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        a.allocate()
    a.free(ids[0])
    assert a.num_free == 1 and a.allocate() == ids[0]
    for b in ids:
        a.free(b)
    with pytest.raises(RuntimeError, match="double free"):
        a.free(ids[1])


def test_page_table_slots_and_append():
    m = BlockManager(8, block_size=4, enable_prefix_caching=False)
    s = SeqBlocks()
    assert m.allocate(s, list(range(6))) == 0
    assert len(s.block_table) == 2
    for pos in range(6):
        assert m.slot(s, pos) == s.block_table[pos // 4] * 4 + pos % 4
    assert slots_of(s.block_table, np.arange(1, 6), 4).tolist() == [m.slot(s, p) for p in range(1, 6)]
    m.append_slot(s, 8)
    assert len(s.block_table) == 2  # still fits
    m.append_slot(s, 9)
    assert len(s.block_table) == 3
    m.free(s)
    assert m.check_all_free() and s.block_table == []


def test_prefix_hit_shares_blocks_and_last_token_is_recomputed():
    m = BlockManager(16, block_size=4)
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    a = SeqBlocks()
    assert m.allocate(a, prompt) == 0
    m.cache_computed(a, prompt, len(prompt))
    b = SeqBlocks()
    assert m.allocate(b, prompt) == 8
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert m.allocator.blocks[a.block_table[0]].ref_count == 2
    # A prompt of exactly two blocks: the block holding its last token is not shared.
    c = SeqBlocks()
    assert m.allocate(c, prompt[:8]) == 4
    assert c.block_table[1] != a.block_table[1]
    for s in (a, b, c):
        m.free(s)
    assert m.check_all_free()
    # Freed cached blocks stay findable until their space is needed.
    d = SeqBlocks()
    assert m.allocate(d, prompt) == 8
    m.free(d)


def test_prefix_ending_mid_block_only_shares_full_blocks():
    m = BlockManager(16, block_size=4)
    a, b = SeqBlocks(), SeqBlocks()
    p1 = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    m.allocate(a, p1)
    m.cache_computed(a, p1, len(p1))
    p2 = [1, 2, 3, 4, 5, 6, 99, 98, 97]  # shares 6 tokens: one full block and half of the next
    assert m.allocate(b, p2) == 4
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]


def test_forced_hash_collision_does_not_serve_wrong_kv(monkeypatch):
    monkeypatch.setattr(bm_mod, "block_hash", lambda parent, ids: 42)
    m = BlockManager(16, block_size=4)
    a, b = SeqBlocks(), SeqBlocks()
    pa, pb = [1, 2, 3, 4, 5], [9, 9, 9, 9, 5]
    m.allocate(a, pa)
    m.cache_computed(a, pa, 5)
    assert m.allocate(b, pb) == 0  # same hash, different tokens: a miss
    assert not set(a.block_table) & set(b.block_table)


def test_eviction_is_lru_and_only_under_pressure():
    m = BlockManager(4, block_size=2)
    seqs = []
    for base in (10, 20):
        s = SeqBlocks()
        p = [base, base + 1, base + 2]
        m.allocate(s, p)
        m.cache_computed(s, p, 3)
        seqs.append((s, p))
    for s, _ in seqs:
        m.free(s)
    assert m.num_free_blocks == 4 and len(m.allocator.evictable) == 2
    # Three fresh blocks: two come off the free list, the third evicts the oldest cached block.
    t = SeqBlocks()
    m.allocate(t, [1, 2, 3, 4, 5])
    assert len(m.allocator.evictable) == 1
    s2, p2 = seqs[1]
    again = SeqBlocks()
    m.free(t)
    assert m.allocate(again, p2) == 2  # the newer prefix survived
    s1 = SeqBlocks()
    m.free(again)
    assert m.allocate(s1, seqs[0][1]) == 0  # the older one was evicted
    m.free(s1)
    assert m.check_all_free()


def test_random_ops_never_leak():
    rng = random.Random(0)
    m = BlockManager(64, block_size=4)
    live: list[tuple[SeqBlocks, list[int]]] = []
    for _ in range(2000):
        op = rng.random()
        if op < 0.4:
            prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 20))]
            if m.can_allocate(len(prompt)):
                s = SeqBlocks()
                m.allocate(s, prompt)
                live.append((s, prompt))
        elif op < 0.7 and live:
            s, toks = rng.choice(live)
            toks.append(rng.randrange(3))
            if m.can_append(s, len(toks)):
                m.append_slot(s, len(toks))
                m.cache_computed(s, toks, len(toks) - 1)
            else:
                toks.pop()
        elif live:
            s, _ = live.pop(rng.randrange(len(live)))
            m.free(s)
        refs = sum(b.ref_count for b in m.allocator.blocks)
        assert refs == sum(len(s.block_table) for s, _ in live)
    for s, _ in live:
        m.free(s)
    assert m.check_all_free()
    assert all(b.ref_count == 0 for b in m.allocator.blocks)


def test_cache_tensors_and_sizing():
    spec = CacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float16)
    assert spec.bytes_per_block == 2 * 3 * 4 * 2 * 8 * 2
    assert spec.blocks_for_budget(spec.bytes_per_block * 11) == 10
    caches = allocate_kv_cache(spec, 10, "cpu")
    assert len(caches) == 3
    k, v = caches[1]
    assert k.shape == (11, 4, 2, 8) and v.shape == (11, 4, 2, 8)  # + one scratch block
    for i, (k, v) in enumerate(caches):
        k.fill_(2 * i)
        v.fill_(2 * i + 1)
    for i, (k, v) in enumerate(caches):  # no two views alias
        assert (k == 2 * i).all() and (v == 2 * i + 1).all()


def test_page_table_version_names_its_contents():
    # The decode graph copies a row's page table only when the version it holds differs (server/
    # worker/cuda_graphs.py): every change must give a new version, never one another table had.
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = SeqBlocks(), SeqBlocks()
    seen = {a.version, b.version}
    assert len(seen) == 2
    bm.allocate(a, list(range(5)))
    assert a.version not in seen
    seen.add(a.version)
    bm.append_slot(a, 9)  # a third block
    assert a.version not in seen and len(a.block_table) == 3
    seen.add(a.version)
    bm.allocate(b, list(range(3)))
    assert b.version not in seen
    seen.add(b.version)
    table = a.block_table
    bm.free(a)
    assert a.version not in seen and a.block_table == [] and table is a.block_table
    seen.add(a.version)
    bm.allocate(a, list(range(3)))  # the same length as b's table, maybe the same block ids: still new
    assert a.version not in seen


def test_trim_gives_back_the_blocks_past_a_length_and_never_a_published_one():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = SeqBlocks()
    ids = list(range(20))
    bm.allocate(seq, ids[:6])
    bm.append_slot(seq, 6 + 9)  # room for a speculative step's proposals: 15 tokens, 4 blocks
    assert len(seq.block_table) == 4 and bm.num_free_blocks == 4
    bm.cache_computed(seq, ids, 8)  # two full blocks of computed tokens published
    version = seq.version
    bm.trim(seq, 9)  # the accepted run ends at token 9: blocks 3.. go back
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5 and seq.version != version
    bm.trim(seq, 12)  # nothing past it: nothing changes
    assert len(seq.block_table) == 3
    with pytest.raises(AssertionError):
        bm.trim(seq, 4)  # would give back the published second block
    bm.free(seq)
    assert bm.check_all_free()
