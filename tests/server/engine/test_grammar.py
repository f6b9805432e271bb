"""Structured output in the engine (server/engine/grammar.py with the worker's bitmask): compile
errors say what is wrong, outputs match their grammar and end with it, constrained rows leave the
unconstrained rows of their batch alone, and asynchronous scheduling, preemption, aborts and
speculative steps keep every matcher in step with its sequence. The grammar process's side:
test_grammar_process.py; the module's engine: conftest.py."""

import contextlib
import copy
import json
import re

import numpy as np
import pytest

from server.config import EngineConfig
from server.engine import LLMEngine, RequestError
from server.engine.grammar import choice_grammar
from server.sampling_params import SamplingParams, StructuredOutput
from tests.helpers import run_to_end
from tests.server.engine.grammar_cases import CHOICE, REGEX, SCHEMA, prompt, sync_scheduling


@pytest.mark.parametrize("spec,words", [
    (StructuredOutput("json", '{"type": "objec"}'), 'invalid JSON schema: Unsupported type "objec"'),
    (StructuredOutput("regex", "[a-"), "invalid regular expression"),
    (StructuredOutput("grammar", 'root ::= "a" |'), "invalid EBNF grammar"),
    (StructuredOutput("grammar", 'start ::= "a"'), "invalid EBNF grammar"),
])
def test_invalid_specs_name_what_is_wrong(engine, grammars, spec, words):
    with pytest.raises(RequestError) as e:
        grammars.compile(spec)
    assert words in str(e.value) and ".cc:" not in str(e.value)  # no C++ source location
    with pytest.raises(RequestError) as e:  # the engine's grammar process says the same
        engine.add_request("bad", prompt(engine), SamplingParams(structured=spec))
    assert words in str(e.value)
    assert "bad" not in engine.seqs


def test_choice_grammar_quotes_every_string():
    assert choice_grammar(["a", 'b"c', "é\n"]) == 'root ::= "a" | "b\\"c" | "é\\n"'


def test_outputs_match_and_end_with_their_grammar(engine):
    specs = [REGEX, CHOICE, SCHEMA, StructuredOutput("json_object")]
    outs = engine.generate([prompt(engine)] * 4, [SamplingParams(max_tokens=80, temperature=0, structured=s)
                                                  for s in specs])
    assert re.fullmatch(r"[a-z]{3,6}-[0-9]{2}", outs[0].text)
    assert outs[1].text in ("red", "green", "blue sky", 'say "hi"')
    doc = json.loads(outs[2].text)
    assert 0 <= doc["n"] <= 50 and len(doc["tags"]) <= 2
    assert isinstance(json.loads(outs[3].text), dict)
    # the grammar ended them: the end token the grammar allowed last, finish_reason "stop"
    assert all(o.finish_reason == "stop" and o.token_ids[-1] in engine.eos_token_ids for o in outs)
    assert engine.block_manager.check_all_free()


def test_constrained_rows_leave_their_neighbours_alone(engine):
    plain = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    alone = engine.generate([prompt(engine, "def f(x):")], plain)[0].token_ids
    mixed = engine.generate([prompt(engine, "def f(x):"), prompt(engine)] * 2,
                            [plain, SamplingParams(max_tokens=40, temperature=0, structured=SCHEMA)] * 2)
    assert mixed[0].token_ids == alone and mixed[2].token_ids == alone


def test_sampled_rows_stay_inside_the_grammar(engine):
    outs = engine.generate([prompt(engine)] * 6, [SamplingParams(max_tokens=30, temperature=1.5, seed=s, structured=REGEX)
                                                  for s in range(6)])
    assert all(re.fullmatch(r"[a-z]{3,6}-[0-9]{2}", o.text) for o in outs), [o.text for o in outs]
    assert len({o.text for o in outs}) > 1  # sampled, not one fixed string


def test_async_and_sync_scheduling_agree(engine):
    texts = []
    for mode in (contextlib.nullcontext(), sync_scheduling(engine)):
        with mode:
            outs = engine.generate([prompt(engine)] * 3, [SamplingParams(max_tokens=60, temperature=0, structured=s)
                                                          for s in (REGEX, CHOICE, SCHEMA)])
        texts.append([o.text for o in outs])
    assert texts[0] == texts[1]


def test_preemption_keeps_matchers_in_step():
    # A cache too small for all of them at once: some are preempted and recomputed mid-grammar.
    eng = LLMEngine(EngineConfig(device="cpu", num_blocks=10, block_size=8, max_num_batched_tokens=64))
    long = prompt(eng, "Return the record of the user as a JSON object:\n")
    outs = eng.generate([long] * 4, [SamplingParams(max_tokens=40, temperature=0, structured=SCHEMA)] * 4)
    assert eng.scheduler.num_preemptions > 0
    for o in outs:
        json.loads(o.text)
    assert eng.block_manager.check_all_free()


def test_min_tokens_yields_to_a_complete_grammar(engine):
    out = engine.generate([prompt(engine)], SamplingParams(max_tokens=20, temperature=0, min_tokens=10,
                                                           structured=CHOICE))[0]
    assert out.text in ("red", "green", "blue sky", 'say "hi"') and out.finish_reason == "stop"


