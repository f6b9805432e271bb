"""The Llama family (Llama, Mistral, Qwen2, Qwen3) against transformers, through the production
loader: logits on CPU with eager and sdpa, across grouped-query (8:2) and multi-query (4:1)
attention, RoPE scaling (linear, llama3, yarn), Qwen2's Q/K/V biases, Qwen3's Q/K norms, tied and
untied heads; greedy tokens through the engine under batching, chunked prefill, prefix hits and
preemption; and what is refused at load."""

import json

import pytest
import torch
from tests.helpers import hf_greedy, make_llama_checkpoint, prefill_logits
from transformers import AutoModelForCausalLM

from models import eos_token_ids, load_model
from server.config import EngineConfig
from server.engine import LLMEngine
from server.sampling_params import SamplingParams

CASES = {  # name -> (model_type, config overrides)
    "llama-gqa": ("llama", dict(num_attention_heads=8, num_key_value_heads=2, hidden_size=128)),
    "llama-mqa-tied": ("llama", dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True)),
    "llama-rope-llama3": ("llama", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                                        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 64})),
    "llama-rope-linear": ("llama", dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})),
    "llama-attention-bias": ("llama", dict(attention_bias=True)),
    "mistral": ("mistral", dict(sliding_window=None)),
    "qwen2-yarn": ("qwen2", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                                                 "original_max_position_embeddings": 64})),
    "qwen3": ("qwen3", dict(head_dim=32, num_attention_heads=4, num_key_value_heads=2, hidden_size=64)),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def ckpt(request, tmp_path_factory):
    model_type, extra = CASES[request.param]
    return make_llama_checkpoint(tmp_path_factory.mktemp(request.param), model_type, **extra)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_logits_match_transformers(ckpt, attention):
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ours = load_model(ckpt, torch.float32, "cpu", attention)
    ids = torch.randint(0, hf.config.vocab_size, (150,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(prefill_logits(ours, ids), ref, atol=2e-4, rtol=2e-4)


# The engine's paged path differs by the attention's shape and the parts around it, not by RoPE's
# scaling (a function of the position alone, which test_logits_match_transformers checks over 150
# positions): grouped-query 4:1, multi-query with a tied head, Q/K/V biases (qwen2) and Q/K norms at
# head_dim 32 (qwen3), each on both backends. CI time: 8 engines, not 16.
GREEDY_CASES = ["llama-gqa", "llama-mqa-tied", "qwen2-yarn", "qwen3"]


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("ckpt", GREEDY_CASES, indirect=True)
def test_greedy_tokens_match_transformers_under_batching_chunks_prefix_hits_and_preemption(ckpt, attention):
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(0, 512, (40,), generator=g).tolist()
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (1, 9, 70, 33)]
    prompts += [shared + [5, 6], shared + [7]]  # the second hits the first's cached blocks
    # 14 blocks of 16 cannot hold all six at once (preemption); 32-token budget: prompts are chunked.
    eng = LLMEngine(EngineConfig(model=str(ckpt), device="cpu", attention=attention, num_blocks=14,
                                 max_num_batched_tokens=32))
    outs = eng.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf, p, 20)
    assert eng.scheduler.num_preemptions > 0 and eng.block_manager.allocator.stats.hits > 0
    assert eng.block_manager.check_all_free()


def test_kv_cache_is_sized_from_kv_heads(tmp_path):
    ckpt = make_llama_checkpoint(tmp_path, "llama", num_attention_heads=8, num_key_value_heads=2, hidden_size=128)
    eng = LLMEngine(EngineConfig(model=str(ckpt), device="cpu", num_blocks=4))
    k_cache, _ = eng.runner.kv_caches[0]
    assert tuple(k_cache.shape[1:]) == (16, 2, 16)  # block_size, KV heads (not 8), head_dim
    assert eng.spec.num_kv_heads == 2 and eng.spec.num_heads == 8


def test_every_eos_id_in_generation_config_stops(tmp_path):
    ckpt = make_llama_checkpoint(tmp_path, "llama")
    first = LLMEngine(EngineConfig(model=str(ckpt), device="cpu", num_blocks=32)).generate(
        [[3, 4, 5]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].token_ids
    gen = json.loads((ckpt / "generation_config.json").read_text())
    gen["eos_token_id"] = [gen.get("eos_token_id", 0), first[3]]  # Llama 3 style: a list
    (ckpt / "generation_config.json").write_text(json.dumps(gen))
    assert first[3] in eos_token_ids(ckpt)
    out = LLMEngine(EngineConfig(model=str(ckpt), device="cpu", num_blocks=32)).generate(
        [[3, 4, 5]], SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert out.finish_reason == "stop" and out.token_ids == first[: first.index(first[3]) + 1]


def test_unsupported_rope_type_is_refused_by_name(tmp_path):
    ckpt = make_llama_checkpoint(tmp_path, "llama")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}  # context-dependent
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="rope_type .dynamic. is not supported"):
        load_model(ckpt, torch.float32, "cpu", "sdpa")


def test_sliding_window_shorter_than_the_context_names_max_model_len(tmp_path):
    ckpt = make_llama_checkpoint(tmp_path, "mistral", sliding_window=128)
    with pytest.raises(ValueError, match="--max-model-len 128"):
        LLMEngine(EngineConfig(model=str(ckpt), device="cpu", num_blocks=16))
    eng = LLMEngine(EngineConfig(model=str(ckpt), device="cpu", num_blocks=16, max_model_len=128))
    assert eng.max_model_len == 128
