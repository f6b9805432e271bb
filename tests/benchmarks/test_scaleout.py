"""Two CPU replicas of a tiny model behind vllm-router (benchmarks/scaleout/bench_scaleout.py starts both):
the routed API works (/generate in SGLang's shape, which the router forwards intact, /v1/completions
streamed and not, /health), a replica killed mid-run is taken out and the requests it held are
retried on the other, and on a shared-prefix workload `cache_aware` routing finds more of the
prompt tokens in the replicas' prefix caches than `round_robin`, which computes each system prompt
once per replica it happens to reach."""

import argparse
import json
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from benchmarks.scaleout import bench_scaleout as so
from benchmarks.scaleout import scaleout_load

# --no-engine-process: the engine on a thread, one Python process per replica to start instead of
# two; routing, retries and prefix-cache hits do not depend on where the engine steps.
# Access lines (INFO) show what the router asked each replica.
REPLICA_ARGS = ["--num-blocks", "512", "--block-size", "16", "--no-engine-process", "--log-level", "info"]
# 16 system prompts (~5 blocks each with this tokenizer), each used ~3 times, one client: on the
# CPU the two policies measured 0.35-0.37 (round_robin) and 0.57-0.60 (cache_aware).
SHARED = argparse.Namespace(system_prompts=16, system_words=[30, 32], user_words=[1, 3], max_tokens=2, block_size=16)


@pytest.fixture(scope="module")
def replicas(tiny_ckpt, tmp_path_factory):
    procs = so.start_replicas(str(tiny_ckpt), 2, "cpu", REPLICA_ARGS, tmp_path_factory.mktemp("replicas"))
    yield procs
    for p in procs:
        p.stop(20, sig=signal.SIGKILL)  # their graceful exit is not what this file tests


@pytest.fixture
def router(replicas, tmp_path):
    def start(policy):
        started.append(so.start_router([p.url for p in replicas], policy, tmp_path / f"router-{policy}.log"))
        return started[-1]

    started = []
    yield start
    for r in started:
        r.stop(10)


def test_routed_api(router):
    url = router("cache_aware").url
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    r = httpx.post(url + "/generate", timeout=60, json={"text": "The quick brown",
                                                        "sampling_params": {"max_new_tokens": 5, "temperature": 0}})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5, r.text
    body = {"model": "model", "prompt": "The quick brown", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    whole = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert whole.status_code == 200, whole.text
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events) == whole.json()["choices"][0]["text"]


