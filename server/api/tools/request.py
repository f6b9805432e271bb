"""What a request asks of tool calling, checked as vLLM checks it, and the plan a reply follows: the
format its calls are written in, the tools it may call, and its grammar (tags.py).

- `tools` with no `tool_choice` means "auto"; `tool_choice` without `tools` is a 400, and so are an
  empty `tools` list and a named function that is not among them.
- "auto" needs the server's `--enable-auto-tool-choice` and `--tool-call-parser` (vLLM's 400
  otherwise). "required" and a named function work without them: the calls are then plain JSON
  (plain.py), as vLLM writes them; with a parser, in the model's own format.
- "none": no call is made and the template is not shown the tools (vLLM's default).
- A named function with a response_format (or structured_outputs) is a 400 (vLLM's); "required"
  makes a call, so a response_format has no reply to shape; "auto" takes a call or the object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from server.api.tools import TOOL_PARSERS
from server.api.tools.base import ToolParser
from server.api.tools.plain import Plain
from server.api.tools.tags import as_format, tool_grammar
from server.sampling_params import StructuredOutput

STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
MAX_TOOLS = 128  # OpenAI allows 128 functions
FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]  # OpenAI's rule (and JSON-safe)


class FunctionDefinition(BaseModel):
    model_config = STRICT
    name: FunctionName
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ChatTool(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(BaseModel):
    model_config = STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: ToolChoiceFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
Tools = Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)]


@dataclass(frozen=True)
class ToolSettings:
    """The server's tool and reasoning flags (server/cli.py), on ServerLimits."""

    parser: str | None = None  # --tool-call-parser
    auto: bool = False  # --enable-auto-tool-choice
    reasoning: str | None = None  # --reasoning-parser


class ToolError(ValueError):
    """A request's tools or tool_choice that cannot be served (a 400 naming `param`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class ToolPlan:
    """How one reply may call tools: `fmt` writes and reads the calls (a module of this package,
    or plain.py's), `tools` are those it may call ({name, parameters}), `choice` is "auto" or
    "required" (a named function is "required" of that one)."""

    fmt: object
    tools: list[dict]
    choice: str
    parallel: bool

    def parser(self) -> ToolParser:
        return ToolParser(self.fmt, [t["name"] for t in self.tools])

    def grammar(self, response: StructuredOutput | None, reasoning: dict | None) -> StructuredOutput:
        return tool_grammar(self.fmt, self.tools, self.choice, self.parallel,
                            as_format(response) if response is not None and self.choice == "auto" else None,
                            reasoning)


def template_tools(tools: list[ChatTool] | None, choice: ToolChoice | None) -> list[dict] | None:
    """The tools the chat template is shown (OpenAI's shape, which templates read), or None."""
    if not tools or choice == "none":
        return None
    return [t.model_dump(exclude_none=True) for t in tools]


def plan_tools(tools: list[ChatTool] | None, choice: ToolChoice | None, parallel: bool | None,
               settings: ToolSettings, structured: bool) -> ToolPlan | None:
    """The reply's ToolPlan (None: no calls), or ToolError saying what cannot be served."""
    if tools is not None and not tools:
        raise ToolError("`tools` must not be an empty array. Either provide at least one tool or omit the field "
                        "entirely.", "tools")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return None
    if not tools:
        raise ToolError("When using `tool_choice`, `tools` must be set.", "tool_choice")
    funcs = [{"name": t.function.name, "parameters": t.function.parameters} for t in tools]
    fmt = TOOL_PARSERS.get(settings.parser) if settings.parser else None
    if isinstance(choice, NamedToolChoice):
        named = [f for f in funcs if f["name"] == choice.function.name]
        if not named:
            raise ToolError("The tool specified in `tool_choice` does not match any of the specified `tools`",
                            "tool_choice")
        if structured:
            raise ToolError("You can only either use constraints for structured outputs or tools, not both.",
                            "tool_choice")
        return ToolPlan(fmt or Plain(named[0]["name"]), named, "required", False)
    if choice == "auto" and (fmt is None or not settings.auto):
        raise ToolError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                        "tool_choice")
    return ToolPlan(fmt or Plain(None), funcs, choice, parallel is not False)
