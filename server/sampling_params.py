"""What a request asks of sampling and stopping: one record, read by every layer.

The front end builds it from a request body (its schema defaults come from here), the engine's stop
rule reads `max_tokens`, `stop`, `stop_token_ids` and `ignore_eos`, and the worker's sampler reads
the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS). Sampling divides the fp32 logits by
# the temperature: at 1e-38 and below that overflows to inf, the softmax of the row is NaN and its
# "sample" is token 0; well before that the distribution is a one-hot of the argmax anyway.
GREEDY_BELOW = 1e-5


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 (or anything below GREEDY_BELOW) = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n alternatives per token (the sampled one always comes back)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW
