"""flash_prefill over a gathered prefix (prefix_starts): every chunk's prefix blocks copied out of
the paged cache back to back, read in whole descriptor tiles. Against prefill_attention_ref over the
paged cache, and against the paged loop itself (the same values: the copy holds the same keys).

The copies carry what the cache holds, NaN included: the tail of each sequence's last block and a
NaN block between sequences (as a copy of a block-table entry nobody owns would), so a score or V row
past a prefix's end that leaked would show. Runs under TRITON_INTERPRET=1 on CPU, like the rest.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from kernels.flash_prefill import block_m, flash_prefill, gathered_prefix_ok, tile_map
from kernels.reference import prefill_attention_ref

from tests.helpers import FP8_DTYPES, fp8_cache
from tests.kernels.test_flash_prefill import DEVICE, _check, _paged_prefix, _randn


@pytest.fixture
def gen(request) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.name.encode()))


def _gathered(k_cache, v_cache, tables, prefix_lens, block_size, nan_gap=True):
    """Each sequence's blocks copied back to back (and, with nan_gap, one NaN block after each):
    (k, v, prefix_starts)."""
    ids, starts, row = [], [], 0
    nan_block = tables[0, -1].item()  # _paged_prefix: entries past a sequence's last block own NaN
    for s, plen in enumerate(prefix_lens.tolist()):
        nb = -(-plen // block_size)
        starts.append(row)
        ids += tables[s, :nb].tolist() + ([nan_block] if nan_gap else [])
        row += (nb + nan_gap) * block_size
    idx = torch.tensor(ids, dtype=torch.long, device=k_cache.device)
    if k_cache.element_size() == 1:
        copy = lambda c: c.view(torch.uint8).index_select(0, idx).view(c.dtype)  # noqa: E731
    else:
        copy = lambda c: c.index_select(0, idx)  # noqa: E731
    return copy(k_cache), copy(v_cache), torch.tensor(starts, dtype=torch.int32, device=k_cache.device)


def _case(g, lens, prefix, heads, kv_heads, head_dim, dtype, block_size=16, fp8=None, tiles=False):
    total = sum(lens)
    q = _randn(g, total, heads, head_dim, dtype=dtype)
    k = _randn(g, total, kv_heads, head_dim, dtype=dtype)
    v = _randn(g, total, kv_heads, head_dim, dtype=dtype)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    kc, vc, bt, pl = _paged_prefix(g, prefix, block_size, kv_heads, head_dim, dtype)
    scales = {}
    if fp8 is not None:
        (kc, ks), (vc, vs) = fp8_cache(kc, fp8, 1), fp8_cache(vc, fp8, 2)
        scales = dict(k_scale=ks, v_scale=vs)
    kg, vg, starts = _gathered(kc, vc, bt, pl, block_size)
    kw = {}
    if tiles:
        seqs, first = tile_map(lens, prefix, block_m(head_dim, max(lens), q.device, heads // kv_heads))
        kw["tiles"] = (torch.from_numpy(seqs).to(DEVICE), torch.from_numpy(first).to(DEVICE))
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    flash_prefill(q, k, v, cu, max(lens), scale, k_cache=kg, v_cache=vg, prefix_lens=pl, prefix_starts=starts,
                  out=out, **scales, **kw)
    paged = flash_prefill(q, k, v, cu, max(lens), scale, k_cache=kc, v_cache=vc, block_tables=bt, prefix_lens=pl,
                          **scales, **kw)
    ref = prefill_attention_ref(q, k, v, cu, scale, k_cache=kc, v_cache=vc, block_tables=bt, prefix_lens=pl,
                                **scales)
    _check(out, ref, dtype)
    torch.testing.assert_close(out, paged, rtol=0, atol=2e-3 if dtype == torch.float16 else 1e-2)


# Prefixes ending mid-block, on a block edge, none, long under one new token, and past one key tile
# (the interpreter's 32-key tiles: whole tiles unmasked, then a partial one); MHA, packed GQA, MQA.
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(2, 2, 64), (8, 2, 64), (4, 1, 128)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gathered_matches_reference_and_paged(gen, heads, kv_heads, head_dim, dtype):
    _case(gen, [1, 37, 64, 5, 20], [300, 19, 0, 32, 77], heads, kv_heads, head_dim, dtype)


def test_gathered_with_a_tile_map(gen):
    """The engine's launch: a tile map, most work first, over mixed chunks."""
    _case(gen, [70, 1, 33, 9], [40, 129, 0, 16], 8, 2, 64, torch.bfloat16, tiles=True)


@pytest.mark.parametrize("fp8", FP8_DTYPES)
def test_gathered_fp8(gen, fp8):
    """An fp8 cache's copy (NaN bytes in unowned slots), read with its per-head scales."""
    _case(gen, [1, 37, 64, 5], [300, 19, 0, 16], 8, 2, 64, torch.bfloat16, fp8=fp8)


def test_gathered_block_sizes(gen):
    _case(gen, [3, 50], [45, 8], 4, 2, 64, torch.float16, block_size=8)
    _case(gen, [3, 50], [45, 100], 4, 2, 64, torch.float16, block_size=64)


def test_gathered_input_errors():
    q = torch.zeros(4, 2, 64, dtype=torch.float16, device=DEVICE)
    cu = torch.tensor([0, 4], dtype=torch.int32, device=DEVICE)
    cache = torch.zeros(2, 16, 2, 64, dtype=torch.float16, device=DEVICE)
    pl = torch.tensor([5], dtype=torch.int32, device=DEVICE)
    starts = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    bt = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="one of block_tables, prefix_starts"):
        flash_prefill(q, q, q, cu, 4, 0.1, k_cache=cache, v_cache=cache, block_tables=bt, prefix_lens=pl,
                      prefix_starts=starts)
    strided = cache.transpose(0, 1)
    with pytest.raises(ValueError, match="contiguous copies"):
        flash_prefill(q, q, q, cu, 4, 0.1, k_cache=strided, v_cache=strided, prefix_lens=pl, prefix_starts=starts)


def test_gathered_prefix_ok():
    dev = torch.device(DEVICE)
    assert gathered_prefix_ok(64, dev) and gathered_prefix_ok(128, dev)
    assert not gathered_prefix_ok(96, dev) and not gathered_prefix_ok(8, dev)
