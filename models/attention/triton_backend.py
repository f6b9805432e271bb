"""Our kernels: K/V write (kernels/kv_write.py, or kernels/rope.py with rotary positions), flash
prefill with a paged prefix (kernels/flash_prefill.py), paged decode (kernels/paged_decode.py).

Launches per layer call: in a step of decodes only, the decode kernel writes this step's K/V itself
(after the query/key rotation, if any: 1 or 2 launches); in a step with prefill chunks one launch
rotates q and k and writes K/V (rope_kv_write; kv_write without rotary positions), then the prefill
kernel (after two copies, K's and V's, of the prefix blocks where the step copies them: gather_plan),
then the decode kernel for the step's decode rows. The flash prefill kernel walks a tile map
(which query tile of which chunk each program takes) built on the host each step: in an eager
step it lists exactly the chunks' tiles (prefill_arrays), so no program idles; in a captured
prefill graph, whose grid never changes, it fills a fixed number of slots, the rest idle.

A step whose chunks are all short (TOKEN_ROWS_MAX tokens at most: speculative verifications, their
k + 1 tokens over a long cached prefix) attends through the paged decode kernel instead, each token
a decode row over its chunk's page table up to its own position (`token_rows`), after the K/V write:
the prefill kernel runs one program a (query tile, head) along the whole prefix: 22 us a layer for a
5-token chunk over 256-512 cached tokens on an H200 (Llama-3.1-8B shape), where the decode kernel,
split over the keys, took 10.5 us for its 5 rows (benchmarks/profiling/profile_spec.py).

Deterministic mode (``deterministic=True``, the server's --deterministic): every row, prompt chunk or
decode, goes through kernels/invariant_attention.py, which reads every key from the cache after
this step's K/V are written, so that a position's output does not depend on the batch, the chunking
or prefill versus decode. Decodes are chunks of one row at position context_len - 1, their keys
split over programs by the kernel's fixed segments (same bits, more parallelism); in a step of
decodes only the attention launch writes their K/V itself, as the default decode kernel does.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.flash_prefill import block_m, flash_prefill, gathered_prefix_ok, tile_map
from kernels.invariant_attention import invariant_attention, num_segments, positions_per_tile
from kernels.kv_write import kv_write
from kernels.paged_decode import paged_decode, warmup_split_variants
from kernels.rope import rope_kv_write
from kvcache import cache_scales
from models.attention.base import AttentionMetadata, Rope, StepRows, base_metadata


TOKEN_ROWS_MAX = 8  # the longest chunk a step may hold for its tokens to attend as decode rows
# A step copies its chunks' prefixes out of the cache, once per layer and back to back, where its
# chunks run at least this many queries per copied key: the prefill kernel then reads the copy in
# whole TMA tiles (flash_prefill's prefix_starts) instead of gathering every tile through the page
# table. The copy costs each key's bytes twice (read, write); the paged loop costs each (query,
# key) pair ~1/3 more than the copy's (H100, Llama-3.1-8B's attention: ~390 against ~580 TFLOP/s,
# benchmarks/kernels/bench_prefill_chunks.py), so the copy pays for itself from ~200 queries per
# key; 512 leaves a margin.
GATHER_MIN_ROWS = 512


def gather_plan(chunk_lens: list[int], chunk_prefix: list[int], block_size: int, max_blocks: int,
                min_rows: int = GATHER_MIN_ROWS) -> dict[str, np.ndarray]:
    """Which cache blocks a step copies, as int32 host arrays: gather_seq and gather_blk, the chunk
    and page-table column of each block, in chunk order; prefix_starts, the row of each chunk's
    first prefix token in the copy. {} (the paged loop) where no chunk has a prefix, the copy
    would pass max_blocks blocks, or the chunks run fewer than min_rows queries per copied key."""
    blocks = -(-np.asarray(chunk_prefix, dtype=np.int64) // block_size)
    copied = int(blocks.sum())
    work = int(np.dot(np.asarray(chunk_lens, dtype=np.int64), np.asarray(chunk_prefix, dtype=np.int64)))
    if not copied or copied > max_blocks or work < min_rows * copied * block_size:
        return {}
    first = np.cumsum(blocks) - blocks
    return {"gather_seq": np.repeat(np.arange(len(blocks)), blocks).astype(np.int32),
            "gather_blk": (np.arange(copied) - np.repeat(first, blocks)).astype(np.int32),
            "prefix_starts": (first * block_size).astype(np.int32)}


def _blocks(cache: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """These blocks of a layer's cache, copied back to back (fp8 ones as bytes: index_select
    does not take every fp8 dtype)."""
    if cache.element_size() == 1:
        return cache.view(torch.uint8).index_select(0, ids).view(cache.dtype)
    return cache.index_select(0, ids)


def token_rows(cu_seqlens: torch.Tensor, prefix_lens: torch.Tensor, block_tables: torch.Tensor,
               num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block_tables [num_tokens, max_blocks], context_lens [num_tokens]) int32 of each prefill token
    as a decode row: its chunk's page table, and its position + 1. Device ops only (captured in a
    prefill graph): a token past cu_seqlens[-1] (a graph's padding) takes the last chunk's table and
    context 1 (it writes no K/V, and its output is not read)."""
    idx = torch.arange(num_tokens, dtype=torch.int32, device=cu_seqlens.device)
    chunk = torch.searchsorted(cu_seqlens[1:], idx, right=True).clamp_(max=block_tables.shape[0] - 1)
    ctx = prefix_lens[chunk] + idx - cu_seqlens[chunk] + 1
    ctx = torch.where(idx < cu_seqlens[-1], ctx, torch.ones_like(ctx))
    return block_tables.index_select(0, chunk), ctx.to(torch.int32)


