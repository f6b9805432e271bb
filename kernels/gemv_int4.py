"""The int4 decode GEMV's half2 loop: ``kernels.gemv.wo_gemv(..., half2=True)``, which
models/quant/gemms.py takes for a linear whose input is bounded within HALF2_X_BOUND (after an RMSNorm).

wo_gemv's fp32 loop spends ~7 instructions on each weight (sm_90 PTX, benchmarks/kernels/gemv_ir.py):
a nibble's shift, its mask and exponent, the float's bias taken off, the FMA, x's load, conversion
and running sum, one weight at a time. This loop takes two weights an instruction, in fp16 pairs:

  - one lop3 puts two nibbles of a word into an fp16 pair by their bits: (w & 0x000F000F) |
    0x64006400 is (1024 + q_i, 1024 + q_i+4), columns i and i + 4 of the word's eight; with the mask
    0x00F000F0 it is 1024 + 16 q (columns i + 1, i + 5), and the word shifted by 8 gives the other
    two pairs: a shift and four lop3 for eight weights;
  - one sub.f16x2 ((1024 + q) - (1024 + z)) or fma.f16x2 ((1024 + 16 q) / 16 - (64 + z)) makes each
    pair q - z, exactly; the zero is subtracted per weight, not folded through the sum of x;
  - four fma.f16x2 multiply the pairs by x's (column i, column i + 4) pairs and add them: each lane's
    fp16 sum holds four products (|q - z| <= 15), converted to fp32 and the lanes added once a word
    (four instructions), then scaled in fp32 and accumulated in fp32 as in the default loop.

x's pairs are made once a step for all BLOCK_N rows (a prmt for fp16 rows; bf16 rows are converted
to fp16 by their bits: exact for |x| in fp16's normal range, 6.1e-5 .. 65504, rounded below it).

half2 contract: as wo_gemv's int4 path in groups (``kernels.quant_reference.wo_matmul_ref`` of one
row, up to the order of the sums and these roundings), with
  - per word and lane, the four products and their sum rounded to fp16 (round-to-nearest-even, each
    fma rounded once): |error| <= ~4 * 2^-11 * max|partial|, against the reference's rounding of each
    weight to x's dtype (2^-9 relative for bf16). Measured under the interpreter (64 x 4096, group
    128, x ~ N(0, 1), scales 5e-4 .. 2.5e-3, outputs of rms ~0.5-0.7) against the fp64 product of
    the dequantized weight: bf16 rows max 3.7e-3 / mean 7.9e-4 (the fp32 loop: 3.7e-3 / 7.7e-4,
    the bf16 reference 4.9e-3 / 1.3e-3), fp16 rows 6.8e-4 / 2.2e-4 (fp32 loop 4.8e-4 / 1.2e-4);
    tests/kernels/test_gemv.py holds it to the fp32 loop's tolerance of the reference;
  - range: a lane's partial sum (four products) must stay within fp16's 65504: |x| up to ~1000 in
    any column (HALF2_X_BOUND). Past it the output is inf / NaN (the fp32 loop has no such limit),
    unless PRESCALE (wo_gemv's `prescale`): then each program's K step multiplies x by the power of
    two that brings the step's largest |x| into [256, 512) (1 where it is below 512) and its sums
    by the inverse, exactly; x values that the scaling takes below fp16's normal range (6.1e-5)
    round there, which is the plain loop's rounding of them relative to the step's largest;
  - x [1, K] 16-bit, 4-byte aligned (read as int32 pairs of columns); no g_idx (GPTQ's desc_act
    keeps the fp32 loop); groups or one per channel as wo_gemv.
Under the interpreter (which runs no PTX) each asm block is the same operation written out in fp32
and fp64 with the same fp16 roundings.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from kernels import pdl
from kernels.tiles import GEMV_PER_CHANNEL as PER_CHANNEL, gemv_finish, gemv_span

_INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")
# |x| up to which the half2 loop is safe: a lane's fp16 sum of four products (|q - z| <= 15) stays
# under fp16's 65504 for |x| < 1092; a caller that cannot bound its x this way keeps the fp32 loop
HALF2_X_BOUND = 1000.0

# one word's eight products: $1 the word, $2 (1024 + z) and $3 -(64 + z) as fp16 pairs, $4..$7 x's
# pairs (columns i, i + 4) for i = 0, 1, 2, 3; $0 the fp32 sum
_DOT8 = tl.constexpr("""{
.reg .b32 w2, q0, q1, q2, q3, k, a;
.reg .b16 %hl, %hh;
.reg .f32 f0, f1;
shr.u32 w2, $1, 8;
lop3.b32 q0, $1, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 q1, $1, 0x00F000F0, 0x64006400, 0xEA;
lop3.b32 q2, w2, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 q3, w2, 0x00F000F0, 0x64006400, 0xEA;
mov.b32 k, 0x2C002C00;
sub.rn.f16x2 q0, q0, $2;
fma.rn.f16x2 q1, q1, k, $3;
sub.rn.f16x2 q2, q2, $2;
fma.rn.f16x2 q3, q3, k, $3;
mul.rn.f16x2 a, q0, $4;
fma.rn.f16x2 a, q1, $5, a;
fma.rn.f16x2 a, q2, $6, a;
fma.rn.f16x2 a, q3, $7, a;
mov.b32 {%hl, %hh}, a;
cvt.f32.f16 f0, %hl;
cvt.f32.f16 f1, %hh;
add.f32 $0, f0, f1;
}""")
# x's pair (column c, column c + 4) from the words holding columns (c, c + 1) and (c + 4, c + 5):
# $1, $2; the low columns (c even) or the high ones
_PAIR_F16_LO = tl.constexpr("prmt.b32 $0, $1, $2, 0x5410;")
_PAIR_F16_HI = tl.constexpr("prmt.b32 $0, $1, $2, 0x7632;")
_PAIR_BF16_LO = tl.constexpr("{ .reg .b32 a, b; shl.b32 a, $1, 16; shl.b32 b, $2, 16; cvt.rn.f16x2.f32 $0, b, a; }")
_PAIR_BF16_HI = tl.constexpr(
    "{ .reg .b32 a, b; and.b32 a, $1, 0xFFFF0000; and.b32 b, $2, 0xFFFF0000; cvt.rn.f16x2.f32 $0, b, a; }")
# ... times the step's power of two $3 (PRESCALE): fp32 for bf16 rows (before the conversion), an
# fp16 pair for fp16 rows
_PAIR_F16_LO_S = tl.constexpr("{ .reg .b32 p; prmt.b32 p, $1, $2, 0x5410; mul.rn.f16x2 $0, p, $3; }")
_PAIR_F16_HI_S = tl.constexpr("{ .reg .b32 p; prmt.b32 p, $1, $2, 0x7632; mul.rn.f16x2 $0, p, $3; }")
_PAIR_BF16_LO_S = tl.constexpr("{ .reg .b32 a, b; shl.b32 a, $1, 16; shl.b32 b, $2, 16; mul.rn.f32 a, a, $3; "
                               "mul.rn.f32 b, b, $3; cvt.rn.f16x2.f32 $0, b, a; }")
_PAIR_BF16_HI_S = tl.constexpr("{ .reg .b32 a, b; and.b32 a, $1, 0xFFFF0000; and.b32 b, $2, 0xFFFF0000; "
                               "mul.rn.f32 a, a, $3; mul.rn.f32 b, b, $3; cvt.rn.f16x2.f32 $0, b, a; }")


@triton.jit
def _f16(bits):
    """The fp16 in the low 16 bits of `bits` (uint32), as fp32."""
    return (bits & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _f16_bits(v):
    """v (fp32 or fp64) rounded to fp16 (nearest-even, once), its bits in a uint32's low half."""
    return v.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)


