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
  prefix_starts (instead of block_tables) [num_seqs] int32: a gathered prefix (the caller's copy;
               models/attention/triton_backend.py gather_plan says when the engine makes one):
               k_cache / v_cache are then each sequence's blocks copied back to back (contiguous),
               and sequence s's cached position i is row prefix_starts[s] + i of the copy viewed as
               [rows, num_kv_heads * head_dim], read in whole tiles through TMA descriptors rather
               than gathered through the page table (the caller pays one copy of the prefix: worth it
               for long chunks, see models/attention/triton_backend.py). Rows past prefix_lens[s]
               (unowned slots, the next sequence's) are loaded whole tiles at a time, but their
               scores are set to -inf and their V rows to 0; rows past the copy's end load as 0.

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

Masking: paged, cache slots past prefix_lens[s] (and block-table entries past the last used block)
are never read (a gathered prefix: see prefix_starts): those loads are masked with other=0 *and*
their scores set to -inf, so NaN or garbage in unowned slots cannot reach the output. Output rows
past a sequence's end are never written.
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

import numpy as np
import torch
import triton

from kernels.flash_prefill_kernels import _flash_prefill_kernel, _range_probe_kernel
from kernels.fp8 import check_scales
# (PrefillConfig and block_m are this module's API too: a caller builds tile maps with block_m)
from kernels.prefill_config import PrefillConfig, _diag_width, _interpreting, _pick_config, block_m, check_config

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


def _tma_ok(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int, block_d: int) -> bool:
    """Can new-token K/V go through 2-D descriptors [tokens, kv_heads * head_dim]? Needs heads
    contiguous within a token, no head_dim padding, 16-byte aligned bases and token strides."""
    if TensorDescriptor is None or head_dim != block_d or not (q.is_cuda or _interpreting()):
        return False
    return all(t.stride(1) == head_dim and t.stride(0) * t.element_size() % 16 == 0 and t.data_ptr() % 16 == 0
               for t in (k, v))


def gathered_prefix_ok(head_dim: int, device: torch.device) -> bool:
    """Should flash_prefill read a gathered prefix (prefix_starts: contiguous copies, through
    descriptors) of this head size on this device? Head sizes 64 and 128 (the ones run on a GPU);
    under the interpreter any power of two from 16 (its tests' small heads)."""
    if TensorDescriptor is None:
        return False
    if _interpreting():
        return head_dim >= 16 and not head_dim & (head_dim - 1)
    return device.type == "cuda" and head_dim in (64, 128)


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
    prefix_starts: torch.Tensor | None = None,
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
    block_d = max(16, triton.next_power_of_2(head_dim))
    if total == 0 or num_seqs <= 0 or max_seqlen <= 0:
        return out

    has_prefix = k_cache is not None
    gathered = has_prefix and prefix_starts is not None
    if has_prefix:
        if v_cache is None or prefix_lens is None or (block_tables is None) == (prefix_starts is None):
            raise ValueError("k_cache needs v_cache, prefix_lens and one of block_tables, prefix_starts")
        if gathered and not (k_cache.is_contiguous() and v_cache.is_contiguous()
                             and _tma_ok(q, k_cache.flatten(0, 1), v_cache.flatten(0, 1), head_dim, block_d)):
            raise ValueError("a gathered prefix (prefix_starts) must be contiguous copies descriptors can read")
        if gathered:
            block_tables = prefix_lens  # never read (PREFIX_TMA reads prefix_starts instead)
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
    tma_ok = _tma_ok(q, k, v, head_dim, block_d)
    map_positions = block_m(head_dim, max_seqlen, q.device, group) if tiles is not None else None
    if _config is not None and not isinstance(_config, dict):
        cfg = PrefillConfig(*_config)
    else:
        cfg = _pick_config(block_d, max_seqlen, q.device, group, tma_ok, has_prefix and not gathered, map_positions,
                           fp8, gathered)
        cfg = cfg._replace(**(_config or {}))
    check_config(cfg, group, tma_ok)
    positions, prefix_n = cfg.block_m // cfg.pack, cfg.prefix_n or cfg.block_n
    # The asm id load reads each row's first block-table entry even where no prefix is read.
    asm_ids = has_prefix and not gathered and cfg.prefix_ids == "asm" and block_tables.shape[1] > 0
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
    if gathered:
        prefix_descs = (_descriptor(k_cache.flatten(0, 1), prefix_n), _descriptor(v_cache.flatten(0, 1), prefix_n))
    else:
        prefix_descs, prefix_starts = (None, None), cu_seqlens  # never read (PREFIX_TMA False)
    _flash_prefill_kernel[grid](
        q, k, v, out, cu_seqlens, *descs, *diag_descs,
        k_cache, v_cache, block_tables, prefix_lens, tile_seq, tile_start, k_scale, v_scale,
        *prefix_descs, prefix_starts,
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
        PREFIX_ASM_IDS=asm_ids and not _interpreting(), PREFIX_CLAMP_IDS=asm_ids, PREFIX_TMA=gathered,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, maxnreg=cfg.maxnreg,
    )
    return out


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
