"""Scale-out: N flashpage replicas behind vllm-router, `round_robin` against `cache_aware`.

    python -m benchmarks.scaleout.bench_scaleout [--replicas 2] [--device cuda] [--out-dir benchmarks/results]

Starts N replicas (one per GPU with --device cuda, or N CPU replicas) of one checkpoint (--model, or
random weights at --model-shape: GPT-2 small by default, or a Llama/Qwen shape, with the embedded
tokenizer), then for each policy a
vllm-router in front of them, and drives two closed-loop workloads of streamed /v1/completions:

- shared: --system-prompts system prompts of --system-words words each (~1.3 tokens a word), each
  request one of them followed by a fresh short user turn: what a chat service with many
  assistants looks like. Each replica's cache (--num-blocks) holds about half the prompts, so
  round_robin, which sends every prompt everywhere, keeps evicting them, while routing by prefix
  lets each replica keep its own half cached;
- nosharing: prompts of the same length with nothing in common;
- chat (named with --workloads): conversations of --turns user turns after one of
  --chat-system-prompts system prompts, each turn a request of the conversation so far, the
  replicas' answers included as they came back. A replica that served a conversation's last turn
  holds all of it; round_robin sends the next turn to any replica. With random weights the answers
  do not re-tokenize to the ids they were generated as, so under every policy a turn computes the
  last answer again (a real model's answer comes back as the same ids, and is found cached).

The load scales with the replicas (--clients-per-replica, --requests-per-replica), so N replicas
are compared with one under the same pressure each, and the client processes start at one instant.
Every run draws its own prompts, so no run finds the last one's blocks cached. Reported per run:
output tokens/s, time to first token (p50/p90/p99), requests/s, errors, and per replica the prompt
tokens it was sent and its prefix-cache hit rate over the run (prompt tokens found cached / prompt
tokens, from its /metrics), the replicas' own TTFT p50 (their histograms), and what
benchmarks/scaleout/scaleout_observe.py sees from the side: a render's time on the loaded replicas, the
gap between their loads, and the router's counters (prefix hits and misses, usable renders).
Before the router runs, two `direct` runs on the nosharing workload: one replica alone (the
baseline N replicas are compared with) and the N replicas with the clients dealt evenly over them,
no router (what the replicas scale to before any router cost). Writes scaleout_<device>.json (GPT-2
small) or scaleout_<shape>[_<tag>]_<device>.json and its plot; benchmarks/scaleout/scaleout_report.py renders
the docs/benchmarks.md section. The clients are benchmarks/scaleout/scaleout_load.py's.
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import shlex
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from benchmarks.shared.checkpoint import LLAMA_SHAPES, make_random_gpt2, make_random_llama  # noqa: E402
from benchmarks.shared.common import ServerProcess, free_port, gpu_slug, summarize, write_result  # noqa: E402
from benchmarks.scaleout.scaleout_load import SERVED_NAME, Conversation, drive, turn_prompt  # noqa: E402
from benchmarks.scaleout.scaleout_observe import Observer, counter_deltas, metric_samples, router_counters  # noqa: E402
from benchmarks.scaleout.scaleout_report import plot, print_row, report  # noqa: E402

# Router configurations: a name, and the router arguments it runs with. `cache_aware` is the
# router's own thresholds (it balances by load only once the busiest replica has 64 more requests
# in flight than the idlest and 1.5x as many); `cache_aware_tight` balances sooner (16 and 1.25);
# `power_of_two` ignores prefixes and sends each request to the less loaded of two replicas.
POLICIES = {"round_robin": ["--policy", "round_robin"],
            "cache_aware": ["--policy", "cache_aware"],
            "cache_aware_tight": ["--policy", "cache_aware", "--balance-abs-threshold", "16",
                                  "--balance-rel-threshold", "1.25"],
            "power_of_two": ["--policy", "power_of_two"]}
WORKLOADS = ("shared", "nosharing", "chat")
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
        procs.append(ServerProcess.python_server(["--model", model, "--served-model-name", SERVED_NAME,
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


@dataclass
class Router:
    """A started vllm-router: its process, and its Prometheus endpoint (how it routed)."""
    process: ServerProcess
    metrics_url: str

    @property
    def url(self) -> str:
        return self.process.url

    def stop(self, timeout: float) -> None:
        self.process.stop(timeout)


def start_router(workers: list[str], policy: str, log_path: Path) -> Router:
    """vllm-router in front of `workers` as POLICIES[policy] configures it, health-checking /health,
    retries on."""
    port, metrics_port = free_port(), free_port()
    cmd = [router_bin(), "--worker-urls", *workers, *POLICIES[policy], "--host", "127.0.0.1", "--port", str(port),
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
           "--health-check-endpoint", "/health", "--health-check-interval-secs", "1",
           "--health-failure-threshold", "1", *RESILIENCE, "--log-level", "warning"]
    return Router(ServerProcess(cmd, port, log_path).wait_healthy(60), f"http://127.0.0.1:{metrics_port}/metrics")


@dataclass
class ReplicaCounters:
    """A replica's /metrics at one instant: what a run's deltas are taken of."""
    prompt_tokens: float
    # (not its lookup count: that is no denominator for a hit rate, a lookup stops at a prompt's
    # first missing block)
    prefix_hit_blocks: float
    ttft_buckets: dict[float, float]  # upper bound (s) -> requests whose engine-side TTFT was within it


def replica_counters(url: str) -> ReplicaCounters:
    samples = metric_samples(url + "/metrics")
    values = {s.name: s.value for s in samples}
    buckets = {float(s.labels["le"]): s.value for s in samples
               if s.name == "flashpage_time_to_first_token_seconds_bucket"}
    return ReplicaCounters(values["flashpage_prompt_tokens_total"], values["flashpage_prefix_cache_hits_total"],
                           buckets)


def replica_ttft_p50_ms(before: list[ReplicaCounters], after: list[ReplicaCounters]) -> float | None:
    """The replicas' own time to first token over a run (from a request reaching the engine), p50
    interpolated within the histogram's buckets: the client's TTFT minus this is what the router
    and the HTTP hops add."""
    bounds = sorted(after[0].ttft_buckets)
    counts = [sum(a.ttft_buckets[le] - b.ttft_buckets.get(le, 0.0) for a, b in zip(after, before)) for le in bounds]
    if not counts or not counts[-1]:
        return None
    half, lo, below = counts[-1] / 2, 0.0, 0.0
    for le, n in zip(bounds, counts):
        if n >= half:
            hi = le if le != float("inf") else lo
            return 1e3 * (lo + (hi - lo) * (half - below) / max(n - below, 1e-9))
        lo, below = le, n
    return None


# ------------------------------------------------------------------------------- load
def make_prompts(workload: str, seed: int, num_requests: int, args) -> list[str | Conversation]:
    """A run's prompts, or (chat) its conversations of args.turns requests each."""
    rng = random.Random(seed)
    chat = workload == "chat"
    systems = [words(rng, rng.randint(*args.system_words))
               for _ in range(args.chat_system_prompts if chat else args.system_prompts)]
    if chat:
        return [Conversation(rng.choice(systems), [words(rng, rng.randint(*args.user_words)) for _ in range(args.turns)])
                for _ in range(max(1, num_requests // args.turns))]
    prompts = []
    for _ in range(num_requests):
        user = words(rng, rng.randint(*args.user_words))
        system = rng.choice(systems) if workload == "shared" else words(rng, rng.randint(*args.system_words))
        prompts.append(turn_prompt(system, user))
    return prompts


def run_once(targets: list[str], replicas: list[str], workload: str, seed: int, args, clients: int,
             num_requests: int, router_metrics: str | None = None) -> dict:
    """One closed-loop run against `targets` (a router, or the replicas themselves), with the
    replicas' prefix-cache hit rates over it (and, given its metrics URL, how the router routed)."""
    prompts = make_prompts(workload, seed, num_requests, args)
    before = [replica_counters(r) for r in replicas]
    routed = router_counters(router_metrics) if router_metrics else None
    observer = Observer(replicas, SERVED_NAME, make_prompts("nosharing", -seed, 1, args)[0])
    observer.start()
    driven = drive(targets, prompts, clients, args.max_tokens, getattr(args, "client_processes", 1))
    records, elapsed = driven.records, driven.elapsed_s
    observed = observer.stop()
    after = [replica_counters(r) for r in replicas]
    if routed is not None:
        observed["router_counters"] = counter_deltas(routed, router_counters(router_metrics))
    ok = [r for r in records if "error" not in r]
    tokens = [a.prompt_tokens - b.prompt_tokens for a, b in zip(after, before)]
    hits = [(a.prefix_hit_blocks - b.prefix_hit_blocks) * args.block_size for a, b in zip(after, before)]  # tokens
    kinds: dict[str, int] = {}
    for r in records:
        if "error" in r:
            kinds[r["error"]] = kinds.get(r["error"], 0) + 1
    return {"workload": workload, "clients": clients, "requests": len(records), "errors": len(records) - len(ok),
            "error_kinds": kinds, "duration_s": elapsed, "start_skew_s": driven.start_skew_s,
            "client_cpu_util": driven.client_cpu_util,
            "output_tokens_per_s": sum(r["tokens"] for r in ok) / elapsed,
            "requests_per_s": len(ok) / elapsed, "ttft_ms": summarize([r["ttft"] for r in ok if r["ttft"]], 1e3),
            "replica_ttft_p50_ms": replica_ttft_p50_ms(before, after),
            "e2e_s": summarize([r["e2e"] for r in ok]),
            "prompt_tokens": tokens, "cached_tokens": hits,
            "hit_rate": sum(hits) / sum(tokens) if sum(tokens) else None,
            "replica_hit_rates": [h / t if t else None for h, t in zip(hits, tokens)], **observed}


# ------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: random weights at --model-shape)")
    ap.add_argument("--model-shape", default="gpt2", choices=["gpt2", *LLAMA_SHAPES],
                    help="random checkpoint of this shape (built on --device). GPT-2 small's prefill is so cheap "
                         "that a prefix hit saves the replicas little; Llama-3.2-1B's costs enough that where prompts "
                         "are cached decides throughput; Llama-3.1-8B's, the size served on one GPU, decides first-token "
                         "latency too (2026-11-26)")
    ap.add_argument("--num-blocks", type=int, default=4096,
                    help="each replica's KV cache in blocks (0: its own sizing). The default holds a replica's "
                         "running sequences on either workload and about half the shared workload's system "
                         "prompts: the memory pressure of a GPU serving a model larger than GPT-2")
    ap.add_argument("--server-args", default="", help="extra arguments for every replica, one string")
    ap.add_argument("--policies", nargs="+", default=["round_robin", "cache_aware"], choices=list(POLICIES),
                    help="cache_aware_tight measured worse than cache_aware on both workloads (2026-11-25), so it "
                         "runs only when named, as does power_of_two (the load-balancing reference: 2.0x one 8B "
                         "replica on nosharing where round_robin gave 1.8x, 2026-11-26)")
    ap.add_argument("--workloads", nargs="+", default=["shared", "nosharing"], choices=WORKLOADS,
                    help="chat runs only when named: its conversations outgrow GPT-2's 1024 positions")
    ap.add_argument("--chat-system-prompts", type=int, default=32, help="chat: the system prompts conversations start from")
    ap.add_argument("--turns", type=int, default=8, help="chat: user turns per conversation")
    ap.add_argument("--clients-per-replica", type=int, default=64,
                    help="closed-loop clients per replica behind the target, so N replicas see the load one does")
    ap.add_argument("--requests-per-replica", type=int, default=3072, help="requests per run, per replica")
    ap.add_argument("--system-prompts", type=int, default=128)
    ap.add_argument("--system-words", type=int, nargs=2, default=[300, 560],
                    help="~400-750 GPT-2 tokens: with the user turn and the output, within GPT-2's 1024")
    ap.add_argument("--user-words", type=int, nargs=2, default=[8, 40])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--client-processes", type=int, default=16,
                    help="client processes sharing the clients (a multiple of --replicas for the direct runs). "
                         "One tops out near 10k streamed tokens/s, and two H100 replicas of GPT-2 small served "
                         "up to 72k with 8 (2026-11-25); each row's client_cpu_util is the busiest one's CPU "
                         "time over its wall time")
    ap.add_argument("--block-size", type=int, default=16, help="the replicas' KV block size (hit tokens = blocks x this)")
    ap.add_argument("--no-baseline", action="store_true",
                    help="skip the direct runs (one replica alone, and the replicas without a router), nosharing")
    ap.add_argument("--tag", default="", help="added to the result file's name: a second workload of one model")
    ap.add_argument("--out-dir", default="benchmarks/results")
    args = ap.parse_args(argv)

    import torch
    import triton

    work = Path(tempfile.mkdtemp(prefix="scaleout-"))
    model = args.model
    if model is None and args.model_shape == "gpt2":
        model = str(make_random_gpt2(work / "gpt2-small", dtype=torch.float16))
    elif model is None:
        model = str(make_random_llama(work / args.model_shape, args.model_shape, device=args.device))
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    replica_args = ["--block-size", str(args.block_size), *(["--num-blocks", str(args.num_blocks)] if args.num_blocks else []),
                    *args.server_args.split()]
    procs = start_replicas(model, args.replicas, args.device, replica_args, work)
    urls = [p.url for p in procs]
    rows, seed = [], 0

    def run(impl: str, policy: str, targets: list[str], replicas: list[str], workload: str,
            router_metrics: str | None = None) -> None:
        nonlocal seed
        seed += 1
        n = len(replicas)
        rows.append({"impl": impl, "replicas": n, "policy": policy,
                     **run_once(targets, replicas, workload, seed, args, args.clients_per_replica * n,
                                args.requests_per_replica * n, router_metrics)})
        print_row(rows[-1])

    try:
        if not args.no_baseline:  # one replica alone, then all of them with the clients dealt evenly: no router
            run("flashpage", "direct", urls[:1], urls[:1], "nosharing")
            run("flashpage", "direct", urls, urls, "nosharing")
        for policy in args.policies:
            router = start_router(urls, policy, work / f"router-{policy}.log")
            try:
                for workload in args.workloads:
                    run(f"flashpage + vllm-router ({policy})", policy, [router.url], urls, workload,
                        router.metrics_url)
            finally:
                router.stop(10)
    finally:
        for p in procs:
            p.stop(30)
    result = {"device": device_name, "torch": torch.__version__.split("+")[0], "triton": triton.__version__,
              "date": datetime.date.today().isoformat(), "model": args.model or args.model_shape,
              "command": "python -m benchmarks.scaleout.bench_scaleout " + shlex.join(argv if argv is not None else sys.argv[1:]),
              "workload": {"server_args": shlex.join(replica_args),
                           **{k: getattr(args, k) for k in ("clients_per_replica", "requests_per_replica",
                                                            "system_prompts", "system_words", "user_words",
                                                            "max_tokens", "client_processes", "chat_system_prompts",
                                                            "turns")}},
              "router": router_version(), "rows": rows}
    # scaleout_<shape>_<gpu>.json (scaleout_<gpu>.json for a --model of one's own)
    prefix = "scaleout" if args.model else f"scaleout_{args.model_shape}"
    prefix += f"_{args.tag}" if args.tag else ""
    result["plot"] = f"{prefix}_{gpu_slug(device_name)}.png"
    path = write_result(result, args.out_dir, prefix)
    plot(result, str(path.with_suffix(".png")))
    print(report(result))
    print(f"wrote {path}")
    return 0


def router_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"vllm-router {version('vllm-router')}"
    except PackageNotFoundError:
        return "vllm-router"


if __name__ == "__main__":
    sys.exit(main())
