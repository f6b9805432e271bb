"""What the replicas and the router look like from the side during a scale-out run
(benchmarks/scaleout/bench_scaleout.py): how far apart the replicas' loads drift, how long a render takes on
them under that load, and the router's own counters of how it routed.

Why the second: vllm-router's `cache_aware` asks every replica's POST /v1/completions/render for
the prompt's tokens and waits for all of them before it forwards the request (seen with stub
replicas: a render made 50 ms slower made every routed request's first token 50 ms later, and
each replica got one render per request). So the slowest replica's render time is part of the
time to first token under `cache_aware` and not under `round_robin`: measuring it apart tells a
router's cost from a replica's.
"""

from __future__ import annotations

import threading
import time

import httpx

from benchmarks.shared.common import summarize


class Observer(threading.Thread):
    """Every `interval` s until stopped: each replica's requests in flight (running + waiting, from
    GET /debug/kv) and the time of one POST /v1/completions/render of `prompt` to each, in turn.
    Each render's prompt ends in a new number: a replica remembers the prompts it tokenized lately
    (server/api/tokenize.py), and the routed requests it stands for are new to it."""

    def __init__(self, replicas: list[str], model: str, prompt: str, interval: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.replicas, self.interval = replicas, interval
        self.body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "stream": True}
        self.loads: list[list[int]] = []
        self.render_s: list[float] = []
        self.renders = 0  # renders sent (each with a prompt of its own)
        self.errors = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop_event.wait(self.interval):
                try:
                    self.loads.append([_in_flight(client, url) for url in self.replicas])
                    for url in self.replicas:
                        self.renders += 1
                        body = {**self.body, "prompt": f"{self.body['prompt']} {self.renders}"}
                        t0 = time.perf_counter()
                        client.post(url + "/v1/completions/render", json=body).raise_for_status()
                        self.render_s.append(time.perf_counter() - t0)
                except httpx.HTTPError:
                    self.errors += 1

    def stop(self) -> dict:
        """Stop sampling; a summary: render time percentiles (ms), and the gap between the most and
        the least loaded replica (mean and max over the samples) with each replica's mean load."""
        self._stop_event.set()
        self.join(10)
        gaps = [max(s) - min(s) for s in self.loads]
        n = max(len(self.loads), 1)
        return {"render_ms": summarize(self.render_s, 1e3) if self.render_s else None,
                "load_gap_mean": sum(gaps) / n if gaps else None, "load_gap_max": max(gaps, default=None),
                "load_mean": [sum(s[i] for s in self.loads) / n for i in range(len(self.replicas))],
                "samples": len(self.loads), "observer_errors": self.errors}


def _in_flight(client: httpx.Client, url: str) -> int:
    kv = client.get(url + "/debug/kv").json()
    return kv["requests_running"] + kv["requests_waiting"]


# The router's own counters of how it routed, by the label that tells the cases apart: whether the
# prefix lookup found a replica (`prefix_hit`, `prefix_miss`, `missing_tokens`: no usable token ids),
# and what each replica's render gave it (`render`; anything else is a render it could not use).
ROUTER_COUNTERS = {"vllm_router_prefix_routing_decisions_total": "outcome",
                   "vllm_router_kv_routing_inputs_total": "result"}
Counters = dict[str, dict[str, float]]  # counter name -> label value -> count


def metric_samples(metrics_url: str) -> list:
    """Every sample a Prometheus endpoint serves now (a replica's /metrics, the router's)."""
    from prometheus_client.parser import text_string_to_metric_families

    return [s for fam in text_string_to_metric_families(httpx.get(metrics_url, timeout=30).text) for s in fam.samples]


def router_counters(metrics_url: str) -> Counters:
    """ROUTER_COUNTERS as vllm-router's Prometheus endpoint has them now: name -> label value -> count."""
    out: Counters = {name: {} for name in ROUTER_COUNTERS}
    for s in metric_samples(metrics_url):
        if s.name in ROUTER_COUNTERS:
            key = s.labels.get(ROUTER_COUNTERS[s.name], "")
            out[s.name][key] = out[s.name].get(key, 0.0) + s.value
    return out


def counter_deltas(before: Counters, after: Counters) -> Counters:
    """What the counters moved by over a run (label values that did not move are left out)."""
    return {name: {k: v - before.get(name, {}).get(k, 0.0) for k, v in values.items()
                   if v != before.get(name, {}).get(k, 0.0)} for name, values in after.items()}
