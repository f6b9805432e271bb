"""GPU-only (skipped without CUDA): speculative decoding through the Triton backend and CUDA graphs
(the verification graphs, the draft model's decode and prefill graphs) gives the greedy tokens of
decoding without it, up to half-precision near-ties (each parting checked to be one), for the GPT-2
family (its own draft, so runs are accepted, and n-gram) and a Llama-family shape with a smaller
Llama draft; no block lost; the graphs really ran."""

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
