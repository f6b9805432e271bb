"""GPU-only (skipped without CUDA): speculative decoding through the Triton backend and CUDA graphs
(the verification graphs, the draft model's decode and prefill graphs) gives the greedy tokens of
decoding without it, up to half-precision near-ties (each parting checked to be one), for the GPT-2
family (its own draft, so runs are accepted, and n-gram), a Llama-family shape with a smaller
Llama draft, and the same shape with an EAGLE-3 head (its catch-up and chained steps in the draft's
graphs, the target's states fused in the target's graphs: the head proposes in graphs what it
proposes eagerly); no block lost; the graphs really ran."""

import json

import pytest
import torch

from server.config import EngineConfig, SpeculativeConfig
from server.engine import LLMEngine
from server.sampling_params import SamplingParams
from tests.gpu.test_gpu_parity import _assert_same_greedy, _prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def gpt2_ckpt(tmp_path_factory):
    from tests.helpers import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("gpu-spec-gpt2"), n_layer=4, n_head=12, n_embd=768,
                           n_positions=1024, vocab_size=2048, initializer_range=0.1)


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):
    from tests.helpers import make_llama_checkpoint

    shape = dict(num_attention_heads=16, num_key_value_heads=4, hidden_size=1024, intermediate_size=2048,
                 vocab_size=2048, max_position_embeddings=2048, initializer_range=0.05)
    target = make_llama_checkpoint(tmp_path_factory.mktemp("gpu-spec-llama"), num_hidden_layers=4, **shape)
    draft = make_llama_checkpoint(tmp_path_factory.mktemp("gpu-spec-llama-draft"), num_hidden_layers=1, seed=3,
                                  **shape)
    return target, draft


def _run(path, prompts, spec=None, dtype="float16", **kw):
    cfg = SpeculativeConfig.parse(json.dumps(spec)) if spec else None
    eng = LLMEngine(EngineConfig(model=str(path), device="cuda", dtype=dtype, num_blocks=2048,
                                 speculative_config=cfg, max_num_batched_tokens=256, **kw))
    outs = eng.generate(prompts, GREEDY)
    assert eng.block_manager.check_all_free()
    return [o.token_ids for o in outs], eng


