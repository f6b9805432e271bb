"""FP8 K/V in the paged cache: what a stored byte means, and the in-kernel quantize / dequantize.

Contract (semantics = ``kernels.reference.fp8_quantize_ref`` / ``fp8_dequantize_ref``), vLLM's
``--kv-cache-dtype fp8`` meaning: a layer's K (or V) cache holds, for a value x of KV head h,
  stored = fp8(clamp(x * (1 / scale[h]), -MAX, MAX)),   read back as   stored * scale[h]
with scale[h] the layer's fp32 k_scale (or v_scale) of that head (per-tensor scales are the same
value for every head). 1 / scale is rounded once to fp32, the product once to fp32, and the cast to
fp8 rounds to nearest even: e4m3 (torch.float8_e4m3fn, tl.float8e4nv, MAX 448) or e5m2
(torch.float8_e5m2, tl.float8e5, MAX 57344). Values past +-MAX saturate (the hardware's satfinite
conversion does the same), NaN stays NaN.

Why the rounding is integer arithmetic on the fp32 bits (``quantize``) rather than Triton's cast:
Triton's interpreter casts fp32 -> fp8 wrongly (triton 3.9: ties away from even, and no carry into
the exponent: 25 -> 26 and -126.35 -> -64 in e4m3), so the CPU tests could not check the cast the
GPU makes. This way every device runs the one rounding the tests check, bit for bit against torch's
own cast (``tests/kernels/test_fp8.py`` covers every fp8 value, the midpoints between neighbours and
one ulp either side). It costs ~15 integer operations an element, only where K/V are written.

Loads (``dequantize``) use Triton's cast, which is exact (every e4m3 and e5m2 value is a float16,
bfloat16 and float32 value); under the interpreter they go through fp32, since its e5m2 -> fp16 cast
is wrong too (and on the GPU e5m2 -> bf16 goes through fp32: triton 3.6 reads e5m2 inf and NaN as
finite bf16). Kernels multiply by the scales outside the tiles: K's scale is folded into the softmax
scale and V's into the output (per KV head, one multiply a row), so an fp8 tile costs one cast.

The attention dots over fp8 tiles run in fp16 whatever the model's dtype (``fp16_rows``): on Hopper
e4m3 -> fp16 is one conversion instruction per two values, while e4m3 -> bf16 goes through fp16 and
fp32 (four), and conversions issue at a fraction of the rate of other arithmetic. A decode kernel
casting to bf16 ran at 46-72% of the copy bandwidth on an H100 (counted in fp8 bytes;
benchmarks/results/fp8_kv_bf16-dots_h100.json), which that would explain; the fp16 path is not
measured yet. A bf16 query row is exact in fp16 once
scaled by a power of two that brings its largest |value| into [1, 2) (bf16 keeps 8 significant bits,
fp16 11); the row's scores are scaled back by the inverse power, so nothing overflows and a row's
result does not depend on the others'. Probabilities go to fp16 for the P.V dot (3 more mantissa
bits than bf16).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.reference import FP8_MAX
from kernels.rounding import round_to

_INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


def is_fp8(dtype: torch.dtype) -> bool:
    """An fp8 KV cache dtype these kernels store (float8_e4m3fn, float8_e5m2)."""
    return dtype in FP8_MAX


@triton.jit
def _round_bits(y, MANT: tl.constexpr, BIAS: tl.constexpr):
    """fp8 bits (int32, 0..255) of y, fp32 already within +-MAX: MANT mantissa bits, exponent bias BIAS."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    SHIFT: tl.constexpr = 23 - MANT
    # normal range: round the fp32 mantissa to MANT bits, nearest even (a carry moves into the
    # exponent), then rebias the exponent
    normal = ((mag + ((1 << (SHIFT - 1)) - 1) + ((mag >> SHIFT) & 1)) >> SHIFT) - ((127 - BIAS) << MANT)
    # below the smallest normal (2^(1 - BIAS)): a multiple of 2^(1 - BIAS - MANT), rounded to the
    # nearest even multiple by the fp32 add of 2^23 (exact for magnitudes this small; the min keeps
    # the unused lanes of large values from overflowing the int32 cast)
    units = tl.minimum(tl.abs(y) * (2.0 ** (BIAS - 1 + MANT)), 1024.0)
    sub = ((units + 8388608.0) - 8388608.0).to(tl.int32)
    out = tl.where(mag < ((128 - BIAS) << 23), sub, normal)
    out = tl.where(y != y, 0x7F, out)  # NaN: all exponent and mantissa bits set, in both formats
    return out | sign


