"""Bounds on a structured-output spec, checked before any compiler sees it.

XGrammar's cost is not its input's size (issue 44): a JSON schema whose `$ref`s chain 3,600 deep
overflowed the stack of `Grammar.from_json_schema` and killed the process (214 KB of JSON). So
every spec is measured first, in plain Python at the cost of reading it once, and one over a bound
is a `SpecLimitError` (HTTP 400) that names the bound and the flag that raises it
(`StructuredLimits`, server/config.py). What passes still compiles in a sacrificial process under a
deadline (server/engine/grammar_compile.py): these bounds turn the known costly shapes away with a
clear message; the process and its deadline catch what they do not foresee.

- Every kind: the spec's text, at most `max_structured_spec_bytes` (UTF-8).
- A JSON spec (a schema, or any kind whose spec is JSON, as a choice list's and a structural tag's
  are): objects and arrays nested at most `max_structured_depth` deep, each local `$ref` followed
  into what it names (each target measured once; a `$ref` back into one being measured is
  recursion, which XGrammar makes a rule reference, not a deeper frame); every count it asks for
  (`maxLength`, `minLength`, `maxItems`, ...: XGrammar's memory grows with `maxLength`) at most
  `max_structured_length`; every list (`enum`, `anyOf`, `required`, the choices, ...) at most
  `max_structured_items` entries; every object's `properties` at most `max_structured_properties`
  (the compile grows faster than their number); every `pattern` as a regular expression below.
- A regular expression: at most `max_structured_regex_chars` characters (XGrammar's time grows
  with them: `"." * 30000` compiled for ~30 s), and its `{m,n}` counts at most
  `max_structured_length`; an EBNF grammar's `{m,n}` counts too (outside its strings and classes).
"""

from __future__ import annotations

import json
import re
from urllib.parse import unquote

from server.config import StructuredLimits
from server.engine.requests import RequestError
from server.sampling_params import StructuredOutput

_END = object()  # a frame's children are exhausted
# A schema's counts; XGrammar unrolls or tracks each (its memory grew with maxLength: 1.6 GB at 20,000,000).
COUNTS = ("maxLength", "minLength", "maxItems", "minItems", "maxProperties", "minProperties", "maxContains",
          "minContains")
PROPERTY_MAPS = ("properties", "patternProperties", "dependentSchemas")
_REPEAT = re.compile(r"(?<!\\)\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")  # {m}, {m,}, {m,n}
_EBNF_TEXT = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]')  # strings and classes: their braces are text


class SpecLimitError(RequestError):
    """A spec over one of the StructuredLimits (HTTP 400 naming the bound and its flag)."""


def check_spec(spec: StructuredOutput, limits: StructuredLimits) -> None:
    """Raise SpecLimitError if `spec` is over a bound (an invalid spec is the compiler's to report)."""
    size = len(spec.spec.encode("utf-8", "surrogatepass"))
    if size > limits.max_structured_spec_bytes:
        raise SpecLimitError(f"the structured-output spec is {size} bytes; at most {limits.max_structured_spec_bytes} "
                             "are allowed (--max-structured-spec-bytes)")
    if spec.kind == "regex":
        check_regex(spec.spec, limits, "the regular expression")
    elif spec.kind == "grammar":
        _check_repeats(_EBNF_TEXT.sub("", spec.spec), limits, "the EBNF grammar")
    doc = _json_doc(spec)
    if doc is None:
        return
    if nesting(doc, limits.max_structured_depth) > limits.max_structured_depth:
        raise SpecLimitError(f"the JSON schema nests objects and arrays more than {limits.max_structured_depth} levels "
                             "deep, counting what its $refs name; at most that many are allowed "
                             "(--max-structured-depth)")
    _check_counts(doc, limits, "the choice list" if spec.kind == "choice" else "the JSON spec")


def check_regex(text: str, limits: StructuredLimits, what: str) -> None:
    if len(text) > limits.max_structured_regex_chars:
        raise SpecLimitError(f"{what} has {len(text)} characters; at most {limits.max_structured_regex_chars} are "
                             "allowed (--max-structured-regex-chars)")
    _check_repeats(text, limits, what)


def _check_repeats(text: str, limits: StructuredLimits, what: str) -> None:
    for m in _REPEAT.finditer(text):
        n = max(int(g) for g in m.groups() if g)
        if n > limits.max_structured_length:
            raise SpecLimitError(f"{what} repeats something {n} times ({m.group(0)}); at most "
                                 f"{limits.max_structured_length} are allowed (--max-structured-length)")


