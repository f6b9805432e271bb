"""What routers and gateways need of a replica. Unknown request fields (--unknown-fields,
server/api/fields.py): by default ignored with one warning per distinct set, so the bodies routers
forward (vllm-router adds `no_stop_trim` to /v1/completions, `return_logprob` and
`return_hidden_states` to /generate) are served as if the fields were absent; with `reject`,
refused as before (422 on /generate, OpenAI's 400 on /v1). Fields we know are validated the same
way in both modes. And the gauges the Gateway API Inference Extension reads. Real servers on
loopback."""

import signal
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.shared.common import ServerProcess

ROUTER_GENERATE = {"return_logprob": False, "return_hidden_states": False}  # what vllm-router adds
ROUTER_COMPLETIONS = {"no_stop_trim": False}
GEN = {"prompt": "The quick brown", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
CMPL = {"model": "gpt2", "prompt": "The quick brown", "max_tokens": 6, "temperature": 0}
CHAT = {"model": "gpt2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def servers(tiny_ckpt, tmp_path_factory):
    """{mode: server}: the default (ignore) and --unknown-fields reject, started together. The
    chat template lets /v1/chat/completions answer for the GPT-2 checkpoint."""
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    base = ["--model", str(tiny_ckpt), "--num-blocks", "64", "--served-model-name", "gpt2",
            "--chat-template", str(template)]
    # The ignore server's steps sleep 20 ms (the test-only fault injector): a tiny model would
    # otherwise finish a request before a /metrics scrape could see it running.
    started = {"ignore": ServerProcess.python_server(base, extra_env={"FLASHPAGE_FAULT_INJECT": "sleep=0.02"}),
               "reject": ServerProcess.python_server([*base, "--unknown-fields", "reject"])}
    try:
        yield {mode: srv.wait_healthy(120) for mode, srv in started.items()}
    finally:
        # SIGKILL: their graceful exit is not what this file tests (test_reliability's SIGTERM test is)
        for srv in started.values():
            srv.stop(30, sig=signal.SIGKILL)


def post(srv, path, body):
    return httpx.post(srv.url + path, json=body, timeout=60)


def test_router_fields_are_ignored_and_change_nothing(servers):
    srv = servers["ignore"]
    plain, routed = post(srv, "/generate", GEN), post(srv, "/generate", {**GEN, **ROUTER_GENERATE})
    assert plain.status_code == routed.status_code == 200, routed.text
    assert routed.json()["token_ids"] == plain.json()["token_ids"]
    plain, routed = post(srv, "/v1/completions", CMPL), post(srv, "/v1/completions", {**CMPL, **ROUTER_COMPLETIONS})
    assert plain.status_code == routed.status_code == 200, routed.text
    assert routed.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    with httpx.stream("POST", srv.url + "/v1/completions", json={**CMPL, **ROUTER_COMPLETIONS, "stream": True}) as r:
        assert r.status_code == 200 and "[DONE]" in r.read().decode()
    routed = post(srv, "/v1/chat/completions", {**CHAT, "vendor_extension": {"x": 1}})
    assert routed.status_code == 200, routed.text


def test_each_set_of_ignored_fields_is_logged_once(servers):
    srv = servers["ignore"]
    for _ in range(3):
        assert post(srv, "/generate", {**GEN, "only_here_once": 1}).status_code == 200
    assert post(srv, "/generate", {**GEN, "only_here_once": 1, "and_this": 2}).status_code == 200
    log = srv.log_text()
    assert log.count("ignoring unknown request fields on /generate: only_here_once (") == 1, log[-2000:]
    assert log.count("ignoring unknown request fields on /generate: and_this, only_here_once") == 1


@pytest.mark.parametrize("mode", ["ignore", "reject"])
def test_known_fields_are_validated_in_either_mode(servers, mode):
    srv = servers[mode]
    r = post(srv, "/generate", {**GEN, "temperature": -1, **ROUTER_GENERATE} if mode == "ignore"
             else {**GEN, "temperature": -1})
    assert r.status_code == 422 and "temperature" in r.text
    r = post(srv, "/v1/completions", {**CMPL, "max_tokens": "5"})  # strict types stay strict
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    # nested objects stay strict: a key there changes what the object means
    r = post(srv, "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi", "oops": 1}]})
    assert r.status_code == 400 and "oops" in r.json()["error"]["message"]


def test_reject_mode_refuses_unknown_fields_naming_them(servers):
    srv = servers["reject"]
    r = post(srv, "/generate", {**GEN, **ROUTER_GENERATE})
    assert r.status_code == 422
    assert {tuple(d["loc"]) for d in r.json()["detail"]} == {("body", "return_logprob"), ("body", "return_hidden_states")}
    r = post(srv, "/v1/completions", {**CMPL, **ROUTER_COMPLETIONS})
    assert r.status_code == 400
    assert r.json()["error"] == {"message": "Unrecognized request argument supplied: no_stop_trim",
                                 "type": "invalid_request_error", "param": "no_stop_trim", "code": None}
    r = post(srv, "/v1/chat/completions", {**CHAT, "vendor_extension": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "vendor_extension"
    assert "ignoring unknown request fields" not in srv.log_text()


def test_the_openai_client_sees_either_mode(servers):
    """An extra_body field the server does not know: served by default, an OpenAI 400 naming it
    with --unknown-fields reject (what test_openai.py asked of every unknown field before)."""
    import openai

    kw = dict(model="gpt2", prompt="hi", max_tokens=2, extra_body={"no_such_field": 1})
    ok = openai.OpenAI(base_url=servers["ignore"].url + "/v1", api_key="x").completions.create(**kw)
    assert len(ok.choices) == 1
    with pytest.raises(openai.BadRequestError) as e:
        openai.OpenAI(base_url=servers["reject"].url + "/v1", api_key="x", max_retries=0).completions.create(**kw)
    assert e.value.status_code == 400 and e.value.body["param"] == "no_such_field"


def test_gateway_gauges_alias_ours(servers):
    """The three gauges the Gateway API Inference Extension reads (TotalQueuedRequests,
    TotalRunningRequests, KVCacheUtilization), under vLLM's names and label, equal ours in every
    scrape, and move: polled while a request streams, they show it running."""
    srv = servers["ignore"]
    seen = []
    with httpx.stream("POST", srv.url + "/v1/completions", timeout=60,
                      json={**CMPL, "max_tokens": 100, "ignore_eos": True, "stream": True}) as r:
        lines = r.iter_lines()  # kept: a dropped iterator closes the stream, and the server aborts the request
        next(line for line in lines if line.startswith("data: "))
        for _ in range(40):  # /metrics reads the snapshot that comes with the engine's step messages
            samples = {s.name: s for fam in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text)
                       for s in fam.samples}
            aliases = {"vllm:num_requests_waiting": "flashpage_requests_waiting",
                       "vllm:num_requests_running": "flashpage_requests_running",
                       "vllm:kv_cache_usage_perc": "flashpage_kv_cache_usage_ratio"}
            for alias, ours in aliases.items():
                assert samples[alias].labels == {"model_name": "gpt2"} and samples[ours].labels == {"model": "gpt2"}
                assert samples[alias].value == samples[ours].value, alias
            seen.append((samples["vllm:num_requests_running"].value, samples["vllm:kv_cache_usage_perc"].value))
            if seen[-1][0]:
                break
            time.sleep(0.05)
    assert seen[-1][0] == 1 and seen[-1][1] > 0, f"never seen running: {seen}"
