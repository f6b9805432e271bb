"""The OpenAI chat completions protocol: the request schema, the conversation it carries, and the
choices (`chat.completion` messages, `chat.completion.chunk` deltas, per-token logprobs). What it
shares with /v1/completions is in server/api/openai_protocol.py; the route is server/api/openai_chat.py."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from server.api.guards import MAX_TOKENS_BOUND, LimitError, ServerLimits, check_prompt_chars, has_surrogates
from server.api.openai_protocol import STRICT, ChoiceBase, OpenAIError, SamplingRequest, finite, token_text
from server.sampling_params import SamplingParams

MaxTokens = Annotated[int, Field(ge=1, le=MAX_TOKENS_BOUND)]


class ChatMessage(BaseModel):
    model_config = STRICT

    role: Literal["system", "user", "assistant"]
    content: str | list[dict]  # a string, or text parts {"type": "text", "text": ...} (checked by conversation())
    name: str | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: MaxTokens | None = None  # neither given: the rest of the context
    max_tokens: MaxTokens | None = None  # deprecated by OpenAI for max_completion_tokens; either may be given
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # accepted only at their defaults (or absent)
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    store: bool | None = None
    modalities: list[str] | None = None

    def unsupported(self) -> list[tuple[str, bool]]:
        return [*super().unsupported(), ("tools", not self.tools), ("tool_choice", self.tool_choice in (None, "none")),
                ("parallel_tool_calls", self.parallel_tool_calls in (None, True)), ("functions", not self.functions),
                ("function_call", self.function_call in (None, "none")), ("store", not self.store),
                ("modalities", self.modalities in (None, ["text"]))]

    def completion_limit(self) -> int | None:
        """max_completion_tokens or max_tokens (400 when both are given and differ); None: neither."""
        a, b = self.max_completion_tokens, self.max_tokens
        if a is not None and b is not None and a != b:
            raise OpenAIError(400, f"'max_completion_tokens' ({a}) and 'max_tokens' ({b}) differ: give one of them",
                              param="max_tokens")
        return a if a is not None else b

    def top_n(self) -> int | None:
        """SamplingParams.logprobs: the alternatives per token, or None without logprobs."""
        if not self.logprobs:
            if self.top_logprobs is not None:
                raise OpenAIError(400, "'top_logprobs' requires 'logprobs': true", param="top_logprobs")
            return None
        return self.top_logprobs or 0

    def conversation(self, limits: ServerLimits) -> list[dict]:
        """The messages as the chat template reads them: {role, content (a string), name?}. Text
        parts are joined with newlines; a part of any other type is a 400 that names it."""
        out = []
        for i, m in enumerate(self.messages):
            content = m.content if isinstance(m.content, str) else _join_parts(i, m.content)
            if has_surrogates(content) or (m.name is not None and has_surrogates(m.name)):
                raise OpenAIError(400, f"messages[{i}] holds a lone UTF-16 surrogate, which is not text",
                                  param="messages")
            out.append({"role": m.role, "content": content, **({"name": m.name} if m.name is not None else {})})
        try:
            check_prompt_chars("".join(m["content"] for m in out), limits, "messages")  # before any rendering
        except LimitError as e:
            raise OpenAIError(400, str(e), param="messages") from None
        return out


def _join_parts(i: int, parts: list[dict]) -> str:
    if not parts:
        raise OpenAIError(400, f"messages[{i}].content is an empty list of parts", param="messages")
    texts = []
    for k, part in enumerate(parts):
        kind = part.get("type")
        if kind != "text":
            raise OpenAIError(400, f"messages[{i}].content[{k}]: content parts of type {kind!r} are not supported "
                              "by this server (only 'text')", param="messages", code="unsupported_content_type")
        if not isinstance(part.get("text"), str) or set(part) != {"type", "text"}:
            raise OpenAIError(400, f"messages[{i}].content[{k}]: a text part is {{\"type\": \"text\", \"text\": "
                              "<string>}", param="messages")
        texts.append(part["text"])
    return "\n".join(texts)


class ChatChoice(ChoiceBase):
    """A chat choice: an assistant message (whole) or deltas (streamed: the role first, then content,
    then an empty delta with finish_reason), and logprobs {content: [{token, logprob, bytes,
    top_logprobs}]}."""

    def __init__(self, index: int, ids: list[int], params: SamplingParams, tokenizer) -> None:
        super().__init__(index, ids, params)
        self.tokenizer = tokenizer
        self.logprobs: list[dict] | None = [] if params.logprobs is not None else None

    def _token(self, tid: int, logprob: float) -> dict:
        tok = token_text(self.tokenizer, tid)  # one token alone: part of a multi-byte character is U+FFFD
        return {"token": tok, "logprob": finite(logprob), "bytes": list(tok.encode("utf-8"))}

    def _piece(self, delta: dict, logprobs: list[dict] | None = None) -> dict:
        return {"index": self.index, "delta": delta, "logprobs": None if logprobs is None else {"content": logprobs},
                "finish_reason": None if delta else self.finish_reason}

    def chunks(self, out) -> list[dict]:
        pieces = []
        if not self.started:
            self.started = True
            pieces.append(self._piece({"role": "assistant", "content": ""}))
        text, logprobs = self.advance(out), None
        self.texts.append(text)
        if self.logprobs is not None:
            logprobs = [{**self._token(*chosen), "top_logprobs": [self._token(*alt) for alt in alts]}
                        for chosen, *alts in out.new_logprobs]
            self.logprobs.extend(logprobs)
        if text or logprobs:
            pieces.append(self._piece({"content": text}, logprobs))
        if out.finished:
            pieces.append(self._piece({}))
        return pieces

    def result(self) -> dict:
        return {"index": self.index, "message": {"role": "assistant", "content": "".join(self.texts)},
                "logprobs": None if self.logprobs is None else {"content": self.logprobs},
                "finish_reason": self.finish_reason}