def _check_counts(doc, limits: StructuredLimits, root: str) -> None:
    """Every count, list, property map and pattern in the document (each object and array once,
    iteratively: its depth is bounded already, but not its breadth)."""
    todo = [(root, doc)]  # (where it is, for the message; an object or a list)
    while todo:
        where, node = todo.pop()
        if isinstance(node, list):
            if len(node) > limits.max_structured_items:
                raise SpecLimitError(f"{where} has {len(node)} entries; at most {limits.max_structured_items} are "
                                     "allowed (--max-structured-items)")
            todo.extend((where, v) for v in node if isinstance(v, (dict, list)))
            continue
        for key in COUNTS:
            n = node.get(key)
            if isinstance(n, (int, float)) and not isinstance(n, bool) and n > limits.max_structured_length:
                raise SpecLimitError(f"the JSON schema's {key} is {n}; at most {limits.max_structured_length} is "
                                     "allowed (--max-structured-length)")
        for key in PROPERTY_MAPS:
            props = node.get(key)
            if isinstance(props, dict) and len(props) > limits.max_structured_properties:
                raise SpecLimitError(f"an object of the JSON schema has {len(props)} {key}; at most "
                                     f"{limits.max_structured_properties} are allowed (--max-structured-properties)")
        patterns = node.get("patternProperties")
        for pattern in [node.get("pattern")] + (list(patterns) if isinstance(patterns, dict) else []):
            if isinstance(pattern, str):
                check_regex(pattern, limits, "a pattern of the JSON schema")
        todo.extend((f"the JSON schema's {k!r}", v) for k, v in node.items() if isinstance(v, (dict, list)))


def _json_doc(spec: StructuredOutput):
    """The spec as a JSON document, where it is one (else None: regular expressions, grammars)."""
    if spec.kind in ("regex", "grammar", "json_object"):
        return None
    text = spec.spec.lstrip()
    if not text.startswith(("{", "[")):
        return None
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # not JSON after all: the compiler says what is wrong
        return None


def nesting(root, limit: int) -> int:
    """How deep objects and arrays nest in `root`, local `$ref`s followed; the count stops once it
    passes `limit` (then it is limit + 1 or a little more). Each object or array is measured once,
    however many paths reach it (a definition many $refs name), and one reached again while it is
    being measured (recursion) adds nothing. Iterative: a chain thousands deep must not overflow
    this process's stack either."""
    done: dict[int, int] = {}  # id of an object or array -> how deep it nests (itself included)
    active: set[int] = set()  # ids of those on the path being measured
    stack = [[id(root), _children(root), 0]]  # [its id, children left, deepest child so far]
    active.add(id(root))
    while stack:
        frame = stack[-1]
        child = next(frame[1], _END)
        if child is _END:
            stack.pop()
            depth = done[frame[0]] = frame[2] + 1
            active.discard(frame[0])
            if not stack:
                return depth
            stack[-1][2] = max(stack[-1][2], depth)
            continue
        if isinstance(child, str):  # a $ref: what it names is a child here
            child = _resolve(root, child)
            if child is None:  # a reference XGrammar resolves (or refuses) itself
                continue
        key = id(child)
        if key in done:
            frame[2] = max(frame[2], done[key])
            if len(stack) + done[key] > limit:
                return len(stack) + done[key]
            continue
        if key in active:  # recursion: a rule reference for XGrammar, not a deeper frame
            continue
        active.add(key)
        stack.append([key, _children(child), 0])
        if len(stack) > limit:
            return len(stack)
    return 0


def _children(node):
    """The objects and arrays directly inside `node`, and its `$ref` (as the string) if it has one."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            yield ref
        for value in node.values():
            if isinstance(value, (dict, list)):
                yield value
    elif isinstance(node, list):
        for value in node:
            if isinstance(value, (dict, list)):
                yield value


def _resolve(root, ref: str):
    """What a local JSON pointer (`#`, `#/$defs/a`) names in `root`; None for any other reference."""
    if not ref.startswith("#") or (len(ref) > 1 and ref[1] != "/"):
        return None
    node = root
    for part in ref[2:].split("/") if len(ref) > 1 else ():
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node if isinstance(node, (dict, list)) else None
