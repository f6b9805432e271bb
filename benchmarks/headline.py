"""The README's one performance table: flashpage against vLLM and transformers on the shapes that
matter (offline throughput, HTTP throughput at 256 streaming clients, batch-1 time per output token),
each cell taken from a current result file in benchmarks/results/ and linked to it; then what the
capabilities past 16-bit decoding (speculation, quantized weights, an FP8 KV cache, tensor
parallelism) change on the Llama-3.1-8B shape, against their issues' goals. make_report.py writes
both between the README's headline markers."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.shared.common import gpu_slug
from server.config import SPEC_BACKOFF

DOC = "docs/benchmarks.md"
OFFLINE_SHAPES = ("gpt2", "llama-3.2-1b", "qwen3-0.6b", "qwen2.5-0.5b", "llama-3.1-8b")
# quantized copies of a shape's checkpoint (benchmarks/peers/workloads.py), both engines on the same files:
# their offline and batch-1 rows come from an H100's run where there is one, else another GPU's
QUANT_SHAPES = ("llama-3.1-8b.fp8-dynamic", "llama-3.1-8b.awq")
# shapes split over several GPUs (--tensor-parallel-size, the files' _tp<N>): likewise any GPU's run
TP_SHAPES = ("llama-3.1-8b_tp2", "llama-3.1-70b_tp4")
SHAPE_NAMES = {"gpt2": "GPT-2 small", "llama-3.2-1b": "Llama-3.2-1B", "qwen3-0.6b": "Qwen3-0.6B",
               "qwen2.5-0.5b": "Qwen2.5-0.5B", "llama-3.1-8b": "Llama-3.1-8B",
               "llama-3.1-8b.fp8-dynamic": "Llama-3.1-8B, FP8_DYNAMIC weights", "llama-3.1-8b.awq": "Llama-3.1-8B, AWQ weights",
               "llama-3.1-8b_tp2": "Llama-3.1-8B, tensor parallel over 2 GPUs",
               "llama-3.1-70b_tp4": "Llama-3.1-70B, tensor parallel over 4 GPUs"}
HTTP_CLIENTS = 256
VLLM_FAILURE = ("vLLM failed in that run; its error (the last line vLLM printed) is under the run in "
                f"[{DOC}]({DOC}#side-by-side-with-vllm), its whole log in the run's logs")
LONG_PROMPTS = {"prompt-8k": "8k", "prompt-32k": "32k"}


# the custom all-reduce is kernels/one_shot_all_reduce.py from this date; before, torch's symm_mem one-shot
CUSTOM_ALL_REDUCE_SINCE = "2026-11-28"
POLICIES = "spec_draft_model_eagle3_policies_h100.json"  # bench_spec --methods draft_model eagle3 --policies ...


def _load(results: Path, name: str) -> dict | None:
    f = results / name
    return json.loads(f.read_text()) if f.exists() else None


def _peers_name(results: Path, workload: str, shape: str) -> str:
    """peers_<workload>_<shape>_h100.json; for a quantized or split shape without one, another GPU's file."""
    name = f"peers_{workload}_{shape}_h100.json"
    if shape in QUANT_SHAPES + TP_SHAPES and not (results / name).exists():
        others = sorted(results.glob(f"peers_{workload}_{shape}_*.json"))
        name = others[0].name if others else name
    return name


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
    for shape in OFFLINE_SHAPES + QUANT_SHAPES + TP_SHAPES:  # offline: output tokens/s, 256 requests of 128-512 tokens in and out
        row = _Row("offline, tok/s", shape)
        name = _peers_name(results, "offline", shape)
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
    for shape in OFFLINE_SHAPES + QUANT_SHAPES + TP_SHAPES:  # batch 1: time per output token, 512-token prompt, 256 outputs
        name = _peers_name(results, "batch1", shape)
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


def _ratio(without: float, with_: float, lower_is_better: bool) -> float:
    return without / with_ if lower_is_better else with_ / without


