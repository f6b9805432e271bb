"""docs/benchmarks.md's tables for the side-by-side files (benchmarks/results/peers_<workload>_<shape>_<gpu>.json):
`report(result)` renders one file, with both engines' numbers in each row, flashpage's as a share of
vLLM's, the versions and the flags both ran under. benchmarks/make_report.py calls it."""

from __future__ import annotations

ENGINE_NAMES = {"flashpage": "flashpage", "vllm": "vLLM"}


def _fmt(v, digits: int = 1) -> str:
    return "–" if v is None else f"{v:,.{digits}f}"


def _ratio(a, b) -> str:
    return f"{a / b:.2f}×" if a and b else "–"


def flags_line(result: dict) -> str:
    f, eng = result["flags"], result.get("engines", {})
    v = eng.get("vllm", {}).get("versions", {})
    fp = eng.get("flashpage", {}).get("versions", {})
    parts = [f"vLLM {v.get('vllm', '?')} (default attention backend: FlashAttention 3 on Hopper; torch.compile and "
             "CUDA graphs on, its defaults; structured outputs: XGrammar, JSON without free whitespace as in "
             f"flashpage), flashpage {fp.get('flashpage') or '(this tree)'} (`--attention triton`, "
             "CUDA graphs)",
             f"both: max_model_len {f['max_model_len']}, max_num_seqs {f['max_num_seqs']}, max_num_batched_tokens "
             f"{f['max_num_batched_tokens']}, gpu_memory_utilization {f['gpu_memory_utilization']}, block size "
             f"{f['block_size']}, chunked prefill {'on' if f['enable_chunked_prefill'] else 'off'}, prefix caching "
             f"{'on' if f['enable_prefix_caching'] else 'off'}, KV cache {f['kv_cache_dtype']}, {f['dtype']}"
             + (f", {f['api_server_count']} API processes" if f.get("api_server_count") else "")
             + (f", tensor parallel over {f['tensor_parallel_size']} GPUs (each engine's custom all-reduce, "
                "NCCL's where it does not apply; NVLink multicast off in both)"
                if f.get("tensor_parallel_size", 1) > 1 else "")
             + (", random weights made by each engine (`--load-format dummy`)" if f.get("load_format") == "dummy" else "")]
    return "; ".join(parts) + "."


def _by(rows: list[dict], *keys) -> dict:
    return {tuple(r.get(k) for k in keys): r for r in rows if "error" not in r}


