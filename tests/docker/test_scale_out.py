"""The scale-out profile for real, on loopback: server replicas started by the container's own
entrypoint (docker/entrypoint.sh, configured by FLASHPAGE_* variables as compose.yaml does), and
Debian's nginx running docker/nginx.conf with only the replica addresses and the listen port
replaced. Requests through nginx reach every replica, streams pass through event by event and equal
the non-streamed result, and when a replica stops nginx sends everything to the others."""

import json
import os
import re
import signal
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from benchmarks.shared.common import ServerProcess, free_port

REPO = Path(__file__).resolve().parents[2]
ENTRYPOINT = REPO / "docker" / "entrypoint.sh"
NGINX_CONF = REPO / "docker" / "nginx.conf"
UPSTREAM_LINE = re.compile(r"^\s*server\s+([\w.-]+):8000\b", re.M)


def render_nginx_conf(text: str, upstreams: list[str], listen: str) -> str:
    """docker/nginx.conf with the replicas' container names replaced by `upstreams` (host:port, in
    order) and `listen 80;` by `listen {listen};`. Nothing else changes."""
    names = UPSTREAM_LINE.findall(text)
    assert len(names) == len(upstreams)
    for name, addr in zip(names, upstreams):
        text, n = re.subn(rf"^(\s*server\s+){re.escape(name)}:8000\b", rf"\g<1>{addr}", text, flags=re.M)
        assert n == 1
    text, n = re.subn(r"^(\s*)listen 80;", rf"\g<1>listen {listen};", text, flags=re.M)
    assert n == 1
    return text


@pytest.fixture(scope="module")
def replicas(tiny_ckpt, tmp_path_factory, environment):
    """One server per `server NAME:8000` line of docker/nginx.conf, each started as the container
    starts it: docker/entrypoint.sh with FLASHPAGE_* variables (loopback instead of 0.0.0.0)."""
    count = len(UPSTREAM_LINE.findall(NGINX_CONF.read_text()))
    logs = tmp_path_factory.mktemp("replicas")
    procs = []
    for i in range(count):
        port = free_port()
        env = environment(FLASHPAGE_MODEL=str(tiny_ckpt), FLASHPAGE_HOST="127.0.0.1", FLASHPAGE_PORT=str(port),
                          FLASHPAGE_NUM_BLOCKS="128", FLASHPAGE_LOG_LEVEL="warning", PYTHONUNBUFFERED="1")
        procs.append(ServerProcess([str(ENTRYPOINT)], port, logs / f"replica{i}.log", env=env, cwd=REPO))
    try:
        for p in procs:
            p.wait_healthy(120)
        yield procs
    finally:
        # The last test stops one replica gracefully (and checks it); the graceful exit of the rest
        # is not under test here, so they are killed.
        for p in procs:
            p.stop(40, sig=signal.SIGKILL)


@pytest.fixture(scope="module")
def nginx(replicas, tool, tmp_path_factory):
    binary = tool("nginx")
    if os.geteuid() != 0 and not os.access("/var/lib/nginx", os.W_OK):
        pytest.skip("Debian's nginx keeps its temp files in /var/lib/nginx: run as root (CI does)")
    prefix = tmp_path_factory.mktemp("nginx")
    port = free_port()
    conf = prefix / "nginx.conf"
    conf.write_text(render_nginx_conf(NGINX_CONF.read_text(), [p.addr for p in replicas], f"127.0.0.1:{port}"))
    access = prefix / "access.log"
    cmd = [binary, "-p", str(prefix), "-e", "stderr", "-c", str(conf), "-g", f"daemon off; pid {prefix}/nginx.pid;"]
    # access_log /dev/stdout -> access.log, errors (stderr) -> error.log
    proc = ServerProcess(cmd, port, prefix / "error.log", stdout_path=access)
    try:
        yield proc.wait_healthy(30).url, access
    finally:
        proc.stop(10, sig=signal.SIGQUIT)  # graceful stop


def log_entries(access: Path, request_ids, timeout: float = 5.0) -> dict:
    """request id -> the fields of nginx's access line for it (written once the response is done)."""
    deadline = time.monotonic() + timeout
    while True:
        found = {}
        for line in access.read_text().splitlines():
            fields = dict(re.findall(r'(\w+)=("[^"]*"|\S+)', line))
            fields = {k: v.strip('"') for k, v in fields.items()}
            if fields.get("request_id") in request_ids:
                found[fields["request_id"]] = fields
        if len(found) == len(request_ids) or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def sse_events(lines):
    """(arrival time, event) for each `data:` line as it comes off the wire."""
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            yield time.monotonic(), (data if data == "[DONE]" else json.loads(data))


