"""XGrammar's structural tags, as the tool-call grammars use them (server/api/tools/): free text
with tagged regions, each region's content constrained (a function's arguments by its JSON schema).

A spec of kind "structural_tag" (server/sampling_params.py) is the JSON of XGrammar's
`{"type": "structural_tag", "format": {...}}`. Before it compiles, every `json_schema` format in it
becomes a `grammar` format holding the compact EBNF that response_format's schemas compile from
(one space after `:` and `,`, no newlines, bounded strings unrolled: server/engine/grammar.py):
XGrammar's own json_schema format allows any whitespace, which a small model emits until
max_tokens. A `json_schema` format may carry `"style": "python"`: the same values written as
Python literals (`True`, `False`, `None`), for the pythonic tool-call format.
"""

from __future__ import annotations

import json
from collections.abc import Callable

_PYTHON = {"true": "True", "false": "False", "null": "None"}


def expand_structural_tag(spec: str, json_ebnf: Callable[[str], str]) -> str:
    """`spec` with its json_schema formats written as grammar formats, by `json_ebnf(schema
    text)`. ValueError if it is not a JSON object."""
    tag = json.loads(spec)
    if not isinstance(tag, dict):
        raise ValueError("a structural tag is a JSON object")
    return json.dumps(_expand(tag, json_ebnf), ensure_ascii=False)


def _expand(node, json_ebnf: Callable[[str], str]):
    if isinstance(node, list):
        return [_expand(x, json_ebnf) for x in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and set(node) <= {"type", "json_schema", "style"}:
        schema = node.get("json_schema")
        schema = {} if schema is True or schema is None else schema
        ebnf = json_ebnf(json.dumps(schema, sort_keys=True, ensure_ascii=False))
        return {"type": "grammar", "grammar": python_literals(ebnf) if node.get("style") == "python" else ebnf}
    return {k: _expand(v, json_ebnf) for k, v in node.items()}


def python_literals(ebnf: str) -> str:
    """An EBNF grammar of JSON values rewritten so that its `true`, `false` and `null` terminals
    are Python's `True`, `False` and `None` (every other JSON value is already a Python literal).
    Only whole string terminals change: the scan skips character classes and reads escapes."""
    out, i, n = [], 0, len(ebnf)
    while i < n:
        c = ebnf[i]
        if c in '"[':
            close = '"' if c == '"' else "]"
            j = i + 1
            while j < n and ebnf[j] != close:
                j += 2 if ebnf[j] == "\\" else 1
            literal = ebnf[i:j + 1]
            if c == '"' and literal[1:-1] in _PYTHON:
                literal = f'"{_PYTHON[literal[1:-1]]}"'
            out.append(literal)
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)
