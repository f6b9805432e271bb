"""Tool calling on the chat and Responses routes: the formats models write calls in, one module each
(`--tool-call-parser`, vLLM's names), read as they stream (base.py: the contract and the driver),
and the grammars that make every call parse (tags.py; server/engine/grammar_tags.py compiles them).
What a request asks (tools, tool_choice, parallel_tool_calls) is read in request.py."""

from __future__ import annotations

from server.api.tools import hermes, llama3_json, mistral, pythonic

TOOL_PARSERS = {m.name: m for m in (hermes, llama3_json, mistral, pythonic)}  # --tool-call-parser's choices
