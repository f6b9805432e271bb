"""Which tile, warps, stages and split count the paged decode kernel (kernels/paged_decode.py)
launches with, from shapes only: never from tensor values, so that a launch can be captured in a
CUDA graph while context lengths change between replays. Tuned on an H100
(benchmarks/results/decode_sweep_h100.txt).
"""

from __future__ import annotations

import functools
import os

import torch
import triton

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
MAX_SPLITS = 64  # also bounds the fused merge's [splits, d] tile (registers)


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


def choose_config(num_seqs: int, num_kv_heads: int, group: int, max_ctx: int, sm_count: int) -> dict:
    """Tile / warps / stages / split count, from shapes only (never from tensor values)."""
    pairs = num_seqs * num_kv_heads
    if _INTERPRET:  # one fixed small config; programs run one by one, so few splits
        return {"BLOCK_N": 32, "num_warps": 1, "num_stages": 1, "PREFETCH": 2,
                "num_splits": split_count(pairs, max_ctx, 32, 4 * sm_count, min_tiles=1)}
    if group == 1:
        # Tuned on H100 (benchmarks/results/decode_sweep_h100.txt): the lane-wise path with 32-token
        # tiles and K/V loaded one tile ahead was within noise of the best config at every large
        # shape. It takes 64-72 registers a thread (Triton 3.6); counting 6 programs of 4 warps
        # per SM keeps every split program in one wave (the sweep's best split counts).
        cfg = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 1, "PREFETCH": 2}
        per_sm = 6
        if max_ctx <= 128 and pairs <= 4 * sm_count:
            # few short sequences: latency-bound, so one tile per program (fewest round trips)
            cfg["BLOCK_N"] = max(32, triton.next_power_of_2(max_ctx))
    else:  # tensor-core path; Triton pipelines its loads with cp.async (3 stages of shared memory)
        cfg = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "PREFETCH": 0}
        per_sm = 4
    cfg["num_splits"] = split_count(pairs, max_ctx, cfg["BLOCK_N"], per_sm * sm_count)
    return cfg
