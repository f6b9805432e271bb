"""GPU-only checks of the fp8 KV cache (skipped without CUDA): the Triton backend with CUDA graphs,
asynchronous scheduling, chunked prefill, prefix hits and an fp8 cache gives the greedy tokens of the
eager backend run eagerly over an fp8 cache (both store through the same quantizer; they part only
where K/V that different kernels computed round to different fp8 values, checked against the fp8
cache's own error at that position), at grouped-query shapes with head sizes 64 and 128; the deterministic mode
over an fp8 cache gives a request the same bits alone and in a batch; n-gram speculation in graphs
over an fp8 cache gives its greedy tokens without speculation; the same memory budget holds twice
the blocks. (Two GPUs: tests/gpu/test_gpu_tp.py.) The kernels' own fp8 tests (tests/kernels) also run on the GPU in the device session,
where Triton casts with the hardware."""

import pytest
import torch

from tests.gpu.test_gpu_llama import ckpt  # noqa: F401 (the fixture: GQA at head 64 and 128)
from tests.gpu.test_gpu_parity import _assert_same_greedy, _prompts, _run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2"])
def test_triton_fp8_with_graphs_matches_eager_fp8(ckpt, kv):
    shared = _prompts(1, 150, 150, seed=3)[0]
    prompts = _prompts(16, 1, 300) + [[7], [5] * 17] + [shared + p for p in _prompts(6, 1, 40, seed=4)]
    ref = _run(ckpt, prompts, attention="eager", dtype="bfloat16", enforce_eager=True, enable_prefix_caching=False,
               kv_cache_dtype=kv)
    got = _run(ckpt, prompts, attention="triton", dtype="bfloat16", max_num_batched_tokens=256, kv_cache_dtype=kv)
    _assert_same_greedy(ckpt, prompts, got, ref, "bfloat16", min_exact=0.5, kv_cache_dtype=kv,
                        backends=("triton", "eager"))


def test_deterministic_fp8_is_batch_invariant(ckpt):
    """--deterministic over an fp8 cache: a request's tokens and logprobs are the same bits alone and
    among 15 others (kernels/invariant_attention.py reads the cache the same way whatever the batch)."""
    from server.config import EngineConfig
    from server.engine import LLMEngine
    from server.sampling_params import SamplingParams

    eng = LLMEngine(EngineConfig(model=str(ckpt), device="cuda", dtype="bfloat16", attention="triton",
                                 deterministic=True, kv_cache_dtype="fp8", num_blocks=1024))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=1)
    prompts = _prompts(16, 5, 200, seed=9)
    alone = eng.generate(prompts[:1], params)[0]
    batch = eng.generate(prompts, params)[0]
    assert alone.token_ids == batch.token_ids
    assert [lp[0] for lp in alone.new_logprobs] == [lp[0] for lp in batch.new_logprobs]


def test_ngram_speculation_over_an_fp8_cache(ckpt):
    """Verifications are prefill chunks over the fp8 cache, in the verification graphs: the write
    leaves a chunk's own K/V as the cache holds them, so they score what decoding over the same cache
    would (equal greedy tokens up to bf16 near-ties)."""
    from tests.gpu.test_gpu_spec import _run as spec_run

    prompts = [p + p[: len(p) // 2] for p in _prompts(13, 1, 300, seed=21)]  # repeats: n-grams to find
    ref, _ = spec_run(ckpt, prompts, dtype="bfloat16", kv_cache_dtype="fp8")
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    got, eng = spec_run(ckpt, prompts, spec, dtype="bfloat16", kv_cache_dtype="fp8")
    _assert_same_greedy(ckpt, prompts, got, ref, "bfloat16", min_exact=0.5, kv_cache_dtype="fp8",
                        backends=("triton", "triton"))
    assert eng.speculator.counters.drafts > 0 and eng.runner.verify_graphs.graphs


def test_fp8_holds_twice_the_blocks(ckpt):
    from server.config import EngineConfig
    from server.engine import LLMEngine

    blocks = {}
    for kv in ("auto", "fp8"):
        eng = LLMEngine(EngineConfig(model=str(ckpt), device="cuda", dtype="bfloat16", kv_cache_memory=64 << 20,
                                     enforce_eager=True, kv_cache_dtype=kv))
        blocks[kv] = eng.block_manager.num_blocks
        assert eng.snapshot().kv_cache_dtype == {"auto": "bfloat16", "fp8": "fp8_e4m3"}[kv]
        eng.runner.close()
    # a budget holds blocks + 1 (the scratch block), twice as many of fp8's
    assert (blocks["fp8"] + 1) // 2 == blocks["auto"] + 1, blocks
