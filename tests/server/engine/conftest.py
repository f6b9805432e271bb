"""Fixtures of the engine's structured-output tests (test_grammar.py, test_grammar_process.py)."""

import pytest

from server.config import EngineConfig
from server.engine import LLMEngine
from server.engine.grammar import Grammars


@pytest.fixture(scope="module")
def engine():
    """The embedded model (real text), shared by a module's tests (one engine a module): each leaves it with nothing
    running and every block free (they assert it), with its asynchronous scheduling on and a
    grammar process that serves (those that kill one see another started). An engine of a test's
    own is one more grammar process to start, seconds of CPU."""
    eng = LLMEngine(EngineConfig(device="cpu", num_blocks=256))
    yield eng
    eng.close()  # its grammar process too


@pytest.fixture(scope="module")
def grammars(engine):
    """The engine's grammars as the API process compiles them (the engine's own are in its process)."""
    return Grammars(engine.tokenizer, engine.spec.vocab_size, engine.eos_token_ids)
