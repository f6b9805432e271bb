"""The README section for one HTTP load-test result file (load_<gpu>.json, written by
benchmarks/compare.py): the impl x concurrency table, triton's throughput ratios against its peers
at each level, any failures, and links to the plots. make_report.py reaches it as
`benchmarks.compare.report`, which is this function.
"""

from __future__ import annotations

from benchmarks.common import gpu_slug

# The configurations compare.py can run, in the order it runs them and the table lists them.
IMPLS = ("triton", "sdpa", "eager", "naive_hf")


def _fmt(v, digits: int = 1) -> str:
    if v is None:
        return "-"
    return f"{v:,.{digits}f}"


def report(result: dict) -> str:
    """The README markdown for one load_<gpu>.json: a table impl x concurrency, the triton/eager and
    triton/naive_hf throughput ratios at each concurrency, and links to the plots."""
    rows = [r for r in result["rows"] if r.get("concurrency") is not None]
    slug = result.get("slug") or gpu_slug(result["device"])
    s = result.get("settings", {})
    order = {impl: i for i, impl in enumerate(IMPLS)}
    rows.sort(key=lambda r: (order.get(r["impl"], len(order)), r["concurrency"]))

    def jit(n, j):
        return f"{n} ± {j}" if j else f"{n}"

    present = list(dict.fromkeys(r["impl"] for r in rows))
    ours = [f"`{i}`" for i in present if i != "naive_hf"]
    served = []
    if ours:
        served.append(f"by flashpage with attention {', '.join(ours)}")
    if "naive_hf" in present:
        served.append("by a naive FastAPI + `transformers.generate` server with static batches "
                      "(`naive_hf`, benchmarks/naive_server.py)")
    lines = [f"### HTTP load test on {result['device']}", ""]
    lines.append(
        f"{result.get('model', 'model')}, served {' and '.join(served)}. Closed loop: C concurrent clients, each "
        "streaming `POST /generate` requests back to back")
    if s:
        per_level = (f"{s['num_requests']} requests" if s.get("num_requests") else
                     f"max({s.get('requests_factor')}·C, {s.get('min_requests')}) requests")
        if s.get("duration_s"):
            per_level += f", cut at {s['duration_s']:g} s"
        lines[-1] += (f"; prompts of {jit(s.get('input_len'), s.get('input_jitter'))} random token ids, outputs of "
                      f"{jit(s.get('output_len'), s.get('output_jitter'))} tokens (`ignore_eos`), greedy; "
                      f"per level {per_level}, each level with prompts of its own (no prefix-cache hits carried "
                      "over)")
    lines[-1] += (f". torch {result.get('torch')}, triton {result.get('triton')}, {result.get('date')}. "
                  f"`{result.get('command')}`")
    lines += ["", "TTFT: time to first token; TPOT: (end-to-end − TTFT) / (output tokens − 1) per request; "
              "ITL: gap between streamed events, per token. Latencies in ms.", ""]
    lines.append("| impl | concurrency | output tok/s | req/s | TTFT p50 | TTFT p99 | TPOT p50 | ITL p99 | errors |")
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        err = str(r.get("errors", 0))
        if r.get("cancelled"):
            err += f" ({r['cancelled']} cut at deadline)"
        lines.append(f"| {r['impl']} | {r['concurrency']} | {_fmt(r.get('output_tokens_per_s'), 0)} | "
                     f"{_fmt(r.get('requests_per_s'), 2)} | {_fmt(r.get('ttft_p50_ms'))} | {_fmt(r.get('ttft_p99_ms'))} | "
                     f"{_fmt(r.get('tpot_p50_ms'), 2)} | {_fmt(r.get('itl_p99_ms'), 2)} | {err} |")

    by = {(r["impl"], r["concurrency"]): r for r in rows}
    levels = sorted({r["concurrency"] for r in rows})
    peers = [p for p in ("eager", "naive_hf") if any(k[0] == p for k in by)]
    if any(k[0] == "triton" for k in by) and peers:
        lines += ["", "Output-token throughput of flashpage's Triton kernels relative to:", "",
                  "| concurrency | " + " | ".join(f"triton / {p}" for p in peers) + " |",
                  "|---:|" + "---:|" * len(peers)]
        for c in levels:
            cells = []
            for p in peers:
                a, b = by.get(("triton", c)), by.get((p, c))
                ok = a and b and a.get("output_tokens_per_s") and b.get("output_tokens_per_s")
                cells.append(f"{a['output_tokens_per_s'] / b['output_tokens_per_s']:.2f}×" if ok else "-")
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
    for f in result.get("failures", []):
        lines += ["", f"`{f['impl']}` failed at {f['stage']}: {f['message'].splitlines()[0][:200]}"]
    lines += ["", f"![throughput vs concurrency](benchmarks/results/load_{slug}_throughput.png)",
              f"![latency percentiles vs concurrency](benchmarks/results/load_{slug}_latency.png)"]
    return "\n".join(lines) + "\n"
