"""Host-side launch path of the paged decode kernel (kernels/paged_decode.py): the first call for a
given key (shapes, strides, dtypes, device, split count, config) goes through Triton's dispatch,
compiling on first use, and records a plan; later calls relaunch the compiled kernels directly from
that cached plan. Why: at small batch a decode step is a few microseconds of GPU work, and Triton's
per-launch dispatch (binding and specializing ~30 arguments) can cost more host time than that.

Imports point one way: kernels/paged_decode.py (contract, entry points) -> this module -> the
Triton programs in kernels/decode_kernels.py.
"""

from __future__ import annotations

import os

import torch
import triton
from triton.runtime import driver

from kernels import pdl
from kernels.decode_config import MAX_SPLITS, merge_constexprs
from kernels.decode_kernels import _decode_kernel, _merge_kernel
from kernels.scratch import scratch

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_LOG2E = 1.4426950408889634


class _Plan:
    """What a later call with the same key needs to relaunch the compiled kernels directly."""

    __slots__ = ("stream", "dec", "grid", "tail", "split", "mer", "m_grid", "m_tail", "lse_off", "scratch", "pairs")

    def __init__(self) -> None:
        self.stream = driver.active.get_current_stream
        self.mer = None


def _counters(device: torch.device, stream: int, n: int) -> torch.Tensor:
    """Split-arrival counters for the fused merge, one int32 per (sequence, kv head), zero between
    launches (the last split resets its counter). One buffer per (device, stream), so launches on
    different streams never share counters; launches on one stream are ordered."""
    return scratch(("decode-counters", device, stream), n, torch.int32, device, min_size=1 << 16, zeroed=True)


# Merge the split partials inside the decode kernel (last split to finish) instead of a second
# launch; FLASHPAGE_DECODE_MERGE=launch selects the separate merge kernel.
_FUSED_MERGE = os.environ.get("FLASHPAGE_DECODE_MERGE", "fused") != "launch"


def _new_kv_args(new_kv, q, context_lens) -> tuple:
    """(k_new, v_new, slot_mapping), or placeholders (never read) without the fused KV write."""
    return new_kv if new_kv is not None else (q, q, context_lens)


def _scale_args(scales, context_lens) -> tuple:
    """(k_scale, v_scale) of an fp8 cache, or placeholders (never read) for a 16-bit one."""
    return scales if scales is not None else (context_lens, context_lens)


