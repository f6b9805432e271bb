"""The scale-out benchmark's clients (benchmarks/scaleout/bench_scaleout.py): a closed loop of streamed
/v1/completions, its clients dealt over several client processes that start at one instant, and
what each request saw (time to first token, end to end, tokens). A client takes a prompt, or a
`Conversation`, whose turns it sends one after another, each with the conversation so far."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import httpx

SERVED_NAME = "model"  # every replica's --served-model-name, what the requests name


@dataclass
class Conversation:
    """A chat: a system prompt and the user's turns. Each turn is a request of the conversation so
    far, the replicas' answers included as they came back (as a chat client sends it)."""
    system: str
    turns: list[str]


def turn_prompt(history: str, user: str) -> str:
    """A request's prompt: what came before (a system prompt, or a conversation) and a user turn."""
    return f"{history}\nUser: {user}\nAssistant:"


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int,
                      keep_text: bool = False) -> dict:
    """One streamed completion: its TTFT, end to end and tokens (and, with keep_text, its text)."""
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    t0, ttft, chunks, text = time.perf_counter(), None, 0, []
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"error": f"http_{r.status_code}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if ttft is None:
                    ttft = time.perf_counter() - t0
                chunks += 1
                if keep_text:  # parsed only for conversations: a JSON parse per token costs the client
                    text.append(json.loads(line[6:])["choices"][0]["text"])
    except httpx.HTTPError as e:
        return {"error": type(e).__name__}
    record = {"ttft": ttft, "e2e": time.perf_counter() - t0, "tokens": max_tokens if chunks else 0}
    if keep_text:
        record["text"] = "".join(text)
    return record


async def converse(client: httpx.AsyncClient, url: str, chat: Conversation, max_tokens: int,
                   records: list[dict]) -> None:
    """A conversation's turns in order, each request the conversation so far; a failed turn ends it."""
    history = chat.system
    for user in chat.turns:
        prompt = turn_prompt(history, user)
        record = await one_request(client, url, prompt, max_tokens, keep_text=True)
        records.append(record)
        if "error" in record:
            return
        history = prompt + record.pop("text")


async def closed_loop(url: str, prompts: list[str | Conversation], clients: int, max_tokens: int) -> list[dict]:
    queue = list(reversed(prompts))
    records: list[dict] = []

    async def client_loop(client):
        while queue:
            item = queue.pop()
            if isinstance(item, Conversation):
                await converse(client, url, item, max_tokens, records)
            else:
                records.append(await one_request(client, url, item, max_tokens))

    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
    return records


@dataclass
class ClientShare:
    """What one client process sends, and the wall-clock instant it starts at."""
    url: str
    prompts: list[str | Conversation]
    clients: int
    max_tokens: int
    start_at: float


@dataclass
class ShareResult:
    records: list[dict]
    started: float
    ended: float
    cpu_s: float  # the process's CPU time over its run: near its wall time, the client is the limit


def _client_process(share: ClientShare) -> ShareResult:
    time.sleep(max(0.0, share.start_at - time.time()))
    started, cpu0 = time.time(), time.process_time()
    records = asyncio.run(closed_loop(share.url, share.prompts, share.clients, share.max_tokens))
    return ShareResult(records, started, time.time(), time.process_time() - cpu0)


@dataclass
class Driven:
    """A closed loop's records and timing, over all its client processes."""
    records: list[dict]
    elapsed_s: float  # from the common start to the last request's end
    start_skew_s: float  # the latest process's start after the common one
    client_cpu_util: float  # the busiest client process's CPU time / its wall time


# Spawned client processes take about a second to import; all of them start at one instant this far
# ahead, so the replicas see the whole load from the first second, not a ramp over process starts.
SPAWN_S = 5.0


def drive(urls: list[str], prompts: list[str | Conversation], clients: int, max_tokens: int,
          processes: int) -> Driven:
    """The closed loop, its clients and prompts dealt over `processes` client processes (one asyncio
    process tops out near 10k streamed tokens/s, under what two GPUs serve), process i sending to
    urls[i % len(urls)]."""
    processes = max(1, min(processes, clients))
    start_at = time.time() + (SPAWN_S if processes > 1 else 0.0)
    shares = [ClientShare(urls[i % len(urls)], prompts[i::processes],
                          clients // processes + (i < clients % processes), max_tokens, start_at)
              for i in range(processes)]
    if processes == 1:
        results = [_client_process(shares[0])]
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) as pool:
            results = list(pool.map(_client_process, shares))
    return Driven([r for res in results for r in res.records], max(res.ended for res in results) - start_at,
                  max(res.started for res in results) - start_at,
                  max(res.cpu_s / max(res.ended - res.started, 1e-9) for res in results))
