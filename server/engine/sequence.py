"""A request as the engine tracks it: its tokens, its progress through the KV cache, its page table."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from kvcache import SeqBlocks
from models import placeholder_id
from server.sampling_params import SamplingParams

PLACEHOLDER = -1  # token id not yet known on the host (see Sequence.pending_row)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    deadline: float | None = None  # time.monotonic() past which it ends with finish_reason "timeout"
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    # KV of token_ids[:num_computed] is in the cache; the next step processes from there.
    num_computed: int = 0
    num_cached_prompt: int = 0  # prompt tokens served by the prefix cache at admission
    blocks: SeqBlocks = field(default_factory=SeqBlocks)
    finish_reason: str | None = None
    num_preemptions: int = 0
    # Incremental detokenization state (server/engine/detokenize.py).
    text: str = ""
    emitted: int = 0  # characters of `text` already sent to the client
    utf8: Any = None  # incremental UTF-8 decoder (byte-level tokenizers)
    prefix_offset: int = 0
    read_offset: int = 0
    first_token_time: float | None = None
    logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # per token: chosen, then top alternatives
    # The prompt log-probabilities scored so far, as the worker's arrays (server/worker/scoring.py):
    # chunks of (token_ids, logprobs) rows, row p of them all prompt token p + 1's id and logprob then
    # alternatives (the first token has none); num_prompt_scored rows in all
    prompt_logprobs: list[tuple[Any, Any]] = field(default_factory=list)
    num_prompt_scored: int = 0
    grammar: Any = None  # its XGrammar matcher, for structured output (server/engine/grammar.py)
    compiling: Any = None  # a Future of that matcher while its grammar compiles; not admitted till then
    # Asynchronous scheduling: a step is launched before the previous one's sampled ids reach the
    # host, so the newest token(s) may still be PLACEHOLDERs. `pending_row` is the row of the newest
    # one in the launched step's sampled ids (the runner gathers it on the GPU); `capped` stops
    # scheduling once the placeholders reach max_tokens or the context limit.
    pending_row: int = -1
    capped: bool = False
    spec: Any = None  # its speculative decoding state (server/engine/spec/policy.py); None: it never speculates

    token_ids: list[int] = field(init=False)  # prompt + output, kept as one list: read every step
    plain: bool = field(init=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        # Greedy, no logprobs, nothing that edits the logits: the token is the argmax the step's
        # CUDA graph already computed.
        p = self.params
        self.plain = p.greedy and p.logprobs is None and not p.processes_logits

    def add_placeholder(self, row: int) -> None:
        """A step that samples this sequence's next token was launched; its id is row `row` of that
        step's sampled ids, not yet on the host."""
        self.token_ids.append(PLACEHOLDER)
        self.pending_row = row

    def resolve(self, tok: int) -> None:
        """The oldest placeholder's id arrived."""
        i = len(self.prompt_token_ids) + len(self.output_token_ids)
        self.token_ids[i] = tok
        self.output_token_ids.append(tok)
        if i == len(self.token_ids) - 1:
            self.pending_row = -1

    def input_token(self, pos: int) -> int:
        """Token `pos` as a step's input id: the id itself, or for a placeholder the id that names
        row `pending_row` of the last step's sampled ids, where the model reads it on the device
        (models/base.py)."""
        tok = self.token_ids[pos]
        return placeholder_id(self.pending_row) if tok == PLACEHOLDER else tok

    @property
    def num_pending(self) -> int:
        """Tokens sampled by launched steps whose ids have not reached the host yet."""
        return len(self.token_ids) - len(self.prompt_token_ids) - len(self.output_token_ids)

    @property
    def scores_prompt(self) -> bool:
        """Still owes prompt log-probabilities (so it may not take prefix-cache hits)."""
        return self.params.prompt_logprobs is not None and self.num_prompt_scored < len(self.prompt_token_ids) - 1

    def take_scores(self, first: int, token_ids, logprobs) -> None:
        """Rows of prompt log-probabilities from position `first` on: those not scored before (a
        recompute after preemption scores positions again) are kept."""
        skip = self.num_prompt_scored - first
        if 0 <= skip < len(token_ids):
            self.prompt_logprobs.append((token_ids[skip:], logprobs[skip:]))
            self.num_prompt_scored += len(token_ids) - skip

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
