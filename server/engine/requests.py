"""Request validation: what the engine can serve, checked once per request before it is queued.

`validate_request` is read-only and needs only `RequestBounds`, so the API side runs it (also when
the engine lives in another process, which sends its bounds once at start-up) and the engine runs
the same function again only for requests added directly (offline use, tests).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcache import blocks_for
from server.sampling_params import SamplingParams


class RequestError(ValueError):
    """A request the engine cannot serve as asked; the message says why (HTTP 400), `param` which
    request field it is about, where one is (OpenAI's error object names it)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineFatalError(RuntimeError):
    """Steps keep failing: the engine cannot continue (the server reports unhealthy and exits)."""


@dataclass(frozen=True, slots=True)
class RequestBounds:
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    eos_token_ids: tuple[int, ...] = ()  # every end-of-sequence id (grammars end on them)


def validate_request(prompt_token_ids: list[int], params: SamplingParams, b: RequestBounds) -> None:
    """Raise RequestError if the engine cannot serve this request as asked."""
    n, vocab = len(prompt_token_ids), b.vocab_size
    if n == 0:
        raise RequestError("the prompt is empty: give at least one token")
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise RequestError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})", "prompt")
    bad = next((t for t in params.stop_token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise RequestError(f"stop token id {bad} is outside the vocabulary [0, {vocab})", "stop_token_ids")
    if params.max_tokens < 0 or (params.max_tokens == 0 and params.prompt_logprobs is None):
        raise RequestError(f"max_tokens is {params.max_tokens}: it must be at least 1 (0 only when scoring the "
                           "prompt: echo with logprobs, or prompt_logprobs)", "max_tokens")
    if params.min_tokens > params.max_tokens:
        raise RequestError(f"min_tokens ({params.min_tokens}) is more than max_tokens ({params.max_tokens})",
                           "min_tokens")
    bad = next((t for t in params.logit_bias if not 0 <= t < vocab), None)
    if bad is not None:
        raise RequestError(f"logit_bias token id {bad} is outside the vocabulary [0, {vocab})", "logit_bias")
    if not params.repetition_penalty > 0:
        raise RequestError(f"repetition_penalty must be above 0, got {params.repetition_penalty}", "repetition_penalty")
    if n + params.max_tokens > b.max_model_len:
        raise RequestError(
            f"prompt has {n} tokens and max_tokens is {params.max_tokens}: {n + params.max_tokens} "
            f"exceeds the model's context of {b.max_model_len} tokens", "max_tokens")
    need = blocks_for(n + params.max_tokens, b.block_size)
    if need > b.num_blocks:
        raise RequestError(f"request needs {need} KV blocks but the whole cache has {b.num_blocks}", "max_tokens")