@triton.jit
def _x_value(bits, X_BF16: tl.constexpr):
    """The 16-bit x in the low half of `bits` (uint32), as fp32."""
    if X_BF16:
        return ((bits & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    return _f16(bits)


@triton.jit
def _x_pair(lo_word, hi_word, sc, HIGH: tl.constexpr, X_BF16: tl.constexpr, PRESCALE: tl.constexpr):
    """x's fp16 pair (column c, column c + 4) from the words (uint32) of columns c & ~1 and c + 4 & ~1:
    the low columns of each or (HIGH) the high ones; with PRESCALE times `sc` (a power of two, fp32),
    exactly where the product stays in fp16's normal range."""
    if _INTERPRET:
        shift: tl.constexpr = 16 if HIGH else 0
        a = (lo_word >> shift) & 0xFFFF
        b = (hi_word >> shift) & 0xFFFF
        if PRESCALE:  # bf16: the fp32 product rounded once to fp16; fp16: the f16x2 product's rounding
            a = _f16_bits(_x_value(a, X_BF16) * sc)
            b = _f16_bits(_x_value(b, X_BF16) * sc)
        elif X_BF16:
            a = _f16_bits((a << 16).to(tl.float32, bitcast=True))
            b = _f16_bits((b << 16).to(tl.float32, bitcast=True))
        return a | (b << 16)
    else:
        if X_BF16 and HIGH:
            asm: tl.constexpr = _PAIR_BF16_HI_S if PRESCALE else _PAIR_BF16_HI
        elif X_BF16:
            asm: tl.constexpr = _PAIR_BF16_LO_S if PRESCALE else _PAIR_BF16_LO
        elif HIGH:
            asm: tl.constexpr = _PAIR_F16_HI_S if PRESCALE else _PAIR_F16_HI
        else:
            asm: tl.constexpr = _PAIR_F16_LO_S if PRESCALE else _PAIR_F16_LO
        if PRESCALE:
            # the scale as the operand each form multiplies by: fp32 bits, or an fp16 pair
            s_bits = sc.to(tl.uint32, bitcast=True) if X_BF16 else _f16_bits(sc) * 0x10001
            s_bits = tl.broadcast_to(s_bits, lo_word.shape)
            return tl.inline_asm_elementwise(asm, "=r,r,r,r", [lo_word, hi_word, s_bits], dtype=tl.uint32,
                                             is_pure=True, pack=1)
        return tl.inline_asm_elementwise(asm, "=r,r,r", [lo_word, hi_word], dtype=tl.uint32, is_pure=True, pack=1)


@triton.jit
def _word_abs(word, X_BF16: tl.constexpr):
    """The larger |x| of the two 16-bit columns in `word` (uint32), as fp32."""
    return tl.maximum(tl.abs(_x_value(word, X_BF16)), tl.abs(_x_value(word >> 16, X_BF16)))


@triton.jit
def _step_scale(x01, x23, x45, x67, X_BF16: tl.constexpr):
    """(sc, 1 / sc): the power of two that brings the step's largest |x| into [256, 512) where it is
    512 or more, else 1 (exact powers of two: the sums scaled back lose nothing)."""
    m = tl.maximum(tl.maximum(_word_abs(x01, X_BF16), _word_abs(x23, X_BF16)),
                   tl.maximum(_word_abs(x45, X_BF16), _word_abs(x67, X_BF16)))
    e = (tl.max(tl.max(m, axis=1), axis=0).to(tl.uint32, bitcast=True) >> 23) & 0xFF  # biased exponent
    big = e >= 136  # |x| >= 512 (NaN and inf too: their outputs stay non-finite)
    sc = tl.where(big, ((262 - e.to(tl.int32)) << 23).to(tl.float32, bitcast=True), 1.0)
    inv = tl.where(big, ((e.to(tl.int32) - 8) << 23).to(tl.float32, bitcast=True), 1.0)
    return sc, inv


@triton.jit
def _lane_dot(q0, q1, q2, q3, zlo, zhi, x04, x15, x26, x37, SHIFT: tl.constexpr):
    """_DOT8's arithmetic on one lane (the halves at bit SHIFT), in fp32 / fp64 with its fp16 roundings."""
    z = _f16(zlo >> SHIFT)
    z16 = _f16(zhi >> SHIFT)
    d0 = _f16(q0 >> SHIFT) - z  # exact: integers below 2048
    d1 = _f16(q1 >> SHIFT) * 0.0625 + z16  # exact: (1024 + 16 q) / 16 - (64 + z)
    d2 = _f16(q2 >> SHIFT) - z
    d3 = _f16(q3 >> SHIFT) * 0.0625 + z16
    a = (d0 * _f16(x04 >> SHIFT)).to(tl.float16).to(tl.float64)  # the product is exact in fp32
    a = (d1.to(tl.float64) * _f16(x15 >> SHIFT).to(tl.float64) + a).to(tl.float16).to(tl.float64)  # fma: exact in
    a = (d2.to(tl.float64) * _f16(x26 >> SHIFT).to(tl.float64) + a).to(tl.float16).to(tl.float64)  # fp64, rounded
    a = (d3.to(tl.float64) * _f16(x37 >> SHIFT).to(tl.float64) + a).to(tl.float16)  # once to fp16
    return a.to(tl.float32)


@triton.jit
def _dot8(words, zlo, zhi, x04, x15, x26, x37):
    """sum over the word's eight columns of (q - z) * x, fp32 (see _DOT8); all uint32 of one shape."""
    if _INTERPRET:
        w2 = words >> 8
        q0 = (words & 0x000F000F) | 0x64006400
        q1 = (words & 0x00F000F0) | 0x64006400
        q2 = (w2 & 0x000F000F) | 0x64006400
        q3 = (w2 & 0x00F000F0) | 0x64006400
        return (_lane_dot(q0, q1, q2, q3, zlo, zhi, x04, x15, x26, x37, 0)
                + _lane_dot(q0, q1, q2, q3, zlo, zhi, x04, x15, x26, x37, 16))
    else:
        return tl.inline_asm_elementwise(_DOT8, "=r,r,r,r,r,r,r,r", [words, zlo, zhi, x04, x15, x26, x37],
                                         dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _int4_half2_kernel(x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, N, K, k_per_split, groups,
                       X_BF16: tl.constexpr, GROUP: tl.constexpr, PRESCALE: tl.constexpr, SPLIT: tl.constexpr,
                       HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """x_ptr: x's columns in int32 pairs (column 2i in the low half); out_ptr: x's dtype. PRESCALE: each
    K step's x scaled by the power of two _step_scale picks, its sums scaled back (any |x|)."""
    offs_n, n_ok, n64, k_lo, k_hi = gemv_span(N, K, k_per_split, BLOCK_N)
    # (kernels/pdl.py) the first two K steps' words, 32 a line
    pdl.gemv_prologue(w_ptr, n64, n_ok, K // 8, k_lo // 8, k_hi // 8, 2 * BLOCK_K // 256, 32, PDL)
    C: tl.constexpr = BLOCK_K if GROUP == PER_CHANNEL else GROUP
    G: tl.constexpr = BLOCK_K // C
    WG: tl.constexpr = C // 8  # a group's words, word w holding columns 8w .. 8w + 7 (column 8w + j in bits 4j)
    offs_g = tl.arange(0, G)
    acc3 = tl.zeros([BLOCK_N, G, WG], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        wv = k0 // 8 + offs_g[:, None] * WG + tl.arange(0, WG)[None, :]
        w_ok = wv < k_hi // 8
        wm = n_ok[:, None, None] & w_ok[None, :, :]
        words = tl.load(w_ptr + n64[:, None, None] * (K // 8) + wv[None, :, :], mask=wm, other=0)
        words = words.to(tl.uint32, bitcast=True)
        if GROUP == PER_CHANNEL:
            g = offs_g * 0
        else:
            g = k0 // GROUP + offs_g
        gp = n64[:, None, None] * groups + g[None, :, None]
        gm = n_ok[:, None, None] & (g < groups)[None, :, None]
        s = tl.load(s_ptr + gp, mask=gm, other=0.0)
        z = tl.load(z_ptr + gp, mask=gm, other=0).to(tl.uint32)
        zlo = tl.broadcast_to(z * 0x10001 | 0x64006400, [BLOCK_N, G, WG])  # 1024 + z, both lanes
        zhi = tl.broadcast_to(z * 0x100010 | 0xD400D400, [BLOCK_N, G, WG])  # -(64 + z)
        # x's four int32 words of the word's eight columns: (0, 1), (2, 3), (4, 5), (6, 7); their pairs
        # made once for all rows (Triton moves them into the words' layout through shared memory, which
        # costs less than the words moved into x's: gemv_ir.py)
        x01 = tl.load(x_ptr + wv * 4, mask=w_ok, other=0).to(tl.uint32, bitcast=True)
        x23 = tl.load(x_ptr + wv * 4 + 1, mask=w_ok, other=0).to(tl.uint32, bitcast=True)
        x45 = tl.load(x_ptr + wv * 4 + 2, mask=w_ok, other=0).to(tl.uint32, bitcast=True)
        x67 = tl.load(x_ptr + wv * 4 + 3, mask=w_ok, other=0).to(tl.uint32, bitcast=True)
        if PRESCALE:
            sc, inv = _step_scale(x01, x23, x45, x67, X_BF16)
            s = s * inv
        else:
            sc = 1.0
        x04 = tl.broadcast_to(_x_pair(x01, x45, sc, False, X_BF16, PRESCALE)[None], [BLOCK_N, G, WG])
        x15 = tl.broadcast_to(_x_pair(x01, x45, sc, True, X_BF16, PRESCALE)[None], [BLOCK_N, G, WG])
        x26 = tl.broadcast_to(_x_pair(x23, x67, sc, False, X_BF16, PRESCALE)[None], [BLOCK_N, G, WG])
        x37 = tl.broadcast_to(_x_pair(x23, x67, sc, True, X_BF16, PRESCALE)[None], [BLOCK_N, G, WG])
        acc3 += s * _dot8(words, zlo, zhi, x04, x15, x26, x37)
    gemv_finish(tl.sum(tl.sum(acc3, axis=2), axis=1), offs_n, n_ok, bias_ptr, out_ptr, part_ptr, count_ptr, SPLIT,
                HAS_BIAS, BLOCK_N)


__all__ = ["HALF2_X_BOUND", "_int4_half2_kernel"]
