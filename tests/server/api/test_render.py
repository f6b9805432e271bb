"""POST /v1/completions/render and /v1/chat/completions/render (server/api/render.py), in vLLM's
shape: the token ids and sampling parameters the route would run a body with, equal to what the
route itself runs (its usage.prompt_tokens and greedy output), per prompt; and the route's own
errors. What prefix-aware routers call on every replica for every request
(tests/benchmarks/test_scaleout.py checks that vllm-router's calls are answered).

In-process apps as tests/server/api/test_tokens.py runs them: `chat` (a checkpoint with a chat
template and a tokenizer that adds BOS) and `bare` (no template, --unknown-fields reject).
"""

import pytest
from starlette.testclient import TestClient
from tests.helpers import with_chat_template

from server.api.app import create_app
from server.api.chat_template import render_chat
from server.api.guards import MAX_CHOICES, ServerLimits
from server.bridge.async_engine import AsyncEngine
from server.config import EngineConfig
from server.engine import LLMEngine
from server.sampling_params import SamplingParams

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The quick brown fox"}]
PARAM_KEYS = {f for f in SamplingParams.__slots__} | {"n"}


def _client(path, limits: ServerLimits):
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", attention="eager", num_blocks=16))
    with TestClient(create_app(AsyncEngine(engine), limits)) as client:
        yield client


@pytest.fixture(scope="module")
def chat(tiny_ckpt, tmp_path_factory):
    yield from _client(with_chat_template(tiny_ckpt, tmp_path_factory.mktemp("render") / "ckpt", TEMPLATE),
                       ServerLimits(max_prompt_chars=20_000, max_prompt_tokens=5_000))


@pytest.fixture(scope="module")
def bare(tiny_ckpt):
    yield from _client(tiny_ckpt, ServerLimits(unknown_fields="reject"))


def _model(client) -> str:
    return client.app.state.engine.engine.model_name


def render(client, path: str, **body) -> list[dict]:
    r = client.post(path, json={"model": _model(client), **body})
    assert r.status_code == 200, r.text
    out = r.json()
    assert isinstance(out, list) and out
    for entry in out:
        assert set(entry) == {"request_id", "token_ids", "sampling_params", "model", "stream"}
        assert set(entry["sampling_params"]) == PARAM_KEYS and entry["model"] == _model(client)
    return out


def error(r, status: int, param: str | None) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    return err["message"]


