"""eager and sdpa: pages gathered into contiguous K/V, then plain PyTorch attention.

- `eager`: the standard attention FlashAttention replaced: QKᵀ, mask, softmax, ·V with the scores
  materialised. The baseline the load test measures.
- `sdpa`: torch's scaled_dot_product_attention on gathered pages, a strong peer.

The decode path uses only tensor ops whose shapes depend on the batch shape, never on values, so it
can be captured in a CUDA graph like ours; the prefill path loops over chunks on the host, so
prefill steps of these backends run eagerly.

An fp8 cache (kvcache/fp8.py) is written through kernels.reference.fp8_quantize_ref and its pages
dequantized as they are gathered, into q's dtype: the same cache bytes as the Triton kernels'.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from kernels.reference import fp8_dequantize_ref, fp8_quantize_ref, rope_ref
from kvcache import cache_scales
from kvcache.cache import scratch_slot
from models.attention.base import AttentionMetadata, Rope, StepRows, base_metadata


def _write_kv_torch(k, v, k_cache, v_cache, slot_mapping) -> None:
    # Padding slots go to the scratch block instead of being filtered out (no dynamic shapes).
    slots = torch.where(slot_mapping < 0, scratch_slot(k_cache), slot_mapping).long()
    for x, cache, scale in zip((k, v), (k_cache, v_cache), cache_scales(k_cache, v_cache)):
        if scale is None:
            cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, x.to(cache.dtype))
        else:  # as bytes: torch has no fp8 index_copy on the CPU
            stored = fp8_quantize_ref(x, scale, cache.dtype)
            cache.view(torch.uint8).view(-1, *cache.shape[2:]).index_copy_(0, slots, stored.view(torch.uint8))
            # x becomes what the cache holds, as the Triton kernels' write leaves it (kernels/kv_write.py)
            x.copy_(fp8_dequantize_ref(stored, scale).to(x.dtype))


def _gather_pages(cache: torch.Tensor, block_tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[n, max_blocks] page tables -> contiguous [n, max_blocks * block_size, kv_heads, d] in `dtype`
    (an fp8 cache dequantized with its scales)."""
    n, max_blocks = block_tables.shape
    pages = cache[block_tables.long()].reshape(n, max_blocks * cache.shape[1], *cache.shape[2:])
    scale = getattr(cache, "scale", None)
    return pages if scale is None else fp8_dequantize_ref(pages, scale).to(dtype)


def _expand_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    return x.repeat_interleave(num_heads // x.shape[-2], dim=-2) if x.shape[-2] != num_heads else x


class TorchAttention:
    """eager and sdpa: pages gathered, then plain PyTorch attention."""

    prefill_graphs = False

    def __init__(self, kind: str) -> None:
        assert kind in ("eager", "sdpa")
        self.name = kind

    def prefill_arrays(self, chunk_lens, chunk_prefix, device, cache=None) -> dict[str, np.ndarray]:
        return {}

    def copies_prefixes(self, device) -> bool:
        return False

    def metadata(self, rows: StepRows) -> AttentionMetadata:
        meta = base_metadata(rows)
        if rows.num_prefill_tokens:
            meta.cu_seqlens_host = [0, *np.cumsum(rows.chunk_lens).tolist()]
            meta.prefix_lens_host = rows.chunk_prefix
        return meta

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                rope: Rope | None = None) -> torch.Tensor:
        if rope is not None:  # torch ops, as transformers rotates (kernels/rope.py is bit-identical)
            q, k = rope_ref(q, rope.positions, rope.cos, rope.sin), rope_ref(k, rope.positions, rope.cos, rope.sin)
        _write_kv_torch(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        p = meta.num_prefill_tokens
        if p:
            out[:p] = self._prefill(q[:p], k[:p], v[:p], k_cache, v_cache, meta, scale)
        if q.shape[0] > p:
            out[p:] = self._decode(q[p:], k_cache, v_cache, meta, scale)
        return out

    def _prefill(self, q, k, v, k_cache, v_cache, meta, scale):
        out = torch.empty_like(q)
        cu, prefix = meta.cu_seqlens_host, meta.prefix_lens_host
        for i in range(len(cu) - 1):
            lo, hi = cu[i], cu[i + 1]
            ks, vs, plen = k[lo:hi], v[lo:hi], prefix[i]
            if plen:
                bt = meta.prefill_block_tables[i : i + 1, : -(-plen // k_cache.shape[1])]
                ks = torch.cat([_gather_pages(k_cache, bt, q.dtype)[0, :plen], ks])
                vs = torch.cat([_gather_pages(v_cache, bt, q.dtype)[0, :plen], vs])
            n, m = hi - lo, ks.shape[0]
            mask = torch.ones(n, m, dtype=torch.bool, device=q.device).tril(diagonal=plen)
            out[lo:hi] = self._attend(q[lo:hi].unsqueeze(0), ks.unsqueeze(0), vs.unsqueeze(0), mask[None], not plen, scale)[0]
        return out

    def _decode(self, q, k_cache, v_cache, meta, scale):
        ks = _gather_pages(k_cache, meta.decode_block_tables, q.dtype)
        vs = _gather_pages(v_cache, meta.decode_block_tables, q.dtype)
        valid = torch.arange(ks.shape[1], device=q.device)[None, :] < meta.context_lens[:, None]  # [n, L]
        # Unwritten slots may hold NaN, and softmax weight 0 times NaN is still NaN.
        vs = torch.where(valid[:, :, None, None], vs, 0)
        ks = torch.where(valid[:, :, None, None], ks, 0)
        return self._attend(q.unsqueeze(1), ks, vs, valid[:, None, :], False, scale)[:, 0]

    def _attend(self, q, k, v, mask, causal, scale):
        """q [b, n, h, d]; k, v [b, m, kvh, d]; mask [b or 1, n, m] bool (True = attend)."""
        h = q.shape[2]
        q, k, v = (x.transpose(1, 2) for x in (q, _expand_kv(k, h), _expand_kv(v, h)))
        if self.name == "sdpa":
            if causal:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
            else:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), scale=scale)
        else:
            s = torch.matmul(q, k.transpose(-1, -2)) * scale
            s = s.masked_fill(~mask.unsqueeze(1), float("-inf"))
            o = torch.matmul(torch.softmax(s.float(), dim=-1).to(v.dtype), v)
        return o.transpose(1, 2)

    def warmup(self, kv_caches, num_heads: int, dtype: torch.dtype | None = None) -> None:
        pass  # nothing compiles per shape

    def graph_tiles(self, num_tokens: int, max_chunks: int, device: torch.device, max_chunk_len=None) -> int:
        return 0

    def fill_graph_tiles(self, num_tokens, lens, prefix, tile_seq, tile_start) -> None:
        pass

    def graph_metadata(self, rows: StepRows, num_tokens: int, tiles, max_chunk_len=None) -> AttentionMetadata:
        raise NotImplementedError(f"{self.name} prefill reads chunk lengths on the host: it cannot be captured")
