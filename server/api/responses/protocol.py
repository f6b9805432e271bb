"""The Responses request (OpenAI's shape) and how it becomes a chat request: `input` (text, or items:
messages, function_call, function_call_output, reasoning) and `instructions` become the messages,
function `tools` the chat's, `text.format` the response_format, `max_output_tokens` the completion
limit. Nothing is stored: `previous_response_id`, `conversation` and item references are refused
with a 400 that says so."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from server.api.guards import MAX_TOKENS_BOUND
from server.api.openai_protocol import BODY, STRICT, OpenAIError
from server.api.tools.request import MAX_TOOLS, FunctionDefinition

MAX_ITEMS = 4096


class FunctionTool(FunctionDefinition):
    """A Responses function tool: the chat's function definition, flat, beside its type."""

    type: Literal["function"]


class NamedFunction(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=256)
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # e.g. verbosity, which a server of one model ignores
    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    model_config = BODY

    model: str
    input: str | Annotated[list[dict], Field(min_length=1, max_length=MAX_ITEMS)]
    instructions: str | None = None
    tools: Annotated[list[dict], Field(max_length=MAX_TOOLS)] | None = None  # function tools (checked in chat_body)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_BOUND)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    text: TextConfig | None = None
    stream: bool = False
    # accepted, and echoed where the response has them; nothing is stored
    store: bool | None = None
    metadata: dict | None = None
    user: str | None = None
    include: list[str] | None = None
    reasoning: dict | None = None
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    stream_options: dict | None = None
    # refused: they need stored responses
    previous_response_id: str | None = None
    conversation: str | dict | None = None
    background: bool | None = None
    # flashpage extensions, as on the chat route
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    top_k: int | None = None
    logit_bias: dict | None = None
    chat_template_kwargs: dict | None = None

    def refused(self) -> None:
        if self.previous_response_id is not None or self.conversation is not None:
            param = "previous_response_id" if self.previous_response_id is not None else "conversation"
            raise OpenAIError(400, f"'{param}' is not supported: this server stores no responses; send the whole "
                              "conversation in 'input'", param=param, code="unsupported_parameter")
        if self.background:
            raise OpenAIError(400, "'background' is not supported by this server", param="background",
                              code="unsupported_parameter")

    def chat_body(self) -> dict:
        """The chat completion request this is (validated by ChatCompletionRequest after)."""
        tools = None
        if self.tools is not None:
            tools = []
            for i, tool in enumerate(self.tools):
                if tool.get("type") != "function":
                    raise OpenAIError(400, f"tools[{i}]: only function tools are supported (got type "
                                      f"{str(tool.get('type'))[:64]!r})", param="tools")
                t = FunctionTool.model_validate(tool)
                tools.append({"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)})
        body = {"model": self.model, "messages": self.messages(), "stream": self.stream}
        choice = self.tool_choice
        fmt = self.text.format if self.text is not None else None
        extra = {"tools": tools, "parallel_tool_calls": self.parallel_tool_calls,
                 "tool_choice": {"type": "function", "function": {"name": choice.name}}
                 if isinstance(choice, NamedFunction) else choice,
                 "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature, "top_p": self.top_p,
                 "response_format": None if fmt is None or fmt.type == "text" else (
                     {"type": "json_object"} if fmt.type == "json_object" else
                     {"type": "json_schema", "json_schema": {"name": fmt.name or "response", "schema": fmt.schema_,
                                                            "strict": fmt.strict}}),
                 "seed": self.seed, "top_k": self.top_k, "logit_bias": self.logit_bias,
                 "chat_template_kwargs": self.chat_template_kwargs,
                 "user": self.user}
        return {**body, **{k: v for k, v in extra.items() if v is not None}}

    def messages(self) -> list[dict]:
        """`instructions` and `input` as chat messages: calls join the assistant message before them,
        outputs become tool messages, reasoning goes with the next assistant message."""
        out: list[dict] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return out + [{"role": "user", "content": self.input}]
        reasoning = ""
        for i, item in enumerate(self.input):
            kind = item.get("type", "message")
            if kind == "message":
                msg = {"role": item.get("role"), "content": _text(i, item.get("content"))}
                if msg["role"] == "assistant" and reasoning:
                    msg["reasoning_content"], reasoning = reasoning, ""
                out.append(msg)
            elif kind == "function_call":
                call = {"id": _field(i, item, "call_id"), "type": "function",
                        "function": {"name": _field(i, item, "name"), "arguments": _field(i, item, "arguments")}}
                if not out or out[-1]["role"] != "assistant":  # calls join the assistant's message before them
                    out.append({"role": "assistant", "content": None})
                    if reasoning:
                        out[-1]["reasoning_content"], reasoning = reasoning, ""
                out[-1].setdefault("tool_calls", []).append(call)
            elif kind == "function_call_output":
                out.append({"role": "tool", "tool_call_id": _field(i, item, "call_id"),
                            "content": _text(i, item.get("output"))})
            elif kind == "reasoning":
                reasoning += "".join(p.get("text", "") for p in (item.get("content") or []) if isinstance(p, dict))
            elif kind == "item_reference":
                raise OpenAIError(400, f"input[{i}]: item references need stored responses, which this server does "
                                  "not keep; send the item itself", param="input")
            else:
                raise OpenAIError(400, f"input[{i}]: items of type {str(kind)[:64]!r} are not supported (message, "
                                  "function_call, function_call_output and reasoning are)", param="input")
        return out


def _field(i: int, item: dict, key: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise OpenAIError(400, f"input[{i}].{key} must be a string", param="input")
    return value


def _text(i: int, content) -> str:
    """A message's or output's content: a string, or parts of text (input_text, output_text, text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise OpenAIError(400, f"input[{i}]: content must be a string or a list of text parts", param="input")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text", "refusal"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise OpenAIError(400, f"input[{i}]: content parts of type {str(kind)[:64]!r} are not supported (only "
                              "text)", param="input", code="unsupported_content_type")
        text = part.get("text", part.get("refusal"))
        if not isinstance(text, str):
            raise OpenAIError(400, f"input[{i}]: a text part needs its text", param="input")
        texts.append(text)
    return "\n".join(texts)