def test_health_through_nginx(nginx):
    url, _ = nginx
    r = httpx.get(url + "/health", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_concurrent_requests_reach_every_replica(nginx, replicas):
    import asyncio

    url, access = nginx
    prompts = [[(11 * i + j) % 300 + 1 for j in range(2 + i)] for i in range(10)] * 2  # each prompt twice
    ids = [uuid.uuid4().hex for _ in prompts]

    async def go():
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            return await asyncio.gather(*[
                c.post("/generate", headers={"X-Request-ID": rid},
                       json={"prompt_token_ids": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
                for rid, p in zip(ids, prompts)])

    responses = asyncio.run(go())
    assert [r.status_code for r in responses] == [200] * len(prompts), [r.text for r in responses]
    bodies = [r.json() for r in responses]
    assert [r.headers["x-request-id"] for r in responses] == ids == [b["id"] for b in bodies]
    assert all(len(b["token_ids"]) == 8 for b in bodies)

    served = log_entries(access, set(ids))
    assert set(served) == set(ids)
    by_replica = {p.addr: [rid for rid in ids if served[rid]["upstream"] == p.addr] for p in replicas}
    assert sum(map(len, by_replica.values())) == len(ids), {rid: served[rid]["upstream"] for rid in ids}
    assert all(len(v) >= 2 for v in by_replica.values()), {k: len(v) for k, v in by_replica.items()}
    # The replicas serve one model: the same prompt gives the same tokens whichever replica ran it.
    half = len(prompts) // 2
    assert [b["token_ids"] for b in bodies[:half]] == [b["token_ids"] for b in bodies[half:]]


def test_streams_pass_through_event_by_event(nginx):
    url, access = nginx
    # 200 tokens: long enough that nginx's millisecond timings see the stream take time, even
    # when the tiny model decodes a token in well under a millisecond.
    body = {"prompt": "The quick brown fox", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    whole = {}
    other = threading.Thread(target=lambda: whole.update(httpx.post(url + "/generate", json=body, timeout=120).json()))
    other.start()  # the non-streamed twin runs at the same time (round-robin: on the other replica)

    rid = uuid.uuid4().hex
    with httpx.stream("POST", url + "/generate", json={**body, "stream": True}, headers={"X-Request-ID": rid},
                      timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        timed = list(sse_events(r.iter_lines()))
    other.join(timeout=120)

    events = [e for _, e in timed]
    assert events[-1] == "[DONE]"
    final, chunks = events[-2], events[:-2]
    assert final["finished"] and final["usage"]["completion_tokens"] == 200
    assert [t for e in chunks for t in e["token_ids"]] == whole["token_ids"]
    assert "".join(e["text"] for e in chunks) == whole["text"]

    # Incremental: the replica took `span_up` seconds from its first byte (the first event) to its
    # last; the client saw the events spread over about as long, in many separate arrivals. A
    # proxy that buffered the response would hand them over at once (a spread near 0).
    times = [t for t, e in timed[:-2]]
    (entry,) = log_entries(access, {rid}).values()
    span_up = float(entry["upstream_time"]) - float(entry["upstream_header_time"])
    span_client = times[-1] - times[0]
    assert span_up > 0, entry
    assert span_client >= 0.5 * span_up - 0.005, (span_client, span_up, times)
    assert len({round(t, 3) for t in times}) >= 3, times


def test_a_stopped_replica_is_taken_out_and_the_rest_serve(nginx, replicas):
    url, access = nginx
    gone, *alive = replicas[::-1]
    # SIGTERM to the entrypoint's pid reaches the server itself (the entrypoint exec'd it): it drains
    # and exits, and nothing is left listening on its port.
    gone.proc.send_signal(signal.SIGTERM)
    assert gone.proc.wait(timeout=45) in (0, -signal.SIGTERM), gone.log_text()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://{gone.addr}/health", timeout=2)

    ids = [uuid.uuid4().hex for _ in range(6)]
    for rid in ids:
        r = httpx.post(url + "/generate", headers={"X-Request-ID": rid}, timeout=60,
                       json={"prompt": "hello", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
    served = log_entries(access, set(ids))
    finals = [served[rid]["upstream"].split(", ")[-1] for rid in ids]
    assert set(finals) <= {p.addr for p in alive}, finals
    assert httpx.get(url + "/health", timeout=10).status_code == 200
