"""Input packing: a scheduled step becomes the flat int32 arrays the model and its attention read.

What the worker reads of the engine's records is the protocol below (`ScheduledChunk`, `SeqState`):
the engine's `ScheduledSeq` and `Sequence` satisfy it, and the worker never imports the engine.

Every int32 array a step needs goes through one pinned buffer and one host-to-device copy, and comes
out as views of one device buffer (no per-step device allocation). There are two pinned host
buffers, used in turn: with asynchronous scheduling step k is packed while step k-1 may not have
started on the device, so its upload may still be reading the other buffer. A buffer is refilled
only once the copy that last read it has run (an event per buffer): the engine has waited for step
k-2 anyway, but start-up runs steps back to back without waiting (server/worker/warmup.py): where
the device ran far behind the host (an 8B model's int4 prefill GEMMs on an H100) a step's upload
read its buffer after a later step had refilled it, the step ran on another step's arrays, and the
warm-up died in the embedding's gather (a device-side assert: an input id out of range).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from kvcache import SeqBlocks, slot_of, slots_of
from models import AttentionBackend, StepRows
from server.sampling_params import SamplingParams


class SeqState(Protocol):
    """A sequence as the worker reads it (server/engine/sequence.py)."""

    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    token_ids: list[int]  # prompt + output; a token not yet on the host is a placeholder
    blocks: SeqBlocks
    plain: bool  # greedy, no logprobs, no logits controls: the argmax the step already computed is its token
    num_pending: int  # newest tokens whose ids are still on the device

    def input_token(self, pos: int) -> int:
        """Token `pos` as a step's input id (a placeholder id for a token still on the device)."""


class ScheduledChunk(Protocol):
    """Tokens [start, start + num_tokens) of one sequence, processed in one step."""

    seq: SeqState
    start: int
    num_tokens: int
    samples: bool  # reaches the end of the sequence's tokens: its last logits are sampled
    # A speculative step's proposals (server/engine/spec/): the chunk is the sequence's last token
    # then these, and every one of its positions samples (verification). Empty (or absent) for any
    # other chunk.
    draft: Sequence[int]


