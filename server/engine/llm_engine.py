"""The synchronous engine: requests in, one `step()` at a time, outputs out.

A step schedules a batch (server/engine/scheduler.py), launches it on the worker
(server/worker/runner.py), and turns the previous step's sampled tokens into outputs: detokenized
incrementally, checked against the stop rule (server/engine/stop.py), finished requests' blocks
freed. The bridge (server/bridge/) calls `step()` from the engine process or a thread; nothing here
is async or knows about HTTP, and nothing here knows which model family runs.
"""

from __future__ import annotations

import heapq
import logging
import time
from dataclasses import dataclass

from kvcache import BlockManager, dtype_name
from models import eos_token_ids, load_tokenizer, resolve_model_path
from server.config import EngineConfig
from server.engine.detokenize import Detokenizer
from server.engine.faults import FaultInjector
from server.engine.outputs import EngineSnapshot, RequestOutput, failed_output, packed_prompt_logprobs
from server.engine.requests import EngineFatalError, RequestBounds, RequestError, validate_request
from server.engine.scheduler import Scheduler, SchedulerOutput
from server.engine.sequence import Sequence, Status
from server.engine.spec import make_speculator
from server.engine.grammar_admission import GrammarAdmission
from server.engine.grammar_compile import CompileSetup, CompileTimeout
from server.engine.grammar_process import GrammarProcess, mask_memory
from server.engine.stats import StatsHooks
from server.engine.stop import ABORT, ERROR, LENGTH, REFUSED, TIMEOUT, advance
from server.sampling_params import SamplingParams
from server.worker import StepHandle, start_worker

log = logging.getLogger("flashpage.engine")


@dataclass(slots=True)
class LaunchFailure:
    """A batch whose launch raised: step() fails its requests after finishing the step in flight."""

    batch: SchedulerOutput
    error: Exception


