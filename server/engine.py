"""The synchronous engine: requests in, one `step()` at a time, outputs out.

A step schedules a batch, runs it, appends sampled tokens, detokenizes incrementally, applies stop
conditions and frees finished requests' blocks. The asyncio wrapper (server/async_engine.py) calls
`step()` from a worker thread; nothing here is async or knows about HTTP.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from kvcache import BlockManager, CacheSpec, blocks_for
from models import DTYPES, load_config, load_model, load_tokenizer, resolve_model_path
from server.config import EngineConfig
from server.detokenize import Detokenizer, find_stop
from server.faults import FaultInjector
from server.model_runner import ModelRunner
from server.sampling import SamplingParams
from server.scheduler import Scheduler
from server.sequence import Sequence, Status

log = logging.getLogger("flashpage.engine")


def merge_outputs(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """a then b (same request) as one output: the deltas concatenated, everything cumulative from b.
    Where a consumer falls behind, its waiting outputs merge this way (the HTTP side's collectors,
    the engine process's outbox)."""
    b.new_text = a.new_text + b.new_text
    b.new_token_ids = a.new_token_ids + b.new_token_ids
    b.new_logprobs = a.new_logprobs + b.new_logprobs
    return b


class RequestError(ValueError):
    """A request the engine cannot serve as asked; the message says why (HTTP 400)."""


class EngineFatalError(RuntimeError):
    """Steps keep failing: the engine cannot continue (the server reports unhealthy and exits)."""


@dataclass
class RequestOutput:
    request_id: str
    new_text: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    new_logprobs: list = field(default_factory=list)
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cached_prompt_tokens: int = 0
    error: str | None = None  # with finish_reason "error": what failed


@dataclass(frozen=True)
class RequestBounds:
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int


def validate_request(prompt_token_ids: list[int], params: SamplingParams, b: RequestBounds) -> None:
    """Raise RequestError if the engine cannot serve this request as asked. Read-only, so the
    HTTP side calls it before queueing."""
    n, vocab = len(prompt_token_ids), b.vocab_size
    if n == 0:
        raise RequestError("the prompt is empty: give at least one token")
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise RequestError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
    bad = next((t for t in params.stop_token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise RequestError(f"stop token id {bad} is outside the vocabulary [0, {vocab})")
    if n + params.max_tokens > b.max_model_len:
        raise RequestError(
            f"prompt has {n} tokens and max_tokens is {params.max_tokens}: {n + params.max_tokens} "
            f"exceeds the model's context of {b.max_model_len} tokens")
    need = blocks_for(n + params.max_tokens, b.block_size)
    if need > b.num_blocks:
        raise RequestError(f"request needs {need} KV blocks but the whole cache has {b.num_blocks}")


class LLMEngine:
    MAX_CONSECUTIVE_STEP_FAILURES = 3  # then step() raises EngineFatalError

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        path = resolve_model_path(config.model)
        self.model_name = config.served_model_name or (config.model or "flashpage-embedded")
        self.hf_config = load_config(path)
        self.tokenizer = load_tokenizer(path)
        dtype = DTYPES[config.dtype] if config.dtype != "auto" else (torch.float16 if self.device.type == "cuda" else torch.float32)
        attention = config.attention or ("triton" if self.device.type == "cuda" else "sdpa")
        if attention == "triton" and dtype == torch.float32:
            raise ValueError("--attention triton runs in float16 or bfloat16: pass --dtype float16/bfloat16, "
                             "or use --attention sdpa for float32")
        log.info("loading weights from %s (%s, attention=%s, device=%s)", path, dtype, attention, self.device)
        self.model = load_model(path, dtype, self.device, attention)
        self.max_model_len = min(config.max_model_len or self.hf_config.n_positions, self.hf_config.n_positions)
        c = self.hf_config
        spec = CacheSpec(c.n_layer, c.n_head, c.n_embd // c.n_head, config.block_size, dtype)
        self.runner = ModelRunner(self.model, spec, self.device, config.max_num_seqs,
                                  config.max_num_batched_tokens, self.max_model_len)
        num_blocks = self._num_blocks(spec)
        log.info("KV cache: %d blocks of %d tokens (%.1f MiB); %d concurrent full-length (%d-token) sequences",
                 num_blocks, spec.block_size, num_blocks * spec.bytes_per_block / 2**20,
                 num_blocks * spec.block_size // self.max_model_len, self.max_model_len)
        self.runner.allocate_cache(num_blocks)
        self.block_manager = BlockManager(num_blocks, spec.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_chunked_prefill, config.max_admit_delay)
        if self.device.type == "cuda":
            t0 = time.monotonic()
            self.runner.warmup()
            log.info("compiled and warmed up the attention kernels in %.1f s", time.monotonic() - t0)
        if self.device.type == "cuda" and not config.enforce_eager:
            log.info("capturing decode CUDA graphs")
            self.runner.capture_graphs()
        self.eos_token_id = self.tokenizer.eos_token_id
        self.detokenizer = Detokenizer(self.tokenizer)
        self.seqs: dict[str, Sequence] = {}
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        self.consecutive_step_failures = 0
        self.faults = FaultInjector.from_env()  # test-only (server/faults.py); None in production
        self.stats = None  # server/metrics.EngineStats (or the engine process's recorder): first_token / finished / step
        self.inflight = None  # (batch, StepHandle) launched but not yet turned into outputs

    def _num_blocks(self, spec: CacheSpec) -> int:
        cfg = self.config
        if cfg.num_blocks:
            return cfg.num_blocks
        if cfg.kv_cache_memory:
            return spec.blocks_for_budget(cfg.kv_cache_memory)
        if self.device.type == "cuda":
            # Size from what is left under the utilisation cap after weights and the activations of
            # the largest possible step (measured by running it), as vLLM does.
            peak = self.runner.profile_peak_memory()
            torch.cuda.empty_cache()  # the cache is one allocation: free segments must be given back first
            free, total = torch.cuda.mem_get_info(self.device)
            in_use_elsewhere = total - free - torch.cuda.memory_reserved(self.device)
            budget = cfg.gpu_memory_utilization * total - peak - in_use_elsewhere
            log.info("memory: %.2f GiB total, peak step %.2f GiB, other processes %.2f GiB -> KV budget %.2f GiB",
                     total / 2**30, peak / 2**30, in_use_elsewhere / 2**30, budget / 2**30)
            return spec.blocks_for_budget(int(budget))
        return spec.blocks_for_budget(512 * 2**20)  # CPU default: 512 MiB

    # -- requests -----------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        validate_request(prompt_token_ids, params, self.limits())

    def limits(self) -> RequestBounds:
        """What validation needs to know, also sent to an API process that runs this engine in
        another process (server/engine_process.py)."""
        return RequestBounds(self.hf_config.vocab_size, self.max_model_len, self.block_manager.block_size,
                             self.block_manager.num_blocks)

    def snapshot(self) -> dict:
        """Counters and gauges for /metrics and /debug/kv; cheap (a few len() calls)."""
        sched, bm = self.scheduler, self.block_manager
        prefix = bm.allocator.stats
        return {"running": len(sched.running), "waiting": len(sched.waiting), "sequences": len(self.seqs),
                "preemptions": sched.num_preemptions, "kv_blocks_total": bm.num_blocks,
                "kv_blocks_free": bm.num_free_blocks, "prefix_queries": prefix.queries, "prefix_hits": prefix.hits,
                "prompt_tokens": self.num_prompt_tokens, "generation_tokens": self.num_generated_tokens}

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self.seqs:
            raise RequestError(f"duplicate request id {request_id!r}")
        self.validate(prompt_token_ids, params)
        seq = Sequence(request_id, list(prompt_token_ids), params)
        self.seqs[request_id] = seq
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self._retire(seq, "abort")

    def _retire(self, seq: Sequence, reason: str) -> None:
        """Every way a request ends (stop, length, abort, error) goes through here: blocks freed,
        per-request state dropped, metrics told."""
        self.scheduler.finish(seq, reason)
        self.seqs.pop(seq.request_id, None)
        self.runner.release(seq.request_id)
        if self.stats is not None:
            now = time.monotonic()
            n = len(seq.output_token_ids)
            tpot = (now - seq.first_token_time) / (n - 1) if n > 1 and seq.first_token_time is not None else None
            self.stats.finished(now - seq.arrival_time, tpot, str(reason))

    def close(self) -> None:
        """Give back the GPU memory (CUDA graphs, KV cache) so that another engine fits in this process."""
        import gc

        self.runner.graphs = self.runner.prefill_graphs = None
        self.runner.kv_caches = []
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self.inflight is not None

    # -- the step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and launch a step, then turn the sampled tokens of the step launched before it
        into outputs (asynchronous scheduling: the host works on step k-1's results while the
        device runs step k). With `async_scheduling` off, a step's own results come back at once."""
        batch = self.scheduler.schedule()
        launched = None
        if not batch.is_empty:
            try:
                if self.faults is not None:
                    self.faults.before_step(batch)
                launched = (batch, self.runner.launch(batch))
            except Exception as e:
                return self._finish(self.inflight) + self._fail_step(batch, e)
            self.scheduler.after_step(batch)
            max_len = self.max_model_len
            for row, seq in enumerate(launched[1].rows):
                seq.add_placeholder(row)
                n = len(seq.token_ids)  # sampled so far, in flight included: n - prompt length
                seq.capped = n - len(seq.prompt_token_ids) >= seq.params.max_tokens or n >= max_len
        if self.config.async_scheduling:
            outputs, self.inflight = self._finish(self.inflight), launched
            return outputs
        return self._finish(launched)

    def _finish(self, launched) -> list[RequestOutput]:
        """Wait for a launched step's sampled ids and advance its sequences with them."""
        self.inflight = None
        if launched is None:
            return []
        batch, handle = launched
        try:
            token_ids, top = self.runner.collect(handle)
        except Exception as e:
            return self._fail_step(batch, e)
        self.consecutive_step_failures = 0
        outputs = []
        now = time.monotonic()
        advance = self._advance
        for j, (seq, tok) in enumerate(zip(handle.rows, token_ids)):
            if seq.status is Status.FINISHED:  # stopped, aborted or failed while this step was in flight
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
            self.stats.step(len(batch.decodes) + len(batch.prefills),
                            len(batch.decodes) + sum(s.num_tokens for s in batch.prefills), now)
        return outputs

    def _fail_step(self, batch, exc: Exception) -> list[RequestOutput]:
        """The model run failed: finish what it scheduled with reason "error" (freeing their
        blocks; nothing of this step reaches the prefix cache) and carry on, unless steps keep failing."""
        self.consecutive_step_failures += 1
        n = self.consecutive_step_failures
        log.error("engine step failed (%d in a row): %r; failing %d request(s)", n, exc, len(batch.scheduled),
                  exc_info=exc)
        message = f"the engine step running this request failed: {type(exc).__name__}: {exc}"
        outputs = []
        for item in batch.scheduled:
            seq = item.seq
            if seq.is_finished:
                continue
            self._retire(seq, "error")
            outputs.append(RequestOutput(seq.request_id, "", [], True, "error", len(seq.prompt_token_ids),
                                         len(seq.output_token_ids), text=seq.text,
                                         token_ids=list(seq.output_token_ids), error=message))
        if n >= self.MAX_CONSECUTIVE_STEP_FAILURES:
            raise EngineFatalError(f"{n} consecutive engine steps failed; last: {exc!r}") from exc
        return outputs

    def _advance(self, seq: Sequence, tok: int, logprob) -> RequestOutput:
        p = seq.params
        reason = None
        if (not p.ignore_eos and tok == self.eos_token_id) or tok in p.stop_token_ids:
            reason = "stop"
        elif len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        decoded = self.detokenizer.step(seq, final=reason is not None)
        if p.stop and decoded:
            cut = find_stop(seq.text, len(decoded), p.stop)
            if cut is not None:
                seq.text = seq.text[:cut]
                reason = "stop"
        # Hold back the tail that could still become the start of a stop string, so that streamed
        # text never contains what the final text cuts.
        hold = 0 if reason is not None or not p.stop else max(map(len, p.stop)) - 1
        end = max(seq.emitted, len(seq.text) - hold)
        new_text, seq.emitted = seq.text[seq.emitted : end], end
        if reason is not None:
            self._retire(seq, reason)
        return RequestOutput(
            seq.request_id, new_text, [tok], reason is not None, reason, len(seq.prompt_token_ids),
            len(seq.output_token_ids), [logprob] if logprob is not None else [], seq.text,
            seq.output_token_ids, seq.num_cached_prompt)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
        """Offline helper: run prompts to completion, return the final outputs in order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"offline-{id(self)}-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
        final = {}
        while len(final) < len(ids):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[r] for r in ids]
