"""What the engine hands back for a request after a step, and how outputs that wait merge."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec


class RequestOutput(msgspec.Struct, array_like=True):
    """Crosses the engine process's pipe (server/bridge/messages.py): a msgspec struct, encoded as
    a compact array, as cheap there as a positional list and still a named type everywhere."""

    request_id: str
    new_text: str  # text that became final this step (held-back stop-string prefixes excluded)
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None  # server/engine/stop.py
    prompt_tokens: int = 0
    completion_tokens: int = 0
    new_logprobs: list = []  # per new token: [(id, logprob), (alt id, logprob), ...]
    text: str = ""  # everything so far
    token_ids: list[int] = []  # every output token so far
    cached_prompt_tokens: int = 0  # prompt tokens served by the prefix cache
    error: str | None = None  # with finish_reason "error": what failed
    # on the request's first output, where asked: per prompt token after the first, (id, logprob)
    # then the top alternatives
    prompt_logprobs: list | None = None


def merge_outputs(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """a then b (same request) as one output: the deltas concatenated, everything cumulative from b.
    Where a consumer falls behind, its waiting outputs merge this way (the HTTP side's collectors,
    the engine process's outbox)."""
    b.new_text = a.new_text + b.new_text
    b.new_token_ids = a.new_token_ids + b.new_token_ids
    b.new_logprobs = a.new_logprobs + b.new_logprobs
    if b.prompt_logprobs is None:
        b.prompt_logprobs = a.prompt_logprobs
    return b


@dataclass(slots=True)
class EngineSnapshot:
    """Counters and gauges of the engine (for /metrics, /debug/kv and admission); cheap to take."""

    running: int
    waiting: int
    sequences: int
    preemptions: int
    kv_blocks_total: int
    kv_blocks_free: int
    prefix_queries: int
    prefix_hits: int
    prompt_tokens: int
    generation_tokens: int
    # what the cache holds, fixed at start-up: its storage dtype (fp8_e4m3, bfloat16, ...), tokens a
    # block, bytes a token (every layer's K and V)
    kv_cache_dtype: str = ""
    kv_block_size: int = 0
    kv_bytes_per_token: int = 0
    # speculative decoding (server/engine/spec/speculator.py SpecCounters), when on: verifications,
    # proposals, accepted proposals, and accepted proposals by position (empty when off)
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)


def failed_output(seq, message: str) -> RequestOutput:
    """A request ended with finish_reason "error" (server/engine/stop.py), with what it produced so far."""
    return RequestOutput(seq.request_id, "", [], True, "error", prompt_tokens=len(seq.prompt_token_ids),
                         completion_tokens=len(seq.output_token_ids), text=seq.text,
                         token_ids=list(seq.output_token_ids), error=message)
