"""Decode GEMVs: one row (a batch-1 decode step) times a quantized weight, streamed at the memory's
bandwidth. At one row a GEMM's whole cost is reading the weight once; tensor-core tiles pad the row
to 16 and leave too few programs to keep every SM's loads in flight, so here each program takes
BLOCK_N output channels over one range of K (split-K, kernels/tiles.py), loads the weight in wide
coalesced [BLOCK_N, BLOCK_K] tiles, dequantizes them in registers and accumulates row-times-weight
products in fp32 (FMAs and a reduction along K, no tensor core).

fp8_gemv contract (semantics = ``kernels.quant_reference.fp8_matmul_ref`` of one row, up to the
order of the fp32 sums; as ``kernels/fp8_matmul.py`` at M = 1):
  x        [1, K]: float8_e4m3fn with x_scale [1, ceil(K / group)] fp32 (quantized before), or
           float16 / bfloat16 / float32 with x_scale None: quantized here exactly as
           ``kernels.fp8_quant.quant_fp8(x, act_group, static_scale)`` quantizes it (the same bits:
           a linear whose input no norm quantized pays no launch for it); or, `weight_only`, a
           float16 / bfloat16 row used as it is (w8a16: semantics = ``wo_matmul_ref`` of one row,
           the weight dequantized in fp32, the result in out_dtype). Last dim contiguous
  weight   [N, K] float8_e4m3fn contiguous; scale [N, ceil(K / group)] fp32 contiguous
  group    128 (the 128x128-block checkpoints: activations are then quantized per 128 columns too),
           or >= K: one scale per output channel (and activations per token, or static)
  bias     [N] out_dtype, or None
  returns  [1, N] out_dtype, rounded once (round-to-nearest-even)

wo_gemv contract (semantics = ``kernels.quant_reference.wo_matmul_ref`` of one row, up to the order
of the fp32 sums and one rounding: the dequantized weight is kept in fp32, not rounded to x's dtype;
as ``kernels/wo_matmul.py`` at M = 1):
  x        [1, K] float16 / bfloat16, last dim contiguous
  weight   int4 [N, K // 8] int32 with zero [N, groups] uint8; or fp8 [N, K] float8_e4m3fn (decoded from
           its bits: the GPUs without FP8 instructions) with zero None. Contiguous.
  scale    [N, groups] fp32 contiguous, groups = ceil(K / group); group >= K: one per output channel,
           else a power of two >= 8 (int4) / >= 16 (fp8)
  g_idx    optional [K] int32 (GPTQ's desc_act): column k's group; its scale and zero are gathered
           per element (slower), from any number of groups G > max(g_idx) (a row-parallel rank's
           share of the columns keeps every group's)
  bias     [N] x's dtype, or None
  returns  [1, N] x's dtype. int4 in groups: sum over each group's columns of x * q, then
           scale * (that - zero * sum of x over the group), so a weight costs a shift, a mask, a
           conversion and an FMA. Option half2: kernels/gemv_int4.py's loop in fp16 pairs (its own
           contract: fp16 partial sums, |x| within HALF2_X_BOUND), for int4 without g_idx; the
           caller's choice (models/quant/gemms.py takes it where the linear's input is bounded).

gemv16 contract (semantics = x.float() @ weight.float().T (+ bias) of one row, rounded once to x's
dtype, up to the order of the fp32 sums):
  x        [1, K] float16 / bfloat16, last dim contiguous
  weight   [N, K] x's dtype, contiguous (a 16-bit linear's own weight)
  bias     [N] x's dtype, or None
  returns  [1, N] x's dtype
  Why: at one row cuBLAS runs the smaller projections in few CTAs (a 4096 x 4096 o_proj in 64-channel
  tiles by its kernel's name: 64 on 132 SMs, half the H100's bandwidth) and adds split-K partials in
  a second kernel; here narrow tiles (8 or 16 rows) spread the weight over many programs without a
  split (config16: splitting K measured slower), so one launch does the whole product.

Grid: (cdiv(N, BLOCK_N), splits); with splits > 1 each program writes its fp32 partial and the
tile's last program to arrive adds them in split order (kernels/tiles.py: deterministic, one launch).
Not checked: NaN/inf (they propagate).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.fp8_quant import dynamic_scale, e4m3_cvt, quantize_values
from kernels.gemv_int4 import _int4_half2_kernel
from kernels.tiles import GEMV_PER_CHANNEL, gemv_finish, gemv_span, split_buffers, split_plan, splits_for
from kernels.wo_matmul import fp8_bits_to_f32

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
PER_CHANNEL = GEMV_PER_CHANNEL  # GROUP's value for one scale per output channel
# x's forms (ACT): quantized before, or a 16-bit row quantized here per token, per group, statically,
# or a 16-bit row not quantized at all (w8a16)
ACT_FP8, ACT_TOKEN, ACT_GROUP, ACT_STATIC, ACT_NONE = (tl.constexpr(v) for v in range(5))


class GemvConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    split_k: int = 0  # 0: from the shape (kernels.tiles.splits_for)


def config(n: int, k: int, int4: bool, w8a16: bool = False) -> GemvConfig:
    """Weight rows by columns a K step and warps, K split where the output tiles alone give fewer than
    four programs per SM (kernels.tiles.splits_for). From bench_quant.py's sweep at the Llama-3.1-8B
    shape on an H100 (benchmarks/results/quant_gemv_h100.json, triton 3.6; µs at one row, the
    earlier 16 x 512, 4 warps before the arrow): FP8 4 x 512 with 2 warps (QKV 15.0 -> 11.4,
    o_proj 11.4 -> 9.4, gate/up 43.8 -> 42.3), past 8k columns 8 x 512 with 4 (down_proj 25.9 ->
    24.3); int4 8 x 1024 with 4 (QKV 17.9 -> 14.2, gate/up 55.8 -> 53.1, down_proj 33.0 -> 32.3),
    4096 x 4096 and smaller 4 x 512 with 2 (o_proj 13.4 -> 11.6). `w8a16` (fp8_gemv of a 16-bit row,
    weight_only): the H200's sweep (benchmarks/results/experiments/quant_w8a16_sweep_h200.json) picked
    FP8's tiles except past 8k columns, 8 x 1024 with 4 (down_proj 27.0 us at FP8's 8 x 512 -> 20.8;
    16 x 512 took 20.9: the 16-bit row is twice the bytes every program reads)."""
    if _INTERPRET:  # few, large tiles: the interpreter's cost is per program and per step
        return GemvConfig(32, 256, 1, 1)
    if int4:
        return GemvConfig(4, 512, 2) if n * k <= 4096 * 4096 else GemvConfig(8, 1024, 4)
    return GemvConfig(8, 1024 if w8a16 else 512, 4) if k > 8192 else GemvConfig(4, 512, 2)


def config16(n: int, k: int) -> GemvConfig:
    """gemv16's tiles, K never split: from bench_quant.py's sweeps at the Llama-3.1-8B, Llama-3.2-1B
    and Qwen3-0.6B shapes on an H200 (benchmarks/results/experiments/gemv16_sweep_*_h200.json,
    triton 3.6). 8 x 512 on 4 warps was first or within 2% of first at every linear of 4096 outputs
    or more; at 2048 or fewer, 16 x 1024 on 8 warps (the 1B's o_proj 5.34 -> 4.95 us, its down_proj
    14.03 -> 11.92). The fastest tile at every linear swept was unsplit (qkv_proj of the 8B: 8 x 512
    in two splits 17.2 us, unsplit 14.6)."""
    if _INTERPRET:
        return GemvConfig(32, 256, 1, 1)
    return GemvConfig(16, 1024, 8, 1) if n <= 2048 else GemvConfig(8, 512, 4, 1)


def _plan(cfg: GemvConfig, n: int, k: int, device: torch.device) -> tuple[int, int]:
    splits = cfg.split_k or splits_for(triton.cdiv(n, cfg.block_n), k, cfg.block_k, device)
    return split_plan(k, cfg.block_k, splits)


@triton.jit
def _fp8_gemv_kernel(x_ptr, xs_ptr, static_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, N, K, k_per_split,
                     stride_ws, ACT: tl.constexpr, GROUP: tl.constexpr, SPLIT: tl.constexpr,
                     HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
                     CVT: tl.constexpr):
    offs_n, n_ok, n64, k_lo, k_hi = gemv_span(N, K, k_per_split, BLOCK_N)
    pdl.gemv_prologue(w_ptr, n64, n_ok, K, k_lo, k_hi, 2 * BLOCK_K // 128, 128, PDL)  # the first two K steps' bytes
    # Products are summed elementwise in registers and reduced across threads once, after the loop.
    if GROUP == PER_CHANNEL:
        offs_k = tl.arange(0, BLOCK_K)
        if ACT == ACT_TOKEN:  # the token's scale needs the whole row's largest magnitude (the row is in L2)
            amax = tl.zeros([BLOCK_K], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                h = tl.load(x_ptr + k0 + offs_k, mask=k0 + offs_k < K, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(h))
            x_scale = dynamic_scale(tl.max(amax, axis=0))
        elif ACT == ACT_STATIC:
            x_scale = tl.load(static_ptr)
        elif ACT == ACT_NONE:
            x_scale = 1.0
        else:
            x_scale = tl.load(xs_ptr)
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            kk = k0 + offs_k
            k_ok = kk < k_hi
            w = tl.load(w_ptr + n64[:, None] * K + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
            if ACT != ACT_FP8 and ACT != ACT_NONE:
                x = quantize_values(x, x_scale, CVT)
            acc2 += w.to(tl.float32) * x[None, :]
        acc = tl.sum(acc2, axis=1) * x_scale * tl.load(ws_ptr + offs_n * stride_ws, mask=n_ok, other=0.0)
    else:  # K as [groups, GROUP]: each step holds BLOCK_K // GROUP whole groups, each with its scales
        G: tl.constexpr = BLOCK_K // GROUP
        offs_g = tl.arange(0, G)
        offs_c = tl.arange(0, GROUP)
        acc3 = tl.zeros([BLOCK_N, G, GROUP], tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            g = k0 // GROUP + offs_g
            g_ok = g * GROUP < k_hi
            kk = g[:, None] * GROUP + offs_c[None, :]
            k_ok = kk < k_hi
            w = tl.load(w_ptr + n64[:, None, None] * K + kk[None, :, :], mask=n_ok[:, None, None] & k_ok[None, :, :],
                        other=0.0)
            x = tl.load(x_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
            ws = tl.load(ws_ptr + offs_n[:, None, None] * stride_ws + g[None, :, None],
                         mask=n_ok[:, None, None] & g_ok[None, :, None], other=0.0)
            if ACT == ACT_NONE:
                acc3 += w.to(tl.float32) * x[None, :, :] * ws
            else:
                if ACT == ACT_GROUP:
                    xs = dynamic_scale(tl.max(tl.abs(x), axis=1))
                    x = quantize_values(x, xs[:, None], CVT)
                else:
                    xs = tl.load(xs_ptr + g, mask=g_ok, other=0.0)
                acc3 += w.to(tl.float32) * x[None, :, :] * (ws * xs[None, :, None])
        acc = tl.sum(tl.sum(acc3, axis=2), axis=1)
    gemv_finish(acc, offs_n, n_ok, bias_ptr, out_ptr, part_ptr, count_ptr, SPLIT, HAS_BIAS, BLOCK_N)


@triton.jit
def _gemv16_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, N, K, k_per_split, SPLIT: tl.constexpr,
                   HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    offs_n, n_ok, n64, k_lo, k_hi = gemv_span(N, K, k_per_split, BLOCK_N)
    pdl.gemv_prologue(w_ptr, n64, n_ok, K, k_lo, k_hi, 2 * BLOCK_K // 64, 64, PDL)  # 64 16-bit elements a line
    offs_k = tl.arange(0, BLOCK_K)
    acc2 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)  # reduced across threads once, after the loop
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < k_hi
        w = tl.load(w_ptr + n64[:, None] * K + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptr + kk, mask=k_ok, other=0.0)
        acc2 += w.to(tl.float32) * x.to(tl.float32)[None, :]
    gemv_finish(tl.sum(acc2, axis=1), offs_n, n_ok, bias_ptr, out_ptr, part_ptr, count_ptr, SPLIT, HAS_BIAS, BLOCK_N)


@triton.jit
def _wo_gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, gidx_ptr, bias_ptr, out_ptr, part_ptr, count_ptr, N, K, k_per_split,
                    groups,
                    INT4: tl.constexpr, GROUP: tl.constexpr, HAS_GIDX: tl.constexpr, SPLIT: tl.constexpr,
                    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    offs_n, n_ok, n64, k_lo, k_hi = gemv_span(N, K, k_per_split, BLOCK_N)
    if INT4:  # (kernels/pdl.py) the first two K steps' weights: int4 words, 32 a line; fp8 bytes
        pdl.gemv_prologue(w_ptr, n64, n_ok, K // 8, k_lo // 8, k_hi // 8, 2 * BLOCK_K // 256, 32, PDL)
    else:
        pdl.gemv_prologue(w_ptr, n64, n_ok, K, k_lo, k_hi, 2 * BLOCK_K // 128, 128, PDL)
    # K as [G, C] (G groups of C columns a step; per channel: one "group" of BLOCK_K); products are
    # summed elementwise in registers and reduced across threads once, after the loop.
    C: tl.constexpr = BLOCK_K if GROUP == PER_CHANNEL else GROUP
    G: tl.constexpr = BLOCK_K // C
    offs_g = tl.arange(0, G)
    if INT4:  # a group's C // 8 words, word w holding columns 8w .. 8w + 7 (column 8w + j in bits 4j)
        WG: tl.constexpr = C // 8
        acc3 = tl.zeros([BLOCK_N, G, WG], tl.float32)
        x_sum = tl.zeros([G, WG], tl.float32)  # per channel: the sum of x, for the zero point
        for k0 in range(k_lo, k_hi, BLOCK_K):
            wv = k0 // 8 + offs_g[:, None] * WG + tl.arange(0, WG)[None, :]
            w_ok = wv < k_hi // 8
            wm = n_ok[:, None, None] & w_ok[None, :, :]
            words = tl.load(w_ptr + n64[:, None, None] * (K // 8) + wv[None, :, :], mask=wm, other=0)
            words = words.to(tl.uint32, bitcast=True)  # logical shifts: no sign to extend
            if not HAS_GIDX and GROUP != PER_CHANNEL:
                g = k0 // GROUP + offs_g
                gp = n64[:, None, None] * groups + g[None, :, None]
                gm = n_ok[:, None, None] & (g < groups)[None, :, None]
                s = tl.load(s_ptr + gp, mask=gm, other=0.0)
                z = tl.load(z_ptr + gp, mask=gm, other=0).to(tl.float32)
            # the eight values of each word one after another, in the words' own registers (a [.., 8]
            # axis spreads them over threads and costs a shuffle a value)
            qx = tl.zeros([BLOCK_N, G, WG], tl.float32)
            xs = tl.zeros([G, WG], tl.float32)
            for j in tl.static_range(8):
                # the value as a float by its bits (2^23 + q), not by a conversion (a quarter-rate one);
                # the word shifted a nibble a time: a shift and one and-or for each value
                q = ((words & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
                words = words >> 4
                x = tl.load(x_ptr + wv * 8 + j, mask=w_ok, other=0.0).to(tl.float32)
                if HAS_GIDX:  # each column's own group: its scale and zero gathered
                    gs = n64[:, None, None] * groups + tl.load(gidx_ptr + wv * 8 + j, mask=w_ok, other=0)[None]
                    s = tl.load(s_ptr + gs, mask=wm, other=0.0)
                    z = tl.load(z_ptr + gs, mask=wm, other=0).to(tl.float32)
                    qx += (q - z) * s * x[None]
                else:
                    qx += q * x[None]
                    xs += x
            if HAS_GIDX:
                acc3 += qx
            elif GROUP == PER_CHANNEL:
                acc3 += qx
                x_sum += xs
            else:
                acc3 += s * (qx - z * xs[None])
        acc = tl.sum(tl.sum(acc3, axis=2), axis=1)
        if GROUP == PER_CHANNEL and not HAS_GIDX:
            s = tl.load(s_ptr + n64 * groups, mask=n_ok, other=0.0)
            z = tl.load(z_ptr + n64 * groups, mask=n_ok, other=0).to(tl.float32)
            acc = s * (acc - z * tl.sum(tl.sum(x_sum, axis=1), axis=0))
    else:  # fp8 decoded from its bits
        offs_c = tl.arange(0, C)
        acc3 = tl.zeros([BLOCK_N, G, C], tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            g = k0 // C + offs_g
            kk = g[:, None] * C + offs_c[None, :]
            k_ok = kk < k_hi
            bits = tl.load(w_ptr + n64[:, None, None] * K + kk[None, :, :], mask=n_ok[:, None, None] & k_ok[None],
                           other=0)
            x = tl.load(x_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
            w = fp8_bits_to_f32(bits.to(tl.int32) & 0xFF)
            if GROUP == PER_CHANNEL:
                acc3 += w * x[None]
            else:
                s = tl.load(s_ptr + n64[:, None, None] * groups + g[None, :, None],
                            mask=n_ok[:, None, None] & (g < groups)[None, :, None], other=0.0)
                acc3 += w * x[None] * s
        acc = tl.sum(tl.sum(acc3, axis=2), axis=1)
        if GROUP == PER_CHANNEL:
            acc = acc * tl.load(s_ptr + n64 * groups, mask=n_ok, other=0.0)
    gemv_finish(acc, offs_n, n_ok, bias_ptr, out_ptr, part_ptr, count_ptr, SPLIT, HAS_BIAS, BLOCK_N)


def _launch(kernel, n: int, k: int, cfg: GemvConfig, out: torch.Tensor, bias: torch.Tensor | None, *args, **meta):
    per, splits = _plan(cfg, n, k, out.device)
    tiles = triton.cdiv(n, cfg.block_n)
    part, count = split_buffers(out.device, tiles, splits, cfg.block_n) if splits > 1 else (out, out)
    use_pdl = pdl.active(out.device) and cfg.block_k >= 128  # (the prefetch's lines: two K steps of at least one)
    kernel[(tiles, splits)](*args, bias if bias is not None else out, out, part, count, n, k, per, **meta,
                            SPLIT=splits > 1, HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                            PDL=use_pdl, num_warps=cfg.num_warps, **(pdl.launch_options(out.device) if use_pdl else {}))
    return out


def _group(group: int, k: int, block_k: int, least: int) -> int:
    """GROUP's value: PER_CHANNEL, or the group, which must divide the K step."""
    if group >= k:
        return PER_CHANNEL.value
    assert group >= least and group & (group - 1) == 0 and block_k % group == 0, \
        f"group {group}: a power of two >= {least} dividing BLOCK_K ({block_k}), or >= K"
    return group


