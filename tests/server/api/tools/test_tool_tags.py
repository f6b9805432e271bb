"""server/api/tools/tags.py and each format's grammar, compiled as the engine compiles them
(server/engine/grammar.py, kind "structural_tag"): random walks through every format's required,
named and auto grammars end in replies whose calls the format's parser reads and whose arguments
validate against the tool's schema; what the grammars refuse; tools beside a response_format; and
a reasoning block first."""

import json
import random

import jsonschema
import numpy as np
import pytest
from transformers import AutoTokenizer

from server.api.reasoning import REASONING_PARSERS
from server.api.tools import TOOL_PARSERS
from server.api.tools.base import CallArgs, CallStart, ToolParser
from server.api.tools.plain import Plain
from server.api.tools.tags import as_format, reasoning_block, tool_grammar
from server.engine.grammar import Grammars
from server.sampling_params import StructuredOutput

TOOLS = [
    {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                         "unit": {"enum": ["C", "F"]}, "days": {"type": "integer", "minimum": 1,
                                                                                "maximum": 7}},
        "required": ["city"], "additionalProperties": False}},
    {"name": "set_alarm", "parameters": {
        "type": "object", "properties": {"on": {"type": "boolean"}, "at": {"anyOf": [{"type": "null"}, {
            "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 2}]}},
        "required": ["on", "at"]}},
    {"name": "ping", "parameters": None},
]
TRIGGERS = {"hermes": "<tool_call>", "llama3_json": '{"name": ', "mistral": "[TOOL_CALLS]",
            "pythonic": "[get_weather("}  # what starts a call in each auto grammar
SCHEMAS = {t["name"]: t["parameters"] or {"type": "object"} for t in TOOLS}


@pytest.fixture(scope="module")
def grammars(tiny_ckpt):
    tok = AutoTokenizer.from_pretrained(tiny_ckpt)
    return Grammars(tok, len(tok), frozenset({tok.eos_token_id})), tok


def walk(grammars, spec: StructuredOutput, seed: int, limit: int = 400) -> str | None:
    """A random reply the grammar allows (uniform over its tokens each step), or None past `limit`."""
    g, tok = grammars
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(g.compile(spec))
    bits = xgr.allocate_token_bitmask(1, g.vocab_size).numpy()
    rnd, ids = random.Random(seed), []
    for _ in range(limit):
        matcher.fill_next_token_bitmask(bits, 0)
        allowed = _allowed(bits, g.vocab_size)
        tid = rnd.choice(allowed)
        if tid == tok.eos_token_id and matcher.accept_token(tid) and matcher.is_terminated():
            return tok.decode(ids)
        assert matcher.accept_token(tid)
        ids.append(tid)
    return None


def _allowed(bits, vocab_size: int) -> list[int]:
    """The token ids a filled mask row allows."""
    return np.flatnonzero(np.unpackbits(bits[0].view(np.uint8), bitorder="little")[:vocab_size]).tolist()


def check(fmt, text: str, at_least: int, at_most: int | None, tools: list[dict] = TOOLS) -> list:
    parser = ToolParser(fmt, [t["name"] for t in tools])
    pieces = parser.feed(text) + parser.end()
    calls = []
    for p in pieces:
        if isinstance(p, CallStart):
            calls.append([p.name, ""])
        elif isinstance(p, CallArgs):
            calls[-1][1] += p.text
    assert at_least <= len(calls) <= (at_most or len(calls)), text
    for name, args in calls:
        jsonschema.validate(json.loads(args), {t["name"]: t["parameters"] or {} for t in tools}[name])
    return calls


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_required_and_named_replies_are_valid_calls(grammars, name):
    fmt, walks = TOOL_PARSERS[name], 0
    for seed in range(12):
        parallel = seed % 2 == 0
        text = walk(grammars, tool_grammar(fmt, TOOLS, "required", parallel), seed)
        if text is not None:
            walks += 1
            check(fmt, text, 1, None if parallel else 1)
        named = walk(grammars, tool_grammar(fmt, TOOLS[1:2], "required", False), 100 + seed)
        if named is not None:
            assert [c[0] for c in check(fmt, named, 1, 1)] == ["set_alarm"]
    assert walks >= 8  # most walks end within the limit


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_auto_replies_hold_only_valid_calls(grammars, name):
    """Free text, in which whatever starts a call is a whole valid one (the walk is pushed into a
    call by starting it with the format's start tag)."""
    fmt = TOOL_PARSERS[name]
    g, tok = grammars
    import xgrammar as xgr

    for seed in range(6):
        spec = tool_grammar(fmt, TOOLS, "auto", True)
        matcher = xgr.GrammarMatcher(g.compile(spec))
        opening = "Sure " + TRIGGERS[name]
        assert matcher.accept_string(opening)
        rest = _continue(matcher, grammars, seed)
        if rest is not None:
            check(fmt, opening + rest, 1, None)


def _continue(matcher, grammars, seed, limit=400):
    g, tok = grammars
    import xgrammar as xgr

    bits = xgr.allocate_token_bitmask(1, g.vocab_size).numpy()
    rnd, ids = random.Random(seed), []
    for _ in range(limit):
        matcher.fill_next_token_bitmask(bits, 0)
        allowed = _allowed(bits, g.vocab_size)
        eos = tok.eos_token_id in allowed
        tid = tok.eos_token_id if eos and rnd.random() < 0.5 else rnd.choice(allowed)
        assert matcher.accept_token(tid)
        if tid == tok.eos_token_id:
            return tok.decode(ids)
        ids.append(tid)
    return None


def test_grammars_refuse_what_breaks_a_schema(grammars):
    import xgrammar as xgr

    g, _ = grammars
    hermes = TOOL_PARSERS["hermes"]
    matcher = xgr.GrammarMatcher(g.compile(tool_grammar(hermes, TOOLS, "required", True)))
    assert not matcher.accept_string('<tool_call>\n{"name": "get_weather", "arguments": {"city": 3')
    matcher = xgr.GrammarMatcher(g.compile(tool_grammar(hermes, TOOLS, "required", True)))
    assert not matcher.accept_string("I will not call")  # required: a call, nothing else
    matcher = xgr.GrammarMatcher(g.compile(tool_grammar(hermes, TOOLS, "required", True)))
    assert not matcher.accept_string('<tool_call>\n{"name": "launch", ')  # not a listed tool


def test_auto_beside_a_response_format_is_a_call_or_the_object(grammars):
    import xgrammar as xgr

    g, _ = grammars
    answer = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
    spec = tool_grammar(TOOL_PARSERS["hermes"], TOOLS, "auto", True, as_format(StructuredOutput("json", json.dumps(
        answer))))
    call = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    for text, ok in [('{"answer": "yes"}', True), (call, True), ("Free text", False), ('{"answer": "maybe"}', False)]:
        m = xgr.GrammarMatcher(g.compile(spec))
        assert (m.accept_string(text) and m.is_completed()) == ok, text
    for seed in range(6):
        text = walk(grammars, spec, seed)
        if text is not None and not text.startswith("<tool_call>"):
            jsonschema.validate(json.loads(text), answer)


def test_reasoning_comes_first(grammars):
    """enabled: the prompt opened the block, the reply closes it before calling; auto: a block may
    open the reply; disabled: none."""
    import xgrammar as xgr

    g, _ = grammars
    think = REASONING_PARSERS["qwen3"]
    call = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    for mode, text, ok in [("enabled", "hmm, weather</think>\n\n" + call, True), ("enabled", call, False),
                           ("auto", "<think>hmm</think>\n\n" + call, True), ("auto", call, True),
                           ("disabled", "<think>hmm</think>" + call, False), ("disabled", call, True)]:
        spec = tool_grammar(TOOL_PARSERS["hermes"], TOOLS, "required", True,
                            reasoning=reasoning_block(mode, think.start, think.end))
        m = xgr.GrammarMatcher(g.compile(spec))
        assert (m.accept_string(text) and m.is_completed()) == ok, (mode, text)


def test_plain_calls_without_a_parser(grammars):
    for seed in range(4):
        text = walk(grammars, tool_grammar(Plain("get_weather"), TOOLS[:1], "required", False), seed)
        if text is not None:
            jsonschema.validate(json.loads(text), SCHEMAS["get_weather"])
        text = walk(grammars, tool_grammar(Plain(None), TOOLS, "required", True), 50 + seed)
        if text is not None:
            for call in json.loads(text):
                jsonschema.validate(call["parameters"], SCHEMAS[call["name"]])


def test_pythonic_with_many_optional_arguments_stays_small(grammars):
    """No argument required and more than MAX_FIRSTS optional: a trailing comma after each, a
    grammar linear in their number (the choice of a first argument would grow as n^2)."""
    import xgrammar as xgr

    from server.api.tools import pythonic

    g, _ = grammars
    many = [{"name": "f", "parameters": {"type": "object", "properties": {f"p{i}": {"type": "integer"}
                                                                          for i in range(40)}}}]
    spec = tool_grammar(pythonic, many, "required", False)
    assert len(spec.spec) < 40 * 400
    for text, ok in [("[f(p1=3, p7=2, )]", True), ("[f()]", True), ("[f(p7=2, p1=3, )]", False)]:
        m = xgr.GrammarMatcher(g.compile(spec))
        assert (m.accept_string(text) and m.is_completed()) == ok, text
    assert check(pythonic, "[f(p1=3, p7=2, )]", 1, 1, many) == [["f", '{"p1": 3, "p7": 2}']]
