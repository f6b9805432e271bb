"""Device code of the paged decode kernel: the Triton programs behind kernels/paged_decode.py, whose
docstring is their contract. Host code never calls these directly: kernels/decode_launch.py launches
them (through Triton's dispatch once per shape, then from a cached plan).
"""

import triton
import triton.language as tl

from kernels import pdl
from kernels.fp8 import dequantize, fp16_rows, inverse, quantize

# Finite "minus infinity" for running maxima: keeps exp2(m_old - m_new) finite (no -inf - -inf).
_NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def _load_tile(k_base, v_base, page, tok, valid, offs_d, d_ok,
               stride_kb, stride_kt, stride_vb, stride_vt, BLOCK_SIZE: tl.constexpr):
    """K and V rows [BLOCK_N, HEAD_DIM_PAD] of tokens `tok` on pages `page` (0 where not valid)."""
    page = page.to(tl.int64)  # int64: num_blocks * block stride can pass 2**31
    slot_k = page * stride_kb + (tok % BLOCK_SIZE) * stride_kt
    slot_v = page * stride_vb + (tok % BLOCK_SIZE) * stride_vt
    mask = valid[:, None] & d_ok[None, :]
    k = tl.load(k_base + slot_k[:, None] + offs_d[None, :], mask=mask, other=0.0)
    v = tl.load(v_base + slot_v[:, None] + offs_d[None, :], mask=mask, other=0.0)
    return k, v


@triton.jit
def _for_math(x, q, LANES: tl.constexpr):
    """fp8 K or V as the math takes it: fp32 on the lane-wise path, q's dtype (fp16 by then) for the
    tensor-core dots."""
    if LANES:
        y = dequantize(x, tl.float32)
    else:
        y = dequantize(x, q.dtype)
    return y


