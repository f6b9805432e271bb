"""What a request asks of sampling and stopping: one record, read by every layer.

The front end builds it from a request body (its schema defaults come from here), the engine's stop
rule reads `max_tokens`, `min_tokens`, `stop`, `stop_token_ids` and `ignore_eos`, the engine's
grammar state reads `structured`, and the worker's sampler reads the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS). Sampling divides the fp32 logits by
# the temperature: at 1e-38 and below that overflows to inf, the softmax of the row is NaN and its
# "sample" is token 0; well before that the distribution is a one-hot of the argmax anyway.
GREEDY_BELOW = 1e-5
LOGIT_BIAS_BOUND = 100.0  # OpenAI clamps logit_bias values to [-100, 100]

# The kinds of structured output (server/engine/grammar.py compiles each with XGrammar); a
# structural tag is what tool calls compile from (server/api/tools/).
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """Output constrained to a grammar. `spec`: a JSON schema as JSON text (json), a regular
    expression (regex), a JSON list of strings (choice), an EBNF grammar (grammar), XGrammar's
    structural tag as JSON (structural_tag), or "" (json_object: any JSON object). Frozen and
    hashable: compiled grammars are cached by it."""

    kind: str
    spec: str = ""


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16  # 0 only with prompt_logprobs: score the prompt, generate nothing
    temperature: float = 1.0  # 0 (or anything below GREEDY_BELOW) = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n alternatives per token (the sampled one always comes back)
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    # Penalties as vLLM and OpenAI define them (server/worker/logits.py applies them on the device):
    presence_penalty: float = 0.0  # minus this from the logit of every token already generated
    frequency_penalty: float = 0.0  # minus this times how often the token was generated
    repetition_penalty: float = 1.0  # logits of prompt and generated tokens: /r if positive, *r if not
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    min_tokens: int = 0  # EOS and stop ids are masked, and stop strings ignored, until this many
    structured: StructuredOutput | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        """Needs the per-sequence token counts on the device."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def processes_logits(self) -> bool:
        """Changes the logits before the choice (so the step's plain argmax is not its token)."""
        return bool(self.penalized or self.logit_bias or self.min_tokens or self.structured is not None)
