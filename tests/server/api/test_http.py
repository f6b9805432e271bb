"""POST /generate through a real uvicorn server on loopback (a subprocess, as users start it)."""

import asyncio

import httpx
import pytest

from tests.helpers import sse_events


@pytest.fixture(scope="module")
def server(plain_server):
    return plain_server  # tests/conftest.py


def test_generate(server):
    r = httpx.post(server + "/generate", json={"prompt": "The quick brown", "max_tokens": 9, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["finish_reason"] == "length" and len(body["token_ids"]) == 9
    assert body["usage"] == {"prompt_tokens": body["usage"]["prompt_tokens"], "completion_tokens": 9,
                             "total_tokens": body["usage"]["prompt_tokens"] + 9}
    assert body["usage"]["prompt_tokens"] > 0 and r.headers["x-request-id"] == body["id"]
    again = httpx.post(server + "/generate", json={"prompt_token_ids": [5, 6, 7], "max_tokens": 9, "temperature": 0})
    assert again.json()["usage"]["prompt_tokens"] == 3


def test_stream_matches_non_stream(server):
    req = {"prompt": "Return a new list", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    whole = httpx.post(server + "/generate", json=req).json()
    with httpx.stream("POST", server + "/generate", json={**req, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    final, chunks = events[-2], events[:-2]
    assert final["finished"] and final["finish_reason"] == "length" and final["usage"]["completion_tokens"] == 12
    assert [t for e in chunks for t in e["token_ids"]] == whole["token_ids"]
    assert "".join(e["text"] for e in chunks) == whole["text"]


@pytest.mark.parametrize("body,field", [
    ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": 5}, "prompt"),
    ({"max_tokens": 4}, "prompt"),
])
def test_invalid_bodies_are_422_naming_the_field(server, body, field):
    r = httpx.post(server + "/generate", json=body)
    assert r.status_code == 422
    assert field in r.text


def test_sglang_shape_is_the_same_request(server):
    """SGLang's /generate shape (what vllm-router forwards): text / input_ids and sampling_params
    with max_new_tokens give what our own fields give."""
    ours = {"prompt": "The quick brown", "max_tokens": 7, "temperature": 0, "top_k": 0, "stop_token_ids": [3],
            "ignore_eos": True}
    sglang = {"text": "The quick brown", "sampling_params": {"max_new_tokens": 7, "temperature": 0, "top_k": -1,
                                                            "stop_token_ids": [3], "ignore_eos": True}}
    a, b = httpx.post(server + "/generate", json=ours), httpx.post(server + "/generate", json=sglang)
    assert a.status_code == b.status_code == 200, b.text
    assert a.json()["token_ids"] == b.json()["token_ids"] and len(b.json()["token_ids"]) <= 7
    ids = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    c = httpx.post(server + "/generate", json=ids)
    assert c.status_code == 200 and c.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


@pytest.mark.parametrize("body,says", [
    ({"text": "hi", "prompt": "hi"}, "got prompt, text"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 2}, "temperature": 0}, "not both (top level: temperature)"),
    ({"text": "hi", "sampling_params": {"max_tokens": 2}}, "max_tokens"),  # SGLang's name there is max_new_tokens
    ({"text": "hi", "sampling_params": {"max_new_tokens": 0}}, "max_new_tokens"),
])
def test_sglang_shape_is_validated(server, body, says):
    r = httpx.post(server + "/generate", json=body)
    assert r.status_code == 422 and says in r.text, r.text


def test_not_json_is_422(server):
    r = httpx.post(server + "/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422


def test_too_long_is_400_with_numbers(server):
    r = httpx.post(server + "/generate", json={"prompt_token_ids": [1] * 200, "max_tokens": 100})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "200" in msg and "100" in msg and "256" in msg
    r = httpx.post(server + "/generate", json={"prompt_token_ids": [1, 99999]})
    assert r.status_code == 400 and "99999" in r.json()["error"]["message"]


def test_concurrent_requests_match_sequential(server):
    prompts = [[(7 * i + j) % 400 + 1 for j in range(1 + 3 * i)] for i in range(12)]

    async def run():
        async with httpx.AsyncClient(base_url=server, timeout=60) as c:
            rs = await asyncio.gather(*[
                c.post("/generate", json={"prompt_token_ids": p, "max_tokens": 10, "temperature": 0, "ignore_eos": True})
                for p in prompts])
        return [r.json()["token_ids"] for r in rs]

    together = asyncio.run(run())
    alone = [httpx.post(server + "/generate", json={"prompt_token_ids": p, "max_tokens": 10, "temperature": 0,
                                                    "ignore_eos": True}).json()["token_ids"] for p in prompts[:4]]
    assert together[:4] == alone
    assert all(len(t) == 10 for t in together)
    assert httpx.get(server + "/health").json() == {"status": "ok"}
