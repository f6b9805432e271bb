"""What the scale-out benchmark (benchmarks/scaleout/bench_scaleout.py) reports, none of it needing a GPU: a
progress line per run, the docs/benchmarks.md section for a scaleout_<gpu>.json (`report`, called by
benchmarks/make_report.py) and its plot.

Rows carry replicas, policy ("direct": clients talk to the replicas themselves, dealt evenly; any
other: vllm-router's policy in front of them), workload, output tokens/s, TTFT percentiles, and per
replica the prompt tokens it was sent and the share of them it found in its prefix cache; rows
measured since the observer (benchmarks/scaleout/scaleout_observe.py) also carry a render's time on the
loaded replicas and the gap between their loads.
"""

from __future__ import annotations

from benchmarks.shared.common import gpu_slug


def _model(result: dict) -> str:
    """The model the replicas served (files from before the model shapes were GPT-2 small's)."""
    model = result.get("model", "gpt2")
    return "GPT-2 small" if model == "gpt2" else model


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _split(r: dict) -> str:
    """Each replica's share of the run's prompt tokens: how evenly the policy spread the work."""
    total = sum(r["prompt_tokens"])
    return " / ".join(f"{100 * t / total:.0f}%" for t in r["prompt_tokens"]) if total else "-"


def _render(r: dict) -> str:
    """A render's p50 on the loaded replicas (ms): the replicas' part of what cache_aware adds to a
    first token (it waits for every replica's render)."""
    return "-" if not r.get("render_ms") else f"{r['render_ms']['p50']:.1f}"


def _engine_ttft(r: dict) -> str:
    """The replicas' own TTFT p50 (from a request reaching the engine), from their histograms."""
    return "-" if r.get("replica_ttft_p50_ms") is None else f"{r['replica_ttft_p50_ms']:.1f}"


def _gap(r: dict) -> str:
    """Mean gap between the most and the least loaded replica, in requests in flight."""
    return "-" if r.get("load_gap_mean") is None else f"{r['load_gap_mean']:.1f}"


