"""server/api/guards.py's checks that need no server: how deep a JSON body nests, read at C speed
on the event loop (the HTTP side of it: tests/server/api/test_adversarial.py)."""

import json

import pytest

from server.api.guards import MAX_JSON_DEPTH, json_too_deep


def depth(value) -> int:
    """The reference: arrays and objects inside each other, counted on the parsed value."""
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    return 0


def nested(n: int, leaf) -> object:
    value = leaf
    for i in range(n):
        value = [value] if i % 2 else {"k": value}
    return value


# strings full of what must not count: brackets, escaped quotes, runs of backslashes before a quote
LEAVES = ["plain", "[{[{", '\\"[', "\\\\", '\\\\"{', 'x\\\\\\"]]', "\u00e9[\ud7ff", "}}]]"]


@pytest.mark.parametrize("n", [0, 1, MAX_JSON_DEPTH, MAX_JSON_DEPTH + 1, 300])
@pytest.mark.parametrize("leaf", LEAVES)
def test_json_depth_counts_brackets_outside_strings_only(n, leaf):
    value = {"a": [leaf] * 40, "b": nested(n, leaf), "c": {leaf: leaf * 30}}
    want = depth(value)
    for body in (json.dumps(value).encode(), json.dumps(value, ensure_ascii=False).encode()):
        assert json_too_deep(body, 0) == want
        assert json_too_deep(body) == (want if want > MAX_JSON_DEPTH else 0)


def test_json_depth_of_bodies_too_shallow_to_read():
    assert json_too_deep(b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH) == 0  # as many brackets as allowed
    assert json_too_deep(b"[" * 1000 + b"]" * 1000) == 1000
    assert json_too_deep(b'{"p": "' + b"[" * 1000 + b'"}') == 0  # text, not nesting
