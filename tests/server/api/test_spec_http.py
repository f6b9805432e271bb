"""Speculative decoding over HTTP (`python -m server --speculative-config ...`, real uvicorn processes
on the CPU): concurrent /generate requests against a cache too small for them all (preemption), a
32-token step budget (chunked prefill) and a second wave that continues the first's prompts (prefix
hits) give transformers' greedy tokens, for the GPT-2 family (a draft model: the checkpoint drafting
for itself, so runs of proposals are accepted, through the engine process) and the Llama family (the
n-gram method, the engine on a thread); /metrics counts the verifications under vLLM's names, and no
KV block is held afterwards. tests/gpu/test_gpu_spec.py runs the Triton backend's CUDA graphs."""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.shared.common import ServerProcess
from tests.helpers import make_llama_checkpoint
from tests.models.test_families_http import (SERVER_ARGS, assert_exercised, generate_concurrently, hf_greedy_all,
                                             scrape, wave_prompts)

# test_families_http's 10 ms a step keeps the first wave's longest prompt running for its 4 chunks and
# 24 decode steps; accepted proposals cut those to ~6 verifications (the GPT-2 checkpoint drafts for
# itself), so under load the wave's arrivals could spread past it and nothing was preempted (seen once
# in CI beside another test process). 30 ms a step kept the wave together for as long as before,
# until a check run beside two other jobs on the two cores (load ~6) spread it again; 60 ms a step.
STEP_SLEEP_ENV = {"FLASHPAGE_FAULT_INJECT": "sleep=0.06"}
# ... and still (two fresh-clone CI runs here on 2026-11-28, gpt2: no preemption): whether the wave
# preempts depended on which prompts the scheduler happened to admit together, which a request's
# arrival decides. So here the two longest (100 and 63 tokens: 7 + 4 blocks when admitted, 8 + 6 as
# they decode) go first and the rest once both run (`exchange_preempting`), in a cache of 12 blocks:
# both fit at admission, and their decodes cannot both finish without a preemption.
SPEC_SERVER_ARGS = [("12" if a == "14" else a) for a in SERVER_ARGS]
assert SPEC_SERVER_ARGS != SERVER_ARGS


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory):
    return make_llama_checkpoint(tmp_path_factory.mktemp("spec-http-llama"), num_attention_heads=8,
                                 num_key_value_heads=2, hidden_size=128)


@pytest.fixture(scope="module")
def servers(tiny_ckpt, llama_ckpt):
    specs = {"gpt2": (tiny_ckpt, {"model": str(tiny_ckpt), "num_speculative_tokens": 3}, []),
             "llama": (llama_ckpt, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                    "prompt_lookup_max": 2}, ["--no-engine-process"])}
    started = {family: ServerProcess.python_server(
        ["--model", str(path), "--device", "cpu", "--attention", "sdpa", *SPEC_SERVER_ARGS, "--speculative-config",
         json.dumps(spec), *extra], extra_env=STEP_SLEEP_ENV) for family, (path, spec, extra) in specs.items()}
    try:
        yield {family: srv.wait_healthy(180).url for family, srv in started.items()}
    finally:
        for srv in started.values():
            srv.stop(30, sig=signal.SIGKILL)


def exchange_preempting(url: str) -> tuple[list[list[int]], list[list[int]], dict[str, float]]:
    """test_families_http's exchange, the first wave's two longest prompts sent first and the rest
    once the server runs both (see SPEC_SERVER_ARGS)."""
    first, second = wave_prompts()
    longest = sorted(range(len(first)), key=lambda i: len(first[i]))[-2:]
    with ThreadPoolExecutor(len(first)) as pool:
        futures = {i: pool.submit(generate_concurrently, url, [first[i]]) for i in longest}
        deadline = time.monotonic() + 30
        while scrape(url)["flashpage_requests_running"] < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        futures |= {i: pool.submit(generate_concurrently, url, [first[i]]) for i in range(len(first)) if i not in longest}
        got = [futures[i].result()[0] for i in range(len(first))]
    got += generate_concurrently(url, second)
    return first + second, got, scrape(url)


def spec_counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("vllm:spec_decode"):
                key = s.name + (f"[{s.labels['position']}]" if "position" in s.labels else "")
                out[key] = s.value
    return out


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_greedy_over_http_with_speculation_matches_transformers(servers, tiny_ckpt, llama_ckpt, family):
    first, second = wave_prompts()
    want = hf_greedy_all(tiny_ckpt if family == "gpt2" else llama_ckpt, first + second)
    prompts, got, metrics = exchange_preempting(servers[family])
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"{family}: prompt {i} ({len(prompts[i])} tokens) differs from transformers"
    assert_exercised(metrics)
    c = spec_counters(servers[family])
    assert c["vllm:spec_decode_num_drafts_total"] > 0
    assert c["vllm:spec_decode_num_draft_tokens_total"] >= c["vllm:spec_decode_num_drafts_total"]
    per_pos = [c[f"vllm:spec_decode_num_accepted_tokens_per_pos_total[{i}]"] for i in range(3)]
    assert sum(per_pos) == c["vllm:spec_decode_num_accepted_tokens_total"]
    assert per_pos == sorted(per_pos, reverse=True)  # a proposal stands only after the ones before it
    if family == "gpt2":  # the draft is the target: runs of proposals accepted
        assert per_pos[2] > 0
