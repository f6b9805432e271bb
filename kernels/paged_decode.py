"""Paged decode attention: one query token per sequence, K/V read through a block table.

Contract (semantics = ``kernels.reference.paged_decode_ref``):
  q             [num_seqs, num_heads, head_dim]           fp16 / bf16 (last dim contiguous)
  k_cache,
  v_cache       [num_blocks, block_size, num_kv_heads, head_dim], q's dtype or fp8 (float8_e4m3fn /
                float8_e5m2, with k_scale and v_scale, fp32 [num_kv_heads]: values are read as
                stored * scale, kernels/fp8.py) (last dim contiguous); block_size a power of two
                (8..256). Slots no sequence owns may hold NaN.
  block_tables  [num_seqs, max_blocks_per_seq] int32; token i of sequence s lives at
                block_tables[s, i // block_size], offset i % block_size.
  context_lens  [num_seqs] int32: tokens to attend to, this step's token included (>= 1; a 0 gives
                an all-zero output row, so padded rows of a captured graph stay finite).
  out           [num_seqs, num_heads, head_dim] in q's dtype (allocated when not given).
  k_new, v_new, slot_mapping (optional, together; the KV write fused in): k_new, v_new
                [num_seqs, num_kv_heads, head_dim] (last dim contiguous) are this step's K/V, the
                token at position context_len - 1 of each sequence, and slot_mapping [num_seqs]
                int32/int64 its flat cache slot. That token's K/V are taken from k_new/v_new
                (whatever its cache slot holds is ignored), and split 0 of each (sequence, kv
                head) writes them into the cache at the slot (slot < 0: not written): kv_write
                and attention in one launch (a decode step at small batch is bound by launches).
                An fp8 cache stores them quantized (kernels/fp8.py), and the attention uses the
                quantized values, as it would have read them back from the cache.
                How the kernel attends to that token is a launch-config choice (decode_config
                NEW_KV_TAIL): after the loop over the cached tokens, by the last split (default),
                or inside its tile; the same result up to fp32 summation order, the same bytes stored.
  num_kv_heads divides num_heads; query head h reads kv head h // (num_heads // num_kv_heads).

What it masks: every token index >= context_len. K/V loads there use other=0 *and* their scores are
set to -inf, because unwritten cache may hold NaN and 0 * NaN = NaN. Block-table entries past a
sequence's last block are never loaded. Cache offsets are computed in int64.

Work split ("flash decoding"): grid = (num_seqs, num_kv_heads, num_splits). One program serves all
query heads of one kv head, so K/V are read from memory once per kv head. When there are too few
(sequence, kv head) pairs to fill the GPU, the context is cut into num_splits ranges; each program
writes a normalised partial output and its log-sum-exp (base 2), and the partials are merged by
log-sum-exp: by default inside the same launch, by the last split of each (sequence, kv head) to
finish (an arrival counter, reset by that program); FLASHPAGE_DECODE_MERGE=launch uses a second
kernel instead. num_splits is chosen from shapes only (no host sync; safe under CUDA-graph capture
while context_lens change between replays): each split's token range is computed in-kernel from the
actual context_len, and a split left with no tokens writes lse = -inf and a zero partial. (Launch
option HALF_MERGE, which decode_config picks for small grids: a short context takes half the
splits, whose fused merge then reads theirs alone, in fewer rounds; the same result up to fp32
summation order.)
With num_splits == 1 the one launch writes ``out`` directly.
The counters live in one int32 buffer per (device, stream); launches that share a buffer must not
run concurrently (e.g. one captured graph replayed on two streams at once).
Host side (kernels/decode_launch.py): after the first call for a given set of shapes/strides/dtypes,
later calls relaunch the compiled kernels directly (see ``_PLANS``), since Triton's dispatch can cost
more than the kernel.
"""

from __future__ import annotations

import torch
from triton import knobs

from kernels import decode_launch, pdl
from kernels.fp8 import check_scales, is_fp8
from kernels.decode_config import (MAX_SPLITS, _num_sms, choose_config,  # noqa: F401 (choose_config re-exported)
                                   half_merge_splits, stage_variants)
# This file: the contract and the public entry points. The Triton programs are in
# kernels/decode_kernels.py, the launch machinery in kernels/decode_launch.py (imports point
# paged_decode -> decode_launch -> decode_kernels). _launch and _PLANS stay importable from here
# (benchmarks/kernels/bench_decode.py uses them); _PLANS_OK is read as decode_launch._PLANS_OK, since
# _disable_plans rebinds it there.
from kernels.decode_launch import _INTERPRET, _PLANS, _Plan, _disable_plans, _launch, _relaunch

