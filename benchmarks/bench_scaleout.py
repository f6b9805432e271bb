"""Scale-out: N flashpage replicas behind vllm-router, `round_robin` against `cache_aware`.

    python benchmarks/bench_scaleout.py [--replicas 2] [--device cuda] [--out-dir benchmarks/results]

Starts N replicas (one per GPU with --device cuda, or N CPU replicas) of one checkpoint (--model,
default: random GPT-2 small weights with the embedded tokenizer), then for each policy a
vllm-router in front of them, and drives two closed-loop workloads of streamed /v1/completions:

- shared: --system-prompts system prompts of --system-words words each (~1.3 tokens a word), each
  request one of them followed by a fresh short user turn: what a chat service with a few
  assistants looks like, where routing by prefix lets each replica keep its own prompts cached;
- nosharing: prompts of the same length with nothing in common.

Every (policy, workload) run draws its own prompts, so no run finds the last one's blocks cached.
Reported per run: output tokens/s, time to first token (p50/p90/p99), requests/s, errors, and each
replica's prefix-cache hit rate over the run (prompt tokens found cached / prompt tokens, from its
/metrics). A run with one replica alone
(no router) on the nosharing workload gives the baseline that N replicas' throughput is compared
with. Writes scaleout_<device>.json and a plot; `report(result)` renders the README section.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import random
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import ServerProcess, free_port, summarize, write_result  # noqa: E402

POLICIES = ("round_robin", "cache_aware")
WORKLOADS = ("shared", "nosharing")
# Plain words, so that a system prompt tokenizes to about 1.3 tokens a word with GPT-2's tokenizer.
WORDS = ("the of and to in is was for on that with as by at from his her are were this be had not but "
         "they which one you all their there an has been would more when will who time some can about "
         "into only other new may people than first could these two any after year most over such "
         "where through between made well even many those before being under long great world state "
         "city music light water school house river north south small large early later model field").split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


# ------------------------------------------------------------------------------- processes
def start_replicas(model: str, n: int, device: str, extra: list[str], log_dir: Path) -> list[ServerProcess]:
    """n servers, replica i on GPU i (CUDA_VISIBLE_DEVICES) or on the CPU; started together."""
    procs = []
    for i in range(n):
        env = {"CUDA_VISIBLE_DEVICES": str(i)} if device == "cuda" else {}
        procs.append(ServerProcess.python_server(["--model", model, "--served-model-name", "model",
                                                  "--device", device, *extra], log_dir / f"replica{i}.log",
                                                 extra_env=env))
    for p in procs:
        p.wait_healthy(900)
    return procs


# A replica that dies fails the requests sent to it until the health check (every second) or the
# circuit breaker (3 failures in a row) takes it out; each such request is retried, and with
# concurrent traffic round_robin can hand one request the dead replica several times in a row:
# 5 attempts measured enough on 2 replicas (tests/benchmarks/test_scaleout.py).
RESILIENCE = ["--retry-max-retries", "5", "--cb-failure-threshold", "3"]


def router_bin() -> str:
    found = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
    if not os.path.exists(found):
        raise SystemExit("vllm-router not found: pip install vllm-router (the version docker/router.Dockerfile pins)")
    return found


def start_router(workers: list[str], policy: str, log_path: Path) -> ServerProcess:
    """vllm-router in front of `workers` with `policy`, health-checking /health, retries on."""
    port, metrics_port = free_port(), free_port()
    cmd = [router_bin(), "--worker-urls", *workers, "--policy", policy, "--host", "127.0.0.1", "--port", str(port),
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
           "--health-check-endpoint", "/health", "--health-check-interval-secs", "1",
           "--health-failure-threshold", "1", *RESILIENCE, "--log-level", "warning"]
    router = ServerProcess(cmd, port, log_path)
    return router.wait_healthy(60)


def prefix_counters(url: str) -> tuple[float, float]:
    """(prompt tokens, prefix-cache hits in blocks) of a replica, from its /metrics. (Its lookup
    count is no denominator for a hit rate: a lookup stops at a prompt's first missing block.)"""
    from prometheus_client.parser import text_string_to_metric_families

    values = {s.name: s.value for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text)
              for s in fam.samples}
    return values["flashpage_prompt_tokens_total"], values["flashpage_prefix_cache_hits_total"]


