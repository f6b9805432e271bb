"""The OpenAI-compatible API through a real uvicorn server on loopback, driven by the official
`openai` client: completions, streaming, n > 1, logprobs, echo, prompt lists, errors, models."""

import json
import time

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families



@pytest.fixture(scope="module")
def server(plain_server):
    return plain_server  # tests/conftest.py


NO_EOS = {"ignore_eos": True}  # flashpage extension: random weights may sample EOS early


def test_models(client, model, tiny_ckpt):
    models = client.models.list().data
    assert [m.id for m in models] == [str(tiny_ckpt)] and models[0].object == "model"
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_greedy_completion_equals_generate(server, client, model):
    raw = client.completions.with_raw_response.create(model=model, prompt="The quick brown", max_tokens=9,
                                                      temperature=0, extra_body=NO_EOS)
    c = raw.parse()
    native = httpx.post(server + "/generate", json={"prompt": "The quick brown", "max_tokens": 9, "temperature": 0,
                                                    "ignore_eos": True}, timeout=60).json()
    assert c.object == "text_completion" and c.model == model
    assert c.id == "cmpl-" + raw.headers["x-request-id"]
    assert len(c.choices) == 1 and c.choices[0].index == 0 and c.choices[0].logprobs is None
    assert c.choices[0].text == native["text"] and c.choices[0].finish_reason == "length"
    assert c.usage.completion_tokens == 9 and c.usage.prompt_tokens == native["usage"]["prompt_tokens"]
    assert c.usage.total_tokens == c.usage.prompt_tokens + 9


def test_stream_matches_non_stream(client, model):
    kw = dict(model=model, prompt="Return a new list", max_tokens=10, temperature=0, extra_body=NO_EOS)
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    usage, pieces = chunks[-1], chunks[:-1]
    assert usage.choices == [] and usage.usage.completion_tokens == 10
    assert usage.usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(ch.object == "text_completion" and ch.usage is None and len(ch.choices) == 1 for ch in pieces)
    assert "".join(ch.choices[0].text for ch in pieces) == whole.choices[0].text
    assert [ch.choices[0].finish_reason for ch in pieces] == [None] * (len(pieces) - 1) + ["length"]
    assert len({ch.id for ch in chunks}) == 1
    plain = list(client.completions.create(**kw, stream=True))  # without include_usage: no usage chunk
    assert all(ch.choices for ch in plain) and "".join(ch.choices[0].text for ch in plain) == whole.choices[0].text


def test_n_choices_seeded_reproducible(client, model):
    kw = dict(model=model, prompt="The quick", max_tokens=8, temperature=1.0, seed=123, extra_body=NO_EOS)
    a = client.completions.create(**kw, n=3)
    b = client.completions.create(**kw, n=3)
    texts = [ch.text for ch in a.choices]
    assert [ch.index for ch in a.choices] == [0, 1, 2]
    assert texts == [ch.text for ch in b.choices]
    assert len(set(texts)) > 1  # each choice has its own seed
    assert a.usage.completion_tokens == 24 and a.usage.prompt_tokens == b.usage.prompt_tokens
    # choice j used seed + j
    assert client.completions.create(**{**kw, "seed": 124}).choices[0].text == texts[1]
    streamed = {}
    for ch in client.completions.create(**kw, n=3, stream=True):
        for c in ch.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert [streamed[i] for i in range(3)] == texts


def test_list_of_prompts(client, model):
    prompts = ["The quick", "Return a new list"]
    kw = dict(model=model, max_tokens=6, temperature=0, extra_body=NO_EOS)
    alone = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]
    both = client.completions.create(prompt=prompts, **kw)
    assert [c.index for c in both.choices] == [0, 1] and [c.text for c in both.choices] == alone
    ids = [[5, 6, 7], [40, 41]]
    tok = client.completions.create(prompt=ids, n=2, **kw)
    assert [c.index for c in tok.choices] == [0, 1, 2, 3] and tok.usage.prompt_tokens == 5
    assert tok.choices[0].text == tok.choices[1].text  # greedy: a prompt's n choices agree
    assert tok.choices[2].text == client.completions.create(prompt=ids[1], **kw).choices[0].text


