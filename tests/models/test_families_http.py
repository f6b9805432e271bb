"""Every Llama-family model type served over HTTP (`python -m server`, a real uvicorn process), on the
CPU with eager or sdpa attention: concurrent /generate requests of mixed lengths, against a cache too
small for all of them at once (preemption), a step budget that splits prompts (chunked prefill), and
a second wave that continues the first wave's prompts (prefix-cache hits), give greedy token ids
identical to transformers' `generate`. The server's own counters show that preemption, chunking and
prefix hits happened, and that no KV block leaked. tests/gpu/test_gpu_llama.py runs the same exchange
against the Triton backend on a GPU.

Each family is served with one of the two CPU backends (SERVED), both backends with grouped-query
attention and each with a family of its own parts: the HTTP path is the same whatever the model, and
tests/models/test_llama.py runs every family with both backends through the engine, under the same
batching, chunking, prefix hits and preemption (CI time: four servers, not eight).
"""

from __future__ import annotations

import random
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.shared.common import ServerProcess
from tests.helpers import hf_greedy, make_llama_checkpoint

FAMILIES = {  # model_type -> config overrides: each family's own parts, at tiny sizes
    "llama": dict(num_attention_heads=8, num_key_value_heads=2, hidden_size=128),  # GQA 4:1
    "mistral": dict(num_attention_heads=4, num_key_value_heads=1, sliding_window=None),  # MQA
    "qwen2": dict(num_attention_heads=4, num_key_value_heads=2),  # Q/K/V biases
    "qwen3": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32, hidden_size=64),  # Q/K norms
}
SERVED = [("llama", "eager"), ("mistral", "sdpa"), ("qwen2", "eager"), ("qwen3", "sdpa")]  # (family, --attention)
MAX_TOKENS = 24
# 14 blocks of 16 tokens hold about half of the first wave's prompts at once, and prompts ending at
# or just before a block edge need a new block on their first decode steps: running requests are
# preempted. 32 batched tokens a step chunk every prompt longer than that.
SERVER_ARGS = ["--num-blocks", "14", "--block-size", "16", "--max-num-batched-tokens", "32"]
# The CPU servers here run the engine on a thread of the server process (the same LLMEngine, scheduler
# and model; what this file checks is each family's model), so each of the four starts one Python
# process instead of two (~4 s less CPU each). The engine process is covered by the other real-server
# tests (tests/server/api/test_reliability.py, test_adversarial.py, benchmarks/test_soak.py, docker/)
# and by tests/gpu/test_gpu_llama.py, which takes SERVER_ARGS (so the flag is not in it).
CPU_ONLY_ARGS = ["--no-engine-process"]
# Preemption needs the wave's long prompts running together. On an idle machine a tiny model's step
# takes a millisecond, so a request that reached the server late (threads starting on a busy CI
# machine) could find the others finished. Every step sleeping 10 ms (the test-only fault injector,
# server/engine/faults.py) keeps the 100-token prompt running for >= 280 ms (4 chunks + 24 tokens),
# far longer than the spread of the wave's arrivals.
STEP_SLEEP_ENV = {"FLASHPAGE_FAULT_INJECT": "sleep=0.01"}


def wave_prompts(seed: int = 0, vocab: int = 400) -> tuple[list[list[int]], list[list[int]]]:
    """First wave: mixed lengths (1, under and over a block, several chunks); second wave: first-wave
    prompts extended, so their full blocks are prefix-cache hits."""
    rng = random.Random(seed)
    first = [[rng.randrange(vocab) for _ in range(n)] for n in (1, 9, 15, 31, 47, 63, 100)]
    second = [first[4] + [rng.randrange(vocab) for _ in range(5)], first[6][:64] + [7]]
    return first, second


def generate_concurrently(url: str, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    def one(prompt):
        r = httpx.post(f"{url}/generate", timeout=300, json={
            "prompt_token_ids": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()["token_ids"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def scrape(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    # The engine-wide series (labelled by model only), not the per-label breakdowns.
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if set(s.labels) <= {"model"}}


def hf_greedy_all(path, prompts: list[list[int]], max_tokens: int = MAX_TOKENS, device: str = "cpu"
                  ) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    return [hf_greedy(hf, prompt, max_tokens) for prompt in prompts]


def exchange(url: str, max_tokens: int = MAX_TOKENS) -> tuple[list[list[int]], list[list[int]], dict[str, float]]:
    """Both waves against a running server: (prompts, token ids, the server's counters after)."""
    first, second = wave_prompts()
    got = generate_concurrently(url, first, max_tokens)
    got += generate_concurrently(url, second, max_tokens)
    return first + second, got, scrape(url)


def assert_exercised(metrics: dict[str, float]) -> None:
    assert metrics["flashpage_preemptions_total"] > 0, "the cache was meant to be too small for the first wave"
    assert metrics["flashpage_prefix_cache_hits_total"] > 0, "the second wave was meant to hit cached blocks"
    assert metrics["flashpage_requests_running"] == 0 and metrics["flashpage_kv_cache_blocks_used"] == 0, \
        "KV blocks still held after every request finished"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {family: make_llama_checkpoint(tmp_path_factory.mktemp(family), family, **extra)
            for family, extra in FAMILIES.items()}


@pytest.fixture(scope="module")
def servers(checkpoints):
    """One server per (family, attention backend) of SERVED, all started at once."""
    started = {(family, attention): ServerProcess.python_server(
        ["--model", str(checkpoints[family]), "--device", "cpu", "--attention", attention, *SERVER_ARGS,
         *CPU_ONLY_ARGS], extra_env=STEP_SLEEP_ENV)
        for family, attention in SERVED}
    try:
        yield {key: srv.wait_healthy(180).url for key, srv in started.items()}
    finally:
        # SIGKILL: a graceful exit (1-2 s of CPU each) is not what this file tests
        # (tests/server/api/test_reliability.py's SIGTERM test is).
        for srv in started.values():
            srv.stop(30, sig=signal.SIGKILL)


@pytest.fixture(scope="module")
def references(checkpoints):
    first, second = wave_prompts()
    return {family: hf_greedy_all(path, first + second) for family, path in checkpoints.items()}


@pytest.mark.parametrize("family,attention", SERVED)
def test_greedy_over_http_matches_transformers(servers, references, family, attention):
    prompts, got, metrics = exchange(servers[family, attention])
    for i, (g, want) in enumerate(zip(got, references[family])):
        assert g == want, f"{family}/{attention}: prompt {i} ({len(prompts[i])} tokens) differs from transformers"
    assert_exercised(metrics)
