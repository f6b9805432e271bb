"""The README's one performance table: flashpage against vLLM and transformers on the shapes that
matter (offline throughput, HTTP throughput at 256 streaming clients, batch-1 time per output token),
each cell taken from a current result file in benchmarks/results/ and linked to it; make_report.py
writes it between the README's headline markers."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.shared.common import gpu_slug

DOC = "docs/benchmarks.md"
OFFLINE_SHAPES = ("gpt2", "llama-3.2-1b", "qwen3-0.6b", "qwen2.5-0.5b", "llama-3.1-8b")
SHAPE_NAMES = {"gpt2": "GPT-2 small", "llama-3.2-1b": "Llama-3.2-1B", "qwen3-0.6b": "Qwen3-0.6B",
               "qwen2.5-0.5b": "Qwen2.5-0.5B", "llama-3.1-8b": "Llama-3.1-8B"}
HTTP_CLIENTS = 256
VLLM_FAILURE = ("vLLM failed in that run; its error (the last line vLLM printed) is under the run in "
                f"[{DOC}]({DOC}#side-by-side-with-vllm), its whole log in the run's logs")
LONG_PROMPTS = {"prompt-8k": "8k", "prompt-32k": "32k"}


def _load(results: Path, name: str) -> dict | None:
    f = results / name
    return json.loads(f.read_text()) if f.exists() else None


def _link(name: str, text: str) -> str:
    return f"[{text}](benchmarks/results/{name})"


class _Row:
    def __init__(self, workload: str, shape: str):
        self.workload, self.shape = workload, shape
        self.cells = {"flashpage": "", "vllm": "", "transformers": ""}
        self.devices: set[str] = set()
        self.dates: set[str] = set()

    def put(self, col: str, value: str, result: dict) -> None:
        self.cells[col] = value
        self.devices.add(gpu_slug(result["device"]).upper())
        self.dates.add(result["date"])

    def line(self) -> str:
        c = self.cells
        return (f"| {self.workload} | {SHAPE_NAMES.get(self.shape, self.shape)} | {c['flashpage']} | {c['vllm'] or '—'} | "
                f"{c['transformers'] or '—'} | {', '.join(sorted(self.devices))} | {', '.join(sorted(self.dates))} |")


def _vllm(row: _Row, result: dict, name: str, value: str | None, failed: list) -> None:
    if value is not None:
        row.put("vllm", value, result)
    elif any(r.get("engine") == "vllm" or r.get("impl") == "vllm" for r in result["rows"] if "error" in r):
        row.cells["vllm"] = f"— ([failed]({DOC}#side-by-side-with-vllm)¹)"
        failed.append(name)


def headline(results: Path) -> str:
    rows: list[_Row] = []
    failed: list[str] = []
    for shape in OFFLINE_SHAPES:  # offline: output tokens/s, 256 requests of 128-512 tokens in and out
        row = _Row("offline, tok/s", shape)
        name = f"peers_offline_{shape}_h100.json"
        peers = _load(results, name)
        if peers:
            by = {r["impl"]: r for r in peers["rows"] if "error" not in r}
            if "flashpage" in by:
                row.put("flashpage", _link(name, f"{by['flashpage']['output_tokens_per_s']:,.0f}"), peers)
            _vllm(row, peers, name, f"{by['vllm']['output_tokens_per_s']:,.0f}" if "vllm" in by else None, failed)
        tname = f"throughput_{shape}_h100.json"
        tput = _load(results, tname)
        if tput:
            by = {r["impl"]: r for r in tput["rows"] if r.get("output_tokens_per_s")}
            if not row.cells["flashpage"] and "flashpage" in by:
                row.put("flashpage", _link(tname, f"{by['flashpage']['output_tokens_per_s']:,.0f}"), tput)
            hf = max((by[i] for i in ("hf_sdpa", "hf_eager") if i in by), key=lambda r: r["output_tokens_per_s"],
                     default=None)
            if hf:
                row.put("transformers", _link(tname, f"{hf['output_tokens_per_s']:,.0f} ({hf['impl']})"), tput)
        if row.cells["flashpage"]:
            rows.append(row)
    # HTTP: output tokens/s at 256 streaming clients
    load = _load(results, "load_h100.json")
    if load:
        row = _Row(f"HTTP, {HTTP_CLIENTS} clients, tok/s", "gpt2")
        by = {r["impl"]: r for r in load["rows"] if r.get("concurrency") == HTTP_CLIENTS
              and r.get("api_server_count") is None}
        if "triton" in by:
            row.put("flashpage", _link("load_h100.json", f"{by['triton']['output_tokens_per_s']:,.0f}"), load)
            if "naive_hf" in by:
                row.put("transformers", _link("load_h100.json", f"{by['naive_hf']['output_tokens_per_s']:,.0f}"), load)
            rows.append(row)
    for shape in OFFLINE_SHAPES:
        name = f"peers_http_{shape}_h100.json"
        peers = _load(results, name)
        if not peers:
            continue
        row = _Row(f"HTTP, {HTTP_CLIENTS} clients, tok/s", shape)
        by = {(r["impl"]): r for r in peers["rows"] if r.get("client") == "vllm-bench"
              and r.get("concurrency") == HTTP_CLIENTS and "error" not in r}
        if "flashpage" in by:
            row.put("flashpage", _link(name, f"{by['flashpage']['output_tokens_per_s']:,.0f}"), peers)
            _vllm(row, peers, name, f"{by['vllm']['output_tokens_per_s']:,.0f}" if "vllm" in by else None, failed)
            rows.append(row)
    for shape in OFFLINE_SHAPES:  # batch 1: time per output token, 512-token prompt, 256 outputs
        name = f"peers_batch1_{shape}_h100.json"
        peers = _load(results, name)
        if not peers:
            continue
        row = _Row("batch 1, TPOT ms", shape)
        by = {r["impl"]: r for r in peers["rows"] if r.get("kind") == "latency" and "error" not in r}
        if "flashpage" in by:
            row.put("flashpage", _link(name, f"{by['flashpage']['tpot_ms']:.2f}"), peers)
            _vllm(row, peers, name, f"{by['vllm']['tpot_ms']:.2f}" if "vllm" in by else None, failed)
            rows.append(row)
    name = "peers_long_llama-3.1-8b_h100.json"  # long prompts, batch 1: TTFT, then TPOT after the prompt
    peers = _load(results, name)
    for task, label in LONG_PROMPTS.items() if peers else ():
        by = {r["impl"]: r for r in peers["rows"] if r.get("task") == task and "error" not in r}
        for metric, what in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT")):
            row = _Row(f"{label}-token prompt, batch 1, {what} ms", "llama-3.1-8b")
            if "flashpage" in by:
                row.put("flashpage", _link(name, f"{by['flashpage'][metric]:,.{0 if metric == 'ttft_ms' else 2}f}"), peers)
                _vllm(row, peers, name, f"{by['vllm'][metric]:,.{0 if metric == 'ttft_ms' else 2}f}" if "vllm" in by
                      else None, failed)
                rows.append(row)
    lines = ["| workload | model (random weights) | flashpage | vLLM | transformers | device | date |",
             "|---|---|---:|---:|---:|---|---|", *(r.line() for r in rows), "",
             "Offline: 256 requests of 128–512 tokens in and out (transformers: `generate` in static batches, the "
             "faster of its eager and SDPA attention). HTTP, streamed: Qwen2.5-0.5B with 512-token prompts and 256 "
             "outputs, driven by vLLM's client (`vllm bench serve`); GPT-2 small with prompts of 512 ± 128 and "
             "outputs of 256 ± 64 tokens, driven by ours, transformers behind the naive server "
             "(`benchmarks/serving/naive_server.py`). Batch 1: a 512-token prompt, 256 outputs; long prompts: "
             "128 outputs, TTFT a 1-token request. —: not run. "
             f"Every run, its command and the rest: [{DOC}]({DOC})."]
    if failed:
        lines += ["", f"¹ {VLLM_FAILURE}."]
    return "\n".join(lines)
