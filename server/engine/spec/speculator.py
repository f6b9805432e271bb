"""Speculative decoding's host side: which sequences propose this step, their verifications in the
step's batch, and, once the step's ids are in, which proposals stand.

A step (server/engine/llm_engine.py calls these):

1. `wants(running)`: does some sequence mean to propose? Then the step in flight is finished first
   (its ids on the host): a proposal continues the sequence's known tokens.
2. `extend(batch)`: after the scheduler's batch, each decode of a sequence that may speculate gets
   room for k more tokens (blocks through the block manager, the step's token budget, the step's
   rows never past max_num_seqs, max_tokens and the context never passed), then the proposer's
   proposals; a decode with proposals becomes a `VerifySeq` in `batch.verifies` (the worker scores
   its k + 1 positions: server/worker/spec/verify.py).
3. `settle(batch, rows, ids, top)`: for each verification, its row i is the target's own choice
   after proposals 1..i (greedy, or sampled with the noise of the row's position,
   kernels/sampling_noise.py); proposal i + 1 stands if it equals row i's choice, and the run is
   rows 0..j, j the proposals that stood. That is exact for greedy rows, and for sampled rows it is
   rejection sampling against a point-mass draft (proposals are greedy): proposal d stands with
   probability p(d) and otherwise the row's own draw, distributed as p given that it is not d,
   follows; a seeded request's tokens are the ones it samples without speculation. The sequence's
   computed tokens advance past the accepted inputs only; full blocks of those are published to the
   prefix cache, and the blocks past the run go back to the block manager (never published: they
   hold rejected positions). The run's tokens are then emitted one by one by the engine's own loop
   (stop rule, stop strings, logprobs row by row, max_tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcache import BlockManager
from server.config import EngineConfig
from server.engine.scheduler import ScheduledSeq, SchedulerOutput
from server.engine.spec.draft import DraftProposer
from server.engine.spec.ngram import NgramProposer
from server.engine.spec.policy import SpecState, can_speculate, record


@dataclass(slots=True)
class VerifySeq(ScheduledSeq):
    """A decode with proposals: tokens start .. start + len(draft) (its last token, then the
    proposals), every position sampled."""

    draft: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        return True


def accepted_prefix(draft: list[int], chosen: list[int]) -> int:
    """How many proposals stand: proposal i + 1 against the choice of row i."""
    j = 0
    while j < len(draft) and draft[j] == chosen[j]:
        j += 1
    return j


@dataclass(slots=True)
class SpecCounters:
    """vLLM's spec_decode counters (server/api/metrics.py): verifications, proposals, accepted ones,
    and accepted ones by position."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