def align16(n: int) -> int:
    """An int32 count rounded up so that what follows starts on a 16-byte boundary: Triton
    specialises kernels on pointer alignment, so shifting alignments would compile new variants
    mid-serving."""
    return -(-n // 4) * 4


class Staging:
    """One int32 device buffer and two pinned host mirrors, filled in turn (why two: see above).
    `next_host()` hands out the mirror to fill for this step (after the copy that last read it has
    run), `upload()` copies it over; on the CPU the one buffer is both."""

    def __init__(self, size: int, device: torch.device) -> None:
        self.on_cuda = device.type == "cuda"
        self.hosts = [torch.zeros(size, dtype=torch.int32, pin_memory=self.on_cuda) for _ in range(2 if self.on_cuda else 1)]
        self.host_nps = [h.numpy() for h in self.hosts]
        self.turn = 0
        self.dev = torch.zeros(size, dtype=torch.int32, device=device) if self.on_cuda else self.hosts[0]
        self.copied = [torch.cuda.Event() for _ in self.hosts] if self.on_cuda else []  # each mirror's last upload

    def next_host(self) -> np.ndarray:
        self.turn = (self.turn + 1) % len(self.hosts)
        if self.copied:  # (pinned mirrors only: a CPU staging has none to wait for)
            self.copied[self.turn].synchronize()  # at once in serving (step k-2 is done); never recorded: at once
        return self.host_nps[self.turn]

    def upload(self, n: int | None = None, non_blocking: bool = True) -> None:
        """Copy the first n (default all) values of the current mirror to the device buffer."""
        if self.on_cuda:
            self.dev[:n].copy_(self.hosts[self.turn][:n], non_blocking=non_blocking)
            if self.copied:
                self.copied[self.turn].record()


Spans = dict[str, tuple[int, tuple[int, ...]]]  # name -> (offset, shape) of each array a pack laid out


class Packer:
    def __init__(self, capacity: int, device: torch.device) -> None:
        self.staging = Staging(capacity, device)
        self.used, self.spans = 0, {}  # the last pack's words and where its arrays lie in them

    def pack(self, **arrays) -> dict[str, torch.Tensor]:
        """Lay out each array (list, numpy array, or 2-D numpy array) back to back; one copy; a
        device view of each, by name."""
        host_np = self.staging.next_host()
        spans, off = {}, 0
        for name, a in arrays.items():
            a = np.asarray(a, dtype=np.int32)
            n = a.size
            if off + n > host_np.size:
                raise ValueError(f"batch needs {off + n} int32 slots, packer holds {host_np.size}")
            host_np[off : off + n] = a.reshape(-1)
            spans[name] = (off, a.shape)
            off += align16(n)  # every array starts on a 16-byte boundary
        self.staging.upload(off)
        self.used, self.spans = off, spans
        return self._views(spans)

    def _views(self, spans: Spans) -> dict[str, torch.Tensor]:
        dev = self.staging.dev
        return {name: dev[o : o + int(np.prod(shape))].view(tuple(shape)) for name, (o, shape) in spans.items()}

    def packed(self) -> tuple[np.ndarray, Spans]:
        """The last pack's words (host) and spans: what the other ranks of a tensor-parallel group
        load into their own packers (server/worker/parallel/)."""
        return self.staging.host_nps[self.staging.turn][: self.used], self.spans

    def load(self, words: np.ndarray, spans: Spans) -> dict[str, torch.Tensor]:
        """Another packer's pack (`packed`) into this one: the same views, over this device's copy."""
        self.staging.next_host()[: len(words)] = words
        self.staging.upload(len(words))
        return self._views(spans)


def pad_rows(rows: list[list[int]], width: int) -> np.ndarray:
    """Page tables as a [len(rows), width] int32 array padded with block 0 (never read: kernels stop
    at each sequence's length)."""
    out = np.zeros((len(rows), width), dtype=np.int32)
    fill_rows(out, rows)
    return out


def fill_rows(out: np.ndarray, rows: list[list[int]]) -> None:
    """out[i, :len(rows[i])] = rows[i] for every row, in two numpy calls instead of one per row
    (hundreds of page tables a step); what lies past each row's length is left as it was."""
    if not rows:
        return
    lens = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    flat = np.fromiter(chain.from_iterable(rows), dtype=out.dtype, count=int(lens.sum()))
    mask = np.arange(int(lens.max())) < lens[:, None]
    out[: len(rows), : mask.shape[1]][mask] = flat  # True cells in row-major order = rows concatenated


@dataclass(slots=True)
class PrefillArrays:
    """A step's prefill chunks, flat (what both the eager step and the prefill graphs upload)."""

    ids: np.ndarray  # [num_tokens] token ids, chunks back to back
    positions: np.ndarray  # [num_tokens]
    slots: np.ndarray  # [num_tokens] flat cache slot of each token's K/V
    lens: list[int]  # new tokens per chunk
    prefix: list[int]  # tokens of each sequence already in the cache (the chunk's start)
    tables: list[list[int]]  # page tables
    ends: list[int]  # row of the last token of each chunk that samples (reaches its sequence's end);
    # every row of a chunk with proposals (a speculative step's verification)


def pack_prefills(prefills: list[ScheduledChunk], block_size: int) -> PrefillArrays:
    ids, pos, slots, lens, prefix, tables, ends = [], [], [], [], [], [], []
    offset = 0
    for item in prefills:
        seq, lo, n, draft = item.seq, item.start, item.num_tokens, getattr(item, "draft", ())
        if lo + n - len(draft) > len(seq.token_ids) - seq.num_pending:  # the scheduler never does this
            raise RuntimeError(f"{seq.request_id}: a prefill chunk reaches a token not yet sampled")
        table = seq.blocks.block_table
        p = np.arange(lo, lo + n)
        ids.append(seq.token_ids[lo : lo + n] if not draft else [seq.token_ids[lo], *draft])
        pos.append(p)
        slots.append(slots_of(table, p, block_size))
        lens.append(n)
        prefix.append(lo)
        tables.append(table)
        offset += n
        if draft:
            ends.extend(range(offset - n, offset))
        elif item.samples:
            ends.append(offset - 1)
    cat = lambda parts: np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)  # noqa: E731
    return PrefillArrays(cat(ids), cat(pos), cat(slots), lens, prefix, tables, ends)


