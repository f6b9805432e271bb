"""A reply as the Responses API shows it: output items (reasoning, message, function_call) built
from the assistant's parts (server/api/assistant.py) in the order they came, with the stream's
events for each (OpenAI's types, each numbered by `sequence_number`), and the response object.

An item opens when its first part arrives and closes when a part of another item does (or the
reply ends): reasoning as `response.reasoning_text.delta` / `.done`; a message as a content part
of `output_text` with `response.output_text.delta` / `.done`; a call as
`response.function_call_arguments.delta` / `.done`. Each item is announced by
`response.output_item.added` and finished by `response.output_item.done`.
"""

from __future__ import annotations

import time
import uuid

from server.api.assistant import Part


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputBuilder:
    """The output items of one reply, and the events that build them (`add`, then `close`)."""

    def __init__(self) -> None:
        self.items: list[dict] = []
        self.open: dict | None = None  # the item parts are being added to
        self.seq = 0

    def event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def add(self, parts: list[Part]) -> list[dict]:
        events: list[dict] = []
        for p in parts:
            kind = {"reasoning": "reasoning", "content": "message"}.get(p.kind, "function_call")
            if self.open is None or self.open["type"] != kind or p.kind == "call":
                events += self.close()
                events += self._start(p)
            events += self._more(p)
        return events

    def _start(self, p: Part) -> list[dict]:
        if p.kind == "reasoning":
            item = {"type": "reasoning", "id": _id("rs"), "summary": [], "content": [], "status": "in_progress"}
        elif p.kind == "content":
            item = {"type": "message", "id": _id("msg"), "status": "in_progress", "role": "assistant", "content": []}
        else:
            item = {"type": "function_call", "id": _id("fc"), "call_id": p.call_id, "name": p.text, "arguments": "",
                    "status": "in_progress"}
        self.open, index = item, len(self.items)
        self.items.append(item)
        events = [self.event("response.output_item.added", output_index=index, item=_copy(item))]
        if p.kind == "content":
            item["content"].append({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            events.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                     content_index=0, part=_copy(item["content"][0])))
        elif p.kind == "reasoning":
            item["content"].append({"type": "reasoning_text", "text": ""})
        return events

    def _more(self, p: Part) -> list[dict]:
        item, index = self.open, len(self.items) - 1
        if p.kind == "call" or not p.text:
            return []
        if p.kind == "args":
            item["arguments"] += p.text
            return [self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                               delta=p.text)]
        item["content"][0]["text"] += p.text
        if p.kind == "reasoning":
            return [self.event("response.reasoning_text.delta", item_id=item["id"], output_index=index,
                               content_index=0, delta=p.text)]
        return [self.event("response.output_text.delta", item_id=item["id"], output_index=index, content_index=0,
                           delta=p.text, logprobs=[])]

    def close(self) -> list[dict]:
        """Finish the open item (its done events)."""
        item, self.open = self.open, None
        if item is None:
            return []
        index, events = len(self.items) - 1, []
        item["status"] = "completed"
        if item["type"] == "function_call":
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                     name=item["name"], arguments=item["arguments"]))
        elif item["type"] == "reasoning":
            events.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                     content_index=0, text=item["content"][0]["text"]))
        else:
            part = item["content"][0]
            events.append(self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                     content_index=0, text=part["text"], logprobs=[]))
            events.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                     content_index=0, part=_copy(part)))
        events.append(self.event("response.output_item.done", output_index=index, item=_copy(item)))
        return events


def _copy(item: dict) -> dict:
    """A snapshot of an item as it is now (events carry what was true when they were sent)."""
    return {k: [dict(x) for x in v] if isinstance(v, list) else v for k, v in item.items()}


def response_object(rid: str, body, items: list[dict], status: str, usage: dict | None,
                    created: int | None = None, incomplete: str | None = None, error: dict | None = None) -> dict:
    """The `response` object: the request's settings echoed, the output items, status and usage."""
    fmt = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format else {
        "type": "text"}
    choice = body.tool_choice
    return {
        "id": rid, "object": "response", "created_at": created or int(time.time()), "status": status,
        "background": False, "error": error,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": body.model,
        "output": items, "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": None, "reasoning": body.reasoning or {"effort": None, "summary": None},
        "store": False, "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": {"format": fmt},
        "tool_choice": choice.model_dump() if choice is not None and not isinstance(choice, str) else (
            choice or ("auto" if body.tools else "none")),
        "tools": body.tools or [], "top_p": 1.0 if body.top_p is None else body.top_p,
        "truncation": body.truncation or "disabled", "usage": usage, "user": body.user,
        "metadata": body.metadata or {},
    }


def usage(prompt_tokens: int, cached: int, output_tokens: int, reasoning_tokens: int = 0) -> dict:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + output_tokens}