def test_logprobs_are_the_models(server, client, model, tiny_ckpt):
    from transformers import GPT2LMHeadModel

    prompt = [5, 17, 99, 3, 250]
    c = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, logprobs=3,
                                  extra_body=NO_EOS)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert all(v <= 0 for v in lp.token_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 4 and all(v <= 0 for v in top.values())
        assert max(top.values()) == pytest.approx(chosen, abs=1e-6)  # greedy: the top-1 is the chosen token
    # Values equal log_softmax of the model over the same tokens.
    ids = httpx.post(server + "/generate", json={"prompt_token_ids": prompt, "max_tokens": 6, "temperature": 0,
                                                 "ignore_eos": True}, timeout=60).json()["token_ids"]
    hf = GPT2LMHeadModel.from_pretrained(tiny_ckpt).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + ids[:-1]])).logits[0, len(prompt) - 1:]
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert ref.argmax(-1).tolist() == ids
    assert lp.token_logprobs == pytest.approx(ref.max(-1).values.tolist(), abs=1e-4)
    for row, top in zip(ref, lp.top_logprobs):
        assert sorted(top.values(), reverse=True) == pytest.approx(row.topk(len(top)).values.tolist(), abs=1e-4)
    # logprobs=0: only the chosen token's
    zero = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0, logprobs=0,
                                     extra_body=NO_EOS).choices[0].logprobs
    assert all(len(t) == 1 for t in zero.top_logprobs)


def test_stop_strings(client, model):
    kw = dict(model=model, prompt="The quick brown", max_tokens=12, temperature=0, extra_body=NO_EOS)
    text = client.completions.create(**kw).choices[0].text
    stop = text[4:6]
    assert len(stop) == 2
    c = client.completions.create(**{**kw, "stop": [stop, "never-there"]}).choices[0]
    assert c.finish_reason == "stop" and c.text == text[:text.find(stop)]
    streamed = list(client.completions.create(**{**kw, "stop": stop}, stream=True))
    assert "".join(ch.choices[0].text for ch in streamed) == c.text and streamed[-1].choices[0].finish_reason == "stop"


def test_echo(client, model):
    kw = dict(model=model, prompt="The quick brown", max_tokens=4, temperature=0, extra_body=NO_EOS)
    plain = client.completions.create(**kw).choices[0].text
    echo = client.completions.create(**kw, echo=True, logprobs=1).choices[0]
    assert echo.text == "The quick brown" + plain
    n_prompt = client.completions.create(**kw).usage.prompt_tokens
    lp = echo.logprobs
    assert len(lp.tokens) == n_prompt + 4 and "".join(lp.tokens[:n_prompt]) == "The quick brown"
    # The prompt's tokens are scored in the prefill pass: the first has none, the rest real values.
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:n_prompt]) and all(len(t) >= 1 for t in lp.top_logprobs[1:n_prompt])
    assert lp.text_offset[0] == 0 and lp.text_offset[n_prompt] == len("The quick brown")
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(**kw, echo=True, stream=True))
    assert streamed == echo.text


def _engine_finished(url: str) -> float:
    """Requests the engine has finished, every reason (its /metrics counter)."""
    return sum(s.value for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text)
               for s in fam.samples if s.name == "flashpage_requests_finished_total")


def test_a_streamed_echo_of_line_separators_reads_back_through_iter_lines(server, model):
    """U+2028, U+2029 and U+0085 in a stream's text (here the echoed prompt's) reach a client that
    splits lines as str.splitlines does (httpx's iter_lines) inside whole events."""
    prompt = "a\u2028b\u2029c\x85d"
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "echo": True, "stream": True, **NO_EOS}
    with httpx.stream("POST", server + "/v1/completions", json=body) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]  # each event's JSON whole
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]).startswith(prompt)


def test_echo_of_nothing_runs_nothing(server, client, model):
    """echo with max_tokens 0 and no logprobs answers with the prompt and costs the engine nothing
    (it once scored every prompt position for no one to read)."""
    before = _engine_finished(server)
    kw = dict(model=model, prompt="The quick brown", max_tokens=0, echo=True)
    whole = client.completions.create(**kw)
    [c] = whole.choices
    assert (c.text, c.logprobs, c.finish_reason) == ("The quick brown", None, "length")
    plain = client.completions.create(model=model, prompt="The quick brown", max_tokens=1, extra_body=NO_EOS)
    assert whole.usage.completion_tokens == 0 and whole.usage.prompt_tokens == plain.usage.prompt_tokens > 0
    streamed = list(client.completions.create(**kw, stream=True))
    assert "".join(ch.choices[0].text for ch in streamed) == c.text and streamed[-1].choices[0].finish_reason == "length"
    client.completions.create(model=model, prompt="x", max_tokens=1)
    # two requests generated: once the counter shows both, it shows any that finished before them
    for _ in range(100):
        if _engine_finished(server) >= before + 2:
            break
        time.sleep(0.05)
    assert _engine_finished(server) == before + 2


