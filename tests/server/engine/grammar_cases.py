"""Specs and helpers the engine's structured-output tests share (test_grammar.py,
test_grammar_process.py; their engine and grammars fixtures: conftest.py)."""

import contextlib
import json

from server.sampling_params import StructuredOutput

REGEX = StructuredOutput("regex", r"[a-z]{3,6}-[0-9]{2}")
CHOICE = StructuredOutput("choice", json.dumps(["red", "green", "blue sky", 'say "hi"']))
SCHEMA = StructuredOutput("json", json.dumps({"type": "object", "properties": {
    "n": {"type": "integer", "minimum": 0, "maximum": 50}, "tags": {"type": "array", "maxItems": 2,
                                                                   "items": {"type": "string", "maxLength": 5}}},
    "required": ["n", "tags"]}))


@contextlib.contextmanager
def sync_scheduling(engine):
    """The engine with asynchronous scheduling off inside the block (each step collected before the
    next is scheduled; the engine reads the mode at every step, and nothing is in flight between
    requests, once the step launched past the last request's end is collected): a module's engine
    serves both modes, where a second engine would start a grammar process of its own (seconds of CPU)."""
    assert not engine.seqs and not engine.admission.held and engine.config.async_scheduling
    while engine.has_unfinished():
        assert engine.step() == []
    engine.config.async_scheduling = False
    try:
        yield engine
        assert engine.inflight is None  # each step was collected at once
    finally:
        engine.config.async_scheduling = True


def prompt(engine, text="Value: "):
    return engine.tokenizer.encode(text)