def test_aborting_a_constrained_request_mid_run(engine):
    engine.add_request("g1", prompt(engine), SamplingParams(max_tokens=60, temperature=0, structured=SCHEMA))
    engine.add_request("g2", prompt(engine), SamplingParams(max_tokens=60, temperature=0, structured=REGEX))
    for _ in range(3):
        engine.step()
    engine.abort_request("g1")
    while engine.has_unfinished():
        engine.step()
    assert engine.block_manager.check_all_free() and not engine.seqs


@pytest.mark.parametrize("spec", [StructuredOutput("json", '{"anyOf": []}'), StructuredOutput("grammar", "root ::= root")])
def test_a_grammar_that_allows_nothing_ends_instead_of_running_on(engine, spec):
    out = engine.generate([prompt(engine)], SamplingParams(max_tokens=20, temperature=0, structured=spec))[0]
    assert out.finish_reason == "stop" and len(out.token_ids) == 1 and out.token_ids[0] in engine.eos_token_ids


def test_the_batch_accept_advances_every_matcher_as_the_public_call_does(engine, grammars):
    """Grammars.accept calls XGrammar's binding without the public wrapper (see _raw_batch_accept):
    with the installed xgrammar it is the binding, and it moves each matcher exactly as accepting
    the tokens one by one does."""
    from server.engine.grammar import _raw_batch_accept

    g = grammars
    assert _raw_batch_accept(g.xgr) is not g.xgr.BatchGrammarMatcher.batch_accept_token  # the fast path is live
    docs = [engine.tokenizer.encode(d, add_special_tokens=False)
            for d in ('{"n": 7, "tags": ["ab", "c"]}', '{"n": 42, "tags": []}', '{"n": 0, "tags": ["xyz"]}')]
    batch, single = [g.matcher(SCHEMA) for _ in docs], [g.matcher(SCHEMA) for _ in docs]
    for k in range(max(map(len, docs))):
        rows = [r for r, d in enumerate(docs) if k < len(d)]  # the shorter documents drop out
        g.accept([batch[r] for r in rows], [docs[r][k] for r in rows])
        for r in rows:
            assert single[r].accept_token(docs[r][k])
    for a, b in zip(batch, single):
        assert a.is_terminated() == b.is_terminated()
        assert a._debug_print_internal_state() == b._debug_print_internal_state()


