"""Batch-invariant paged attention: the deterministic mode's one attention kernel, for prompt chunks
and decodes alike, whose result for a query position does not depend on the batch, the chunking,
or whether the position is computed by a prefill or by a decode step.

Contract (semantics = ``kernels.reference.prefill_attention_ref`` over the cached keys; bits as
below):
  q            [total_rows, num_heads, head_dim] fp16 / bf16, last dim contiguous
  k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim], q's dtype, last dim contiguous,
               block_size a power of two. Every key a row attends to is ALREADY in the cache (the
               caller writes this step's K/V first), but for new_kv's. Or fp8 (float8_e4m3fn /
               float8_e5m2) with k_scale, v_scale (fp32 [num_kv_heads]): every key and value is then
               read as stored * scale (kernels/fp8.py), new_kv's written quantized first; a row's
               bits are still a function of its query and the cached bytes only.
  block_tables [num_chunks, max_blocks] int32
  cu_seqlens   [num_chunks + 1] int32: chunk c owns rows cu[c] .. cu[c+1]-1, at positions
               prefix_lens[c] + 0, 1, ... (a decode is a chunk of one row at context_len - 1)
  prefix_lens  [num_chunks] int32
  tiles        (tile_seq, tile_start) int32 [num_tiles]: program tile i serves chunk positions
               tile_start[i] .. + positions_per_tile() - 1 of chunk tile_seq[i] (-1: idle), as
               kernels/flash_prefill.py's tile_map builds them
  max_segments host int >= the segments of the longest context (cdiv(max context, SEGMENT))
  split        host bool: segments spread over programs (each writes its segments' fp32 partials,
               a merge launch folds them; latency at small batch), or one program per tile
               folding its segments in order (no partials)
  new_kv       optional (k_new, v_new [total_rows, num_kv_heads, head_dim], slot_mapping [total_rows]
               int32/int64, -1 skipped): a decode launch (every chunk one row, split=True) that
               writes this step's K/V itself, before its last segment reads them (one launch less
               per layer than a separate kv_write); the cache then holds them as kv_write would
  returns      out [total_rows, num_heads, head_dim], q's dtype. Row at position p, head h attends
               to cache positions 0..p of its chunk's sequence with kv head h // group.

What is fixed, and why each row's bits are a function of its own query and keys only:
  * keys are read from the cache in SEGMENT-token segments at absolute positions
    [s * SEGMENT, (s + 1) * SEGMENT), each in BLOCK_N-key tiles at absolute positions: the same
    tiles in the same order whether a prompt arrives whole, in chunks, after a prefix-cache hit, or
    one token at a time; one masked loop (no separate unmasked or diagonal loops);
  * within a segment, the online softmax (exp2, fp32) gives (o_s, lse_s); segments are folded in
    ascending order by one helper (``_fold``), in registers (split=False) or by the merge kernel
    from fp32 partials (split=True): the same operations on the same fp32 values, so the choice
    of path (made per launch from the batch, for speed) does not change a bit;
  * one tile shape (``tile_rows``: query positions x the GQA group's heads, BLOCK_N, warps)
    per model whatever the batch, so every tl.dot is the same tensor-core instruction; rows of other
    positions or sequences in a tile only add masked entries, and a masked entry contributes an
    exact 0 (p = 0, alpha = 1);
  * FMA contraction is off (``enable_fp_fusion=False``): the fold is the same IEEE operations in
    both kernels; outputs add +0.0 so that -0.0 and +0.0 do not depend on how many fully masked
    tiles a row went through.

Cache slots past a row's position are masked (scores -inf, loads 0), so NaN in unused slots cannot
reach the output; block-table entries past the tile's last position are not read.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.fp8 import check_scales, dequantize, fp16_rows, inverse, quantize

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
SEGMENT = 256  # keys per segment: the unit of the fixed split over keys
# Rows per tile (positions x padded group; more when a group is larger): the tile every prompt
# chunk and decode goes through, so its size and warps fix the bits. A decode fills only a group's
# rows of its tile; at 64 rows an MHA decode computed 64x the softmax it needs (1.5x the default
# decode kernel's time at batch 256), while prefill, a small share of a served step's attention,
# loses little with small tiles.
BLOCK_M = 16
BLOCK_N = 128 if _INTERPRET else 64  # keys per tile (the interpreter: fewer, larger numpy ops)
NUM_WARPS = 4
MAX_SPLIT_PROGRAMS = 8192  # split path: programs per segment axis, budget (bits do not depend on it)
NUM_STAGES = 2  # software pipelining of the key loop (loads only: no effect on bits); 2 fastest on the H100
_LOG2E = 1.4426950408889634
_NEG_BIG = tl.constexpr(-1.0e30)  # finite running-max start: exp2 of differences stays finite


def num_segments(block_tables: torch.Tensor, block_size: int) -> int:
    """The segments of the longest context these page tables can hold (the max_segments argument)."""
    return -(-block_tables.shape[1] * block_size // SEGMENT)


def tile_rows(group: int) -> int:
    """Rows of a tile for a GQA group of `group` query heads: BLOCK_M, or the padded group if larger."""
    return max(BLOCK_M, triton.next_power_of_2(group))


def positions_per_tile(group: int) -> int:
    """Query positions a tile holds for a GQA group of `group` query heads (what the tile map
    must be built with)."""
    return tile_rows(group) // triton.next_power_of_2(group)


@triton.jit
def _rows(CU, PREFIX, TILE_SEQ, TILE_START, kv_head, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
          BLOCK_M: tl.constexpr):
    """The tile's rows: (token row, query head, position, valid) vectors, its sequence and last position."""
    seq = tl.load(TILE_SEQ + tl.program_id(1))
    start = tl.load(TILE_START + tl.program_id(1))
    busy = seq >= 0
    seq = tl.maximum(seq, 0)
    row0 = tl.load(CU + seq)
    n = tl.where(busy, tl.load(CU + seq + 1) - row0, 0)
    prefix = tl.load(PREFIX + seq)
    r = tl.arange(0, BLOCK_M)
    local = start + r // GROUP_PAD
    head = kv_head * GROUP + r % GROUP_PAD
    valid = (local < n) & (r % GROUP_PAD < GROUP)
    pos = prefix + local
    # the tile's last position; -1 when idle (also padding rows of a captured graph: prefix -1)
    last = tl.where(start < n, prefix + tl.minimum(start + BLOCK_M // GROUP_PAD, n) - 1, -1)
    return row0 + local, head, pos, valid & (pos >= 0), seq, last


@triton.jit
def _segment(q, pos, lo, hi, bt_row, kc_base, vc_base, stride_kcb, stride_kct, stride_vcb, stride_vct, qk_scale,
             v_scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
             CACHE_BLOCK: tl.constexpr, UPCAST_DOT: tl.constexpr, KV_FP8: tl.constexpr):
    """(o, lse) of keys [lo, hi) for every row (lo a multiple of BLOCK_N); rows with no key there
    give l = 0 (their o is NaN and must be masked by the caller). KV_FP8: fp8 tiles cast to fp16, q
    fp16_rows' and qk_scale per row (K's scale in it), V's (v_scale) on o."""
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    m_i = tl.full([BLOCK_M], _NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        key = start_n + tl.arange(0, BLOCK_N)
        k_ok = key < hi
        blk = tl.load(bt_row + key // CACHE_BLOCK, mask=k_ok, other=0).to(tl.int64)
        within = (key % CACHE_BLOCK).to(tl.int64)
        kT = tl.load(kc_base + (blk * stride_kcb + within * stride_kct)[None, :] + offs_d[:, None],
                     mask=k_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(vc_base + (blk * stride_vcb + within * stride_vct)[:, None] + offs_d[None, :],
                    mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        if KV_FP8:  # fp16 tiles and q (kernels/fp8.py fp16_rows), qk_scale per row
            kT = dequantize(kT, tl.float16)
            v = dequantize(v, tl.float16)
            s = tl.dot(q, kT) * qk_scale[:, None]
        elif UPCAST_DOT:  # the interpreter has no bf16 matmul
            s = tl.dot(q.to(tl.float32), kT.to(tl.float32)) * qk_scale
        else:
            s = tl.dot(q, kT) * qk_scale
        s = tl.where(key[None, :] <= pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if UPCAST_DOT:
            acc = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), acc * alpha[:, None])
        else:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    o = acc / l_i[:, None]
    if KV_FP8:
        o = o * v_scale
    return o, m_i + tl.math.log2(l_i)


@triton.jit
def _write_new_kv(K_NEW, V_NEW, SLOTS, row, kc_base, vc_base, kv_head, offs_d, d_ok, stride_knt, stride_knh,
                  stride_vnt, stride_vnh, stride_kcb, stride_kct, stride_vcb, stride_vct, k_scale, v_scale,
                  CACHE_BLOCK: tl.constexpr, KV_FP8: tl.constexpr):
    """Token `row`'s K/V of this kv head into its cache slot (decode launches with new_kv); an fp8
    cache's quantized with the head's scales."""
    slot = tl.load(SLOTS + row).to(tl.int64)
    if slot >= 0:
        blk = slot // CACHE_BLOCK
        within = slot % CACHE_BLOCK
        r = row.to(tl.int64)
        k = tl.load(K_NEW + r * stride_knt + kv_head * stride_knh + offs_d, mask=d_ok)
        v = tl.load(V_NEW + r * stride_vnt + kv_head * stride_vnh + offs_d, mask=d_ok)
        if KV_FP8:
            k = quantize(k, inverse(k_scale), kc_base.dtype.element_ty)
            v = quantize(v, inverse(v_scale), vc_base.dtype.element_ty)
        tl.store(kc_base + blk * stride_kcb + within * stride_kct + offs_d, k, mask=d_ok)
        tl.store(vc_base + blk * stride_vcb + within * stride_vct + offs_d, v, mask=d_ok)


@triton.jit
def _fold(mx, num, den, o, lse, active):
    """Fold one segment's (o, lse) into the running (max, numerator, denominator) of active rows."""
    m_new = tl.maximum(mx, lse)
    a = tl.math.exp2(mx - m_new)
    w = tl.math.exp2(lse - m_new)
    num_new = num * a[:, None] + o * w[:, None]
    den_new = den * a + w
    return (tl.where(active, m_new, mx), tl.where(active[:, None], num_new, num), tl.where(active, den_new, den))


@triton.jit
def _fold_start(BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """The empty (max, numerator, denominator) that _fold starts from."""
    return (tl.full([BLOCK_M], float("-inf"), dtype=tl.float32), tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32),
            tl.zeros([BLOCK_M], dtype=tl.float32))


@triton.jit
def _store_folded(O, row, head, num, den, valid, offs_d, d_ok, stride_ot, stride_oh):
    """out = num / den for the valid rows (+0.0: one sign of zero), in both kernels alike."""
    out = num / den[:, None] + 0.0
    tl.store(O + row.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=valid[:, None] & d_ok[None, :])


# The block-table width and the segment count follow the batch (eager steps) or the graph: without
# this Triton would compile a variant per value class (1, multiple of 16, other) mid-serving.
@triton.jit(do_not_specialize=["max_segments", "stride_bts", "stride_pt"])
def _attn_kernel(Q, K_CACHE, V_CACHE, BLOCK_TABLES, CU, PREFIX, TILE_SEQ, TILE_START, O, PO, PLSE,
                 K_NEW, V_NEW, SLOTS, K_SCALE, V_SCALE, qk_scale, split, max_segments,
                 stride_qt, stride_qh, stride_ot, stride_oh, stride_kcb, stride_kct, stride_kch,
                 stride_vcb, stride_vct, stride_vch, stride_bts, stride_pt,
                 stride_knt, stride_knh, stride_vnt, stride_vnh, NEW_KV: tl.constexpr,
                 HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, CACHE_BLOCK: tl.constexpr,
                 SEGMENT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 UPCAST_DOT: tl.constexpr, KV_FP8: tl.constexpr):
    kv_head = tl.program_id(0)
    row, head, pos, valid, seq, last = _rows(CU, PREFIX, TILE_SEQ, TILE_START, kv_head, GROUP, GROUP_PAD, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(Q + row.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=valid[:, None] & d_ok[None, :], other=0.0)
    bt_row = BLOCK_TABLES + seq.to(tl.int64) * stride_bts
    kc_base = K_CACHE + kv_head.to(tl.int64) * stride_kch
    vc_base = V_CACHE + kv_head.to(tl.int64) * stride_vch
    k_scale = 1.0
    v_scale = 1.0
    if KV_FP8:  # per kv head: K's folds into the softmax scale, V's onto each segment's o
        k_scale = tl.load(K_SCALE + kv_head)
        v_scale = tl.load(V_SCALE + kv_head)
        q, q_up = fp16_rows(q)  # each row's own power of two: no row's bits depend on another's
        qk_scale = qk_scale * k_scale * q_up
    n_seg = tl.where(last >= 0, last // SEGMENT + 1, 0)
    if split:  # segments program_id(2), + num_programs(2), ...: each one's partial to PO / PLSE
        first = tl.program_id(2)
        if NEW_KV and n_seg > 0 and (n_seg - 1) % tl.num_programs(2) == first:
            # a decode row's own K/V, by the program of its last segment (the only one to read them)
            _write_new_kv(K_NEW, V_NEW, SLOTS, tl.load(CU + seq), kc_base, vc_base, kv_head, offs_d, d_ok,
                          stride_knt, stride_knh, stride_vnt, stride_vnh, stride_kcb, stride_kct, stride_vcb,
                          stride_vct, k_scale, v_scale, CACHE_BLOCK, KV_FP8)
            tl.debug_barrier()  # written by every thread before any reads them back
        for seg in range(first, n_seg, tl.num_programs(2)):
            o, lse = _segment(q, pos, seg * SEGMENT, tl.minimum(seg * SEGMENT + SEGMENT, last + 1), bt_row,
                              kc_base, vc_base, stride_kcb, stride_kct, stride_vcb, stride_vct, qk_scale,
                              v_scale, BLOCK_M, BLOCK_N, BLOCK_D, HEAD_DIM, CACHE_BLOCK, UPCAST_DOT, KV_FP8)
            active = valid & (pos >= seg * SEGMENT)
            at = row.to(tl.int64) * stride_pt + head * max_segments + seg
            tl.store(PLSE + at, lse, mask=active)
            tl.store(PO + at[:, None] * HEAD_DIM + offs_d[None, :], o, mask=active[:, None] & d_ok[None, :])
    else:  # every segment of the tile, folded in order
        mx, num, den = _fold_start(BLOCK_M, BLOCK_D)
        for seg in range(0, n_seg):
            o, lse = _segment(q, pos, seg * SEGMENT, tl.minimum(seg * SEGMENT + SEGMENT, last + 1), bt_row,
                              kc_base, vc_base, stride_kcb, stride_kct, stride_vcb, stride_vct, qk_scale,
                              v_scale, BLOCK_M, BLOCK_N, BLOCK_D, HEAD_DIM, CACHE_BLOCK, UPCAST_DOT, KV_FP8)
            mx, num, den = _fold(mx, num, den, o, lse, valid & (pos >= seg * SEGMENT))
        _store_folded(O, row, head, num, den, valid, offs_d, d_ok, stride_ot, stride_oh)


@triton.jit(do_not_specialize=["max_segments", "stride_pt"])
def _merge_kernel(CU, PREFIX, TILE_SEQ, TILE_START, O, PO, PLSE, max_segments, stride_ot, stride_oh, stride_pt,
                  HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, SEGMENT: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """The split path's second launch: fold each row's segment partials in ascending order."""
    row, head, pos, valid, seq, last = _rows(CU, PREFIX, TILE_SEQ, TILE_START, tl.program_id(0), GROUP, GROUP_PAD,
                                             BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    n_seg = tl.where(last >= 0, last // SEGMENT + 1, 0)
    mx, num, den = _fold_start(BLOCK_M, BLOCK_D)
    for seg in range(0, n_seg):
        active = valid & (pos >= seg * SEGMENT)
        at = row.to(tl.int64) * stride_pt + head * max_segments + seg
        lse = tl.load(PLSE + at, mask=active, other=float("-inf"))
        o = tl.load(PO + at[:, None] * HEAD_DIM + offs_d[None, :], mask=active[:, None] & d_ok[None, :], other=0.0)
        mx, num, den = _fold(mx, num, den, o, lse, active)
    _store_folded(O, row, head, num, den, valid, offs_d, d_ok, stride_ot, stride_oh)


def invariant_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        cu_seqlens: torch.Tensor, prefix_lens: torch.Tensor, tiles: tuple[torch.Tensor, torch.Tensor],
                        scale: float, max_segments: int, split: bool = False, out: torch.Tensor | None = None,
                        new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """See the module docstring (an fp8 cache takes k_scale, v_scale). No host sync; every shape
    comes from the host arguments."""
    rows, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    fp8 = check_scales(k_cache, k_scale, v_scale)
    assert q.dtype in (torch.float16, torch.bfloat16) and k_cache.dtype == v_cache.dtype
    assert fp8 or k_cache.dtype == q.dtype
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    if out is None:
        out = torch.empty_like(q)
    tile_seq, tile_start = tiles
    if rows == 0 or tile_seq.numel() == 0:
        return out
    max_segments = max(1, max_segments)
    # Programs per (kv head, tile) on the split path: one per segment, but no more than
    # MAX_SPLIT_PROGRAMS spread over the (kv head, tile) pairs, and at least one (the page tables of
    # a 128k-context model give 512 segments, nearly all past any row's context: without the cap,
    # a million idle programs per launch at batch 256).
    segs = max(1, min(max_segments, MAX_SPLIT_PROGRAMS // max(1, num_kv_heads * tile_seq.numel()))) if split else 1
    # partials [rows, heads, max_segments] of lse, then of o (x head_dim), fp32
    po = torch.empty(rows * num_heads * max_segments * (head_dim + 1) if split else 1,
                     device=q.device, dtype=torch.float32)
    plse = po[rows * num_heads * max_segments * head_dim:] if split else po
    stride_pt = num_heads * max_segments
    consts = dict(HEAD_DIM=head_dim, GROUP=group, GROUP_PAD=group_pad, SEGMENT=SEGMENT, BLOCK_M=tile_rows(group),
                  BLOCK_D=max(16, triton.next_power_of_2(head_dim)))
    grid = (num_kv_heads, tile_seq.numel(), segs)
    if new_kv is not None:
        k_new, v_new, slots = new_kv
        assert split and k_new.shape == v_new.shape == (rows, num_kv_heads, head_dim), "decode rows, split"
        assert k_new.stride(2) == 1 and v_new.stride(2) == 1 and slots.shape == (rows,)
    else:
        k_new = v_new = slots = q  # never read
    if not fp8:
        k_scale = v_scale = q  # never read
    _attn_kernel[grid](q, k_cache, v_cache, block_tables, cu_seqlens, prefix_lens, tile_seq, tile_start, out, po, plse,
                       k_new, v_new, slots, k_scale, v_scale, scale * _LOG2E, int(split), max_segments,
                       q.stride(0), q.stride(1), out.stride(0), out.stride(1),
                       k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                       v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), stride_pt,
                       k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1), NEW_KV=new_kv is not None,
                       CACHE_BLOCK=block_size, BLOCK_N=BLOCK_N, UPCAST_DOT=_INTERPRET and q.dtype == torch.bfloat16,
                       KV_FP8=fp8,
                       **consts,
                       num_warps=NUM_WARPS, num_stages=NUM_STAGES, enable_fp_fusion=False)
    if split:
        _merge_kernel[grid[:2]](cu_seqlens, prefix_lens, tile_seq, tile_start, out, po, plse, max_segments,
                                out.stride(0), out.stride(1), stride_pt, **consts, num_warps=NUM_WARPS,
                                enable_fp_fusion=False)
    return out
