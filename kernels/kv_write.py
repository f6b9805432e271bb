"""KV write: scatter this step's K/V rows into the paged cache.

Contract (semantics = ``kernels.reference.kv_write_ref``):
  k, v          [num_tokens, num_kv_heads, head_dim], any float dtype, last dim contiguous (token and
                head strides free, so views into a fused qkv projection work without a copy).
  k_cache,
  v_cache       [num_blocks, block_size, num_kv_heads, head_dim], last dim contiguous; rows are
                converted to the cache dtype: rounded to nearest even, or for an fp8 cache
                (float8_e4m3fn / float8_e5m2) quantized with the per-head scales (kernels/fp8.py).
  slot_mapping  [num_tokens] int32 or int64: flat slot = block * block_size + offset.
                A slot of -1 (any negative value) is padding: that token is skipped and nothing
                in the cache is touched for it.
  k_scale,
  v_scale       fp32 [num_kv_heads], contiguous: an fp8 cache's scales (required then, else unused).

An fp8 cache's rows are also written back over k and v (`held`: the stored value times its scale,
rounded to their dtype), so that attention over this step's own K/V (a prefill chunk's) reads what
later steps read from the cache: a token then attends over the same values whether its keys came
from the same chunk, an earlier chunk, a prefix hit or a recomputation after preemption (vLLM's
attention reads every key from the cache). Padding rows (slot -1) are left as they are.

One program per token writes all of its heads. Cache offsets are computed in int64. Slots must be
unique among non-padding tokens (as they are when each token owns its slot); duplicates would race.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.fp8 import check_scales, held, inverse, placeholder, quantize

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _kv_write_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr,
    num_kv_heads,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_kch,
    stride_vcb, stride_vct, stride_vch,
    HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, KV_FP8: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        offs_h = tl.arange(0, HEADS_PAD)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < HEAD_DIM)
        tok64 = tok.to(tl.int64)
        k_src = k_ptr + tok64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
        v_src = v_ptr + tok64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
        k = tl.load(k_src, mask=mask)
        v = tl.load(v_src, mask=mask)
        if KV_FP8:
            h_ok = offs_h < num_kv_heads
            k_sc = tl.load(ks_ptr + offs_h, mask=h_ok, other=1.0)[:, None]
            v_sc = tl.load(vs_ptr + offs_h, mask=h_ok, other=1.0)[:, None]
            k = quantize(k, inverse(k_sc), kc_ptr.dtype.element_ty)
            v = quantize(v, inverse(v_sc), vc_ptr.dtype.element_ty)
            tl.store(k_src, held(k, k_sc, k_ptr.dtype.element_ty), mask=mask)
            tl.store(v_src, held(v, v_sc, v_ptr.dtype.element_ty), mask=mask)
        kc = kc_ptr + block * stride_kcb + off * stride_kct
        vc = vc_ptr + block * stride_vcb + off * stride_vct
        tl.store(kc + offs_h[:, None] * stride_kch + offs_d[None, :], k.to(kc_ptr.dtype.element_ty), mask=mask)
        tl.store(vc + offs_h[:, None] * stride_vch + offs_d[None, :], v.to(vc_ptr.dtype.element_ty), mask=mask)


def kv_write(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write k, v [num_tokens, kv_heads, head_dim] into their cache slots; slot -1 is skipped. An fp8
    cache takes its per-head scales k_scale, v_scale [kv_heads] fp32, and the written rows of k and v
    become what it holds (see the module docstring)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape, "k and v must have the same shape"
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (num_kv_heads, head_dim)
    assert slot_mapping.shape == (num_tokens,)
    assert slot_mapping.dtype in (torch.int32, torch.int64)
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    fp8 = check_scales(k_cache, k_scale, v_scale)
    if num_tokens == 0:
        return
    block_size = k_cache.shape[1]
    elems = triton.next_power_of_2(num_kv_heads) * triton.next_power_of_2(head_dim)
    _kv_write_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, placeholder(k_scale, slot_mapping), placeholder(v_scale, slot_mapping),
        num_kv_heads,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HEAD_DIM=head_dim, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size, KV_FP8=fp8,
        # a [heads, d] tile of 16-byte vectors: one warp per ~256 elements, at most 8
        num_warps=1 if _INTERPRET else max(1, min(8, elems // 256)),
    )