def test_cache_aware_tokenizes_through_render(replicas, router):
    """cache_aware asks every replica for each request's tokens: /v1/completions/render and
    /v1/chat/completions/render answer (vLLM's routes; before they existed, each request cost every
    replica a 404 and a /tokenize before it was sent)."""
    url = router("cache_aware").url
    chat = {"model": "model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    logs = [len(p.log_text()) for p in replicas]
    body = {"model": "model", "prompt": "The quick brown", "max_tokens": 2, "temperature": 0}
    for _ in range(3):
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
    # no chat template here: the chat render's 400 (as the chat route's), then the route's own
    assert httpx.post(url + "/v1/chat/completions", json=chat, timeout=60).status_code == 400
    for p, start in zip(replicas, logs):
        # The router routes once every render is in or its 1 s budget is spent, so on a loaded
        # machine a replica may log its render after the client has its answer: wait for the line.
        deadline = time.monotonic() + 20
        while True:
            seen = re.findall(r"(POST \S+) (\d+)", p.log_text()[start:])
            if ("POST /v1/chat/completions/render", "400") in seen or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert seen.count(("POST /v1/completions/render", "200")) == 3, seen
        assert ("POST /v1/chat/completions/render", "400") in seen
        assert not [s for s in seen if s[0] == "POST /tokenize" or s[1] == "404"], seen


def test_cache_aware_routing_hits_the_prefix_cache_more_than_round_robin(replicas, router):
    urls = [p.url for p in replicas]
    rates = {}
    for seed, policy in enumerate(["round_robin", "cache_aware"]):
        started = router(policy)
        row = so.run_once([started.url], urls, "shared", seed, SHARED, clients=1, num_requests=48,
                          router_metrics=started.metrics_url)
        assert row["errors"] == 0
        rates[policy] = row["hit_rate"]
        # what the run's observer saw from the side: renders answered on both replicas, loads sampled
        assert row["samples"] > 0 and row["observer_errors"] == 0 and row["render_ms"]["p50"] > 0, row
        assert len(row["load_mean"]) == 2 and row["replica_ttft_p50_ms"] > 0, row
        if policy == "cache_aware":  # the router's counters: it routed on the renders' token ids, 2 per request
            moved = row["router_counters"]
            assert moved["vllm_router_kv_routing_inputs_total"] == {"render": 96}, moved
            decisions = moved["vllm_router_prefix_routing_decisions_total"]
            assert sum(decisions.values()) == 48 and decisions.get("prefix_hit", 0) > 0, moved
    assert rates["cache_aware"] > rates["round_robin"] + 0.1, rates


# 8 conversations of 3 turns from 2 system prompts (~55 tokens each with this tokenizer, a turn ~50
# more: the third within the model's 256 positions): the turns after the first find the conversation
# so far cached on the replica that served the last one.
CHAT = argparse.Namespace(**{**vars(SHARED), "system_words": [12, 14], "user_words": [6, 8]}, chat_system_prompts=2,
                          turns=3)


def test_chat_turns_carry_the_conversation_and_cache_aware_keeps_it_on_one_replica(replicas, router):
    urls = [p.url for p in replicas]
    chats = so.make_prompts("chat", 3, 24, CHAT)
    assert len(chats) == 8 and all(len(c.turns) == 3 for c in chats)
    rates = {}
    for seed, policy in enumerate(["round_robin", "cache_aware"]):
        started = router(policy)
        row = so.run_once([started.url], urls, "chat", 10 + seed, CHAT, clients=2, num_requests=24,
                          router_metrics=started.metrics_url)
        assert row["errors"] == 0 and row["requests"] == 24, row
        rates[policy] = row["hit_rate"]
    # round_robin finds a conversation's earlier turns on the replica it sends a turn to about half
    # the time; cache_aware sends every turn where the conversation is
    assert rates["cache_aware"] > rates["round_robin"] + 0.1, rates


def test_a_conversation_sends_each_turn_with_the_answers_before_it(monkeypatch):
    """scaleout_load.converse: turn n's prompt is turn n-1's prompt, its answer and the new user turn."""
    import asyncio

    sent = []

    async def fake_request(client, url, prompt, max_tokens, keep_text=False):
        sent.append(prompt)
        return {"ttft": 0.01, "e2e": 0.02, "tokens": max_tokens, "text": f" answer{len(sent)}"}

    monkeypatch.setattr(scaleout_load, "one_request", fake_request)
    records = []
    asyncio.run(scaleout_load.converse(None, "http://x", scaleout_load.Conversation("sys", ["a", "b", "c"]), 4,
                                       records))
    assert sent == ["sys\nUser: a\nAssistant:", "sys\nUser: a\nAssistant: answer1\nUser: b\nAssistant:",
                    "sys\nUser: a\nAssistant: answer1\nUser: b\nAssistant: answer2\nUser: c\nAssistant:"]
    assert len(records) == 3 and all("text" not in r for r in records)  # the text is the next prompt's, not kept


def test_direct_runs_deal_the_clients_over_the_replicas_from_one_start(replicas, monkeypatch):
    """The no-router baseline: two client processes, one per replica, both starting at one instant."""
    monkeypatch.setattr(scaleout_load, "SPAWN_S", 3.0)
    urls = [p.url for p in replicas]
    args = argparse.Namespace(**vars(SHARED), client_processes=2)
    row = so.run_once(urls, urls, "nosharing", 7, args, clients=2, num_requests=8)
    assert row["errors"] == 0 and row["requests"] == 8
    assert all(t > 0 for t in row["prompt_tokens"]), row["prompt_tokens"]  # each replica got its share
    assert 0 <= row["start_skew_s"] < 1.0 and row["duration_s"] > 0
    assert 0 < row["client_cpu_util"] <= 1.5, row["client_cpu_util"]  # one process: about a core at most


def test_replica_ttft_p50_interpolates_the_runs_histogram_deltas():
    """The replicas' engine-side TTFT over a run: bucket counts summed over replicas, less what they
    held before the run, p50 interpolated inside the bucket that holds it."""
    def counters(*cumulative):
        return so.ReplicaCounters(0, 0, dict(zip([0.01, 0.02, 0.04, float("inf")], cumulative)))

    before = [counters(5, 5, 5, 5), counters(0, 0, 0, 0)]
    after = [counters(7, 8, 15, 15), counters(2, 3, 10, 10)]  # this run: 4 <= 10 ms, 2 more <= 20, 14 more <= 40
    assert so.replica_ttft_p50_ms(before, after) == pytest.approx(20 + 20 * 4 / 14)
    assert so.replica_ttft_p50_ms(after, after) is None  # no request in the run


# Last in this file: it kills one of the module's replicas (rather than starting two more of its own).
def test_a_killed_replica_is_taken_out_and_its_requests_retried(replicas, tmp_path):
    procs = replicas
    router = so.start_router([p.url for p in procs], "round_robin", tmp_path / "router.log")
    body = {"model": "model", "prompt": "The quick brown", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    try:
        with ThreadPoolExecutor(8) as pool:
            first = [pool.submit(httpx.post, router.url + "/v1/completions", json=body, timeout=120) for _ in range(8)]
            procs[1].proc.send_signal(signal.SIGKILL)  # while both replicas hold requests
            statuses = [f.result().status_code for f in first]
            after = list(pool.map(lambda _: httpx.post(router.url + "/v1/completions", json=body, timeout=120).status_code,
                                  range(16)))
        assert statuses == [200] * 8, f"requests on the killed replica were not retried: {statuses}"
        assert after == [200] * 16
    finally:
        router.stop(10)
