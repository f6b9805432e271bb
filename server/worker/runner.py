"""The model runner: a scheduled step in, sampled ids out (the device side of the engine).

Batch layout (what the attention backends expect): prefill chunks first, packed and delimited by
`cu_seqlens`, then one token per decoding sequence (server/worker/inputs.py packs it). A step with
decodes only replays a CUDA graph captured for the next larger batch size, and prefill chunks one
captured for their padded token count where one fits (server/worker/cuda_graphs.py); a mixed step
replays both. Anything else runs eagerly.

The runner speaks only the model contract (models/base.py): `forward`, `lm_head`, `spec`, and the
model's attention backend for metadata and warm-up.

Under tensor parallelism this is rank 0's runner: `peers` (server/worker/parallel/) sends each
forward's packed inputs to the other ranks, whose runners run the same forward on their shards
(graph replays through the graphs' `on_replay`, eager steps here); this rank alone chooses tokens.
"""

from __future__ import annotations

import atexit
import gc
import operator
import random
import weakref

import torch

from kernels.argmax import argmax_rows
from kvcache import CacheSpec, allocate_kv_cache
from models import CausalLM, StepRows
from server.worker.choice import ChoiceGraphs, argmax_choice
from server.worker.grammar_rows import GrammarBuffers, GrammarFill, MaskMemory
from server.worker.inputs import Packer, ScheduledChunk, SeqState, prepare_step
from server.worker.logits import GrammarMask, StepControls, TokenCounts
from server.worker.sampler import inverse_temperatures, log_softmax, noise_keys, sample, top_logprobs
from server.worker.scoring import PromptScores, head_slices, score_chunks, unpack, wants_scores
from server.worker.spec.verify import verify_parts, verify_rows, verify_slots
from server.worker.steps import ArgmaxChoice, RowsPlan, StepHandle, StepResult


def close_at_exit(ref: weakref.ref) -> None:
    """atexit: close the runner `ref` names if it is still alive (ModelRunner.attach_peers)."""
    runner = ref()
    if runner is not None:
        runner.close()