def _launch(q, k_cache, v_cache, block_tables, context_lens, new_kv, scale, out, cfg: dict, plan: _Plan | None = None,
            scales=None):
    """Launch through Triton's normal dispatch (compiling on first use); fill ``plan`` if given."""
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    num_splits = int(cfg["num_splits"])
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    lanes = group == 1 and not cfg.get("DOT", False)
    group_pad = 1 if lanes else max(16, triton.next_power_of_2(group))
    split = num_splits > 1
    fused = split and num_splits <= MAX_SPLITS and cfg.get("FUSED_MERGE", _FUSED_MERGE)
    # A constexpr that follows the split count: servers compile every power of two up front
    # (see warmup_split_variants) so that no new batch shape compiles a variant mid-serving.
    splits_pad = max(2, triton.next_power_of_2(num_splits))
    rows = num_seqs * num_heads * num_splits
    po = plse = cnt = out  # placeholders where unused
    if split:
        # one scratch allocation: partial outputs [seqs, heads, splits, d] then lse [seqs, heads, splits]
        po = torch.empty(rows * (head_dim + 1), device=q.device, dtype=torch.float32)
        plse = po[rows * head_dim :]
    if fused:
        stream = 0 if _INTERPRET else driver.active.get_current_stream(q.device.index)
        cnt = _counters(q.device, stream, num_seqs * num_kv_heads)
    kn, vn, slots = _new_kv_args(new_kv, q, context_lens)
    merge, half = merge_constexprs(group, splits_pad, head_dim_pad, cfg, bool(fused))
    tail = (
        num_splits, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1), num_heads,
    )
    consts = dict(
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, GROUP=group, GROUP_PAD=group_pad,
        BLOCK_SIZE=block_size, BLOCK_N=cfg["BLOCK_N"], SPLIT=split,
        # (an fp8 cache's dots run in fp16: kernels/fp8.py)
        DOT_F32=_INTERPRET and q.dtype == torch.bfloat16 and scales is None, PREFETCH=int(cfg.get("PREFETCH", 0)),
        LANES=lanes,
        FUSED_MERGE=bool(fused), SPLITS_PAD=splits_pad, NEW_KV=new_kv is not None,
        MERGE_HEADS=merge, MERGE_HALF=half,
        KV_FP8=scales is not None,
        NEW_KV_TAIL=new_kv is not None and bool(cfg.get("NEW_KV_TAIL", True)),  # (decode_config: why)
        PDL=pdl.active(q.device),  # (last: the plan's constexprs follow the signature's order)
    )
    grid = (num_seqs, num_kv_heads, num_splits)
    dec = _decode_kernel[grid](q, k_cache, v_cache, block_tables, context_lens, kn, vn, slots, out, po, plse, cnt,
                               *_scale_args(scales, context_lens), scale * _LOG2E,
                               *tail, **consts, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if plan is not None:  # runtime args after the scale, then the constexprs, in signature order
        plan.dec, plan.grid, plan.tail, plan.split = dec, grid, tail + tuple(consts.values()), split
        plan.lse_off, plan.scratch, plan.pairs = rows * head_dim, rows * (head_dim + 1), num_seqs * num_kv_heads
    if split and not fused:
        m_grid = (num_seqs * num_heads,)
        m_tail = (num_splits, num_heads, out.stride(0), out.stride(1))
        m_consts = dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, SPLITS_PAD=splits_pad)
        mer = _merge_kernel[m_grid](po, plse, out, *m_tail, **m_consts, num_warps=1 if _INTERPRET else 2)
        if plan is not None:
            plan.mer, plan.m_grid, plan.m_tail = mer, (m_grid[0], 1, 1), m_tail + tuple(m_consts.values())
    return out


# Host time matters here: a decode step for a small batch is a few microseconds of GPU work, and
# Triton's per-launch dispatch (binding and specializing ~30 arguments) costs more than that on a
# slow host. So the first call for a key (shapes, strides, dtypes, device, split count) goes through
# Triton, and later calls relaunch the compiled kernels directly. The key fixes every argument that
# Triton specializes on, except pointer alignment: the fast path runs only when all pointers are
# 16-byte aligned, and a plan is only made from such a call.
_PLANS: dict = {}


def _fast(kernel, grid: tuple, stream: int, args: tuple) -> None:
    kernel.run(grid[0], grid[1], grid[2], stream, kernel.function, kernel.packed_metadata, None, None, None, *args)


_PLANS_OK = True


def _disable_plans() -> None:
    global _PLANS_OK
    _PLANS_OK = False


def _relaunch(plan: _Plan, q, k_cache, v_cache, block_tables, context_lens, new_kv, scale, out,
              scales=None) -> torch.Tensor:
    if out is None:
        out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    stream = plan.stream(q.device.index)
    head = (q, k_cache, v_cache, block_tables, context_lens, *_new_kv_args(new_kv, q, context_lens))
    ks, vs = _scale_args(scales, context_lens)
    if not plan.split:  # one launch writes out
        _fast(plan.dec, plan.grid, stream, head + (out, out, out, out, ks, vs, scale * _LOG2E) + plan.tail)
        return out
    po = torch.empty(plan.scratch, device=q.device, dtype=torch.float32)
    plse = po[plan.lse_off :]
    cnt = out if plan.mer is not None else _counters(q.device, stream, plan.pairs)
    _fast(plan.dec, plan.grid, stream, head + (out, po, plse, cnt, ks, vs, scale * _LOG2E) + plan.tail)
    if plan.mer is not None:  # separate merge launch
        _fast(plan.mer, plan.m_grid, stream, (po, plse, out) + plan.m_tail)
    return out
