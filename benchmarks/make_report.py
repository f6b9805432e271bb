"""Render docs/benchmarks.md and the README's headline table from the result files in
benchmarks/results/ (the current ones: its top level; results/experiments/ is never read).

Each result kind has a renderer, `report(result) -> str`, in the module of the benchmark that writes
it; this script only finds the files, groups them by subject and kind, and writes the text. A kind's
runs (shapes, workloads, devices, days) are the rows of one table, each naming its file, then each
run's own report follows under the command that made it. Numbers are never typed by hand.

  python -m benchmarks.make_report [--check]
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"


@dataclass(frozen=True)
class Kind:
    prefix: str  # its files: results/<prefix>*.json (the longest matching prefix wins)
    module: str  # where its renderer lives
    title: str
    func: str = "report"  # the renderer: func(result) -> str
    summary: str | None = None  # a function of the module giving a run's figures in one cell, if any


# (subject, its kinds) in the order docs/benchmarks.md shows them
SECTIONS: list[tuple[str, list[Kind]]] = [
    ("Kernels", [
        Kind("prefill_", "benchmarks.kernels.bench_prefill", "Flash prefill kernel"),
        Kind("prefill_chunks_", "benchmarks.kernels.bench_prefill_chunks", "A long prompt's prefill in chunks"),
        Kind("decode_", "benchmarks.kernels.bench_decode", "Paged decode kernel"),
        Kind("decode_latency_", "benchmarks.kernels.bench_decode_latency", "Paged decode at batch 1 and 4: launch time"),
        Kind("invariant_kernels_", "benchmarks.kernels.bench_invariant_kernels", "Batch-invariant kernels"),
        Kind("fp8_kv_", "benchmarks.kernels.bench_fp8_kv", "FP8 KV cache: decode kernel and engine"),
    ]),
    ("Engine", [
        Kind("throughput_", "benchmarks.engine.bench_throughput", "Engine throughput (offline)", summary="summary"),
        Kind("nanovllm_", "benchmarks.engine.bench_throughput", "Engine throughput, nano-vllm's benchmark protocol",
             summary="summary"),
        Kind("prefix_", "benchmarks.engine.bench_prefix", "Prefix caching and chunked prefill"),
    ]),
    ("Serving", [
        Kind("load_", "benchmarks.serving.compare", "HTTP load test"),
        Kind("soak_", "benchmarks.serving.soak", "Soak: mixed and hostile clients"),
    ]),
    ("Scale-out", [
        Kind("scaleout_", "benchmarks.scaleout.scaleout_report", "Replicas behind vllm-router"),
        Kind("tp_", "benchmarks.scaleout.bench_tp", "Tensor parallelism"),
    ]),
    ("Structured outputs", [Kind("structured_", "benchmarks.engine.bench_structured", "Structured outputs and penalties")]),
    ("Determinism", [Kind("determinism_", "benchmarks.engine.bench_determinism",
                          "Deterministic mode (batch invariance) over HTTP")]),
    ("Quantization", [
        Kind("quant_", "benchmarks.quant.quant_report", "Quantized weights on a GPU"),
        Kind("quant_quality_", "benchmarks.quant.quant_report", "Quality of each quantized format", "quality_report"),
        Kind("kv_accuracy_", "benchmarks.quant.bench_kv_accuracy", "FP8 KV cache: accuracy"),
    ]),
    ("Speculative decoding", [
        Kind("spec_", "benchmarks.engine.bench_spec", "Speculative decoding against its acceptance"),
        Kind("embedded_draft_", "benchmarks.engine.bench_spec", "The embedded draft's acceptance", "acceptance_report"),
    ]),
    ("Against vLLM", [Kind("peers_", "benchmarks.peers.report", "Side by side with vLLM", summary="summary")]),
]
KINDS = [k for _, kinds in SECTIONS for k in kinds]
BEGIN, END = "<!-- BEGIN headline -->", "<!-- END headline -->"


def kind_of(path: Path) -> Kind | None:
    """The kind whose prefix is the longest that the file's name starts with."""
    matches = [k for k in KINDS if path.name.startswith(k.prefix)]
    return max(matches, key=lambda k: len(k.prefix)) if matches else None