class Speculator:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int,
                 draft_runner=None) -> None:
        spec = config.speculative_config
        self.k, self.floor, self.max_batch = spec.num_speculative_tokens, spec.min_acceptance, spec.disable_by_batch_size
        self.bm, self.max_model_len = block_manager, max_model_len
        self.max_num_seqs, self.budget = config.max_num_seqs, config.max_num_batched_tokens
        if spec.method == "ngram":
            self.proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        else:
            self.proposer = DraftProposer(draft_runner, self.k, config.max_num_batched_tokens)
        self.acceptance = accepted_prefix  # which proposals stand (benchmarks swap in an oracle's)
        self.counters = SpecCounters(accepted_per_pos=[0] * self.k)

    def snapshot(self) -> dict:
        """The counters as EngineSnapshot's spec_* fields."""
        c = self.counters
        return dict(spec_drafts=c.drafts, spec_draft_tokens=c.draft_tokens, spec_accepted_tokens=c.accepted_tokens,
                    spec_accepted_per_pos=list(c.accepted_per_pos))

    def state(self, params) -> SpecState | None:
        """A new request's state (None: its parameters never speculate)."""
        return SpecState() if can_speculate(params) else None

    def wants(self, running: list) -> bool:
        """Will some running sequence propose in the next step?"""
        if len(running) > self.max_batch:
            return False
        return any(s.spec is not None and s.spec.skip == 0 and len(s.token_ids) > len(s.prompt_token_ids)
                   for s in running)

    def extend(self, batch: SchedulerOutput, running: int) -> None:
        """Turn the batch's decodes of sequences that propose into verifications (see the module)."""
        for seq in batch.preempted:  # recomputed from scratch: the draft too
            if seq.spec is not None:
                self.proposer.reset(seq)
        if running > self.max_batch or not batch.decodes:
            return
        budget = self.budget - batch.num_tokens
        room = self.max_num_seqs - len(batch.decodes) - sum(1 for p in batch.prefills if p.samples)
        items, picked = [], []
        for item in batch.decodes:
            seq = item.seq
            st = seq.spec
            if st is None:
                continue
            if st.skip:  # backing off (counted down by every step, speculating or not)
                st.skip -= 1
                continue
            if seq.num_pending:  # its last step is still in flight: nothing to continue from
                continue
            k = min(self.k, seq.params.max_tokens - len(seq.output_token_ids) - 1,
                    self.max_model_len - 1 - item.start, budget, room)
            if k <= 0 or not self.bm.can_append(seq.blocks, item.start + k + 1):
                continue
            self.bm.append_slot(seq.blocks, item.start + k + 1)
            items.append((seq, item.start, k))
            picked.append(item)
            budget, room = budget - k, room - k
        if not items:
            return
        moved = set()
        for item, (seq, start, k), draft in zip(picked, items, self.proposer.propose(items)):
            if not draft:
                self.bm.trim(seq.blocks, start + 1)
                if draft is not None:  # found nothing to propose
                    record(seq.spec, 0, 0, self.floor)
                continue
            draft = draft[:k]
            batch.verifies.append(VerifySeq(seq, start, 1 + len(draft), draft=draft))
            moved.add(id(item))
        if moved:
            batch.decodes = [item for item in batch.decodes if id(item) not in moved]

    def placeholder_rows(self, batch: SchedulerOutput, rows: list):
        """(row, sequence) of the step's rows that take a placeholder: all but the verifications'."""
        n_dec, n_ver = len(batch.decodes), sum(v.num_tokens for v in batch.verifies)
        return [(r, s) for r, s in enumerate(rows) if not n_dec <= r < n_dec + n_ver]

    def settle(self, batch: SchedulerOutput, rows: list, ids: list[int], top: list | None):
        """Which proposals stand (see the module): the step's rows, ids and logprobs with each
        verification's rows replaced by its run, the run's tokens appended to the sequence (the
        engine's loop resolves them one by one, as placeholders)."""
        n_dec = len(batch.decodes)
        out_rows, out_ids = rows[:n_dec], ids[:n_dec]
        out_top = top[:n_dec] if top is not None else None
        r, c = n_dec, self.counters
        for v in batch.verifies:
            n, seq = v.num_tokens, v.seq
            chosen, r = ids[r : r + n], r + n
            if seq.is_finished:
                continue
            j = self.acceptance(v.draft, chosen)
            c.drafts += 1
            c.draft_tokens += len(v.draft)
            c.accepted_tokens += j
            for i in range(j):
                c.accepted_per_pos[i] += 1
            record(seq.spec, len(v.draft), j, self.floor)
            self.proposer.accepted(seq, v.start, len(v.draft), j)
            run = chosen[: j + 1]
            seq.token_ids += run
            seq.num_computed = v.start + j + 1  # the inputs that stood: the last token, the accepted proposals
            self.bm.cache_computed(seq.blocks, seq.token_ids, seq.num_computed)
            self.bm.trim(seq.blocks, len(seq.token_ids))
            out_rows += [seq] * len(run)
            out_ids += run
            if out_top is not None:
                out_top += top[r - n : r - n + len(run)]
        out_rows += rows[r:]
        out_ids += ids[r:]
        if out_top is not None:
            out_top += top[r:]
        return out_rows, out_ids, out_top
