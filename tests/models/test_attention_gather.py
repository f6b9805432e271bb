"""The Triton backend's prefix copy (models/attention/triton_backend.py gather_plan): which steps copy
their chunks' prefixes out of the cache, what they copy, and that a step run that way gives the
dense reference's output and cache (the step builder and checks of test_attention_backends.py: NaN
in every slot nobody owns, shuffled blocks), fp8 caches included.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from models.attention import make_backend
from models.attention.triton_backend import GATHER_MIN_ROWS, gather_plan

from tests.helpers import FP8_DTYPES, fp8_cache
from tests.models.test_attention_backends import (BLOCK, DEVICE, MAX_BLOCKS, _build, _check_cache, _check_out,
                                                  _forward, worker_metadata)


def test_gather_plan_lists_each_prefix_block_once():
    lens, prefix = [600, 900, 700], [40, 0, 33]  # 3, 0 and 3 blocks of 16
    plan = gather_plan(lens, prefix, 16, 100, min_rows=1)
    assert plan["gather_seq"].tolist() == [0, 0, 0, 2, 2, 2]
    assert plan["gather_blk"].tolist() == [0, 1, 2, 0, 1, 2]
    assert plan["prefix_starts"].tolist() == [0, 48, 48]  # (the empty prefix's start is never read)
    assert all(a.dtype == np.int32 for a in plan.values())


def test_gather_plan_keeps_the_paged_loop_where_the_copy_does_not_pay():
    assert gather_plan([600], [0], 16, 100) == {}  # no prefix
    # queries per copied key: 512 over one full block copies, 511 does not
    assert gather_plan([GATHER_MIN_ROWS], [16], 16, 100) != {}
    assert gather_plan([GATHER_MIN_ROWS - 1], [16], 16, 100) == {}
    # a partial block is copied whole: 512 queries over 8 keys of a 16-key block do not pay
    assert gather_plan([GATHER_MIN_ROWS], [8], 16, 100) == {}
    # one-token chunks over long prefixes beside a long chunk: the step's total decides
    assert gather_plan([4096, 1, 1], [4096, 4096, 4096], 16, 1000) != {}
    assert gather_plan([1024, 1, 1], [64, 4096, 4096], 16, 1000) == {}
    # more blocks than the memory profile copied
    assert gather_plan([4096], [1600], 16, 100) != {}
    assert gather_plan([4096], [1601], 16, 100) == {}


def test_the_backend_asks_for_a_copy_only_with_the_cache_given():
    backend = make_backend("triton", 64, 2)
    lens, prefix = [4096], [4096]
    assert "prefix_starts" not in backend.prefill_arrays(lens, prefix, torch.device(DEVICE))
    assert "prefix_starts" in backend.prefill_arrays(lens, prefix, torch.device(DEVICE), (16, 1000))
    # the deterministic mode reads every key through its own kernel; head sizes no descriptor reads
    assert "prefix_starts" not in make_backend("triton", 64, 2, deterministic=True).prefill_arrays(
        lens, prefix, torch.device(DEVICE), (16, 1000))
    assert "prefix_starts" not in make_backend("triton", 80, 2).prefill_arrays(
        lens, prefix, torch.device(DEVICE), (16, 1000))


def _gathering_metadata(backend, rows):
    """worker_metadata with the cache given and every prefix worth copying."""
    backend.gather_min_rows = 1
    arrays = backend.prefill_arrays(rows.chunk_lens, rows.chunk_prefix, torch.device(DEVICE), (BLOCK, MAX_BLOCKS * 4))
    assert "prefix_starts" in arrays
    rows.extra = {name: torch.from_numpy(np.asarray(a, dtype=np.int32)).to(DEVICE) for name, a in arrays.items()}
    meta = backend.metadata(rows)
    assert meta.prefix_gather is not None
    return meta


# Chunks over prefixes ending mid-block, on a block edge and none, beside decodes.
CHUNKS = [(21, 6), (0, 19), (32, 9), (5, 30)]


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 64), (4, 4, 64), (4, 1, 128)])
def test_a_step_with_its_prefixes_copied(heads, kv_heads, head_dim):
    step = _build(heads, kv_heads, head_dim, torch.float16, chunks=CHUNKS)
    out, storage = _forward(make_backend("triton", head_dim, heads // kv_heads), step.q, step.k, step.v, step.storage,
                            step.rows, _gathering_metadata, step.scale)
    _check_out(out, step, torch.float16, "gathered")
    _check_cache(storage, step.want_storage, "gathered")


@pytest.mark.parametrize("fp8", FP8_DTYPES)
def test_an_fp8_step_with_its_prefixes_copied_reads_what_the_paged_loop_reads(fp8):
    """Over an fp8 cache (NaN bytes in every unowned slot) the copy holds the cache's bytes: the
    same output as the paged loop's, and the same cache after the step."""
    step = _build(4, 2, 64, torch.bfloat16, chunks=CHUNKS, seed=3)
    storage = torch.empty(step.storage.shape, dtype=getattr(torch, fp8))
    scales = {}
    for layer, kv in itertools.product(range(2), range(2)):
        storage[layer, kv], scales[layer, kv] = fp8_cache(step.storage[layer, kv], fp8, seed=2 * layer + kv)

    def run(metadata):
        return _forward(make_backend("triton", 64, 2), step.q, step.k, step.v, storage, step.rows, metadata,
                        step.scale, kv_scales=(scales[1, 0], scales[1, 1]))

    (paged, cache_paged), (gathered, cache_gathered) = run(worker_metadata), run(_gathering_metadata)
    real = step.real
    assert not gathered[:real].isnan().any()
    torch.testing.assert_close(gathered[:real].float(), paged[:real].float(), atol=1e-2, rtol=1e-2)
    assert torch.equal(cache_paged.view(torch.uint8), cache_gathered.view(torch.uint8))
