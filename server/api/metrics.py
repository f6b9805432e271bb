"""Prometheus metrics (`GET /metrics`) and the periodic engine summary log line.

Each app gets its own `CollectorRegistry` (several apps may live in one process, as in tests).
Two kinds of series, all labelled by `model`:

- Read on scrape from engine state, costing the engine nothing: requests running / waiting,
  preemptions, KV cache blocks used / total and usage ratio, its size in tokens, bytes a token and
  storage dtype (an info gauge), prefix-cache queries / hits / hit rate, prompt and generated token
  counters (the engine's own counters).
- Recorded through three hooks the engine calls when `engine.stats` is set: `first_token` and
  `finished` once per request, `step` once per step. With the engine in its own process the hooks
  are recorded there and replayed here with each step's outputs. Histograms: time to first token (from when the engine received the request), time per
  output token (per request: (finish - first token) / (output tokens - 1)), end-to-end latency,
  and batch size in tokens and in sequences per step. Nothing is done per token.

With several API processes (server/api/servers.py) the recorded series live in prometheus_client's
multiprocess files and every process's /metrics sums them; the engine sends its events to one
process only, so nothing is counted twice. The snapshot series are the engine's, read once.

`step` also logs a one-line summary every `log_stats_interval` seconds while the engine is busy
(prompt and generation throughput, running, waiting, KV cache usage, prefix-cache hit rate).
"""

from __future__ import annotations

import logging
import os

from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.process_collector import ProcessCollector

from server.engine.stats import StatsEvent

log = logging.getLogger("flashpage.stats")

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_POW2 = tuple(float(2**i) for i in range(15))  # 1 .. 16384


class _EngineCollector:
    """Gauges and counters computed from the engine's snapshot() at scrape time."""

    def __init__(self, engine, model: str) -> None:
        self.engine, self.model = engine, model

    def collect(self):
        s, m = self.engine.snapshot(), [self.model]
        total = s.kv_blocks_total
        used = total - s.kv_blocks_free

        def gauge(name, doc, value, label="model"):
            g = GaugeMetricFamily(name, doc, labels=[label])
            g.add_metric(m, value)
            return g

        def counter(name, doc, value, label="model"):
            c = CounterMetricFamily(name, doc, labels=[label])
            c.add_metric(m, value)
            return c

        def counter_(name, doc, value):  # vLLM's label
            return counter(name, doc, value, "model_name")

        yield gauge("flashpage_requests_running", "Requests admitted to the running batch.", s.running)
        yield gauge("flashpage_requests_waiting", "Requests queued (new or preempted).", s.waiting)
        yield counter("flashpage_preemptions", "Running requests preempted for lack of KV blocks.", s.preemptions)
        yield gauge("flashpage_kv_cache_usage_ratio", "Fraction of KV blocks in use (0..1).", used / total if total else 0.0)
        yield gauge("flashpage_kv_cache_blocks_used", "KV blocks referenced by sequences.", used)
        yield gauge("flashpage_kv_cache_blocks_total", "KV blocks allocated at start-up.", total)
        yield gauge("flashpage_kv_cache_tokens_total", "Tokens the KV cache holds (blocks x block size; twice "
                    "as many with --kv-cache-dtype fp8).", total * s.kv_block_size)
        yield gauge("flashpage_kv_cache_bytes_per_token", "KV cache bytes a token takes (every layer's K and V).",
                    s.kv_bytes_per_token)
        info = GaugeMetricFamily("flashpage_kv_cache_info", "The KV cache's storage dtype (--kv-cache-dtype), as "
                                 "a label; the value is 1.", labels=["model", "kv_cache_dtype"])
        info.add_metric([self.model, s.kv_cache_dtype], 1)
        yield info
        yield counter("flashpage_prefix_cache_queries", "Full prompt blocks looked up in the prefix cache.",
                      s.prefix_queries)
        yield counter("flashpage_prefix_cache_hits", "Prefix-cache lookups that found the block.", s.prefix_hits)
        yield gauge("flashpage_prefix_cache_hit_rate", "Prefix-cache hits / queries since start.", _hit_rate(s))
        yield counter("flashpage_prompt_tokens", "Prompt tokens of requests that produced a first token.",
                      s.prompt_tokens)
        yield counter("flashpage_generation_tokens", "Tokens generated.", s.generation_tokens)
        # The Gateway API Inference Extension's model-server protocol (TotalQueuedRequests,
        # TotalRunningRequests, KVCacheUtilization) under the vLLM names its endpoint picker reads by
        # default, with vLLM's label: the same three values again, so a gateway needs no mapping.
        if s.spec_accepted_per_pos:  # speculative decoding is on: vLLM's counters, under its names
            yield counter_("vllm:spec_decode_num_drafts", "Verifications of proposals (one a speculating "
                           "sequence and step).", s.spec_drafts)
            yield counter_("vllm:spec_decode_num_draft_tokens", "Proposed tokens verified.", s.spec_draft_tokens)
            yield counter_("vllm:spec_decode_num_accepted_tokens", "Proposed tokens accepted.",
                           s.spec_accepted_tokens)
            per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos", "Proposed tokens "
                                          "accepted, by their position among a verification's proposals.",
                                          labels=["model_name", "position"])
            for i, n in enumerate(s.spec_accepted_per_pos):
                per_pos.add_metric([self.model, str(i)], n)
            yield per_pos
        yield gauge("vllm:num_requests_waiting", "Alias of flashpage_requests_waiting (Gateway API Inference "
                    "Extension: TotalQueuedRequests).", s.waiting, "model_name")
        yield gauge("vllm:num_requests_running", "Alias of flashpage_requests_running (TotalRunningRequests).",
                    s.running, "model_name")
        yield gauge("vllm:kv_cache_usage_perc", "Alias of flashpage_kv_cache_usage_ratio, 0..1 (KVCacheUtilization).",
                    used / total if total else 0.0, "model_name")