class TritonAttention:
    name = "triton"
    prefill_graphs = True

    def __init__(self, head_dim: int, group: int = 1, deterministic: bool = False) -> None:
        self.head_dim, self.group, self.deterministic = head_dim, group, deterministic
        self.gather_min_rows = GATHER_MIN_ROWS  # (tests lower it to gather every prefix)
        self._block_m: dict[int, int] = {}  # captured token count -> flash_prefill's BLOCK_M for it
        self._iota: torch.Tensor | None = None  # 0, 1, 2, ...: decode rows as one-row chunks
        self._zeros: torch.Tensor | None = None

    def _positions_per_tile(self, max_seqlen: int, device: torch.device) -> int:
        if self.deterministic:
            return positions_per_tile(self.group)
        return block_m(self.head_dim, max_seqlen, device, self.group)

    def _as_token_rows(self, max_chunk_len: int | None) -> bool:
        """Do chunks of at most this many tokens (None: any) attend as decode rows (`token_rows`)?"""
        return max_chunk_len is not None and max_chunk_len <= TOKEN_ROWS_MAX and not self.deterministic

    def copies_prefixes(self, device: torch.device) -> bool:
        """Can a step on this device copy its prefixes out of the cache (gather_plan)?"""
        return gathered_prefix_ok(self.head_dim, device) and not self.deterministic

    def prefill_arrays(self, chunk_lens: list[int], chunk_prefix: list[int], device: torch.device,
                       cache: tuple[int, int] | None = None) -> dict[str, np.ndarray]:
        """The prefill kernel's tile map for these chunks, exactly as many tiles as they need: a
        grid over (longest chunk) x chunks would launch idle programs for the short ones; and where
        the step copies its prefixes out of the cache (`gather_plan`), which blocks. Nothing for
        chunks that attend as decode rows."""
        if self._as_token_rows(max(chunk_lens)):
            return {}
        bm = self._positions_per_tile(max(chunk_lens), device)
        tile_seq, tile_start = tile_map(chunk_lens, chunk_prefix, bm)
        arrays = {"tile_seq": tile_seq, "tile_start": tile_start}
        if cache is not None and self.copies_prefixes(device):
            arrays.update(gather_plan(chunk_lens, chunk_prefix, *cache, self.gather_min_rows))
        return arrays

    def metadata(self, rows: StepRows) -> AttentionMetadata:
        meta = base_metadata(rows)
        if rows.num_prefill_tokens:
            meta.max_seqlen = max(rows.chunk_lens)
            meta.has_prefix = any(rows.chunk_prefix)
            if "tile_seq" in rows.extra:
                meta.prefill_tiles = rows.extra["tile_seq"], rows.extra["tile_start"]
            if "prefix_starts" in rows.extra:
                ex = rows.extra
                ids = rows.prefill_block_tables[ex["gather_seq"].long(), ex["gather_blk"].long()]
                meta.prefix_gather = ids, ex["prefix_starts"]
            if self._as_token_rows(meta.max_seqlen):
                meta.token_rows = token_rows(rows.cu_seqlens, rows.prefix_lens, rows.prefill_block_tables,
                                             rows.num_prefill_tokens)
        if self.deterministic:
            self._decode_chunks(meta)
        return meta

    def _decode_chunks(self, meta: AttentionMetadata) -> None:
        """Deterministic mode: the decode rows as one-row chunks (positions context_len - 1), in
        device ops only (captured with the rest of a decode graph)."""
        if meta.context_lens is None or not meta.context_lens.numel():
            return
        n = meta.context_lens.shape[0]
        if self._iota is None or self._iota.numel() < n + 1 or self._iota.device != meta.context_lens.device:
            # allocated at warm-up (before any capture) for the largest batch; never shrinks
            self._iota = torch.arange(max(n + 1, 1 << 12), dtype=torch.int32, device=meta.context_lens.device)
            self._zeros = torch.zeros_like(self._iota)
        meta.decode_chunks = (self._iota[: n + 1], meta.context_lens - 1, (self._iota[:n], self._zeros[:n]))

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                rope: Rope | None = None) -> torch.Tensor:
        # An fp8 cache's scales (kvcache/fp8.py); every kernel below quantizes or dequantizes with them.
        ks, vs = cache_scales(k_cache, v_cache)
        if self.deterministic:
            return self._forward_invariant(q, k, v, k_cache, v_cache, meta, scale, rope, ks, vs)
        out = torch.empty_like(q)
        p = meta.num_prefill_tokens
        if not p:  # decodes only: the decode kernel writes this step's K/V itself
            if rope is not None:
                rope_kv_write(q, k, None, rope.positions, rope.cos, rope.sin, None, None, None, write_cache=False)
            paged_decode(q, k_cache, v_cache, meta.decode_block_tables, meta.context_lens, scale, out=out,
                         k_new=k, v_new=v, slot_mapping=meta.slot_mapping, k_scale=ks, v_scale=vs)
            return out
        if rope is not None:  # rotation and the K/V write in one launch
            rope_kv_write(q, k, v, rope.positions, rope.cos, rope.sin, k_cache, v_cache, meta.slot_mapping,
                          k_scale=ks, v_scale=vs)
        else:
            kv_write(k, v, k_cache, v_cache, meta.slot_mapping, ks, vs)
        if meta.token_rows is not None:  # short chunks: each token a decode row (see the module's docstring)
            paged_decode(q[:p], k_cache, v_cache, *meta.token_rows, scale, out=out[:p], k_scale=ks, v_scale=vs)
        else:
            if meta.prefix_gather is not None:  # long chunks: their prefixes copied out (GATHER_MIN_ROWS)
                ids, starts = meta.prefix_gather
                prefix = dict(k_cache=_blocks(k_cache, ids), v_cache=_blocks(v_cache, ids), prefix_starts=starts)
            elif meta.has_prefix:
                prefix = dict(k_cache=k_cache, v_cache=v_cache, block_tables=meta.prefill_block_tables)
            else:
                prefix = {}
            flash_prefill(q[:p], k[:p], v[:p], meta.cu_seqlens, meta.max_seqlen, scale, prefix_lens=meta.prefix_lens,
                          out=out[:p], tiles=meta.prefill_tiles, k_scale=ks, v_scale=vs, **prefix)
        if q.shape[0] > p:
            paged_decode(q[p:], k_cache, v_cache, meta.decode_block_tables, meta.context_lens, scale, out=out[p:],
                         k_scale=ks, v_scale=vs)
        return out

    def _forward_invariant(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                           rope: Rope | None, ks, vs) -> torch.Tensor:
        p = meta.num_prefill_tokens
        sc = dict(k_scale=ks, v_scale=vs)
        if not p:  # decodes only: the attention launch writes this step's K/V itself
            if rope is not None:
                rope_kv_write(q, k, None, rope.positions, rope.cos, rope.sin, None, None, None, write_cache=False)
            return self._invariant_decodes(q, k_cache, v_cache, meta, scale, new_kv=(k, v, meta.slot_mapping), **sc)
        if rope is not None:
            rope_kv_write(q, k, v, rope.positions, rope.cos, rope.sin, k_cache, v_cache, meta.slot_mapping, **sc)
        else:
            kv_write(k, v, k_cache, v_cache, meta.slot_mapping, **sc)
        out = torch.empty_like(q)
        tables = meta.prefill_block_tables
        invariant_attention(q[:p], k_cache, v_cache, tables, meta.cu_seqlens, meta.prefix_lens, meta.prefill_tiles,
                            scale, num_segments(tables, k_cache.shape[1]), out=out[:p], **sc)
        if q.shape[0] > p:  # a mixed step's decodes: their K/V went in with the chunks'
            self._invariant_decodes(q[p:], k_cache, v_cache, meta, scale, out=out[p:], **sc)
        return out

    @staticmethod
    def _invariant_decodes(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, out=None,
                           new_kv=None, k_scale=None, v_scale=None) -> torch.Tensor:
        """The decode rows as one-row chunks (meta.decode_chunks), their keys split over programs by
        segment (the same bits as unsplit, the kernel's contract): faster at every decode batch
        measured on the H100, 1 to 256 rows (benchmarks/results/invariant_kernels_h100.json);
        prompt chunks have tiles enough without."""
        cu, prefix, tiles = meta.decode_chunks
        tables = meta.decode_block_tables
        return invariant_attention(q, k_cache, v_cache, tables, cu, prefix, tiles, scale,
                                   num_segments(tables, k_cache.shape[1]), split=True, out=out, new_kv=new_kv,
                                   k_scale=k_scale, v_scale=v_scale)

    def warmup(self, kv_caches, num_heads: int, dtype: torch.dtype | None = None) -> None:
        """Compile every split variant of the decode kernel (kernels/paged_decode.py). The
        deterministic mode never launches it; its kernels' variants are few and the worker's
        warm-up steps compile them."""
        if self.deterministic:
            return
        k_cache, v_cache = kv_caches[0]
        ks, vs = cache_scales(k_cache, v_cache)
        warmup_split_variants(k_cache, v_cache, num_heads, dtype or k_cache.dtype, ks, vs)

    # -- captured prefill steps -----------------------------------------------------------------
    def graph_tiles(self, num_tokens: int, max_chunks: int, device: torch.device,
                    max_chunk_len: int | None = None) -> int:
        if self._as_token_rows(max_chunk_len):
            return 0  # (decode rows: no prefill kernel, no tile map to fill each replay)
        bm = self._block_m[num_tokens] = self._positions_per_tile(num_tokens, device)
        # sum(ceil(len / bm)) over <= max_chunks chunks of num_tokens tokens <= num_tokens / bm + max_chunks
        return -(-num_tokens // bm) + max_chunks

    def fill_graph_tiles(self, num_tokens: int, lens: list[int], prefix: list[int], tile_seq: np.ndarray,
                         tile_start: np.ndarray) -> None:
        tile_seq[:], tile_start[:] = tile_map(lens, prefix, self._block_m[num_tokens], len(tile_seq))

    def graph_metadata(self, rows: StepRows, num_tokens: int, tiles, max_chunk_len: int | None = None
                       ) -> AttentionMetadata:
        meta = base_metadata(rows)
        meta.max_seqlen, meta.has_prefix, meta.prefill_tiles = num_tokens, True, tiles
        if self._as_token_rows(max_chunk_len):
            meta.token_rows = token_rows(rows.cu_seqlens, rows.prefix_lens, rows.prefill_block_tables, num_tokens)
        if self.deterministic:
            self._decode_chunks(meta)
        return meta
