"""Attention over the paged KV cache, behind one interface with three backends.

A batch is flat: its first `num_prefill_tokens` tokens belong to prefill chunks (packed, delimited by
`cu_seqlens`, each chunk continuing a sequence whose first `prefix_lens[i]` tokens are already in
the cache), the rest are decode tokens, one per sequence. Every backend first writes this step's
K/V into the cache at `slot_mapping`, then attends:

- `triton`: our kernels (kernels/flash_prefill.py, kernels/paged_decode.py, kernels/kv_write.py).
- `eager`: the standard attention FlashAttention replaced: QKᵀ, mask, softmax, ·V with the scores
  materialised; pages gathered into contiguous K/V first. The baseline the load test measures.
- `sdpa`: torch's scaled_dot_product_attention on gathered pages, a strong peer.

The decode path of `eager` and `sdpa` uses only tensor ops whose shapes depend on the batch shape,
never on values, so it can be captured in a CUDA graph like ours.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvcache.cache import scratch_slot

BACKENDS = ("triton", "eager", "sdpa")


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = padding (not written)
    num_prefill_tokens: int
    # prefill part
    cu_seqlens: torch.Tensor | None = None  # [num_prefills + 1] int32
    max_seqlen: int = 0
    prefix_lens: torch.Tensor | None = None  # [num_prefills] int32
    prefill_block_tables: torch.Tensor | None = None  # [num_prefills, max_blocks] int32
    has_prefix: bool = False
    cu_seqlens_host: list[int] | None = None
    prefix_lens_host: list[int] | None = None
    # (tile_seq, tile_start) int32: flash_prefill's tile map, set in captured prefill graphs
    # (server/cuda_graphs.py), whose grid cannot follow the batch. Only the triton backend.
    prefill_tiles: tuple[torch.Tensor, torch.Tensor] | None = None
    # decode part
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] int32
    context_lens: torch.Tensor | None = None  # [num_decodes] int32, this step's token included


def _write_kv_torch(k, v, k_cache, v_cache, slot_mapping) -> None:
    # Padding slots go to the scratch block instead of being filtered out (no dynamic shapes).
    slots = torch.where(slot_mapping < 0, scratch_slot(k_cache), slot_mapping).long()
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))


def _gather_pages(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[n, max_blocks] page tables -> contiguous [n, max_blocks * block_size, kv_heads, d]."""
    n, max_blocks = block_tables.shape
    return cache[block_tables.long()].reshape(n, max_blocks * cache.shape[1], *cache.shape[2:])