def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    _config: dict | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged K/V; with k_new, v_new and
    slot_mapping, this step's K/V written into the cache in the same launch. An fp8 cache takes its
    per-kv-head scales k_scale, v_scale. See the module docstring. ``_config`` overrides the
    tile/warps/stages config key by key (tuning and benchmarks only): a launch option it does not
    name (HALF_MERGE, NEW_KV_TAIL, FUSED_MERGE) stays as the tables chose it."""
    new_kv = None
    if k_new is not None or v_new is not None or slot_mapping is not None:
        new_kv = (k_new, v_new, slot_mapping)
        assert all(t is not None for t in new_kv), "k_new, v_new and slot_mapping come together"
        assert k_new.shape == v_new.shape == (q.shape[0], *k_cache.shape[2:]), "k_new, v_new: [num_seqs, kv_heads, d]"
        assert k_new.stride(2) == 1 and v_new.stride(2) == 1
        assert slot_mapping.shape == (q.shape[0],) and slot_mapping.dtype in (torch.int32, torch.int64)
    scales = None if k_scale is None and v_scale is None else (k_scale, v_scale)
    key = None
    if not _INTERPRET and q.is_cuda:
        ptrs = q.data_ptr() | k_cache.data_ptr() | v_cache.data_ptr() | block_tables.data_ptr() | context_lens.data_ptr()
        if out is not None:
            ptrs |= out.data_ptr()
        if new_kv is not None:
            ptrs |= k_new.data_ptr() | v_new.data_ptr() | slot_mapping.data_ptr()
        if scales is not None:  # kvcache keeps each layer's scales 16-byte aligned
            ptrs |= k_scale.data_ptr() | v_scale.data_ptr()
        hook = knobs.runtime.launch_enter_hook  # a HookChain (empty unless a profiler registered one)
        if ptrs & 15 == 0 and (hook is None or not getattr(hook, "calls", True)):
            key = (q.shape, q.stride(), q.dtype, q.device, k_cache.shape, k_cache.stride(), k_cache.dtype,
                   v_cache.shape, v_cache.stride(), v_cache.dtype, block_tables.shape, block_tables.stride(),
                   block_tables.dtype, context_lens.shape, context_lens.dtype, num_splits,
                   None if out is None else (out.shape, out.stride(), out.dtype),
                   None if new_kv is None else (k_new.stride(), k_new.dtype, v_new.stride(), v_new.dtype,
                                                slot_mapping.dtype),
                   None if _config is None else tuple(sorted(_config.items())), pdl.active(q.device))
            plan = _PLANS.get(key) if decode_launch._PLANS_OK else None
            if plan is not None:
                try:
                    return _relaunch(plan, q, k_cache, v_cache, block_tables, context_lens, new_kv, scale, out,
                                     scales)
                except (TypeError, AttributeError):  # a Triton whose launcher differs: dispatch normally
                    _disable_plans()

    num_seqs, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, kd = k_cache.shape
    assert kd == head_dim and v_cache.shape == k_cache.shape, "k/v cache shape mismatch"
    assert num_heads % num_kv_heads == 0, "num_kv_heads must divide num_heads"
    assert block_size & (block_size - 1) == 0, "block_size must be a power of two"
    assert k_cache.dtype == v_cache.dtype, "k and v caches must share a dtype"
    assert check_scales(k_cache, k_scale, v_scale) or k_cache.dtype == q.dtype, "a 16-bit cache is q's dtype"
    scales = (k_scale, v_scale) if is_fp8(k_cache.dtype) else None
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    assert block_tables.dtype == torch.int32 and context_lens.dtype == torch.int32
    if out is None:
        out = torch.empty((num_seqs, num_heads, head_dim), device=q.device, dtype=q.dtype)
    else:
        assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1
    if num_seqs == 0:
        return out
    max_ctx = block_tables.shape[1] * block_size
    cfg = choose_config(num_seqs, num_kv_heads, num_heads // num_kv_heads, max_ctx, _num_sms(q.device), head_dim,
                        k_cache.element_size())
    if _config is not None:
        cfg.update(_config)
    if num_splits is not None:
        cfg["num_splits"] = max(1, min(int(num_splits), 1024))
    plan = None if key is None or not decode_launch._PLANS_OK else _Plan()
    _launch(q, k_cache, v_cache, block_tables, context_lens, new_kv, scale, out, cfg, plan, scales)
    if plan is not None and hasattr(plan.dec, "packed_metadata") and len(_PLANS) < 4096:
        _PLANS[key] = plan
    return out


def warmup_split_variants(k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, dtype: torch.dtype,
                          k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Compile the decode kernel for every split padding a batch can select (2, 4, .. MAX_SPLITS),
    with and without the fused KV write, at every pipelining depth the config picks for this group
    size (decode_config.stage_variants), so that a server never compiles one mid-serving. Reads the
    cache; writes nothing to it. `dtype`: the queries' (the model's); an fp8 cache's scales."""
    block_size = k_cache.shape[1]
    sc = dict(k_scale=k_scale, v_scale=v_scale)
    width = max(1, min(k_cache.shape[0], 4 * MAX_SPLITS * 32 // block_size))
    q = torch.zeros(1, num_heads, k_cache.shape[3], dtype=dtype, device=k_cache.device)
    tables = torch.arange(width, dtype=torch.int32, device=k_cache.device)[None]
    ctx = torch.full((1,), width * block_size, dtype=torch.int32, device=k_cache.device)
    kv = torch.zeros(1, *k_cache.shape[2:], dtype=dtype, device=k_cache.device)
    slot = torch.full((1,), -1, dtype=torch.int32, device=k_cache.device)  # nothing is written
    group = num_heads // k_cache.shape[2]
    wide = None if is_fp8(k_cache.dtype) else half_merge_splits(group, k_cache.shape[3])  # (16-bit tables only)
    for stages in stage_variants(group):
        splits = 2
        while splits <= MAX_SPLITS:
            for half in (False, True) if splits == wide else (False,):
                cfg = {"num_stages": stages, "HALF_MERGE": half}
                paged_decode(q, k_cache, v_cache, tables, ctx, 1.0, num_splits=splits, _config=cfg, **sc)
                paged_decode(q, k_cache, v_cache, tables, ctx, 1.0, num_splits=splits, k_new=kv, v_new=kv,
                             slot_mapping=slot, _config=cfg, **sc)
            splits *= 2