def capabilities(results: Path) -> str:
    """One row per capability and measure: without, with, the speed-up (or the ratio the goal is
    stated in), the goal, from the current spec_, quant_, fp8_kv_engine_ and tp_ result files."""
    rows = []

    def add(what: str, measure: str, name: str, result: dict, without: float, with_: float, fmt: str, goal: str,
            lower_is_better: bool = True, as_fraction: bool = False) -> None:
        r = _ratio(without, with_, lower_is_better)
        cell = f"{1 / r:.2f}× the time" if as_fraction else f"{r:.2f}×"
        rows.append(f"| {what} | {measure} | {without:{fmt}} | {_link(name, format(with_, fmt))} | {cell} | {goal} | "
                    f"{gpu_slug(result['device']).upper()} | {result['date']} |")

    # The draft model and EAGLE-3 from the run of both back-off rules where there is one, each under
    # its default rule (server/config.py SPEC_BACKOFF), else from their runs under the rule of the day
    policies = POLICIES if (results / POLICIES).exists() else None
    sources = [("spec_h100.json", ("ngram",) if policies else ("ngram", "draft_model")),
               *([(policies, ("draft_model", "eagle3"))] if policies else [("spec_eagle3_h100.json", ("eagle3",))])]
    for name, methods in sources:
        spec = _load(results, name)
        if not spec:
            continue
        by = {(r["clients"], r["config"]): r for r in spec["rows"]}
        draft = SHAPE_NAMES.get(spec.get("draft"), spec.get("draft"))
        label = {"ngram": "n-gram", "draft_model": f"{draft}-shaped draft", "eagle3": "EAGLE-3 head"}
        for m in methods:
            config = f"{m} p=0.8" + (f" backoff={SPEC_BACKOFF[m]}" if name == policies else "")
            one, off1 = by.get((1, config)), by.get((1, "off"))
            if one and off1 and one["mean_accepted_length"]:
                add(f"speculation, {label[m]}", f"batch 1, TPOT ms (mean accepted length {one['mean_accepted_length']:.2f})",
                    name, spec, off1["tpot_ms"], one["tpot_ms"], ".2f", "≥ 2.2× at length 3")
            many, off = by.get((256, config)), by.get((256, "off"))
            if many and off:
                add(f"speculation, {label[m]}", "256 clients, output tok/s", name, spec, off["output_tok_s"],
                    many["output_tok_s"], ",.0f", "≥ 0.98×", lower_is_better=False)
    quant = _load(results, "quant_h100.json")
    if quant:
        by = {(r["step"], r["format"]): r for r in quant["rows"] if r["step"] in ("tpot", "throughput")}
        for fmt in [f for f in quant["formats"] if f != "bf16"]:
            if ("tpot", fmt) in by and ("tpot", "bf16") in by:
                add(f"weights: {fmt}", "batch 1, TPOT ms", "quant_h100.json", quant, by["tpot", "bf16"]["tpot_ms"],
                    by["tpot", fmt]["tpot_ms"], ".2f", "≤ 0.6× (FP8), ≤ 0.4× (4-bit)", as_fraction=True)
            if ("throughput", fmt) in by and ("throughput", "bf16") in by:
                add(f"weights: {fmt}", "offline, output tok/s", "quant_h100.json", quant,
                    by["throughput", "bf16"]["tok_per_s"], by["throughput", fmt]["tok_per_s"], ",.0f", "≥ 1.3× (FP8)",
                    lower_is_better=False)
    kv = _load(results, "fp8_kv_engine_h100.json")
    if kv:
        by = {r["kv_cache_dtype"]: r for r in kv["rows"] if r.get("impl") == "engine"}
        if "auto" in by and "fp8" in by:
            a, f, name = by["auto"], by["fp8"], "fp8_kv_engine_h100.json"
            add("KV cache: fp8", f"{kv['args']['prompt_len'] // 1024}k-token prompts, as many as fit: output tok/s", name, kv,
                a["output_tok_s"], f["output_tok_s"], ",.0f", "≥ 1.3×", lower_is_better=False)
            add("KV cache: fp8", "sequences resident at once", name, kv, a["most_running"], f["most_running"], ",.0f",
                "2×", lower_is_better=False)
            add("KV cache: fp8", f"{a['tpot_context'] // 1024}k context, batch 1, TPOT ms", name, kv, a["tpot_ms"],
                f["tpot_ms"], ".2f", "≥ 1.15×")
    tp = _load(results, "tp_llama-3.1-8b_h100.json")
    if tp:
        one = next((r for r in tp["rows"] if r["tp"] == 1), None)
        # a row per size and all-reduce (bench_tp --custom-all-reduce off on serves each size both ways)
        for r in sorted((r for r in tp["rows"] if r["tp"] > 1), key=lambda r: (r["tp"], bool(r.get("custom_all_reduce")))):
            if one is None:
                break
            how = {None: "", False: ", NCCL all-reduce", True: ", custom all-reduce"}[r.get("custom_all_reduce")]
            if r.get("custom_all_reduce") and tp["date"] < CUSTOM_ALL_REDUCE_SINCE:
                how += " (torch's one-shot, since replaced)"
            add(f"tensor parallel, {r['tp']} GPUs{how}", "batch 1, TPOT ms", "tp_llama-3.1-8b_h100.json", tp,
                one["tpot_ms"], r["tpot_ms"], ".2f", "≤ 0.6× the time (2 GPUs)", as_fraction=True)
    tp4 = _load(results, "tp_llama-3.1-70b_h100.json")
    for r in (tp4 or {}).get("rows", []):  # no one-GPU row (70B does not fit one): against its floor
        add(f"tensor parallel, {r['tp']} GPUs, Llama-3.1-70B shape", "batch 1, TPOT ms (without: the floor, a rank's "
            f"weights at {tp4['hbm_tbps']} TB/s)", "tp_llama-3.1-70b_h100.json", tp4, r["floor_ms"], r["tpot_ms"], ".2f",
            "≤ 1.3× the floor", as_fraction=True)
    if not rows:
        return ""
    return "\n".join(["| capability | Llama-3.1-8B shape unless named (random weights) | without | with | speed-up | goal "
                      "| device | date |",
                      "|---|---|---:|---:|---:|---|---|---|", *rows, "",
                      "Speculation: k = 4, acceptance set by an oracle proposer (each proposal the target's own next "
                      "token with probability 0.8), 256-token prompts, 128 outputs. Without: the same engine, "
                      f"no speculation (tensor parallel: one GPU). Every configuration: [{DOC}]({DOC})."])
