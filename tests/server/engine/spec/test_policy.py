"""The batch back-off rule (server/engine/spec/policy.py) at its boundaries: the cost model's sign
change, all rows low, one row high, the probes' back-off, a row left out too long, the estimate's
start, and the batch-size limit before it (Speculator.wants)."""

import json
from types import SimpleNamespace

from kvcache import BlockManager
from server.config import (SPEC_COST_PLAIN_ROW, SPEC_COST_POSITION, SPEC_MAX_BACKOFF, SPEC_ROUND_COST, EngineConfig,
                           SpeculativeConfig)
from server.engine.spec.policy import BatchBackoff, SpecState, StepCosts, estimate, record, rows_for_round
from server.engine.spec.speculator import Speculator

DRAFT = StepCosts(SPEC_ROUND_COST["draft_model"], SPEC_COST_POSITION, SPEC_COST_PLAIN_ROW)


def _state(acceptance: float, verifications: int = 10) -> SpecState:
    """A sequence whose estimate is `acceptance` (its optimistic start long forgotten)."""
    return SpecState(acceptance=acceptance, start_weight=0.75 ** verifications)


def test_one_row_speculates_exactly_above_the_break_even():
    # one row, k = 4: (1 + 4a) / (1 + round + 4 position) > 1  <=>  a > (round + 4 position) / 4
    even = (DRAFT.round_cost + 4 * DRAFT.position) / 4
    assert rows_for_round([4 * (even + 1e-3)], [4], 1, DRAFT) == 1
    assert rows_for_round([4 * (even - 1e-3)], [4], 1, DRAFT) == 0
    cheap = StepCosts(SPEC_ROUND_COST["eagle3"], SPEC_COST_POSITION, SPEC_COST_PLAIN_ROW)
    assert rows_for_round([4 * (even - 1e-3)], [4], 1, cheap) == 1  # a cheaper round breaks even lower


def test_all_rows_low_no_round_one_row_high_depends_on_the_batch():
    low = [0.05 * 4] * 8
    assert rows_for_round(low, [4] * 8, 8, DRAFT) == 0
    # one well-accepted row beside a hopeless one: its round pays at 2 rows (without the other), not
    # beside seven poor ones at 8 (the round costs the same, the tokens it adds are about one row's)
    assert rows_for_round([0.9 * 4, 0.0], [4, 4], 2, DRAFT) == 1
    assert rows_for_round([0.9 * 4] + [0.05 * 4] * 7, [4] * 8, 8, DRAFT) == 0
    # all eight at 0.45 (k = 4: 1.8 tokens a verification) pay for a draft round; at 0.25 they do not
    assert rows_for_round([0.45 * 4] * 8, [4] * 8, 8, DRAFT) == 8
    assert rows_for_round([0.25 * 4] * 8, [4] * 8, 8, DRAFT) == 0


def test_a_round_takes_the_best_rows_and_leaves_the_worthless():
    b = BatchBackoff(DRAFT)
    cands = [(_state(0.0), 4), (_state(0.9), 4), (_state(0.8), 4), (_state(0.0), 4)]
    assert b.choose(cands, 4) == [1, 2]
    cands[3][0].idle = SPEC_MAX_BACKOFF  # left out for long: it joins a round that runs anyway
    assert b.choose(cands, 4) == [1, 2, 3]


def test_without_a_paying_round_the_batch_probes_at_doubling_intervals():
    b = BatchBackoff(DRAFT)
    cands = [(_state(0.05), 4)] * 8
    assert b.choose(cands, 8, commit=False) == [] and (b.skip, b.backoff) == (0, 0)  # asking counts nothing
    probes = [step for step in range(300) if b.choose(cands, 8)]
    gaps = [q - p - 1 for p, q in zip(probes, probes[1:])]
    assert probes[0] == 1 and gaps[:7] == [2, 4, 8, 16, 32, 64, 64]  # steps without a round between probes
    # a round the model chooses resets the back-off
    assert b.choose([(_state(0.9), 4)] * 8, 8) and (b.skip, b.backoff) == (0, 0)


def test_the_estimate_forgets_its_optimistic_start_after_a_few_verifications():
    st = SpecState()
    assert estimate(st) == 1.0
    for _ in range(4):
        record(st, 4, 0, 0.0)
    assert estimate(st) < 0.11 < st.acceptance  # the plain average still says 0.32
    assert st.skip == st.backoff == 0  # a floor of 0 (the batch rule): no per-sequence back-off
    full = SpecState()
    for _ in range(4):
        record(full, 4, 4, 0.0)
    assert estimate(full) == full.acceptance == 1.0


def _speculator(method="draft_model", **kw) -> Speculator:
    spec = SpeculativeConfig.parse(json.dumps({"method": method, "model": "d", "num_speculative_tokens": 4,
                                               "disable_by_batch_size": 8, **kw}))
    return Speculator(EngineConfig(speculative_config=spec), BlockManager(16, 16, False), 4096)


def _seq(acceptance: float):
    return SimpleNamespace(spec=_state(acceptance), token_ids=[1, 2, 3], prompt_token_ids=[1, 2],
                           output_token_ids=[3], params=SimpleNamespace(max_tokens=100))


def test_wants_follows_the_rule_and_the_batch_size_limit():
    spec = _speculator()
    assert spec.batch is not None and spec.batch.costs.round_cost == SPEC_ROUND_COST["draft_model"]
    assert spec.wants([_seq(0.9)] * 8)
    assert not spec.wants([_seq(0.9)] * 9)  # above disable_by_batch_size
    assert not spec.wants([_seq(0.05)] * 8)  # no round pays (the first such step starts the back-off)
    at_the_end = _seq(0.9)
    at_the_end.token_ids = [1] * 4096  # the context is full: nothing to propose, so no synchronous step for it
    assert not spec.wants([at_the_end] * 8)
    assert _speculator(backoff="per_sequence").batch is None
    assert _speculator(round_cost=0.0).batch.costs.round_cost == 0.0
