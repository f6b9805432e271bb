"""Reasoning between think tags, split from the answer as it streams.

Where a reply starts is read from the rendered prompt (`ThinkFormat.state`): a prompt that leaves a
think block open (Qwen3's thinking templates, DeepSeek-R1's) starts it in reasoning; one that closed
it (Qwen3 with `enable_thinking: false` writes an empty block) starts it in the answer; otherwise
the parser's default decides: "maybe" (reasoning only if the reply opens with the start tag) or
"reasoning". Reasoning runs to the end tag (a start tag the model writes first is dropped), and
whitespace after the end tag is dropped. A reply cut off inside reasoning is all reasoning. The
tool-call grammar (server/api/tools/tags.py) lets a reasoning block come first by the same state.
"""

from __future__ import annotations

from dataclasses import dataclass

_STATE_MODE = {"reasoning": "enabled", "content": "disabled", "maybe": "auto"}


@dataclass(frozen=True)
class ThinkFormat:
    name: str
    start: str
    end: str
    default: str  # "maybe" or "reasoning": where a reply starts when the prompt does not say

    def state(self, prompt_tail: str) -> str:
        """"reasoning", "content" or "maybe", from the end of the rendered prompt."""
        if prompt_tail.rfind(self.start) > prompt_tail.rfind(self.end):
            return "reasoning"
        if prompt_tail.rstrip().endswith(self.end):
            return "content"
        return self.default

    def grammar_mode(self, state: str) -> str:
        """The reasoning block's mode in a grammar (server/api/tools/tags.py: reasoning_block)."""
        return _STATE_MODE[state]


class ThinkSplitter:
    """Feeds of a reply's text in, ("reasoning" | "content", text) pieces out; `end` flushes."""

    def __init__(self, fmt: ThinkFormat, state: str) -> None:
        self.fmt, self.state = fmt, state
        self.opening = state != "content"  # a start tag may still come first
        self.buf = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.buf += text
        out: list[tuple[str, str]] = []
        while self.buf:
            if self.opening:
                head = self.buf.lstrip()
                if head.startswith(self.fmt.start):
                    self.buf, self.state, self.opening = head[len(self.fmt.start):], "reasoning", False
                    continue
                if self.fmt.start.startswith(head):
                    return out  # it may still be the start tag
                self.opening = False
                if self.state == "maybe":
                    self.state = "content"
            if self.state == "after":  # whitespace after the end tag is dropped
                self.buf = self.buf.lstrip()
                if self.buf:
                    self.state = "content"
                continue
            if self.state == "content":
                out.append(("content", self.buf))
                self.buf = ""
                return out
            at = self.buf.find(self.fmt.end)
            if at != -1:
                if at:
                    out.append(("reasoning", self.buf[:at]))
                self.buf, self.state = self.buf[at + len(self.fmt.end):], "after"
                continue
            keep = next((n for n in range(min(len(self.fmt.end) - 1, len(self.buf)), 0, -1)
                         if self.buf.endswith(self.fmt.end[:n])), 0)
            if len(self.buf) > keep:
                out.append(("reasoning", self.buf[:len(self.buf) - keep]))
                self.buf = self.buf[len(self.buf) - keep:]
            return out
        return out

    def end(self) -> list[tuple[str, str]]:
        text, self.buf = self.buf, ""
        if not text or self.state == "after":
            return []
        return [("reasoning" if self.state == "reasoning" else "content", text)]
