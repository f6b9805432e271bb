"""The streaming contract every tool-call format meets, and the driver that splits an assistant's
text into content and calls, whatever the chunks it arrives in.

A format (one module each: hermes.py, llama3_json.py, mistral.py, pythonic.py, plain.py) gives
- `start_tags(tools)`: the literal strings that open a call region (a region holds one call or a
  list of them);
- `region(tag)`: a `Region` reading that region's text, fed as it arrives;
- the structural tags of its calls (grammar.py: the grammar that makes every call parse).

The driver (`ToolParser`) holds back text that may still become a start tag (a chunk may end inside
one), hands each region to its `Region`, and turns what they read into `Piece`s: `Text` (content),
`CallStart` (a call's name, known before its arguments) and `CallArgs` (the arguments' JSON text,
in pieces whose concatenation is the whole). Whitespace at the end of content is held until text
follows it: it goes out with that text, is dropped before a call, and is kept at the end only
when the reply made no call, so that streamed and whole replies agree; whitespace after a call is
dropped too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Text:
    text: str


@dataclass(frozen=True, slots=True)
class CallStart:
    name: str


@dataclass(frozen=True, slots=True)
class CallArgs:
    text: str


Piece = Text | CallStart | CallArgs


class Region(Protocol):
    """Reads one call region, from its start tag on. `feed` returns what became known; once `done`,
    `rest` is the text after the region (given back to the driver). `end` is called when the reply
    ends inside the region: a region that never named a call gives its text back as `Text`."""

    done: bool
    rest: str

    def feed(self, text: str) -> list[Piece]: ...

    def end(self) -> list[Piece]: ...


class ToolFormat(Protocol):
    name: str

    def start_tags(self, names: list[str]) -> list[str]: ...

    def region(self, tag: str) -> Region: ...

    def call_tags(self, tools: list[dict]) -> list[dict]: ...

    def calls(self, tools: list[dict], parallel: bool) -> dict: ...

    def auto(self, tools: list[dict], parallel: bool) -> dict: ...


class ToolParser:
    """Content and calls out of a reply in `fmt`, fed in any chunks (`feed`), then `end`."""

    def __init__(self, fmt: ToolFormat, names: list[str]) -> None:
        self.fmt, self.tags = fmt, [t for t in fmt.start_tags(names) if t]
        self.opens_at_start = "" in fmt.start_tags(names)  # the whole reply is a region (plain.py)
        self.region: Region | None = None
        self.buf = ""  # text outside a region that may still begin a start tag
        self.ws = ""  # whitespace at the end of the content so far, held back
        self.calls = 0
        self.after_call = False  # whitespace after a call is no content either

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        if self.opens_at_start:
            self.opens_at_start = False
            self.region = self.fmt.region("")
        while True:
            if self.region is not None:
                self._take(self.region.feed(text), out)
                if not self.region.done:
                    return out
                text, self.region = self.region.rest, None
                continue
            self.buf += text
            at, tag = _first_tag(self.buf, self.tags)
            if tag is None:
                keep = _tag_prefix(self.buf, self.tags)
                self._content(self.buf[: len(self.buf) - keep], out)
                self.buf = self.buf[len(self.buf) - keep:]
                return out
            self._content(self.buf[:at], out)
            text, self.buf = self.buf[at:], ""
            self.region = self.fmt.region(tag)

    def end(self) -> list[Piece]:
        out: list[Piece] = []
        if self.region is not None:
            self._take(self.region.end(), out)
            self.region = None
        self._content(self.buf, out)
        self.buf = ""
        if self.ws and not self.calls:
            out.append(Text(self.ws))
        self.ws = ""
        return out

    def _take(self, pieces: list[Piece], out: list[Piece]) -> None:
        for p in pieces:
            if isinstance(p, Text):
                self._content(p.text, out)
                continue
            if isinstance(p, CallStart):
                self.calls += 1
                self.ws, self.after_call = "", True
            out.append(p)

    def _content(self, text: str, out: list[Piece]) -> None:
        text = self.ws + text
        if self.after_call:
            text = text.lstrip()
            self.after_call = not text
        if not text:
            self.ws = ""
            return
        body = text.rstrip()
        self.ws = text[len(body):]
        if body:
            out.append(Text(body))


def _first_tag(text: str, tags: list[str]) -> tuple[int, str | None]:
    best, found = len(text), None
    for tag in tags:
        at = text.find(tag)
        if at != -1 and (at < best or (at == best and found is not None and len(tag) > len(found))):
            best, found = at, tag
    return best, found


def _tag_prefix(text: str, tags: list[str]) -> int:
    """The length of the longest end of `text` that a start tag begins with (it may still become one)."""
    longest = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), longest, -1):
            if text.endswith(tag[:n]):
                longest = n
                break
    return longest
