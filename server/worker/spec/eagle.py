"""The EAGLE-3 head of `--speculative-config '{"method": "eagle3", "model": DIR, ...}'` (models/eagle3.py)
as a draft: the draft model's runner (server/worker/spec/draft.py: its own KV cache over the target's
block ids, prefill and decode graphs, the round of catch-up chunks then k - 1 chained decode steps)
driving the head instead of a model.

What differs is what the head reads. Its position p takes token p + 1 with the target's fused state
at p, which the target wrote into the head's `features` (a row per cache slot, beside the head's own
K/V: a block holds both, `bytes_per_block`) when it computed p. So a catch-up chunk covers positions
whose next token is known, one behind the sequence (server/engine/spec/draft.py, `lag`), and reads
its tokens one ahead (`_Ahead`); a chained step feeds the head the state it output at the position
before (models/eagle3.py `carry`) with the token it chose there, as the draft model's steps feed it
its choice. Its proposals are target ids (the head's logits cover the target's vocabulary).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvcache import CacheSpec
from server.worker.inputs import ScheduledChunk
from server.worker.spec.draft import DraftRunner

log = logging.getLogger("flashpage.spec")


class _Tokens:
    """A sequence's token ids one ahead: [i] is token i + 1 (what the head's position i reads)."""

    __slots__ = ("ids",)

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.ids[i.start + 1 : i.stop + 1]
        return self.ids[i + 1]

    def __len__(self) -> int:
        return len(self.ids) - 1


class _Ahead:
    """A sequence as the head's catch-up chunk reads it (SeqState): its page table, its tokens one ahead."""

    __slots__ = ("seq", "token_ids")

    def __init__(self, seq) -> None:
        self.seq, self.token_ids = seq, _Tokens(seq.token_ids)

    @property
    def blocks(self):
        return self.seq.blocks

    @property
    def request_id(self) -> str:
        return self.seq.request_id

    num_pending = 0  # a sequence proposes only with every token on the host


@dataclass(slots=True)
class _CatchUp:
    seq: _Ahead
    start: int
    num_tokens: int
    samples: bool
    draft: tuple = ()


class EagleRunner(DraftRunner):
    """DraftRunner over an EAGLE-3 head; its fused-state rows are allocated beside its cache."""

    def __init__(self, head, cache_spec: CacheSpec, device: torch.device, max_num_seqs: int, max_tokens: int,
                 max_model_len: int, k: int) -> None:
        super().__init__(head, cache_spec, device, max_num_seqs, max_tokens, max_model_len, k)
        head.allocate(1, cache_spec.block_size, max_num_seqs)  # until the cache is sized: the target's profile run

    @property
    def bytes_per_block(self) -> int:
        return self.cache_spec.bytes_per_block + self.model.feature_bytes(self.block_size)

    def allocate_cache(self, num_blocks: int) -> None:
        super().allocate_cache(num_blocks)
        self.model.allocate(num_blocks, self.block_size, self.max_num_seqs)

    def propose(self, chunks: list[ScheduledChunk], ks: list[int]) -> list[list[int]]:
        return super().propose([_CatchUp(_Ahead(c.seq), c.start, c.num_tokens, c.samples) for c in chunks], ks)


def load_eagle3(config, target, dtype: torch.dtype, device: torch.device, attention: str, max_model_len: int,
                block_size: int, max_tokens: int, token_table=None) -> EagleRunner | None:
    """The head of an eagle3 speculative config (None for any other method), loaded for `target`
    (which from now on hands it its states), in the target's dtype, on its device, with its
    attention backend. `token_table`: the target's whole, under tensor parallelism
    (server/worker/spec/parallel.py)."""
    from models import load_eagle3_head, resolve_model_path

    spec = config.speculative_config
    if spec is None or spec.method != "eagle3":
        return None
    path = resolve_model_path(spec.model)
    head = load_eagle3_head(path, target, dtype, device, attention, max_model_len, token_table)
    s = head.spec
    log.info("EAGLE-3 head %s: draft vocabulary %d, the target's layers %s, %d proposals a step", path,
             head.draft_to_target.numel(), list(head.aux_layers), spec.num_speculative_tokens)
    cache = CacheSpec(s.num_layers, s.num_kv_heads, s.head_dim, block_size, dtype)
    return EagleRunner(head, cache, device, config.max_num_seqs, max_tokens, max_model_len, spec.num_speculative_tokens)
