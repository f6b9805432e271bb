"""--tensor-parallel-size on the CPU over HTTP: real servers whose ranks are processes joined by
gloo, the same code the GPUs run over NCCL (the graph replays aside: tests/gpu/test_gpu_tp.py).

Three servers, started together:
- GPT-2, 2 ranks, the engine in its own process (which starts rank 1);
- Llama, 8 query and 2 K/V heads, 2 ranks: the K/V heads split, one each;
- the same Llama shape at 4 ranks from its config.json alone (--load-format dummy): each K/V head
  replicated on the two ranks whose query heads use it.

The two-rank servers serve test_families_http's two waves (a cache too small for the first:
preemption; a step budget that chunks prompts; a second wave that hits the first's cached blocks),
the four-rank one a batch of the first wave's prompts, with greedy tokens equal to transformers'
(the whole model, on the same weights: for the dummy server, the dummy tensors loaded into
transformers' model), which is what one rank gives (tests/models). Float32 on
the CPU: a row-parallel projection adds two (four) partial dot products where the whole model adds
one, so logits differ in the last bits (tests/models/test_parallel.py: within 1e-4); greedy tokens
are equal unless two logits tie that closely, which these prompts do not. Sampled tokens (seeded),
penalties, logit_bias, min_tokens, structured outputs and log-probabilities, chosen on rank 0 from
the gathered logits, equal one rank's engine's. A rank that dies stops the server (exit 1); SIGTERM
drains it and every rank exits.
"""

from __future__ import annotations

import re
import signal
import time

from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
import torch

from benchmarks.shared.common import ServerProcess
from server.config import EngineConfig
from server.engine import LLMEngine
from server.sampling_params import SamplingParams, StructuredOutput
from tests.helpers import hf_greedy, make_checkpoint, make_llama_checkpoint
from tests.models.test_families_http import (SERVER_ARGS, STEP_SLEEP_ENV, assert_exercised, exchange,
                                             generate_concurrently, hf_greedy_all, wave_prompts)

LLAMA = dict(num_attention_heads=8, num_key_value_heads=2, hidden_size=128)


def _dummy_reference(path, prompts, max_tokens):
    """transformers' greedy tokens with the dummy checkpoint's tensors (models/loader.py) loaded."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from models.loader import dummy_tensors

    config = AutoConfig.from_pretrained(path)
    hf = AutoModelForCausalLM.from_config(config).eval()
    hf.load_state_dict(dict(dummy_tensors(config, torch.float32, "cpu").items()))
    return [hf_greedy(hf, p, max_tokens) for p in prompts]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    dummy = make_llama_checkpoint(tmp_path_factory.mktemp("llama-dummy"), "llama", **LLAMA, seed=5)
    for f in dummy.glob("*.safetensors"):
        f.unlink()  # config.json and the tokenizer: all --load-format dummy reads
    return {"gpt2": make_checkpoint(tmp_path_factory.mktemp("gpt2")),
            "llama": make_llama_checkpoint(tmp_path_factory.mktemp("llama"), "llama", **LLAMA),
            "llama-dummy": dummy}


@pytest.fixture(scope="module")
def servers(checkpoints):
    args = {"gpt2": ["--tensor-parallel-size", "2"],  # the engine process starts rank 1
            "llama": ["--tensor-parallel-size", "2", "--no-engine-process"],
            "llama-dummy": ["--tensor-parallel-size", "4", "--load-format", "dummy", "--no-engine-process"]}
    started = {name: ServerProcess.python_server(["--model", str(checkpoints[name]), "--device", "cpu",
                                                  *SERVER_ARGS, *args[name]], extra_env=STEP_SLEEP_ENV)
               for name in args}
    try:
        yield {name: srv.wait_healthy(300) for name, srv in started.items()}
    finally:
        for srv in started.values():
            srv.stop(30, sig=signal.SIGKILL)


def _ranks(srv: ServerProcess) -> list[psutil.Process]:
    return [p for p in psutil.Process(srv.pid).children(recursive=True)
            if "server.worker.parallel.follower" in " ".join(p.cmdline())]


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_greedy_tokens_equal_one_rank_under_preemption_chunking_and_prefix_hits(servers, checkpoints, name):
    assert len(_ranks(servers[name])) == 1
    prompts, got, metrics = exchange(servers[name].url)
    assert got == hf_greedy_all(checkpoints[name], prompts)
    assert_exercised(metrics)


def test_four_ranks_with_replicated_kv_heads_from_dummy_weights(servers, checkpoints):
    assert len(_ranks(servers["llama-dummy"])) == 3
    prompts = wave_prompts()[0][:5]
    got = generate_concurrently(servers["llama-dummy"].url, prompts, max_tokens=12)
    assert got == _dummy_reference(checkpoints["llama-dummy"], prompts, 12)


# /generate bodies and the SamplingParams they stand for
CONTROLS = [
    (dict(temperature=0.8, top_k=20, top_p=0.9, seed=7), dict(temperature=0.8, top_k=20, top_p=0.9, seed=7)),
    (dict(temperature=1.0, seed=11), dict(temperature=1.0, seed=11)),  # sampled by the argmax kernel's noise
    (dict(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.3),
     dict(temperature=0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.3)),
    (dict(temperature=0.5, seed=3, logit_bias={"7": 4.0}, min_tokens=6),
     dict(temperature=0.5, seed=3, logit_bias={7: 4.0}, min_tokens=6)),
    (dict(temperature=0, prompt_logprobs=2), dict(temperature=0, prompt_logprobs=2)),
    (dict(temperature=0, structured_outputs={"choice": ["alpha", "beta", "gamma"]}),
     dict(temperature=0, structured=StructuredOutput("choice", '["alpha", "beta", "gamma"]'))),
]


def _one_rank_outputs(engine, prompts, params) -> list[dict]:
    """Each request's tokens, token logprobs and prompt logprobs from an engine stepped to the end."""
    outs = [{"token_ids": [], "logprobs": [], "prompt_logprobs": None} for _ in prompts]
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
    while engine.has_unfinished():
        for out in engine.step():
            o = outs[int(out.request_id)]
            o["token_ids"] += out.new_token_ids
            o["logprobs"] += out.new_logprobs
            o["prompt_logprobs"] = out.prompt_logprobs or o["prompt_logprobs"]
    return outs


