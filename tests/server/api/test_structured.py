"""Structured outputs, sampling controls and prompt scores over HTTP, through the official `openai`
client and /generate, on the embedded model: 20 JSON schemas whose outputs parse and validate
(`jsonschema`), regular expressions, choices and EBNF grammars that match, invalid specs that are
400s saying what is wrong, and the penalties, logit_bias, min_tokens and prompt_logprobs fields on
every route."""

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest

from transformers import AutoTokenizer

from benchmarks.shared.common import ServerProcess
from models import EMBEDDED_MODEL
from server.api.openai_serving import BUILD_ON_LOOP
from server.engine.outputs import PromptLogprobs
from tests.helpers import app_client
from tests.server.api.structured_schemas import SCHEMAS

MSGS = [{"role": "user", "content": "Give me the data as JSON."}]


@pytest.fixture(scope="module")
def server():
    # the embedded model's own chat template (models/embedded/chat_template.jinja): no flag needed
    srv = ServerProcess.python_server(["--num-blocks", "256", "--max-model-len", "512"]).wait_healthy(120)
    yield srv.url
    srv.stop(30, must_exit=True)


def test_twenty_json_schemas_parse_and_validate(client, model):
    def ask(job):
        route, schema = job
        fmt = {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}
        if route == "chat":
            c = client.chat.completions.create(model=model, messages=MSGS, max_tokens=120, temperature=0,
                                               response_format=fmt).choices[0]
            return c.message.content, c.finish_reason
        c = client.completions.create(model=model, prompt="JSON:", max_tokens=120, temperature=0,
                                      extra_body={"response_format": fmt}).choices[0]
        return c.text, c.finish_reason

    jobs = [("chat" if i % 2 else "completions", schema) for i, schema in enumerate(SCHEMAS)]
    with ThreadPoolExecutor(len(jobs)) as pool:  # together: constrained rows share batches
        results = list(pool.map(ask, jobs))
    for (route, schema), (text, finish) in zip(jobs, results):
        assert finish == "stop", (route, text)  # the grammar ended it, not max_tokens
        jsonschema.validate(json.loads(text), schema)


def test_sampled_json_and_json_object_mode_streamed(client, model):
    schema = {"type": "json_schema", "json_schema": {"name": "out", "schema": SCHEMAS[0]}}
    c = client.chat.completions.create(model=model, messages=MSGS, max_tokens=120, temperature=1.0, seed=0,
                                       response_format=schema, n=4).choices
    for choice in c:  # sampling draws from the grammar's tokens only
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[0])
    # JSON-object mode (no schema: strings are unbounded, so greedy, where this model closes them)
    kw = dict(model=model, messages=MSGS, max_tokens=150, response_format={"type": "json_object"})
    whole = client.chat.completions.create(**kw, temperature=0).choices[0].message.content
    streamed = "".join(ch.choices[0].delta.content or "" for ch in
                       client.chat.completions.create(**kw, temperature=0, stream=True) if ch.choices)
    assert streamed == whole and isinstance(json.loads(whole), dict)


@pytest.mark.parametrize("spec,check", [
    ({"regex": r"[A-Z][a-z]{2,5} [0-9]{3}"}, lambda t: re.fullmatch(r"[A-Z][a-z]{2,5} [0-9]{3}", t)),
    ({"choice": ["alpha", "beta", "gamma delta"]}, lambda t: t in ("alpha", "beta", "gamma delta")),
    ({"grammar": 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9]'}, lambda t: re.fullmatch(r"\([1-9](\+[1-9])*\)", t)),
    ({"json": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 5}},
               "required": ["n"]}}, lambda t: 1 <= json.loads(t)["n"] <= 5),
    ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
])
def test_structured_outputs_on_completions(client, model, spec, check):
    # JSON-object mode's strings are unbounded: sampled, this model may not close one within
    # max_tokens (as in the test above), so that mode runs greedy only
    for temperature in (0,) if "json_object" in spec else (0, 1.0):
        c = client.completions.create(model=model, prompt="The value is ", max_tokens=100, temperature=temperature,
                                      seed=1, extra_body={"structured_outputs": spec}).choices[0]
        assert check(c.text), c.text
        assert c.finish_reason == "stop"