def _spec_summary(s, drafts: int, proposed: int, accepted: int) -> dict:
    """The window's speculative decoding (with it on): tokens a verification gave (vLLM's mean
    acceptance length, 1 + accepted / verifications) and the share of proposals accepted."""
    if not s.spec_accepted_per_pos:
        return {}
    return {"spec_drafts": drafts, "spec_mean_accepted_length": round(1 + accepted / drafts, 3) if drafts else 0.0,
            "spec_acceptance_rate": round(accepted / proposed, 4) if proposed else 0.0}


def _hit_rate(s: dict) -> float:
    return s.prefix_hits / s.prefix_queries if s.prefix_queries else 0.0


class EngineStats:
    """Owns the registry. `engine` is an LLMEngine or an EngineClient (server/bridge/engine_process.py):
    anything with `model_name`, `config` and `snapshot()`. Its hooks are called from the engine
    thread, or replayed from the engine process's recorded events."""

    def __init__(self, engine, log_interval: float | None = None) -> None:
        self.engine = engine
        self.model = engine.model_name
        self.registry = CollectorRegistry()  # what GET /metrics serves
        r, lab = self.registry, ["model"]
        multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        if multiprocess:  # several API processes: each writes its series to files; any one sums them all
            MultiProcessCollector(self.registry)
            r = CollectorRegistry()  # defined here, served from the files (not twice)
        self.ttft = Histogram("flashpage_time_to_first_token_seconds", "Time from the engine receiving a request "
                              "to its first token.", lab, buckets=_LATENCY_BUCKETS, registry=r).labels(self.model)
        self.tpot = Histogram("flashpage_time_per_output_token_seconds", "Per request: (finish - first token) / "
                              "(output tokens - 1).", lab, buckets=_TPOT_BUCKETS, registry=r).labels(self.model)
        self.e2e = Histogram("flashpage_e2e_request_latency_seconds", "Time from the engine receiving a request "
                             "to its last token.", lab, buckets=_E2E_BUCKETS, registry=r).labels(self.model)
        self.batch_tokens = Histogram("flashpage_batch_tokens", "Tokens processed per engine step.", lab,
                                      buckets=_POW2, registry=r).labels(self.model)
        self.batch_seqs = Histogram("flashpage_batch_sequences", "Sequences per engine step.", lab,
                                    buckets=_POW2[:11], registry=r).labels(self.model)
        self._finished = Counter("flashpage_requests_finished", "Requests finished, by finish reason.",
                                 ["model", "finish_reason"], registry=r)
        self.by_reason = {k: self._finished.labels(self.model, k) for k in ("stop", "length")}
        self.registry.register(_EngineCollector(engine, self.model))  # the engine's own, global already
        if not multiprocess:  # one process's CPU and memory would misdescribe several
            try:
                ProcessCollector(registry=r)
            except Exception:  # pragma: no cover - platforms without /proc
                pass
        if log_interval is None:
            log_interval = engine.config.log_stats_interval
        self.log_interval = log_interval
        self._last_step = float("-inf")
        self._mark(0.0)

    # -- engine hooks ---------------------------------------------------------------------------
    def first_token(self, ttft: float) -> None:
        self.ttft.observe(ttft)

    def finished(self, e2e: float, tpot: float | None, reason: str) -> None:
        self.e2e.observe(e2e)
        if tpot is not None:
            self.tpot.observe(tpot)
        child = self.by_reason.get(reason)
        if child is None:
            child = self.by_reason[reason] = self._finished.labels(self.model, reason)
        child.inc()

    def step(self, num_seqs: int, num_tokens: int, now: float) -> None:
        self.batch_seqs.observe(num_seqs)
        self.batch_tokens.observe(num_tokens)
        self._steps += 1
        self._prefill_steps += num_tokens > num_seqs  # a prompt chunk rode along
        self._seqs += num_seqs
        if self.log_interval <= 0:
            return
        if now - self._last_step > self.log_interval:  # busy again after idling: restart the window
            self._mark(now)
        self._last_step = now
        if now - self._t >= self.log_interval:
            self.log_summary(now)

    def replay(self, events: list[StatsEvent]) -> None:
        """Hook calls recorded in the engine process (server/engine/stats.py), in order."""
        for event in events:
            event.apply(self)

    # -- the summary line ---------------------------------------------------------------------
    def _mark(self, now: float) -> None:
        s = self.engine.snapshot()
        self._t, self._prompt, self._gen = now, s.prompt_tokens, s.generation_tokens
        self._drafts, self._proposed, self._accepted = s.spec_drafts, s.spec_draft_tokens, s.spec_accepted_tokens
        self._steps = self._prefill_steps = self._seqs = 0

    def summary(self, now: float) -> dict:
        s = self.engine.snapshot()
        dt = max(now - self._t, 1e-9)
        total = s.kv_blocks_total
        return {"prompt_tokens_per_s": round((s.prompt_tokens - self._prompt) / dt, 1),
                "generation_tokens_per_s": round((s.generation_tokens - self._gen) / dt, 1),
                "running": s.running, "waiting": s.waiting,
                "kv_cache_usage": round((total - s.kv_blocks_free) / total, 4) if total else 0.0,
                "prefix_cache_hit_rate": round(_hit_rate(s), 4), "preemptions": s.preemptions,
                "steps_per_s": round(self._steps / dt, 1), "mean_batch": round(self._seqs / max(self._steps, 1), 1),
                "prefill_step_share": round(self._prefill_steps / max(self._steps, 1), 3),
                **_spec_summary(s, s.spec_drafts - self._drafts, s.spec_draft_tokens - self._proposed,
                                s.spec_accepted_tokens - self._accepted)}

    def log_summary(self, now: float) -> None:
        d = self.summary(now)
        log.info("prompt %.1f tok/s, generation %.1f tok/s, running %d, waiting %d, KV cache %.1f%%, "
                 "prefix cache hit rate %.1f%%, preemptions %d, %.0f steps/s (%.0f%% with prefill, mean batch "
                 "%.1f)", d["prompt_tokens_per_s"], d["generation_tokens_per_s"], d["running"], d["waiting"],
                 100 * d["kv_cache_usage"], 100 * d["prefix_cache_hit_rate"], d["preemptions"], d["steps_per_s"],
                 100 * d["prefill_step_share"], d["mean_batch"], extra={"stats": d})
        if "spec_mean_accepted_length" in d:
            log.info("speculative decoding: mean accepted length %.2f over %d verifications (acceptance %.1f%%)",
                     d["spec_mean_accepted_length"], d["spec_drafts"], 100 * d["spec_acceptance_rate"])
        self._mark(now)


def install_metrics(app: FastAPI, engine) -> EngineStats:
    """Attach an EngineStats to the engine (`engine.stats`) and serve GET /metrics."""
    stats = EngineStats(engine)
    engine.stats = stats
    app.state.stats = stats

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(generate_latest(stats.registry), media_type=CONTENT_TYPE_LATEST)

    return stats