def current_files(results_dir: Path = RESULTS) -> dict[Kind, list[Path]]:
    """The top level's result files by kind; ValueError for one that no kind reads (a current result
    must be shown, an experiment belongs in results/experiments/)."""
    by: dict[Kind, list[Path]] = {k: [] for k in KINDS}
    for f in sorted(results_dir.glob("*.json")):
        kind = kind_of(f)
        if kind is None:
            raise ValueError(f"{f.name}: no renderer reads it (a kind in make_report.SECTIONS, or move it "
                             "to results/experiments/)")
        by[kind].append(f)
    return by


def anchor(title: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def _demote(text: str, levels: int) -> str:
    """A report's own headings, `levels` deeper (it is nested under its run's heading); code blocks untouched."""
    out, fence = [], False
    for line in text.splitlines():
        fence ^= line.startswith("```")
        out.append("#" * levels + line if line.startswith("#") and not fence else line)
    return "\n".join(out)


def run_name(kind: Kind, f: Path) -> str:
    return f.stem[len(kind.prefix):].replace("_", ", ") or f.stem


def render_kind(kind: Kind, files: list[Path]) -> str:
    module = importlib.import_module(kind.module)
    report = getattr(module, kind.func)
    summary = getattr(module, kind.summary) if kind.summary else None
    rel = lambda f: f"../{f.relative_to(ROOT).as_posix()}"  # noqa: E731  (links from docs/)
    results = [json.loads(f.read_text()) for f in files]
    figures = "| figures " if summary else ""
    lines = [f"### {kind.title}", "", f"| run {figures}| device | date | command | file |",
             "|---|" + "---|" * (4 + bool(summary))]
    for f, r in zip(files, results):
        cell = f"| {summary(r)} " if summary else ""
        lines.append(f"| [{run_name(kind, f)}](#{anchor(f'{kind.title}: {run_name(kind, f)}')}) {cell}| {r['device']} | "
                     f"{r['date']} | `{r['command']}` | [{f.name}]({rel(f)}) |")
    for f, r in zip(files, results):
        versions = ", ".join(f"{k} {r[k]}" for k in ("torch", "triton") if r.get(k))
        body = _demote(report(r), 2).replace("](benchmarks/", "](../benchmarks/")
        lines += ["", f"#### {kind.title}: {run_name(kind, f)}", "",
                  f"{r['device']}{', ' + versions if versions else ''}, {r['date']}; `{r['command']}` → "
                  f"[`{f.relative_to(ROOT).as_posix()}`]({rel(f)})", "", body]
    return "\n".join(lines)


def render_doc(results_dir: Path = RESULTS) -> str:
    files = current_files(results_dir)
    head = ["# Benchmarks", "",
            "Generated by `python -m benchmarks.make_report` from the result files in `benchmarks/results/` "
            "(do not edit by hand). Every script runs from the repo root as `python -m benchmarks.<package>.<name>` "
            "([the packages](../benchmarks/__init__.py)); "
            "each run below names its command, device and file. A/B experiments and profiles that notes and "
            "commits cite are in `benchmarks/results/experiments/`, not shown here.", ""]
    toc, body = [], []
    for subject, kinds in SECTIONS:
        parts = [render_kind(k, files[k]) for k in kinds if files[k]]
        if parts:
            toc.append(f"- [{subject}](#{anchor(subject)}): " +
                       ", ".join(f"[{k.title}](#{anchor(k.title)})" for k in kinds if files[k]))
            body += [f"## {subject}", "", "\n\n".join(parts), ""]
    return "\n".join(head + toc + [""] + body).rstrip() + "\n"


def render_readme(text: str, results_dir: Path = RESULTS) -> str:
    from benchmarks.headline import capabilities, headline

    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    more = capabilities(results_dir)
    return f"{head}{BEGIN}\n{headline(results_dir)}{chr(10) * 2 + more if more else ''}\n{END}{tail}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/benchmarks.md or the README is stale")
    args = ap.parse_args(argv)
    stale = []
    for path, new in ((DOC, render_doc()), (README, render_readme(README.read_text()))):
        if not path.exists() or path.read_text() != new:
            stale.append(path.relative_to(ROOT).as_posix())
            if not args.check:
                path.write_text(new)
    if args.check and stale:
        print("stale (run python -m benchmarks.make_report):", ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
