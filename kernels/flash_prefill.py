"""Flash prefill: packed variable-length causal attention with an optional paged prefix (Triton).

Contract (semantics are exactly ``kernels.reference.prefill_attention_ref``):

  q            [total_tokens, num_heads, head_dim]     fp16 or bf16; last dim contiguous
  k, v         [total_tokens, num_kv_heads, head_dim]  same dtype; the *new* tokens of every sequence,
                                                       packed back to back; last dim contiguous
  cu_seqlens   [num_seqs + 1] int32 on q's device; sequence s owns rows cu[s] .. cu[s+1]-1
  max_seqlen   host int >= the longest new-token run (sizes the grid; never read from the device;
               rows past it would be left unwritten)
  scale        softmax scale, usually head_dim ** -0.5
  k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim], block_size a power of two,
               any strides but a contiguous last dim; usually q's dtype (others are cast on load)
  block_tables [num_seqs, max_blocks] int32; prefix_lens [num_seqs] int32

Sequence s's new tokens sit at positions prefix_lens[s] .. prefix_lens[s] + len_s - 1. Each query
attends to every cached position [0, prefix_lens[s]) (read through block_tables[s]: token i lives
in block block_tables[s, i // block_size] at offset i % block_size) and causally to the new tokens
up to and including itself. num_kv_heads divides num_heads; query head h reads kv head
h // (num_heads // num_kv_heads). head_dim may be anything up to 256 (padded to a power of two with
masked loads). Scores are never materialised: one program owns BLOCK_M queries of one head of one
sequence and streams K/V tiles with an online softmax in fp32 (exp2, log2(e) folded into the
scale): first the cached prefix, then the new keys below the diagonal (no mask), then the diagonal
tiles (causal mask); tiles above the diagonal are never visited. Grid: (query tiles of the longest
run, heads, sequences); programs past their sequence's end exit at once.

Masking: cache slots past prefix_lens[s] (and block-table entries past the last used block) are
never read: those loads are masked with other=0 *and* their scores set to -inf, so NaN or garbage
in unowned slots cannot reach the output. Rows past a sequence's end are neither read nor written.
Cache addressing is int64. The launch path does no host sync (.item()/.tolist()).

Tile map (for CUDA graphs, whose grid cannot follow the batch): with ``tiles=(tile_seq, tile_start)``,
two int32 [num_tiles] device tensors, the grid is (num_tiles, heads) and program i serves rows
tile_start[i] .. + BLOCK_M of sequence tile_seq[i] (-1: no work); ``tile_map()`` builds it for a
batch, ``block_m()`` gives the BLOCK_M it must use. max_seqlen then only picks the tile config.

Returns out [total_tokens, num_heads, head_dim] in q's dtype (written into ``out`` if given).
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.jit
def _online_softmax_step(acc, l_i, m_i, q, kT, v, qk_scale, keep, APPLY_MASK: tl.constexpr,
                         UPCAST_DOT: tl.constexpr):
    """One K/V tile: fold scores q·kT into the running (max, sum, acc). No NaN guard needed: the
    first tile a program visits always holds a key every row may see (cached position 0, new key
    0, or the diagonal's first key), so m_i is finite before any fully masked row-tile can occur."""
    if UPCAST_DOT:
        qk = tl.dot(q.to(tl.float32), kT.to(tl.float32))
    else:
        qk = tl.dot(q, kT)
    if APPLY_MASK:
        qk = tl.where(keep, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if UPCAST_DOT:
        acc = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), acc)
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_new


