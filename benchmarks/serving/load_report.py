"""The docs/benchmarks.md section for one HTTP load-test result file (load_<gpu>.json, written by
benchmarks/serving/compare.py): the impl x concurrency table, triton's throughput ratios against its peers
at each level, the offline reference (`offline`, from bench_throughput.py) when the file has one,
the API-process table when it has rows with `api_server_count` (compare.py --api-server-counts),
any failures, and links to the plots. make_report.py reaches it as `benchmarks.serving.compare.report`,
which is this function.
"""

from __future__ import annotations

import re

from benchmarks.shared.common import gpu_slug

# The configurations compare.py can run, in the order it runs them and the table lists them.
IMPLS = ("triton", "sdpa", "eager", "naive_hf")


def _fmt(v, digits: int = 1) -> str:
    if v is None:
        return "-"
    return f"{v:,.{digits}f}"


def _jit(n, j) -> str:
    return f"{n} ± {j}" if j else f"{n}"


def _shape(s: dict) -> str:
    """The request shape and per-level bounds of a settings dict, as a clause."""
    per_level = (f"{s['num_requests']} requests" if s.get("num_requests") else
                 f"max({s.get('requests_factor')}·C, {s.get('min_requests')}) requests")
    if s.get("duration_s"):
        per_level += f", cut at {s['duration_s']:g} s"
    return (f"prompts of {_jit(s.get('input_len'), s.get('input_jitter'))} random token ids, outputs of "
            f"{_jit(s.get('output_len'), s.get('output_jitter'))} tokens (`ignore_eos`), greedy; "
            f"per level {per_level}")


def _pct(v, ref) -> str:
    return f"{100 * v / ref:.0f}%" if v and ref else "-"


def report(result: dict) -> str:
    """The docs/benchmarks.md markdown for one load_<gpu>.json: a table impl x concurrency, the triton/eager and
    triton/naive_hf throughput ratios at each concurrency, the offline reference, the API-process
    sweep, and links to the plots."""
    api_rows = [r for r in result["rows"] if r.get("api_server_count") is not None and r.get("concurrency")]
    rows = [r for r in result["rows"] if r.get("concurrency") is not None and r.get("api_server_count") is None]
    slug = result.get("slug") or gpu_slug(result["device"])
    s = result.get("settings", {})
    order = {impl: i for i, impl in enumerate(IMPLS)}
    rows.sort(key=lambda r: (order.get(r["impl"], len(order)), r["concurrency"]))

    present = list(dict.fromkeys(r["impl"] for r in rows))
    ours = [f"`{i}`" for i in present if i != "naive_hf"]
    served = []
    if ours:
        served.append(f"by flashpage with attention {', '.join(ours)}")
    if "naive_hf" in present:
        served.append("by a naive FastAPI + `transformers.generate` server with static batches "
                      "(`naive_hf`, benchmarks/serving/naive_server.py)")
    lines = [f"### HTTP load test on {result['device']}", ""]
    lines.append(
        f"{result.get('model', 'model')}, served {' and '.join(served) or 'by flashpage'}. Closed loop: C concurrent "
        "clients, each streaming `POST /generate` requests back to back")
    if s:
        lines[-1] += f"; {_shape(s)}, each level with prompts of its own (no prefix-cache hits carried over)"
    dates = result.get("impl_dates") or {}
    when = result.get("date")
    if len(set(dates.values())) > 1:  # a merged file: say which rows are of which day
        by_day: dict[str, list[str]] = {}
        for impl in present:
            by_day.setdefault(dates.get(impl, when), []).append(f"`{impl}`")
        when = "; ".join(f"{', '.join(impls)} rows {day}" for day, impls in sorted(by_day.items(), reverse=True))
    lines[-1] += (f". torch {result.get('torch')}, triton {result.get('triton')}, {when}. "
                  f"`{result.get('command')}`")
    lines += ["", "TTFT: time to first token; TPOT: (end-to-end − TTFT) / (output tokens − 1) per request; "
              "ITL: gap between streamed events, per token. Latencies in ms.", ""]
    seqs = s.get("max_num_seqs", 256)
    over = sorted({r["concurrency"] for r in rows if r["concurrency"] > seqs})
    if over:
        lines += [f"At {', '.join(map(str, over))} clients there are more requests than the server runs at once "
                  f"(`--max-num-seqs` {seqs}): the rest wait in its queue, and TTFT includes that wait (the server gets "
                  "`--max-waiting-requests` and `--max-connections` large enough for every client, so that the "
                  "queue answers no 503s).", ""]
    caps = {i: c for i, c in (s.get("impl_max_concurrency") or {}).items() if i in present}
    if caps and any(r["concurrency"] > min(caps.values()) for r in rows):
        lines += [", ".join(f"`{i}`" for i in caps) + f" run up to {'/'.join(str(c) for c in dict.fromkeys(caps.values()))} "
                  "clients (`--impl-max-concurrency`; they are about ten times slower than triton).", ""]
    if rows:
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
            if any(cell != "-" for cell in cells):
                lines.append(f"| {c} | " + " | ".join(cells) + " |")
    lines += _offline(result, by)
    lines += _api_table(result, api_rows)
    for f in result.get("failures", []):
        who = f["impl"] if f.get("api_server_count") is None else f"{f['impl']}` with `--api-server-count {f['api_server_count']}"
        lines += ["", f"`{who}` failed at {f['stage']}: {f['message'].splitlines()[0][:200]}"]
    if rows:
        lines += ["", f"![throughput vs concurrency](benchmarks/results/load_{slug}_throughput.png)",
                  f"![latency percentiles vs concurrency](benchmarks/results/load_{slug}_latency.png)"]
    if api_rows:
        lines += ["", f"![throughput and latency vs API processes](benchmarks/results/load_{slug}_api_servers.png)"]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)) + "\n"