class LLMEngine:
    MAX_CONSECUTIVE_STEP_FAILURES = 3  # then step() raises EngineFatalError

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        path = resolve_model_path(config.model)
        self.model_name = config.served_model_name or (config.model or "flashpage-embedded")
        self.tokenizer = load_tokenizer(path)
        worker = start_worker(config, path, self.tokenizer)
        self.cache_spec = worker.cache_spec  # what the cache stores (its dtype) and a block's bytes
        self.device, self.spec, self.max_model_len = worker.device, worker.spec, worker.max_model_len
        self.runner = worker.runner
        # what /v1/models reports of the weights: their format (None: 16-bit) and bytes on the device
        self.quantization, self.weight_bytes = worker.weights.quantization, worker.weights.bytes
        self.block_manager = BlockManager(worker.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config)
        self.speculator = make_speculator(config, self.block_manager, self.max_model_len, worker)  # None: off
        # The tokenizer's EOS and every one the checkpoint declares (generation_config.json).
        eos = eos_token_ids(path) + [self.tokenizer.eos_token_id]
        self.eos_token_ids = frozenset(i for i in eos if i is not None)
        self.runner.stop_ids = self.eos_token_ids  # what min_tokens holds back
        self.model_path = path
        self._grammars: GrammarProcess | None = None  # started when the first structured request comes
        self._mask_fd = -1  # the memory it fills masks into (a memfd), made with it, kept for a restart
        limits = config.structured  # structured requests held out of the queue until their matcher is made
        self.admission = GrammarAdmission(CompileSetup(path, self.spec.vocab_size, tuple(sorted(self.eos_token_ids)),
                                                       limits.structured_cache_memory), limits)
        self.detokenizer = Detokenizer(self.tokenizer)
        self.seqs: dict[str, Sequence] = {}
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        self.consecutive_step_failures = 0
        self.faults = FaultInjector.from_env()  # test-only (server/engine/faults.py); None in production
        self.stats: StatsHooks | None = None  # the metrics (server/api/metrics.py) or the engine process's recorder
        self.inflight: tuple[SchedulerOutput, StepHandle] | None = None  # launched, not yet turned into outputs
        self.deadlines: list[tuple[float, str]] = []  # heap of (deadline, request id); stale entries skipped

    # -- requests -----------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        validate_request(prompt_token_ids, params, self.limits())

    @property
    def grammars(self) -> GrammarProcess:
        """The grammar process (server/engine/grammar_process.py): started by the first structured
        request, and again by the next one if it died (its sequences then fail, step by step)."""
        proc = self._grammars
        if proc is not None and proc.alive:
            return proc
        if proc is not None:
            log.error("the grammar process exited (code %s); starting another", proc.proc.poll())
            proc.close()
        if self._mask_fd < 0:
            # The tokenizer's ids only: rows of the logits past them (padding) are never text.
            covered = min(self.spec.vocab_size, len(self.tokenizer))
            self._mask_fd, self.runner.grammar_memory = mask_memory(
                self.config.max_num_seqs, covered, lambda: self._grammars is not None and self._grammars.alive)
        self._grammars = GrammarProcess(self.model_path, self.spec.vocab_size, self.eos_token_ids, self._mask_fd,
                                        self.runner.grammar_memory, owed=proc.abandon() if proc is not None else None,
                                        cache_bytes=self.config.structured.structured_cache_memory,
                                        compile_timeout=self.config.structured.structured_compile_timeout)
        if self.faults is not None and self.faults.compile_sleep:  # tests only
            self._grammars.slow_compiles(self.faults.compile_sleep, self.faults.compile_marker)
        return self._grammars

    def limits(self) -> RequestBounds:
        """What validation needs to know, also sent to an API process that runs this engine in
        another process (server/bridge/engine_process.py)."""
        return RequestBounds(self.spec.vocab_size, self.max_model_len, self.block_manager.block_size,
                             self.block_manager.num_blocks, tuple(sorted(self.eos_token_ids)))

    def snapshot(self) -> EngineSnapshot:
        """Counters and gauges for /metrics and /debug/kv; cheap (a few len() calls)."""
        sched, bm = self.scheduler, self.block_manager
        prefix = bm.allocator.stats
        return EngineSnapshot(running=len(sched.running), waiting=len(sched.waiting) + len(self.admission.held),
                              sequences=len(self.seqs),
                              preemptions=sched.num_preemptions, kv_blocks_total=bm.num_blocks,
                              kv_blocks_free=bm.num_free_blocks, prefix_queries=prefix.queries,
                              prefix_hits=prefix.hits, prompt_tokens=self.num_prompt_tokens,
                              generation_tokens=self.num_generated_tokens,
                              kv_cache_dtype=dtype_name(self.cache_spec.dtype), kv_block_size=bm.block_size,
                              kv_bytes_per_token=self.cache_spec.bytes_per_block // bm.block_size,
                              **(self.speculator.snapshot() if self.speculator is not None else {}))

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    validated: bool = False, deadline: float | None = None) -> None:
        """Queue a request. `validated`: the caller already ran validate_request with this engine's
        bounds (the bridge does, before queueing), so it is not checked twice. `deadline`: a
        time.monotonic() past which the request ends with finish_reason "timeout"."""
        if request_id in self.seqs:
            raise RequestError(f"duplicate request id {request_id!r}")
        if not validated:
            self.validate(prompt_token_ids, params)
        seq = Sequence(request_id, list(prompt_token_ids), params, deadline=deadline)
        if self.speculator is not None:
            seq.spec = self.speculator.state(params)
        if params.structured is not None:  # (offline callers' specs checked here: RequestError)
            self.admission.admit(seq, lambda: self.grammars, checked=validated)  # held until its matcher is made
        self.seqs[request_id] = seq
        if seq.compiling is None:
            self.scheduler.add(seq)
        if deadline is not None:
            heapq.heappush(self.deadlines, (deadline, request_id))

    def abort_request(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self._retire(seq, ABORT)

    def _retire(self, seq: Sequence, reason: str) -> None:
        """Every way a request ends (server/engine/stop.py) goes through here: blocks freed,
        per-request state dropped, metrics told."""
        self.scheduler.finish(seq, reason)
        self.seqs.pop(seq.request_id, None)
        self.runner.release(seq.request_id)
        if self._grammars is not None and seq.grammar is not None:
            self._grammars.drop(seq.grammar)
        elif self._grammars is not None and seq.compiling is not None:  # its matcher may still be in the making
            self._grammars.drop(seq.compiling.key, answered=False, spec=seq.compiling.spec)
        if self.stats is not None:
            now = time.monotonic()
            n = len(seq.output_token_ids)
            tpot = (now - seq.first_token_time) / (n - 1) if n > 1 and seq.first_token_time is not None else None
            self.stats.finished(now - seq.arrival_time, tpot, str(reason))

    def close(self) -> None:
        """Give back the GPU memory (CUDA graphs, KV cache) so that another engine fits in this
        process (the draft's too); stop the grammar process."""
        if self.speculator is not None:
            self.speculator.close()
        self.runner.close()
        if self._grammars is not None:
            self._grammars.close()
            self._grammars = None
        self.admission.close()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self.inflight is not None or bool(self.admission.held)

    def _expire(self) -> list[RequestOutput]:
        """End every request whose deadline has passed (queued or running), with the text so far."""
        outputs, now, heap = [], time.monotonic(), self.deadlines
        while heap and heap[0][0] <= now:
            _, rid = heapq.heappop(heap)
            seq = self.seqs.get(rid)
            if seq is None or seq.deadline is None or seq.deadline > now:
                continue  # ended already (its entry is stale), or an id reused with a later deadline
            new_text, seq.emitted = seq.text[seq.emitted :], len(seq.text)
            self._retire(seq, TIMEOUT)
            outputs.append(RequestOutput(rid, new_text, [], True, TIMEOUT, prompt_tokens=len(seq.prompt_token_ids),
                                         completion_tokens=len(seq.output_token_ids), text=seq.text,
                                         token_ids=seq.output_token_ids, cached_prompt_tokens=seq.num_cached_prompt))
        return outputs

    def _compiled(self, wait: bool) -> list[RequestOutput]:
        """Queue each held request whose matcher is made (server/engine/grammar_admission.py); one
        whose compile failed ends with finish_reason "error", one whose compile ran past the
        deadline with "refused" (the client's 400, server/engine/grammar_process.py)."""
        outputs = []
        for seq, error in self.admission.made(self._grammars, wait):
            if error is None:
                self.scheduler.add(seq)
            elif isinstance(error, CompileTimeout):  # refused, as the API process refuses one
                self._retire(seq, REFUSED)
                outputs.append(failed_output(seq, str(error), REFUSED))
            else:
                outputs.append(self._fail(seq, f"the request's grammar failed to compile: {error}"))
        return outputs

    # -- the step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and launch a step, then turn the sampled tokens of the step launched before it
        into outputs (asynchronous scheduling: the host works on step k-1's results while the
        device runs step k). With `async_scheduling` off, a step's own results come back at once.
        Requests past their deadline end first, so that no step is spent on them.

        A step with grammar-constrained rows is launched like any other; its masks are filled by
        the grammar process, sent the job once step k-1's ids are in (server/engine/grammar_process.py),
        and the device waits for them before choosing (server/worker/grammar_rows.py)."""
        expired = self._expire() if self.deadlines else []
        if self.admission.held:
            expired += self._compiled(wait=not self.scheduler.running and self.inflight is None)
        if self.speculator is not None and self.speculator.finish_first(self.inflight, self.scheduler.running):
            expired += self._finish(self.inflight)
        launched = self._launch()
        if isinstance(launched, LaunchFailure):
            return expired + self._finish(self.inflight) + self._fail_step(launched.batch, launched.error)
        if self.config.async_scheduling:
            outputs = self._finish(self.inflight, launched)
            self.inflight = launched
        else:
            outputs = self._finish(launched, launched)
        if self._grammars is not None and (self.inflight is None or self.inflight[1].grammar is None):
            self._grammars.flush()  # no job is on its way to carry the matchers made and dropped
        return expired + outputs if expired else outputs

    def _launch(self) -> tuple[SchedulerOutput, StepHandle] | LaunchFailure | None:
        """Schedule a batch and launch it (None: nothing to run)."""
        batch = self.scheduler.schedule()
        if batch.is_empty:
            return None
        try:
            if self.faults is not None:
                self.faults.before_step(batch)
            if self.speculator is not None:
                self.speculator.extend(batch, len(self.scheduler.running), self._grammars)
            launched = (batch, self.runner.launch(batch.prefills, batch.decodes, batch.verifies))
        except Exception as e:
            if self.config.tensor_parallel_size > 1:  # the other ranks may wait in the step's collectives for good
                raise EngineFatalError(f"a step failed under tensor parallelism, which cannot go on: {e!r}") from e
            return LaunchFailure(batch, e)
        self.scheduler.after_step(batch)
        max_len = self.max_model_len
        rows = launched[1].rows
        for row, seq in enumerate(rows) if not batch.verifies else self.speculator.placeholder_rows(batch, rows):
            seq.add_placeholder(row)
            n = len(seq.token_ids)  # sampled so far, in flight included: n - prompt length
            seq.capped = n - len(seq.prompt_token_ids) >= seq.params.max_tokens or n >= max_len
        return launched

    def _submit_grammar(self, tokens: list[int] | None, launched: tuple[SchedulerOutput, StepHandle] | None) -> None:
        """Send the grammar process the ids the last constrained step sampled (its matchers take
        them) and the masks of a constrained step to fill; then let the runner choose that step's
        tokens (behind a wait for the fill)."""
        handle = launched[1] if launched is not None and launched[1].parts is not None else None
        if tokens is None and handle is None:
            return
        step = None if handle is None else handle.grammar.step
        drafts = self.speculator.grammar_drafts(launched[0]) if handle is not None and launched[0].verifies else None
        try:  # (the process the rows were sent to: a dead one is replaced only by the next request)
            self._grammars.job(step, tokens, None if handle is None else handle.rows, drafts)
        except RuntimeError as e:  # the process is gone: this step and those it owed fail when collected
            log.error("%s", e)
            self._grammars.abandon(step)
        if handle is not None:
            self.runner.complete(handle)

    def _finish(self, launched: tuple[SchedulerOutput, StepHandle] | None,
                fill: tuple[SchedulerOutput, StepHandle] | None = None) -> list[RequestOutput]:
        """Wait for a launched step's sampled ids and advance its sequences with them. The grammar
        thread gets the ids first, then the masks of `fill` (the step just launched, when it has
        constrained rows) to fill: on sync scheduling the same step, whose ids wait for them."""
        self.inflight = None
        if launched is fill:  # sync: the masks first, or collect would wait for them forever
            self._submit_grammar(None, fill)
            fill = None
        if launched is None:
            self._submit_grammar(None, fill)
            return []
        batch, handle = launched
        broken = {}
        try:
            result = self.runner.collect(handle)
            if handle.grammar is not None:  # the device (or the CPU) waited for its flag: did the fill fail?
                self._grammars.check(handle.grammar.step)
                self._grammars.drain()
                broken = self._grammars.broken  # matchers that could not be made: those rows ran free
        except Exception as e:
            self._submit_grammar(None, fill)
            return self._fail_step(batch, e)
        self.consecutive_step_failures = 0
        grammar_ids = result.token_ids if handle.grammar is not None else None
        rows, ids, top = handle.rows, result.token_ids, result.logprobs
        if batch.verifies:  # each verification's rows become its accepted run (server/engine/spec/)
            rows, ids, top, grammar_ids = self.speculator.settle(batch, rows, ids, top, grammar_ids)
        # the grammars take the ids first: the step just launched waits for them
        self._submit_grammar(grammar_ids, fill)
        outputs = []
        if broken:  # (after the job: the step just launched has their rows; their tokens are dropped)
            outputs = [self._fail(seq, f"the request's grammar failed: {broken[seq.grammar]}")
                       for seq in handle.rows if seq.grammar in broken and seq.status is not Status.FINISHED]
        now = time.monotonic()
        advance = self._advance
        for scored in result.prompt_logprobs:  # arrays: nothing here is built per prompt token
            scored.seq.take_scores(scored.first, scored.token_ids, scored.logprobs)
        for j, (seq, tok) in enumerate(zip(rows, ids)):
            if seq.status is Status.FINISHED:  # stopped, aborted or failed while this step was in flight
                continue
            if seq.params.max_tokens == 0:  # scored the prompt only: its sampled token is dropped
                self._retire(seq, LENGTH)
                outputs.append(RequestOutput(seq.request_id, "", [], True, LENGTH,
                                             prompt_tokens=len(seq.prompt_token_ids),
                                             prompt_logprobs=packed_prompt_logprobs(seq)))
                continue
            seq.resolve(tok)
            if seq.first_token_time is None:
                seq.first_token_time = now
                self.num_prompt_tokens += len(seq.prompt_token_ids)
                if self.stats is not None:
                    self.stats.first_token(now - seq.arrival_time)
            logprob = None
            if top is not None and seq.params.logprobs is not None:
                logprob = top[j]
                seq.logprobs.append(logprob)
            outputs.append(advance(seq, tok, logprob))
        self.num_generated_tokens += len(outputs)
        if self.stats is not None:  # decodes are one token each; only the (few) prefill chunks are summed
            self.stats.step(len(batch.decodes) + len(batch.prefills) + len(batch.verifies),
                            len(batch.decodes) + sum(s.num_tokens for s in batch.prefills)
                            + sum(v.num_tokens for v in batch.verifies), now)
        return outputs

    def _fail_step(self, batch: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        """The model run failed: finish what it scheduled with reason "error" (freeing their
        blocks; nothing of this step reaches the prefix cache) and carry on, unless steps keep failing."""
        self.consecutive_step_failures += 1
        n = self.consecutive_step_failures
        log.error("engine step failed (%d in a row): %r; failing %d request(s)", n, exc, len(batch.scheduled),
                  exc_info=exc)
        message = f"the engine step running this request failed: {type(exc).__name__}: {exc}"
        outputs = [self._fail(item.seq, message) for item in batch.scheduled + batch.verifies
                   if not item.seq.is_finished]
        if n >= self.MAX_CONSECUTIVE_STEP_FAILURES:
            raise EngineFatalError(f"{n} consecutive engine steps failed; last: {exc!r}") from exc
        return outputs

    def _fail(self, seq: Sequence, message: str) -> RequestOutput:
        """End a request with finish_reason "error", with what it produced so far."""
        self._retire(seq, ERROR)
        return failed_output(seq, message)

    def _advance(self, seq: Sequence, tok: int, logprob) -> RequestOutput:
        out = advance(seq, tok, logprob, self.eos_token_ids, self.max_model_len, self.detokenizer)
        if out.finished:
            self._retire(seq, out.finish_reason)
        return out

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
        """Offline helper: run prompts to completion, return the final outputs in order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"offline-{id(self)}-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
        final, scores = {}, {}
        while len(final) < len(ids):
            for out in self.step():
                if out.prompt_logprobs is not None:  # on a request's first output only
                    scores[out.request_id] = out.prompt_logprobs
                if out.finished:
                    final[out.request_id] = out
        for r in ids:
            final[r].prompt_logprobs = scores.get(r)
        return [final[r] for r in ids]
