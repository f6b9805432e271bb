"""What an assistant said, read out of a reply's text as it streams: reasoning (the reasoning
parser's, server/api/reasoning/), content, and tool calls (the tool parser's, server/api/tools/),
in that order of reading: the reasoning splitter first, then the tool parser over what it calls
the answer. The chat route turns the parts into OpenAI's message and deltas (`chat_deltas`,
`chat_message`); the Responses route into its output items and events.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from server.api.reasoning import ThinkSplitter
from server.api.tools.base import CallArgs, CallStart, Text, ToolParser


@dataclass(slots=True)
class Part:
    """One piece of the reply: kind "reasoning" or "content" (text), "call" (a call begins: index,
    id and name in `text`) or "args" (more of call `index`'s arguments)."""

    kind: str
    text: str
    index: int = -1
    call_id: str = ""


@dataclass
class Call:
    id: str
    name: str
    arguments: str = ""


@dataclass
class AssistantReply:
    """A reply's parts as it streams (`feed`, then `end`), and what it said in all."""

    reasoning_parser: ThinkSplitter | None = None
    tool_parser: ToolParser | None = None
    reasoning: str = ""
    content: str = ""
    calls: list[Call] = field(default_factory=list)

    def feed(self, text: str) -> list[Part]:
        return self._parts(text, final=False)

    def end(self) -> list[Part]:
        return self._parts("", final=True)

    def _parts(self, text: str, final: bool) -> list[Part]:
        if self.reasoning_parser is None:
            said = [("content", text)] if text else []
        else:
            said = self.reasoning_parser.feed(text) if text else []
            said += self.reasoning_parser.end() if final else []
        out: list[Part] = []
        for kind, piece in said:
            if kind == "reasoning":
                self.reasoning += piece
                out.append(Part("reasoning", piece))
            else:
                self._answer(self.tool_parser.feed(piece) if self.tool_parser else [Text(piece)], out)
        if final and self.tool_parser is not None:
            self._answer(self.tool_parser.end(), out)
        return _merged(out)

    def _answer(self, pieces, out: list[Part]) -> None:
        for p in pieces:
            if isinstance(p, Text):
                self.content += p.text
                out.append(Part("content", p.text))
            elif isinstance(p, CallStart):
                self.calls.append(Call(f"call_{uuid.uuid4().hex[:24]}", p.name))
                out.append(Part("call", p.name, len(self.calls) - 1, self.calls[-1].id))
            elif isinstance(p, CallArgs):
                self.calls[-1].arguments += p.text
                out.append(Part("args", p.text, len(self.calls) - 1))


def _merged(parts: list[Part]) -> list[Part]:
    """Neighbouring parts of one kind (and call) as one."""
    out: list[Part] = []
    for p in parts:
        last = out[-1] if out else None
        if last is not None and p.kind == last.kind and p.kind != "call" and p.index == last.index:
            last.text += p.text
        else:
            out.append(p)
    return out


def chat_deltas(parts: list[Part]) -> list[dict]:
    """OpenAI's chat deltas of `parts`: content, reasoning (as `reasoning_content` and vLLM's
    `reasoning`), and tool calls (index, id, type and name first, then the arguments in pieces)."""
    deltas = []
    for p in parts:
        if p.kind == "content":
            deltas.append({"content": p.text})
        elif p.kind == "reasoning":
            deltas.append({"reasoning_content": p.text, "reasoning": p.text})
        elif p.kind == "call":
            deltas.append({"tool_calls": [{"index": p.index, "id": p.call_id, "type": "function",
                                           "function": {"name": p.text, "arguments": ""}}]})
        else:
            deltas.append({"tool_calls": [{"index": p.index, "function": {"arguments": p.text}}]})
    return deltas


def chat_message(reply: AssistantReply) -> dict:
    """The whole assistant message: content (None when the reply is calls alone), reasoning where a
    reasoning parser runs, and tool_calls where calls were made."""
    message: dict = {"role": "assistant", "content": reply.content or (None if reply.calls else "")}
    if reply.reasoning_parser is not None:
        message["reasoning_content"] = message["reasoning"] = reply.reasoning or None
    if reply.calls:
        message["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name,
                                                                              "arguments": c.arguments}}
                                 for c in reply.calls]
    return message
