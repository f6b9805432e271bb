"""kv_write against kv_write_ref (runs under TRITON_INTERPRET=1 on CPU; see tests/conftest.py).

The cache is poisoned (random values and NaN) before each call; afterwards every listed slot must
hold its row and every other slot must be bit-identical to before (padding slots -1 untouched).
"""

from __future__ import annotations

import random

import pytest
import torch

from kernels.kv_write import kv_write
from kernels.reference import fp8_dequantize_ref, kv_write_ref

from tests.helpers import FP8_DTYPES, fp8_cache

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


@pytest.mark.parametrize("fp8", FP8_DTYPES)
def test_kv_write_fp8_matches_reference_quantizer(fp8: str) -> None:
    """An fp8 cache: each written row holds exactly the reference quantizer's bytes with its head's
    scale, padding rows and every other slot (NaN bytes included) are untouched; bf16 rows and
    rows of fp32 as a strided view of a fused projection. The written rows of k and v become what
    the cache holds (dequantized, in their dtype), the padding rows stay as they were."""
    fp8_dtype = getattr(torch, fp8)
    g = torch.Generator().manual_seed(3)
    num_blocks, block_size, kv_heads, head_dim, n = 5, 16, 3, 64, 21
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, k_scale = fp8_cache(_poisoned_cache(shape, torch.bfloat16, g) * 40, fp8, seed=1)
    v_cache, v_scale = fp8_cache(_poisoned_cache(shape, torch.bfloat16, g), fp8, seed=2)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:n].to(DEVICE)
    slots[::5] = -1
    qkv = (torch.randn(n, 3, kv_heads, head_dim, generator=g) * 30).to(DEVICE)
    for k, v in ((qkv[:, 1].to(torch.bfloat16), qkv[:, 2].to(torch.bfloat16)), (qkv[:, 1], qkv[:, 2])):
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        k_in, v_in = k.clone(), v.clone()
        kv_write_ref(k_in.clone(), v_in.clone(), k_ref, v_ref, slots, k_scale, v_scale)
        kv_write(k, v, k_cache, v_cache, slots, k_scale, v_scale)
        assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8)), f"{fp8}: k cache differs"
        assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8)), f"{fp8}: v cache differs"
        keep = slots >= 0
        for x, x_in, cache, scale in ((k, k_in, k_cache, k_scale), (v, v_in, v_cache, v_scale)):
            back = fp8_dequantize_ref(cache.view(-1, kv_heads, head_dim)[slots[keep]], scale)
            if x is k:  # (v's scales are those of a smaller cache: its rows saturate)
                assert ((back - x_in[keep].float()).abs() <= x_in[keep].float().abs() / 8 + scale[:, None] * 2**-6).all()
            assert torch.equal(x[keep], back.to(x.dtype)), f"{fp8}: a written row is not what the cache holds"
            assert torch.equal(x[~keep], x_in[~keep]), f"{fp8}: a padding row changed"
    with pytest.raises(ValueError, match="needs k_scale"):
        kv_write(k, v, k_cache, v_cache, slots)
