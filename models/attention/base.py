"""The attention-backend contract: what a step's rows look like, and what every backend does with them.

A step's batch is flat: its first `num_prefill_tokens` tokens belong to prefill chunks (packed back
to back, delimited by `cu_seqlens`, each chunk continuing a sequence whose first `prefix_lens[i]`
tokens are already in the cache), the rest are decode tokens, one per sequence. The worker packs
the step into `StepRows` (device int32 views plus the host lists they came from); the model's
backend turns those into its own `AttentionMetadata` once per step (`metadata`), and every layer
calls `forward` with it; arrays of its own it wants uploaded with the step's come from
`prefill_arrays`. A backend also owns its start-up work (`warmup`) and what a captured
prefill graph needs of it (`graph_tiles`, `fill_graph_tiles`, `graph_metadata`): the worker
captures graphs without knowing what a backend keeps in them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch


@dataclass(slots=True)
class StepRows:
    """A step's flat batch as the worker packed it."""

    slot_mapping: torch.Tensor  # [num_tokens] int32 flat cache slot of each token's K/V; -1 = padding (not written)
    num_prefill_tokens: int
    # prefill chunks
    cu_seqlens: torch.Tensor | None = None  # [num_chunks + 1] int32
    prefix_lens: torch.Tensor | None = None  # [num_chunks] int32: tokens of each chunk's sequence already cached
    prefill_block_tables: torch.Tensor | None = None  # [num_chunks, max_blocks] int32
    chunk_lens: list[int] = field(default_factory=list)  # host: new tokens of each chunk
    chunk_prefix: list[int] = field(default_factory=list)  # host: prefix_lens
    # decodes
    context_lens: torch.Tensor | None = None  # [num_decodes] int32, this step's token included
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] int32
    # what the backend's prefill_arrays() asked for, uploaded with the rest (device views, by name)
    extra: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(slots=True)
class AttentionMetadata:
    """StepRows plus what a backend derives from them once per step (not per layer)."""

    slot_mapping: torch.Tensor
    num_prefill_tokens: int
    cu_seqlens: torch.Tensor | None = None
    prefix_lens: torch.Tensor | None = None
    prefill_block_tables: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    decode_block_tables: torch.Tensor | None = None
    max_seqlen: int = 0  # longest chunk (triton: picks the prefill kernel's tile size)
    has_prefix: bool = False  # any chunk continues cached tokens (triton)
    cu_seqlens_host: list[int] | None = None  # eager / sdpa loop over chunks on the host
    prefix_lens_host: list[int] | None = None
    # (tile_seq, tile_start) int32: flash_prefill's tile map (triton): in captured prefill graphs,
    # whose grid cannot follow the batch, and in eager steps, whose grid then holds no idle programs.
    prefill_tiles: tuple[torch.Tensor, torch.Tensor] | None = None
    # (cu_seqlens, prefix_lens, (tile_seq, tile_start)) of the decode rows as one-row chunks: the
    # deterministic triton path runs them through the prefill chunks' kernel
    decode_chunks: tuple | None = None
    # (block_tables [T, max_blocks], context_lens [T]) int32: each prefill token as a decode row,
    # its chunk's page table and its own position + 1 (triton: a step of short chunks alone, e.g.
    # speculative verifications, attends through the paged decode kernel, split over the keys)
    token_rows: tuple[torch.Tensor, torch.Tensor] | None = None
    # (block ids [n], prefix_starts [num_chunks]) int32 (triton): each layer copies these cache
    # blocks (every chunk's prefix, back to back) and the prefill kernel reads the copy in whole
    # tiles; chunk i's prefix starts at row prefix_starts[i] of it
    prefix_gather: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass(slots=True)
class Rope:
    """Rotary positions for one layer call: the step's token positions and the model's tables.
    A backend given one rotates q and k (in place where it can) before it writes K/V and attends,
    so that rotation, the K/V write and (on the Triton backend) the query rotation share a launch."""

    positions: torch.Tensor  # [num_tokens] int32 / int64
    cos: torch.Tensor  # [max_positions, head_dim] fp32, "rotate_half" layout (kernels/rope.py)
    sin: torch.Tensor


def base_metadata(rows: StepRows) -> AttentionMetadata:
    return AttentionMetadata(rows.slot_mapping, rows.num_prefill_tokens, rows.cu_seqlens, rows.prefix_lens,
                             rows.prefill_block_tables, rows.context_lens, rows.decode_block_tables)


class AttentionBackend(Protocol):
    """One per model, shared by its layers."""

    name: str
    prefill_graphs: bool  # can a prefill step be captured in a CUDA graph (no host values read per step)?

    def prefill_arrays(self, chunk_lens: list[int], chunk_prefix: list[int], device: torch.device,
                       cache: tuple[int, int] | None = None) -> dict[str, np.ndarray]:
        """Host int32 arrays an eager step with these prefill chunks needs besides StepRows' own;
        the worker uploads them in the step's one copy and hands them back in `StepRows.extra`.
        `cache`: (block_size, max_blocks) of the KV cache, where the worker lets the step copy its
        chunks' prefixes out of the cache (at most max_blocks blocks: what its memory profile ran)."""

    def copies_prefixes(self, device: torch.device) -> bool:
        """Can a step on this device copy its chunks' prefixes out of the cache (prefill_arrays'
        `cache`)? The worker reserves memory for the largest copy where it can."""

    def metadata(self, rows: StepRows) -> AttentionMetadata:
        """This step's metadata, built once and handed to every layer."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                rope: Rope | None = None) -> torch.Tensor:
        """q [num_tokens, heads, d], k/v [num_tokens, kv_heads, d]: rotate q and k if `rope` is
        given (bit-identical to kernels.reference.rope_ref), write k/v at `slot_mapping`, attend,
        return [num_tokens, heads, d]. q, k and v may be modified in place. An fp8 cache carries its
        scales (kvcache.cache_scales): K/V are stored quantized and every key and value attended
        over is read as the cache holds it, a prefill chunk's own included (so that a token
        attends over the same values however its sequence was chunked, cached or recomputed)."""

    def warmup(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], num_heads: int,
               dtype: torch.dtype | None = None) -> None:
        """Compile what batch shapes could otherwise compile mid-serving. `dtype`: the queries'
        (the model's; None: the cache's, which differs for an fp8 cache)."""

    def graph_tiles(self, num_tokens: int, max_chunks: int, device: torch.device,
                    max_chunk_len: int | None = None) -> int:
        """Slots of per-step work map a captured prefill step of `num_tokens` tokens in at most
        `max_chunks` chunks, none longer than `max_chunk_len` (None: any), needs (0: none)."""

    def fill_graph_tiles(self, num_tokens: int, lens: list[int], prefix: list[int], tile_seq: np.ndarray,
                         tile_start: np.ndarray) -> None:
        """Write that work map (host int32 arrays of graph_tiles() slots) for these chunks."""

    def graph_metadata(self, rows: StepRows, num_tokens: int, tiles: tuple[torch.Tensor, torch.Tensor] | None,
                       max_chunk_len: int | None = None) -> AttentionMetadata:
        """Metadata over a captured prefill graph's static rows: nothing in it may be read from
        the host at replay, so it covers any batch of up to `num_tokens` tokens. `max_chunk_len`:
        the longest chunk any replay holds, where the graph's owner knows it (a speculative
        verification's k + 1); None: any."""