def fp8_gemv(x: torch.Tensor, x_scale: torch.Tensor | None, weight: torch.Tensor, scale: torch.Tensor, group: int,
             out_dtype: torch.dtype, bias: torch.Tensor | None = None, act_group: int = 1 << 30,
             static_scale: torch.Tensor | None = None, cfg: GemvConfig | None = None,
             weight_only: bool = False) -> torch.Tensor:
    """x [1, K] @ weight[N, K].T with FP8 scales -> [1, N] out_dtype. See the module docstring;
    `weight_only`: x (16-bit) is not quantized."""
    (m, k), n = x.shape, weight.shape[0]
    assert m == 1 and x.stride(1) == 1 and weight.dtype == torch.float8_e4m3fn and weight.is_contiguous()
    assert weight.shape[1] == k and scale.dtype == torch.float32 and scale.is_contiguous()
    cfg = cfg or config(n, k, False, weight_only)
    g = _group(group, k, cfg.block_k, 16)
    assert scale.shape == (n, 1 if g == PER_CHANNEL.value else triton.cdiv(k, group))
    assert bias is None or (bias.shape == (n,) and bias.dtype == out_dtype)
    if weight_only:
        assert x_scale is None and static_scale is None and x.dtype in (torch.float16, torch.bfloat16)
        act = ACT_NONE
    elif x_scale is not None:
        assert x.dtype == torch.float8_e4m3fn and x_scale.shape == (1, scale.shape[1]) and x_scale.stride(1) == 1
        act = ACT_FP8
    elif static_scale is not None:
        assert g == PER_CHANNEL.value and static_scale.numel() == 1 and static_scale.dtype == torch.float32
        act = ACT_STATIC
    else:
        assert (act_group >= k) == (g == PER_CHANNEL.value) and (g == PER_CHANNEL.value or act_group == group), \
            "activations per token with per-channel weights, per group with group weights"
        act = ACT_TOKEN if g == PER_CHANNEL.value else ACT_GROUP
    out = torch.empty((1, n), dtype=out_dtype, device=x.device)
    if n == 0:
        return out
    return _launch(_fp8_gemv_kernel, n, k, cfg, out, bias, x, x_scale if x_scale is not None else scale,
                   static_scale if static_scale is not None else scale, weight, scale, stride_ws=scale.stride(0),
                   ACT=act.value, GROUP=g, CVT=e4m3_cvt(x.device))


