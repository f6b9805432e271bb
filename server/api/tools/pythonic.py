"""The pythonic format (`--tool-call-parser pythonic`), which Llama 3.2 and Llama 4 write: the calls
as a Python list of calls with keyword arguments,

    [get_weather(city="Paris", days=2), get_time(zone="CET")]

The arguments are Python literals (read with `ast.literal_eval`) and come out as JSON. A call is
started when `name(` is read and its arguments follow, whole, when its parenthesis closes. The
grammar writes each argument's value as JSON with Python's True, False and None, so that every
call it allows is Python; required arguments first, then any of the optional ones, in the
schema's order (a tool of more than MAX_FIRSTS arguments, none required, writes each with a
trailing comma, which Python allows: its grammar then grows linearly)."""

from __future__ import annotations

import ast
import json

from server.api.tools.base import CallArgs, CallStart, Piece, Text
from server.api.tools.tags import call_tag, const, listed

name = "pythonic"
MAX_FIRSTS = 16  # optional arguments beyond which (and none required) each is written with a trailing comma


def start_tags(names: list[str]) -> list[str]:
    return [f"[{n}(" for n in names]


def region(tag: str) -> PythonCalls:
    return PythonCalls()


def call_tags(tools: list[dict]) -> list[dict]:
    return [call_tag(f'{t["name"]}(', _kwargs(t.get("parameters")), ")") for t in tools]


def calls(tools: list[dict], parallel: bool) -> dict:
    return call_tag("[", listed(call_tags(tools), ", ", parallel), "]")


def auto(tools: list[dict], parallel: bool) -> dict:
    # one trigger per tool ("[name("): a bracket alone stays text
    more = [] if not parallel else [{"type": "star", "content": {"type": "sequence", "elements": [
        const(", "), {"type": "or", "elements": call_tags(tools)}]}}]
    tags = [call_tag(f'[{t["name"]}(', {"type": "sequence", "elements": [_kwargs(t.get("parameters")), const(")"),
                                                                           *more]}, "]") for t in tools]
    return {"type": "triggered_tags", "triggers": [f'[{t["name"]}(' for t in tools], "tags": tags,
            "stop_after_first": not parallel}


def _kwargs(schema: dict | None) -> dict:
    """Keyword arguments matching an object schema: the required ones in order, then any subset of
    the optional ones in order (Python takes keywords in any order; the grammar fixes one)."""
    props = (schema or {}).get("properties") or {}
    if not props:
        return const("")
    shared = {k: schema[k] for k in ("$defs", "definitions") if k in schema}  # what a property's $ref reads
    required = [p for p in props if p in set(schema.get("required") or ())]
    optional = [p for p in props if p not in required]

    def kw(p: str) -> dict:
        value = props[p] if isinstance(props[p], dict) else {}
        return {"type": "sequence", "elements": [const(f"{p}="), {"type": "json_schema", "json_schema": {
            **shared, **value}, "style": "python"}]}

    def tail(opts: list[str]) -> list[dict]:
        return [{"type": "optional", "content": {"type": "sequence", "elements": [const(", "), kw(p)]}} for p in opts]

    if required:
        head = [kw(required[0])] + [x for p in required[1:] for x in (const(", "), kw(p))]
        return {"type": "sequence", "elements": head + tail(optional)}
    if len(optional) > MAX_FIRSTS:  # the choice of a first argument grows as n^2: a trailing comma instead
        return {"type": "sequence", "elements": [{"type": "optional", "content": {
            "type": "sequence", "elements": [kw(p), const(", ")]}} for p in optional]}
    firsts = [{"type": "sequence", "elements": [kw(p), *tail(optional[i + 1:])]} for i, p in enumerate(optional)]
    return {"type": "or", "elements": [*firsts, const("")]}


class PythonCalls:
    """A `Region` of a Python list of calls (server/api/tools/base.py), read character by character:
    strings (either quote, with escapes) and nesting are followed so that only the list's own
    parentheses and brackets count."""

    def __init__(self) -> None:
        self.text, self.i = "", 0
        self.depth = 0  # brackets and parentheses open, the list's own included
        self.quote, self.esc = "", False
        self.call_at = -1  # where the current call's name begins
        self.calls = 0
        self.done, self.rest = False, ""

    def feed(self, text: str) -> list[Piece]:
        self.text += text
        out: list[Piece] = []
        while self.i < len(self.text) and not self.done:
            self._char(self.text[self.i], out)
            self.i += 1
        return out

    def end(self) -> list[Piece]:
        self.done = True
        return [] if self.calls else [Text(self.text)]

    def _char(self, c: str, out: list[Piece]) -> None:
        if self.quote:
            if self.esc:
                self.esc = False
            elif c == "\\":
                self.esc = True
            elif c == self.quote:
                self.quote = ""
            return
        if c in "'\"":
            self.quote = c
        elif c in "[({":
            self.depth += 1
            if c == "(" and self.depth == 2:  # a call of the list opens: its name is known
                self.call_at = self.text.rfind("[" if self.calls == 0 else ",", 0, self.i) + 1
                out.append(CallStart(self.text[self.call_at:self.i].strip()))
                self.calls += 1
        elif c in "])}":
            self.depth -= 1
            if c == ")" and self.depth == 1:
                out.append(CallArgs(_arguments(self.text[self.call_at:self.i + 1])))
            elif self.depth == 0:
                self.done, self.rest = True, self.text[self.i + 1:]


def _arguments(call: str) -> str:
    """A call's keyword arguments as a JSON object ("{}" for what is not a call of literals)."""
    try:
        node = ast.parse(call.strip(), mode="eval").body
        args = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
        return json.dumps(args, ensure_ascii=False)
    except (SyntaxError, ValueError, TypeError, AttributeError, RecursionError):
        return "{}"