def test_completion_render_is_what_the_route_runs(chat):
    tokenizer = chat.app.state.engine.engine.tokenizer
    body = {"prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    [entry] = render(chat, "/v1/completions/render", **body)
    assert entry["token_ids"] == tokenizer.encode("The quick brown fox") and entry["stream"] is False
    run = chat.post("/v1/completions", json={"model": _model(chat), **body})
    assert run.status_code == 200, run.text
    assert run.json()["usage"]["prompt_tokens"] == len(entry["token_ids"])
    params = entry["sampling_params"]
    assert params["max_tokens"] == 6 and params["temperature"] == 0 and params["ignore_eos"] is True
    assert params["n"] == 1 and params["stop"] == [] and params["structured"] is None
    # the ids run: the route's greedy continuation of the rendered ids is its continuation of the text
    again = chat.post("/v1/completions", json={"model": _model(chat), **body, "prompt": entry["token_ids"]})
    assert again.json()["choices"][0]["text"] == run.json()["choices"][0]["text"]


def test_completion_render_per_prompt_with_the_fields_applied(chat):
    tokenizer = chat.app.state.engine.engine.tokenizer
    prompts = ["The quick brown fox", "jumps over", "the lazy dog"]
    out = render(chat, "/v1/completions/render", prompt=prompts, n=2, seed=7, stop=["\n"], top_k=5,
                 temperature=0.5, logprobs=2, stream=True, presence_penalty=0.5, logit_bias={"3": 200})
    assert [e["token_ids"] for e in out] == [tokenizer.encode(p) for p in prompts]
    assert len({e["request_id"] for e in out}) == 3 and all(e["stream"] for e in out)
    for e in out:  # each prompt's first choice; choice j runs with seed + j
        p = e["sampling_params"]
        assert (p["n"], p["seed"], p["stop"], p["top_k"], p["temperature"], p["logprobs"]) == (2, 7, ["\n"], 5, 0.5, 2)
        assert p["presence_penalty"] == 0.5 and p["logit_bias"] == {"3": 100.0}  # clamped to +-100, as the route
        assert p["max_tokens"] == 16  # the schema's default
    # token-id prompts pass through as given
    assert render(chat, "/v1/completions/render", prompt=[[5, 6, 7], [8]])[1]["token_ids"] == [8]


def test_request_id_follows_the_header(chat):
    r = chat.post("/v1/completions/render", json={"model": _model(chat), "prompt": ["a", "b"]},
                  headers={"X-Request-ID": "route-abc"})
    assert [e["request_id"] for e in r.json()] == ["cmpl-route-abc-0", "cmpl-route-abc-1"]
    assert r.headers["x-request-id"] == "route-abc"


def test_chat_render_is_what_the_chat_route_runs(chat):
    engine = chat.app.state.engine.engine
    _, ids = render_chat(engine.tokenizer, MSGS, None)
    [entry] = render(chat, "/v1/chat/completions/render", messages=MSGS, n=3, max_completion_tokens=4)
    assert entry["token_ids"] == ids and entry["request_id"].startswith("chatcmpl-")
    assert entry["sampling_params"]["max_tokens"] == 4 and entry["sampling_params"]["n"] == 3
    run = chat.post("/v1/chat/completions", json={"model": _model(chat), "messages": MSGS, "max_tokens": 1})
    assert run.json()["usage"]["prompt_tokens"] == len(ids)
    # neither limit: the rest of the context, as the chat route gives
    [entry] = render(chat, "/v1/chat/completions/render", messages=MSGS)
    assert entry["sampling_params"]["max_tokens"] == engine.max_model_len - len(ids)
    # logprobs as the route reads them
    [entry] = render(chat, "/v1/chat/completions/render", messages=MSGS, logprobs=True, top_logprobs=3)
    assert entry["sampling_params"]["logprobs"] == 3


def test_the_routes_errors(chat, bare):
    path = "/v1/completions/render"
    assert "does not exist" in error(chat.post(path, json={"model": "other", "prompt": "a"}), 404, "model")
    too_long = chat.post(path, json={"model": _model(chat), "prompt": "a", "max_tokens": 10_000})
    assert "maximum context length" in error(too_long, 400, "prompt") and too_long.json()["error"]["code"] == \
        "context_length_exceeded"
    many = chat.post(path, json={"model": _model(chat), "prompt": ["a"] * MAX_CHOICES, "n": 2})
    assert "sequences" in error(many, 400, "n")
    assert "only with 'echo'" in error(chat.post(path, json={"model": _model(chat), "prompt": "a", "max_tokens": 0}),
                                       400, "max_tokens")
    assert error(chat.post(path, json={"model": _model(chat), "prompt": 3}), 400, "prompt")  # not a prompt: 400, not 422
    over = chat.post(path, json={"model": _model(chat), "prompt": "a" * 20_001})
    assert "20000" in error(over, 400, "prompt")
    # no chat template: the chat route's 400 naming the flag; unknown fields refused where the server refuses them
    no_template = bare.post("/v1/chat/completions/render", json={"model": _model(bare), "messages": MSGS})
    assert "--chat-template" in error(no_template, 400, "messages")
    assert "vendor_field" in error(bare.post(path, json={"model": _model(bare), "prompt": "a", "vendor_field": 1}),
                                   400, "vendor_field")


def test_render_queues_nothing(chat):
    """Rendered, not run: no request reaches the engine, no block is taken, nothing is generated."""
    before = chat.get("/debug/kv").json()
    render(chat, "/v1/completions/render", prompt=["a"] * 64, max_tokens=1)
    after = chat.get("/debug/kv").json()
    assert after["kv_blocks_free"] == after["kv_blocks_total"] and after["requests_active"] == 0
    assert after["engine_sequences"] == before["engine_sequences"] == 0
    assert after["generated_tokens"] == before["generated_tokens"]
