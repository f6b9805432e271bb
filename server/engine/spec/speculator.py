"""Speculative decoding's host side: which sequences propose this step, their verifications in the
step's batch, and, once the step's ids are in, which proposals stand.

A step (server/engine/llm_engine.py calls these):

1. `finish_first(inflight, running)`: does some sequence mean to propose (`wants`)? Then the step
   in flight is finished first (its ids on the host): a proposal continues the sequence's known
   tokens.
2. `extend(batch)`: after the scheduler's batch, each decode of a sequence not backing off gets
   room for k more tokens (blocks through the block manager, the step's token budget, the step's
   rows never past max_num_seqs, max_tokens and the context never passed), then the proposer's
   proposals, a constrained sequence's cut at the first its grammar rejects (the grammar process's
   check); a decode with proposals becomes a `VerifySeq` in `batch.verifies` (the worker scores
   its k + 1 positions, each after the proposals before it: server/worker/spec/verify.py; the
   grammar process fills a constrained one's masks from `grammar_drafts`).
3. `settle(batch, rows, ids, top)`: for each verification, its row i is the target's own choice
   after proposals 1..i (greedy, or sampled with the noise of the row's position,
   kernels/sampling_noise.py); proposal i + 1 stands if it equals row i's choice, and the run is
   rows 0..j, j the proposals that stood. That is exact for greedy rows, and for sampled rows it is
   rejection sampling against a point-mass draft (proposals are greedy): proposal d stands with
   probability p(d) and otherwise the row's own draw, distributed as p given that it is not d,
   follows; a seeded request's tokens are the ones it samples without speculation. The sequence's
   computed tokens advance past the accepted inputs only; full blocks of those are published to the
   prefix cache, and the blocks past the run go back to the block manager (never published: they
   hold rejected positions). A penalized sequence's counts take the run (server/worker/spec/
   penalties.py), a constrained one's matcher takes it with the next grammar job (`grammar_ids`).
   The run's tokens are then emitted one by one by the engine's own loop (stop rule, stop strings,
   logprobs row by row, max_tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcache import BlockManager
from server.config import EngineConfig
from server.engine.scheduler import ScheduledSeq, SchedulerOutput
from server.engine.spec.draft import DraftProposer
from server.engine.spec.ngram import NgramProposer
from server.engine.spec.policy import SpecState, batch_rule, record
from server.worker.logits import TokenCounts
from server.worker.spec.penalties import count_runs


@dataclass(slots=True)
class VerifySeq(ScheduledSeq):
    """A decode with proposals: tokens start .. start + len(draft) (its last token, then the
    proposals), every position sampled."""

    draft: list[int] = field(default_factory=list)
    accepted: int = -1  # the proposals that stood, once settled (-1: its sequence had ended)

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
                 draft_runner=None, counts: TokenCounts | None = None) -> None:
        spec = config.speculative_config
        self.k, self.floor, self.max_batch = spec.num_speculative_tokens, spec.min_acceptance, spec.disable_by_batch_size
        self.bm, self.max_model_len = block_manager, max_model_len
        self.max_num_seqs, self.budget = config.max_num_seqs, config.max_num_batched_tokens
        if spec.method == "ngram":
            self.proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        else:
            self.proposer = DraftProposer(draft_runner, self.k, config.max_num_batched_tokens,
                                          lag=1 if spec.method == "eagle3" else 0)
        self.acceptance = accepted_prefix  # which proposals stand (benchmarks swap in an oracle's)
        # the back-off rule (policy.py): None = per_sequence
        self.batch = batch_rule(spec.round_cost) if spec.backoff == "batch" else None
        self.counters = SpecCounters(accepted_per_pos=[0] * self.k)
        self.counts = counts  # the runner's penalty counts: accepted runs are counted there

    def close(self) -> None:
        """Give back the draft's device memory (its CUDA graphs and KV cache), as the engine's runner does."""
        runner = getattr(self.proposer, "runner", None)
        if runner is not None:
            runner.close()

    def snapshot(self) -> dict:
        """The counters as EngineSnapshot's spec_* fields."""
        c = self.counters
        return dict(spec_drafts=c.drafts, spec_draft_tokens=c.draft_tokens, spec_accepted_tokens=c.accepted_tokens,
                    spec_accepted_per_pos=list(c.accepted_per_pos))

    def state(self, params) -> SpecState:
        """A new request's state."""
        return SpecState()

    def finish_first(self, inflight, running: list) -> bool:
        """Must the step in flight be finished before the next is scheduled? A speculative step
        continues its sequences' known tokens, and the step after one cannot stand placeholders
        for a run of unknown length."""
        return inflight is not None and (bool(inflight[0].verifies) or self.wants(running))

    def wants(self, running: list) -> bool:
        """Will some running sequence propose in the next step?"""
        if len(running) > self.max_batch:
            return False
        if self.batch is not None:  # the batch rule's answer for the decoding ones, not counted as a step
            decoding = [s for s in running if len(s.token_ids) > len(s.prompt_token_ids)]
            cands = [(s.spec, self._most_proposals(s, len(s.token_ids) - 1)) for s in decoding if s.spec is not None]
            cands = [c for c in cands if c[1] > 0]
            return bool(cands) and bool(self.batch.choose(cands, len(decoding), commit=False))
        return any(s.spec is not None and s.spec.skip == 0 and len(s.token_ids) > len(s.prompt_token_ids)
                   for s in running)

    def _most_proposals(self, seq, last: int) -> int:
        """How many proposals a sequence whose last token is at position `last` may verify: k, with
        neither max_tokens nor the context passed."""
        return min(self.k, seq.params.max_tokens - len(seq.output_token_ids) - 1, self.max_model_len - 1 - last)

    def _record(self, st: SpecState, proposed: int, accepted: int) -> None:
        """A verification's outcome; under the batch rule (floor 0) it only moves the average."""
        record(st, proposed, accepted, self.floor if self.batch is None else 0.0)

    def _candidates(self, batch: SchedulerOutput) -> list[tuple[ScheduledSeq, int]]:
        """The batch's decodes that may propose this step, with their most proposals (max_tokens
        and the context never passed): per_sequence, those not backing off (whose back-offs count
        down here); batch, those the rule's round takes."""
        out = []
        for item in batch.decodes:
            seq = item.seq
            st = seq.spec
            if st is None:
                continue
            if self.batch is None and st.skip:  # backing off (counted down by every step, speculating or not)
                st.skip -= 1
                continue
            if seq.num_pending:  # its last step is still in flight: nothing to continue from
                continue
            k = self._most_proposals(seq, item.start)
            if k > 0:
                out.append((item, k))
        if self.batch is None:
            return out
        taken = set(self.batch.choose([(item.seq.spec, k) for item, k in out], len(batch.decodes)))
        for i, (item, _) in enumerate(out):
            if i not in taken:
                item.seq.spec.idle += 1
        return [c for i, c in enumerate(out) if i in taken]

    def extend(self, batch: SchedulerOutput, running: int, grammars=None) -> None:
        """Turn the batch's decodes of sequences that propose into verifications (see the module).
        `grammars`: the grammar process (server/engine/grammar_process.py), which cuts a constrained
        sequence's proposals at the first its grammar rejects."""
        for seq in batch.preempted:  # recomputed from scratch: the draft too
            if seq.spec is not None:
                self.proposer.reset(seq)
        if running > self.max_batch or not batch.decodes:
            return
        budget = self.budget - batch.num_tokens
        room = self.max_num_seqs - len(batch.decodes) - sum(1 for p in batch.prefills if p.samples)
        items, picked = [], []
        for item, k in self._candidates(batch):
            seq = item.seq
            k = min(k, budget, room)
            if k <= 0 or not self.bm.can_append(seq.blocks, item.start + k + 1):
                continue
            self.bm.append_slot(seq.blocks, item.start + k + 1)
            items.append((seq, item.start, k))
            picked.append(item)
            budget, room = budget - k, room - k
        if not items:
            return
        drafts = self.proposer.propose(items)
        constrained = [i for i, ((seq, _, _), d) in enumerate(zip(items, drafts)) if d and seq.grammar is not None]
        if constrained:
            valid = (grammars.valid_prefixes([(items[i][0].grammar, drafts[i]) for i in constrained])
                     if grammars is not None else [0] * len(constrained))
            for i, n in zip(constrained, valid):
                drafts[i] = drafts[i][:n]
        moved = set()
        for item, (seq, start, k), draft in zip(picked, items, drafts):
            if not draft:
                self.bm.trim(seq.blocks, start + 1)
                if draft is not None:  # found nothing to propose
                    self._record(seq.spec, 0, 0)
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

    def grammar_drafts(self, batch: SchedulerOutput) -> list[tuple[int, list[int]]] | None:
        """The step's constrained verifications as the grammar process fills them: (first row,
        proposals); None when it has none."""
        out, r = [], len(batch.decodes)
        for v in batch.verifies:
            if v.seq.grammar is not None:
                out.append((r, v.draft))
            r += v.num_tokens
        return out or None

    def grammar_ids(self, batch: SchedulerOutput, ids: list[int]) -> list[int]:
        """A settled step's ids as the grammar process takes them: a verification's rows hold its
        accepted run, then -1 (not taken)."""
        out, r = list(ids), len(batch.decodes)
        for v in batch.verifies:
            n = v.num_tokens
            out[r + v.accepted + 1 : r + n] = [-1] * (n - v.accepted - 1)
            r += n
        return out

    def settle(self, batch: SchedulerOutput, rows: list, ids: list[int], top: list | None,
               grammar_ids: list[int] | None = None):
        """Which proposals stand (see the module): the step's rows, ids and logprobs with each
        verification's rows replaced by its run, the run's tokens appended to the sequence (the
        engine's loop resolves them one by one, as placeholders); and `grammar_ids` (the step's
        ids, for a step with constrained rows) as the grammar process takes them (grammar_ids)."""
        n_dec = len(batch.decodes)
        out_rows, out_ids = rows[:n_dec], ids[:n_dec]
        out_top = top[:n_dec] if top is not None else None
        r, c, runs = n_dec, self.counters, []
        for v in batch.verifies:
            n, seq = v.num_tokens, v.seq
            chosen, r = ids[r : r + n], r + n
            if seq.is_finished:
                continue
            j = v.accepted = self.acceptance(v.draft, chosen)
            c.drafts += 1
            c.draft_tokens += len(v.draft)
            c.accepted_tokens += j
            for i in range(j):
                c.accepted_per_pos[i] += 1
            self._record(seq.spec, len(v.draft), j)
            self.proposer.accepted(seq, v.start, len(v.draft), j)
            run = chosen[: j + 1]
            if seq.params.penalized:  # row 0 counted its token; the rest of the run, now
                runs.append((seq.request_id, run[1:]))
            seq.token_ids += run
            seq.num_computed = v.start + j + 1  # the inputs that stood: the last token, the accepted proposals
            self.bm.cache_computed(seq.blocks, seq.token_ids, seq.num_computed)
            self.bm.trim(seq.blocks, len(seq.token_ids))
            out_rows += [seq] * len(run)
            out_ids += run
            if out_top is not None:
                out_top += top[r - n : r - n + len(run)]
        if self.counts is not None and (runs or self.counts.scratched):
            count_runs(self.counts, runs)
        out_rows += rows[r:]
        out_ids += ids[r:]
        if out_top is not None:
            out_top += top[r:]
        return out_rows, out_ids, out_top, None if grammar_ids is None else self.grammar_ids(batch, grammar_ids)


def make_speculator(config: EngineConfig, block_manager: BlockManager, max_model_len: int, worker) -> Speculator | None:
    """The engine's speculator over its worker (server/worker/setup.py: the draft, the penalty
    counts), or None where speculation is off."""
    if config.speculative_config is None:
        return None
    return Speculator(config, block_manager, max_model_len, worker.draft, worker.runner.counts)
