"""GPU-only (skipped without two CUDA GPUs): tensor parallelism over NCCL, with the Triton backend,
CUDA graphs (the all-reduces, the LM head's gather and the sampled ids' broadcast captured in them),
asynchronous scheduling, chunked prefill and prefix caching: --tensor-parallel-size 2 gives one
GPU's greedy tokens up to bf16 near-ties (each parting checked against transformers' fp32 logits,
as test_gpu_parity does) and its chosen tokens' log-probabilities within bf16 noise, at the
Llama-3.1-8B shape's attention (32 query and 8 K/V heads of 128, hidden 4096) with fewer layers, a
narrower MLP and a smaller vocabulary; eager steps (--enforce-eager) likewise; and the rank-0-only
parts (penalties, seeded sampling, structured outputs with the grammar's wait on the device, prompt
log-probabilities) run beside the collectives without a hang, choosing what one GPU chooses.

Every engine here is rank 0 in this process (rank 1 its own process on cuda:1), one at a time."""

import json

import pytest
import torch

from server.config import EngineConfig
from server.engine import LLMEngine
from server.sampling_params import SamplingParams, StructuredOutput
from tests.gpu.test_gpu_parity import _assert_same_greedy, _assert_same_logprobs, _logprob_run, _prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs two CUDA GPUs")

# Llama-3.1-8B's attention; 3 layers, MLP 4096 wide, 4096-token vocabulary (_prompts draws ids < 2048)
SHAPE = dict(num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_size=4096, intermediate_size=4096,
             num_hidden_layers=3, max_position_embeddings=2048, vocab_size=4096, initializer_range=0.02)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tests.helpers import make_llama_checkpoint

    path = make_llama_checkpoint(tmp_path_factory.mktemp("tp-llama-8b-shape"), "llama", **SHAPE)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "dtype": "bfloat16"}))  # served in bf16, as 8B is
    return path


def _engine(path, tp: int, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), device="cuda", tensor_parallel_size=tp, num_blocks=1024,
                                  max_model_len=2048, **kw))


def _greedy_and_logprobs(path, tp: int, prompts, **kw):
    """test_gpu_parity's run at `tp` ranks; the engine closed after (one group at a time per process)."""
    engines = []
    try:
        return _logprob_run(path, prompts, on_engine=engines.append, tensor_parallel_size=tp, max_model_len=2048, **kw)
    finally:
        for eng in engines:
            eng.close()


def _workload():
    shared = _prompts(1, 150, 150, seed=3)[0]
    return _prompts(20, 1, 300) + [[7], [5] * 17] + [shared + p for p in _prompts(6, 1, 40, seed=4)]


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_two_gpus_give_one_gpus_greedy_tokens_and_logprobs(ckpt, enforce_eager):
    prompts = _workload()
    kw = dict(max_num_batched_tokens=256, enforce_eager=enforce_eager)
    one = _greedy_and_logprobs(ckpt, 1, prompts, **kw)
    two = _greedy_and_logprobs(ckpt, 2, prompts, **kw)
    order = [str(i) for i in range(len(prompts))]
    _assert_same_greedy(ckpt, prompts, [two[0][r] for r in order], [one[0][r] for r in order], "bfloat16")
    _assert_same_logprobs(two, one, bound=0.15)


def test_rank_0s_choices_beside_the_collectives(ckpt):
    """Penalties (decode graph's penalized argmax), seeded sampling with top-k (the general sampler),
    a structured choice (the grammar's wait kernel on rank 0's stream, then its masked argmax), and
    prompt log-probabilities (eager steps with LM-head slices on every rank), all in one batch."""
    prompts = _prompts(8, 20, 120, seed=9)
    params = [SamplingParams(max_tokens=16, temperature=0, repetition_penalty=1.2, frequency_penalty=0.3),
              SamplingParams(max_tokens=16, temperature=0.8, top_k=50, seed=5),
              SamplingParams(max_tokens=16, temperature=1.0, seed=6),
              SamplingParams(max_tokens=16, temperature=0, structured=StructuredOutput("regex", "[a-z ]{4,20}")),
              SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=2)] * 2
    prompts = prompts[: len(params)] + prompts[: len(params) - len(prompts)]
    outs = {}
    for tp in (1, 2):
        eng = _engine(ckpt, tp, max_num_batched_tokens=256)
        try:
            outs[tp] = eng.generate(prompts, params)
            assert eng.block_manager.check_all_free()
        finally:
            eng.close()
    for p, a, b in zip(params, outs[1], outs[2]):
        assert len(b.token_ids) == len(a.token_ids) or p.structured is not None
        if p.prompt_logprobs:
            worst = max(abs(x[0][1] - y[0][1]) for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]))
            assert worst < 0.15, f"prompt log-probabilities differ by {worst:.3f}"
    same = sum(a.token_ids == b.token_ids for a, b in zip(outs[1], outs[2]))
    assert same >= len(params) // 2, f"only {same} of {len(params)} requests chose one GPU's tokens"
