"""The hermes format (`--tool-call-parser hermes`), which Qwen2.5 and Qwen3 write: each call a JSON
object in its own tags,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

calls one after the other (a newline between them), text before them is content."""

from __future__ import annotations

from server.api.tools.tags import call_tag, json_args, listed, triggered
from server.api.tools.json_calls import JsonCalls, Layout

name = "hermes"
START, END = "<tool_call>", "</tool_call>"
_LAYOUT = Layout(opener=START, closer=END)


def start_tags(names: list[str]) -> list[str]:
    return [START]


def region(tag: str) -> JsonCalls:
    return JsonCalls(_LAYOUT)


def call_tags(tools: list[dict]) -> list[dict]:
    return [call_tag(f'{START}\n{{"name": "{t["name"]}", "arguments": ', json_args(t), f"}}\n{END}") for t in tools]


def calls(tools: list[dict], parallel: bool) -> dict:
    return listed(call_tags(tools), "\n", parallel)


def auto(tools: list[dict], parallel: bool) -> dict:
    return triggered([START], call_tags(tools), parallel)
