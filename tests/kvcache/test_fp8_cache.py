"""kvcache/fp8.py: --kv-cache-dtype names, the scales' layout, and caches that carry their scales
(named apart from tests/kernels/test_fp8.py: pytest needs unique basenames)."""

import pytest
import torch

from kvcache import CacheSpec, KVScales, allocate_kv_cache, cache_scales, dtype_name, resolve_cache_dtype


def test_vllm_names_and_meanings():
    assert resolve_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_cache_dtype("fp8", torch.bfloat16) == resolve_cache_dtype("fp8_e4m3", torch.float16) \
        == torch.float8_e4m3fn
    assert resolve_cache_dtype("fp8_e5m2", torch.float32) == torch.float8_e5m2
    assert [dtype_name(d) for d in (torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16)] == \
        ["fp8_e4m3", "fp8_e5m2", "bfloat16"]
    with pytest.raises(ValueError, match="fp8_e5m2"):
        resolve_cache_dtype("int8", torch.float16)


def test_an_fp8_block_takes_half_the_bytes_and_a_budget_twice_the_blocks():
    spec16 = CacheSpec(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16)
    spec8 = CacheSpec(4, 2, 64, 16, torch.float8_e4m3fn)
    assert 2 * spec8.bytes_per_block == spec16.bytes_per_block == 2 * 4 * 16 * 2 * 64 * 2
    budget = 100 * spec16.bytes_per_block
    assert spec16.blocks_for_budget(budget) == 99 and spec8.blocks_for_budget(budget) == 199


def test_fp8_caches_carry_their_layers_scales():
    spec = CacheSpec(num_layers=3, num_kv_heads=5, head_dim=8, block_size=4, dtype=torch.float8_e4m3fn)
    k = torch.arange(15, dtype=torch.float32).view(3, 5) + 1
    scales = KVScales.filled(3, 5, "cpu", "test", k, 0.5)
    for row in (*scales.k, *scales.v):  # the decode kernel's cached plans need 16-byte aligned pointers
        assert row.data_ptr() % 16 == 0 and row.is_contiguous()
    caches = allocate_kv_cache(spec, num_blocks=6, device="cpu", scales=scales)
    for i, (kc, vc) in enumerate(caches):
        assert kc.shape == (7, 4, 5, 8) and kc.dtype == torch.float8_e4m3fn
        ks, vs = cache_scales(kc, vc)
        assert torch.equal(ks, k[i]) and torch.equal(vs, torch.full((5,), 0.5))
        assert ks.data_ptr() == scales.k[i].data_ptr()  # the same memory: a calibration pass writes it in place
        assert type(kc[0]) is torch.Tensor and type(kc.view(torch.uint8)) is torch.Tensor  # ops give plain tensors
    assert caches[0][0].data_ptr() + caches[0][0].numel() == caches[0][1].data_ptr()  # one allocation, as before
    plain = allocate_kv_cache(CacheSpec(3, 5, 8, 4, torch.float16), 6, "cpu")
    assert cache_scales(*plain[0]) == (None, None)
    assert scales.per_head() and not KVScales.filled(3, 5, "cpu", "test").per_head()
    assert "per KV head" in scales.describe() and "test" in scales.describe()
