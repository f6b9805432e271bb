"""kv_write against kv_write_ref (runs under TRITON_INTERPRET=1 on CPU; see tests/conftest.py).

The cache is poisoned (random values and NaN) before each call; afterwards every listed slot must
hold its row and every other slot must be bit-identical to before (padding slots -1 untouched).
"""

from __future__ import annotations

import random

import pytest
import torch

from kernels.kv_write import kv_write
from kernels.reference import kv_write_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _poisoned_cache(shape, dtype, g):
    c = torch.randn(shape, generator=g).to(dtype)
    c.view(-1)[:: 7] = float("nan")
    return c.to(DEVICE)


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kv_write_matches_reference(dtype: torch.dtype, slot_dtype: torch.dtype) -> None:
    seed = random.randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    num_blocks, block_size, kv_heads, head_dim = 6, 16, 3, 64
    num_tokens = 23
    k = torch.randn(num_tokens, kv_heads, head_dim, generator=g).to(device=DEVICE, dtype=dtype)
    v = torch.randn(num_tokens, kv_heads, head_dim, generator=g).to(device=DEVICE, dtype=dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens].to(slot_dtype)
    pad = torch.randperm(num_tokens, generator=g)[:6]
    slots[pad] = -1
    slots = slots.to(DEVICE)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = _poisoned_cache(shape, dtype, g), _poisoned_cache(shape, dtype, g)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    kv_write_ref(k, v, k_ref, v_ref, slots)
    kv_write(k, v, k_cache, v_cache, slots)
    # Bit-identical everywhere: written slots equal the rows, all other slots (NaN included) unchanged.
    assert torch.equal(_bits(k_cache), _bits(k_ref)), f"seed={seed}: k cache differs"
    assert torch.equal(_bits(v_cache), _bits(v_ref)), f"seed={seed}: v cache differs"
    flat_k = k_cache.view(-1, kv_heads, head_dim)
    keep = slots >= 0
    assert torch.equal(flat_k[slots[keep].long()], k[keep]), f"seed={seed}: rows not written"


def test_kv_write_strided_input_and_cast() -> None:
    """k/v as views of a fused qkv projection (non-contiguous tokens), fp32 rows into an fp16 cache,
    a block size that is not a power of two, and an all-padding call that must touch nothing."""
    seed = random.randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    num_tokens, kv_heads, head_dim, block_size = 9, 2, 32, 12
    qkv = torch.randn(num_tokens, 3, kv_heads, head_dim, generator=g).to(DEVICE)
    k, v = qkv[:, 1], qkv[:, 2]
    assert not k.is_contiguous()
    shape = (4, block_size, kv_heads, head_dim)
    k_cache = _poisoned_cache(shape, torch.float16, g)
    v_cache = _poisoned_cache(shape, torch.float16, g)
    slots = torch.tensor([5, -1, 47, 0, 13, -1, 30, 11, 46], dtype=torch.int64, device=DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    kv_write_ref(k, v, k_ref, v_ref, slots)
    kv_write(k, v, k_cache, v_cache, slots)
    assert torch.equal(_bits(k_cache), _bits(k_ref)), f"seed={seed}: k cache differs"
    assert torch.equal(_bits(v_cache), _bits(v_ref)), f"seed={seed}: v cache differs"

    before_k, before_v = k_cache.clone(), v_cache.clone()
    kv_write(k, v, k_cache, v_cache, torch.full((num_tokens,), -1, dtype=torch.int32, device=DEVICE))
    assert torch.equal(_bits(k_cache), _bits(before_k)) and torch.equal(_bits(v_cache), _bits(before_v))
