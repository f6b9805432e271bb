"""Our kernels: K/V write (kernels/kv_write.py, or kernels/rope.py with rotary positions), flash
prefill with a paged prefix (kernels/flash_prefill.py), paged decode (kernels/paged_decode.py).

Launches per layer call: in a step of decodes only, the decode kernel writes this step's K/V itself
(after the query/key rotation, if any: 1 or 2 launches); in a step with prefill chunks one launch
rotates q and k and writes K/V (rope_kv_write; kv_write without rotary positions), then the prefill
kernel, then the decode kernel for the step's decode rows. The flash prefill kernel walks a tile map
(which query tile of which chunk each program takes) built on the host each step: in an eager
step it lists exactly the chunks' tiles (prefill_arrays), so no program idles; in a captured
prefill graph, whose grid never changes, it fills a fixed number of slots, the rest idle.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.flash_prefill import block_m, flash_prefill, tile_map
from kernels.kv_write import kv_write
from kernels.paged_decode import paged_decode, warmup_split_variants
from kernels.rope import rope_kv_write
from models.attention.base import AttentionMetadata, Rope, StepRows, base_metadata


class TritonAttention:
    name = "triton"
    prefill_graphs = True

    def __init__(self, head_dim: int, group: int = 1) -> None:
        self.head_dim, self.group = head_dim, group
        self._block_m: dict[int, int] = {}  # captured token count -> flash_prefill's BLOCK_M for it

    def prefill_arrays(self, chunk_lens: list[int], chunk_prefix: list[int], device: torch.device
                       ) -> dict[str, np.ndarray]:
        """The flash prefill kernel's tile map for these chunks, exactly as many tiles as they
        need: a grid over (longest chunk) x chunks would launch idle programs for the short ones."""
        bm = block_m(self.head_dim, max(chunk_lens), device, self.group)
        tile_seq, tile_start = tile_map(chunk_lens, chunk_prefix, bm)
        return {"tile_seq": tile_seq, "tile_start": tile_start}

    def metadata(self, rows: StepRows) -> AttentionMetadata:
        meta = base_metadata(rows)
        if rows.num_prefill_tokens:
            meta.max_seqlen = max(rows.chunk_lens)
            meta.has_prefix = any(rows.chunk_prefix)
            if "tile_seq" in rows.extra:
                meta.prefill_tiles = rows.extra["tile_seq"], rows.extra["tile_start"]
        return meta

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                rope: Rope | None = None) -> torch.Tensor:
        out = torch.empty_like(q)
        p = meta.num_prefill_tokens
        if not p:  # decodes only: the decode kernel writes this step's K/V itself
            if rope is not None:
                rope_kv_write(q, k, None, rope.positions, rope.cos, rope.sin, None, None, None, write_cache=False)
            paged_decode(q, k_cache, v_cache, meta.decode_block_tables, meta.context_lens, scale, out=out,
                         k_new=k, v_new=v, slot_mapping=meta.slot_mapping)
            return out
        if rope is not None:  # rotation and the K/V write in one launch
            rope_kv_write(q, k, v, rope.positions, rope.cos, rope.sin, k_cache, v_cache, meta.slot_mapping)
        else:
            kv_write(k, v, k_cache, v_cache, meta.slot_mapping)
        cache = (k_cache, v_cache) if meta.has_prefix else (None, None)
        flash_prefill(q[:p], k[:p], v[:p], meta.cu_seqlens, meta.max_seqlen, scale, k_cache=cache[0],
                      v_cache=cache[1], block_tables=meta.prefill_block_tables, prefix_lens=meta.prefix_lens,
                      out=out[:p], tiles=meta.prefill_tiles)
        if q.shape[0] > p:
            paged_decode(q[p:], k_cache, v_cache, meta.decode_block_tables, meta.context_lens, scale, out=out[p:])
        return out

    def warmup(self, kv_caches, num_heads: int) -> None:
        """Compile every split variant of the decode kernel (kernels/paged_decode.py)."""
        k_cache, v_cache = kv_caches[0]
        warmup_split_variants(k_cache, v_cache, num_heads, k_cache.dtype)

    # -- captured prefill steps -----------------------------------------------------------------
    def graph_tiles(self, num_tokens: int, max_chunks: int, device: torch.device) -> int:
        bm = self._block_m[num_tokens] = block_m(self.head_dim, num_tokens, device, self.group)
        # sum(ceil(len / bm)) over <= max_chunks chunks of num_tokens tokens <= num_tokens / bm + max_chunks
        return -(-num_tokens // bm) + max_chunks

    def fill_graph_tiles(self, num_tokens: int, lens: list[int], prefix: list[int], tile_seq: np.ndarray,
                         tile_start: np.ndarray) -> None:
        tile_seq[:], tile_start[:] = tile_map(lens, prefix, self._block_m[num_tokens], len(tile_seq))

    def graph_metadata(self, rows: StepRows, num_tokens: int, tiles) -> AttentionMetadata:
        meta = base_metadata(rows)
        meta.max_seqlen, meta.has_prefix, meta.prefill_tiles = num_tokens, True, tiles
        return meta
