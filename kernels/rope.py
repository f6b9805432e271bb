"""Rotary position embedding (RoPE) of q and k, fused with the K/V write into the paged cache.

Contract (semantics = ``kernels.reference.rope_kv_write_ref``, built on ``rope_ref``):
  q             [num_tokens, num_heads, head_dim], float16 / bfloat16 / float32.
  k, v          [num_tokens, num_kv_heads, head_dim], q's dtype.
                q, k and v may be strided views (e.g. of one merged QKV projection output): token and
                head strides are free; the last dim must be contiguous. head_dim must be even (any
                even size: 64, 80, 96, 128, ...). q, k, v must not overlap one another.
  positions     [num_tokens] int32 / int64: the position of each token (row of cos/sin).
  cos, sin      [max_positions, head_dim] float32 tables, last dim contiguous: the non-interleaved
                ("rotate_half") convention, emb = cat(freqs, freqs) (times any attention scaling).
  k_cache,
  v_cache       [num_blocks(+1), block_size, num_kv_heads, head_dim], last dim contiguous (any block
                size). Rows are converted to the cache dtype (round-to-nearest-even), or for an fp8
                cache quantized with k_scale / v_scale (fp32 [num_kv_heads]), as kv_write does
                (kernels/fp8.py); then the written rows of k (rotated) and v are replaced by what
                the fp8 cache holds, dequantized to their dtype (kernels/kv_write.py says why).
  slot_mapping  [num_tokens] int32 / int64: flat slot = block * block_size + offset; a negative slot
                (-1, padding) writes nothing for that token.
  write_cache   True: rotate, then write rotated k and (unrotated) v into the cache at slot_mapping.
                False: rotate only; v, k_cache, v_cache and slot_mapping may be None. This is for
                steps the decode kernel finishes, since paged_decode's fused path (k_new, v_new,
                slot_mapping) writes this step's K/V itself.

What it does, in ONE launch: q and k are rotated IN PLACE (q, k are returned for convenience; they
are the same tensors), so that afterwards the caller hands q, k, v to the attention kernels exactly
as before (flash_prefill reads the step's own k; paged_decode's k_new reads it too). Every row is
rotated, padding rows (slot -1) included; only their cache write is skipped.

Numerics, per element, exactly as transformers' ``apply_rotary_pos_emb`` computes in x's dtype:
cos and sin are looked up at the token's position and ROUNDED TO x's DTYPE first; then
out = x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x[..., d/2:], x[..., :d/2]), where
torch rounds each product and the sum to x's dtype. The kernel computes each of those steps in fp32
and rounds it (kernels/rounding.py), so the result is bit-identical to the reference in every dtype
(fp32 too: the launch disables FMA contraction on the GPU, so x*cos + r*sin rounds twice, as torch).
Measured bit-identical to the model's rotation on an H100 (triton 3.6) and under the interpreter.

Not checked: positions in range of the tables, slot values in range of the cache, uniqueness of
non-padding slots (duplicates would race), aliasing between q, k and v. Cache offsets are int64.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.fp8 import check_scales, held, inverse, placeholder, quantize
from kernels.rounding import round_to

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _rotate_heads(base, stride_h, num_heads, c1, s1, c2, s2, offs_h, offs_d, dmask, HALF: tl.constexpr):
    """Rotate the [num_heads, 2 * HALF] rows at `base` in place; returns the rotated halves (x's dtype)."""
    mask = (offs_h[:, None] < num_heads) & dmask[None, :]
    p1 = base + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    # first half:  x1 * cos1 + (-x2) * sin1;  second half: x2 * cos2 + x1 * sin2; every step rounded.
    dt = base.dtype.element_ty
    o1 = round_to(round_to(x1 * c1, dt).to(tl.float32) - round_to(x2 * s1, dt).to(tl.float32), dt)
    o2 = round_to(round_to(x2 * c2, dt).to(tl.float32) + round_to(x1 * s2, dt).to(tl.float32), dt)
    tl.store(p1, o1, mask=mask)
    tl.store(p1 + HALF, o2, mask=mask)
    return o1, o2, mask


@triton.jit
def _rope_kv_write_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr,
    num_heads, num_kv_heads,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cos, stride_sin,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, HQ_PAD: tl.constexpr, HKV_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, WRITE: tl.constexpr, KV_FP8: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    dt = q_ptr.dtype.element_ty
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    offs_d = tl.arange(0, HALF_PAD)
    dmask = offs_d < HALF
    # cos/sin of this position, rounded to x's dtype (then exact in fp32), as [1, HALF_PAD] rows.
    cp = cos_ptr + pos * stride_cos + offs_d
    sp = sin_ptr + pos * stride_sin + offs_d
    c1 = round_to(tl.load(cp, mask=dmask, other=0.0), dt).to(tl.float32)[None, :]
    c2 = round_to(tl.load(cp + HALF, mask=dmask, other=0.0), dt).to(tl.float32)[None, :]
    s1 = round_to(tl.load(sp, mask=dmask, other=0.0), dt).to(tl.float32)[None, :]
    s2 = round_to(tl.load(sp + HALF, mask=dmask, other=0.0), dt).to(tl.float32)[None, :]

    offs_q = tl.arange(0, HQ_PAD)
    _rotate_heads(q_ptr + tok * stride_qt, stride_qh, num_heads, c1, s1, c2, s2, offs_q, offs_d, dmask, HALF)
    offs_h = tl.arange(0, HKV_PAD)
    k1, k2, kmask = _rotate_heads(k_ptr + tok * stride_kt, stride_kh, num_kv_heads, c1, s1, c2, s2, offs_h,
                                  offs_d, dmask, HALF)
    if WRITE:
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        if slot >= 0:
            block = slot // BLOCK_SIZE
            off = slot % BLOCK_SIZE
            kc = kc_ptr + block * stride_kcb + off * stride_kct + offs_h[:, None] * stride_kch + offs_d[None, :]
            vp = v_ptr + tok * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
            vc = vc_ptr + block * stride_vcb + off * stride_vct + offs_h[:, None] * stride_vch + offs_d[None, :]
            v1 = tl.load(vp, mask=kmask, other=0.0).to(tl.float32)
            v2 = tl.load(vp + HALF, mask=kmask, other=0.0).to(tl.float32)
            if KV_FP8:  # k1, k2 are the rotated k in x's dtype, as the cache of a 16-bit run would hold it
                h_ok = offs_h < num_kv_heads
                k_sc = tl.load(ks_ptr + offs_h, mask=h_ok, other=1.0)[:, None]
                v_sc = tl.load(vs_ptr + offs_h, mask=h_ok, other=1.0)[:, None]
                kq1 = quantize(k1, inverse(k_sc), kc_ptr.dtype.element_ty)
                kq2 = quantize(k2, inverse(k_sc), kc_ptr.dtype.element_ty)
                vq1 = quantize(v1, inverse(v_sc), vc_ptr.dtype.element_ty)
                vq2 = quantize(v2, inverse(v_sc), vc_ptr.dtype.element_ty)
                tl.store(kc, kq1, mask=kmask)
                tl.store(kc + HALF, kq2, mask=kmask)
                tl.store(vc, vq1, mask=kmask)
                tl.store(vc + HALF, vq2, mask=kmask)
                # k and v become what the cache holds (kernels/kv_write.py says why)
                kp = k_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
                tl.store(kp, held(kq1, k_sc, dt), mask=kmask)
                tl.store(kp + HALF, held(kq2, k_sc, dt), mask=kmask)
                tl.store(vp, held(vq1, v_sc, v_ptr.dtype.element_ty), mask=kmask)
                tl.store(vp + HALF, held(vq2, v_sc, v_ptr.dtype.element_ty), mask=kmask)
            else:
                tl.store(kc, round_to(k1.to(tl.float32), kc_ptr.dtype.element_ty), mask=kmask)
                tl.store(kc + HALF, round_to(k2.to(tl.float32), kc_ptr.dtype.element_ty), mask=kmask)
                tl.store(vc, round_to(v1, vc_ptr.dtype.element_ty), mask=kmask)
                tl.store(vc + HALF, round_to(v2, vc_ptr.dtype.element_ty), mask=kmask)


def rope_kv_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor | None,
    v_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor | None,
    write_cache: bool = True,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k in place and (write_cache) write rotated k and v at slot_mapping; one launch.
    An fp8 cache takes its scales k_scale, v_scale. Returns (q, k), the same tensors. See the module
    docstring."""
    num_tokens, num_heads, head_dim = q.shape
    assert k.dim() == 3 and k.shape[0] == num_tokens and k.shape[2] == head_dim, "k: [num_tokens, kv_heads, d]"
    num_kv_heads = k.shape[1]
    assert head_dim % 2 == 0, "head_dim must be even"
    assert k.dtype == q.dtype and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
    assert q.stride(2) == 1 and k.stride(2) == 1, "q, k: last dim contiguous"
    assert positions.shape == (num_tokens,) and positions.dtype in (torch.int32, torch.int64)
    assert cos.shape == sin.shape and cos.dim() == 2 and cos.shape[1] == head_dim, "cos, sin: [positions, d]"
    assert cos.dtype == sin.dtype == torch.float32 and cos.stride(1) == 1 and sin.stride(1) == 1
    if write_cache:
        assert v is not None and k_cache is not None and v_cache is not None and slot_mapping is not None
        assert v.shape == k.shape and v.dtype == k.dtype and v.stride(2) == 1, "v: like k, last dim contiguous"
        assert k_cache.shape == v_cache.shape and k_cache.dim() == 4 and k_cache.shape[2:] == (num_kv_heads, head_dim)
        assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1
        assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype in (torch.int32, torch.int64)
        cache_args = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                      v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))
        block_size = k_cache.shape[1]
        fp8 = check_scales(k_cache, k_scale, v_scale)
    else:  # the kernel never reads these: any pointers will do (fixed strides: no recompiles)
        v, k_cache, v_cache, slot_mapping = k, k, k, positions
        cache_args, block_size, fp8 = (0,) * 6, 1, False
    if num_tokens == 0:
        return q, k
    half = head_dim // 2
    half_pad, hq_pad, hkv_pad = triton.next_power_of_2(half), triton.next_power_of_2(num_heads), triton.next_power_of_2(num_kv_heads)
    elems = 2 * (hq_pad + 2 * hkv_pad) * half_pad
    _rope_kv_write_kernel[(num_tokens,)](
        q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping,
        placeholder(k_scale, positions), placeholder(v_scale, positions),
        num_heads, num_kv_heads,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), sin.stride(0),
        *cache_args,
        HALF=half, HALF_PAD=half_pad, HQ_PAD=hq_pad, HKV_PAD=hkv_pad,
        BLOCK_SIZE=block_size, WRITE=bool(write_cache), KV_FP8=fp8,
        num_warps=1 if _INTERPRET else 1 << max(0, min(3, (elems // 512).bit_length() - 1)),  # a power of 2, <= 8
        enable_fp_fusion=False,  # x*cos + r*sin must round twice, as torch does (fp32)
    )
    return q, k


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotation only (rope_kv_write with write_cache=False): for steps whose attention kernel
    writes the K/V itself."""
    return rope_kv_write(q, k, None, positions, cos, sin, None, None, None, write_cache=False)
