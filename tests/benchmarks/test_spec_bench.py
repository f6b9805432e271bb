"""benchmarks/engine/bench_spec.py's oracle on the CPU: the mean accepted length it sets is the one the engine
measures ((1 - p^(k+1)) / (1 - p)), whichever proposer pays for the proposals, and the plain engine
is what its 'off' runs measure."""

import json

import pytest

from benchmarks.engine.bench_spec import configure, expected_length, main, measure, run_clients
from server.config import EngineConfig, SpeculativeConfig
from server.engine import LLMEngine
from server.engine.spec.ngram import NgramProposer


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    spec = SpeculativeConfig.parse(json.dumps({"model": str(tiny_ckpt), "num_speculative_tokens": 4}))
    eng = LLMEngine(EngineConfig(model=str(tiny_ckpt), device="cpu", num_blocks=128, speculative_config=spec))
    eng.speculator.proposers = {"draft_model": eng.speculator.proposer, "ngram": NgramProposer(1, 3)}
    return eng


@pytest.fixture(scope="module")
def eagle3_engine(eagle3_pair):
    """The target of an EAGLE-3 head (it feeds the head at every step: an engine of its own)."""
    target, head = eagle3_pair
    spec = SpeculativeConfig.parse(json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": 4}))
    eng = LLMEngine(EngineConfig(model=str(target), device="cpu", num_blocks=128, speculative_config=spec))
    eng.speculator.proposers = {"eagle3": eng.speculator.proposer}
    return eng


@pytest.mark.parametrize("method,p", [("ngram", 0.77), ("draft_model", 0.5), ("ngram", 0.0), ("eagle3", 0.77)])
def test_the_oracle_sets_the_mean_accepted_length(request, method, p):
    engine = request.getfixturevalue("eagle3_engine" if method == "eagle3" else "engine")
    spec = engine.speculator
    configure(engine, spec, method, p, 32)
    prompts = [[i + 1] * 7 for i in range(4)]
    r = run_clients(engine, prompts, 60)
    c = spec.counters
    measured = 1 + c.accepted_tokens / c.drafts
    assert abs(measured - expected_length(p, 4)) < 0.5, (measured, expected_length(p, 4))
    assert r["output_tok_s"] > 0 and engine.block_manager.check_all_free()
    assert engine.num_generated_tokens % 60 == 0  # every request made exactly its 60 tokens


def test_off_is_the_plain_engine(engine):
    spec = engine.speculator
    configure(engine, spec, None, 0.0, 32)
    assert engine.speculator is None
    run_clients(engine, [[5, 6, 7]], 10)
    configure(engine, spec, "ngram", 0.9, 32)
    assert engine.speculator is spec and spec.counters.drafts == 0


def test_floors_run_side_by_side(engine):
    """--floors: a method at each back-off floor, rows of their own that record the floor; a floor
    of 1 backs off after the first miss, so it verifies less often than a floor of 0."""
    import argparse

    args = argparse.Namespace(probabilities=[0.5], sweep_clients=[2], probability=0.5, forced_clients=[],
                              repeats=1, repeats_256=1, num_speculative_tokens=4, max_tokens=40, deadline=None,
                              floors={"ngram": [0.0, 1.0]}, policies=[])
    prompts = [[i + 3] * 9 for i in range(2)]
    rows = {r["config"]: r for r in measure(engine, engine.speculator, "plain", ["ngram"], 2, prompts, args, {}, 0.0)}
    low, high = rows["ngram p=0.5 floor=0.0"], rows["ngram p=0.5 floor=1.0"]
    assert (low["min_acceptance"], high["min_acceptance"]) == (0.0, 1.0)
    assert low["runs_tok_s"] == [low["output_tok_s"]] and len(high["runs_tok_s"]) == 1  # each run's, kept
    assert 0 < high["verifications"] < low["verifications"], (high, low)
    with pytest.raises(SystemExit):
        main(["--floors", "draft_model=1.5"])


def test_policies_run_side_by_side(engine):
    """--policies: the draft at each back-off rule, rows of their own that record it; with a draft
    that proposes what the oracle mostly rejects (p = 0.1) at 2 clients, the batch rule verifies far
    less often than per_sequence with a floor of 0 (every step)."""
    import argparse

    args = argparse.Namespace(probabilities=[0.1], sweep_clients=[2], probability=0.1, forced_clients=[],
                              repeats=1, repeats_256=1, num_speculative_tokens=4, max_tokens=24, deadline=None,
                              floors={"draft_model": [0.0]}, policies=["per_sequence", "batch"])
    prompts = [[i + 3] * 9 for i in range(2)]
    rows = {r["config"]: r for r in measure(engine, engine.speculator, "plain", ["draft_model"], 2, prompts, args, {}, 0.0)}
    seq, batch = rows["draft_model p=0.1 floor=0.0 backoff=per_sequence"], rows["draft_model p=0.1 floor=0.0 backoff=batch"]
    assert (seq["backoff"], batch["backoff"]) == ("per_sequence", "batch")
    assert 0 < batch["verifications"] < seq["verifications"] / 2, (batch, seq)
    with pytest.raises(SystemExit):
        main(["--policies", "never"])
