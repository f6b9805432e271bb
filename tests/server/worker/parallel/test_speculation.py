"""Speculative decoding under tensor parallelism on the CPU (server/worker/spec/parallel.py): two
gloo ranks in this process and one follower process, each method against one rank.

Each method's engine at --tensor-parallel-size 2 serves one batch: a shared prefix (prefix hits), a
step budget that chunks prompts beside verifications, and too few blocks (preemption, then
recomputation); greedy rows and a seeded sampled one. The proposer is wrapped: its proposals are
recorded, and every other round a greedy sequence's are replaced by its known continuation, so
that runs of every proposal are accepted too (a random draft seldom agrees with a random target).
Against the same engine at one rank:

- the tokens: those of one rank without speculation, with it, and of the two ranks without it (the
  ngram engine, its speculator taken away after its run);
- every proposal the draft made, round by round: the draft runs whole on rank 0 (a draft model
  whose 3 heads no group of 2 could split), an EAGLE-3 head over the target's hidden states there,
  whole after the all-reduces, and the target's token table gathered from both ranks, so rank 0
  proposes what one rank does (float32: the target's logits differ in the last bits, tests/models);
- steps where sequences verify beside plain decodes and prompt chunks happened, and no block is lost.

The verification graphs' replays on the other ranks are the GPU's (tests/gpu/test_gpu_tp.py);
their messages are the prefill graphs' (tests/server/worker/parallel/test_follower.py).
"""

from __future__ import annotations

import json
import random

import pytest

from server.config import EngineConfig, SpeculativeConfig
from server.engine import LLMEngine
from server.sampling_params import SamplingParams
from tests.helpers import make_llama_checkpoint

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=12, temperature=0.9, seed=5, ignore_eos=True)


def _prompts() -> list[list[int]]:
    g = random.Random(1)
    shared = [g.randrange(400) for _ in range(20)]
    prompts = [shared + [g.randrange(400) for _ in range(g.randint(2, 12))] for _ in range(3)]
    return prompts + [[g.randrange(400) for _ in range(g.randint(2, 8))] * 3 for _ in range(3)]


PROMPTS = _prompts()
PARAMS = [GREEDY] * (len(PROMPTS) - 1) + [SAMPLED]


@pytest.fixture(scope="module")
def models(eagle3_pair, tmp_path_factory):
    """{target, eagle3 head, draft}: the draft 1 layer of 3 query heads and 1 K/V head."""
    target, head = eagle3_pair
    draft = make_llama_checkpoint(tmp_path_factory.mktemp("tp-draft"), num_hidden_layers=1, num_attention_heads=3,
                                  num_key_value_heads=1, hidden_size=48, seed=3)
    return {"target": target, "eagle3": head, "draft_model": draft}


def _spec(method: str, models: dict) -> SpeculativeConfig:
    d = {"method": method, "num_speculative_tokens": 3}
    d |= dict(prompt_lookup_min=1, prompt_lookup_max=3) if method == "ngram" else {"model": str(models[method])}
    return SpeculativeConfig.parse(json.dumps(d))


def _engine(models: dict, size: int, method: str | None = None) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(models["target"]), device="cpu", tensor_parallel_size=size,
                                  speculative_config=method and _spec(method, models), num_blocks=8,
                                  max_num_batched_tokens=40, max_num_seqs=16))


def _generate(eng: LLMEngine) -> list[list[int]]:
    outs = [o.token_ids for o in eng.generate(PROMPTS, PARAMS)]
    assert eng.block_manager.check_all_free()
    return outs


@pytest.fixture(scope="module")
def plain(models):
    """One rank's tokens without speculation."""
    eng = _engine(models, 1)
    try:
        return _generate(eng)
    finally:
        eng.close()


def _speculate(eng: LLMEngine, want: list[list[int]]) -> dict:
    """The engine's tokens, its draft's proposals round by round, and the kinds of step it ran."""
    proposer, runner = eng.speculator.proposer, eng.runner
    propose, launch = proposer.propose, runner.launch
    rounds, kinds, turn = [], set(), [0]
    index = {tuple(p): i for i, p in enumerate(PROMPTS)}

    def record(items):
        drafts = propose(items)
        for (seq, _, k), d in zip(items, drafts):
            if d is None:  # (a draft's catch-up that did not fit the round: it goes on next round)
                continue
            i = index[tuple(seq.prompt_token_ids)]
            rounds.append((i, len(seq.token_ids), list(d)))
            turn[0] += 1
            if seq.params.temperature == 0 and turn[0] % 2:  # its known continuation: accepted whole
                done = len(seq.token_ids) - len(seq.prompt_token_ids)
                d[:] = want[i][done : done + k]
        return drafts

    def kind(prefills, decodes, verifies=None):
        if verifies:  # what ran beside the verifications
            kinds.add((bool(decodes), bool(prefills)))
        return launch(prefills, decodes, verifies)

    proposer.propose, runner.launch = record, kind
    try:
        tokens = _generate(eng)
    finally:
        proposer.propose, runner.launch = propose, launch
    s = eng.snapshot()
    return dict(tokens=tokens, rounds=rounds, kinds=kinds, accepted=s.spec_accepted_per_pos,
                preemptions=s.preemptions, hits=s.prefix_hits)


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3"])
def test_two_ranks_speculate_as_one_does(models, plain, method):
    one = _engine(models, 1, method)
    try:
        want = _speculate(one, plain)
    finally:
        one.close()
    two = _engine(models, 2, method)
    try:
        got = _speculate(two, plain)
        if method == "ngram":  # the same two ranks without speculation
            speculator, two.speculator = two.speculator, None
            assert _generate(two) == plain
            two.speculator = speculator
    finally:
        two.close()
    assert want["tokens"] == plain
    assert got["tokens"] == plain
    assert got["rounds"] == want["rounds"] and len(got["rounds"]) > 10
    assert got["accepted"] == want["accepted"] and got["accepted"][-1] > 0  # runs of every proposal stood
    assert any(d for d, _ in got["kinds"]) and any(p for _, p in got["kinds"])  # beside decodes, beside prompts
    assert got["preemptions"] > 0 and got["hits"] > 0