def _errors(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        if "error" in r:
            first = r["error"].strip().splitlines()
            out.append(f"- {ENGINE_NAMES.get(r['impl'], r['impl'])} failed{' on ' + r['task'] if r.get('task') else ''}: "
                       f"`{first[-1] if first else ''}`")
    return out


def offline_table(result: dict) -> list[str]:
    by = _by(result["rows"], "task", "impl")
    lines = ["| workload | flashpage tok/s | vLLM tok/s | flashpage / vLLM |", "|---|---:|---:|---:|"]
    for task, what in (("random", "256 requests, in/out 128–512, greedy"),
                       ("nano-vllm", "nano-vllm's bench.py (in/out 100–1024, temperature 0.6)")):
        a, b = by.get((task, "flashpage"), {}), by.get((task, "vllm"), {})
        if a or b:
            x, y = a.get("output_tokens_per_s"), b.get("output_tokens_per_s")
            lines.append(f"| {what} | {_fmt(x, 0)} | {_fmt(y, 0)} | {_ratio(x, y)} |")
    return lines


def latency_table(result: dict) -> list[str]:
    by = _by(result["rows"], "task", "impl")
    lines = ["| prompt → outputs | TTFT flashpage | TTFT vLLM | TPOT flashpage | TPOT vLLM | TPOT flashpage / vLLM |",
             "|---|---:|---:|---:|---:|---:|"]
    for task in dict.fromkeys(r["task"] for r in result["rows"] if r.get("kind") == "latency"):
        a, b = by.get((task, "flashpage"), {}), by.get((task, "vllm"), {})
        ref = a or b
        lines.append(f"| {ref.get('prompt_len', '?'):,} → {ref.get('max_tokens', '?')} | {_fmt(a.get('ttft_ms'), 2)} ms | "
                     f"{_fmt(b.get('ttft_ms'), 2)} ms | {_fmt(a.get('tpot_ms'), 3)} ms | {_fmt(b.get('tpot_ms'), 3)} ms | "
                     f"{_ratio(a.get('tpot_ms'), b.get('tpot_ms'))} |")
    return lines


def structured_table(result: dict) -> list[str]:
    lines = ["| engine | with the schema (tok/s) | unconstrained, same lengths | ratio | parsed | mean tokens |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        if "error" not in r:
            lines.append(f"| {ENGINE_NAMES[r['impl']]} | {_fmt(r['with_tok_s'], 0)} | {_fmt(r['without_tok_s'], 0)} | "
                         f"{r['ratio']:.2f} | {r['parsed']}/{r['batch']} | {r['mean_len']} |")
    return lines


HTTP_COLS = (("output_tokens_per_s", "tok/s", 0), ("ttft_p50_ms", "TTFT p50", 1), ("ttft_p99_ms", "TTFT p99", 1),
             ("itl_p50_ms", "ITL p50", 2), ("itl_p99_ms", "ITL p99", 2), ("tpot_p50_ms", "TPOT p50", 2))


def http_table(result: dict, client: str) -> list[str]:
    rows = [r for r in result["rows"] if r.get("client") == client and "error" not in r]
    if not rows:
        return []
    by = _by(rows, "level", "impl")
    head = " | ".join(f"{label} fp | {label} vLLM" for _, label, _ in HTTP_COLS)
    lines = [f"| clients | {head} | failed fp | failed vLLM | tok/s flashpage / vLLM |",
             "|---:|" + "---:|" * (2 * len(HTTP_COLS) + 3)]
    for level in dict.fromkeys(r["level"] for r in rows):
        a, b = by.get((level, "flashpage"), {}), by.get((level, "vllm"), {})
        conc = (a or b).get("concurrency")
        cells = " | ".join(f"{_fmt(a.get(k), d)} | {_fmt(b.get(k), d)}" for k, _, d in HTTP_COLS)
        lines.append(f"| {conc} | {cells} | {_failed(a)} | {_failed(b)} | "
                     f"{_ratio(a.get('output_tokens_per_s'), b.get('output_tokens_per_s'))} |")
    return lines


def _failed(row: dict) -> str:
    """Requests of a level that got no answer: "0", or "628 of 2048 (503 ×628)" with the statuses our client
    counted; a throughput beside failures is not comparable, so the table must show them."""
    if not row:
        return "–"
    n = row.get("errors") or 0
    if not n:
        return "0"
    statuses = ", ".join(f"{k} ×{v}" for k, v in (row.get("errors_by_status") or {}).items())
    return f"{n} of {row.get('num_requests', '?')}" + (f" ({statuses})" if statuses else "")


CLIENT_TITLES = {"vllm-bench": "driven by `vllm bench serve` (vLLM's client)",
                 "flashpage-load": "driven by benchmarks/serving/load_test.py (ours, /v1/completions)"}


def summary(result: dict) -> str:
    """One cell for docs/benchmarks.md's table of runs: each engine's main figure, or that it failed."""
    kind, cells = result["workload"], []
    for engine in ENGINE_NAMES:
        rows = [r for r in result["rows"] if r.get("impl") == engine or r.get("engine") == engine]
        ok = [r for r in rows if "error" not in r]
        if not ok:
            cells.append(f"{ENGINE_NAMES[engine]} failed" if rows else "")
        elif kind in ("batch1", "long", "long-fp8"):
            cells.append(f"{ENGINE_NAMES[engine]} TPOT " + " / ".join(f"{r['tpot_ms']:.2f}" for r in ok) + " ms")
        elif kind in ("http", "prefix"):
            best = max(ok, key=lambda r: r.get("output_tokens_per_s") or 0)
            cells.append(f"{ENGINE_NAMES[engine]} up to {best['output_tokens_per_s']:,.0f} tok/s")
        elif kind == "structured":
            cells.append(f"{ENGINE_NAMES[engine]} {ok[0]['ratio']:.2f}× unconstrained")
        else:
            cells.append(f"{ENGINE_NAMES[engine]} {ok[0]['output_tokens_per_s']:,.0f} tok/s")
    return "; ".join(c for c in cells if c)


def report(result: dict) -> str:
    kind = result["workload"]
    out = [flags_line(result), ""]
    if kind in ("offline", "nanovllm"):
        out += offline_table(result)
    elif kind in ("batch1", "long", "long-fp8"):
        out += ["Batch 1, one request at a time (TTFT: a 1-token request; TPOT: (end to end − TTFT) / (outputs − 1)):",
                "", *latency_table(result)]
    elif kind == "structured":
        out += ["64 prompts of 128 tokens under benchmarks/engine/bench_structured.py's JSON schema (XGrammar in both), "
                "greedy, to the grammar's end, against the same prompts unconstrained at the same lengths:", "",
                *structured_table(result)]
    elif kind in ("http", "prefix"):
        what = ("streamed /v1/completions, 512-token prompts, 256 outputs (ignore_eos)" if kind == "http" else
                "shared prefixes (vLLM's prefix_repetition dataset), prefix caching on in both")
        for client, title in CLIENT_TITLES.items():
            table = http_table(result, client)
            if table:
                out += [f"{what}, {title}; latencies in ms:", "", *table, ""]
    else:
        raise ValueError(f"unknown workload {kind!r}")
    errors = _errors(result["rows"])
    if errors:
        out += ["", *errors]
    return "\n".join(out).rstrip()
