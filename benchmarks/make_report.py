"""Regenerate the README's results section from benchmarks/results/*.json.

Each benchmark script owns a `report(result) -> str` that renders its own file; this script only
finds the files, calls those, and splices the text between the README's results markers. Numbers
are never typed by hand.

  python benchmarks/make_report.py [--check]
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# results file prefix -> (module with report(), section title)
SECTIONS = [
    ("prefill_", "benchmarks.kernels.bench_prefill", "Flash prefill kernel"),
    ("decode_", "benchmarks.kernels.bench_decode", "Paged decode kernel"),
    ("throughput_", "benchmarks.engine.bench_throughput", "Engine throughput (offline)"),
    ("nanovllm_", "benchmarks.engine.bench_throughput", "Engine throughput, nano-vllm's benchmark protocol"),
    ("ab_throughput_", "benchmarks.engine.ab_commits", "Engine throughput, two commits side by side"),
    ("load_", "benchmarks.serving.compare", "HTTP load test"),
    ("prefix_", "benchmarks.engine.bench_prefix", "Prefix caching and chunked prefill"),
    ("scaleout_", "benchmarks.scaleout.scaleout_report", "Scale-out behind vllm-router"),
    ("structured_", "benchmarks.engine.bench_structured", "Structured outputs and penalties"),
    ("determinism_", "benchmarks.engine.bench_determinism", "Deterministic mode (batch invariance) over HTTP"),
    ("invariant_kernels_", "benchmarks.kernels.bench_invariant_kernels", "Batch-invariant kernels"),
    ("tp_", "benchmarks.scaleout.bench_tp", "Tensor parallelism"),
    ("peers_", "benchmarks.peers.report", "Side by side with vLLM"),
    ("spec_", "benchmarks.engine.bench_spec", "Speculative decoding against its acceptance"),
]
BEGIN, END = "<!-- BEGIN results -->", "<!-- END results -->"


def render(results_dir: Path) -> str:
    parts = []
    for prefix, module, title in SECTIONS:
        files = sorted(results_dir.glob(f"{prefix}*.json"))
        if not files:
            continue
        report = importlib.import_module(module).report
        for f in files:
            result = json.loads(f.read_text())
            meta = (f"{result['device']}, torch {result['torch']}, triton {result['triton']}, {result['date']}; "
                    f"`{result['command']}` → `{f.relative_to(ROOT)}`")
            # the file's own part of its name (model, workload tag, GPU): one heading per file, apart
            which = f.stem[len(prefix):].replace("_", ", ")
            parts.append(f"### {title}: {which}\n\n{meta}\n\n{report(result)}\n")
    return "\n".join(parts) if parts else "No GPU results yet.\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 if the README is not up to date")
    ap.add_argument("--readme", default=str(ROOT / "README.md"))
    args = ap.parse_args(argv)
    readme = Path(args.readme)
    text = readme.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    new = f"{head}{BEGIN}\n{render(ROOT / 'benchmarks' / 'results')}{END}{tail}"
    if args.check:
        return 0 if new == text else 1
    readme.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
