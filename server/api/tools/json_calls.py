"""Calls written as JSON objects `{"name": ..., "arguments": {...}}`, the shape of the hermes,
llama3_json, mistral and plain formats, read as they stream: `JsonCalls` is a `Region`
(server/api/tools/base.py) laid out by a `Layout` (what opens and closes the region, whether the
calls are a JSON array, what separates them), and `_Object` reads one object a character at a time,
knowing at its top level each key and where each value starts and ends.

A call is started (its name given out) once its name is read and its arguments have begun; the
arguments then go out as the model writes them, character for character, so their pieces join into
exactly the JSON text the model wrote (arguments given as a JSON string are decoded, in one piece).
An object that is not a call (no name, or, where the layout requires them, no arguments) and a
region that breaks off before any call are given back as text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from server.api.tools.base import CallArgs, CallStart, Piece, Text

_WS = " \t\r\n"


@dataclass(frozen=True)
class Layout:
    opener: str = ""  # text the region starts with (its start tag, when the tag is not the object's start)
    list_open: str = ""  # "[" when the calls are a JSON array
    separator: str = ""  # between calls: "," in an array, ";" between Llama's objects; "" = one call
    list_close: str = ""
    closer: str = ""  # after the calls: hermes' "</tool_call>"
    args_keys: tuple[str, ...] = ("arguments", "parameters")
    require_args: bool = False  # an object without arguments is not a call (Llama's, which may be an answer)


class _Object:
    """One JSON object, read incrementally from `text[start:]` (`scan(text)` reads what is new)."""

    def __init__(self, start: int, args_keys: tuple[str, ...]) -> None:
        self.i, self.args_keys = start, args_keys
        self.depth, self.in_str, self.esc = 0, False, False
        self.state = "open"  # at the top level: open | key | colon | value | scalar | after
        self.key: str | None = None
        self.mark = 0  # where the current key or value began
        self.name: str | None = None
        self.args: list[int | None] | None = None  # [start, end or None]
        self.complete = self.broken = False

    def scan(self, text: str) -> None:
        while self.i < len(text) and not (self.complete or self.broken):
            self._char(text, text[self.i])
            self.i += 1

    def _char(self, text: str, c: str) -> None:
        if self.in_str:
            if self.esc:
                self.esc = False
            elif c == "\\":
                self.esc = True
            elif c == '"':
                self.in_str = False
                if self.depth == 1 and self.state == "key":
                    try:
                        self.key = json.loads(text[self.mark:self.i + 1])
                    except ValueError:
                        self.broken = True
                    self.state = "colon"
                elif self.depth == 1:
                    self._value_end(text, self.i + 1)
            return
        if self.depth > 1:
            if c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 1:
                    self._value_end(text, self.i + 1)
            return
        if self.state == "scalar":
            if c not in _WS + ",}":
                return
            self._value_end(text, self.i)
        if c in _WS:
            return
        state = self.state
        if state == "open":
            self.depth, self.state, self.broken = 1, "key", c != "{"
        elif state == "key" and c == '"':
            self.in_str, self.mark = True, self.i
        elif state in ("key", "after") and c == "}":
            self.depth, self.complete = 0, True
        elif state == "colon" and c == ":":
            self.state = "value"
        elif state == "after" and c == ",":
            self.state = "key"
        elif state == "value":
            self.mark = self.i
            if self.key in self.args_keys:
                self.args = [self.i, None]
            if c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            else:
                self.state = "scalar"
        else:
            self.broken = True

    def _value_end(self, text: str, end: int) -> None:
        self.state = "after"
        if self.key == "name" and self.name is None:
            value = text[self.mark:end]
            self.name = json.loads(value) if value.startswith('"') else None
        elif self.key in self.args_keys and self.args is not None and self.args[1] is None:
            self.args[1] = end


class JsonCalls:
    """A region of JSON calls laid out by `layout` (see the module docstring)."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.text, self.pos, self.phase = "", 0, "opener"
        self.obj: _Object | None = None
        self.started = False  # the current object's call has been given out
        self.sent = 0  # how far its arguments have gone out
        self.calls = 0
        self.done, self.rest = False, ""

    def feed(self, text: str) -> list[Piece]:
        self.text += text
        out: list[Piece] = []
        self._run(out, final=False)
        return out

    def end(self) -> list[Piece]:
        out: list[Piece] = []
        self._run(out, final=True)
        if not self.done and not self.calls:
            out.append(Text(self.text))
        self.done = True
        return out

    def _finish(self, at: int) -> None:
        self.done, self.rest, self.phase = True, self.text[at:], "done"

    def _give_back(self, out: list[Piece], at: int) -> None:
        """Not a call after all: the region's text from `at` (all of it when no call came before)."""
        if self.calls:
            self._finish(at)
        else:
            out.append(Text(self.text))
            self._finish(len(self.text))

    def _skip_ws(self) -> int:
        i = self.pos
        while i < len(self.text) and self.text[i] in _WS:
            i += 1
        return i

    def _run(self, out: list[Piece], final: bool) -> None:
        lay = self.layout
        while not self.done:
            if self.phase == "opener":
                self.pos, self.phase = len(lay.opener), "list" if lay.list_open else "object"
                continue
            if self.phase == "object_read":
                if not self._read(out):
                    return
                continue
            i = self._skip_ws()
            if i == len(self.text) and not final:
                return
            nxt = self.text[i:i + 1]
            if self.phase == "list":
                if nxt != lay.list_open:
                    return self._give_back(out, self.pos)
                self.pos, self.phase = i + 1, "object"
            elif self.phase == "object":
                if nxt != "{":
                    return self._give_back(out, self.pos)
                self.obj, self.started, self.pos = _Object(i, lay.args_keys), False, i
                self.phase = "object_read"
            elif self.phase == "after":
                if lay.separator and nxt == lay.separator:
                    self.pos, self.phase = i + 1, "object"
                elif lay.list_close and nxt == lay.list_close:
                    self.pos, self.phase = i + 1, "closer"
                else:
                    self.phase = "closer"
            elif self.phase == "closer":
                tail = self.text[i:]
                if lay.closer and tail.startswith(lay.closer):
                    return self._finish(i + len(lay.closer))
                if lay.closer and lay.closer.startswith(tail) and not final:
                    return
                return self._finish(self.pos)
            if final and i == len(self.text):
                return

    def _read(self, out: list[Piece]) -> bool:
        """Scan the current object; give out what became known. False: wait for more text."""
        obj, text = self.obj, self.text
        obj.scan(text)
        if obj.broken or (obj.complete and (obj.name is None or (obj.args is None and self.layout.require_args))):
            if self.started:  # a call already given out ends here; what follows is text
                self._finish(obj.i)
            else:
                self._give_back(out, self.pos)
            return False
        if not self.started and obj.name is not None and (obj.args is not None or obj.complete):
            self.started, self.calls = True, self.calls + 1
            out.append(CallStart(obj.name))
            self.sent = obj.args[0] if obj.args is not None else 0
        if self.started and obj.args is not None:
            start, end = obj.args
            if text[start] == '"':  # arguments as a JSON string: decoded, once whole
                if end is not None and self.sent < end:
                    out.append(CallArgs(json.loads(text[start:end])))
                    self.sent = end
            else:
                upto = end if end is not None else obj.i
                if upto > self.sent:
                    out.append(CallArgs(text[self.sent:upto]))
                    self.sent = upto
        if not obj.complete:
            return False
        if obj.args is None:
            out.append(CallArgs("{}"))
        self.pos, self.phase = obj.i, "after"
        if not self.layout.separator:
            self.phase = "closer"
        return True
