"""Bounds on structured-output specs, checked before any compiler sees them
(server/engine/grammar_bounds.py): each over-bound spec is a SpecLimitError naming its flag."""

import json

import pytest

from server.config import StructuredLimits
from server.engine.grammar_bounds import SpecLimitError, check_spec, nesting
from server.sampling_params import StructuredOutput


def ref_chain(levels: int) -> dict:
    """Issue 44's crasher: each definition's property refers to the next (3 levels of nesting each)."""
    defs = {f"d{i}": {"properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(levels)}
    return {"$defs": {**defs, f"d{levels}": {"type": "string"}}, "$ref": "#/$defs/d0"}


def test_nesting_follows_refs_and_stops_at_recursion():
    assert nesting({"type": "string"}, 100) == 1
    assert nesting({"properties": {"a": {"items": [{"type": "integer"}]}}}, 100) == 5  # object, props, a, list, item
    # each $ref counts what it names, wherever it is written: the deepest path is the root, $defs,
    # then d0's three levels and the nine definitions after it, d10 last
    assert nesting(ref_chain(10), 1000) == 2 + 3 * 10 + 1
    # recursion is a rule reference for XGrammar, not a deeper frame: it counts once
    tree = {"$defs": {"node": {"properties": {"kids": {"items": {"$ref": "#/$defs/node"}}}}}, "$ref": "#/$defs/node"}
    assert nesting(tree, 1000) == 6  # the root, $defs, node, properties, kids, items
    # a definition named many times is measured once (a fan-out of references stays linear)
    wide = {"$defs": {"x": {"properties": {"y": {"type": "string"}}}},
            "properties": {f"p{i}": {"$ref": "#/$defs/x"} for i in range(1000)}}
    assert nesting(wide, 1000) == 6  # the root, properties, p0, then x, its properties and y
    # references it cannot resolve are XGrammar's to refuse; escaped pointers resolve
    def deep_ref(ref):  # the root, properties, p, properties, q, and what q's $ref names
        return {"properties": {"p": {"properties": {"q": {"$ref": ref}}}}, "$defs": {"a/b": {"items": {}}}}
    assert nesting(deep_ref("#/$defs/a~1b"), 10) == 7
    assert nesting(deep_ref("https://example.com/s.json"), 10) == nesting(deep_ref("#/$defs/nothing"), 10) == 5


def test_a_ref_chain_thousands_deep_is_measured_without_recursion():
    assert nesting(ref_chain(20_000), 128) > 128  # stops early, and never overflows Python's stack
    assert nesting(ref_chain(20_000), 10**9) == 2 + 3 * 20_000 + 1


@pytest.mark.parametrize("spec,words", [
    (StructuredOutput("json", json.dumps(ref_chain(1000))), ["more than 128 levels", "--max-structured-depth"]),
    (StructuredOutput("regex", "a" * 70_000), ["70000 bytes", "65536", "--max-structured-spec-bytes"]),
    (StructuredOutput("grammar", 'root ::= "' + "é" * 40_000 + '"'), ["80011 bytes", "--max-structured-spec-bytes"]),
    # issue 44, case 5: 41 bytes that took XGrammar from 1.35 to 2.98 GB (and 80 GB at 1e9)
    (StructuredOutput("json", '{"type": "string", "maxLength": 20000000}'),
     ["maxLength is 20000000", "16384", "--max-structured-length"]),
    (StructuredOutput("json", '{"type": "object", "minProperties": 1e9}'), ["minProperties", "--max-structured-length"]),
    (StructuredOutput("regex", "[a-z]{2,100000}"), ["100000 times", "{2,100000}", "--max-structured-length"]),
    (StructuredOutput("grammar", 'root ::= "a" [0-9]{1,20000}'), ["EBNF grammar", "20000 times", "--max-structured-length"]),
    (StructuredOutput("json", json.dumps({"type": "string", "pattern": "^x{99999}$"})), ["a pattern", "99999"]),
    # case 3: "." * 30000 compiled for ~30 s
    (StructuredOutput("regex", "." * 30_000), ["30000 characters", "4096", "--max-structured-regex-chars"]),
    # case 3's offline measurements: an enum of 60k strings 33 s, 20k properties and 2,000 bounded strings > 60 s
    (StructuredOutput("json", json.dumps({"enum": list(range(5000))})), ["'enum' has 5000 entries", "--max-structured-items"]),
    (StructuredOutput("choice", json.dumps(["x"] * 5000)), ["the choice list has 5000 entries", "--max-structured-items"]),
    (StructuredOutput("json", json.dumps({"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 128}
                                                                       for i in range(1000)}})),
     ["1000 properties", "256", "--max-structured-properties"]),
])
def test_specs_over_a_bound_name_it_and_its_flag(spec, words):
    with pytest.raises(SpecLimitError) as e:
        check_spec(spec, StructuredLimits())
    assert all(w in str(e.value) for w in words), str(e.value)


def test_specs_within_the_bounds_pass_and_invalid_ones_are_left_to_the_compiler():
    limits = StructuredLimits()
    for spec in (StructuredOutput("json", json.dumps(ref_chain(40))), StructuredOutput("json_object"),
                 StructuredOutput("regex", "[a-"), StructuredOutput("json", "{not json"),
                 StructuredOutput("choice", json.dumps(["a", "b"])), StructuredOutput("grammar", "root ::= "),
                 StructuredOutput("grammar", 'root ::= "{100000}" [{]'),  # braces in strings and classes are text
                 StructuredOutput("regex", r"\{100000\}"),  # and escaped ones in a regular expression
                 StructuredOutput("json", json.dumps({"type": "string", "maxLength": 16384, "enum": list(range(4096))}))):
        check_spec(spec, limits)
    with pytest.raises(SpecLimitError):  # a kind this module does not know is still measured as JSON
        check_spec(StructuredOutput("structural_tag", json.dumps(ref_chain(200))), limits)
