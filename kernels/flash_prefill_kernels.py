"""Device code of the flash prefill kernel; the contract, the launch path and the tile configs live
in kernels/flash_prefill.py (imports point one way: flash_prefill -> this module).

One program owns a query tile of BLOCK_M rows. Row r is query position start_m + r // PACK of query
head head0 + r % PACK, where head0 = PACK * program_id(0): PACK = 1 is the plain layout (BLOCK_M
positions of one head); PACK > 1 packs heads of one GQA group into the tile ("PackGQA", as in
FlashAttention-3), so every K/V tile the program streams is loaded once for PACK query heads, and
the causal mask compares each row's own position. The tile covers P = BLOCK_M // PACK positions.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.fp8 import dequantize, fp16_rows


@triton.jit
def _online_softmax_step(acc, l_i, m_i, q, kT, v, qk_scale, keep, APPLY_MASK: tl.constexpr,
                         UPCAST_DOT: tl.constexpr, v_scale=1.0, FP8: tl.constexpr = False):
    """One K/V tile: fold scores q·kT into the running (max, sum, acc). No NaN guard needed: the
    first tile a program visits always holds a key every row may see (cached position 0, new key
    0, or a key before the tile's first position), so m_i is finite before any fully masked
    row-tile can occur. FP8 (an fp8 prefix tile, kernels/fp8.py): q and the tiles are fp16,
    qk_scale is per row ([BLOCK_M]: fp16_rows' powers times K's scale), and the tile's V counts
    v_scale times (the scale goes on the probabilities, not on the tile)."""
    if UPCAST_DOT:
        qk = tl.dot(q.to(tl.float32), kT.to(tl.float32))
    else:
        qk = tl.dot(q, kT)
    if FP8:  # per-row scales
        qk = qk * qk_scale[:, None]
        if APPLY_MASK:
            qk = tl.where(keep, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
    else:
        if APPLY_MASK:
            qk = tl.where(keep, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if FP8:
        p = p * v_scale
    if UPCAST_DOT:
        acc = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), acc)
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_new


@triton.jit
def _prefix_tile(acc, l_i, m_i, q, start_n, prefix_len, bt_row, kc_base, vc_base,
                 stride_kcb, stride_kct, stride_vcb, stride_vct, qk_scale,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                 CACHE_BLOCK: tl.constexpr, UPCAST_DOT: tl.constexpr, v_scale=1.0, KV_FP8: tl.constexpr = False,
                 BOUND: tl.constexpr = True, CLAMP_IDS: tl.constexpr = False, ASM_IDS: tl.constexpr = False):
    """Cached positions [start_n, start_n + BLOCK_N): every position < prefix_len is visible to
    every new query, so the only mask is the prefix bound, which also keeps unowned / NaN slots
    and block-table entries past the last used block from being read. BOUND False: the caller
    knows the whole tile lies inside the prefix (PrefillConfig.prefix_split), so the loads and
    scores go unmasked (the same values: every key was kept anyway). CLAMP_IDS (PrefillConfig.
    prefix_ids "asm"): keys past the prefix read the row's first page id instead of a masked one,
    and with ASM_IDS (on the GPU) through an inline ld.global, which Triton's pipeliner leaves alone
    (its prologue runs it unpredicated for tiles past the loop's end too: the host makes sure that
    first entry exists); their K/V loads stay masked.
    KV_FP8: the tiles are fp8, cast to fp16 (q is fp16_rows' and qk_scale per row), v_scale is V's
    scale."""
    pos = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    n_ok = pos < prefix_len  # (unused where not BOUND)
    if CLAMP_IDS:
        ids = bt_row + tl.where(n_ok, pos // CACHE_BLOCK, 0)
        if ASM_IDS:
            blk = tl.inline_asm_elementwise("ld.global.b32 $0, [$1];", "=r,l", [ids], dtype=tl.int32,
                                            is_pure=True, pack=1).to(tl.int64)
        else:
            blk = tl.load(ids).to(tl.int64)
    elif not BOUND:
        blk = tl.load(bt_row + pos // CACHE_BLOCK).to(tl.int64)
    else:
        blk = tl.load(bt_row + pos // CACHE_BLOCK, mask=n_ok, other=0).to(tl.int64)
    within = (pos % CACHE_BLOCK).to(tl.int64)
    k_off = blk * stride_kcb + within * stride_kct
    v_off = blk * stride_vcb + within * stride_vct
    if not BOUND and BLOCK_D == HEAD_DIM:
        kT = tl.load(kc_base + k_off[None, :] + offs_d[:, None])
        vv = tl.load(vc_base + v_off[:, None] + offs_d[None, :])
    elif not BOUND:
        kT = tl.load(kc_base + k_off[None, :] + offs_d[:, None], mask=d_ok[:, None], other=0.0)
        vv = tl.load(vc_base + v_off[:, None] + offs_d[None, :], mask=d_ok[None, :], other=0.0)
    else:
        kT = tl.load(kc_base + k_off[None, :] + offs_d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        vv = tl.load(vc_base + v_off[:, None] + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    # (if/else, not an early return: Triton compiles the statements after a static return too)
    if KV_FP8:
        acc, l_i, m_i = _online_softmax_step(acc, l_i, m_i, q, dequantize(kT, tl.float16), dequantize(vv, tl.float16),
                                             qk_scale, n_ok[None, :], BOUND, UPCAST_DOT, v_scale, True)
    else:
        acc, l_i, m_i = _online_softmax_step(acc, l_i, m_i, q, kT.to(q.dtype), vv.to(q.dtype), qk_scale,
                                             n_ok[None, :], BOUND, UPCAST_DOT)
    return acc, l_i, m_i


@triton.jit
def _prefix_tile_tma(acc, l_i, m_i, q, start_n, prefix_len, pk_desc, pv_desc, row0, col0, qk_scale,
                     BLOCK_N: tl.constexpr, UPCAST_DOT: tl.constexpr, v_scale=1.0, KV_FP8: tl.constexpr = False,
                     BOUND: tl.constexpr = True):
    """Cached positions [start_n, start_n + BLOCK_N) of a gathered prefix (flash_prefill's
    prefix_starts): the sequence's blocks copied back to back, rows row0 + position of descriptors
    over the copy, so each tile is one TMA load instead of a gather through the page table. BOUND:
    the tile may pass prefix_len; the rows past it (the last block's unowned slots, the next
    sequence's blocks) have their scores masked and their V rows zeroed, so that not even NaN there
    can reach the output; rows past the copy's end load as 0. KV_FP8 as in _prefix_tile."""
    k = pk_desc.load([row0 + start_n, col0])
    vv = pv_desc.load([row0 + start_n, col0])
    if KV_FP8:
        kT, vv = dequantize(k.T, tl.float16), dequantize(vv, tl.float16)
    else:
        kT, vv = k.T.to(q.dtype), vv.to(q.dtype)
    n_ok = start_n + tl.arange(0, BLOCK_N) < prefix_len
    if BOUND:
        vv = tl.where(n_ok[:, None], vv, 0.0)
    return _online_softmax_step(acc, l_i, m_i, q, kT, vv, qk_scale, n_ok[None, :], BOUND, UPCAST_DOT, v_scale,
                                KV_FP8)


@triton.jit
def _new_tile(acc, l_i, m_i, q, start_n, kT_ptrs, v_ptrs, stride_kt, stride_vt, offs_m, seq_len, qk_scale,
              CAUSAL: tl.constexpr, BOUND: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
              HEAD_DIM: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """New-token keys [start_n, start_n + BLOCK_N) through pointers (kT_ptrs / v_ptrs span BLOCK_N
    keys). Off the diagonal they are before every row's position and inside the sequence: no causal
    or bound mask, only head_dim padding (resolved at compile time). CAUSAL: mask keys after each
    row's position; for rows we store (key <= row < seq_len) that alone suffices. BOUND: the tile
    may pass the sequence's end: those keys load as 0, so rows we don't store stay finite."""
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    kT_ptrs += start_n * stride_kt
    v_ptrs += start_n * stride_vt
    pos = start_n + tl.arange(0, BLOCK_N)
    if BOUND:
        n_ok = pos < seq_len
        kT = tl.load(kT_ptrs, mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        vv = tl.load(v_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    elif BLOCK_D == HEAD_DIM:
        kT = tl.load(kT_ptrs)
        vv = tl.load(v_ptrs)
    else:
        kT = tl.load(kT_ptrs, mask=d_ok[:, None], other=0.0)
        vv = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
    keep = None
    if CAUSAL:
        keep = pos[None, :] <= offs_m[:, None]
    return _online_softmax_step(acc, l_i, m_i, q, kT, vv, qk_scale, keep, CAUSAL, UPCAST_DOT)


@triton.jit
def _new_tile_tma(acc, l_i, m_i, q, start_n, k_desc, v_desc, row0, col0, offs_m, seq_len, qk_scale,
                  CAUSAL: tl.constexpr, BOUND: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """New-token keys [start_n, start_n + BLOCK_N) through tensor descriptors (TMA on Hopper) of
    BLOCK_N-row blocks. The descriptor spans every packed token, so a tile that may pass the
    sequence's end (BOUND) may hold rows of the next sequence (or padding): the causal test
    (CAUSAL) masks their scores and their V rows are zeroed, so that not even NaN there can reach a
    stored row (p = 0 times NaN is NaN). Rows past the last packed token load as 0."""
    k = k_desc.load([row0 + start_n, col0])
    vv = v_desc.load([row0 + start_n, col0])
    pos = start_n + tl.arange(0, BLOCK_N)
    if BOUND:
        vv = tl.where((pos < seq_len)[:, None], vv, 0.0)
    keep = None
    if CAUSAL:
        keep = pos[None, :] <= offs_m[:, None]
    return _online_softmax_step(acc, l_i, m_i, q, k.T, vv, qk_scale, keep, CAUSAL, UPCAST_DOT)


# The block-table row stride is the widest page table of the batch: it changes from step to step,
# and Triton would otherwise compile a variant for each of its value classes (1, multiple of 16,
# other) the first time one shows up, stalling a live server for a second each time.
@triton.jit(do_not_specialize=["stride_bts"])
def _flash_prefill_kernel(
    Q, K, V, O, CU_SEQLENS, K_DESC, V_DESC, K_DESC_D, V_DESC_D,
    K_CACHE, V_CACHE, BLOCK_TABLES, PREFIX_LENS, TILE_SEQ, TILE_START, K_SCALE, V_SCALE,
    PK_DESC, PV_DESC, PREFIX_STARTS,
    qk_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch, stride_bts,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, PACK: tl.constexpr, CACHE_BLOCK: tl.constexpr,
    HAS_PREFIX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST_DOT: tl.constexpr, WHILE_LOOPS: tl.constexpr, TILE_MAP: tl.constexpr, USE_TMA: tl.constexpr,
    DIAG: tl.constexpr, DIAG_N: tl.constexpr, KV_FP8: tl.constexpr,
    TILES_FASTEST: tl.constexpr, PREFIX_N: tl.constexpr, PREFIX_SPLIT: tl.constexpr,
    PREFIX_CLAMP_IDS: tl.constexpr, PREFIX_ASM_IDS: tl.constexpr, PREFIX_TMA: tl.constexpr,
):
    P: tl.constexpr = BLOCK_M // PACK  # query positions per tile
    # Program order (PrefillConfig.order). Default: grid axis 0 is the head group, the fastest-varying
    # one: programs launched together take the same query tile of every head, so the heaviest tiles
    # of all heads run first (tail balance) and the heads sharing a kv head stream the same K/V at
    # about the same time (L2 hits). TILES_FASTEST swaps axes 0 and 1: the programs resident at once
    # are query tiles of one or two head groups, i.e. of one or two kv heads, so the keys they all
    # stream (a long prefix above all) are one or two kv heads' rather than every kv head's; the
    # heaviest tiles still run first within each head group. Which program does what is unchanged,
    # and so is every output bit.
    if TILES_FASTEST:
        group_id = tl.program_id(1)
        tile_id = tl.program_id(0)
        num_tile_ids = tl.num_programs(0)
    else:
        group_id = tl.program_id(0)
        tile_id = tl.program_id(1)
        num_tile_ids = tl.num_programs(1)
    head0 = group_id * PACK
    # No early return for programs without work (idle tile-map entries, tiles past their
    # sequence's end): they run empty loops and a fully masked store instead. Measured that way
    # on the H100; it also keeps the kernel free of the branches Triton's Hopper warp
    # specialization rejects.
    if TILE_MAP:  # the host listed (sequence, first position) per query tile; seq -1 = an idle program
        seq = tl.load(TILE_SEQ + tile_id)
        start_m = tl.load(TILE_START + tile_id)
        busy = seq >= 0
        seq = tl.maximum(seq, 0)
    else:
        start_m = (num_tile_ids - 1 - tile_id) * P  # heaviest (last) tiles first
        seq = tl.program_id(2)
        busy = True
    seq_start = tl.load(CU_SEQLENS + seq)
    seq_len = tl.where(busy, tl.load(CU_SEQLENS + seq + 1) - seq_start, 0)
    live = start_m < seq_len
    kv_head = head0 // GROUP  # PACK divides GROUP: the tile's heads share this kv head
    # One int64 base per sequence keeps packed offsets safe; in-sequence offsets stay int32.
    tok0 = seq_start.to(tl.int64)

    rows = tl.arange(0, BLOCK_M)
    if PACK == 1:
        offs_m = start_m + rows
        q_head = head0 + tl.zeros([BLOCK_M], dtype=tl.int32)
    else:
        offs_m = start_m + rows // PACK  # each row's own position: what the causal mask compares
        q_head = head0 + rows % PACK
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    m_ok = offs_m < seq_len
    row_off = offs_m[:, None] * stride_qt + q_head[:, None] * stride_qh
    q = tl.load(Q + tok0 * stride_qt + row_off + offs_d[None, :], mask=m_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Each loop appears twice: `for` (what the GPU compiles and software-pipelines) and `while`
    # for Triton interpreters that cannot turn a device scalar into a Python range bound (3.6
    # with NumPy >= 2.4); WHILE_LOOPS is decided by a probe, see _interpreter_needs_while().
    if HAS_PREFIX:
        prefix_len = tl.where(live, tl.load(PREFIX_LENS + seq), 0)
        bt_row = BLOCK_TABLES + seq.to(tl.int64) * stride_bts
        kc_base = K_CACHE + kv_head.to(tl.int64) * stride_kch
        vc_base = V_CACHE + kv_head.to(tl.int64) * stride_vch
        q_prefix = q
        prefix_scale = qk_scale
        v_scale = 1.0
        if KV_FP8:  # fp16 dots over the fp8 tiles; K's scale in the rows' scales (kernels/fp8.py)
            q_prefix, q_up = fp16_rows(q)
            prefix_scale = qk_scale * tl.load(K_SCALE + kv_head) * q_up
            v_scale = tl.load(V_SCALE + kv_head)
        # PREFIX_N keys per tile (PrefillConfig.prefix_n; BLOCK_N by default). PREFIX_SPLIT: the
        # whole tiles [0, prefix_full) go through an unmasked loop, then the last partial one masked.
        # PREFIX_ASM_IDS: with tl.load, Triton (3.6 and 3.9, sm_90) pipelines the page-id load too, as
        # an async copy committed after the K/V copies of the tiles ahead, so each iteration waits for
        # every copy in flight (async_wait num = 0) and each gather's latency is exposed; through the
        # opaque load the K/V copies of the next tile stay in flight (num = 2, as in the new-token
        # pointer loops). benchmarks/kernels/prefill_ir.py prints it.
        prefix_full = 0
        if PREFIX_SPLIT or PREFIX_TMA:
            prefix_full = (prefix_len // PREFIX_N) * PREFIX_N
        if PREFIX_TMA:  # a gathered prefix: whole tiles unmasked, then the last partial one masked
            prow0 = tl.load(PREFIX_STARTS + seq)
            pcol0 = kv_head * HEAD_DIM
            if WHILE_LOOPS:
                start_n = 0
                while start_n < prefix_full:
                    acc, l_i, m_i = _prefix_tile_tma(acc, l_i, m_i, q_prefix, start_n, prefix_len, PK_DESC, PV_DESC,
                                                     prow0, pcol0, prefix_scale, PREFIX_N, UPCAST_DOT, v_scale,
                                                     KV_FP8, False)
                    start_n += PREFIX_N
                while start_n < prefix_len:
                    acc, l_i, m_i = _prefix_tile_tma(acc, l_i, m_i, q_prefix, start_n, prefix_len, PK_DESC, PV_DESC,
                                                     prow0, pcol0, prefix_scale, PREFIX_N, UPCAST_DOT, v_scale,
                                                     KV_FP8, True)
                    start_n += PREFIX_N
            else:
                for start_n in range(0, prefix_full, PREFIX_N):
                    acc, l_i, m_i = _prefix_tile_tma(acc, l_i, m_i, q_prefix, start_n, prefix_len, PK_DESC, PV_DESC,
                                                     prow0, pcol0, prefix_scale, PREFIX_N, UPCAST_DOT, v_scale,
                                                     KV_FP8, False)
                for start_n in range(prefix_full, prefix_len, PREFIX_N):
                    acc, l_i, m_i = _prefix_tile_tma(acc, l_i, m_i, q_prefix, start_n, prefix_len, PK_DESC, PV_DESC,
                                                     prow0, pcol0, prefix_scale, PREFIX_N, UPCAST_DOT, v_scale,
                                                     KV_FP8, True)
        elif WHILE_LOOPS:
            start_n = 0
            if PREFIX_SPLIT:
                while start_n < prefix_full:
                    acc, l_i, m_i = _prefix_tile(acc, l_i, m_i, q_prefix, start_n, prefix_len, bt_row, kc_base,
                                                 vc_base, stride_kcb, stride_kct, stride_vcb, stride_vct, prefix_scale,
                                                 PREFIX_N, BLOCK_D, HEAD_DIM, CACHE_BLOCK, UPCAST_DOT, v_scale, KV_FP8,
                                                 False, PREFIX_CLAMP_IDS, PREFIX_ASM_IDS)
                    start_n += PREFIX_N
            while start_n < prefix_len:
                acc, l_i, m_i = _prefix_tile(acc, l_i, m_i, q_prefix, start_n, prefix_len, bt_row, kc_base, vc_base,
                                             stride_kcb, stride_kct, stride_vcb, stride_vct, prefix_scale,
                                             PREFIX_N, BLOCK_D, HEAD_DIM, CACHE_BLOCK, UPCAST_DOT, v_scale, KV_FP8,
                                             True, PREFIX_CLAMP_IDS, PREFIX_ASM_IDS)
                start_n += PREFIX_N
        else:
            if PREFIX_SPLIT:
                for start_n in range(0, prefix_full, PREFIX_N):
                    acc, l_i, m_i = _prefix_tile(acc, l_i, m_i, q_prefix, start_n, prefix_len, bt_row, kc_base,
                                                 vc_base, stride_kcb, stride_kct, stride_vcb, stride_vct, prefix_scale,
                                                 PREFIX_N, BLOCK_D, HEAD_DIM, CACHE_BLOCK, UPCAST_DOT, v_scale, KV_FP8,
                                                 False, PREFIX_CLAMP_IDS, PREFIX_ASM_IDS)
            for start_n in range(prefix_full, prefix_len, PREFIX_N):
                acc, l_i, m_i = _prefix_tile(acc, l_i, m_i, q_prefix, start_n, prefix_len, bt_row, kc_base, vc_base,
                                             stride_kcb, stride_kct, stride_vcb, stride_vct, prefix_scale,
                                             PREFIX_N, BLOCK_D, HEAD_DIM, CACHE_BLOCK, UPCAST_DOT, v_scale, KV_FP8,
                                             True, PREFIX_CLAMP_IDS, PREFIX_ASM_IDS)

    # Two key loops, [0, lo) in BLOCK_N tiles, then [lo, hi) in DIAG_N tiles (masked, and bounded
    # by the sequence's end); keys after the tile's last position are never visited. The first
    # tile is always [0, ...): key 0 is visible to every row, so every row has a finite running
    # max from the first new-token tile on. DIAG (PrefillConfig.diag) picks where the loops split:
    #  0: lo = start_m rounded down to BLOCK_N: off-diagonal tiles unmasked, then the diagonal in
    #     BLOCK_N tiles (P need not be a multiple of BLOCK_N). With P < BLOCK_N (GQA at 2k: 32
    #     positions, 64 keys) the diagonal loop is one tile whose K/V load nothing overlaps
    #     (a loop of its own) and, when start_m is a multiple of BLOCK_N, half its keys lie past
    #     every row.
    #  1: the same split, but the diagonal loop steps DIAG_N = P keys (at least 16, tl.dot's
    #     minimum; at most BLOCK_N, so P >= BLOCK_N is 0 again): no key past the tile's last
    #     position is loaded or multiplied. The at most BLOCK_N / P - 1 unmasked P-wide tiles
    #     between lo and start_m go through the masked loop too rather than a third one-trip loop
    #     (a mask is cheaper than another exposed load, and two trips of one loop pipeline). The
    #     diagonal's first load stays exposed, but it is half as large.
    #     On the H100 (GQA 32/8, d128) 1 was 1-5% faster than 0 with 64-key tiles at 1k-8k
    #     (sweep_prefill_gqa_h100.json); a third form, one loop masking every tile, was slower.
    hi = tl.where(live, tl.minimum(start_m + P, seq_len), 0)
    lo = tl.minimum((start_m // BLOCK_N) * BLOCK_N, hi)
    if USE_TMA:
        col0 = kv_head * HEAD_DIM  # descriptors view k, v as [tokens, kv_heads * head_dim]
        row0 = seq_start
        k_desc_d, v_desc_d = K_DESC, V_DESC
        if DIAG_N != BLOCK_N:  # the host built DIAG_N-row descriptors for the diagonal loop
            k_desc_d, v_desc_d = K_DESC_D, V_DESC_D
        if WHILE_LOOPS:
            start_n = 0
            while start_n < lo:
                acc, l_i, m_i = _new_tile_tma(acc, l_i, m_i, q, start_n, K_DESC, V_DESC, row0, col0, offs_m, seq_len,
                                              qk_scale, False, False, BLOCK_N, UPCAST_DOT)
                start_n += BLOCK_N
            while start_n < hi:
                acc, l_i, m_i = _new_tile_tma(acc, l_i, m_i, q, start_n, k_desc_d, v_desc_d, row0, col0, offs_m,
                                              seq_len, qk_scale, True, True, DIAG_N, UPCAST_DOT)
                start_n += DIAG_N
        else:
            for start_n in range(0, lo, BLOCK_N):
                acc, l_i, m_i = _new_tile_tma(acc, l_i, m_i, q, start_n, K_DESC, V_DESC, row0, col0, offs_m, seq_len,
                                              qk_scale, False, False, BLOCK_N, UPCAST_DOT)
            for start_n in range(lo, hi, DIAG_N):
                acc, l_i, m_i = _new_tile_tma(acc, l_i, m_i, q, start_n, k_desc_d, v_desc_d, row0, col0, offs_m,
                                              seq_len, qk_scale, True, True, DIAG_N, UPCAST_DOT)
    else:
        kT_ptrs = K + tok0 * stride_kt + kv_head * stride_kh + offs_n[None, :] * stride_kt + offs_d[:, None]
        v_ptrs = V + tok0 * stride_vt + kv_head * stride_vh + offs_n[:, None] * stride_vt + offs_d[None, :]
        kT_ptrs_d, v_ptrs_d = kT_ptrs, v_ptrs
        if DIAG_N != BLOCK_N:
            offs_w = tl.arange(0, DIAG_N)
            kT_ptrs_d = K + tok0 * stride_kt + kv_head * stride_kh + offs_w[None, :] * stride_kt + offs_d[:, None]
            v_ptrs_d = V + tok0 * stride_vt + kv_head * stride_vh + offs_w[:, None] * stride_vt + offs_d[None, :]
        if WHILE_LOOPS:
            start_n = 0
            while start_n < lo:
                acc, l_i, m_i = _new_tile(acc, l_i, m_i, q, start_n, kT_ptrs, v_ptrs, stride_kt, stride_vt, offs_m,
                                          seq_len, qk_scale, False, False, BLOCK_N, BLOCK_D, HEAD_DIM,
                                          UPCAST_DOT)
                start_n += BLOCK_N
            while start_n < hi:
                acc, l_i, m_i = _new_tile(acc, l_i, m_i, q, start_n, kT_ptrs_d, v_ptrs_d, stride_kt, stride_vt, offs_m,
                                          seq_len, qk_scale, True, True, DIAG_N, BLOCK_D, HEAD_DIM, UPCAST_DOT)
                start_n += DIAG_N
        else:
            for start_n in range(0, lo, BLOCK_N):
                acc, l_i, m_i = _new_tile(acc, l_i, m_i, q, start_n, kT_ptrs, v_ptrs, stride_kt, stride_vt, offs_m,
                                          seq_len, qk_scale, False, False, BLOCK_N, BLOCK_D, HEAD_DIM,
                                          UPCAST_DOT)
            for start_n in range(lo, hi, DIAG_N):
                acc, l_i, m_i = _new_tile(acc, l_i, m_i, q, start_n, kT_ptrs_d, v_ptrs_d, stride_kt, stride_vt, offs_m,
                                          seq_len, qk_scale, True, True, DIAG_N, BLOCK_D, HEAD_DIM, UPCAST_DOT)

    acc = acc / tl.where(m_ok, l_i, 1.0)[:, None]  # rows not stored may have seen no key at all
    o_ptrs = O + tok0 * stride_ot + offs_m[:, None] * stride_ot + q_head[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


@triton.jit
def _range_probe_kernel(X):
    for i in range(0, tl.load(X), 1):
        tl.store(X + 1, i)