def test_generate_in_both_shapes(server):
    ours = httpx.post(server + "/generate", json={"prompt": "Pick:", "max_tokens": 20, "temperature": 0,
                                                  "structured_outputs": {"choice": ["left", "right"]}},
                      timeout=60).json()  # each new spec compiles in a compile process first: seconds on a busy host
    assert ours["text"] in ("left", "right") and ours["finish_reason"] == "stop"
    for field, spec, pattern in [("regex", "[0-9]{4}", r"[0-9]{4}"), ("ebnf", 'root ::= "x" [a-c] "y"', r"x[a-c]y"),
                                 ("json_schema", json.dumps(SCHEMAS[2]), r'\{"color": "(red|green|blue)"\}')]:
        sg = httpx.post(server + "/generate", json={"text": "Go:", "sampling_params": {
            "max_new_tokens": 40, "temperature": 0, field: spec}}, timeout=60).json()
        assert re.fullmatch(pattern, sg["text"]), (field, sg)


@pytest.mark.parametrize("body,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
     'Unsupported type "objec"'),
    ({"structured_outputs": {"regex": "[a-"}}, "invalid regular expression"),
    ({"structured_outputs": {"grammar": 'root ::= "a" |'}}, "invalid EBNF grammar"),
    ({"structured_outputs": {"json": "{not json"}}, "not JSON"),
    ({"structured_outputs": {}}, "exactly one of"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one of"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "one kind"),
    ({"response_format": {"type": "xml"}}, "response_format"),
])
def test_invalid_specs_are_400s_saying_what_is_wrong(server, model, body, words):
    for route, base in [("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": MSGS})]:
        r = httpx.post(server + route, json={"model": model, "max_tokens": 5, **base, **body})
        assert r.status_code == 400, (route, r.text)
        assert words in r.json()["error"]["message"], r.text


def test_generate_refuses_invalid_specs(server):
    r = httpx.post(server + "/generate", json={"prompt": "hi", "structured_outputs": {"regex": "(a"}})
    assert r.status_code == 400 and "invalid regular expression" in r.json()["error"]["message"]
    r = httpx.post(server + "/generate", json={"text": "hi", "sampling_params": {"json_schema": "[1, 2"}})
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
    r = httpx.post(server + "/generate", json={"text": "hi", "sampling_params": {"regex": "a", "ebnf": "root ::= \"a\""}})
    assert r.status_code == 400 and "one kind" in r.json()["error"]["message"]


def test_penalties_logit_bias_and_min_tokens_over_http(server, client, model):
    kw = dict(model=model, prompt="def f(x):\n    return", max_tokens=16, temperature=0)
    plain = client.completions.create(**kw).choices[0].text
    penalized = {}
    for name, extra in [("presence_penalty", {"presence_penalty": 2.0}), ("frequency_penalty", {"frequency_penalty": 1.5}),
                        ("repetition_penalty", {"extra_body": {"repetition_penalty": 2.0}})]:
        penalized[name] = client.completions.create(**kw, **extra).choices[0].text
        assert penalized[name] != plain, extra
    forced = client.completions.create(**{**kw, "max_tokens": 4}, logit_bias={"261": 100}, logprobs=0).choices[0]
    assert len(forced.logprobs.tokens) == 4 and len(set(forced.logprobs.tokens)) == 1
    chat = client.chat.completions.create(model=model, messages=MSGS, max_tokens=4, temperature=0,
                                          logit_bias={"261": 100}, logprobs=True)
    assert [t.token for t in chat.choices[0].logprobs.content] == [forced.logprobs.tokens[0]] * 4
    # EOS made the likeliest token: min_tokens holds it back (OpenAI's logit_bias keys are strings).
    eos = AutoTokenizer.from_pretrained(EMBEDDED_MODEL).eos_token_id
    short = client.completions.create(**kw, logit_bias={str(eos): 30}).choices[0]
    held = client.completions.create(**kw, logit_bias={str(eos): 30}, extra_body={"min_tokens": 5})
    assert short.finish_reason == "stop" and held.choices[0].finish_reason == "stop"
    assert held.usage.completion_tokens == 6  # five held back, then the EOS
    g = httpx.post(server + "/generate", json={"prompt": "def f(x):\n    return", "max_tokens": 16, "temperature": 0,
                                               "frequency_penalty": 1.5}).json()
    assert g["text"] == penalized["frequency_penalty"]
    sg = httpx.post(server + "/generate", json={"text": "def f(x):\n    return", "sampling_params": {
        "max_new_tokens": 16, "temperature": 0, "frequency_penalty": 1.5}}).json()
    assert sg["text"] == g["text"]