def _expand_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    return x.repeat_interleave(num_heads // x.shape[-2], dim=-2) if x.shape[-2] != num_heads else x


class TorchAttention:
    """eager and sdpa: pages gathered, then plain PyTorch attention."""

    def __init__(self, kind: str, scale: float) -> None:
        assert kind in ("eager", "sdpa")
        self.kind, self.scale = kind, scale

    def __call__(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        _write_kv_torch(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        p = meta.num_prefill_tokens
        if p:
            out[:p] = self._prefill(q[:p], k[:p], v[:p], k_cache, v_cache, meta)
        if q.shape[0] > p:
            out[p:] = self._decode(q[p:], k_cache, v_cache, meta)
        return out

    def _prefill(self, q, k, v, k_cache, v_cache, meta):
        out = torch.empty_like(q)
        cu, prefix = meta.cu_seqlens_host, meta.prefix_lens_host
        for i in range(len(cu) - 1):
            lo, hi = cu[i], cu[i + 1]
            ks, vs, plen = k[lo:hi], v[lo:hi], prefix[i]
            if plen:
                bt = meta.prefill_block_tables[i : i + 1, : -(-plen // k_cache.shape[1])]
                ks = torch.cat([_gather_pages(k_cache, bt)[0, :plen], ks])
                vs = torch.cat([_gather_pages(v_cache, bt)[0, :plen], vs])
            n, m = hi - lo, ks.shape[0]
            mask = torch.ones(n, m, dtype=torch.bool, device=q.device).tril(diagonal=plen)
            out[lo:hi] = self._attend(q[lo:hi].unsqueeze(0), ks.unsqueeze(0), vs.unsqueeze(0), mask[None], causal=not plen)[0]
        return out

    def _decode(self, q, k_cache, v_cache, meta):
        ks = _gather_pages(k_cache, meta.decode_block_tables)
        vs = _gather_pages(v_cache, meta.decode_block_tables)
        valid = torch.arange(ks.shape[1], device=q.device)[None, :] < meta.context_lens[:, None]  # [n, L]
        # Unwritten slots may hold NaN, and softmax weight 0 times NaN is still NaN.
        vs = torch.where(valid[:, :, None, None], vs, 0)
        ks = torch.where(valid[:, :, None, None], ks, 0)
        return self._attend(q.unsqueeze(1), ks, vs, valid[:, None, :], causal=False)[:, 0]

    def _attend(self, q, k, v, mask, causal):
        """q [b, n, h, d]; k, v [b, m, kvh, d]; mask [b or 1, n, m] bool (True = attend)."""
        h = q.shape[2]
        q, k, v = (x.transpose(1, 2) for x in (q, _expand_kv(k, h), _expand_kv(v, h)))
        if self.kind == "sdpa":
            if causal:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
            else:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), scale=self.scale)
        else:
            s = torch.matmul(q, k.transpose(-1, -2)) * self.scale
            s = s.masked_fill(~mask.unsqueeze(1), float("-inf"))
            o = torch.matmul(torch.softmax(s.float(), dim=-1).to(v.dtype), v)
        return o.transpose(1, 2)


class TritonAttention:
    """Our kernels: KV write, flash prefill (with paged prefix), paged decode."""

    prefill_graphs = True  # prefill steps can be captured (flash_prefill takes a tile map)

    def __init__(self, scale: float) -> None:
        from kernels.flash_prefill import flash_prefill
        from kernels.kv_write import kv_write
        from kernels.paged_decode import paged_decode

        self.scale = scale
        self._prefill, self._decode, self._write = flash_prefill, paged_decode, kv_write

    def warmup(self, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int) -> None:
        """Compile the kernel variants that batch shapes select (see kernels/paged_decode.py)."""
        from kernels.paged_decode import warmup_split_variants

        warmup_split_variants(k_cache, v_cache, num_heads, k_cache.dtype)

    def __call__(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        out = torch.empty_like(q)
        p = meta.num_prefill_tokens
        if not p:  # decodes only: the decode kernel writes this step's K/V itself (one launch fewer a layer)
            self._decode(q, k_cache, v_cache, meta.decode_block_tables, meta.context_lens, self.scale, out=out,
                         k_new=k, v_new=v, slot_mapping=meta.slot_mapping)
            return out
        self._write(k, v, k_cache, v_cache, meta.slot_mapping)
        if p:
            cache = (k_cache, v_cache) if meta.has_prefix else (None, None)
            self._prefill(
                q[:p], k[:p], v[:p], meta.cu_seqlens, meta.max_seqlen, self.scale,
                k_cache=cache[0], v_cache=cache[1], block_tables=meta.prefill_block_tables,
                prefix_lens=meta.prefix_lens, out=out[:p], tiles=meta.prefill_tiles,
            )
        if q.shape[0] > p:
            self._decode(q[p:], k_cache, v_cache, meta.decode_block_tables, meta.context_lens, self.scale, out=out[p:])
        return out


def make_attention(kind: str, scale: float):
    if kind == "triton":
        return TritonAttention(scale)
    if kind in ("eager", "sdpa"):
        return TorchAttention(kind, scale)
    raise ValueError(f"unknown attention backend {kind!r}; choose one of {', '.join(BACKENDS)}")
