"""Which tile, warps, stages and split count the paged decode kernel (kernels/paged_decode.py)
launches with, from shapes only: never from tensor values, so that a launch can be captured in a
CUDA graph while context lengths change between replays. Tuned on an H100
(benchmarks/results/experiments/decode_sweep_h100.txt).
"""

from __future__ import annotations

import functools
import os

import torch
import triton

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
MAX_SPLITS = 64  # also bounds the fused merge's [splits, d] tile (registers)
MERGE_REGS = 64  # fp32 registers a thread the fused merge's tile of partials may take


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _num_sms(device: torch.device) -> int:
    if _INTERPRET or device.type != "cuda":
        return 4  # the interpreter runs programs one by one: keep grids small
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def split_count(pairs: int, max_ctx: int, block_n: int, slots: int, min_tiles: int = 4) -> int:
    """Splits per (sequence, kv head): as many as keep all programs resident in one wave on the GPU
    (``slots`` programs fit at once; rounding down, since a small second wave costs a whole
    program's time), with at least ``min_tiles`` tiles of the longest possible context (the
    block-table width) per split."""
    max_tiles = max(1, -(-max_ctx // block_n))
    return max(1, min(slots // pairs, max_tiles // min_tiles, MAX_SPLITS))


def merge_heads(group: int, splits_pad: int, head_dim_pad: int, num_warps: int) -> int:
    """Query heads the fused merge combines per round (a power of two): as many as fit their
    [heads, splits, d] fp32 partials in MERGE_REGS registers a thread. The merge runs after the main
    loop, whose registers are free by then; each round is a dependent load at the kernel's tail."""
    fit = max(1, MERGE_REGS * 32 * num_warps // (splits_pad * head_dim_pad))
    return min(triton.next_power_of_2(group), 1 << (fit.bit_length() - 1))


def merge_constexprs(group: int, splits_pad: int, head_dim_pad: int, cfg: dict, fused: bool) -> tuple[int, int]:
    """The kernel's MERGE_HEADS and MERGE_HALF for a launch: heads a round of the fused merge, and of
    the merge of half the splits where the config asks for HALF_MERGE (the kernel takes that path
    where it is more; else MERGE_HEADS, and the kernel compiles as without the option). 1, 1 unfused."""
    if not fused:
        return 1, 1
    merge = merge_heads(group, splits_pad, head_dim_pad, cfg["num_warps"])
    return merge, merge_heads(group, splits_pad // 2, head_dim_pad, cfg["num_warps"]) if cfg.get("HALF_MERGE") else merge


def choose_config(num_seqs: int, num_kv_heads: int, group: int, max_ctx: int, sm_count: int,
                  head_dim: int = 64, kv_bytes: int = 2) -> dict:
    """Tile / warps / stages / split count, from shapes only (never from tensor values). kv_bytes:
    the cache's element size (1 for an fp8 cache)."""
    if _INTERPRET:  # one fixed small config; programs run one by one, so few splits
        return {"BLOCK_N": 32, "num_warps": 1, "num_stages": 1, "PREFETCH": 2,
                "num_splits": split_count(num_seqs * num_kv_heads, max_ctx, 32, 4 * sm_count, min_tiles=1)}
    if kv_bytes == 1:
        return choose_fp8_config(num_seqs, num_kv_heads, group, max_ctx, sm_count, head_dim)
    return choose_gpu_config(num_seqs, num_kv_heads, group, max_ctx, sm_count, head_dim)


# An fp8 cache (kernels/fp8.py: the tensor-core dots run in fp16). FP8_TILES[(lane-wise path,
# padded head_dim)] = (BLOCK_N, num_warps, num_stages, PREFETCH). Picked from the first H100 sweep,
# whose dots were in bf16 (benchmarks/results/fp8_kv_bf16-dots_h100.json): on the GQA path 5 stages
# won at every shape, 64- and 128-key tiles within 8% of each other, and more splits than the
# 16-bit merge cap (32 against 16 for one 64k-token sequence: each program moves half the bytes);
# on the lane-wise path 32-key tiles of 8 warps were within 5% of the best at both shapes. Not yet
# swept with fp16 dots.
FP8_TILES = {(True, 64): (32, 8, 1, 0), (True, 128): (32, 8, 1, 0), (False, 64): (64, 4, 5, 0),
             (False, 128): (64, 4, 5, 0)}
FP8_SPLIT_CAP = 32
# The GQA path's fp8 tiles take Triton's own cast. Variants that cast V, or K and V, through an
# inline cvt (staged in fp16 for the dots) were measured on an H100 on 2026-11-27 and removed
# (benchmarks/results/fp8_kv_variants_h100.json): V alone within 2% of it at 11 of 21 shapes, up to
# 18% slower at 9, 6% faster at 1 (the engine's fused launch: 8, 9 and 4, by up to 16%), K and V up
# to 32% slower, and other output bits at 14 and 16 of the 16 GQA shapes (another accumulation layout).
# Launch config key NEW_KV_TAIL (with the fused K/V write; on unless a config says False): the key
# loop runs over the cached tokens [0, context_len - 1) alone, as the launch without the write does,
# and the last split adds this step's token from registers after it (one online-softmax update); the
# store of its K/V is unchanged. Off, the launch where()s the token into the tile it falls in, which
# Triton compiles by staging both K and V tiles through shared memory every tile. Compiled for sm_90
# (decode_ir.py --new-kv --tail), head_dim 128, 16 bits, the tables' 5- and 3-stage configs: 505 and
# 451 PTX instructions a tile (the launch without the write's counts) instead of 799 and 749, 142 and
# 128 registers instead of 190 and 182 (3 and 4 CTAs an SM instead of 2), triton 3.6; 3.9: 428 and
# 393 instead of 738 and 699, 151 and 149 registers instead of 182 and 168. Outputs differ in fp32
# summation order only. Measured on an H100 (bench_fp8_kv.py --fused-write --new-kv-tail,
# benchmarks/results/fp8_kv_variants_h100.json), every decode shape's fused launch faster or within 1%
# with it: 16-bit 61-91% of copy bandwidth -> 79-98% where the K/V are >= 256 MB (one 64k-token
# sequence at 32/8 heads x 128: 68% -> 87%, the plain launch's 87%), fp8 43-63% -> 60-76%.

# Launch config key HALF_MERGE: where the fused merge of half the splits takes more query heads a
# round than the whole tile's (32 splits of a group of 4 at head 128), a context that half the
# splits cover in at most 2 tiles each takes half of them and that merge; a longer one spreads over
# all of them, and the merge reads only the splits that hold tiles. choose_gpu_config picks it at
# HALF_MERGE_SPLITS (twice the one-round cap) where the half tile's merge takes the whole group in
# one round and the grid stays small (`wide_splits`: 2 programs an SM at head 128, 1 at head 64).
# Measured on an H200 (bench_decode_latency, 2026-11-28; benchmarks/results/decode_latency_h200.json),
# 32 layers of the engine's fused-write launch, microseconds a launch against the 16 splits of before:
# Llama-3.1-8B (32/8 heads x 128) 7.42 / 9.38 / 18.62 / 41.15 against 7.49 / 9.57 / 17.57 / 49.46 at
# 512 / 2k / 8k / 32k tokens; its TP=2 rank (16/4) 7.07 / 8.58 / 15.36 / 31.42 against 7.20 / 8.83 /
# 16.77 / 48.35; Qwen2.5-0.5B (14/2 x 64) 5.38 / 7.47 / 11.20 / 25.82 against 5.31 / 7.14 / 14.21 /
# 42.30. Not picked: its batch 4 (5.66 / 8.61 / 13.12 / 30.82 against 5.41 / 7.36 / 14.50 / 42.99),
# a group of 8 at head 128 (Llama-3.1-70B's TP=4 rank, 16/2: its half tile merges in 2 rounds; 8.13 /
# 9.70 / 22.42 / 38.11 against 7.97 / 9.47 / 17.47 / 49.25), and larger grids (Llama-3.1-8B at batch 4:
# 12.9-49.4 against 9.2-40.4 at 512-8k tokens). Not measured on an H100 (132 SMs too).
# Off, the launches compile to the PTX they did before it existed (both tritons, 64 configs: head
# 64 and 128, 3 and 5 stages, 1 to 32 splits, fp8 and 16 bits, with and without the fused write).
HALF_MERGE_SPLITS = 32


def half_merge_splits(group: int, head_dim: int) -> int | None:
    """The split count at which choose_gpu_config may pick HALF_MERGE for this group and head size
    (a 16-bit cache on a GPU), or None where it never does: what the warm-up compiles it at."""
    if _INTERPRET or group == 1:
        return None
    d_pad = max(16, triton.next_power_of_2(head_dim))
    return HALF_MERGE_SPLITS if 2 * merge_split_cap(group, d_pad) == HALF_MERGE_SPLITS else None


def wide_splits(pairs: int, group: int, head_dim: int, max_ctx: int, block_n: int, programs: int) -> int | None:
    """HALF_MERGE_SPLITS where choose_gpu_config takes them with HALF_MERGE (see above): the group
    qualifies, the grid holds at most `programs` programs, and the block table's width gives each
    split at least 4 tiles (split_count's rule); else None."""
    wide = half_merge_splits(group, head_dim)
    if wide is None or pairs * wide > programs:
        return None
    return wide if split_count(pairs, max_ctx, block_n, programs) >= wide else None


def choose_fp8_config(num_seqs: int, num_kv_heads: int, group: int, max_ctx: int, sm_count: int,
                      head_dim: int = 64) -> dict:
    """The config on a GPU for an fp8 cache (choose_config with kv_bytes 1)."""
    pairs = num_seqs * num_kv_heads
    d_pad = min(max(64, triton.next_power_of_2(head_dim)), 128)
    block_n, warps, stages, prefetch = FP8_TILES[group == 1, d_pad]
    cfg = {"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages, "PREFETCH": prefetch}
    if group == 1:
        if max_ctx <= 128 and pairs <= 4 * sm_count:
            cfg["BLOCK_N"] = max(32, triton.next_power_of_2(max_ctx))
        cfg["num_splits"] = split_count(pairs, max_ctx, cfg["BLOCK_N"], 6 * sm_count)
        return cfg
    cfg["num_splits"] = min(FP8_SPLIT_CAP, split_count(pairs, max_ctx, block_n, 4 * sm_count))
    return cfg


def choose_gpu_config(num_seqs: int, num_kv_heads: int, group: int, max_ctx: int, sm_count: int,
                      head_dim: int = 64) -> dict:
    """The config on a GPU (choose_config outside the interpreter) for a 16-bit cache. Tuned on an
    H100, Triton 3.6."""
    pairs = num_seqs * num_kv_heads
    if group == 1:
        # The lane-wise path with 32-token tiles and K/V loaded one tile ahead was within noise of
        # the best config at every large shape. It takes 64-72 registers a thread (Triton 3.6);
        # counting 6 programs of 4 warps per SM keeps every split program in one wave.
        cfg = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 1, "PREFETCH": 2}
        if max_ctx <= 128 and pairs <= 4 * sm_count:
            # few short sequences: latency-bound, so one tile per program (fewest round trips)
            cfg["BLOCK_N"] = max(32, triton.next_power_of_2(max_ctx))
        cfg["num_splits"] = split_count(pairs, max_ctx, cfg["BLOCK_N"], 6 * sm_count)
        return cfg
    # GQA: the tensor-core path, its loads pipelined by Triton with cp.async. num_stages 3 gives
    # K/V one shared-memory buffer (the next tile's loads start after this tile's math); 5 gives
    # two, the next tile in flight during the math: the block-table load that K/V addresses come
    # from takes stages of its own. Two buffers cost occupancy, so they pay only on small grids.
    # Splits stop where the fused merge would take a second round (each round a dependent load
    # at the kernel's tail, ~2 us), 16 at least: past that, fewer deeper-pipelined programs were
    # faster (one sequence of 64K tokens, 32/8 heads x 128: 110 us at 16 splits, 115 at 49; H100).
    # Except twice that with HALF_MERGE where a small grid leaves SMs idle (wide_splits, above).
    d_pad = max(16, triton.next_power_of_2(head_dim))
    cap = max(16, merge_split_cap(group, d_pad))
    if d_pad > 64:
        # BLOCK_N 64: 128 registers with 3 stages (4 programs per SM), ~140 and 72 KB of shared
        # memory with 5 (3 per SM). Splits fill 3 per SM, measured ~1% faster than 4.
        block_n, wide_grid, fill = 64, 2 * sm_count, 3 * sm_count
        deep = lambda splits: pairs * splits < 2 * sm_count  # noqa: E731
    else:
        # head_dim <= 64, BLOCK_N 32: 64-80 registers and 20 KB with 5 stages (~7 programs per SM),
        # fewer with 3 (8 per SM): two buffers pay while the grid fits one wave.
        # (HALF_MERGE's grid: one program an SM here; at 2, Qwen2.5-0.5B at batch 4, it lost 0.3-1.4 us
        # at 512-2k tokens on an H200)
        block_n, wide_grid, fill = 32, sm_count, 4 * sm_count
        deep = lambda splits: pairs * splits <= 6 * sm_count  # noqa: E731
    splits = wide_splits(pairs, group, head_dim, max_ctx, block_n, wide_grid) or min(
        cap, split_count(pairs, max_ctx, block_n, fill))
    cfg = {"BLOCK_N": block_n, "num_warps": 4, "num_stages": 5 if deep(splits) else 3, "PREFETCH": 0,
           "num_splits": splits}
    return cfg | {"HALF_MERGE": True} if splits > cap else cfg


def stage_variants(group: int) -> tuple[int, ...]:
    """Every num_stages the config can pick for this group size (with either cache element size),
    whatever the batch: what a warm-up must compile so that no batch shape compiles a variant
    mid-serving."""
    if _INTERPRET:
        return (1,)
    return (1,) if group == 1 else (3, 5)


def merge_split_cap(group: int, head_dim_pad: int, num_warps: int = 4) -> int:
    """The most splits (a power of two) whose fused merge takes one round for the whole group."""
    fit = max(1, MERGE_REGS * 32 * num_warps // (triton.next_power_of_2(group) * head_dim_pad))
    return 1 << (fit.bit_length() - 1)
