"""The n-gram proposer (server/engine/spec/ngram.py) against vLLM's rule, and the acceptance rule."""

import random

from server.engine.spec import accepted_prefix
from server.engine.spec.ngram import ngram_propose


def reference(tokens, min_n, max_n, k):
    """vLLM's rule spelled out: the longest n-gram suffix that recurs, its earliest occurrence."""
    total = len(tokens)
    if total < min_n:
        return []
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = tokens[total - n:]
        for i in range(0, total - n):  # occurrences other than the suffix itself
            if tokens[i: i + n] == suffix:
                return tokens[i + n: i + n + k]
    return []


def test_vllm_docstring_example():
    # [1,2,3,4,2,3], min 2, max 3, k 4: [4,2,3] does not recur, [2,3] does: the three tokens after it
    assert ngram_propose([1, 2, 3, 4, 2, 3], 2, 3, 4) == [4, 2, 3]


def test_edges():
    assert ngram_propose([5], 1, 3, 4) == []  # nothing earlier
    assert ngram_propose([1, 2], 3, 3, 4) == []  # shorter than min_n
    assert ngram_propose([7, 7, 7, 7], 1, 2, 3) == [7, 7]  # overlapping occurrence, the earliest
    assert ngram_propose([1, 2, 9, 1, 2, 8, 1, 2], 1, 2, 2) == [9, 1]  # earliest of equal length
    assert ngram_propose([1, 2, 3, 1, 2, 3], 1, 2, 0) == []
    assert ngram_propose([4, 1, 2, 5, 3, 1, 2], 1, 5, 2) == [5, 3]  # the longest match wins


def test_random_sequences_against_the_rule():
    g = random.Random(0)
    for _ in range(500):
        toks = [g.randrange(4) for _ in range(g.randint(1, 40))]
        lo = g.randint(1, 3)
        hi = g.randint(lo, 5)
        k = g.randint(1, 5)
        assert ngram_propose(toks, lo, hi, k) == reference(toks, lo, hi, k), (toks, lo, hi, k)


def test_accepted_prefix():
    assert accepted_prefix([4, 5, 6], [4, 5, 6, 7]) == 3
    assert accepted_prefix([4, 5, 6], [4, 9, 6, 7]) == 1
    assert accepted_prefix([4], [3, 1]) == 0
    assert accepted_prefix([], [3]) == 0