def gemv16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           cfg: GemvConfig | None = None) -> torch.Tensor:
    """x [1, K] @ weight[N, K].T (+ bias) -> [1, N], all in x's 16-bit dtype. See the module docstring."""
    (m, k), n = x.shape, weight.shape[0]
    assert m == 1 and x.dtype in (torch.float16, torch.bfloat16) and x.stride(1) == 1
    assert weight.dtype == x.dtype and weight.shape == (n, k) and weight.is_contiguous()
    assert bias is None or (bias.shape == (n,) and bias.dtype == x.dtype)
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    return _launch(_gemv16_kernel, n, k, cfg or config16(n, k), out, bias, x, weight)


def wo_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int,
            bias: torch.Tensor | None = None, g_idx: torch.Tensor | None = None,
            cfg: GemvConfig | None = None, half2: bool = False, prescale: bool = False) -> torch.Tensor:
    """x [1, K] @ dequant(weight)[N, K].T -> [1, N] in x's dtype. See the module docstring; `half2`:
    int4 without g_idx through kernels/gemv_int4.py's loop (fp16 pairs; its contract), with
    `prescale` for x of any range (each K step scaled by a power of two)."""
    (m, k), n = x.shape, weight.shape[0]
    int4 = zero is not None
    assert m == 1 and x.dtype in (torch.float16, torch.bfloat16) and x.stride(1) == 1 and weight.is_contiguous()
    if int4:
        assert weight.dtype == torch.int32 and k % 8 == 0 and weight.shape == (n, k // 8), "int4: [N, K // 8] int32"
        assert zero.dtype == torch.uint8 and zero.shape == scale.shape and zero.is_contiguous()
    else:
        assert weight.dtype == torch.float8_e4m3fn and weight.shape == (n, k) and g_idx is None, "fp8: [N, K]"
        weight = weight.view(torch.uint8)
    cfg = cfg or config(n, k, int4)
    g = PER_CHANNEL.value if g_idx is not None else _group(group, k, cfg.block_k, 8 if int4 else 16)
    groups = scale.shape[1] if g_idx is not None else triton.cdiv(k, group) if group < k else 1  # g_idx: any
    assert scale.shape == (n, groups) and scale.dtype == torch.float32 and scale.is_contiguous()
    assert g_idx is None or (g_idx.shape == (k,) and g_idx.dtype == torch.int32)
    assert bias is None or (bias.shape == (n,) and bias.dtype == x.dtype)
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    if half2 and int4 and g_idx is None:
        return _launch(_int4_half2_kernel, n, k, cfg, out, bias, x.view(torch.int32), weight, scale, zero,
                       groups=groups, X_BF16=x.dtype == torch.bfloat16, GROUP=g, PRESCALE=prescale)
    return _launch(_wo_gemv_kernel, n, k, cfg, out, bias, x, weight, scale, zero if int4 else scale,
                   g_idx if g_idx is not None else scale, groups=groups, INT4=int4, GROUP=g,
                   HAS_GIDX=g_idx is not None)


__all__ = ["GemvConfig", "config", "config16", "fp8_gemv", "gemv16", "wo_gemv"]
