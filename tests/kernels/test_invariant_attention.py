"""invariant_attention against the attention reference, and its contract: a position's bits do not
depend on the batch, the chunking, prefill versus decode, or the split path (TRITON_INTERPRET=1 on
CPU, see tests/conftest.py).

Every case writes the sequences' K/V to randomly permuted cache blocks and fills every slot no
sequence owns with NaN. The invariance tests compute the same positions of one sequence
  - by a prefill of the whole prompt in one chunk,
  - by prefills in several chunks of different boundaries (each after the previous chunks, as a
    prefix-cache hit or a chunked prefill would),
  - by decodes, one position at a time,
  - inside batches of 1, 7 and 20 other sequences (rows), with the split path and without,
and compare the outputs bitwise.
"""

from __future__ import annotations

import pytest
import torch

from kernels.flash_prefill import tile_map
from kernels.invariant_attention import SEGMENT, invariant_attention, positions_per_tile
from kernels.reference import fp8_dequantize_ref, fp8_quantize_ref, prefill_attention_ref

from tests.helpers import FP8_DTYPES, bits, fp8_cache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 16
# rows that see no key in a segment (masked out of every result) divide by zero in numpy
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


class Cache:
    """Paged K/V of several sequences (their full contexts), NaN everywhere else."""

    def __init__(self, g, lens, kv_heads, head_dim, dtype):
        need = [-(-n // BLOCK) for n in lens]
        num_blocks = sum(need) + 2
        self.k = torch.full((num_blocks, BLOCK, kv_heads, head_dim), float("nan"), dtype=dtype)
        self.v = self.k.clone()
        perm = torch.randperm(num_blocks, generator=g)
        width = max(need) + 1
        self.tables = torch.full((len(lens), width), int(perm[-1]), dtype=torch.int32)  # spare entries: a NaN block
        used = 0
        self.keys, self.values = [], []
        for s, (n, nb) in enumerate(zip(lens, need)):
            self.tables[s, :nb] = perm[used : used + nb].to(torch.int32)
            used += nb
            k = torch.randn(n, kv_heads, head_dim, generator=g).to(dtype)
            v = torch.randn(n, kv_heads, head_dim, generator=g).to(dtype)
            slots = self.tables[s, torch.arange(n) // BLOCK].long() * BLOCK + torch.arange(n) % BLOCK
            self.k.view(-1, kv_heads, head_dim)[slots] = k
            self.v.view(-1, kv_heads, head_dim)[slots] = v
            self.keys.append(k)
            self.values.append(v)
        self.k, self.v, self.tables = self.k.to(DEVICE), self.v.to(DEVICE), self.tables.to(DEVICE)
        self.max_segments = -(-width * BLOCK // SEGMENT)
        self.scales = {}

    def to_fp8(self, fp8: str) -> None:
        """The cache as fp8 (NaN slots NaN bytes), keys and values as the attention reads them."""
        (self.k, ks), (self.v, vs) = fp8_cache(self.k, fp8, 1), fp8_cache(self.v, fp8, 2)
        self.scales = dict(k_scale=ks, v_scale=vs)
        self.keys = [fp8_dequantize_ref(fp8_quantize_ref(k.to(DEVICE), ks, self.k.dtype), ks) for k in self.keys]
        self.values = [fp8_dequantize_ref(fp8_quantize_ref(v.to(DEVICE), vs, self.v.dtype), vs) for v in self.values]


def _run(cache, q_rows, chunks, group, split):
    """chunks: (sequence, first position, length) per chunk; q_rows: the matching query rows, packed."""
    lens = [n for _, _, n in chunks]
    prefix = [p for _, p, _ in chunks]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    tables = cache.tables[torch.tensor([s for s, _, _ in chunks], device=DEVICE)]
    ts, st = tile_map(lens, prefix, positions_per_tile(group))
    tiles = (torch.from_numpy(ts).to(DEVICE), torch.from_numpy(st).to(DEVICE))
    out = torch.full_like(q_rows, float("nan"))
    d = q_rows.shape[-1]
    return invariant_attention(q_rows, cache.k, cache.v, tables, cu, torch.tensor(prefix, dtype=torch.int32, device=DEVICE),
                               tiles, d**-0.5, cache.max_segments, split=split, out=out, **cache.scales)


CASES = [  # (heads, kv_heads, head_dim, dtype, context lengths)
    (2, 2, 32, torch.float16, [1, 300, 37]),
    (4, 1, 48, torch.bfloat16, [530, 17]),  # MQA, head_dim not a power of two
    (6, 2, 16, torch.float16, [260, 64, 3]),  # group 3 (padded to 4)
    (20, 1, 16, torch.float16, [70, 5]),  # a group wider than BLOCK_M: one position per tile of 32 rows
]


@pytest.mark.parametrize("heads,kv_heads,head_dim,dtype,lens", CASES)
@pytest.mark.parametrize("split", [False, True])
def test_matches_reference(heads, kv_heads, head_dim, dtype, lens, split, fp8=None):
    g = torch.Generator().manual_seed(sum(lens) + heads)
    cache = Cache(g, lens, kv_heads, head_dim, dtype)
    if fp8 is not None:
        cache.to_fp8(fp8)
    # every sequence's last 5 positions as a chunk (a prefill after a prefix), plus a decode each
    chunks = [(s, max(0, n - 5), min(n, 5)) for s, n in enumerate(lens)] + [(s, n - 1, 1) for s, n in enumerate(lens)]
    q = torch.randn(sum(c[2] for c in chunks), heads, head_dim, generator=g).to(device=DEVICE, dtype=dtype)
    out = _run(cache, q, chunks, heads // kv_heads, split)
    row = 0
    for s, p, n in chunks:
        k, v = cache.keys[s][: p + n].to(DEVICE), cache.values[s][: p + n].to(DEVICE)
        cu = torch.tensor([0, p + n], dtype=torch.int32, device=DEVICE)
        # the reference attends causally over the whole context; keep the chunk's rows
        full_q = torch.zeros(p + n, heads, head_dim, dtype=dtype, device=DEVICE)
        full_q[p:] = q[row : row + n]
        ref = prefill_attention_ref(full_q, k, v, cu, head_dim**-0.5)[p:]
        tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
        torch.testing.assert_close(out[row : row + n].float(), ref.float(), atol=tol, rtol=tol)
        row += n


@pytest.mark.parametrize("fp8", FP8_DTYPES)
@pytest.mark.parametrize("split", [False, True])
def test_fp8_cache_matches_reference(split, fp8):
    """An fp8 cache (per-head scales, NaN bytes in every unowned slot): prompt chunks and decodes
    against the reference over the dequantized keys and values, MQA at a head size off the powers
    of two (the second case)."""
    test_matches_reference(*CASES[1], split, fp8=fp8)


@pytest.mark.parametrize("heads,kv_heads,head_dim,dtype,lens,fp8", [(*CASES[0], None), (*CASES[1], None),
                                                                    (*CASES[0], "float8_e4m3fn")])
def test_positions_are_invariant(heads, kv_heads, head_dim, dtype, lens, fp8):
    """One sequence's positions computed in one chunk, in several chunks, by decodes, and among
    other sequences' rows in batches of 1, 7 and 20 rows, split or not: bitwise equal (over an
    fp8 cache too, with fewer chunkings and batches: what differs there is only the loads).

    CI time (the interpreter runs every tile): the MQA case (4 positions a tile, 3 segments) is cut
    only at the segment edges (chunks that start off a tile's edge, after a prefix, and cross the
    next segment's edge), as the fp8 case is; the MHA case's other cuts add a length-1 chunk, a
    7-position one and many after prefixes. The largest batch is 20 rows (a row's programs depend
    on the batch only past MAX_SPLIT_PROGRAMS, which test_decode_writes_its_own_kv caps); the chunk
    among chunks is the sequence's last 40 positions after its prefix (`whole` is the one chunk)."""
    g = torch.Generator().manual_seed(11)
    n = max(lens)
    others = [int(x) for x in torch.randint(1, SEGMENT + 40, (20,), generator=g)]
    cache = Cache(g, [n] + others, kv_heads, head_dim, dtype)
    if fp8 is not None:
        cache.to_fp8(fp8)
    group = heads // kv_heads
    q_all = torch.randn(n, heads, head_dim, generator=g).to(device=DEVICE, dtype=dtype)
    whole = _run(cache, q_all, [(0, 0, n)], group, split=False)
    results = {"split whole": _run(cache, q_all, [(0, 0, n)], group, split=True)}
    cuttings = ([1, n // 3, n - 7], [SEGMENT - 1, SEGMENT + 1], list(range(0, n, 97)))
    for cuts in cuttings if fp8 is None and group == 1 else cuttings[1:2]:
        bounds = sorted({0, *[c for c in cuts if 0 < c < n], n})
        pieces = [_run(cache, q_all[a:b], [(0, a, b - a)], group, split=(a % 2 == 0))
                  for a, b in zip(bounds, bounds[1:])]
        results[f"chunks {bounds}"] = torch.cat(pieces)
    probe = [0, 1, SEGMENT - 1, SEGMENT, n - 1]  # positions checked as decodes, alone and in batches
    for split in (False, True):
        results[f"decodes alone split={split}"] = torch.cat(
            [_run(cache, q_all[p : p + 1], [(0, p, 1)], group, split) for p in probe])
        for batch in (7, 20) if fp8 is None else (7,):  # the probes' decode rows, then other sequences' decode rows
            chunks = [(0, p, 1) for p in probe] + [(s, cache.keys[s].shape[0] - 1, 1) for s in range(1, batch - 4)]
            q = torch.randn(len(chunks), heads, head_dim, generator=g).to(device=DEVICE, dtype=dtype)
            q[: len(probe)] = q_all[probe]
            results[f"decodes in {batch} split={split}"] = _run(cache, q, chunks, group, split)[: len(probe)]
    # and as one chunk (its last 40 positions, after its prefix) among other sequences' chunks
    mixed = [(s, max(0, cache.keys[s].shape[0] - 9), min(9, cache.keys[s].shape[0])) for s in range(1, 7)]
    q_mixed = torch.randn(sum(c[2] for c in mixed), heads, head_dim, generator=g).to(device=DEVICE, dtype=dtype)
    out = _run(cache, torch.cat([q_mixed, q_all[n - 40 :]]), mixed + [(0, n - 40, 40)], group, split=False)
    results["chunk among chunks"] = out[q_mixed.shape[0] :]
    for name, got in results.items():
        want = whole[probe] if got.shape[0] == len(probe) else whole[n - got.shape[0] :]  # all, or the last 40
        assert torch.equal(bits(got), bits(want)), f"{name}: not bitwise equal to the one-chunk prefill"
    assert not torch.isnan(whole).any()


@pytest.mark.parametrize("heads,kv_heads,head_dim,dtype,lens", CASES)
@pytest.mark.parametrize("max_programs", [None, 1])
def test_decode_writes_its_own_kv(heads, kv_heads, head_dim, dtype, lens, max_programs, monkeypatch, fp8=None):
    """A decode launch given new_kv writes this step's K/V into the cache (slot -1 skipped) and
    gives the bits of kv_write followed by the launch without it; also when the split grid is
    capped (max_programs 1: one program per (kv head, tile) walks every segment) and the write
    falls to a program that also computes other segments."""
    from kernels import invariant_attention as ia
    from kernels.kv_write import kv_write

    if max_programs is not None:
        monkeypatch.setattr(ia, "MAX_SPLIT_PROGRAMS", max_programs)

    g = torch.Generator().manual_seed(5 + heads)
    cache = Cache(g, lens, kv_heads, head_dim, dtype)
    fused = Cache(torch.Generator().manual_seed(5 + heads), lens, kv_heads, head_dim, dtype)
    if fp8 is not None:
        cache.to_fp8(fp8)
        fused.to_fp8(fp8)
    rows = len(lens) + 1  # one decode per sequence at its last position, then a padding row
    chunks = [(s, n - 1, 1) for s, n in enumerate(lens)]
    q = torch.randn(rows, heads, head_dim, generator=g).to(device=DEVICE, dtype=dtype)
    k_new = torch.randn(rows, kv_heads, head_dim, generator=g).to(device=DEVICE, dtype=dtype)
    v_new = torch.randn(rows, kv_heads, head_dim, generator=g).to(device=DEVICE, dtype=dtype)
    slots = torch.tensor([int(cache.tables[s, (n - 1) // BLOCK]) * BLOCK + (n - 1) % BLOCK for s, n in enumerate(lens)]
                         + [-1], dtype=torch.int64, device=DEVICE)
    kv_write(k_new, v_new, cache.k, cache.v, slots, **cache.scales)
    want = _run(cache, q[:-1], chunks, heads // kv_heads, split=False)
    cu = torch.arange(rows + 1, dtype=torch.int32, device=DEVICE)
    prefix = torch.tensor([n - 1 for n in lens] + [-1], dtype=torch.int32, device=DEVICE)
    tables = torch.cat([fused.tables, fused.tables[:1]])
    tiles = (torch.arange(rows, dtype=torch.int32, device=DEVICE), torch.zeros(rows, dtype=torch.int32, device=DEVICE))
    got = invariant_attention(q, fused.k, fused.v, tables, cu, prefix, tiles, head_dim**-0.5, fused.max_segments,
                              split=True, new_kv=(k_new, v_new, slots), **fused.scales)
    assert torch.equal(bits(got[:-1]), bits(want))
    raw = (lambda t: t.view(torch.uint8)) if fp8 is not None else bits
    assert torch.equal(raw(fused.k), raw(cache.k)) and torch.equal(raw(fused.v), raw(cache.v))


@pytest.mark.parametrize("fp8", FP8_DTYPES)
def test_fp8_decode_writes_its_own_kv(fp8, monkeypatch):
    """new_kv over an fp8 cache: the reference quantizer's bytes, and the bits of kv_write then the
    launch without it."""
    test_decode_writes_its_own_kv(*CASES[2], None, monkeypatch, fp8=fp8)
