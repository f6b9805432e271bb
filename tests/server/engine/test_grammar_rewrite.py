"""The bounded-string rewrite (server/engine/grammar_rewrite.py): the same language, the same token
masks at every step, and taken only where it applies."""

from __future__ import annotations

import json
import random

import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from models import load_tokenizer, resolve_model_path  # noqa: E402
from server.engine.grammar import Grammars, _json_schema_rewritten  # noqa: E402
from server.engine.grammar_rewrite import (MAX_UNROLLED, MAX_UNROLLED_RULES, json_string_characters,  # noqa: E402
                                           unroll_bounded_strings)
from server.sampling_params import StructuredOutput  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 5},
    "code": {"type": "string", "minLength": 2, "maxLength": 4},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3},
    "free": {"type": "string"}},
    "required": ["name", "code", "tags", "free"]}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_path(None))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    return xgr.GrammarCompiler(info, cache_enabled=False)


def ebnf(schema: dict) -> str:
    return str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))


def accepts(compiled, text: str) -> bool:
    """The whole of `text`, and nothing more, is a sentence of the grammar."""
    m = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return m.accept_string(text) and m.is_terminated()


def documents(rng: random.Random, n: int) -> list[str]:
    """Documents at and around every bound: lengths lo-1 .. hi+1, quotes, backslashes, newlines."""
    alphabet = ['a', 'Z', '7', ' ', 'é', '"', '\\', '\n', '\t', '}']

    def s(k: int) -> str:
        return "".join(rng.choice(alphabet) if rng.random() < 0.3 else "x" for _ in range(k))

    docs = []
    for _ in range(n):
        tags = ", ".join(f'"{s(rng.randint(0, 4))}"' for _ in range(rng.randint(0, 4)))
        docs.append(f'{{"name": "{s(rng.randint(0, 6))}", "code": "{s(rng.randint(1, 5))}", '
                    f'"tags": [{tags}], "free": "{s(rng.randint(0, 3))}"}}')
    return docs


def test_bounded_strings_become_chains_ending_in_the_quote():
    text = ebnf(SCHEMA)
    rewritten = unroll_bounded_strings(text)
    assert "{0, 5}" in text and "{2, 4}" in text and "{0, 3}" in text
    assert "{0, 5}" not in rewritten and "{2, 4}" not in rewritten and "{0, 3}" not in rewritten
    rules = dict(line.split(" ::= ", 1) for line in rewritten.splitlines() if " ::= " in line)
    # minLength 2: two characters up front, then up to two more
    code = [name for name, body in rules.items() if body.endswith("_left_2))") and body.count("_characters") == 2]
    assert len(code) == 1
    assert rules[f"{code[0]}_left_0"] == '(("\\""))'
    assert "_left_" not in unroll_bounded_strings(ebnf({"type": "string"}))  # unbounded: untouched


def test_long_bounds_and_unknown_shapes_are_left_alone():
    long = ebnf({"type": "string", "maxLength": MAX_UNROLLED + 1})
    assert unroll_bounded_strings(long) == long
    short = ebnf({"type": "string", "maxLength": 3})
    assert unroll_bounded_strings(short, max_unrolled=2) == short
    # a character rule of another shape (not one class) is not rewritten
    odd = 'root ::= (("\\"" ch{0, 3} "\\""))\nch ::= (("a" "b"))\n'
    assert unroll_bounded_strings(odd) == odd
    # a name the chain would take is already a rule: left alone rather than clobbered
    taken = 'root ::= (("\\"" ch{0, 1} "\\""))\nch ::= (([a-z]))\nroot_left_0 ::= (("x"))\n'
    assert unroll_bounded_strings(taken) == taken


def test_chains_stop_at_the_rule_budget():
    """Issue 44: every chain rule costs compile time (2,000 strings of maxLength 128 compiled for over
    a minute); past the budget, strings keep XGrammar's own repetition, in order."""
    many = ebnf({"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 99} for i in range(8)},
                 "required": [f"p{i}" for i in range(8)]})
    text = unroll_bounded_strings(many, max_rules=350)  # three chains of 100 rules fit, the fourth does not
    assert text.count("_left_0 ::=") == 3 and text.count("{0, 99}") == 5
    assert unroll_bounded_strings(many).count("_left_0 ::=") == 5  # the default budget, 512 rules
    assert MAX_UNROLLED_RULES == 512


def test_the_rewritten_grammar_accepts_exactly_the_same_documents(compiler):
    text = ebnf(SCHEMA)
    original, rewritten = compiler.compile_grammar(text), compiler.compile_grammar(unroll_bounded_strings(text))
    docs = documents(random.Random(0), 300)
    verdicts = [accepts(original, d) for d in docs]
    assert 30 < sum(verdicts) < 270  # both kinds are exercised
    assert [accepts(rewritten, d) for d in docs] == verdicts


def test_the_token_masks_are_the_same_at_every_step(compiler, tokenizer):
    text = ebnf(SCHEMA)
    original, rewritten = compiler.compile_grammar(text), compiler.compile_grammar(unroll_bounded_strings(text))
    words = (len(tokenizer) + 31) // 32
    for doc in ['{"name": "Ann", "code": "ab", "tags": ["x", "yz", ""], "free": "any length at all"}',
                '{"name": "abcde", "code": "abcd", "tags": [], "free": ""}']:
        ids = tokenizer.encode(doc, add_special_tokens=False)
        a, b = xgr.GrammarMatcher(original), xgr.GrammarMatcher(rewritten)
        for step, tok in enumerate(ids + [None]):
            ma, mb = torch.zeros(1, words, dtype=torch.int32), torch.zeros(1, words, dtype=torch.int32)
            a.fill_next_token_bitmask(ma)
            b.fill_next_token_bitmask(mb)
            assert torch.equal(ma, mb), f"{doc!r}: masks differ after {step} tokens"
            if tok is not None:
                assert a.accept_token(tok) and b.accept_token(tok)


def test_grammars_compile_json_schemas_through_the_rewrite(tokenizer):
    grammars = Grammars(tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id}))
    compiled = grammars.compile(StructuredOutput("json", json.dumps(SCHEMA)))
    assert "_left_" in str(compiled.grammar)
    plain = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})
    assert _json_schema_rewritten(plain) is None  # nothing bounded: compiled as the schema it is
    assert "_left_" not in str(grammars.compile(StructuredOutput("json", plain)).grammar)


def test_bounded_strings_hold_no_control_characters(compiler):
    """JSON forbids U+0000-U+001F unescaped in a string; XGrammar's bounded strings let them through."""
    for bound in (4, MAX_UNROLLED + 1):  # unrolled, and left to XGrammar's repetition
        schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": bound}}, "required": ["s"]}
        loose = ebnf(schema)
        assert accepts(compiler.compile_grammar(loose), '{"s": "a\x1bb"}')  # the hole, as XGrammar prints it
        tight = compiler.compile_grammar(json_string_characters(unroll_bounded_strings(loose)))
        assert not accepts(tight, '{"s": "a\x1bb"}') and not accepts(tight, '{"s": "a\tb"}')
        assert accepts(tight, '{"s": "ab"}')
        assert _json_schema_rewritten(json.dumps(schema)) is not None  # the server compiles the tight one
