"""rope_kv_write against rope_kv_write_ref (TRITON_INTERPRET=1 on CPU; see tests/conftest.py).

The cos/sin tables are built by the model's own Rotary (models/llama.py), and the reference is
checked against Rotary.rotate, so "bit-identical to the reference" means bit-identical to the model.
q, k, v are views of one merged QKV output; the cache is poisoned (random values and NaN) and every
slot not written must keep its exact bits. Every comparison is bit-exact, in fp16, bf16 and fp32.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig

from kernels.reference import fp8_dequantize_ref, rope_kv_write_ref, rope_ref
from kernels.rope import rope, rope_kv_write
from models.llama import Rotary

from tests.helpers import FP8_DTYPES, fp8_cache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MAX_POS = 300


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _rotary(head_dim: int, scaled: bool) -> Rotary:
    rope = ({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
             "high_freq_factor": 4.0, "original_max_position_embeddings": 64} if scaled
            else {"rope_type": "default", "rope_theta": 10000.0})
    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=MAX_POS, rope_parameters=rope)
    return Rotary(config, head_dim, torch.device(DEVICE))


def _qkv(n, heads, kv_heads, d, dtype, g):
    """q, k, v as strided views of one [n, (heads + 2 kv_heads) * d] projection output."""
    qkv = (torch.randn(n, (heads + 2 * kv_heads) * d, generator=g) * 2).to(dtype).to(DEVICE)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    return qkv, q.view(n, heads, d), k.view(n, kv_heads, d), v.view(n, kv_heads, d)


def _poisoned_cache(shape, dtype, g):
    c = torch.randn(shape, generator=g).to(dtype)
    c.view(-1)[::5] = float("nan")
    return c.to(DEVICE)


CASES = [  # (num_tokens, num_heads, num_kv_heads, head_dim, block_size, scaled rope)
    (1, 8, 2, 64, 16, False),     # one token, 8:2 grouped-query
    (13, 8, 2, 128, 16, True),    # a batch with padding rows, 8:2, llama3-scaled tables
    (9, 4, 1, 128, 8, False),     # 4:1 (multi-query)
    (6, 12, 4, 80, 16, True),     # non-power-of-two heads and head_dim
]


def _hf_rotate(q, k, positions, rot):
    """transformers' apply_rotary_pos_emb on [n, heads, d] rows, with cos/sin cast to the input
    dtype as its rotary embedding module returns them."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cos = rot.cos[positions.long()][None].to(q.dtype)
    sin = rot.sin[positions.long()][None].to(q.dtype)
    hq, hk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    return hq[0].transpose(0, 1), hk[0].transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "n{}-h{}:{}-d{}-bs{}-{}".format(*c[:5], "scaled" if c[5] else "plain"))
