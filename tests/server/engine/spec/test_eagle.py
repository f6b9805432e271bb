"""EAGLE-3 heads end to end on the CPU (models/eagle3.py, server/worker/spec/eagle.py): a head in
the published layout loaded through the production path; greedy tokens the ones decoding gives
without it, and a seeded sampled request's too, under chunked prefill (the head's catch-up split
across rounds), preemption and prefix hits, with runs of proposals accepted; every round's
proposals the reference head's (models/eagle3_reference.py) for the sequence's tokens at that
round, over the target's hidden states as transformers computes them; no block lost."""

import json
import random

import pytest
import torch

from server.config import EngineConfig, SpeculativeConfig
from server.engine import LLMEngine
from server.sampling_params import SamplingParams


def _engine(target, head=None, **kw):
    spec = None if head is None else SpeculativeConfig.parse(json.dumps(
        {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3, "disable_by_batch_size": 16}))
    return LLMEngine(EngineConfig(model=str(target), device="cpu", speculative_config=spec, num_blocks=12,
                                  max_num_batched_tokens=40, max_num_seqs=64, **kw))


def _reference(target, head):
    """(transformers' target, the reference head, its aux layers) in float32."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    from models.eagle3_reference import Eagle3Reference

    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    config = LlamaConfig.from_pretrained(head)
    ref = Eagle3Reference(config).float().eval()
    ref.load_state_dict({k: v.float() if v.is_floating_point() else v
                         for k, v in load_file(head / "model.safetensors").items()})
    return hf, ref, config.eagle_config["eagle_aux_hidden_state_layer_ids"]


def test_greedy_and_seeded_tokens_unchanged_and_every_round_the_reference_heads(eagle3_pair):
    target, head = eagle3_pair
    g = random.Random(1)
    shared = [g.randrange(400) for _ in range(24)]
    prompts = [shared + [g.randrange(400) for _ in range(g.randint(2, 20))] for _ in range(4)]
    prompts += [[g.randrange(400) for _ in range(g.randint(2, 30))] for _ in range(4)]
    params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)] * 6
    params += [SamplingParams(max_tokens=16, temperature=0.9, seed=5 + i, ignore_eos=True) for i in range(2)]
    ref = [o.token_ids for o in _engine(target).generate(prompts, params)]

    eng = _engine(target, head)
    proposer = eng.speculator.proposer
    propose, rounds, turn, waits = proposer.propose, [], [0], [0]
    want = {}

    def record(items):
        """The head's proposals recorded; every other round of a greedy request proposes its
        known continuation instead, so that runs of proposals are accepted and the head catches
        up on them."""
        drafts = propose(items)
        for (seq, _, _), d in zip(items, drafts):
            if d is None:  # its catch-up did not fit the round's token budget: it goes on next round
                waits[0] += 1
                continue
            rounds.append((list(seq.token_ids), list(d)))
            turn[0] += 1
            done = len(seq.token_ids) - len(seq.prompt_token_ids)
            if seq.params.temperature == 0 and turn[0] % 2:
                d[:] = (want[seq.request_id][done:] + d)[: len(d)]
        return drafts

    proposer.propose = record
    for i, (p, sp) in enumerate(zip(prompts, params)):
        want[str(i)] = ref[i]
        eng.add_request(str(i), p, sp)
    got = {}
    while eng.has_unfinished():
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert [got[str(i)] for i in range(len(prompts))] == ref
    assert eng.block_manager.check_all_free()
    c = eng.speculator.counters
    assert c.drafts > 20 and c.accepted_per_pos[2] > 5  # runs of all three proposals stood
    assert eng.scheduler.num_preemptions > 0 and eng.block_manager.allocator.stats.hits > 0
    assert waits[0] > 0  # catch-ups over several rounds

    # each round's tokens are a prefix of its request's final ones: the target's states at every
    # position come from one forward of those (causal: a position's states see nothing later)
    hf, head_ref, layers = _reference(target, head)
    embed = hf.get_input_embeddings()
    with torch.no_grad():
        aux = {}
        for p, out in zip(prompts, ref):
            states = hf(torch.tensor([p + out]), output_hidden_states=True).hidden_states
            aux[tuple(p)] = torch.cat([states[j][0] for j in layers], dim=-1)
        for tokens, d in rounds:
            p = next(p for p in prompts if tokens[: len(p)] == p)
            assert head_ref.propose(tokens, aux[tuple(p)], len(d), embed) == d, tokens


def test_an_eagle3_head_named_as_a_draft_model_is_refused(eagle3_pair):
    target, head = eagle3_pair
    spec = SpeculativeConfig.parse(json.dumps({"model": str(head), "num_speculative_tokens": 2}))
    with pytest.raises(ValueError, match='is an EAGLE-3 head, not a draft model: pass "method": "eagle3"'):
        LLMEngine(EngineConfig(model=str(target), device="cpu", num_blocks=8, speculative_config=spec))
