"""POST /tokenize and POST /detokenize (server/api/tokens.py) in vLLM's shapes: counts and ids as the
tokenizer gives them, add_special_tokens, token strings, chat bodies rendered as
/v1/chat/completions renders them, round trips, and errors in OpenAI's shape (wrong model 404, ids
outside the vocabulary, prompt limits, malformed bodies, unknown fields).

The apps run in-process (the engine on a thread) through Starlette's TestClient: these routes never
reach the engine's steps, so real uvicorn servers would only add start-up time. The checkpoint is
the session's tiny GPT-2 with a chat template and a tokenizer that adds BOS itself (as
tests/server/api/test_chat.py builds it), so adding special tokens or not changes the ids. Two apps:
`chat` (that checkpoint, tight prompt limits) and `bare` (the plain checkpoint: no chat template,
--unknown-fields reject).
"""

import asyncio
import json

import pytest
from starlette.testclient import TestClient
from tests.helpers import with_chat_template

from server.api.app import create_app
from server.api.chat_template import render_chat
from server.api.guards import ServerLimits
from server.api.tokenize import INLINE_CHARS, INLINE_IDS, _memos
from server.bridge.async_engine import AsyncEngine
from server.config import EngineConfig
from server.engine import LLMEngine

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The quick brown fox"}]
TEXT = "The quick brown fox jumps over the lazy dog. naïve café – 東京 🙂\n"
LONG = TEXT * 150  # past INLINE_CHARS and, in ids, past INLINE_IDS: the off-loop paths
LIMITS = ServerLimits(max_prompt_chars=20_000, max_prompt_tokens=5_000)
UNSEEN = "ж"  # not in the tokenizer's training text: two byte tokens per character


@pytest.fixture(scope="module")
def chat_ckpt(tiny_ckpt, tmp_path_factory):
    return with_chat_template(tiny_ckpt, tmp_path_factory.mktemp("tokens-gpt2") / "ckpt", TEMPLATE)


def _client(path, limits: ServerLimits):
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", attention="eager", num_blocks=16))
    with TestClient(create_app(AsyncEngine(engine), limits)) as client:
        yield client


@pytest.fixture(scope="module")
def chat(chat_ckpt):
    yield from _client(chat_ckpt, LIMITS)


@pytest.fixture(scope="module")
def bare(tiny_ckpt):
    yield from _client(tiny_ckpt, ServerLimits(unknown_fields="reject"))


@pytest.fixture(scope="module")
def tokenizer(chat):
    return chat.app.state.engine.engine.tokenizer


def tokenize(client, **body) -> dict:
    r = client.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert set(out) == {"count", "max_model_len", "tokens", "token_strs"} and out["count"] == len(out["tokens"])
    return out


def detokenize(client, tokens: list[int]) -> str:
    r = client.post("/detokenize", json={"tokens": tokens})
    assert r.status_code == 200, r.text
    assert set(r.json()) == {"prompt"}
    return r.json()["prompt"]