def print_row(r: dict) -> None:
    t = r["ttft_ms"]
    print(f"{r['replicas']} x {r['policy']:17s} {r['workload']:9s} {r['output_tokens_per_s']:9.0f} tok/s  "
          f"TTFT p50 {t['p50'] or 0:7.1f} ms (engine {_engine_ttft(r)}) p99 {t['p99'] or 0:7.1f} ms  "
          f"hit rate {_pct(r['hit_rate'])}  "
          f"split {_split(r)}  render p50 {_render(r)} ms  load gap {_gap(r)}  busiest client "
          f"{_pct(r.get('client_cpu_util'))}  errors {r['errors']}  "
          f"{r['duration_s']:.1f} s", flush=True)
    for name, moved in (r.get("router_counters") or {}).items():  # how the router routed this run
        print(f"    {name}: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(moved.items())), flush=True)


def baseline(rows: list[dict]) -> float | None:
    """One replica alone on the nosharing workload: what N replicas are compared with."""
    return next((r["output_tokens_per_s"] for r in rows if r["replicas"] == 1 and r["workload"] == "nosharing"), None)


def _workloads(result: dict) -> str:
    """What each workload of the file's rows sends."""
    w, present = result["workload"], {r["workload"] for r in result["rows"]}
    words = f"{w['system_words'][0]}-{w['system_words'][1]} words"
    said = {"shared": f"shared: {w['system_prompts']} system prompts of {words} plus a "
                      f"{w['user_words'][0]}-{w['user_words'][1]}-word user turn",
            "nosharing": f"nosharing: prompts of {words} and a user turn, with nothing in common",
            "chat": f"chat: conversations of {w.get('turns')} user turns of {w['user_words'][0]}-{w['user_words'][1]} "
                    f"words after one of {w.get('chat_system_prompts')} system prompts of {words}, each turn a "
                    "request of the conversation so far with the answers as they came back (random weights: an "
                    "answer does not re-tokenize to its own ids, so each turn computes the last answer again)"}
    return "; ".join(text for name, text in said.items() if name in present) + "."


def report(result: dict) -> str:
    """docs/benchmarks.md section: one row per (replicas, policy, workload), the throughput against one replica."""
    rows, w = result["rows"], result["workload"]
    base = baseline(rows)
    clients = (f"{w['clients_per_replica']} clients per replica" if "clients_per_replica" in w
               else f"{w['clients']} clients")
    requests = (f"{w['requests_per_replica']} streamed /v1/completions per replica" if "requests_per_replica" in w
                else f"{w['num_requests']} streamed /v1/completions")
    lines = [f"Model: {_model(result)} (random weights). Closed loop, {clients}, {requests} per run, "
             f"{w['max_tokens']} output tokens each; {_workloads(result)} "
             f"Replica arguments: `{w['server_args'] or '(defaults)'}`. "
             f"{result.get('router', 'vllm-router')}; policy `direct`: no router, the clients dealt evenly over the "
             "replicas. Hit rate = prompt tokens the replicas found in their prefix caches / prompt tokens, over the "
             "run; split = each replica's share of the prompt tokens; engine TTFT = the replicas' own TTFT p50, from "
             "a request reaching the engine (interpolated in their histogram's buckets); render = a "
             "POST /v1/completions/render's time on the loaded replicas, p50 (`cache_aware` renders on every replica before it routes, so the "
             "slowest render is in each first token); load gap = requests in flight on the busiest replica minus "
             "the idlest, mean over the run.", "",
             "| replicas | policy | workload | output tok/s | vs 1 replica, nosharing | TTFT p50 ms | engine TTFT p50 ms "
             "| TTFT p99 ms | hit rate | per replica | split | render ms | load gap | errors |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|"]
    for r in rows:
        # against one replica on the same workload only: a shared run's hits are no scaling
        vs = f"{r['output_tokens_per_s'] / base:.2f}x" if base and r["workload"] == "nosharing" else "-"
        lines.append(f"| {r['replicas']} | {r['policy']} | {r['workload']} | {r['output_tokens_per_s']:,.0f} | {vs} "
                     f"| {r['ttft_ms']['p50'] or 0:.1f} | {_engine_ttft(r)} | {r['ttft_ms']['p99'] or 0:.1f} "
                     f"| {_pct(r['hit_rate'])} "
                     f"| {' / '.join(_pct(x) for x in r['replica_hit_rates'])} | {_split(r)} | {_render(r)} "
                     f"| {_gap(r)} | {r['errors']} |")
    if result.get("plot"):  # the image's name; True in files from before the model shapes
        name = result["plot"] if isinstance(result["plot"], str) else f"scaleout_{gpu_slug(result['device'])}.png"
        lines += ["", f"![scale-out](benchmarks/results/{name})"]
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Output tokens/s and TTFT p50 per run, side by side, bars labelled with the hit rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [f"{r['replicas']}x {r['policy']}\n{r['workload']}" for r in rows]
    palette = {"direct": "C7", "round_robin": "C0", "cache_aware": "C2"}
    colors = [palette.get(r["policy"], "C1") for r in rows]
    fig, (tput, ttft) = plt.subplots(1, 2, figsize=(12, 4.5))
    bars = tput.bar(labels, [r["output_tokens_per_s"] / 1e3 for r in rows], color=colors)
    tput.bar_label(bars, labels=[f"hit {_pct(r['hit_rate'])}" for r in rows], fontsize=7)
    tput.set(ylabel="output tokens/s (thousands)", title="throughput")
    ttft.bar(labels, [r["ttft_ms"]["p50"] or 0 for r in rows], color=colors)
    ttft.set(ylabel="ms", title="time to first token, p50")
    for ax in (tput, ttft):
        ax.tick_params(axis="x", labelsize=7, rotation=30)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"flashpage replicas ({_model(result)}) behind {result.get('router', 'vllm-router')} - {result['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
