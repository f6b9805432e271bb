"""The structural tags (XGrammar's, as JSON: server/engine/grammar_tags.py compiles them) that make
tool calls parse: the pieces every format builds its calls from, and `tool_grammar`, which puts a
request's together: its tool choice, `parallel_tool_calls`, a `response_format` beside the tools,
and the reasoning the model may write first.

- `required` (and a named function, which is `required` over that one tool): one call or more in
  the format's syntax and nothing else; with `parallel_tool_calls: false`, exactly one.
- `auto`: any text, but a call once its start tag is written is a whole call of a listed tool
  (XGrammar's triggered tags); `parallel_tool_calls: false` ends the reply after the first call.
- `auto` with a JSON `response_format`: a call (as `required`) or the object, nothing else.
- With a reasoning parser, a reasoning block may come first (`reasoning`: "enabled" when the prompt
  left it open, "auto" when the model may open one, "disabled" when the template closed it).
"""

from __future__ import annotations

import json

from server.sampling_params import StructuredOutput


def call_tag(begin: str, content: dict, end: str) -> dict:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def const(text: str) -> dict:
    return {"type": "const_string", "value": text}


def json_args(tool: dict) -> dict:
    """A function's arguments: JSON matching its parameters (any JSON object without them)."""
    return {"type": "json_schema", "json_schema": tool.get("parameters") or {"type": "object"}}


def listed(tags: list[dict], separator: str, parallel: bool) -> dict:
    """One call or more (exactly one unless `parallel`), `separator` between them."""
    return {"type": "tags_with_separator", "tags": tags, "separator": separator, "at_least_one": True,
            "stop_after_first": not parallel}


def triggered(triggers: list[str], tags: list[dict], parallel: bool) -> dict:
    """Any text, in which a trigger starts one of `tags` (the reply ends after one unless `parallel`)."""
    return {"type": "triggered_tags", "triggers": triggers, "tags": tags, "stop_after_first": not parallel}


def reasoning_block(mode: str, start: str, end: str) -> dict | None:
    """The reasoning that may precede the answer; None when there is none."""
    if mode == "disabled":
        return None
    block = {"type": "sequence", "elements": [call_tag("" if mode == "enabled" else start, {"type": "any_text"}, end),
                                              {"type": "regex", "pattern": r"\s{0,2}"}]}
    return block if mode == "enabled" else {"type": "optional", "content": block}


def tool_grammar(fmt, tools: list[dict], choice: str, parallel: bool, response: dict | None = None,
                 reasoning: dict | None = None) -> StructuredOutput:
    """The grammar of a reply under `choice` ("auto" or "required"; a named function is "required"
    over `tools` = [that function]) in format `fmt` (a module of server/api/tools/). `response`: the
    structural-tag format of a response_format beside the tools (auto only)."""
    if choice == "required":
        body = fmt.calls(tools, parallel)
    elif response is not None:
        body = {"type": "or", "elements": [fmt.calls(tools, parallel), response]}
    else:
        body = fmt.auto(tools, parallel)
    return structural(body, reasoning)


def structural(body: dict, reasoning: dict | None = None) -> StructuredOutput:
    """The structural tag of `body` (after `reasoning`, when given), as a structured-output spec."""
    if reasoning is not None:
        body = {"type": "sequence", "elements": [reasoning, body]}
    return StructuredOutput("structural_tag", json.dumps({"type": "structural_tag", "format": body},
                                                         sort_keys=True, ensure_ascii=False))


def as_format(spec: StructuredOutput) -> dict:
    """A response_format's or structured_outputs' spec as a structural-tag format (to stand beside
    tool calls, or after reasoning)."""
    if spec.kind == "json":
        return {"type": "json_schema", "json_schema": json.loads(spec.spec)}
    if spec.kind == "json_object":
        return {"type": "json_schema", "json_schema": {"type": "object"}}
    if spec.kind == "regex":
        return {"type": "regex", "pattern": spec.spec}
    if spec.kind == "grammar":
        return {"type": "grammar", "grammar": spec.spec}
    if spec.kind == "choice":
        return {"type": "or", "elements": [const(c) for c in json.loads(spec.spec)]}
    return json.loads(spec.spec)["format"]  # structural_tag