@triton.jit
def quantize(x, inv_scale, dtype: tl.constexpr):
    """x (any float; inv_scale broadcast against it, fp32 1 / scale) stored as `dtype`
    (tl.float8e4nv or tl.float8e5): see the module docstring."""
    y = x.to(tl.float32) * inv_scale
    if dtype == tl.float8e5:
        y = tl.minimum(tl.maximum(y, -57344.0, propagate_nan=tl.PropagateNan.ALL), 57344.0,
                       propagate_nan=tl.PropagateNan.ALL)
        bits = _round_bits(y, 2, 15)
    else:
        y = tl.minimum(tl.maximum(y, -448.0, propagate_nan=tl.PropagateNan.ALL), 448.0,
                       propagate_nan=tl.PropagateNan.ALL)
        bits = _round_bits(y, 3, 7)
    return bits.to(tl.uint8).to(dtype, bitcast=True)


@triton.jit
def dequantize(c, dtype: tl.constexpr):
    """fp8 `c` as `dtype` (exact; the caller multiplies by the scale where it pays least)."""
    # (one return: Triton compiles the statements after a return inside a static branch too)
    if _INTERPRET:
        # The interpreter's fp8 -> fp32 cast is right but for the special values (triton 3.9: e4m3
        # NaN -> 480, e5m2 inf -> 65536 and NaN -> 81920..114688), and its fp32 -> fp16 cast of those
        # then overflows: NaN stays NaN here, as on the GPU, so that tests of poisoned slots mean
        # what they say.
        f = c.to(tl.float32)
        low = c.to(tl.uint8, bitcast=True).to(tl.int32) & 0x7F
        if c.dtype == tl.float8e5:
            f = tl.where(low == 0x7C, tl.where(f > 0, float("inf"), float("-inf")), f)
            f = tl.where(low > 0x7C, float("nan"), f)
        else:
            f = tl.where(low == 0x7F, float("nan"), f)
        out = f.to(dtype)
    elif c.dtype == tl.float8e5 and dtype == tl.bfloat16:
        out = c.to(tl.float32).to(dtype)
    else:
        out = c.to(dtype)
    return out


@triton.jit
def held(c, scale, dtype: tl.constexpr):
    """What fp8 `c` stored with `scale` means, c * scale in fp32, rounded to `dtype` (nearest even):
    the value written back over a K/V row the cache quantized (kv_write, rope_kv_write), so that
    attention over this step's own rows reads them as later steps read them from the cache."""
    return round_to(dequantize(c, tl.float32) * scale, dtype)


@triton.jit
def fp16_rows(q):
    """q [rows, d] as fp16 times a power of two per row, which brings the row's largest |value| into
    [1, 2), and those powers' inverses [rows] (fp32), to multiply the row's dot products by. Exact for
    bf16 and fp16 q whose values stay above 2^-14 of their row's largest."""
    qf = q.to(tl.float32)
    e = (tl.max(tl.abs(qf), axis=1).to(tl.int32, bitcast=True) >> 23) & 0xFF  # the biased exponent
    e = tl.minimum(tl.maximum(e, 1), 253)  # an all-zero row (padding) stays zero, nothing overflows
    down = ((254 - e) << 23).to(tl.float32, bitcast=True)  # 2^(127 - e)
    up = (e << 23).to(tl.float32, bitcast=True)  # 2^(e - 127)
    return (qf * down[:, None]).to(tl.float16), up


@triton.jit
def inverse(scale):
    """1 / scale rounded once to fp32 (IEEE division, as torch's `1.0 / scale`)."""
    return tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)


def check_scales(cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> bool:
    """Whether `cache` is fp8 (then k_scale and v_scale must be fp32 [num_kv_heads] on its device);
    raises when the scales do not fit."""
    if not is_fp8(cache.dtype):
        return False
    kvh = cache.shape[-2]
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None:
            raise ValueError(f"an {cache.dtype} KV cache needs {name} (fp32 [num_kv_heads])")
        if s.dtype != torch.float32 or s.shape != (kvh,) or s.device != cache.device or s.stride(0) != 1:
            raise ValueError(f"{name} must be a contiguous fp32 [{kvh}] tensor on {cache.device}, got "
                             f"{s.dtype} {tuple(s.shape)} on {s.device}")
    return True


def placeholder(x: torch.Tensor | None, fallback: torch.Tensor) -> torch.Tensor:
    """A scale argument the kernel never reads (16-bit caches): any tensor will do."""
    return fallback if x is None else x

