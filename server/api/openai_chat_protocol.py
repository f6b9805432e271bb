"""The OpenAI chat completions protocol: the request schema, the conversation it carries, and the
choices (`chat.completion` messages, `chat.completion.chunk` deltas, per-token logprobs). What it
shares with /v1/completions is in server/api/openai_protocol.py; the route is server/api/openai_chat.py."""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from server.api.assistant import AssistantReply, chat_deltas, chat_message
from server.api.guards import MAX_TOKENS_BOUND, LimitError, ServerLimits, check_prompt_chars, has_surrogates
from server.api.openai_protocol import STRICT, ChoiceBase, OpenAIError, SamplingRequest, finite, token_text
from server.api.tools.request import ToolChoice, Tools
from server.sampling_params import SamplingParams

MaxTokens = Annotated[int, Field(ge=1, le=MAX_TOKENS_BOUND)]
# apply_chat_template's own arguments, which chat_template_kwargs may not set
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                                      "add_generation_prompt", "continue_final_message", "return_dict",
                                      "return_assistant_tokens_mask", "tokenizer_kwargs", "padding", "truncation",
                                      "max_length", "return_tensors"})


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCallItem(BaseModel):
    """A call an earlier assistant message made (clients echo back what they were sent; extra keys,
    such as a stream's `index`, are ignored)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = STRICT

    role: Literal["system", "developer", "user", "assistant", "tool"]
    # a string, or text parts {"type": "text", "text": ...} (checked by conversation()); None only
    # for an assistant message that made calls
    content: str | list[dict] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None  # assistant
    tool_call_id: str | None = None  # tool: the call this is the result of
    reasoning_content: str | None = None  # assistant: its reasoning (templates may show it)
    reasoning: str | None = None  # vLLM's newer name for it


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: MaxTokens | None = None  # neither given: the rest of the context
    max_tokens: MaxTokens | None = None  # deprecated by OpenAI for max_completion_tokens; either may be given
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: Tools | None = None  # server/api/tools/request.py
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's: extra variables for the chat template (e.g. enable_thinking)
    chat_template_kwargs: dict | None = None
    # vLLM's, for routers and RL loops: the prompt's and choices' token ids in the response; and a
    # prompt already rendered (by /v1/chat/completions/render), used as is instead of the messages
    return_token_ids: bool | None = None
    prompt_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)] | None = None
    # accepted only at their defaults (or absent)
    functions: list | None = None
    function_call: str | dict | None = None
    store: bool | None = None
    modalities: list[str] | None = None
    _grammar: object = PrivateAttr(None)  # the reply's grammar, when the route sets one (tools, reasoning)

    def unsupported(self) -> list[tuple[str, bool]]:
        return [*super().unsupported(), ("functions", not self.functions),
                ("function_call", self.function_call in (None, "none")), ("store", not self.store),
                ("modalities", self.modalities in (None, ["text"]))]

    def structured(self):
        return self._grammar if self._grammar is not None else super().structured()

    def template_kwargs(self) -> dict:
        """chat_template_kwargs, without apply_chat_template's own arguments (a 400 naming them)."""
        kwargs = self.chat_template_kwargs or {}
        if bad := sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs)):
            raise OpenAIError(400, f"chat_template_kwargs may not set {', '.join(bad)}", param="chat_template_kwargs")
        return kwargs

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
        """The messages as the chat template reads them: {role, content (a string), name?}, with an
        assistant's tool_calls (arguments as objects, as templates expect them), a tool result's
        tool_call_id, and an assistant's reasoning_content. Text parts are joined with newlines; a
        part of any other type is a 400 that names it; "developer" is "system"."""
        out = [_template_message(i, m) for i, m in enumerate(self.messages)]
        try:
            check_prompt_chars("".join(_texts(m) for m in out), limits, "messages")  # before any rendering
        except LimitError as e:
            raise OpenAIError(400, str(e), param="messages") from None
        return out


def _template_message(i: int, m: ChatMessage) -> dict:
    if m.content is None and not m.tool_calls:
        raise OpenAIError(400, f"messages[{i}].content is required (only an assistant message with tool_calls "
                          "may leave it out)", param="messages")
    if m.role == "tool" and not m.tool_call_id:
        raise OpenAIError(400, f"messages[{i}]: a tool message needs 'tool_call_id'", param="messages")
    if (m.tool_calls and m.role != "assistant") or (m.tool_call_id is not None and m.role != "tool"):
        raise OpenAIError(400, f"messages[{i}]: 'tool_calls' belong to assistant messages and 'tool_call_id' to "
                          "tool messages", param="messages")
    content = "" if m.content is None else m.content if isinstance(m.content, str) else _join_parts(i, m.content)
    out = {"role": "system" if m.role == "developer" else m.role, "content": content}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if reasoning := m.reasoning_content or m.reasoning:
        out["reasoning_content"] = reasoning
    if has_surrogates(_texts(out)):
        raise OpenAIError(400, f"messages[{i}] holds a lone UTF-16 surrogate, which is not text", param="messages")
    return out


def _arguments(text: str):
    """A call's arguments as the object templates render (`| tojson`); text that is no JSON object stays text."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _texts(m: dict) -> str:
    """Every string a template message holds (for the prompt's character bound and the surrogate check)."""
    calls = "".join(c["function"]["name"] + json.dumps(c["function"]["arguments"], ensure_ascii=False)
                    for c in m.get("tool_calls", ()))
    return m["content"] + m.get("name", "") + m.get("reasoning_content", "") + m.get("tool_call_id", "") + calls


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
    top_logprobs}]}. With a `reply` (server/api/assistant.py) its text is read as reasoning, content
    and tool calls, and a reply that made calls and stopped finishes with "tool_calls". With
    `token_ids`, each chunk carries the ids of its output (vLLM's `token_ids`), and so does the
    whole choice."""

    def __init__(self, index: int, ids: list[int], params: SamplingParams, tokenizer,
                 reply: AssistantReply | None = None, token_ids: bool = False) -> None:
        super().__init__(index, ids, params)
        self.tokenizer, self.reply, self.token_ids = tokenizer, reply, [] if token_ids else None
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
        if self.reply is None:
            deltas = [{"content": text}] if text or logprobs else []
        else:
            parts = (self.reply.feed(text) if text else []) + (self.reply.end() if out.finished else [])
            deltas = chat_deltas(parts) or ([{"content": ""}] if logprobs else [])
            if self.reply.calls and self.finish_reason == "stop":
                self.finish_reason = "tool_calls"
        for k, delta in enumerate(deltas):
            pieces.append(self._piece(delta, logprobs if k == 0 else None))
        if out.finished:
            pieces.append(self._piece({}))
        if self.token_ids is not None:
            self.token_ids.extend(out.new_token_ids)
            mine = pieces[1:] if pieces and "role" in pieces[0]["delta"] else pieces
            if not mine:
                mine = [self._piece({})]
                mine[0]["finish_reason"] = None
                pieces.append(mine[0])
            mine[0]["token_ids"] = out.new_token_ids
        return pieces

    def result(self) -> dict:
        message = chat_message(self.reply) if self.reply is not None else {"role": "assistant",
                                                                             "content": "".join(self.texts)}
        out = {"index": self.index, "message": message,
               "logprobs": None if self.logprobs is None else {"content": self.logprobs},
               "finish_reason": self.finish_reason}
        if self.token_ids is not None:
            out["token_ids"] = self.token_ids
        return out