@pytest.mark.parametrize("cut", [0, 5])
def test_a_dead_end_row_is_found_past_the_first_words_too(grammars, cut):
    """_end_dead_ends reads the first words of each row first: a live row that allows only high ids
    is left alone, a live row that allows nothing (or only bits past the vocabulary) gets the end
    token, a row that is not live is never touched. cut: a vocabulary that ends inside a word."""
    g = copy.copy(grammars)
    g.vocab_size -= cut
    words = -(-g.vocab_size // 32)
    bits = np.zeros((4, words), dtype=np.int32)
    high = g.vocab_size - 3  # past the words checked first
    bits[0, high // 32] = np.array([1 << (high % 32)], dtype=np.uint32).view(np.int32)[0]
    rest = g.vocab_size % 32
    if rest:
        past = ~((1 << rest) - 1) & 0xFFFFFFFF  # every bit of the last word past the vocabulary
        bits[2, -1] = np.array([past], dtype=np.uint32).view(np.int32)[0]
    live = np.array([1, 1, 1, 0], dtype=np.int32)
    before = bits.copy()
    g._end_dead_ends(bits, live, 4)
    assert np.array_equal(bits[0], before[0]) and np.array_equal(bits[3], before[3])
    end_row = np.zeros(words, dtype=np.int32)
    end_row[g.end // 32] = np.array([1 << (g.end % 32)], dtype=np.uint32).view(np.int32)[0]
    assert np.array_equal(bits[1], end_row) and np.array_equal(bits[2], end_row)


def test_a_verifications_rows_are_filled_after_the_proposals_before_them(engine, grammars):
    """Speculative decoding (server/engine/spec/): `valid_prefix` counts the proposals a matcher
    accepts in a row; `fill_bitmask` fills row i of a verification with what the matcher allows after
    proposals 1..i (as a matcher advanced token by token allows), leaves the rows past a rejected
    proposal not live, and gives the proposals back; `accept(runs=True)` advances a matcher over its
    accepted run, one token per row."""
    g = grammars
    doc = engine.tokenizer.encode('{"n": 7, "tags": ["ab", "c"]}', add_special_tokens=False)
    m, ref = g.matcher(SCHEMA), g.matcher(SCHEMA)
    for t in doc[:2]:
        assert m.accept_token(t) and ref.accept_token(t)
    state = m._debug_print_internal_state()
    words = -(-g.vocab_size // 32)
    want = np.zeros((4, words), dtype=np.int32)
    for i in range(4):  # what the matcher allows after doc[2 : 2 + i]
        ref.fill_next_token_bitmask(want, i)
        ref.accept_token(doc[2 + i])
    bad = int(np.flatnonzero(np.unpackbits(want[2].view(np.uint8), bitorder="little") == 0)[0])  # not allowed there
    proposals = doc[2:4] + [bad, doc[5]]
    assert g.valid_prefix(m, proposals) == 2 and g.valid_prefix(m, doc[2:6]) == 4
    bits, live = np.zeros((6, words), dtype=np.int32), np.zeros(6, dtype=np.int32)
    g.fill_bitmask([None, m, m, m, m, m], bits, live, drafts=[(1, proposals)])
    assert live.tolist() == [0, 1, 1, 1, 0, 0]
    assert np.array_equal(bits[1:4], want[:3])
    assert m._debug_print_internal_state() == state  # the proposals given back
    g.accept([m, m, m], doc[2:5], runs=True)  # an accepted run of three
    again = g.matcher(SCHEMA)
    for t in doc[:5]:
        again.accept_token(t)
    assert m._debug_print_internal_state() == again._debug_print_internal_state()


def test_speculative_steps_keep_constrained_outputs(engine):
    """Speculative decoding (n-gram proposals, looked up in prompts that show the format): greedy
    and seeded sampled constrained requests give the tokens they give without it; proposals were cut
    where the grammar rejected them (before the verification) and runs of them accepted; the
    outputs parse."""
    from server.config import SpeculativeConfig
    from server.engine.spec import Speculator

    spec = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, '
                                   '"prompt_lookup_max": 3}')
    prompts = [prompt(engine, 'Value: {"n": 12, "tags": ["ab", "cd"]}\\nValue: {"n": 3, "tags": ["x"]}\\nValue: '),
               prompt(engine, "Values: abc-12, abcd-13, abde-14, abdf-")] * 2
    params = [SamplingParams(max_tokens=60, temperature=0, structured=SCHEMA),
              SamplingParams(max_tokens=30, temperature=0, structured=REGEX),
              SamplingParams(max_tokens=60, temperature=0.8, seed=3, structured=SCHEMA),
              SamplingParams(max_tokens=30, temperature=0.8, seed=4, structured=REGEX)]
    ref = engine.generate(prompts, params)
    config = copy.copy(engine.config)
    config.speculative_config = spec
    engine.speculator = speculator = Speculator(config, engine.block_manager, engine.max_model_len,
                                                counts=engine.runner.counts)
    checked = []  # (proposals, how many of them the grammar accepted)
    check = engine._grammars.valid_prefixes
    engine._grammars.valid_prefixes = lambda drafts: checked.extend(zip(drafts, n := check(drafts))) or n
    try:
        got = engine.generate(prompts, params)
    finally:
        engine.speculator = None
        del engine._grammars.valid_prefixes
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert any(n < len(d) for (_, d), n in checked) and any(n > 0 for _, n in checked)
    assert speculator.counters.accepted_tokens > 0
    for o, p in zip(got, params):
        assert o.finish_reason == "stop"
        if p.structured is SCHEMA:
            assert set(json.loads(o.text)) == {"n", "tags"}
        else:
            assert re.fullmatch(REGEX.spec, o.text)


def test_compiled_grammars_are_kept_within_their_memory_bound(engine, grammars):
    """Issue 44, case 6: compiler caches were unbounded in every process that compiles (~20 distinct
    specs took one from 365 to 1,041 MB). XGrammar's cache takes a byte bound; the grammar process
    keeps exactly the specs the engine lists as ready, which stay within theirs. (Last in the module:
    it leaves the engine's process with one compiled spec.)"""
    from server.engine.grammar import Grammars

    specs = [StructuredOutput("regex", "[a-z]{2,40}-" + "." * 40 + str(i)) for i in range(6)]
    bounded = Grammars(engine.tokenizer, engine.spec.vocab_size, engine.eos_token_ids, cache_bytes=400 << 10)
    sizes = [bounded.compile(s).memory_size_bytes for s in specs]
    assert sum(sizes) > 3 * (400 << 10) and bounded.compiler.get_cache_size_bytes() <= (400 << 10) + max(sizes)

    proc = engine.grammars
    kept, proc.cache_bytes = proc.cache_bytes, max(sizes) + 1  # room for one of them at a time
    try:
        outs = engine.generate([prompt(engine)] * 6, [SamplingParams(max_tokens=8, temperature=0, structured=s)
                                                      for s in specs])
        assert all(o.finish_reason in ("stop", "length") for o in outs)
        assert len(proc.ready) == 1 and proc.ready_bytes <= proc.cache_bytes
        proc.flush()  # the forgets ride on the next message
        assert proc.held() == 0 and proc.cached == 1  # the process let go of what the engine no longer lists
        engine.add_request("again", prompt(engine), SamplingParams(max_tokens=4, temperature=0, structured=specs[-1]))
        assert engine.seqs["again"].compiling is None  # still listed: admitted at once
        run_to_end(engine)
    finally:
        proc.cache_bytes = kept
    assert engine.block_manager.check_all_free()
