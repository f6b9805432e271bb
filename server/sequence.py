"""A request as the engine tracks it: its tokens, its progress through the KV cache, its page table."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from kvcache import SeqBlocks
from server.sampling import SamplingParams


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
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    # KV of token_ids[:num_computed] is in the cache; the next step processes from there.
    num_computed: int = 0
    num_cached_prompt: int = 0  # prompt tokens served by the prefix cache at admission
    blocks: SeqBlocks = field(default_factory=SeqBlocks)
    finish_reason: str | None = None
    num_preemptions: int = 0
    # Incremental detokenization state (server/detokenize.py).
    text: str = ""
    emitted: int = 0  # characters of `text` already sent to the client
    utf8: Any = None  # incremental UTF-8 decoder (byte-level tokenizers)
    prefix_offset: int = 0
    read_offset: int = 0
    first_token_time: float | None = None
    logprobs: list[dict] = field(default_factory=list)

    token_ids: list[int] = field(init=False)  # prompt + output, kept as one list: read every step

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    def append_token(self, tok: int) -> None:
        self.output_token_ids.append(tok)
        self.token_ids.append(tok)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