def test_rope_kv_write_matches_reference(dtype, case):
    n, heads, kv_heads, d, block_size, scaled = case
    seed = random.randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    rot = _rotary(d, scaled)
    qkv, q, k, v = _qkv(n, heads, kv_heads, d, dtype, g)
    pos_dtype = torch.int64 if n % 2 else torch.int32
    positions = torch.randint(0, MAX_POS, (n,), generator=g)
    positions[0] = MAX_POS - 1  # the tables' last row
    positions = positions.to(pos_dtype).to(DEVICE)
    num_blocks = -(-n // block_size) + 3
    shape = (num_blocks + 1, block_size, kv_heads, d)  # + the scratch block, as kvcache lays it out
    k_cache, v_cache = _poisoned_cache(shape, dtype, g), _poisoned_cache(shape, dtype, g)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:n]
    if n > 1:
        slots[torch.randperm(n, generator=g)[: max(1, n // 4)]] = -1
    slots = slots.to(torch.int32 if n % 3 else torch.int64).to(DEVICE)

    ref_qkv, rq, rk, rv = _qkv(n, heads, kv_heads, d, dtype, torch.Generator().manual_seed(0))
    ref_qkv.copy_(qkv)
    ref_kc, ref_vc = k_cache.clone(), v_cache.clone()
    rope_kv_write_ref(rq, rk, rv, positions, rot.cos, rot.sin, ref_kc, ref_vc, slots)
    # The reference is transformers' own rotation, bit for bit.
    hf_q, hf_k = _hf_rotate(q.clone(), k.clone(), positions, rot)
    assert torch.equal(_bits(rq), _bits(hf_q)), f"seed={seed}"
    assert torch.equal(_bits(rk), _bits(hf_k)), f"seed={seed}"

    before = qkv.clone()
    out_q, out_k = rope_kv_write(q, k, v, positions, rot.cos, rot.sin, k_cache, v_cache, slots)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()  # in place
    assert not torch.equal(_bits(qkv), _bits(before))
    # q and k rotated in place inside the merged buffer, v untouched: all bit-identical.
    assert torch.equal(_bits(qkv), _bits(ref_qkv)), f"seed={seed}: rotated q/k differ"
    # Listed slots hold rotated k and v; every other slot (NaN included) keeps its bits.
    assert torch.equal(_bits(k_cache), _bits(ref_kc)), f"seed={seed}: k cache differs"
    assert torch.equal(_bits(v_cache), _bits(ref_vc)), f"seed={seed}: v cache differs"
    keep = slots >= 0
    flat_v = v_cache.view(-1, kv_heads, d)
    assert torch.equal(_bits(flat_v[slots[keep].long()]), _bits(v[keep])), f"seed={seed}: v rows not written"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rotation_only_and_all_padding(dtype):
    """write_cache=False (and rope()) rotate exactly as with the write, touching no cache; a call
    whose every slot is -1 rotates every row (padding rows too) and leaves the cache bit-identical."""
    g = torch.Generator().manual_seed(7)
    n, heads, kv_heads, d = 5, 8, 2, 64
    rot = _rotary(d, False)
    qkv, q, k, v = _qkv(n, heads, kv_heads, d, dtype, g)
    positions = torch.tensor([0, 1, 17, 250, 3], device=DEVICE)
    expect_q, expect_k = rope_ref(q, positions, rot.cos, rot.sin), rope_ref(k, positions, rot.cos, rot.sin)
    v_before = v.clone()

    qkv_a = qkv.clone()
    qa, ka = [t.view(n, -1, d) for t in qkv_a.split([heads * d, kv_heads * d, kv_heads * d], -1)][:2]
    rope_kv_write(qa, ka, None, positions, rot.cos, rot.sin, None, None, None, write_cache=False)
    assert torch.equal(_bits(qa), _bits(expect_q)) and torch.equal(_bits(ka), _bits(expect_k))

    qb, kb = rope(q.clone(), k.clone(), positions.to(torch.int32), rot.cos, rot.sin)
    assert torch.equal(_bits(qb), _bits(expect_q)) and torch.equal(_bits(kb), _bits(expect_k))

    shape = (3, 16, kv_heads, d)
    k_cache, v_cache = _poisoned_cache(shape, dtype, g), _poisoned_cache(shape, dtype, g)
    kc0, vc0 = k_cache.clone(), v_cache.clone()
    pad = torch.full((n,), -1, dtype=torch.int32, device=DEVICE)
    rope_kv_write(q, k, v, positions, rot.cos, rot.sin, k_cache, v_cache, pad)
    assert torch.equal(_bits(q), _bits(expect_q)) and torch.equal(_bits(k), _bits(expect_k))
    assert torch.equal(_bits(v), _bits(v_before))
    assert torch.equal(_bits(k_cache), _bits(kc0)) and torch.equal(_bits(v_cache), _bits(vc0))

    q0, k0 = rope_kv_write(q[:0], k[:0], v[:0], positions[:0], rot.cos, rot.sin, k_cache, v_cache, pad[:0])
    assert q0.shape == (0, heads, d) and k0.shape == (0, kv_heads, d)


@pytest.mark.parametrize("fp8", FP8_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rope_kv_write_fp8_cache(dtype, fp8):
    """An fp8 cache: q and k rotated exactly as with a 16-bit cache, and the cache holds the reference
    quantizer's bytes of the rotated k (in x's dtype) and of v, per-head scales, padding skipped."""
    g = torch.Generator().manual_seed(9)
    n, heads, kv_heads, d, block_size = 11, 8, 2, 128, 16
    rot = _rotary(d, True)
    qkv, q, k, v = _qkv(n, heads, kv_heads, d, dtype, g)
    positions = torch.randint(0, MAX_POS, (n,), generator=g).to(DEVICE)
    shape = (3, block_size, kv_heads, d)
    k_cache, k_scale = fp8_cache(_poisoned_cache(shape, dtype, g) * 3, fp8, seed=4)
    v_cache, v_scale = fp8_cache(_poisoned_cache(shape, dtype, g) * 3, fp8, seed=5)
    slots = torch.randperm(3 * block_size, generator=g)[:n].to(DEVICE)
    slots[[2, 7]] = -1
    ref_qkv, rq, rk, rv = _qkv(n, heads, kv_heads, d, dtype, torch.Generator().manual_seed(0))
    ref_qkv.copy_(qkv)
    ref_kc, ref_vc = k_cache.clone(), v_cache.clone()
    rope_kv_write_ref(rq, rk, rv, positions, rot.cos, rot.sin, ref_kc, ref_vc, slots, k_scale=k_scale, v_scale=v_scale)
    rope_kv_write(q, k, v, positions, rot.cos, rot.sin, k_cache, v_cache, slots, k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(_bits(qkv), _bits(ref_qkv)), "rotated q/k differ"
    assert torch.equal(k_cache.view(torch.uint8), ref_kc.view(torch.uint8)), "k cache differs"
    assert torch.equal(v_cache.view(torch.uint8), ref_vc.view(torch.uint8)), "v cache differs"
    keep = slots >= 0  # the written rows of k and v are what the cache holds (the qkv check: padding too)
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        held = fp8_dequantize_ref(cache.view(-1, kv_heads, d)[slots[keep]], scale).to(dtype)
        assert torch.equal(_bits(x[keep]), _bits(held))
