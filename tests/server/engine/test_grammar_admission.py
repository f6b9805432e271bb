"""server/engine/grammar_admission.py against a stand-in grammar process (the real one, end to end:
test_grammar_process.py): a spec the process compiled is admitted at once without a check; any
other is held until its matcher is made or fails, and a request that ended meanwhile is dropped; a
spec no front end checked is checked first, and one that fails its check asks for no matcher."""

import pytest

from server.config import StructuredLimits
from server.engine.grammar_admission import GrammarAdmission
from server.engine.requests import RequestError
from server.engine.sequence import Sequence, Status
from server.sampling_params import SamplingParams, StructuredOutput

SPEC = StructuredOutput("regex", "[a-z]+")
NEW = StructuredOutput("regex", "[0-9]+")


class _Pending:
    def __init__(self, key):
        self.key, self.answer = key, None

    def done(self):
        return self.answer is not None

    def result(self):
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.key


class _Grammars:
    def __init__(self):
        self.ready, self.asked, self.drains = {SPEC}, [], 0

    def __call__(self):  # admit() asks for the live process each time it needs it
        return self

    def add(self, key, spec):
        self.asked.append((key, spec))
        return None if spec in self.ready else _Pending(key)

    def drain(self, timeout):
        self.drains += 1


class _Checker:
    def __init__(self, refuse=()):
        self.refuse, self.checked = refuse, []

    def check(self, spec):
        self.checked.append(spec)
        if spec in self.refuse:
            raise RequestError("over a bound")


def _seq(name, spec):
    return Sequence(name, [1, 2], SamplingParams(max_tokens=4, structured=spec))


def _admission(checker=None):
    adm = GrammarAdmission(setup=None, limits=StructuredLimits())
    adm.compiler = checker
    return adm


def test_the_process_is_asked_for_again_after_a_check():
    """A check can take seconds: the matcher is asked of the process live after it (one that died
    meanwhile was replaced by the engine's `grammars`), not of the one looked at before."""
    before, after = _Grammars(), _Grammars()
    live = iter([before, after])
    adm = _admission(_Checker())
    assert adm.admit(_seq("a", NEW), lambda: next(live), checked=False) is False
    assert before.asked == [] and after.asked == [(1, NEW)]


def test_a_compiled_spec_is_admitted_at_once_and_others_are_held_until_made():
    grammars, checker = _Grammars(), _Checker()
    adm = _admission(checker)
    now = _seq("a", SPEC)
    assert adm.admit(now, grammars, checked=False) is True
    assert now.grammar == 1 and now.compiling is None and not adm.held and checker.checked == []
    later, failed, gone = _seq("b", NEW), _seq("c", NEW), _seq("d", NEW)
    assert [adm.admit(s, grammars, checked=True) for s in (later, failed, gone)] == [False] * 3
    assert adm.held == [later, failed, gone] and checker.checked == []  # checked by a front end
    assert adm.made(grammars, wait=False) == [] and len(adm.held) == 3  # nothing answered yet
    later.compiling.answer = True
    failed.compiling.answer = RequestError("no")
    gone.status = Status.FINISHED  # ended while its matcher was in the making
    out = adm.made(grammars, wait=False)
    assert [(s.request_id, type(e)) for s, e in out] == [("b", type(None)), ("c", RequestError)]
    assert later.grammar == 2 and later.compiling is None and failed.grammar is None
    assert adm.held == [] and grammars.asked == [(1, SPEC), (2, NEW), (3, NEW), (4, NEW)]


def test_an_idle_engine_waits_a_little_for_the_matchers_asked_for():
    grammars, adm = _Grammars(), _admission()
    seq = _seq("a", NEW)
    adm.admit(seq, grammars, checked=True)
    assert adm.made(grammars, wait=True) == [] and grammars.drains > 1  # drained until COMPILE_WAIT_S passed
    assert adm.held == [seq]


def test_an_unchecked_spec_is_checked_first_and_a_refused_one_asks_for_nothing():
    grammars, checker = _Grammars(), _Checker(refuse={NEW})
    adm = _admission(checker)
    with pytest.raises(RequestError, match="over a bound"):
        adm.admit(_seq("a", NEW), grammars, checked=False)
    assert checker.checked == [NEW] and grammars.asked == [] and adm.keys == 0 and not adm.held
    fine = StructuredOutput("regex", "x")
    assert adm.admit(_seq("b", fine), grammars, checked=False) is False and checker.checked == [NEW, fine]
