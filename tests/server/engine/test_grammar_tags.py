"""server/engine/grammar_tags.py: a structural tag's JSON schemas become compact grammars (Python
literals for the pythonic style), and Grammars compiles the result (kind "structural_tag")."""

import json

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string as accepts

from server.engine.grammar import json_schema_ebnf
from server.engine.grammar_tags import expand_structural_tag, python_literals

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "v": {"type": ["null", "string"]}},
          "required": ["ok", "v"]}


def tag(content: dict) -> str:
    return json.dumps({"type": "structural_tag", "format": {"type": "tag", "begin": "<c>", "content": content,
                                                            "end": "</c>"}})


def test_json_schema_content_is_compact_json():
    g = xgr.Grammar.from_structural_tag(expand_structural_tag(tag({"type": "json_schema", "json_schema": SCHEMA}),
                                                              json_schema_ebnf))
    assert accepts(g, '<c>{"ok": true, "v": null}</c>')
    assert not accepts(g, '<c>{"ok":true, "v": null}</c>')  # no whitespace but one space after : and ,
    assert not accepts(g, '<c>{\n  "ok": true, "v": null}</c>')
    assert not accepts(g, '<c>{"ok": "yes", "v": null}</c>')


def test_python_style_writes_python_literals():
    text = expand_structural_tag(tag({"type": "json_schema", "json_schema": SCHEMA, "style": "python"}),
                                 json_schema_ebnf)
    g = xgr.Grammar.from_structural_tag(text)
    assert accepts(g, '<c>{"ok": True, "v": None}</c>') and accepts(g, '<c>{"ok": False, "v": "null"}</c>')
    assert not accepts(g, '<c>{"ok": true, "v": null}</c>')


def test_python_literals_touch_only_whole_terminals():
    ebnf = r'''root ::= "true" | "\"true\"" | [t] "rue" | "null" | "a\"null"'''
    assert python_literals(ebnf) == r'''root ::= "True" | "\"true\"" | [t] "rue" | "None" | "a\"null"'''


def test_not_a_tag_is_an_error():
    with pytest.raises(ValueError):
        expand_structural_tag("[1, 2]", json_schema_ebnf)


def test_grammars_compile_a_structural_tag_and_name_what_is_wrong(tiny_ckpt):
    from transformers import AutoTokenizer

    from server.engine import RequestError
    from server.engine.grammar import Grammars
    from server.sampling_params import StructuredOutput

    tok = AutoTokenizer.from_pretrained(tiny_ckpt)
    grammars = Grammars(tok, len(tok), frozenset({tok.eos_token_id}))
    matcher = grammars.matcher(StructuredOutput("structural_tag", tag({"type": "json_schema", "json_schema": SCHEMA})))
    assert matcher.accept_string('<c>{"ok": true, "v": "x"}</c>')
    with pytest.raises(RequestError, match="invalid tool-call grammar"):
        grammars.compile(StructuredOutput("structural_tag", tag({"type": "json_schema", "json_schema": {
            "type": "objec"}})))