def test_prompt_logprobs_on_generate_equal_echo(server, client, model):
    prompt = "The quick brown fox jumps over the lazy dog"
    echo = client.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=2).choices[0]
    assert echo.text == prompt and echo.finish_reason == "length"
    streamed = [ch.choices[0] for ch in client.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True,
                                                                  logprobs=2, stream=True)]
    assert "".join(c.text for c in streamed) == prompt and streamed[-1].finish_reason == "length"
    assert [v for c in streamed if c.logprobs for v in c.logprobs.token_logprobs] == echo.logprobs.token_logprobs
    g = httpx.post(server + "/generate", json={"prompt": prompt, "max_tokens": 0, "prompt_logprobs": 2}).json()
    assert g["token_ids"] == [] and g["prompt_logprobs"][0] is None
    scores = [entry[0][1] for entry in g["prompt_logprobs"][1:]]
    assert scores == pytest.approx(echo.logprobs.token_logprobs[1:], abs=1e-6)
    assert all(len(entry) == 3 for entry in g["prompt_logprobs"][1:])  # the token, then 2 alternatives
    events = [json.loads(line[6:]) for line in httpx.post(
        server + "/generate", json={"prompt": prompt, "max_tokens": 2, "prompt_logprobs": 0, "stream": True}
    ).text.splitlines() if line.startswith("data: {")]
    assert [e[0][1] for e in events[0]["prompt_logprobs"][1:]] == pytest.approx(scores, abs=1e-6)
    assert all("prompt_logprobs" not in e for e in events[1:])
    r = httpx.post(server + "/generate", json={"prompt": prompt, "max_tokens": 0})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]


def test_large_prompt_scores_are_expanded_off_the_event_loop(tiny_ckpt, monkeypatch):
    """The engine hands prompt scores over packed (server/engine/outputs.py PromptLogprobs); the
    API process expands a large one (past BUILD_ON_LOOP pairs) on a thread of its own, whole or
    streamed, on /generate and on /v1/completions' echo (issue 44), and a small one in place.
    In-process (server/api/app.py on a thread engine), where the threads can be seen."""
    where = []
    expand = PromptLogprobs.entries
    monkeypatch.setattr(PromptLogprobs, "entries", lambda self, *a: where.append(
        threading.current_thread().name.startswith("flashpage-answer")) or expand(self, *a))
    prompt = [5 + i % 300 for i in range(250)]  # 249 scored x 21 = 5,229 pairs: past BUILD_ON_LOOP
    assert 249 * 21 > BUILD_ON_LOOP
    with app_client(["--model", str(tiny_ckpt), "--device", "cpu", "--num-blocks", "64"]) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        asks = [("/generate", {"prompt_token_ids": prompt, "max_tokens": 1, "prompt_logprobs": 20}),
                ("/generate", {"prompt_token_ids": prompt, "max_tokens": 1, "prompt_logprobs": 20, "stream": True}),
                ("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 20}),
                ("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 20,
                                     "stream": True}),
                ("/generate", {"prompt_token_ids": prompt[:20], "max_tokens": 1, "prompt_logprobs": 2})]
        for path, body in asks:
            r = c.post(path, json=body)
            assert r.status_code == 200, r.text[:300]
            whole = r.json() if not body.get("stream") else json.loads(r.text.split("\n\n")[0].removeprefix("data: "))
            if path == "/generate":
                assert whole["prompt_logprobs"][0] is None and len(whole["prompt_logprobs"]) == len(body["prompt_token_ids"])
                assert all(len(e) == 1 + body["prompt_logprobs"] for e in whole["prompt_logprobs"][1:])
            else:
                assert len(whole["choices"][0]["logprobs"]["token_logprobs"]) >= len(prompt)
    assert where == [True, True, True, True, False]
