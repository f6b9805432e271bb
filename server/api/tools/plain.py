"""Calls as plain JSON, what a required or named tool choice produces when the server runs without
`--tool-call-parser` (vLLM's shapes): a named function's reply is its arguments object,

    {"city": "Paris"}

and a required choice's is a JSON array of calls, `[{"name": "get_weather", "parameters": {...}}]`.
The whole reply is the region (its start tag is the empty string)."""

from __future__ import annotations

from server.api.tools.base import CallArgs, CallStart, Piece
from server.api.tools.json_calls import JsonCalls, Layout
from server.api.tools.tags import call_tag, json_args, listed

_LAYOUT = Layout(list_open="[", separator=",", list_close="]", args_keys=("parameters", "arguments"))


class Plain:
    """The plain format of one request: `named` is the function a named choice forces (else None)."""

    name = "plain"

    def __init__(self, named: str | None) -> None:
        self.named = named

    def start_tags(self, names: list[str]) -> list[str]:
        return [""]

    def region(self, tag: str):
        return NamedArgs(self.named) if self.named else JsonCalls(_LAYOUT)

    def call_tags(self, tools: list[dict]) -> list[dict]:
        return [call_tag(f'{{"name": "{t["name"]}", "parameters": ', json_args(t), "}") for t in tools]

    def calls(self, tools: list[dict], parallel: bool) -> dict:
        if self.named:
            return json_args(tools[0])
        return call_tag("[", listed(self.call_tags(tools), ", ", parallel), "]")

    def auto(self, tools: list[dict], parallel: bool) -> dict:
        raise AssertionError("auto needs a --tool-call-parser (refused before this)")


class NamedArgs:
    """The whole reply is the arguments of the one function a named choice forces."""

    def __init__(self, name: str) -> None:
        self.name, self.started = name, False
        self.done, self.rest = False, ""

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = [] if self.started else [CallStart(self.name)]
        self.started = True
        return out + ([CallArgs(text)] if text else [])

    def end(self) -> list[Piece]:
        return self.feed("") if not self.started else []
