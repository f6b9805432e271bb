"""GET /metrics (Prometheus text) moving as requests are served, and the logs: JSON lines with
request ids, start-up progress, the periodic engine summary."""

import json
import logging
import time

import httpx
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.shared.common import ServerProcess
from server.config import EngineConfig
from server.engine import LLMEngine
from server.logs import JsonFormatter, RequestIdFilter, TextFormatter, request_id_var
from server.api.metrics import EngineStats
from server.bridge.engine_loop import SNAPSHOT_EVERY_S
from server.sampling_params import SamplingParams


@pytest.fixture(scope="module", params=[1, 2], ids=["api1", "api2"])
def served(request, tiny_ckpt):
    # With 2 API processes (server/api/servers.py) every scrape may reach a different process: each
    # must report the whole server's series, counted once.
    srv = ServerProcess.python_server(["--model", str(tiny_ckpt), "--num-blocks", "64", "--log-level", "info",
                                       "--log-format", "json", "--log-stats-interval", "0.05",
                                       "--api-server-count", str(request.param)]).wait_healthy(120)
    yield srv.url, srv.lines
    srv.stop(30, must_exit=True)


def parse(text: str) -> dict:
    """{(sample name, frozenset(labels without model)): value}, checking every sample names the model."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("flashpage_") and "le" not in s.labels:  # buckets are not needed here
                assert "model" in s.labels, s
                out[(s.name, frozenset((k, v) for k, v in s.labels.items() if k != "model"))] = s.value
    return out


def scrape(url: str) -> dict:
    r = httpx.get(url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return parse(r.text)


def m(metrics: dict, name: str, **labels) -> float:
    return metrics[(name, frozenset(labels.items()))]


def complete(url: str, model: str, **kw) -> dict:
    body = {"model": model, "temperature": 0, "ignore_eos": True, **kw}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_counters_and_histograms_move(served, tiny_ckpt):
    url, _ = served
    model = str(tiny_ckpt)
    before = scrape(url)
    outs = [complete(url, model, prompt="The quick brown", max_tokens=5),
            complete(url, model, prompt=[5, 6, 7, 8], max_tokens=3, n=2),
            complete(url, model, prompt="Return a new list", max_tokens=4, stream=False)]
    native = httpx.post(url + "/generate", json={"prompt": "hi", "max_tokens": 2, "ignore_eos": True}).json()
    sequences = 5  # 1 + 2 + 1 completions and one /generate
    recorded = ("flashpage_time_to_first_token_seconds", "flashpage_e2e_request_latency_seconds",
                "flashpage_time_per_output_token_seconds")
    # With several API processes the engine's recorded events reach one of them, which replays them
    # when its loop reads them: a response may arrive first (seen once under a loaded CI machine).
    deadline = time.monotonic() + 5.0
    while True:
        after = scrape(url)
        counts = [m(after, h + "_count") - m(before, h + "_count") for h in recorded]
        if all(c >= sequences for c in counts) or time.monotonic() > deadline:
            break
        time.sleep(0.05)

    def delta(name, **labels):
        return m(after, name, **labels) - m(before, name, **labels)

    gen = sum(o["usage"]["completion_tokens"] for o in outs) + native["usage"]["completion_tokens"]
    prompt = sum(o["usage"]["prompt_tokens"] for o in outs) + native["usage"]["prompt_tokens"]
    prompt += 4  # the n=2 request runs its prompt twice in the engine (two sequences)
    assert gen == 5 + 6 + 4 + 2
    assert delta("flashpage_generation_tokens_total") == gen
    assert delta("flashpage_prompt_tokens_total") == prompt
    for h in recorded:
        assert delta(h + "_count") == sequences, h
        assert delta(h + "_sum") > 0
    assert delta("flashpage_requests_finished_total", finish_reason="length") == sequences
    assert delta("flashpage_batch_tokens_count") == delta("flashpage_batch_sequences_count") >= 5
    assert delta("flashpage_batch_tokens_sum") >= prompt + gen - sequences  # every token went through a step
    # Idle again: nothing running, no KV blocks held.
    assert m(after, "flashpage_requests_running") == 0 and m(after, "flashpage_requests_waiting") == 0
    assert m(after, "flashpage_kv_cache_usage_ratio") == 0 and m(after, "flashpage_kv_cache_blocks_used") == 0
    assert m(after, "flashpage_kv_cache_blocks_total") == 64
    assert m(after, "flashpage_preemptions_total") == 0


def test_prefix_cache_hits(served, tiny_ckpt):
    url, _ = served
    before = scrape(url)
    prompt = list(range(10, 50))  # 40 tokens: two full 16-token blocks can be shared
    complete(url, str(tiny_ckpt), prompt=prompt, max_tokens=2)
    complete(url, str(tiny_ckpt), prompt=prompt, max_tokens=2)
    after = scrape(url)
    hits = m(after, "flashpage_prefix_cache_hits_total") - m(before, "flashpage_prefix_cache_hits_total")
    queries = m(after, "flashpage_prefix_cache_queries_total") - m(before, "flashpage_prefix_cache_queries_total")
    assert hits == 2 and queries == 3  # the first lookup misses and stops; the second finds both blocks
    assert 0 < m(after, "flashpage_prefix_cache_hit_rate") <= 1


def test_running_gauge_and_abort_frees_cache(served, tiny_ckpt):
    url, _ = served
    body = {"model": str(tiny_ckpt), "prompt": "The quick", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        it = r.iter_lines()
        next(line for line in it if line.startswith("data: "))
        # With several API processes the scrape may reach one that is not streaming this request:
        # its gauges are the engine's snapshot of at most SNAPSHOT_EVERY_S ago, so wait for one.
        deadline = time.monotonic() + 1.0
        while True:
            during = scrape(url)
            if m(during, "flashpage_requests_running") == 1 or time.monotonic() > deadline:
                break
            time.sleep(SNAPSHOT_EVERY_S / 2)
        assert m(during, "flashpage_requests_running") == 1 and m(during, "flashpage_kv_cache_blocks_used") >= 1
        assert 0 < m(during, "flashpage_kv_cache_usage_ratio") < 1
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # the client went away: the request is aborted, its blocks freed
        now = scrape(url)
        if m(now, "flashpage_requests_running") == 0 and m(now, "flashpage_kv_cache_blocks_used") == 0:
            break
        time.sleep(0.1)
    else:
        pytest.fail("aborted stream still holds KV blocks")


def test_json_logs(served, tiny_ckpt):
    url, lines = served
    r = httpx.post(url + "/v1/completions", headers={"X-Request-ID": "log-test-1"},
                   json={"model": str(tiny_ckpt), "prompt": "The quick", "max_tokens": 150, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200
    time.sleep(0.3)
    records = [json.loads(line) for line in list(lines) if line.strip()]  # every line is one JSON object
    assert all({"ts", "level", "logger", "message"} <= set(rec) for rec in records)
    messages = " | ".join(rec["message"] for rec in records)
    assert "loading weights" in messages and "KV cache" in messages and "engine ready" in messages
    mine = [rec for rec in records if rec.get("request_id") == "log-test-1"]
    assert any(rec["logger"] == "flashpage.http" and "POST /v1/completions 200" in rec["message"] for rec in mine)
    assert any(rec["logger"] == "flashpage.openai" for rec in mine)
    summaries = [rec for rec in records if rec["logger"] == "flashpage.stats"]
    assert summaries, "no periodic engine summary while busy"
    s = summaries[-1]
    assert "tok/s" in s["message"] and "KV cache" in s["message"]
    assert {"prompt_tokens_per_s", "generation_tokens_per_s", "running", "waiting", "kv_cache_usage",
            "prefix_cache_hit_rate"} <= set(s["stats"])


def test_formatters_carry_request_id():
    rec = logging.LogRecord("flashpage.test", logging.INFO, __file__, 1, "hello %s", ("there",), None)
    token = request_id_var.set("rid-7")
    try:
        RequestIdFilter().filter(rec)
    finally:
        request_id_var.reset(token)
    assert "[rid-7]: hello there" in TextFormatter().format(rec)
    out = json.loads(JsonFormatter().format(rec))
    assert out["request_id"] == "rid-7" and out["message"] == "hello there" and out["level"] == "INFO"
    extra = logging.LogRecord("x", logging.INFO, __file__, 1, "m", None, None)
    extra.request_id, extra.stats = "r2", {"a": 1}  # what logging's extra= does
    RequestIdFilter().filter(extra)
    assert json.loads(JsonFormatter().format(extra))["request_id"] == "r2"
    assert json.loads(JsonFormatter().format(extra))["stats"] == {"a": 1}


def test_preemptions_and_registries_per_engine(tiny_ckpt):
    def engine(num_blocks):
        return LLMEngine(EngineConfig(model=str(tiny_ckpt), device="cpu", attention="eager", num_blocks=num_blocks,
                                      enable_prefix_caching=False, log_stats_interval=0))

    small, big = engine(12), engine(128)
    stats = [EngineStats(small), EngineStats(big)]  # two registries in one process must not collide
    small.stats, big.stats = stats
    prompts = [[(7 * i + j) % 400 + 1 for j in range(20 + 5 * i)] for i in range(6)]
    small.generate(prompts, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    assert small.scheduler.num_preemptions > 0
    got = parse(generate_latest(stats[0].registry).decode())
    assert m(got, "flashpage_preemptions_total") == small.scheduler.num_preemptions
    assert m(got, "flashpage_generation_tokens_total") == 6 * 30
    assert m(got, "flashpage_time_to_first_token_seconds_count") == 6  # once per request, preempted or not
    assert m(got, "flashpage_kv_cache_blocks_used") == 0
    other = parse(generate_latest(stats[1].registry).decode())
    assert m(other, "flashpage_generation_tokens_total") == 0 and m(other, "flashpage_kv_cache_blocks_total") == 128
