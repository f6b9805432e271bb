"""Bounded JSON strings rewritten so that XGrammar fills their token masks from its precompiled cache.

XGrammar 0.2.8 turns a JSON-schema string with `maxLength` n ≤ 128 into a counted repetition,

    name ::= (("\\"" name_characters{lo, n} "\\""))
    name_characters ::= (([^\\"\\\\\\r\\n]))

and rechecks every token that could continue the string on each fill, because a repetition's count
is context its precompiled masks do not see (xgrammar#852, open upstream). Inside such a string a
fill took 0.2-0.9 ms against ~5 us elsewhere (the embedded model's 8k vocabulary, one row, on this
project's CPU): the bound of constrained decoding at batch 64.

The same language as a right-linear chain, one rule per number of characters still allowed, each
ending in the closing quote,

    name ::= (("\\"" name_characters ... (lo times) name_left_{n-lo}))
    name_left_k ::= (("\\"") | (name_characters name_left_{k-1}))
    name_left_0 ::= (("\\""))

has no counter: each rule's mask is decided when the grammar compiles (measured: 0.19 ms of fills
for a whole 84-token document of the benchmark schema, against 3.5 ms). Above 128 XGrammar already
represents the repetition differently and cheaply, and a chain would cost compile time linear in n,
so longer bounds are left alone. Every rule of a chain costs compile time too (each one's masks are
decided then: 50 strings of maxLength 128 took 4 s to compile on the embedded model's 8k
vocabulary, 2,000 of them over a minute, issue 44), so a schema's chains together hold at most
MAX_UNROLLED_RULES rules: the strings past that budget keep XGrammar's repetition (dearer fills,
a compile that stays short).

`unroll_bounded_strings` rewrites the EBNF XGrammar prints for a schema and returns it unchanged
when nothing matches; grammar.py compiles the rewritten text only when it differs.

`json_string_characters` closes a hole in the same strings: their character class, `[^"\\\r\n]`,
lets through the control characters U+0000-U+001F, which JSON forbids unescaped in a string
(`json.loads` refuses them); XGrammar's unbounded strings exclude them, and so do these now.
"""

from __future__ import annotations

import re

MAX_UNROLLED = 128  # XGrammar's own threshold for unrolling a counted repetition
MAX_UNROLLED_RULES = 512  # chain rules a schema's strings may add together (~0.3 s of compile at 8k tokens)

_RULE = re.compile(r"^(\w+) ::= (.*)$", re.M)
_BOUNDED = re.compile(r'^(\w+) ::= \(\("\\"" (\w+)\{(\d+), (\d+)\} "\\""\)\)$', re.M)
_CHAR_CLASS = re.compile(r"\(\(\[(?:[^\]\\]|\\.)*\]\)\)")
_LOOSE_CHARACTERS = r'(([^\"\\\r\n]))'  # a bounded string's characters, as XGrammar 0.2.8 prints them
_JSON_CHARACTERS = r'(([^\0-\x1f\"\\\r\n]))'  # its unbounded strings' (no control character)


def json_string_characters(ebnf: str) -> str:
    """`ebnf` with bounded strings' characters as JSON allows them (no control characters)."""
    return ebnf.replace(" ::= " + _LOOSE_CHARACTERS, " ::= " + _JSON_CHARACTERS)


def unroll_bounded_strings(ebnf: str, max_unrolled: int = MAX_UNROLLED, max_rules: int = MAX_UNROLLED_RULES) -> str:
    """`ebnf` with each bounded string of at most `max_unrolled` characters as a chain of rules, in
    order, while their rules together stay within `max_rules`."""
    rules = dict(_RULE.findall(ebnf))
    budget = [max_rules]

    def chain(m: re.Match) -> str:
        name, char, lo, hi = m.group(1), m.group(2), int(m.group(3)), int(m.group(4))
        left = [f"{name}_left_{k}" for k in range(hi - lo + 1)]
        if (hi > max_unrolled or lo > hi or len(left) > budget[0] or not _CHAR_CLASS.fullmatch(rules.get(char, ""))
                or rules.keys() & left):
            return m.group(0)
        budget[0] -= len(left)
        lines = [f'{name} ::= (("\\""{f" {char}" * lo} {left[-1]}))']
        lines += [f'{left[k]} ::= (("\\"") | ({char} {left[k - 1]}))' for k in range(hi - lo, 0, -1)]
        lines.append(f'{left[0]} ::= (("\\""))')
        return "\n".join(lines)

    return _BOUNDED.sub(chain, ebnf)