def error(r, status: int, param: str | None = None) -> str:
    """The message of an OpenAI-shaped error with this status and param."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    return err["message"]


def test_counts_and_ids_are_the_tokenizers(chat, tokenizer):
    bos = tokenizer.bos_token_id
    for text in ("The quick brown fox", "", LONG):
        plain = tokenizer.encode(text, add_special_tokens=False)
        out = tokenize(chat, prompt=text)  # add_special_tokens defaults to true, as vLLM's
        assert out["tokens"] == tokenizer.encode(text) == [bos] + plain
        assert out["max_model_len"] == 256 and out["token_strs"] is None
        assert tokenize(chat, prompt=text, add_special_tokens=False)["tokens"] == plain
    assert len(tokenizer.encode(LONG)) > INLINE_IDS and len(LONG) > INLINE_CHARS


def test_round_trip(chat, tokenizer):
    for text in (TEXT, LONG):
        assert detokenize(chat, tokenize(chat, prompt=text, add_special_tokens=False)["tokens"]) == text
        # with special tokens the BOS comes back as text, as the tokenizer decodes it
        assert detokenize(chat, tokenize(chat, prompt=text)["tokens"]) == tokenizer.bos_token + text
    assert detokenize(chat, []) == ""


def test_return_token_strs(chat, tokenizer):
    for text in (TEXT, LONG):
        out = tokenize(chat, prompt=text, return_token_strs=True)
        assert out["token_strs"] == tokenizer.convert_ids_to_tokens(out["tokens"])
        assert out["token_strs"][0] == tokenizer.bos_token and "Ġquick" in out["token_strs"]
    assert tokenize(chat, prompt=TEXT, return_token_strs=None)["token_strs"] is None  # vLLM's field is nullable
    chat_out = tokenize(chat, messages=MSGS, return_token_strs=True)
    assert chat_out["token_strs"] == tokenizer.convert_ids_to_tokens(chat_out["tokens"])


def test_chat_body_is_the_chat_routes_prompt(chat, tokenizer):
    _, ids = render_chat(tokenizer, MSGS, None)
    out = tokenize(chat, messages=MSGS, model=str(chat.app.state.engine.engine.model_name))
    assert out["tokens"] == ids and ids[0] == tokenizer.bos_token_id and ids[1] != ids[0]  # one BOS: the template's
    r = chat.post("/v1/chat/completions", json={"model": chat.app.state.engine.engine.model_name, "messages": MSGS,
                                                "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == out["count"]
    # text parts are read as the chat route reads them (joined with newlines)
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tokenize(chat, messages=parts)["tokens"] == render_chat(tokenizer, [{"role": "user", "content": "a\nb"}],
                                                                   None)[1]


def test_chat_flags(chat, tokenizer):
    def rendered(**kw):
        return tokenizer.encode(tokenizer.apply_chat_template(MSGS, tokenize=False, **kw), add_special_tokens=False)

    default = tokenize(chat, messages=MSGS)["tokens"]
    assert tokenize(chat, messages=MSGS, add_special_tokens=True)["tokens"] == [tokenizer.bos_token_id] + default
    bare = tokenize(chat, messages=MSGS, add_generation_prompt=False)["tokens"]
    assert bare == rendered(add_generation_prompt=False) and default[:len(bare)] == bare and len(default) > len(bare)
    cont = tokenize(chat, messages=MSGS, continue_final_message=True)["tokens"]  # no generation prompt then
    assert cont == rendered(add_generation_prompt=False, continue_final_message=True) and cont != bare
    assert tokenizer.decode(cont).endswith(MSGS[-1]["content"])
    r = chat.post("/tokenize", json={"messages": MSGS, "continue_final_message": True, "add_generation_prompt": True})
    assert "cannot both be true" in error(r, 400, "continue_final_message")


def test_without_a_chat_template_the_chat_routes_400(bare):
    r = bare.post("/tokenize", json={"messages": MSGS})
    assert "--chat-template" in error(r, 400, "messages")
    r2 = bare.post("/v1/chat/completions", json={"model": bare.app.state.engine.engine.model_name, "messages": MSGS})
    assert r2.status_code == 400 and r2.json()["error"]["message"] == r.json()["error"]["message"]
    assert tokenize(bare, prompt="hi")["count"] >= 1  # text still tokenizes


def test_wrong_model_is_404(chat):
    name = chat.app.state.engine.engine.model_name
    bodies = (("/tokenize", {"prompt": "hi"}), ("/tokenize", {"messages": MSGS}), ("/detokenize", {"tokens": [1]}))
    for path, body in bodies:
        r = chat.post(path, json={**body, "model": "no-such-model"})
        assert "no-such-model" in error(r, 404, "model") and r.json()["error"]["code"] == "model_not_found"
        assert chat.post(path, json={**body, "model": name}).status_code == 200  # the served name, or none at all
        assert chat.post(path, json=body).status_code == 200


def test_ids_outside_the_vocabulary_are_400(chat, tokenizer):
    vocab = len(tokenizer)
    for bad in (vocab, -1, 2**70):
        msg = error(chat.post("/detokenize", json={"tokens": [1, bad, 2]}), 400, "tokens")
        assert str(bad) in msg and str(vocab) in msg
    assert detokenize(chat, [vocab - 1]) == tokenizer.decode([vocab - 1])


def test_prompt_limits_are_400(chat):
    msg = error(chat.post("/tokenize", json={"prompt": "a" * 20_001}), 400, "prompt")
    assert "--max-prompt-chars" in msg and "20001" in msg
    msg = error(chat.post("/tokenize", json={"prompt": UNSEEN * 2_600}), 400, "prompt")
    assert "--max-prompt-tokens" in msg and "5201" in msg  # 5,200 and the BOS
    assert tokenize(chat, prompt=UNSEEN * 2_500, add_special_tokens=False)["count"] == 5_000  # at the bound
    assert error(chat.post("/tokenize", json={"prompt": UNSEEN * 2_500}), 400, "prompt")  # one past it: the BOS
    msg = error(chat.post("/tokenize", json={"messages": [{"role": "user", "content": "a" * 20_001}]}), 400, "messages")
    assert "--max-prompt-chars" in msg
    msg = error(chat.post("/tokenize", json={"messages": [{"role": "user", "content": UNSEEN * 2_600}]}), 400,
                "messages")
    assert "--max-prompt-tokens" in msg
    assert "--max-prompt-tokens" in error(chat.post("/detokenize", json={"tokens": [1] * 5_001}), 400, "tokens")


@pytest.mark.parametrize("path,body,param,words", [
    ("/tokenize", {}, "prompt", "required"),
    ("/tokenize", {"prompt": 5}, "prompt", "must be a string"),
    ("/tokenize", {"prompt": ["a", "b"]}, "prompt", "must be a string"),
    ("/tokenize", {"prompt": "hi", "add_special_tokens": "yes"}, "add_special_tokens", "boolean"),  # strict
    ("/tokenize", {"prompt": "\ud800"}, "prompt", "surrogate"),
    ("/tokenize", {"messages": []}, "messages", "at least 1"),
    ("/tokenize", {"messages": [{"role": "tool", "content": "x"}]}, "messages", "tool_call_id"),
    ("/tokenize", {"messages": [{"role": "critic", "content": "x"}]}, "messages", "messages.0.role"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages", "messages.0.extra"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages", "'image_url'"),
    ("/tokenize", {"prompt": "hi", "messages": MSGS}, "prompt", "not both"),
    ("/tokenize", [], None, "body"),
    ("/detokenize", {}, "tokens", "required"),
    ("/detokenize", {"tokens": [1.5]}, "tokens", "tokens.0"),
    ("/detokenize", {"tokens": [True]}, "tokens", "tokens.0"),  # strict: true is not 1
    ("/detokenize", {"tokens": "1 2"}, "tokens", "list"),
])
def test_malformed_bodies_are_openai_400s(chat, path, body, param, words):
    # json.dumps escapes the lone surrogate (\ud800), which a client's JSON encoder may refuse to send
    r = chat.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert words in error(r, 400, param)


def test_unparsable_json_and_wrong_method(chat):
    for path in ("/tokenize", "/detokenize"):
        r = chat.post(path, content=b"{bad", headers={"content-type": "application/json"})
        assert "could not parse" in error(r, 400)
        r = chat.get(path)
        assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert chat.post("/generate", json={"prompt": 5}).status_code == 422  # other routes keep their own errors


def test_unknown_fields_follow_the_flag(chat, bare):
    assert tokenize(chat, prompt="hi", vendor_field=1)["count"] == tokenize(chat, prompt="hi")["count"]
    assert detokenize(chat, [1]) == chat.post("/detokenize", json={"tokens": [1], "x": 2}).json()["prompt"]
    assert "vendor_field" in error(bare.post("/tokenize", json={"prompt": "hi", "vendor_field": 1}), 400,
                                   "vendor_field")
    assert "x" in error(bare.post("/detokenize", json={"tokens": [1], "x": 2}), 400, "x")


def test_long_work_runs_off_the_event_loop(chat, monkeypatch):
    ran = []
    to_thread = asyncio.to_thread

    def recording(fn, *args, **kw):
        ran.append(getattr(fn, "__name__", repr(fn)))
        return to_thread(fn, *args, **kw)

    monkeypatch.setattr(asyncio, "to_thread", recording)
    _memos.clear()  # LONG, encoded by an earlier test, would be remembered
    ids = tokenize(chat, prompt=LONG, return_token_strs=True)["tokens"]
    # fastokens encodes LONG inline (~0.3 ms); the tokenizer's own encoder would take a thread for it
    # (tests/server/api/test_tokenize.py)
    assert chat.app.state.tokenizer_backend == "fastokens" and ran == ["convert_ids_to_tokens"]
    detokenize(chat, ids)
    tokenize(chat, messages=MSGS)
    assert ran[1:] == ["decode", "_render"]
    ran.clear()
    detokenize(chat, tokenize(chat, prompt=TEXT, return_token_strs=True)["tokens"])  # short: inline
    assert ran == []


def test_openapi_documents_both_routes(chat):
    paths = chat.get("/openapi.json").json()["paths"]
    assert {"400", "404"} <= set(paths["/tokenize"]["post"]["responses"]) <= {"200", "400", "404", "422"}
    assert "oneOf" in json.dumps(paths["/tokenize"]["post"]["requestBody"])
    assert "/detokenize" in paths