@pytest.fixture(scope="module")
def one_rank(checkpoints):
    eng = LLMEngine(EngineConfig(model=str(checkpoints["llama"]), device="cpu", num_blocks=64))
    yield eng
    eng.close()


def test_sampling_controls_structured_outputs_and_logprobs_equal_one_ranks(servers, one_rank):
    """Every control at once (one batch), against one rank's engine given the same requests."""
    url = servers["llama"].url
    prompts = wave_prompts(seed=2)[0][1:3]
    cases = [(prompt, body, fields) for body, fields in CONTROLS for prompt in prompts]
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]

    def ask(case):
        prompt, body, _ = case
        if body is None:  # token logprobs: the OpenAI route
            r = httpx.post(f"{url}/v1/completions", timeout=300, json={
                "model": model, "prompt": prompt, "max_tokens": 10, "temperature": 0, "logprobs": 3})
        else:
            r = httpx.post(f"{url}/generate", timeout=300, json={"prompt_token_ids": prompt, "max_tokens": 10, **body})
        assert r.status_code == 200, r.text
        return r.json()

    cases += [(prompt, None, dict(temperature=0, logprobs=3)) for prompt in prompts]
    with ThreadPoolExecutor(len(cases)) as pool:
        got = list(pool.map(ask, cases))
    want = _one_rank_outputs(one_rank, [c[0] for c in cases], [SamplingParams(max_tokens=10, **c[2]) for c in cases])
    for (_, body, _), out, ref in zip(cases, got, want):
        if body is None:
            lp = out["choices"][0]["logprobs"]["token_logprobs"]
            assert len(lp) == 10 and max(abs(a - b[0][1]) for a, b in zip(lp, ref["logprobs"])) < 1e-4
            continue
        assert out["token_ids"] == ref["token_ids"], body
        if "prompt_logprobs" in body:
            for got_pos, ref_pos in zip(out["prompt_logprobs"][1:], ref["prompt_logprobs"]):
                assert [t for t, _ in got_pos] == [t for t, _ in ref_pos]
                assert max(abs(a - b) for (_, a), (_, b) in zip(got_pos, ref_pos)) < 1e-4


def test_sigterm_drains_the_server_and_every_rank_exits(servers):
    srv = servers["gpt2"]
    ranks = _ranks(srv)
    assert ranks
    assert srv.stop(60, sig=signal.SIGTERM, must_exit=True) == 0
    assert not [p for p in ranks if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_a_rank_that_dies_stops_the_server(servers):
    """SIGKILL one rank of four: rank 0 says so and exits 1 (the API side's engine is gone), and the
    other ranks follow it out."""
    srv = servers["llama-dummy"]
    ranks = _ranks(srv)
    ranks[1].kill()
    deadline = time.monotonic() + 60
    while srv.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert srv.proc.returncode == 1, srv.log_tail()
    assert re.search(r"tensor-parallel rank \d stopped", srv.log_text()), srv.log_tail()
    gone, alive = psutil.wait_procs(ranks, timeout=30)
    assert not alive
