"""Continuous batching: which sequences run this step, and how many tokens each processes.

Every step (1) keeps each running sequence going: a decode token, or the next chunk of a prompt
still being prefilled; (2) admits waiting requests, oldest first, while the token budget
(`max_num_batched_tokens`), `max_num_seqs` and free KV blocks allow. When a running sequence needs
a block and none is free, the most recently admitted running sequence is preempted: its blocks are
freed and it goes back to the front of the queue to be recomputed later (prompt plus what it has
generated so far), so the engine degrades to queueing instead of failing.

With chunked prefill, a prompt larger than the budget left is split across steps; without it, a
prompt is prefilled whole (alone if it exceeds the budget by itself).

A step that carries a prefill pays a fixed extra cost (a second graph replay, or eager launches)
however many prompts it holds. So while many sequences decode, waiting requests are admitted
together: once there is one per `running_per_admit` running, or after `max_admit_delay` steps (as
TGI's `max_waiting_tokens` bounds its wait). Below 64 running a request is admitted at once; at 256
running, four share a prefill (measured on an H100 with 256 streaming clients, when prefill chunks
still ran eagerly: 41k output tokens/s against 32k admitting every step).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import ClassVar

from kvcache import BlockManager
from server.config import EngineConfig
from server.engine.sequence import Sequence, Status


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    start: int  # first token position processed this step (== seq.num_computed)
    num_tokens: int
    draft: ClassVar[tuple[int, ...]] = ()  # proposals to verify: a speculative step's VerifySeq (spec/)

    @property
    def is_decode(self) -> bool:
        """One token, the sequence's last, after others: a decode (it samples). A one-token chunk
        inside a prompt (a step's budget down to 1) is a prefill chunk that samples nothing."""
        return self.num_tokens == 1 and self.start > 0 and self.samples

    @property
    def samples(self) -> bool:
        """Does this chunk reach the end of the sequence's tokens, so its last logits are sampled?"""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    prefills: list[ScheduledSeq] = field(default_factory=list)
    decodes: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # decodes that verify proposals this step (server/engine/spec/), moved out of `decodes`: their
    # progress is settled when their ids are in, not by after_step
    verifies: list = field(default_factory=list)

    @property
    def scheduled(self) -> list[ScheduledSeq]:
        return self.prefills + self.decodes  # the batch order: prefill tokens first

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    def __init__(self, block_manager: BlockManager, config: EngineConfig) -> None:
        self.bm = block_manager
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.chunked = config.enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last one is preempted first
        self.num_preemptions = 0
        self.max_admit_delay = config.max_admit_delay
        self.running_per_admit = config.running_per_admit
        self.steps_waited = 0  # steps in which waiting requests were held back

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bs = self.bm.block_size
        i = 0
        # The hot loop of the engine (every running sequence, every step): plain attribute reads.
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.capped:  # its last token is in flight; it finishes when that arrives
                i += 1
                continue
            start = seq.num_computed
            remaining = len(seq.token_ids) - start
            n = remaining if remaining == 1 else self._prefill_chunk(remaining, budget, bool(out.prefills))
            if n == 0:
                i += 1
                continue
            # Make room for this chunk's KV, preempting the newest others if the cache is full.
            if start + n > len(seq.blocks.block_table) * bs:
                extra = self.bm.blocks_missing(seq.blocks, start + n)
                while self.bm.num_free_blocks < extra and self.running[-1] is not seq:
                    self._preempt(self.running[-1], out)
                if self.bm.num_free_blocks < extra:
                    self._preempt(seq, out)
                    break
                self.bm.append_slot(seq.blocks, start + n)
            item = ScheduledSeq(seq, start, n)
            (out.decodes if remaining == 1 and start > 0 else out.prefills).append(item)  # item.is_decode
            budget -= n
            i += 1

        if (self.waiting and out.decodes and len(self.waiting) * self.running_per_admit < len(self.running)
                and self.steps_waited < self.max_admit_delay):
            self.steps_waited += 1
            return out  # let more prompts gather for one shared prefill
        self.steps_waited = 0
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            seq = self.waiting[0]
            if not self.bm.can_allocate(seq.num_tokens):
                break  # no blocks (a request whose grammar compiles is queued only once it has: llm_engine.py)
            num_cached = self._admit(seq)
            n = self._prefill_chunk(seq.num_tokens - num_cached, budget, bool(out.prefills))
            if n == 0:
                break  # stays admitted; runs next step
            out.prefills.append(ScheduledSeq(seq, seq.num_computed, n))
            budget -= n
        return out

    def _prefill_chunk(self, remaining: int, budget: int, batch_has_prefill: bool) -> int:
        if self.chunked:
            return min(remaining, budget)
        if remaining <= budget:
            return remaining
        # Unchunked: an oversized prompt goes alone, when nothing else was taken from the budget.
        return remaining if budget == self.max_num_batched_tokens and not batch_has_prefill else 0

    def _admit(self, seq: Sequence) -> int:
        self.waiting.popleft()
        num_cached = self.bm.allocate(seq.blocks, seq.token_ids, reuse=not seq.scores_prompt)
        seq.num_computed = num_cached
        if seq.num_preemptions == 0:
            seq.num_cached_prompt = num_cached
        seq.status = Status.RUNNING
        self.running.append(seq)
        return num_cached

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.bm.free(seq.blocks)
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        for lst in (out.prefills, out.decodes):
            lst[:] = [s for s in lst if s.seq is not seq]

    def after_step(self, out: SchedulerOutput) -> None:
        """Advance progress for what ran, and publish newly computed full blocks to the prefix cache."""
        bs = self.bm.block_size
        for item in out.scheduled:
            seq = item.seq
            seq.num_computed = n = item.start + item.num_tokens
            if n // bs > len(seq.blocks.hashes):  # a block filled up (the common step fills none)
                # Only blocks whose token ids are all known: a placeholder cannot be hashed.
                self.bm.cache_computed(seq.blocks, seq.token_ids, min(n, seq.num_tokens - seq.num_pending))

    def finish(self, seq: Sequence, reason: str) -> None:
        """Finish (or abort) a sequence wherever it is, returning its blocks."""
        if seq.status is Status.FINISHED:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.free(seq.blocks)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
