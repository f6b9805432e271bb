"""What the engine hands back for a request after a step, and how outputs that wait merge."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import numpy as np


class PromptLogprobs(msgspec.Struct, array_like=True):
    """A request's prompt log-probabilities, packed: row p is prompt token p + 1's id and
    log-probability, then its top `k` alternatives' (the first token has none). Two arrays' bytes
    from the worker to the API process, so that neither the engine's thread nor the pipe handles an
    object per token (issue 44: a 12.5k-token prompt with 20 alternatives held the engine's loop
    128-533 ms as lists of tuples). Read as a sequence, row p is [(id, logprob), (alt id, logprob),
    ...]: built when read, which the API process does off its event loop for a large one."""

    token_ids: bytes  # int32 [n, 1 + k], row-major
    logprobs: bytes  # float32 [n, 1 + k]
    k: int

    @classmethod
    def pack(cls, chunks: list[tuple[np.ndarray, np.ndarray]], k: int) -> PromptLogprobs:
        """One record of the (token_ids, logprobs) arrays of consecutive chunks of rows."""
        if not chunks:
            return cls(b"", b"", k)
        ids, logprobs = zip(*chunks)
        return cls(np.concatenate(ids).tobytes(), np.concatenate(logprobs).tobytes(), k)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(token_ids, logprobs), [n, 1 + k] each, read-only views of the bytes."""
        return (np.frombuffer(self.token_ids, np.int32).reshape(-1, 1 + self.k),
                np.frombuffer(self.logprobs, np.float32).reshape(-1, 1 + self.k))

    @property
    def pairs(self) -> int:
        """The (id, logprob) pairs it expands to: what reading it costs."""
        return len(self.token_ids) // 4

    def entries(self, rows: slice = slice(None)) -> list[list[tuple[int, float]]]:
        """Rows as lists of (id, logprob): the token's, then its alternatives'."""
        ids, logprobs = self.arrays()
        return [list(zip(i, v)) for i, v in zip(ids[rows].tolist(), logprobs[rows].tolist())]

    def __len__(self) -> int:
        return len(self.token_ids) // (4 * (1 + self.k))

    def __iter__(self):
        return iter(self.entries())

    def __getitem__(self, index: int | slice):
        if isinstance(index, slice):
            return self.entries(index)
        index = range(len(self))[index]  # IndexError past either end, as a list's
        return self.entries(slice(index, index + 1))[0]


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
    error: str | None = None  # with finish_reason "error": what failed ("refused": why)
    # on the request's first output, where asked: per prompt token after the first, (id, logprob)
    # then the top alternatives, packed
    prompt_logprobs: PromptLogprobs | None = None


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


def failed_output(seq, message: str, reason: str = "error") -> RequestOutput:
    """A request ended with finish_reason "error" (or "refused": server/engine/stop.py), with what it
    produced so far."""
    return RequestOutput(seq.request_id, "", [], True, reason, prompt_tokens=len(seq.prompt_token_ids),
                         completion_tokens=len(seq.output_token_ids), text=seq.text,
                         token_ids=list(seq.output_token_ids), error=message)


def packed_prompt_logprobs(seq) -> PromptLogprobs:
    """A sequence's prompt log-probabilities (all scored by now), as they cross to the API process."""
    return PromptLogprobs.pack(seq.prompt_logprobs, seq.params.prompt_logprobs or 0)
