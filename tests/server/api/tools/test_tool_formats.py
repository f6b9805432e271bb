"""server/api/tools/: each format's parser (through the driver, base.py) on recorded model outputs:
the content and calls read from the whole text, and the same from every split of it into chunks,
single characters, random splits, and splits inside the start tag and inside a JSON string; text
that only looks like a call stays content."""

import json
import random

import pytest

from server.api.tools import TOOL_PARSERS
from server.api.tools.base import CallArgs, CallStart, Text, ToolParser
from server.api.tools.plain import Plain

WEATHER = '{"city": "Paris, \\"FR\\"", "days": [1, {"n": "}]"}], "ok": true}'

# (format, tool names, model output, expected content, expected [(name, arguments)])
RECORDED = [
    ("hermes", ["get_weather"], 'Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": ' + WEATHER
     + '}\n</tool_call>', "Let me check.", [("get_weather", WEATHER)]),
    ("hermes", ["get_weather", "get_time"], '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
     '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', "",
     [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")]),
    ("hermes", ["f"], "<tool_call>\n{\"name\": \"f\"}\n</tool_call>", "", [("f", "{}")]),  # no arguments: {}
    ("hermes", ["f"], 'Two <tool_calls> and a <tool_call> that is not JSON', "Two <tool_calls> and a <tool_call> that "
     "is not JSON", []),
    ("hermes", ["f"], "Plain answer, trailing space kept \n", "Plain answer, trailing space kept \n", []),
    ("llama3_json", ["get_weather"], '{"name": "get_weather", "parameters": ' + WEATHER + '}',
     "", [("get_weather", WEATHER)]),
    ("llama3_json", ["a", "b"], '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": '
     '{"y": "z"}}', "", [("a", '{"x": 1}'), ("b", '{"y": "z"}')]),
    ("llama3_json", ["a"], 'The record is {"name": "Ada", "born": 1815}.', 'The record is {"name": "Ada", "born": '
     '1815}.', []),  # an object without parameters is an answer
    ("mistral", ["a", "b"], 'Sure. [TOOL_CALLS] [{"name": "a", "arguments": {"x": [1, 2]}}, {"name": "b", '
     '"arguments": "{\\"y\\": 2}"}]', "Sure.", [("a", '{"x": [1, 2]}'), ("b", '{"y": 2}')]),
    ("pythonic", ["get_weather", "get_time"], '[get_weather(city="Paris, (FR)", days=[1, 2], ok=True), '
     "get_time(zone='C]ET', extra={'a': None})]", "",
     [("get_weather", '{"city": "Paris, (FR)", "days": [1, 2], "ok": true}'),
      ("get_time", '{"zone": "C]ET", "extra": {"a": null}}')]),
    ("pythonic", ["get_weather"], "A list [1, 2] is no call, nor is [other(3)].",
     "A list [1, 2] is no call, nor is [other(3)].", []),
]


def read(fmt, names, chunks) -> tuple[str, list]:
    parser, pieces = ToolParser(fmt, names), []
    for chunk in chunks:
        pieces += parser.feed(chunk)
    pieces += parser.end()
    content, calls = "", []
    for p in pieces:
        if isinstance(p, Text):
            content += p.text
        elif isinstance(p, CallStart):
            calls.append([p.name, ""])
        else:
            assert isinstance(p, CallArgs) and calls, "arguments before their call"
            calls[-1][1] += p.text
    return content, [tuple(c) for c in calls]


def splits(text: str, seed: int) -> list[list[str]]:
    rnd = random.Random(seed)
    out = [[text], list(text)]
    for _ in range(20):
        cuts = sorted(rnd.sample(range(1, len(text)), min(len(text) - 1, rnd.randint(1, 8))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return out


@pytest.mark.parametrize("name,names,text,content,calls", RECORDED)
def test_recorded_outputs_read_alike_in_any_chunks(name, names, text, content, calls):
    fmt = TOOL_PARSERS[name]
    for chunks in splits(text, seed=len(text)):
        assert read(fmt, names, chunks) == (content, calls), chunks


@pytest.mark.parametrize("name,tag", [("hermes", "<tool_call>"), ("mistral", "[TOOL_CALLS]"),
                                      ("llama3_json", '{"name"'), ("pythonic", "[get_weather(")])
def test_splits_inside_the_start_tag_and_inside_a_json_string(name, tag):
    """Every cut point of the start tag and of a string holding a quote, an escape and a brace."""
    row = next(r for r in RECORDED if r[0] == name and r[4] and tag.lstrip("[").split("(")[0] in r[2])
    _, names, text, content, calls = row
    at = text.index(tag)
    string = text.index('"Paris') if '"Paris' in text else text.index('"', at + len(tag))
    for cut in [*range(at + 1, at + len(tag)), *range(string + 1, string + 12)]:
        assert read(TOOL_PARSERS[name], names, [text[:cut], text[cut:]]) == (content, calls), cut


def test_a_call_cut_off_keeps_what_came():
    """max_tokens inside the arguments: the call with its arguments so far; inside the start tag or
    before the name is known: the text, as content."""
    fmt = TOOL_PARSERS["hermes"]
    assert read(fmt, ["f"], ['<tool_call>\n{"name": "f", "arguments": {"a": "b']) == ("", [("f", '{"a": "b')])
    assert read(fmt, ["f"], ['Hi <tool_call>\n{"na']) == ('Hi <tool_call>\n{"na', [])
    assert read(fmt, ["f"], ["Hi <tool_"]) == ("Hi <tool_", [])


def test_content_between_and_after_calls():
    """Whitespace around calls is no content; words after a call are."""
    text = ('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n\nDone, and <tool_call>\n'
            '{"name": "g", "arguments": {"x": 1}}\n</tool_call>\n')
    for chunks in splits(text, 3):
        assert read(TOOL_PARSERS["hermes"], ["f", "g"], chunks) == ("Done, and", [("f", "{}"), ("g", '{"x": 1}')])


def test_arguments_stream_before_the_call_ends():
    parser = ToolParser(TOOL_PARSERS["hermes"], ["f"])
    pieces = parser.feed('<tool_call>\n{"name": "f", "arguments": {"city": "Pa')
    assert pieces == [CallStart("f"), CallArgs('{"city": "Pa')]
    assert parser.feed('ris"}}\n</tool') == [CallArgs('ris"}')]
    assert parser.feed("_call>") == [] and parser.end() == []


@pytest.mark.parametrize("named,text,calls", [
    ("get_weather", '{"city": "Oslo"}', [("get_weather", '{"city": "Oslo"}')]),
    (None, '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]',
     [("a", '{"x": 1}'), ("b", "{}")]),
])
def test_plain_json_without_a_parser(named, text, calls):
    for chunks in splits(text, 5):
        assert read(Plain(named), ["get_weather", "a", "b"], chunks) == ("", calls)


def test_recorded_arguments_are_json():
    for _, _, _, _, calls in RECORDED:
        for _, args in calls:
            json.loads(args)