@triton.jit
def _prefix_tile(acc, l_i, m_i, q, start_n, prefix_len, bt_row, kc_base, vc_base,
                 stride_kcb, stride_kct, stride_vcb, stride_vct, qk_scale,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                 CACHE_BLOCK: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """Cached positions [start_n, start_n + BLOCK_N): every position < prefix_len is visible to
    every new query, so the only mask is the prefix bound, which also keeps unowned / NaN slots
    and block-table entries past the last used block from being read."""
    pos = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    n_ok = pos < prefix_len
    blk = tl.load(bt_row + pos // CACHE_BLOCK, mask=n_ok, other=0).to(tl.int64)
    within = (pos % CACHE_BLOCK).to(tl.int64)
    k_off = blk * stride_kcb + within * stride_kct
    v_off = blk * stride_vcb + within * stride_vct
    kT = tl.load(kc_base + k_off[None, :] + offs_d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0)
    vv = tl.load(vc_base + v_off[:, None] + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    return _online_softmax_step(acc, l_i, m_i, q, kT.to(q.dtype), vv.to(q.dtype), qk_scale, n_ok[None, :],
                                True, UPCAST_DOT)


@triton.jit
def _packed_tile(acc, l_i, m_i, q, start_n, kT_ptrs, v_ptrs, stride_kt, stride_vt, offs_m, seq_len, qk_scale,
                 DIAGONAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM: tl.constexpr,
                 UPCAST_DOT: tl.constexpr):
    """New-token keys [start_n, start_n + BLOCK_N). Off the diagonal they are below it for every
    row and inside the sequence: no causal or bound mask, only head_dim padding (resolved at
    compile time). On the diagonal the causal mask alone suffices for rows we store (key <= row <
    seq_len); keys past the end load as 0, so rows we don't store stay finite."""
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    kT_ptrs += start_n * stride_kt
    v_ptrs += start_n * stride_vt
    if DIAGONAL:
        pos = start_n + tl.arange(0, BLOCK_N)
        n_ok = pos < seq_len
        kT = tl.load(kT_ptrs, mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        vv = tl.load(v_ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        keep = pos[None, :] <= offs_m[:, None]
    elif BLOCK_D == HEAD_DIM:
        kT = tl.load(kT_ptrs)
        vv = tl.load(v_ptrs)
        keep = None
    else:
        kT = tl.load(kT_ptrs, mask=d_ok[:, None], other=0.0)
        vv = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        keep = None
    return _online_softmax_step(acc, l_i, m_i, q, kT, vv, qk_scale, keep, DIAGONAL, UPCAST_DOT)


# The block-table row stride is the widest page table of the batch: it changes from step to step,
# and Triton would otherwise compile a variant for each of its value classes (1, multiple of 16,
# other) the first time one shows up, stalling a live server for a second each time.
@triton.jit(do_not_specialize=["stride_bts"])
def _flash_prefill_kernel(
    Q, K, V, O, CU_SEQLENS,
    K_CACHE, V_CACHE, BLOCK_TABLES, PREFIX_LENS, TILE_SEQ, TILE_START,
    qk_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch, stride_bts,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, CACHE_BLOCK: tl.constexpr, HAS_PREFIX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST_DOT: tl.constexpr,
    WHILE_LOOPS: tl.constexpr, TILE_MAP: tl.constexpr,
):
    head = tl.program_id(1)
    if TILE_MAP:  # the host listed (sequence, first row) per query tile; seq -1 = an idle program
        seq = tl.load(TILE_SEQ + tl.program_id(0))
        if seq < 0:
            return
        start_m = tl.load(TILE_START + tl.program_id(0))
    else:
        # Heaviest (last, longest-causal-row) query tiles are launched first: better tail balance.
        start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
        seq = tl.program_id(2)
    seq_start = tl.load(CU_SEQLENS + seq)
    seq_len = tl.load(CU_SEQLENS + seq + 1) - seq_start
    if start_m >= seq_len:
        return
    kv_head = head // GROUP
    # One int64 base per sequence keeps packed offsets safe; in-sequence offsets stay int32.
    tok0 = seq_start.to(tl.int64)

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    m_ok = offs_m < seq_len

    q_ptrs = Q + tok0 * stride_qt + head * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :]
    q = tl.load(q_ptrs, mask=m_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Each loop appears twice: `for` (what the GPU compiles and software-pipelines) and `while`
    # for Triton interpreters that cannot turn a device scalar into a Python range bound (3.6
    # with NumPy >= 2.4); WHILE_LOOPS is decided by a probe, see _interpreter_needs_while().
    if HAS_PREFIX:
        prefix_len = tl.load(PREFIX_LENS + seq)
        bt_row = BLOCK_TABLES + seq.to(tl.int64) * stride_bts
        kc_base = K_CACHE + kv_head.to(tl.int64) * stride_kch
        vc_base = V_CACHE + kv_head.to(tl.int64) * stride_vch
        if WHILE_LOOPS:
            start_n = 0
            while start_n < prefix_len:
                acc, l_i, m_i = _prefix_tile(acc, l_i, m_i, q, start_n, prefix_len, bt_row, kc_base, vc_base,
                                             stride_kcb, stride_kct, stride_vcb, stride_vct, qk_scale,
                                             BLOCK_N, BLOCK_D, HEAD_DIM, CACHE_BLOCK, UPCAST_DOT)
                start_n += BLOCK_N
        else:
            for start_n in range(0, prefix_len, BLOCK_N):
                acc, l_i, m_i = _prefix_tile(acc, l_i, m_i, q, start_n, prefix_len, bt_row, kc_base, vc_base,
                                             stride_kcb, stride_kct, stride_vcb, stride_vct, qk_scale,
                                             BLOCK_N, BLOCK_D, HEAD_DIM, CACHE_BLOCK, UPCAST_DOT)

    kT_ptrs = K + tok0 * stride_kt + kv_head * stride_kh + offs_n[None, :] * stride_kt + offs_d[:, None]
    v_ptrs = V + tok0 * stride_vt + kv_head * stride_vh + offs_n[:, None] * stride_vt + offs_d[None, :]
    # Off-diagonal keys [0, start_m), then the diagonal [start_m, start_m + BLOCK_M) clipped to the
    # sequence; tiles above the diagonal are never visited. Key start_m is visible to every row,
    # so every row has a finite running max once the first diagonal tile is in.
    hi = tl.minimum(start_m + BLOCK_M, seq_len)
    if WHILE_LOOPS:
        start_n = 0
        while start_n < start_m:
            acc, l_i, m_i = _packed_tile(acc, l_i, m_i, q, start_n, kT_ptrs, v_ptrs, stride_kt, stride_vt, offs_m,
                                         seq_len, qk_scale, False, BLOCK_N, BLOCK_D, HEAD_DIM, UPCAST_DOT)
            start_n += BLOCK_N
        while start_n < hi:
            acc, l_i, m_i = _packed_tile(acc, l_i, m_i, q, start_n, kT_ptrs, v_ptrs, stride_kt, stride_vt, offs_m,
                                         seq_len, qk_scale, True, BLOCK_N, BLOCK_D, HEAD_DIM, UPCAST_DOT)
            start_n += BLOCK_N
    else:
        for start_n in range(0, start_m, BLOCK_N):
            acc, l_i, m_i = _packed_tile(acc, l_i, m_i, q, start_n, kT_ptrs, v_ptrs, stride_kt, stride_vt, offs_m,
                                         seq_len, qk_scale, False, BLOCK_N, BLOCK_D, HEAD_DIM, UPCAST_DOT)
        for start_n in range(start_m, hi, BLOCK_N):
            acc, l_i, m_i = _packed_tile(acc, l_i, m_i, q, start_n, kT_ptrs, v_ptrs, stride_kt, stride_vt, offs_m,
                                         seq_len, qk_scale, True, BLOCK_N, BLOCK_D, HEAD_DIM, UPCAST_DOT)

    acc = acc / l_i[:, None]
    o_ptrs = O + tok0 * stride_ot + head * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :]
    tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


@triton.jit
def _range_probe_kernel(X):
    for i in range(0, tl.load(X), 1):
        tl.store(X + 1, i)


@functools.lru_cache(maxsize=None)
def _interpreter_needs_while() -> bool:
    """True where the interpreter cannot use a loaded scalar as a `range` bound."""
    try:
        _range_probe_kernel[(1,)](torch.tensor([2, 0], dtype=torch.int32))
        return False
    except Exception:  # noqa: BLE001 - any failure means: use the while-loop form
        return True


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Padded head_dim -> (max_seqlen threshold, config at or below it, config above it), each config
# (BLOCK_M, BLOCK_N, num_warps, num_stages); picked from sweeps on an H100 with triton 3.6
# (benchmarks/bench_prefill.py --sweep; numbers in benchmarks/results/sweep_prefill_h100.json).
# Short runs prefer 64-row tiles (twice the programs, less of each diagonal tile wasted); long runs
# 128x64 with 8 warps (two warpgroups, two programs per SM). A fixed table rather than
# triton.autotune: a live server must not stall to compile and time a dozen variants whenever a
# new shape arrives, and the choice should not change between runs.
_GPU_CONFIGS: dict[int, tuple[int, tuple[int, int, int, int], tuple[int, int, int, int]]] = {
    64: (2048, (64, 64, 4, 3), (128, 64, 8, 3)),
    128: (1024, (64, 64, 4, 3), (128, 64, 8, 3)),
    256: (0, (64, 32, 8, 2), (64, 32, 8, 2)),  # untimed: the largest tiles that compile without spills
}
# Interpreter: small tiles, BLOCK_N < BLOCK_M so the multi-tile diagonal path is exercised.
_INTERPRET_CONFIG = (64, 32, 4, 1)


def _pick_config(block_d: int, max_seqlen: int, device: torch.device) -> tuple[int, int, int, int]:
    if _interpreting() or device.type != "cuda":
        return _INTERPRET_CONFIG
    for d, (threshold, short, long) in sorted(_GPU_CONFIGS.items()):
        if block_d <= d:
            return short if max_seqlen <= threshold else long
    raise ValueError(f"head_dim up to 256 supported, got padded {block_d}")


def flash_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float,
    *,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    block_tables: torch.Tensor | None = None,
    prefix_lens: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    tiles: tuple[torch.Tensor, torch.Tensor] | None = None,
    _config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """Causal attention over packed new tokens (+ optional paged prefix). See module docstring.
    ``_config`` (BLOCK_M, BLOCK_N, num_warps, num_stages) overrides the table (benchmark sweeps)."""
    total, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"q must be fp16 or bf16, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError("q, k, v must share a dtype")
    if k.shape != v.shape or k.shape[0] != total or k.shape[2] != head_dim:
        raise ValueError(f"k/v shape {tuple(k.shape)} does not match q {tuple(q.shape)}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads {num_kv_heads} must divide num_heads {num_heads}")
    if head_dim > 256:
        raise ValueError(f"head_dim up to 256 supported, got {head_dim}")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if out is None:
        out = torch.empty((total, num_heads, head_dim), dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError("out must match q's shape and dtype, last dim contiguous")
    num_seqs = cu_seqlens.numel() - 1
    if total == 0 or num_seqs <= 0 or max_seqlen <= 0:
        return out

    has_prefix = k_cache is not None
    if has_prefix:
        if v_cache is None or block_tables is None or prefix_lens is None:
            raise ValueError("k_cache needs v_cache, block_tables and prefix_lens")
        cache_block = k_cache.shape[1]
        if cache_block & (cache_block - 1) or k_cache.shape[2] != num_kv_heads or k_cache.shape[3] != head_dim:
            raise ValueError(f"bad cache shape {tuple(k_cache.shape)} (block_size must be a power of two)")
        if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or v_cache.shape != k_cache.shape:
            raise ValueError("k_cache/v_cache must match, last dim contiguous")
        kc_strides = k_cache.stride()[:3]
        vc_strides = v_cache.stride()[:3]
        bt_stride = block_tables.stride(0)
    else:
        # Never dereferenced (HAS_PREFIX is a compile-time False); any tensor will do.
        k_cache = v_cache = block_tables = prefix_lens = cu_seqlens
        cache_block, kc_strides, vc_strides, bt_stride = 1, (0, 0, 0), (0, 0, 0), 0

    block_d = max(16, triton.next_power_of_2(head_dim))
    block_m, block_n, num_warps, num_stages = _config or _pick_config(block_d, max_seqlen, q.device)
    if block_m % block_n:
        raise ValueError("BLOCK_N must divide BLOCK_M (the off-diagonal loop stops at a BLOCK_M edge)")
    if tiles is not None:
        tile_seq, tile_start = tiles
        if tile_seq.shape != tile_start.shape or tile_seq.dtype != torch.int32 or tile_start.dtype != torch.int32:
            raise ValueError("tiles: two int32 tensors of one shape [num_tiles]")
        grid = (tile_seq.numel(), num_heads, 1)
    else:
        tile_seq = tile_start = cu_seqlens  # never read (TILE_MAP is a compile-time False)
        grid = (triton.cdiv(max_seqlen, block_m), num_heads, num_seqs)
    _flash_prefill_kernel[grid](
        q, k, v, out, cu_seqlens,
        k_cache, v_cache, block_tables, prefix_lens, tile_seq, tile_start,
        float(scale) * _LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        *kc_strides, *vc_strides, bt_stride,
        HEAD_DIM=head_dim, GROUP=num_heads // num_kv_heads, CACHE_BLOCK=cache_block,
        HAS_PREFIX=has_prefix, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        # Triton's interpreter (seen in 3.6 and 3.9) multiplies bf16 dot operands as raw uint16 bit patterns;
        # under it we feed the dots fp32 copies of the same bf16 values instead.
        UPCAST_DOT=_interpreting() and q.dtype == torch.bfloat16,
        WHILE_LOOPS=_interpreting() and _interpreter_needs_while(),
        TILE_MAP=tiles is not None,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def block_m(head_dim: int, max_seqlen: int, device: torch.device) -> int:
    """The BLOCK_M flash_prefill uses for these shapes (what a tile map must be built with)."""
    return _pick_config(max(16, triton.next_power_of_2(head_dim)), max_seqlen, device)[0]


def tile_map(lens: np.ndarray, prefix_lens: np.ndarray, block_m: int, num_tiles: int) -> tuple[np.ndarray, np.ndarray]:
    """(tile_seq, tile_start), int32 [num_tiles]: every query tile of sequences with `lens` new
    tokens, the most work first (a tile's causal row reaches prefix + start + block_m keys: long
    rows first balance the tail), then idle tiles (-1). Raises if the batch needs more tiles."""
    lens = np.asarray(lens, dtype=np.int64)
    counts = -(-lens // block_m)
    need = int(counts.sum())
    if need > num_tiles:
        raise ValueError(f"batch needs {need} query tiles, the map holds {num_tiles}")
    seq = np.repeat(np.arange(len(lens)), counts)
    start = (np.arange(need) - np.repeat(np.cumsum(counts) - counts, counts)) * block_m
    order = np.argsort(-(np.asarray(prefix_lens, dtype=np.int64)[seq] + start), kind="stable")
    tile_seq = np.full(num_tiles, -1, dtype=np.int32)
    tile_start = np.zeros(num_tiles, dtype=np.int32)
    tile_seq[:need], tile_start[:need] = seq[order], start[order]
    return tile_seq, tile_start
