"""benchmarks/serving/naive_server.py through a real uvicorn subprocess: same API as flashpage, and its
static batches (left-padded) give the tokens transformers' own generate gives one prompt at a time."""

import asyncio
import sys

import httpx
import pytest

from benchmarks.shared.common import ServerProcess, free_port
from tests.helpers import hf_greedy, sse_events


@pytest.fixture(scope="module")
def naive(tiny_ckpt, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("naive-log") / "server.log"
    # a 0.4 s batching window, so that two requests sent together land in one batch
    cmd = [sys.executable, "-m", "benchmarks.serving.naive_server", "--model", str(tiny_ckpt),
           "--port", str(port), "--device", "cpu", "--max-batch", "4", "--batch-wait-ms", "400",
           "--log-level", "warning"]
    server = ServerProcess(cmd, port, log)
    server.wait_healthy(120)
    yield server.url
    server.stop()


def hf_greedy_eager(ckpt, prompt: list[int], n: int) -> list[int]:
    from transformers import GPT2LMHeadModel

    return hf_greedy(GPT2LMHeadModel.from_pretrained(ckpt, attn_implementation="eager").eval(), prompt, n)


def test_batch_of_two_lengths_matches_transformers(naive, tiny_ckpt):
    prompts = [[5, 17, 99, 230, 41, 8, 300, 12, 77, 150, 3], [64, 9, 201]]
    lens = [12, 7]

    async def both():
        async with httpx.AsyncClient(base_url=naive, timeout=60) as c:
            return await asyncio.gather(*[
                c.post("/generate", json={"prompt_token_ids": p, "max_tokens": n, "temperature": 0, "ignore_eos": True})
                for p, n in zip(prompts, lens)])

    rs = asyncio.run(both())
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
    assert [r.headers["x-batch-size"] for r in rs] == ["2", "2"]  # one generate call, left-padded
    for r, p, n in zip(rs, prompts, lens):
        body = r.json()
        assert body["token_ids"] == hf_greedy_eager(tiny_ckpt, p, n)
        assert body["finish_reason"] == "length"
        assert body["usage"] == {"prompt_tokens": len(p), "completion_tokens": n, "total_tokens": len(p) + n}


def test_stream_format_matches_flashpage(naive):
    req = {"prompt": "The quick brown", "max_tokens": 9, "temperature": 0, "ignore_eos": True}
    whole = httpx.post(naive + "/generate", json=req, timeout=60).json()
    with httpx.stream("POST", naive + "/generate", json={**req, "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    final, chunks = events[-2], events[:-2]
    assert final["finished"] and final["finish_reason"] == "length" and final["usage"]["completion_tokens"] == 9
    assert all(not e["finished"] and e["token_ids"] for e in chunks) and len(chunks) > 1  # streamed per step
    assert [t for e in chunks for t in e["token_ids"]] == whole["token_ids"]
    assert "".join(e["text"] for e in chunks) == whole["text"]


def test_errors_match_flashpage(naive):
    r = httpx.post(naive + "/generate", json={"prompt_token_ids": [1] * 200, "max_tokens": 100})
    assert r.status_code == 400 and "256" in r.json()["error"]["message"]
    r = httpx.post(naive + "/generate", json={"prompt_token_ids": [1, 99999]})
    assert r.status_code == 400 and "99999" in r.json()["error"]["message"]
    r = httpx.post(naive + "/generate", json={"prompt": "hi", "max_tokens": 0})
    assert r.status_code == 422 and "max_tokens" in r.text
    info = httpx.get(naive + "/info").json()
    assert info["vocab_size"] == 512 and info["max_model_len"] == 256


def test_stop_token_ids_and_eos_trim_each_request(naive):
    req = {"prompt_token_ids": [5, 17, 99, 230], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    full = httpx.post(naive + "/generate", json=req, timeout=60).json()["token_ids"]
    stop_tok = full[5]
    cut = httpx.post(naive + "/generate", json={**req, "stop_token_ids": [stop_tok]}, timeout=60).json()
    k = full.index(stop_tok)
    assert cut["token_ids"] == full[:k + 1] and cut["finish_reason"] == "stop"  # kept as the last token, as flashpage
