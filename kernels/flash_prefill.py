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
               any strides but a contiguous last dim; usually q's dtype (others are cast on load),
               or fp8 (float8_e4m3fn / float8_e5m2) with k_scale, v_scale (fp32 [num_kv_heads]):
               the prefix is then read as stored * scale (kernels/fp8.py). The new tokens are
               always k and v as given: a chunk's own keys never go through the cache here
               (kv_write and rope_kv_write leave them as an fp8 cache holds them).
  block_tables [num_seqs, max_blocks] int32; prefix_lens [num_seqs] int32

Sequence s's new tokens sit at positions prefix_lens[s] .. prefix_lens[s] + len_s - 1. Each query
attends to every cached position [0, prefix_lens[s]) (read through block_tables[s]: token i lives
in block block_tables[s, i // block_size] at offset i % block_size) and causally to the new tokens
up to and including itself. num_kv_heads divides num_heads; query head h reads kv head
h // (num_heads // num_kv_heads). head_dim may be anything up to 256 (padded to a power of two with
masked loads). Scores are never materialised: one program owns a tile of BLOCK_M rows and streams
K/V tiles with an online softmax in fp32 (exp2, log2(e) folded into the scale): first the cached
prefix, then the new keys before the tile's first position (no mask), then the diagonal tiles
(causal mask; with PrefillConfig.diag in tiles as narrow as the query tile's positions); tiles
after its last position are never visited.

Grouped-query attention: a tile's rows are (position, query head) pairs of one sequence, PACK query
heads of one GQA group x BLOCK_M / PACK positions (PackGQA), so each K/V tile is loaded once for
the PACK heads; the causal mask compares each row's own position. PACK (1 for MHA) and the tile
shapes are picked per launch from host shapes only (head_dim, max_seqlen, group, prefix or not),
never from tensor values. Grid: (head groups, query tiles of the longest run, sequences), the
heaviest tiles first; programs past their sequence's end do no work and write nothing. With
PrefillConfig.order "tiles_fastest" the first two axes swap (query tiles vary fastest); the
outputs are the same bits either way.

Masking: cache slots past prefix_lens[s] (and block-table entries past the last used block) are
never read: those loads are masked with other=0 *and* their scores set to -inf, so NaN or garbage
in unowned slots cannot reach the output. Output rows past a sequence's end are never written.
New-token K/V: with pointer loads, rows past a sequence's end are not read. Where k and v allow
it (head_dim a power of two >= 16, heads contiguous within a token, 16-byte aligned base and token
stride; on the GPU and under the interpreter) their tiles are TMA loads through 2-D descriptors
[tokens, kv_heads * head_dim] instead, and a diagonal tile then also reads the next sequence's
(or padding) rows: their scores are masked and their V rows zeroed, so even NaN there cannot reach
the output; rows past the last token load as 0. Cache addressing is int64. The launch path does
no host sync (.item()/.tolist()).

Tile map: with ``tiles=(tile_seq, tile_start)``, two int32 [num_tiles] device tensors, the grid is
(head groups, num_tiles) and program (g, i) serves positions tile_start[i] .. + block_m() - 1 of
sequence tile_seq[i] (-1: no work) for its heads; ``tile_map()`` builds it on the host for a batch,
``block_m()`` gives the positions per tile it must use (a function of head_dim, the token bound
and the GQA group). max_seqlen then only picks the tile config. CUDA graphs need one (their grid
cannot follow the batch); eager varlen batches use one too, so the grid holds no idle programs:
without a map it is (query tiles of the longest run) x sequences, and the programs past a short
sequence's end still cost a launch slot each (342 -> 282 TFLOP/s on the H100 for a mixed batch).

Returns out [total_tokens, num_heads, head_dim] in q's dtype (written into ``out`` if given).
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import numpy as np
import torch
import triton

from kernels.flash_prefill_kernels import _flash_prefill_kernel, _range_probe_kernel
from kernels.fp8 import check_scales

try:  # host-side TMA descriptors (Triton >= 3.4); without them every load goes through pointers
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

_LOG2E = 1.4426950408889634


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


class PrefillConfig(NamedTuple):
    """One launch configuration. block_m counts tile rows: block_m // pack query positions of
    `pack` query heads of one GQA group. tma: new-token K/V through tensor descriptors. maxnreg
    caps registers per thread (Triton's launch option): at 128 two 8-warp programs share an SM.
    diag: 0 = an unmasked loop of BLOCK_N-key tiles up to start_m rounded down to BLOCK_N, then
    the diagonal in masked BLOCK_N-key tiles; 1 = the same, but the diagonal loop steps
    min(BLOCK_N, max(16, positions)) keys, so no key past the tile's last position is loaded (see
    the key loops in kernels/flash_prefill_kernels.py).
    order: which grid axis varies fastest, "heads_fastest" (the head groups: the programs resident
    at once span every kv head) or "tiles_fastest" (the query tiles: they span one or two kv heads,
    whose prefix they all stream); a scheduling choice only, the outputs are the same bits.
    prefix_n: keys per tile of the paged-prefix loop (None: block_n; a power of two >= 16).
    prefix_split: the prefix's whole tiles in an unmasked loop, the last partial one masked (the
    same bits as one masked loop at the same prefix_n).
    prefix_ids: how the prefix loop reads page ids: "load" (tl.load) or "asm" (an inline ld.global
    Triton's pipeliner cannot turn into an async copy, so the K/V gathers stay pipelined; see the
    prefix loop in kernels/flash_prefill_kernels.py); the same bits. Under the interpreter "asm"
    runs the same addressing through tl.load (no inline assembly there)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    pack: int = 1
    tma: bool = False
    maxnreg: int | None = None
    diag: int = 0
    order: str = "heads_fastest"
    prefix_n: int | None = None
    prefix_split: bool = False
    prefix_ids: str = "load"


ORDERS = ("heads_fastest", "tiles_fastest")
PREFIX_IDS = ("load", "asm")


# Tables picked from sweeps on an H100 with triton 3.6 (benchmarks/kernels/bench_prefill.py --sweep; numbers
# in benchmarks/results/experiments/sweep_prefill_gqa_h100.json, pointer-only MHA tiles in
# sweep_prefill_h100.json). Fixed tables rather than triton.autotune: a live server must not
# stall to compile and time a dozen variants whenever a new shape arrives, and the choice should
# not change between runs.
#
# Query positions per tile for MHA, by padded head_dim: (max_seqlen threshold, positions at or
# below it, above it). Short runs prefer 64-position tiles (twice the programs, less of each
# diagonal tile wasted).
_POSITIONS = {64: (2048, 64, 128), 128: (1024, 64, 128), 256: (1 << 62, 64, 64)}
# GQA: 128-row tiles of up to _MAX_PACK heads (4 measured; 32 positions).
_GQA_ROWS, _MAX_PACK = 128, 4
_INF = 1 << 62
# (padded head_dim, rows) -> [(max_seqlen bound, (BLOCK_N, num_warps, num_stages, tma, maxnreg))],
# the first bound >= max_seqlen wins. Head 128, 128 rows (GQA at 32/8 heads; MHA at N > 1024):
# up to 1k, 128x32 tiles at 128 registers (two programs per SM, 3 stages); at 2k 128x64, 2
# stages, 128 registers; longer, 128x128 tiles, 3 TMA stages (one program per SM, 225 KB of
# shared memory): 0.94-1.02x cuDNN at 4k-16k (GQA and MHA, benchmarks/results/prefill_h100.json).
_TILES = {
    (64, 64): [(1024, (64, 4, 3, False, None)), (_INF, (64, 4, 3, True, None))],
    (64, 128): [(_INF, (64, 8, 3, True, None))],
    (128, 64): [(_INF, (64, 4, 3, False, None))],
    (128, 128): [(1024, (32, 8, 3, True, 128)), (2048, (64, 8, 2, True, 128)), (_INF, (128, 8, 3, True, None))],
    (256, 64): [(_INF, (32, 8, 2, False, None))],  # untimed: the largest tiles that compile without spills
}
# Packed GQA tiles (pack > 1), by padded head_dim, as _TILES; entries may add diag. Head 128: up to
# 8k, 128x64 tiles, 2 stages, 128 registers, the diagonal in 32-key tiles (diag 1): 1-5% faster
# than the same tile with 64-key diagonals at 1k, 2k and 8k, 7% at 4k, and 3-14% faster than the
# MHA table's picks there; past 8k the 128x128 tile is still the fastest (H100, GQA 32/8, varlen
# batch: benchmarks/results/experiments/sweep_prefill_gqa_h100.json, run c).
_GQA_TILES = {128: [(8192, (64, 8, 2, True, 128, 1)), (_INF, (128, 8, 3, True, None))]}
# With a paged prefix (K/V gathered through pointers) the 128-wide and 128-register tiles spill
# hundreds of bytes: 128 rows then take 128x64 tiles, 3 stages, TMA for the new tokens only.
_PREFIX_TILE = (64, 8, 3, True, None)
# Tensors a descriptor cannot cover (padded head_dim, strided heads): pointer loads.
_POINTER_TILE = {64: (64, 4, 3, False, None), 128: (64, 8, 3, False, None)}
# The paged-prefix loop of 128-row tiles over a 16-bit cache: 128-key tiles, page ids through the
# inline load (PrefillConfig.prefix_n / prefix_ids). With tl.load's ids the loop waits each
# iteration for every K/V copy in flight (the id load queues behind them: async_wait depth 0 in
# the sm_90 IR, 2 with "asm": benchmarks/kernels/prefill_ir.py) and ran at ~240 TFLOP/s whatever the
# prefix's length. Measured on an H100 (bench_prefill_chunks.py, Llama-3.1-8B's attention, a
# 32k-token prompt in 8k chunks; benchmarks/results/experiments/prefill_chunks_variants_h100.log): the
# chunk at 8k of prefix 5.86 -> 4.21 ms, at 16k 10.29 -> 7.14 ms (1.39x, 1.44x); "asm" alone 4.74
# and 8.26, 128-key tiles alone 4.98 and 8.72; the other options gained less (the split 4.54 and
# 7.96, the program order 5.44 and 9.72). The same bits as tl.load's ids (tests/kernels/test_flash_prefill_order.py, which passed
# on the H100). An fp8 prefix keeps the table's loop (its combination unmeasured).
_PREFIX_LOOP = {"prefix_n": 128, "prefix_ids": "asm"}
# Interpreter: small tiles, BLOCK_N < positions per tile so the multi-tile diagonal path runs;
# descriptor (TMA) loads wherever the tensors allow them, as on the GPU (tests flip this).
_INTERPRET_POSITIONS, _INTERPRET_BLOCK_N = 64, 32
_INTERPRET_TMA = True


def _bucket(block_d: int) -> int:
    if block_d > 256:
        raise ValueError(f"head_dim up to 256 supported, got padded {block_d}")
    return 64 if block_d <= 64 else 128 if block_d <= 128 else 256


def _positions(block_d: int, max_seqlen: int, device: torch.device, group: int = 1) -> int:
    """Query positions per tile. GQA tiles (head_dim up to 128) hold _GQA_ROWS rows of as many
    of the group's heads as fit (_MAX_PACK at most); MHA and head 256 tiles one head's positions."""
    if group > 1 and _bucket(block_d) < 256:
        return _GQA_ROWS // _pack(group, _MAX_PACK)
    if _interpreting() or device.type != "cuda":
        return _INTERPRET_POSITIONS
    threshold, short, long = _POSITIONS[_bucket(block_d)]
    return short if max_seqlen <= threshold else long


def _pack(group: int, limit: int) -> int:
    """Query heads per tile: the largest power of two dividing the group, at most `limit`."""
    pack = 1
    while group % (2 * pack) == 0 and 2 * pack <= limit:
        pack *= 2
    return pack


def _pick_config(block_d: int, max_seqlen: int, device: torch.device, group: int = 1, tma_ok: bool = False,
                 has_prefix: bool = True, positions: int | None = None, fp8: bool = False) -> PrefillConfig:
    """The launch config for these shapes (host values only: a CUDA graph replays it). With a
    tile map, `positions` is the block_m() it was built with; `fp8`: the prefix cache is fp8."""
    d = _bucket(block_d)
    max_rows = 64 if d == 256 else _GQA_ROWS
    positions = positions or _positions(block_d, max_seqlen, device, group)
    pack = _pack(group, min(_MAX_PACK, max_rows // positions))
    rows = positions * pack
    if _interpreting() or device.type != "cuda":
        return PrefillConfig(rows, _INTERPRET_BLOCK_N, 4, 1, pack, tma_ok and _INTERPRET_TMA)
    table = _GQA_TILES[d] if pack > 1 and d in _GQA_TILES else _TILES[d, rows]
    tile = next(t for bound, t in table if max_seqlen <= bound)
    if has_prefix and rows == 128:
        tile = _PREFIX_TILE
    if tile[3] and not tma_ok:
        tile = _POINTER_TILE[d]
    cfg = PrefillConfig(rows, *tile[:3], pack, *tile[3:])
    return cfg._replace(**_PREFIX_LOOP) if has_prefix and rows == 128 and not fp8 else cfg


def _diag_width(cfg: PrefillConfig) -> int:
    """Keys per tile of the diagonal loop: BLOCK_N, or with diag=1 the tile's positions, at least
    16 (tl.dot's smallest N) and at most BLOCK_N (a power of two dividing it)."""
    if cfg.diag != 1:
        return cfg.block_n
    return min(cfg.block_n, max(16, cfg.block_m // cfg.pack))


def _tma_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int, block_d: int) -> bool:
    """Can new-token K/V go through 2-D descriptors [tokens, kv_heads * head_dim]? Needs heads
    contiguous within a token, no head_dim padding, 16-byte aligned bases and token strides."""
    if TensorDescriptor is None or head_dim != block_d or not (q.is_cuda or _interpreting()):
        return False
    return all(t.stride(1) == head_dim and t.stride(0) * t.element_size() % 16 == 0 and t.data_ptr() % 16 == 0
               for t in (k, v))


def _descriptor(t: torch.Tensor, rows: int):
    """t [tokens, heads, head_dim] as a 2-D [tokens, heads * head_dim] descriptor of one head's
    rows x head_dim tiles (the kernel picks the head by the column offset)."""
    return TensorDescriptor(t, [t.shape[0], t.shape[1] * t.shape[2]], [t.stride(0), 1], [rows, t.shape[2]])


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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    _config: tuple | dict | None = None,
) -> torch.Tensor:
    """Causal attention over packed new tokens (+ optional paged prefix; an fp8 one with its scales
    k_scale, v_scale). See module docstring. ``_config`` (a PrefillConfig or its leading fields)
    overrides the table, or (a dict) some of the picked config's fields (benchmark sweeps)."""
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
        fp8 = check_scales(k_cache, k_scale, v_scale)
    else:
        # Never dereferenced (HAS_PREFIX is a compile-time False); any tensor will do.
        k_cache = v_cache = block_tables = prefix_lens = cu_seqlens
        cache_block, kc_strides, vc_strides, bt_stride, fp8 = 1, (0, 0, 0), (0, 0, 0), 0, False
    k_scale, v_scale = (k_scale, v_scale) if fp8 else (cu_seqlens, cu_seqlens)  # placeholders: never read

    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    tma_ok = _tma_ok(q, k, v, head_dim, block_d)
    map_positions = block_m(head_dim, max_seqlen, q.device, group) if tiles is not None else None
    if _config is not None and not isinstance(_config, dict):
        cfg = PrefillConfig(*_config)
    else:
        cfg = _pick_config(block_d, max_seqlen, q.device, group, tma_ok, has_prefix, map_positions, fp8)
        cfg = cfg._replace(**(_config or {}))
    positions = cfg.block_m // cfg.pack
    if cfg.block_m % cfg.pack or group % cfg.pack or positions < 1:
        raise ValueError(f"{cfg}: pack must divide block_m and the GQA group {group}")
    if cfg.tma and not tma_ok:
        raise ValueError(f"{cfg}: these k/v cannot be read through descriptors")
    if cfg.diag not in (0, 1):
        raise ValueError(f"{cfg}: diag must be 0 or 1")
    if cfg.order not in ORDERS:
        raise ValueError(f"{cfg}: order must be one of {ORDERS}")
    prefix_n = cfg.prefix_n or cfg.block_n
    if prefix_n < 16 or prefix_n & (prefix_n - 1):
        raise ValueError(f"{cfg}: prefix_n must be a power of two >= 16")
    if cfg.prefix_ids not in PREFIX_IDS:
        raise ValueError(f"{cfg}: prefix_ids must be one of {PREFIX_IDS}")
    # The asm id load reads each row's first block-table entry even where no prefix is read.
    asm_ids = has_prefix and cfg.prefix_ids == "asm" and block_tables.shape[1] > 0
    if tiles is not None:
        if positions != map_positions:
            raise ValueError("a tile map needs the positions per tile that block_m() reports")
        tile_seq, tile_start = tiles
        if tile_seq.shape != tile_start.shape or tile_seq.dtype != torch.int32 or tile_start.dtype != torch.int32:
            raise ValueError("tiles: two int32 tensors of one shape [num_tiles]")
        grid = (num_heads // cfg.pack, tile_seq.numel(), 1)
    else:
        tile_seq = tile_start = cu_seqlens  # never read (TILE_MAP is a compile-time False)
        grid = (num_heads // cfg.pack, triton.cdiv(max_seqlen, positions), num_seqs)
    if grid[1] > 65535 or grid[2] > 65535:  # (axes 1 and 2's limit; checked for either order alike)
        raise ValueError(f"grid {grid} too large: at most 65535 query tiles and sequences per launch")
    tiles_fastest = cfg.order == "tiles_fastest"
    if tiles_fastest:
        grid = (grid[1], grid[0], grid[2])
    descs = (_descriptor(k, cfg.block_n), _descriptor(v, cfg.block_n)) if cfg.tma else (None, None)
    diag_n = _diag_width(cfg)
    diag_descs = (_descriptor(k, diag_n), _descriptor(v, diag_n)) if cfg.tma and diag_n != cfg.block_n else (None, None)
    _flash_prefill_kernel[grid](
        q, k, v, out, cu_seqlens, *descs, *diag_descs,
        k_cache, v_cache, block_tables, prefix_lens, tile_seq, tile_start, k_scale, v_scale,
        float(scale) * _LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        *kc_strides, *vc_strides, bt_stride,
        HEAD_DIM=head_dim, GROUP=group, PACK=cfg.pack, CACHE_BLOCK=cache_block,
        HAS_PREFIX=has_prefix, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d,
        # Triton's interpreter (seen in 3.6 and 3.9) multiplies bf16 dot operands as raw uint16 bit patterns;
        # under it we feed the dots fp32 copies of the same bf16 values instead.
        UPCAST_DOT=_interpreting() and q.dtype == torch.bfloat16,
        WHILE_LOOPS=_interpreting() and _interpreter_needs_while(),
        TILE_MAP=tiles is not None, USE_TMA=cfg.tma, DIAG=cfg.diag, DIAG_N=diag_n, KV_FP8=fp8,
        TILES_FASTEST=tiles_fastest, PREFIX_N=prefix_n, PREFIX_SPLIT=bool(cfg.prefix_split),
        PREFIX_ASM_IDS=asm_ids and not _interpreting(), PREFIX_CLAMP_IDS=asm_ids,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, maxnreg=cfg.maxnreg,
    )
    return out


def block_m(head_dim: int, max_seqlen: int, device: torch.device, group: int = 1) -> int:
    """Query positions per tile that flash_prefill uses for these shapes and GQA group (what a
    tile map must be built with; a packed tile holds them for several heads)."""
    return _positions(max(16, triton.next_power_of_2(head_dim)), max_seqlen, device, group)


def config_bounds() -> list[int]:
    """The max_seqlen values past which the tables pick another launch config (tile shape or
    positions per tile): a warm-up that runs a chunk just past each (and a short one) compiles
    every variant a batch can launch."""
    bounds = {b for table in (*_TILES.values(), *_GQA_TILES.values()) for b, _ in table}
    bounds |= {threshold for threshold, _, _ in _POSITIONS.values()}
    return sorted(b for b in bounds if b < _INF)


def tile_map(lens: np.ndarray, prefix_lens: np.ndarray, block_m: int, num_tiles: int | None = None
             ) -> tuple[np.ndarray, np.ndarray]:
    """(tile_seq, tile_start), int32 [num_tiles]: every query tile of sequences with `lens` new
    tokens, the most work first (a tile's causal row reaches prefix + start + block_m keys: long
    rows first balance the tail), then idle tiles (-1). Raises if the batch needs more tiles.
    num_tiles None: exactly as many as the batch needs (an eager launch, no idle program)."""
    lens = np.asarray(lens, dtype=np.int64)
    counts = -(-lens // block_m)
    need = int(counts.sum())
    num_tiles = need if num_tiles is None else num_tiles
    if need > num_tiles:
        raise ValueError(f"batch needs {need} query tiles, the map holds {num_tiles}")
    seq = np.repeat(np.arange(len(lens)), counts)
    start = (np.arange(need) - np.repeat(np.cumsum(counts) - counts, counts)) * block_m
    order = np.argsort(-(np.asarray(prefix_lens, dtype=np.int64)[seq] + start), kind="stable")
    tile_seq = np.full(num_tiles, -1, dtype=np.int32)
    tile_start = np.zeros(num_tiles, dtype=np.int32)
    tile_seq[:need], tile_start[:need] = seq[order], start[order]
    return tile_seq, tile_start
