"""Specs compiled where a crash or a runaway cannot take the server down (server/engine/grammar_compile.py):
a spec that kills the compile process, or runs past the deadline, is a RequestError for its own
caller only; the process is replaced and the next spec compiles; verdicts are remembered; the
pool's queue is bounded."""

import json
import time

import pytest

from models import load_tokenizer
from server.config import StructuredLimits
from server.engine import RequestError
from server.engine.grammar_compile import CompilerBusy, CompileSetup, CompileTimeout, SpecCompiler
from server.sampling_params import StructuredOutput
from tests.server.engine.test_grammar_bounds import ref_chain

OBJECT = StructuredOutput("json", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))


@pytest.fixture(scope="module")
def compiler(tiny_ckpt):
    tok = load_tokenizer(str(tiny_ckpt))
    # bounds raised past the crasher's size and depth and the runaway's length, so that the compiler
    # sees them; a short deadline
    limits = StructuredLimits(max_structured_spec_bytes=1 << 22, max_structured_depth=10**6,
                              max_structured_regex_chars=10**6, structured_compile_timeout=1.0)
    c = SpecCompiler(CompileSetup(str(tiny_ckpt), len(tok), (tok.eos_token_id,)), limits)
    yield c
    c.close()


def worker_pid(c: SpecCompiler) -> int:
    [worker] = c._started
    return worker.proc.pid


def test_a_crash_or_a_runaway_fails_only_its_spec(compiler):
    compiler.check(OBJECT)
    first = worker_pid(compiler)
    with pytest.raises(RequestError) as e:  # the binding's own error, from the process
        compiler.check(StructuredOutput("regex", "[a-"))
    assert "invalid regular expression" in str(e.value) and worker_pid(compiler) == first

    # Issue 44, case 1: a $ref chain 4,000 deep overflowed XGrammar's stack and killed the API process.
    crasher = StructuredOutput("json", json.dumps(ref_chain(10_000)))
    with pytest.raises(RequestError) as e:
        compiler.check(crasher)
    assert "crashed the grammar compiler" in str(e.value) and "SIGSEGV" in str(e.value), str(e.value)
    assert worker_pid(compiler) != first  # replaced at once
    compiler.check(StructuredOutput("regex", "[a-z]+"))  # and the next spec compiles

    # Issue 44, case 3: "." * 30000 compiled for ~30 s; past the deadline the process is killed.
    second = worker_pid(compiler)
    t0 = time.monotonic()
    with pytest.raises(CompileTimeout) as e:
        compiler.check(StructuredOutput("regex", "." * 30_000))
    assert time.monotonic() - t0 < 1.0 + 30  # the deadline, plus at most the new process's start
    assert "did not compile within 1 s" in str(e.value) and "--structured-compile-timeout" in str(e.value)
    assert worker_pid(compiler) != second
    compiler.check(StructuredOutput("choice", json.dumps(["yes", "no"])))

    # Verdicts are remembered: a spec seen before is answered without a round trip, good or bad.
    assert compiler.cached(OBJECT) is True
    with pytest.raises(RequestError, match="crashed"):
        compiler.cached(crasher)
    assert compiler.cached(StructuredOutput("regex", "[0-9]+")) is False


def test_the_queue_of_compiles_is_bounded(compiler):
    held = []
    for _ in range(compiler.queue_bound):
        held.append(compiler.slot())
        held[-1].__enter__()
    try:
        with pytest.raises(CompilerBusy):
            with compiler.slot():
                pass
    finally:
        for slot in held:
            slot.__exit__(None, None, None)
    assert compiler.pending == 0
