"""Which tile, warps, stages and prefix loop the flash prefill kernel (kernels/flash_prefill.py)
launches with: PrefillConfig, and the tables that pick one from host values only (head size,
max_seqlen, GQA group, whether a paged or a gathered prefix is read and whether it is fp8), so that a CUDA graph
replays the launch it captured. Tuned on an H100 (the comments say with what); the interpreter gets
small tiles of its own.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton

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
# on the H100). The prefix's whole tiles in an unmasked loop (prefix_split; the same bits) took a
# further 4.26 -> 3.97 ms at 8k, 7.12 -> 6.90 at 16k, 10.08 -> 10.01 at 24k (the same benchmark, one
# H100 run, 2026-11-28: benchmarks/results/prefill_chunks_h100.json, flashpage_asm_ids_n128_split).
# An fp8 prefix keeps the table's loop (its combination unmeasured).
_PREFIX_LOOP = {"prefix_n": 128, "prefix_ids": "asm", "prefix_split": True}
# A gathered prefix (flash_prefill's prefix_starts: the prefix's blocks copied back to back, read in
# whole TMA tiles) streams like a long prompt's keys: 128-row tiles take the table's tile for prompts
# past 8k (128x128, 3 TMA stages) whatever the chunk's length, with the query tiles fastest in the
# grid. H200, Llama-3.1-8B's attention, a 32k-token prompt in 8k chunks (bench_prefill_chunks.py,
# over a copy made before the timing): the chunks at 8k, 16k and 24k of prefix took 3.16, 5.34, 7.58
# ms with the table's tile for 8k chunks (128x64, 2 stages), 2.98, 5.01, 6.97 with this tile and
# 2.89, 5.03, 6.61 with it in this order (vLLM's FlashAttention-3 on the paged cache: 2.77, 4.64,
# 6.47); 128-key prefix tiles under the 8k chunks' tile spilled (27 ms at 8k). An fp8 copy keeps the
# table's tile (this one unmeasured over fp8).
_GATHERED_TILE = {128: PrefillConfig(128, 128, 8, 3, tma=True, order="tiles_fastest")}
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
                 has_prefix: bool = True, positions: int | None = None, fp8: bool = False,
                 gathered: bool = False) -> PrefillConfig:
    """The launch config for these shapes (host values only: a CUDA graph replays it). With a
    tile map, `positions` is the block_m() it was built with; `fp8`: the prefix cache is fp8;
    `gathered`: the prefix is a contiguous copy (has_prefix then says nothing of it)."""
    d = _bucket(block_d)
    max_rows = 64 if d == 256 else _GQA_ROWS
    positions = positions or _positions(block_d, max_seqlen, device, group)
    pack = _pack(group, min(_MAX_PACK, max_rows // positions))
    rows = positions * pack
    if _interpreting() or device.type != "cuda":
        return PrefillConfig(rows, _INTERPRET_BLOCK_N, 4, 1, pack, tma_ok and _INTERPRET_TMA)
    if gathered and rows == 128 and d in _GATHERED_TILE and tma_ok and not fp8:
        return _GATHERED_TILE[d]._replace(pack=pack)
    table = _GQA_TILES[d] if pack > 1 and d in _GQA_TILES else _TILES[d, rows]
    tile = next(t for bound, t in table if max_seqlen <= bound)
    if has_prefix and rows == 128:
        tile = _PREFIX_TILE
    if tile[3] and not tma_ok:
        tile = _POINTER_TILE[d]
    cfg = PrefillConfig(rows, *tile[:3], pack, *tile[3:])
    return cfg._replace(**_PREFIX_LOOP) if has_prefix and rows == 128 and not fp8 else cfg


def check_config(cfg: PrefillConfig, group: int, tma_ok: bool) -> None:
    """ValueError, naming the field, where `cfg` (a caller's own: flash_prefill's _config) cannot run
    a GQA group of `group` heads over these tensors (`tma_ok`: descriptors can read them)."""
    if cfg.block_m % cfg.pack or group % cfg.pack or cfg.block_m // cfg.pack < 1:
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


def _diag_width(cfg: PrefillConfig) -> int:
    """Keys per tile of the diagonal loop: BLOCK_N, or with diag=1 the tile's positions, at least
    16 (tl.dot's smallest N) and at most BLOCK_N (a power of two dividing it)."""
    if cfg.diag != 1:
        return cfg.block_n
    return min(cfg.block_n, max(16, cfg.block_m // cfg.pack))


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