REF_CLIENTS = 256  # the level the offline reference is set against


def _offline(result: dict, by: dict) -> list[str]:
    """The offline engine's figure (bench_throughput.py) and the HTTP server's share of it at 256 clients."""
    off = result.get("offline") or {}
    ref = off.get("output_tokens_per_s")
    if not ref:
        return []
    w = off.get("workload") or {}
    shape = ""
    if w.get("input_len") and w.get("output_len"):
        shape = (f", {w.get('num_requests')} requests of {w['input_len'][0]}–{w['input_len'][1]} prompt and "
                 f"{w['output_len'][0]}–{w['output_len'][1]} output tokens")
    lines = ["", f"Offline reference: our engine through its Python API, no HTTP (`benchmarks/engine/bench_throughput.py`"
             f"{shape}), {ref:,.0f} output tok/s; {off.get('date')}, `{off.get('command')}`."]
    r = by.get(("triton", REF_CLIENTS))
    if r and r.get("output_tokens_per_s"):
        lines[-1] += (f" At {REF_CLIENTS} clients: {r['output_tokens_per_s']:,.0f} tok/s = "
                      f"{_pct(r['output_tokens_per_s'], ref)} of offline (triton, the table above).")
    return lines


def _api_table(result: dict, rows: list[dict]) -> list[str]:
    """API processes x clients: throughput (against one process and offline) and latencies."""
    if not rows:
        return []
    sw = result.get("api_sweep") or {}
    ref = (result.get("offline") or {}).get("output_tokens_per_s")
    rows = sorted(rows, key=lambda r: (r["impl"], r["concurrency"], r["api_server_count"]))
    one = {(r["impl"], r["concurrency"]): r for r in rows if r["api_server_count"] == 1}
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    lines = ["", f"API processes: the {', '.join(f'`{i}`' for i in impls)} server started with `--api-server-count N` "
             "(N API processes sharing one listening socket in front of one engine process; the default comes from the cores: 4 on a 16-core host), "
             "C clients" + (f"; {_shape(sw)}" if sw else "") + (f"; {sw.get('date')}, `{sw.get('command')}`" if sw else "")
             + ". ITL counts an event of k tokens as one gap and k − 1 zeros, so an ITL p50 of 0 means that most "
             "tokens arrive several to an event.", ""]
    head = "| API processes | impl | clients | output tok/s | vs 1 process |" if len(impls) > 1 else \
        "| API processes | clients | output tok/s | vs 1 process |"
    head += (" % of offline |" if ref else "") + " TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | TPOT p50 | errors |"
    n_cols = head.count("|") - 1
    lines += [head, "|---:|" + ("---|" if len(impls) > 1 else "") + "---:|" * (n_cols - 1 - (len(impls) > 1))]
    for r in rows:
        tput = r.get("output_tokens_per_s")
        base = one.get((r["impl"], r["concurrency"]), {}).get("output_tokens_per_s")
        err = str(r.get("errors", 0)) + (f" ({r['cancelled']} cut at deadline)" if r.get("cancelled") else "")
        cells = [str(r["api_server_count"]), *([r["impl"]] if len(impls) > 1 else []), str(r["concurrency"]),
                 _fmt(tput, 0), f"{tput / base:.2f}×" if tput and base else "-", *([_pct(tput, ref)] if ref else []),
                 _fmt(r.get("ttft_p50_ms")), _fmt(r.get("ttft_p99_ms")), _fmt(r.get("itl_p50_ms"), 2),
                 _fmt(r.get("itl_p99_ms"), 2), _fmt(r.get("tpot_p50_ms"), 2), err]
        lines.append("| " + " | ".join(cells) + " |")
    return lines