@dataclass(slots=True)
class StepInputs:
    """One step, packed and on the device."""

    input_ids: torch.Tensor  # [num_tokens] int32 (placeholder ids included)
    positions: torch.Tensor  # [num_tokens] int32
    rows: StepRows  # what the attention backend builds its metadata from
    ends: torch.Tensor  # rows whose hidden states are sampled: decodes first, then prefill chunks


def prepare_step(packer: Packer, prefills: list[ScheduledChunk], decodes: list[ScheduledChunk],
                 block_size: int, attention: AttentionBackend | None = None, gather_blocks: int = 0) -> StepInputs:
    """Flatten a step: prefill chunks first, then one token per decode; plus the arrays the
    attention backend asks for (`prefill_arrays`), in the same upload."""
    pf = pack_prefills(prefills, block_size)
    ids, pos, slots = [], [], []
    offset = len(pf.ids)
    for item in decodes:  # plain ints: numpy calls cost more than they save for one token
        seq, lo = item.seq, item.start
        ids.append(seq.input_token(lo))
        pos.append(lo)
        slots.append(slot_of(seq.blocks.block_table, lo, block_size))
    # Rows that sample, decodes first: the order of the step's sampled ids (server/worker/runner.py).
    ends = [offset + i for i, item in enumerate(decodes) if item.samples] + pf.ends
    arrays = dict(input_ids=np.concatenate([pf.ids, ids]), positions=np.concatenate([pf.positions, pos]),
                  slot_mapping=np.concatenate([pf.slots, slots]), ends=ends)
    extra = {}
    if prefills:
        arrays.update(cu_seqlens=[0, *np.cumsum(pf.lens).tolist()], prefix_lens=pf.prefix,
                      prefill_block_tables=pad_rows(pf.tables, max(map(len, pf.tables))))
        if attention is not None:
            cache = (block_size, gather_blocks) if gather_blocks else None
            extra = attention.prefill_arrays(pf.lens, pf.prefix, packer.staging.dev.device, cache)
    if decodes:
        tables = [s.seq.blocks.block_table for s in decodes]
        arrays.update(context_lens=[s.start + 1 for s in decodes],
                      decode_block_tables=pad_rows(tables, max(map(len, tables))))
    if extra.keys() & arrays.keys():
        raise ValueError(f"backend arrays {sorted(extra.keys() & arrays.keys())} clash with the step's own")
    arrays.update(extra)
    return step_inputs(packer.pack(**arrays), offset, pf.lens, pf.prefix, list(extra))


def step_inputs(v: dict[str, torch.Tensor], num_prefill_tokens: int, chunk_lens: list[int], chunk_prefix: list[int],
                extra: list[str]) -> StepInputs:
    """A packed step's views (by name) as the model reads them; `extra`: the backend's own arrays."""
    rows = StepRows(v["slot_mapping"], num_prefill_tokens, cu_seqlens=v.get("cu_seqlens"),
                    prefix_lens=v.get("prefix_lens"), prefill_block_tables=v.get("prefill_block_tables"),
                    chunk_lens=chunk_lens, chunk_prefix=chunk_prefix, context_lens=v.get("context_lens"),
                    decode_block_tables=v.get("decode_block_tables"), extra={name: v[name] for name in extra})
    return StepInputs(v["input_ids"], v["positions"], rows, v["ends"])