@pytest.mark.parametrize("kw,param", [
    ({"max_tokens": 0}, "max_tokens"),  # 0 only with echo
    ({"max_tokens": -1}, "max_tokens"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"logit_bias": {"x": 10}}, "logit_bias"),
    ({"logit_bias": {"99999": 10}}, "logit_bias"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"extra_body": {"min_tokens": 20}, "max_tokens": 5}, "min_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"n": 0}, "n"),
    ({"logprobs": 50}, "logprobs"),
    ({"best_of": 3}, "best_of"),
    ({"suffix": "x"}, "suffix"),
    ({"extra_body": {"prompt": [1, "a"]}}, "prompt"),
    ({"prompt": [1] * 250, "max_tokens": 10}, "prompt"),
    ({"prompt": [1, 99999]}, "prompt"),
    ({"max_tokens": "5"}, "max_tokens"),  # strict JSON types, as /generate
    ({"stop": ["x"] * 17}, "stop"),
])
def test_bad_requests_are_openai_400s(client, model, kw, param):
    kw = {"prompt": "hi", **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, **kw)
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == param and err["type"] == "invalid_request_error"
    assert err["message"] and set(err) == {"message", "type", "param", "code"}


def test_error_details(server, client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt=[1] * 250, max_tokens=10)
    assert e.value.code == "context_length_exceeded" and "256" in e.value.message and "260" in e.value.message
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="hi")
    assert e.value.code == "model_not_found"
    # Harmless parameters at their defaults are accepted.
    ok = client.completions.create(model=model, prompt="hi", max_tokens=2, presence_penalty=0, frequency_penalty=0,
                                   best_of=1, user="alice", logit_bias={})
    assert len(ok.choices) == 1
    r = httpx.post(server + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(server + "/v1/completions", json={"model": model, "prompt": "hi", "stream_options": {}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"
    r = httpx.post(server + "/v1/completions", content=b'{"model": "%s", "prompt": "\\ud800"}' % model.encode(),
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"]
    r = httpx.get(server + "/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    # /generate keeps FastAPI's 422 for bodies that do not validate
    assert httpx.post(server + "/generate", json={"prompt": "hi", "max_tokens": -1}).status_code == 422


def test_request_id_header_on_every_endpoint(server, model):
    calls = [("GET", "/health", None), ("GET", "/metrics", None), ("GET", "/v1/models", None),
             ("GET", "/nope", None), ("POST", "/generate", {"prompt": "hi", "max_tokens": 1}),
             ("POST", "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 1}),
             ("POST", "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 0})]
    for method, path, body in calls:
        r = httpx.request(method, server + path, json=body)
        assert len(r.headers["x-request-id"]) == 32, path
        r = httpx.request(method, server + path, json=body, headers={"X-Request-ID": "client-id-42"})
        assert r.headers["x-request-id"] == "client-id-42", path
    r = httpx.post(server + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 1},
                   headers={"X-Request-ID": "abc"})
    assert r.json()["id"] == "cmpl-abc"
    with httpx.stream("POST", server + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2,
                                                                "stream": True}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert r.headers["content-type"].startswith("text/event-stream") and r.headers["x-request-id"]
    assert events[-1] == "[DONE]" and json.loads(events[0])["id"] == "cmpl-" + r.headers["x-request-id"]


def test_a_spec_refusal_names_the_field_the_spec_came_in():
    """structured_param: the field a 400 about a body's structured-output spec names, on either side
    (the API process's compile or the grammar process's deadline)."""
    from types import SimpleNamespace as Body

    from server.api.openai_protocol import structured_param

    tool = [{"type": "function", "function": {"name": "f"}}]
    assert structured_param(Body(tools=tool, tool_choice="auto", structured_outputs=None)) == "tools"
    assert structured_param(Body(tools=tool, tool_choice="none", structured_outputs=None)) == "response_format"
    assert structured_param(Body(tools=None, structured_outputs={"regex": "a"})) == "structured_outputs"
    assert structured_param(Body(response_format={"type": "json_object"})) == "response_format"
