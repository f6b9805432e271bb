"""The llama3_json format (`--tool-call-parser llama3_json`), which Llama 3.1-3.3 write for custom
tools: a JSON object per call, its arguments under "parameters" (or "arguments"),

    {"name": "get_weather", "parameters": {"city": "Paris"}}

several separated by "; ", after an optional `<|python_tag|>`. An object without parameters is not
a call (a JSON answer may have a "name" too)."""

from __future__ import annotations

from server.api.tools.tags import call_tag, json_args, listed, triggered
from server.api.tools.json_calls import JsonCalls, Layout

name = "llama3_json"
PYTHON_TAG = "<|python_tag|>"
TRIGGER = '{"name": '  # how every call the grammar writes begins
_KEYS = ("parameters", "arguments")


def start_tags(names: list[str]) -> list[str]:
    return [PYTHON_TAG, '{"name"']


def region(tag: str) -> JsonCalls:
    return JsonCalls(Layout(opener=tag if tag == PYTHON_TAG else "", separator=";", args_keys=_KEYS,
                            require_args=True))


def call_tags(tools: list[dict]) -> list[dict]:
    return [call_tag(f'{TRIGGER}"{t["name"]}", "parameters": ', json_args(t), "}") for t in tools]


def calls(tools: list[dict], parallel: bool) -> dict:
    return listed(call_tags(tools), "; ", parallel)


def auto(tools: list[dict], parallel: bool) -> dict:
    return triggered([TRIGGER], call_tags(tools), parallel)