# ------------------------------------------------------------------------------- load
def make_prompts(workload: str, seed: int, num_requests: int, args) -> list[str]:
    rng = random.Random(seed)
    systems = [words(rng, rng.randint(*args.system_words)) for _ in range(args.system_prompts)]
    prompts = []
    for _ in range(num_requests):
        user = words(rng, rng.randint(*args.user_words))
        if workload == "shared":
            prompts.append(f"{rng.choice(systems)}\nUser: {user}\nAssistant:")
        else:
            prompts.append(f"{words(rng, rng.randint(*args.system_words))}\nUser: {user}\nAssistant:")
    return prompts


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": "model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    t0, ttft, chunks = time.perf_counter(), None, 0
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
    except httpx.HTTPError as e:
        return {"error": type(e).__name__}
    return {"ttft": ttft, "e2e": time.perf_counter() - t0, "tokens": max_tokens if chunks else 0}


async def closed_loop(url: str, prompts: list[str], clients: int, max_tokens: int) -> tuple[list[dict], float]:
    queue = list(reversed(prompts))
    records: list[dict] = []

    async def client_loop(client):
        while queue:
            records.append(await one_request(client, url, queue.pop(), max_tokens))

    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
        return records, time.perf_counter() - t0


def _client_process(url: str, prompts: list[str], clients: int, max_tokens: int) -> tuple[list[dict], float]:
    return asyncio.run(closed_loop(url, prompts, clients, max_tokens))


def drive(url: str, prompts: list[str], clients: int, max_tokens: int, processes: int) -> tuple[list[dict], float]:
    """The closed loop, its clients and prompts dealt over `processes` client processes: one
    asyncio process tops out near 10k streamed tokens/s, under what two GPUs serve."""
    processes = max(1, min(processes, clients))
    if processes == 1:
        return _client_process(url, prompts, clients, max_tokens)
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    shares = [(url, prompts[i::processes], clients // processes + (i < clients % processes), max_tokens)
              for i in range(processes)]
    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) as pool:
        results = list(pool.map(_client_process, *zip(*shares)))
    return [r for records, _ in results for r in records], max(elapsed for _, elapsed in results)


def run_once(url: str, replicas: list[str], workload: str, seed: int, args) -> dict:
    """One closed-loop run against `url` (a router or a replica), with the replicas' prefix-cache
    hit rates over it."""
    prompts = make_prompts(workload, seed, args.num_requests, args)
    before = [prefix_counters(r) for r in replicas]
    records, elapsed = drive(url, prompts, args.clients, args.max_tokens, getattr(args, "client_processes", 1))
    after = [prefix_counters(r) for r in replicas]
    ok = [r for r in records if "error" not in r]
    tokens = [a[0] - b[0] for a, b in zip(after, before)]
    hits = [(a[1] - b[1]) * args.block_size for a, b in zip(after, before)]  # blocks -> tokens
    kinds: dict[str, int] = {}
    for r in records:
        if "error" in r:
            kinds[r["error"]] = kinds.get(r["error"], 0) + 1
    return {"workload": workload, "requests": len(records), "errors": len(records) - len(ok), "error_kinds": kinds,
            "duration_s": elapsed, "output_tokens_per_s": sum(r["tokens"] for r in ok) / elapsed,
            "requests_per_s": len(ok) / elapsed, "ttft_ms": summarize([r["ttft"] for r in ok if r["ttft"]], 1e3),
            "e2e_s": summarize([r["e2e"] for r in ok]),
            "prompt_tokens": tokens, "cached_tokens": hits,
            "hit_rate": sum(hits) / sum(tokens) if sum(tokens) else None,
            "replica_hit_rates": [h / t if t else None for h, t in zip(hits, tokens)]}