class ModelRunner:
    def __init__(self, model: CausalLM, cache_spec: CacheSpec, device: torch.device, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int) -> None:
        self.model = model
        self.cache_spec = cache_spec
        self.block_size = cache_spec.block_size
        self.device = device
        self.max_num_seqs = max_num_seqs
        self.max_tokens = max(max_num_batched_tokens, max_num_seqs)
        self.max_blocks = -(-max_model_len // cache_spec.block_size)
        # The most cache blocks a step may copy out of a layer's cache for the prefill kernel (the
        # attention backend's gather_plan): one longest sequence's, where the backend copies at all;
        # the memory profile reserves them (server/worker/warmup.py).
        self.gather_blocks = self.max_blocks if model.attention.copies_prefixes(device) else 0
        s = max_num_seqs
        # ids, positions, slots | cu_seqlens, prefix_lens, context_lens, ends | page tables | the
        # backend's arrays (a tile map: two per query tile, at most one tile per token; a prefix
        # copy: two per block, at most gather_blocks, and one per chunk) | alignment
        self.packer = Packer(3 * self.max_tokens + 4 * (s + 1) + s * self.max_blocks + 2 * (self.max_tokens + s)
                             + 2 * self.gather_blocks + s + 4 * 12, device)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.graphs = None
        self.prefill_graphs = None
        self.verify_graphs = None  # a speculative step's (server/worker/spec/verify.py), where speculation is on
        self.rng = random.Random()  # the noise keys of unseeded sampled rows (kernels/sampling_noise.py)
        self.on_cuda = device.type == "cuda"
        # The last step's sampled ids stay here, on the device, for the next step's placeholders.
        self.last_ids = torch.zeros(max_num_seqs, dtype=torch.int32, device=device)
        # Two pinned landing buffers: step k's copy must not overwrite step k-1's before it is read.
        self.host_ids = [torch.zeros(max_num_seqs, dtype=torch.int32, pin_memory=self.on_cuda) for _ in range(2)]
        self.flip = 0
        self.scores: list[PromptScores] = []  # this step's prompt log-probabilities (eager paths add them)
        self.stop_ids: frozenset[int] = frozenset()  # the model's EOS ids (the engine sets them): min_tokens
        self.counts = TokenCounts(model.vocab_size, device)  # generated-token counts of penalized sequences
        self.last_plan: RowsPlan | None = None  # the last step's rows and how they choose: see _plan
        self.grammar_memory: MaskMemory | None = None  # where its grammar process fills masks (the engine sets it)
        self.grammar: GrammarBuffers | None = None  # made by the first constrained step
        self.choice_graphs: ChoiceGraphs | None = None  # likewise, where decode graphs run
        self.pending = None  # CPU: the constrained step whose choice waits for its fill (see complete)
        self.peers = None  # tensor parallelism, rank 0: the other ranks (server/worker/parallel/peers.py)

    # -- start-up (the runs before serving: server/worker/warmup.py) ---------------------------
    def forward(self, caches, input_ids, positions, rows: StepRows, sampled_ids=None) -> torch.Tensor:
        """The model's forward over `caches` with its backend's metadata for `rows`."""
        meta = self.model.attention.metadata(rows)
        return self.model.forward(input_ids, positions, caches, meta, sampled_ids=sampled_ids)

    def allocate_cache(self, num_blocks: int, scales=None) -> None:
        """`scales`: an fp8 cache's KVScales (kvcache/fp8.py)."""
        if self.on_cuda:  # one allocation of most of the GPU: what an earlier engine in this process left
            gc.collect()  # in freed segments (collected late, after the budget was measured) goes back first
            torch.cuda.empty_cache()
        self.kv_caches = allocate_kv_cache(self.cache_spec, num_blocks, self.device, scales)

    def attach_peers(self, peers) -> None:
        """Rank 0 of a tensor-parallel group: `peers` (server/worker/parallel/peers.py) runs the other
        ranks. An engine never closed closes at exit, its graphs before the group (the peers' own
        exit handler, registered earlier, runs later): NCCL's destroy hangs while they live. Held
        weakly: a closed engine's runner is not kept for the process's life."""
        self.peers = peers
        atexit.register(close_at_exit, weakref.ref(self))

    def close(self) -> None:
        """Give back the device memory (CUDA graphs, KV cache) so that another engine fits in this process."""
        self.graphs = self.prefill_graphs = self.choice_graphs = self.verify_graphs = None
        self.kv_caches = []
        if self.peers is not None:  # (the group's destroy collects the graphs dropped above first)
            self.peers.close()
            self.peers = None
        if self.grammar is not None:
            self.grammar.close()
            self.grammar = None
        gc.collect()
        if self.on_cuda:
            torch.cuda.empty_cache()

    def capture_graphs(self) -> None:
        from server.worker.cuda_graphs import DecodeGraphs, PrefillGraphs

        self.graphs = DecodeGraphs(self.model, self.kv_caches, self.max_num_seqs, self.max_blocks, self.device,
                                   self.last_ids, self.counts)
        self.graphs.capture()
        if self.model.attention.prefill_graphs:
            self.prefill_graphs = PrefillGraphs(self.model, self.kv_caches, self.max_tokens, self.max_blocks,
                                                self.device)
            self.prefill_graphs.capture()
        if self.peers is not None:  # the other ranks replay what this one does
            self.graphs.on_replay = self.peers.replayer(self.graphs, prefill=False)
            if self.prefill_graphs is not None:
                self.prefill_graphs.on_replay = self.peers.replayer(self.prefill_graphs, prefill=True)

    # -- one step -----------------------------------------------------------------------------
    def launch(self, prefills: list[ScheduledChunk], decodes: list[ScheduledChunk],
               verifies: list[ScheduledChunk] | None = None) -> StepHandle:
        """Enqueue one step on the device and return without waiting for it: the sampled ids (and
        logprobs) are on their way to pinned host memory; `collect()` waits for them. Sampled ids
        also stay on the device (`last_ids`), where the next step reads its placeholder tokens.

        Rows (the sequences that sample) are ordered decodes first, then prefill chunks. Every path
        writes each row's argmax into `last_ids` on the device (the CUDA graphs include it), which is
        the whole choice of rows with only temperature and penalties (the plan's ArgmaxChoice; the
        decode graph samples and penalizes); only a step with a row that asks for top-k/top-p or
        logprobs, or whose logits are edited otherwise (logit_bias, min_tokens: server/worker/logits.py),
        runs the general sampler. A step with a grammar-constrained row carries a `GrammarFill` and
        returns after the forward: the engine hands the fill to its grammar job, then calls
        `complete` (server/worker/grammar_rows.py, server/worker/choice.py).

        `verifies`: a speculative step's proposals, chunks whose every position samples; their rows
        come after the decodes' (server/worker/spec/verify.py)."""
        self._resolve()  # on the CPU, the last step's constrained choice: this forward reads its ids
        with torch.inference_mode():
            positions = offsets = None
            n_dec = len(decodes)
            if verifies:
                rows, positions, offsets = verify_rows(decodes, verifies, prefills)
            else:
                rows = [item.seq for item in decodes] + [item.seq for item in prefills if item.samples]
            # Planned before the forward: a new penalized row's count slot is set up first, and
            # the decode graph makes the plan's choice itself where it can (plan.choice).
            plan = None if all(s.plain for s in rows) else self._plan(rows, offsets, verify_slots(self, verifies, n_dec))
            # (not a constrained step's: its masks come after the forward, and a penalized row's
            # choice must not be counted before the grammar has had its say)
            choice = plan.choice if plan is not None and not plan.structured else None
            chosen = 0  # rows whose choice the decode graph made
            graph_size = 0
            if verifies:
                parts = verify_parts(self, decodes, verifies, prefills)
            elif self.graphs is not None and decodes and n_dec <= self.graphs.max_batch:
                # Decodes replay their graph; prefill chunks in the same step replay theirs (or run
                # eagerly) after it. Under steady traffic nearly every step admits a prompt:
                # running those steps wholly eager would give up the graphs exactly when the load
                # is highest.
                deferred = plan.choice if plan is not None and plan.structured else None
                parts = [self.graphs.run(decodes, self.block_size, choice, deferred)]
                chosen = n_dec
                if prefills:
                    parts.append(self._prefill(prefills, n_dec))
                elif deferred is not None:  # the choice after the fill can replay a graph (ChoiceGraphs)
                    graph_size = self.graphs.size_for(n_dec)
            elif not decodes:
                parts = [self._prefill(prefills, 0)]
            else:
                parts = [self._eager(prefills, decodes, 0)]
            handle = StepHandle(rows, scores=self.scores)
            self.scores = []
            if not rows:
                return self._finish_launch(handle)
            parts = [p for p in parts if p is not None]
            if plan is not None:
                handle.controls = plan.controls
                # each row's position: its last input token's (the sampler's noise counter)
                handle.positions = positions or ([it.start + it.num_tokens - 1 for it in decodes]
                                                 + [it.start + it.num_tokens - 1 for it in prefills if it.samples])
                if plan.structured:
                    if self.grammar is None:
                        self.grammar = GrammarBuffers(self.grammar_memory, self.device)
                        if self.graphs is not None:
                            self.choice_graphs = ChoiceGraphs(self.graphs, self.grammar, self.last_ids, self.counts,
                                                              self.model.vocab_size)
                    handle.grammar = self.grammar.next(len(rows))
                    handle.graph_size = graph_size
                    handle.parts, handle.plan = parts, plan
                    return handle
                if choice is not None:
                    argmax_choice(parts, choice, handle.positions, chosen, self.last_ids, self.counts,
                                  self.model.vocab_size)
                else:
                    self._sample(handle, parts)
            return self._finish_launch(handle)

    def _plan(self, rows: list[SeqState], offsets: list[int] | None = None,
              slots: dict[int, int] | None = None) -> RowsPlan:
        """How the step's rows choose their tokens, and their logits controls (server/worker/logits.py).
        Decoding steps keep the same rows step after step, and a row's parameters, bias and penalty
        slot do not change while its sequence runs: the previous step's plan serves again when the
        rows are the same sequences in the same order and none still waits on min_tokens (whose
        held-back ids depend on the count sampled). Building one is a Python pass over the rows and
        an upload, ~0.1 ms a step at 64 rows; checking the rows is one pass of identity tests.
        `slots`: a verification's rows whose penalties read a scratch slot (server/worker/spec/penalties.py),
        filled anew each step: such a plan is not kept."""
        last = self.last_plan
        if last is not None and len(last.rows) == len(rows) and all(map(operator.is_, last.rows, rows)):
            return last
        params = [s.params for s in rows]
        # Sampled so far, in-flight placeholders included (this step's is added after launch).
        sampled = [len(s.token_ids) - len(s.prompt_token_ids) for s in rows]
        if offsets is not None:  # a verification's row i samples its sequence's i-th token from here
            sampled = [n + i for n, i in zip(sampled, offsets)]
        pending = any(n < p.min_tokens for n, p in zip(sampled, params))
        controls = None
        if any(p.processes_logits for p in params):
            controls = StepControls.build(params, sampled, [s.request_id for s in rows],
                                          [s.prompt_token_ids for s in rows], self.stop_ids, self.counts, self.device,
                                          slots)
        structured = any(p.structured is not None for p in params)
        # The argmax kernel's own choice: temperature, noise, penalties and a grammar's masks, but no
        # other control, no top-k/top-p (a sort), no logprobs.
        choice = None
        if ((controls is None or (controls.bias is None and controls.masked is None))
                and all(p.logprobs is None and (p.greedy or (p.top_k <= 0 and p.top_p >= 1.0)) for p in params)):
            slot = (slots or {}).get
            choice = ArgmaxChoice([slot(r, self.counts.slots.get(s.request_id, -1)) if p.penalized else -1
                                   for r, (s, p) in enumerate(zip(rows, params))],
                                  inverse_temperatures(params), noise_keys(params, self.rng))
        plan = RowsPlan(list(rows), controls, structured=structured, choice=choice)
        self.last_plan = None if pending or slots else plan
        return plan

    def complete(self, handle: StepHandle) -> StepHandle:
        """Choose a constrained step's tokens from the masks its GrammarFill will hold. Called once
        the engine has handed that fill to the grammar job: on a GPU the choice is enqueued now,
        behind the device's wait for the job's flag (enqueued before the job exists, the wait
        could stall the host's next synchronizing call, and with it the job: a deadlock); on the
        CPU it stays pending until its ids are needed (see _resolve)."""
        parts, plan, handle.parts, handle.plan = handle.parts, handle.plan, None, None
        if not self.on_cuda:
            self.pending = (handle, parts, plan)
            return handle
        try:
            with torch.inference_mode():
                self._choose(handle, parts, plan, handle.grammar)
                self._finish_launch(handle)
        except Exception as e:  # collect() raises it: the engine fails the step
            handle.error = e
        return handle

    def _resolve(self, handle: StepHandle | None = None) -> None:
        """CPU: choose the pending constrained step's tokens (`handle`: only if it is that step)."""
        if self.pending is None or (handle is not None and self.pending[0] is not handle):
            return
        (pending, parts, plan), self.pending = self.pending, None
        try:
            if not pending.grammar.wait():
                why = "the grammar process is gone" if not pending.grammar.flag.alive() else "not in time"
                raise RuntimeError(f"the grammar masks of a constrained step were not filled: {why}")
            with torch.inference_mode():
                self._choose(pending, parts, plan, pending.grammar)
                self._finish_launch(pending)
        except Exception as e:  # collect() raises it: the engine fails the step
            pending.error = e
        for request_id in pending.released:
            self.release(request_id)

    def _choose(self, handle: StepHandle, parts: list[torch.Tensor], plan: RowsPlan, fill: GrammarFill) -> None:
        if plan.choice is not None and handle.graph_size and self.choice_graphs is not None:
            self.choice_graphs.run(handle.graph_size, fill)  # (None if their capture failed: that step failed)
            return
        bits, live = self.grammar.masks(fill, len(handle.rows))
        if plan.choice is not None:
            argmax_choice(parts, plan.choice, handle.positions, 0, self.last_ids, self.counts, self.model.vocab_size,
                          (bits, live, self.grammar.covered))
        else:
            self._sample(handle, parts, GrammarMask(bits, live, self.grammar.covered))

    def _finish_launch(self, handle: StepHandle) -> StepHandle:
        """The step's ids (and logprobs) on their way to the host; an event to wait for them."""
        n = len(handle.rows)
        if n:
            self.flip = 1 - self.flip
            handle.ids = self._to_host(self.last_ids[:n], self.host_ids[self.flip][:n])
        if self.on_cuda:
            handle.event = torch.cuda.Event()
            handle.event.record()
        return handle

    def _sample(self, handle: StepHandle, parts: list[torch.Tensor], grammar: GrammarMask | None = None) -> None:
        """The general sampler (logits controls, temperature, top-k/p, seeds, logprobs) over the
        step's logits (raw LM-head rows, in row order); its ids replace the greedy ones in
        `last_ids`. Logprobs are the model's own distribution, before any control (vLLM's default)."""
        rows = handle.rows
        raw = (torch.cat(parts) if len(parts) > 1 else parts[0])[:, : self.model.vocab_size].float()
        logits, c = raw, handle.controls
        want = [s.params.logprobs for s in rows]
        if (c is not None and not c.empty) or grammar is not None:
            # The controls edit in place: a copy only where logprobs need the raw rows (else raw is
            # the step's own fp32 copy, or a view of a graph's output buffer the next replay rewrites).
            logits = raw.clone() if any(w is not None for w in want) else raw
            (c or StepControls()).apply(logits, self.counts, grammar)
        invariant = self.model.deterministic
        params = [s.params for s in rows]
        ids, _ = sample(logits, params, noise_keys(params, self.rng), handle.positions, invariant=invariant)
        logprobs = None
        if any(w is not None for w in want):  # per-row bits independent of the batch where asked
            logprobs = log_softmax(raw, invariant)
        self.last_ids[: len(rows)].copy_(ids)
        if c is not None and c.penalty is not None:
            self.counts.add(c.penalty[1], ids[c.penalty[0]])
        handle.want = want
        if logprobs is not None:
            k = max(max(w or 0 for w in want), 1)
            chosen = logprobs.gather(1, ids[:, None])
            top_v, top_i = top_logprobs(logprobs, k, invariant)
            packed = torch.cat([chosen, top_i.float(), top_v], dim=1)
            handle.top = self._to_host(packed, torch.empty(packed.shape, pin_memory=self.on_cuda))
            handle.k = k

    def _greedy(self, raw: torch.Tensor, row0: int) -> None:
        """last_ids[row0 : row0 + len(raw)] = argmax of each raw logits row over the vocabulary."""
        out = self.last_ids[row0 : row0 + raw.shape[0]]
        if self.on_cuda:
            argmax_rows(raw, self.model.vocab_size, out=out)
        else:
            out.copy_(raw[:, : self.model.vocab_size].argmax(dim=-1))

    def _prefill(self, prefills: list[ScheduledChunk], row0: int, graphs=None, rows: int = 0) -> torch.Tensor | None:
        """Raw logits of the prefill chunks that sample (greedy ids into last_ids from row row0):
        from a captured graph where one fits (and no chunk scores its prompt). `graphs`, `rows`: a
        speculative step's verification graphs and its rows (server/worker/spec/verify.py)."""
        graphs = graphs or self.prefill_graphs
        if graphs is not None and graphs.fits(prefills, rows) and not any(map(wants_scores, prefills)):
            logits = graphs.run(prefills, self.block_size)
            if logits is not None:
                self.last_ids[row0 : row0 + logits.shape[0]].copy_(graphs.ids[: logits.shape[0]])
            return logits
        return self._eager(prefills, [], row0)

    def _eager(self, prefills: list[ScheduledChunk], decodes: list[ScheduledChunk], row0: int) -> torch.Tensor | None:
        """Run the step without graphs: raw logits of the rows that sample (None if none does),
        their greedy ids into last_ids from row row0."""
        step = prepare_step(self.packer, prefills, decodes, self.block_size, self.model.attention, self.gather_blocks)
        scored = any(map(wants_scores, prefills))
        if self.peers is not None:  # the other ranks' same forward and LM-head calls
            self.peers.eager(self.packer, step.rows, head_slices(prefills) if scored else [])
        hidden = self.forward(self.kv_caches, step.input_ids, step.positions, step.rows, sampled_ids=self.last_ids)
        if scored:
            self.scores += score_chunks(self.model.lm_head, hidden, prefills, self.model.vocab_size, self.on_cuda,
                                        self.model.deterministic)
        if not len(step.ends):
            return None
        logits = self.model.lm_head(hidden[step.ends])
        self._greedy(logits, row0)
        return logits

    def _to_host(self, src: torch.Tensor, pinned: torch.Tensor) -> torch.Tensor:
        if not self.on_cuda:
            return src.clone()
        pinned.copy_(src, non_blocking=True)
        return pinned

    def collect(self, handle: StepHandle) -> StepResult:
        """Wait for a launched step; return the sampled token of each row (in batch order) and, where
        requests asked for logprobs, the chosen token's and the top alternatives'."""
        self._resolve(handle)
        if handle.error is not None:
            raise handle.error
        if handle.event is not None:
            handle.event.synchronize()  # releases the GIL while the device finishes
        prompt = [unpack(s) for s in handle.scores]
        if handle.ids is None:
            return StepResult([], prompt_logprobs=prompt)
        ids = handle.ids.tolist()
        if handle.top is None:
            return StepResult(ids, prompt_logprobs=prompt)
        k, top = handle.k, []
        for j, (r, w) in enumerate(zip(handle.top.tolist(), handle.want)):
            w = w or 0
            top.append([(ids[j], r[0])] + [(int(t), v) for t, v in zip(r[1 : 1 + w], r[1 + k : 1 + k + w])])
        return StepResult(ids, top, prompt)

    def release(self, request_id: str) -> None:
        if self.pending is not None and any(s.request_id == request_id for s in self.pending[0].rows):
            self.pending[0].released.append(request_id)  # its pending choice would count its token again
            return
        self.counts.release(request_id)