# num_splits and the block-table row stride follow the batch's shape; without this Triton compiles
# a variant per value class (1, multiple of 16, other) mid-serving.
@triton.jit(do_not_specialize=["num_splits", "stride_bts"])
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, kn_ptr, vn_ptr, slot_ptr, out_ptr, po_ptr, plse_ptr, cnt_ptr,
    ks_ptr, vs_ptr, scale_log2, num_splits,
    stride_qs, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bts, stride_os, stride_oh,
    stride_kns, stride_knh, stride_vns, stride_vnh,
    num_heads,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, DOT_F32: tl.constexpr, PREFETCH: tl.constexpr, LANES: tl.constexpr,
    FUSED_MERGE: tl.constexpr, SPLITS_PAD: tl.constexpr, NEW_KV: tl.constexpr, MERGE_HEADS: tl.constexpr,
    MERGE_HALF: tl.constexpr, KV_FP8: tl.constexpr, NEW_KV_TAIL: tl.constexpr, PDL: tl.constexpr,
):
    pdl.launch_dependents(PDL)  # (kernels/pdl.py: o_proj's GEMV may start its weight stream)
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    # This split's tile range, from the real context length (shapes fix only the split count).
    ctx = tl.load(ctx_ptr + seq)
    # NEW_KV_TAIL (with NEW_KV): the loop reads the cached tokens [0, ctx - 1) only, split as if
    # they were the whole context, with no where() for this step's token in it; the last split adds
    # that token after the loop (one key from registers).
    if NEW_KV and NEW_KV_TAIL:
        n_loop = ctx - 1
    else:
        n_loop = ctx
    n_tiles = tl.cdiv(n_loop, BLOCK_N)
    tiles_per_split = tl.cdiv(n_tiles, num_splits)
    active = num_splits  # the splits the fused merge reads; the last of them adds this step's token
    if MERGE_HALF > MERGE_HEADS:  # the launch option HALF_MERGE (decode_config)
        # A context that half the splits cover in at most 2 tiles each takes half of them (the rest
        # stay empty): their merge is a tile of half the splits, in fewer rounds; longer contexts
        # spread over all of them. The merge reads the splits that hold tiles alone (>= 1).
        if n_tiles <= SPLITS_PAD:
            tiles_per_split = tl.maximum(tiles_per_split, tl.cdiv(n_tiles, SPLITS_PAD // 2))
        active = tl.maximum(tl.cdiv(n_tiles, tl.maximum(tiles_per_split, 1)), 1)
    t_start = split * tiles_per_split
    t_end = tl.minimum(t_start + tiles_per_split, n_tiles)
    lim = tl.minimum(n_loop, t_end * BLOCK_N)  # this split's tokens are [t_start*BLOCK_N, lim)

    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_g = tl.arange(0, GROUP_PAD)
    d_ok = offs_d < HEAD_DIM
    g_ok = offs_g < GROUP
    heads = kvh * GROUP + offs_g  # the query heads this program serves
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bts
    k_base = k_ptr + kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + kvh.to(tl.int64) * stride_vh
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # [GROUP_PAD, HEAD_DIM_PAD]
    if KV_FP8:
        # An fp8 cache's per-kv-head scales: K's folds into the softmax scale (qv, or each tile's
        # scores), V's multiplies the output once; tiles are cast, never scaled element by element.
        k_sc = tl.load(ks_ptr + kvh)
        v_sc = tl.load(vs_ptr + kvh)
        scale_log2 = scale_log2 * k_sc
        if not LANES:  # the dots in fp16, q scaled per row by a power of two (kernels/fp8.py fp16_rows)
            q, q_up = fp16_rows(q)
            row_scale = scale_log2 * q_up
    if NEW_KV:
        last = ctx - 1
        k_last = tl.load(kn_ptr + seq.to(tl.int64) * stride_kns + kvh * stride_knh + offs_d, mask=d_ok, other=0.0)
        v_last = tl.load(vn_ptr + seq.to(tl.int64) * stride_vns + kvh * stride_vnh + offs_d, mask=d_ok, other=0.0)
        if KV_FP8:
            k_last = quantize(k_last, inverse(k_sc), k_ptr.dtype.element_ty)
            v_last = quantize(v_last, inverse(v_sc), v_ptr.dtype.element_ty)
        else:
            k_last = k_last.to(k_ptr.dtype.element_ty)
            v_last = v_last.to(v_ptr.dtype.element_ty)
        slot = tl.load(slot_ptr + seq).to(tl.int64)
        # Whatever another split loads from this slot meanwhile is replaced by k_last/v_last below.
        if (split == 0) & (slot >= 0):
            dst = (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_kt
            tl.store(k_base + dst + offs_d, k_last, mask=d_ok)
            dst = (slot // BLOCK_SIZE) * stride_vb + (slot % BLOCK_SIZE) * stride_vt
            tl.store(v_base + dst + offs_d, v_last, mask=d_ok)
        if KV_FP8:  # the values the cache now holds, as the tiles below are read
            k_last = _for_math(k_last, q, LANES)
            v_last = _for_math(v_last, q, LANES)

    if LANES:
        # One query row (GROUP_PAD == 1): no tensor-core shape fits, so dot products are
        # elementwise products + row sums. Each of the BLOCK_N lanes keeps its own running max,
        # sum and accumulator (lane j sees tokens j, j+BLOCK_N, ...), so the loop needs no
        # cross-warp reduction; the lanes are merged once after it.
        qv = tl.sum(q.to(tl.float32), axis=0) * scale_log2  # fold scale and log2(e) in once
        m = tl.full([BLOCK_N], _NEG_BIG, tl.float32)
        l = tl.zeros([BLOCK_N], tl.float32)
        acc = tl.zeros([BLOCK_N, HEAD_DIM_PAD], tl.float32)
    else:
        # GQA: the query heads of this kv head are the rows of a tensor-core tile (padded to 16),
        # so each K/V tile is read once for all of them.
        m = tl.full([GROUP_PAD], _NEG_BIG, tl.float32)
        l = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)

    if NEW_KV and NEW_KV_TAIL:
        # This step's token's scores, before the loop: only they, not an fp32 copy of q, stay live
        # across it. -inf where another split adds it, or the row is empty (ctx 0): then alpha 1, p 0.
        if LANES:
            s_last = tl.zeros([GROUP_PAD], tl.float32) + tl.sum(k_last.to(tl.float32) * qv, axis=0)
        else:
            s_last = tl.sum(q.to(tl.float32) * k_last.to(tl.float32)[None, :], axis=1)
            s_last = s_last * (row_scale if KV_FP8 else scale_log2)
        s_last = tl.where((split == active - 1) & (ctx > 0), s_last, float("-inf"))

    # PREFETCH 2: the next tile's K/V and the page ids of the one after are loaded one iteration
    # ahead (register double buffering), so loads are in flight while a tile is computed.
    tok0 = t_start * BLOCK_N + offs_n
    if PREFETCH == 2:
        ok0 = tok0 < lim
        page0 = tl.load(bt_row + tok0 // BLOCK_SIZE, mask=ok0, other=0)
        k_n, v_n = _load_tile(k_base, v_base, page0, tok0, ok0, offs_d, d_ok,
                              stride_kb, stride_kt, stride_vb, stride_vt, BLOCK_SIZE)
        tok1 = tok0 + BLOCK_N
        page_n = tl.load(bt_row + tok1 // BLOCK_SIZE, mask=tok1 < lim, other=0)

    for t in range(t_start, t_end):
        tok = t * BLOCK_N + offs_n
        valid = tok < n_loop
        if PREFETCH == 2:
            k, v = k_n, v_n
            tok1 = tok + BLOCK_N
            ok1 = tok1 < lim
            k_n, v_n = _load_tile(k_base, v_base, page_n, tok1, ok1, offs_d, d_ok,
                                  stride_kb, stride_kt, stride_vb, stride_vt, BLOCK_SIZE)
            tok2 = tok + 2 * BLOCK_N
            page_n = tl.load(bt_row + tok2 // BLOCK_SIZE, mask=tok2 < lim, other=0)
        else:
            page = tl.load(bt_row + tok // BLOCK_SIZE, mask=valid, other=0)
            k, v = _load_tile(k_base, v_base, page, tok, valid, offs_d, d_ok,
                              stride_kb, stride_kt, stride_vb, stride_vt, BLOCK_SIZE)
        if KV_FP8:  # prefetched as fp8 (half the registers), cast here
            k = _for_math(k, q, LANES)
            v = _for_math(v, q, LANES)
        if NEW_KV and not NEW_KV_TAIL:  # this step's token: from registers, not from its slot (maybe unwritten)
            is_last = (tok == last)[:, None]
            k = tl.where(is_last, k_last[None, :], k)
            v = tl.where(is_last, v_last[None, :], v)
        if LANES:
            s = tl.sum(k.to(tl.float32) * qv[None, :], axis=1)
            s = tl.where(valid, s, float("-inf"))  # masked K loaded as 0, and NaN must not leak
            m_new = tl.maximum(m, s)
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new)
            l = l * alpha + p
            acc = acc * alpha[:, None] + p[:, None] * v.to(tl.float32)
            m = m_new
        else:
            if DOT_F32:  # interpreter: its bf16 tl.dot is wrong (triton 3.9); fp32 is exact here
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
            else:
                s = tl.dot(q, tl.trans(k))
            if KV_FP8:
                s = tl.where(valid[None, :], s * row_scale[:, None], float("-inf"))
            else:
                s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            if DOT_F32:
                pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32))
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m = m_new

    if LANES:  # merge the lanes: [GROUP_PAD=1] row state
        m_all = tl.max(m, axis=0)
        w = tl.exp2(m - m_all)
        l_row = tl.zeros([GROUP_PAD], tl.float32) + tl.sum(l * w, axis=0)
        m_row = tl.zeros([GROUP_PAD], tl.float32) + m_all
        acc_row = tl.sum(acc * w[:, None], axis=0)[None, :]
    else:
        l_row, m_row, acc_row = l, m, acc
    if NEW_KV and NEW_KV_TAIL:  # this step's token (s_last, before the loop): one online-softmax update
        m_new = tl.maximum(m_row, s_last)
        alpha = tl.exp2(m_row - m_new)
        p = tl.exp2(s_last - m_new)
        l_row = l_row * alpha + p
        acc_row = acc_row * alpha[:, None] + p[:, None] * v_last.to(tl.float32)[None, :]
        m_row = m_new
    # A split with no tokens has l == 0: it writes a zero partial and lse = -inf.
    l_safe = tl.where(l_row > 0, l_row, 1.0)
    o = acc_row / l_safe[:, None]
    if KV_FP8:
        o = o * v_sc
    lse = tl.where(l_row > 0, m_row + tl.log2(l_safe), float("-inf"))
    st_mask = g_ok[:, None] & d_ok[None, :]
    if SPLIT:
        prow = (seq.to(tl.int64) * num_heads + heads) * num_splits + split
        tl.store(po_ptr + prow[:, None] * HEAD_DIM + offs_d[None, :], o, mask=st_mask)
        tl.store(plse_ptr + prow, lse, mask=g_ok)
        if FUSED_MERGE:
            # The last split of this (sequence, kv head) to finish merges them all, saving a second
            # launch. Barrier: every thread's partial stores precede the counter's release; the
            # acquire makes the other splits' partials visible; .cg loads skip the (incoherent) L1.
            tl.debug_barrier()
            pair = seq * tl.num_programs(1) + kvh
            done = tl.atomic_add(cnt_ptr + pair, 1, sem="acq_rel", scope="gpu")
            if done == num_splits - 1:
                # MERGE_HEADS query heads per round trip: this merge is the kernel's tail, and each
                # round is a dependent load latency (registers bound a round: decode_config.merge_heads).
                # HALF_MERGE: a tile of half the splits and MERGE_HALF heads a round where the splits
                # in use fit it. (A constexpr test around a runtime one: off, the launch compiles to
                # the code it did before the option existed.)
                if MERGE_HALF > MERGE_HEADS:
                    if active <= SPLITS_PAD // 2:
                        _merge_group(po_ptr, plse_ptr, out_ptr, seq, kvh, num_heads, num_splits, active, stride_os,
                                     stride_oh, GROUP, HEAD_DIM, HEAD_DIM_PAD, SPLITS_PAD // 2, MERGE_HALF)
                    else:
                        _merge_group(po_ptr, plse_ptr, out_ptr, seq, kvh, num_heads, num_splits, active, stride_os,
                                     stride_oh, GROUP, HEAD_DIM, HEAD_DIM_PAD, SPLITS_PAD, MERGE_HEADS)
                else:
                    _merge_group(po_ptr, plse_ptr, out_ptr, seq, kvh, num_heads, num_splits, num_splits, stride_os,
                                 stride_oh, GROUP, HEAD_DIM, HEAD_DIM_PAD, SPLITS_PAD, MERGE_HEADS)
                tl.store(cnt_ptr + pair, 0)  # reset for the next launch (self-cleaning counters)
    else:
        orow = out_ptr + seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh
        tl.store(orow + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=st_mask)


@triton.jit
def _merge_row(po_ptr, plse_ptr, row0, num_splits, orow_ptr,
               HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr, CACHE: tl.constexpr):
    """out[row] = log-sum-exp weighted mean of the num_splits partials starting at partial row0."""
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    s_ok = offs_s < num_splits
    d_ok = offs_d < HEAD_DIM
    prow = row0 + offs_s
    lse = tl.load(plse_ptr + prow, mask=s_ok, other=float("-inf"), cache_modifier=CACHE)
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)  # all splits empty (context_len 0): weights all 0
    w = tl.exp2(lse - m)
    o = tl.load(po_ptr + prow[:, None] * HEAD_DIM + offs_d[None, :],
                mask=s_ok[:, None] & d_ok[None, :], other=0.0, cache_modifier=CACHE)
    o = tl.where(w[:, None] > 0, o, 0.0)  # an empty split's partial never contributes
    den = tl.sum(w, axis=0)
    res = tl.sum(o * w[:, None], axis=0) / tl.where(den > 0, den, 1.0)
    tl.store(orow_ptr + offs_d, res.to(orow_ptr.dtype.element_ty), mask=d_ok)


@triton.jit
def _merge_group(po_ptr, plse_ptr, out_ptr, seq, kvh, num_heads, num_splits, active, stride_os, stride_oh,
                 GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
                 HEADS: tl.constexpr):
    """The fused merge of one (sequence, kv head)'s query heads: HEADS a round (_merge_heads), over the
    first `active` of their num_splits partials (<= SPLITS_PAD)."""
    for g in tl.static_range(0, GROUP, HEADS):
        head = kvh * GROUP + g
        _merge_heads(po_ptr, plse_ptr, (seq.to(tl.int64) * num_heads + head) * num_splits, num_splits, active,
                     out_ptr + seq.to(tl.int64) * stride_os + head * stride_oh, stride_oh, GROUP - g,
                     HEAD_DIM, HEAD_DIM_PAD, SPLITS_PAD, HEADS)


@triton.jit
def _merge_heads(po_ptr, plse_ptr, row0, num_splits, active, orow_ptr, stride_oh, heads_left,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr, HEADS: tl.constexpr):
    """_merge_row of the first `active` splits (<= SPLITS_PAD) of min(HEADS, heads_left) consecutive
    heads at once, as one [HEADS, splits, d] tile (a head's num_splits partials follow the previous
    head's). HEADS a power of two."""
    offs_h = tl.arange(0, HEADS)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    h_ok = offs_h < heads_left
    d_ok = offs_d < HEAD_DIM
    ok = h_ok[:, None] & (offs_s < active)[None, :]
    prow = row0 + offs_h[:, None] * num_splits + offs_s[None, :]  # [HEADS, SPLITS_PAD]
    lse = tl.load(plse_ptr + prow, mask=ok, other=float("-inf"), cache_modifier=".cg")
    m = tl.max(lse, axis=1)
    m = tl.where(m == float("-inf"), 0.0, m)  # all splits empty (context_len 0): weights all 0
    w = tl.exp2(lse - m[:, None])
    o = tl.load(po_ptr + prow[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                mask=ok[:, :, None] & d_ok[None, None, :], other=0.0, cache_modifier=".cg")
    o = tl.where(w[:, :, None] > 0, o, 0.0)  # an empty split's partial never contributes
    den = tl.sum(w, axis=1)
    res = tl.sum(o * w[:, :, None], axis=1) / tl.where(den > 0, den, 1.0)[:, None]
    tl.store(orow_ptr + offs_h[:, None] * stride_oh + offs_d[None, :], res.to(orow_ptr.dtype.element_ty),
             mask=h_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(
    po_ptr, plse_ptr, out_ptr, num_splits, num_heads, stride_os, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    pid = tl.program_id(0)  # seq * num_heads + head
    seq = pid // num_heads
    head = pid % num_heads
    _merge_row(po_ptr, plse_ptr, pid.to(tl.int64) * num_splits, num_splits,
               out_ptr + seq.to(tl.int64) * stride_os + head * stride_oh, HEAD_DIM, HEAD_DIM_PAD, SPLITS_PAD, "")