# ------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: random GPT-2 small weights)")
    ap.add_argument("--server-args", default="", help="extra arguments for every replica, one string")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--clients", type=int, default=64, help="closed-loop clients")
    ap.add_argument("--num-requests", type=int, default=1024, help="requests per run")
    ap.add_argument("--system-prompts", type=int, default=32)
    ap.add_argument("--system-words", type=int, nargs=2, default=[300, 560],
                    help="~400-750 GPT-2 tokens: with the user turn and the output, within GPT-2's 1024")
    ap.add_argument("--user-words", type=int, nargs=2, default=[8, 40])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--client-processes", type=int, default=8, help="client processes sharing the clients")
    ap.add_argument("--block-size", type=int, default=16, help="the replicas' KV block size (hit tokens = blocks x this)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the one-replica nosharing run")
    ap.add_argument("--out-dir", default="benchmarks/results")
    args = ap.parse_args(argv)

    import torch
    import triton

    work = Path(tempfile.mkdtemp(prefix="scaleout-"))
    model = args.model
    if model is None:
        from benchmarks.checkpoint import make_random_gpt2

        model = str(make_random_gpt2(work / "gpt2-small", dtype=torch.float16))
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    procs = start_replicas(model, args.replicas, args.device, ["--block-size", str(args.block_size),
                                                               *args.server_args.split()], work)
    urls = [p.url for p in procs]
    rows, seed = [], 0
    try:
        if not args.no_baseline:  # one replica alone, no router: the baseline for N replicas
            seed += 1
            rows.append({"impl": "flashpage", "replicas": 1, "policy": "direct", **run_once(urls[0], urls[:1], "nosharing", seed, args)})
            print_row(rows[-1])
        for policy in args.policies:
            router = start_router(urls, policy, work / f"router-{policy}.log")
            try:
                for workload in args.workloads:
                    seed += 1
                    rows.append({"impl": f"flashpage + vllm-router ({policy})", "replicas": len(urls), "policy": policy,
                                 **run_once(router.url, urls, workload, seed, args)})
                    print_row(rows[-1])
            finally:
                router.stop(10)
    finally:
        for p in procs:
            p.stop(30)
    result = {"device": device_name, "torch": torch.__version__.split("+")[0], "triton": triton.__version__,
              "date": datetime.date.today().isoformat(),
              "command": "python benchmarks/bench_scaleout.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
              "workload": {k: getattr(args, k) for k in ("clients", "num_requests", "system_prompts", "system_words",
                                                         "user_words", "max_tokens", "client_processes",
                                                         "server_args")},
              "router": router_version(), "rows": rows}
    path = write_result(result, args.out_dir, "scaleout")
    print(report(result))
    print(f"wrote {path}")
    return 0


def router_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"vllm-router {version('vllm-router')}"
    except PackageNotFoundError:
        return "vllm-router"


def print_row(r: dict) -> None:
    t = r["ttft_ms"]
    rate = "-" if r["hit_rate"] is None else f"{100 * r['hit_rate']:.0f}%"
    print(f"{r['replicas']} x {r['policy']:12s} {r['workload']:9s} {r['output_tokens_per_s']:9.0f} tok/s  "
          f"TTFT p50 {t['p50'] or 0:7.1f} ms p99 {t['p99'] or 0:7.1f} ms  hit rate {rate}  errors {r['errors']}",
          flush=True)


def report(result: dict) -> str:
    """README section: one row per (replicas, policy, workload), the throughput against one replica."""
    rows = result["rows"]
    base = next((r["output_tokens_per_s"] for r in rows if r["replicas"] == 1), None)
    w = result["workload"]
    lines = [f"Closed loop, {w['clients']} clients, {w['num_requests']} streamed /v1/completions per run, "
             f"{w['max_tokens']} output tokens each; shared: {w['system_prompts']} system prompts of "
             f"{w['system_words'][0]}-{w['system_words'][1]} words plus a {w['user_words'][0]}-{w['user_words'][1]}"
             f"-word user turn; nosharing: prompts of the same length with nothing in common. "
             f"{result.get('router', 'vllm-router')}; hit rate = prompt tokens the replicas found in their prefix "
             "caches / prompt tokens, over the run.", "",
             "| replicas | policy | workload | output tok/s | vs 1 replica, nosharing | TTFT p50 ms | TTFT p99 ms | hit rate "
             "| per replica | errors |", "|---:|---|---|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        pct = lambda x: "-" if x is None else f"{100 * x:.0f}%"  # noqa: E731
        vs = f"{r['output_tokens_per_s'] / base:.2f}x" if base else "-"
        lines.append(f"| {r['replicas']} | {r['policy']} | {r['workload']} | {r['output_tokens_per_s']:,.0f} | {vs} "
                     f"| {r['ttft_ms']['p50'] or 0:.1f} | {r['ttft_ms']['p99'] or 0:.1f} | {pct(r['hit_rate'])} "
                     f"| {' / '.join(pct(x) for x in r['replica_hit_rates'])} | {r['errors']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
