"""The mistral format (`--tool-call-parser mistral`), which Mistral's instruct models (v0.3 and
after, the JSON-array form) write: one region holding a JSON array of calls,

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]

Where a tokenizer makes `[TOOL_CALLS]` a special token, the detokenizer drops it from the text: the
grammar of a required or named choice then writes it as text, and an auto choice only finds calls
the model writes that way."""

from __future__ import annotations

from server.api.tools.tags import call_tag, json_args, listed, triggered
from server.api.tools.json_calls import JsonCalls, Layout

name = "mistral"
START = "[TOOL_CALLS]"
_LAYOUT = Layout(opener=START, list_open="[", separator=",", list_close="]")


def start_tags(names: list[str]) -> list[str]:
    return [START]


def region(tag: str) -> JsonCalls:
    return JsonCalls(_LAYOUT)


def call_tags(tools: list[dict]) -> list[dict]:
    return [call_tag(f'{{"name": "{t["name"]}", "arguments": ', json_args(t), "}") for t in tools]


def calls(tools: list[dict], parallel: bool) -> dict:
    return call_tag(f"{START} [", listed(call_tags(tools), ", ", parallel), "]")


def auto(tools: list[dict], parallel: bool) -> dict:
    return triggered([START], [calls(tools, parallel)], parallel=False)