@pytest.mark.parametrize("method", ["self", "ngram"])
def test_speculation_in_graphs_gives_the_greedy_tokens(gpt2_ckpt, method):
    # 1..13 sequences with prompts up to 300 tokens (several 256-token chunks) and repeats (n-grams)
    prompts = _prompts(13, 1, 300, seed=21)
    prompts = [p + p[: len(p) // 2] for p in prompts]
    ref, _ = _run(gpt2_ckpt, prompts)
    spec = ({"model": str(gpt2_ckpt), "num_speculative_tokens": 4} if method == "self"
            else {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    got, eng = _run(gpt2_ckpt, prompts, spec)
    _assert_same_greedy(gpt2_ckpt, prompts, got, ref, min_exact=0.5)
    c = eng.speculator.counters
    assert c.drafts > 0
    assert eng.runner.verify_graphs is not None and eng.runner.verify_graphs.graphs
    if method == "self":
        assert c.accepted_tokens > 0.5 * c.draft_tokens
        assert eng.speculator.proposer.runner.graphs is not None  # the draft's decode graphs ran


def test_llama_family_with_a_smaller_draft(llama_pair):
    target, draft = llama_pair
    prompts = _prompts(9, 4, 200, seed=22)
    ref, _ = _run(target, prompts, dtype="bfloat16")
    got, eng = _run(target, prompts, {"model": str(draft), "num_speculative_tokens": 3}, dtype="bfloat16")
    _assert_same_greedy(target, prompts, got, ref, "bfloat16")
    assert eng.speculator.counters.drafts > 0
    assert eng.speculator.proposer.runner.graphs is not None  # the draft's decode graphs


def test_penalized_and_constrained_rows_speculate_in_graphs(gpt2_ckpt):
    """Penalized rows (the argmax kernel's penalized choice over scratch count slots) and
    grammar-constrained rows (masks filled after each proposal, the device waiting for them) verify
    proposals in the verification graphs beside plain rows: the tokens of decoding without
    speculation (up to half-precision near-ties: most requests identical), outputs inside their
    grammar, runs accepted, no block or count slot left."""
    import re

    from server.sampling_params import StructuredOutput

    regex = "(ab|cd)[a-z]{2,6}(, (ab|cd)[a-z]{2,6}){2,4}"
    prompts = _prompts(8, 4, 120, seed=23)
    prompts = [p + p[: len(p) // 2] for p in prompts]
    params = [SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, frequency_penalty=0.3,
                             presence_penalty=0.2),
              SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, repetition_penalty=1.2),
              SamplingParams(max_tokens=64, temperature=0.0, structured=StructuredOutput("regex", regex)),
              GREEDY] * 2

    def run(spec):
        cfg = SpeculativeConfig.parse(json.dumps(spec)) if spec else None
        eng = LLMEngine(EngineConfig(model=str(gpt2_ckpt), device="cuda", dtype="float16", num_blocks=2048,
                                     speculative_config=cfg, max_num_batched_tokens=256))
        outs = eng.generate(prompts, params)
        assert eng.block_manager.check_all_free()
        return outs, eng

    ref, _ = run(None)
    got, eng = run({"model": str(gpt2_ckpt), "num_speculative_tokens": 4})
    assert sum(g.token_ids == r.token_ids for g, r in zip(got, ref)) >= 6
    for g, p in zip(got, params):
        if p.structured is not None and g.finish_reason == "stop":
            assert re.fullmatch(regex, g.text), g.text
    c = eng.speculator.counters
    assert c.accepted_tokens > 0 and eng.runner.verify_graphs.graphs
    assert not eng.runner.counts.slots and not eng.runner.counts.scratched
    eng.close()


def test_llama_family_with_an_eagle3_head(llama_pair, tmp_path):
    from benchmarks.shared.checkpoint import make_random_eagle3

    target, _ = llama_pair
    head = make_random_eagle3(tmp_path / "eagle3", target, draft_vocab_size=512, layer_ids=[1, 2, 3], std=0.05)
    prompts = _prompts(9, 4, 200, seed=24)
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    ref, _ = _run(target, prompts, dtype="bfloat16")

    def run(**kw):
        """(tokens, {the sequence's tokens at a round: that round's proposals}, engine)"""
        cfg = SpeculativeConfig.parse(json.dumps(spec))
        eng = LLMEngine(EngineConfig(model=str(target), device="cuda", dtype="bfloat16", num_blocks=2048,
                                     speculative_config=cfg, max_num_batched_tokens=256, **kw))
        proposer, rounds = eng.speculator.proposer, {}
        propose = proposer.propose

        def record(items):
            drafts = propose(items)
            rounds.update({tuple(seq.token_ids): list(d) for (seq, _, _), d in zip(items, drafts) if d is not None})
            return drafts

        proposer.propose = record
        outs = eng.generate(prompts, GREEDY)
        assert eng.block_manager.check_all_free()
        return [o.token_ids for o in outs], rounds, eng

    got, in_graphs, eng = run()
    _assert_same_greedy(target, prompts, got, ref, "bfloat16")
    assert eng.speculator.counters.drafts > 0 and eng.runner.verify_graphs.graphs
    assert eng.speculator.proposer.runner.graphs is not None  # the head's decode graphs
    _, eager, _ = run(enforce_eager=True)
    shared = in_graphs.keys() & eager.keys()
    assert len(shared) >= 0.5 * len(eager)
    same = sum(in_graphs[t] == eager[t] for t in shared)
    assert same >= 0.8 * len(shared), f"{same} of {len(shared)} rounds proposed alike in graphs and eagerly"
