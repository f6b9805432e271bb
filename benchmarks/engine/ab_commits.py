"""Two versions of the engine side by side on one GPU: same greedy tokens, and throughput within noise?

When a change may cost speed (a refactor, a new code path), run the old and the new tree in one
device call. Each tree runs in its own subprocess with its own imports (cwd = the tree), in turns
(old, new, old, new, ...), so that drift of the machine hits both alike:

1. greedy tokens of the same random GPT-2 small checkpoint and prompts (triton, CUDA graphs,
   asynchronous scheduling, chunked prefill) must be identical in both trees;
2. `benchmarks/engine/bench_throughput.py` (offline tokens/s, decode-step times) runs `--rounds` times per
   tree.

    git archive OLD_COMMIT | tar -x -C /tmp/old     # the old tree, anywhere
    python -m benchmarks.engine.ab_commits --old-tree /tmp/old --old-label OLD_COMMIT --new-label NEW_COMMIT

writes benchmarks/results/ab_throughput_<gpu>.json: one row per (tree, round), plus the greedy check.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

from benchmarks.shared.common import gpu_run_info, write_result  # noqa: E402

# Runs inside each tree (cwd = the tree): the engine's offline API has kept these names across
# versions, except where SamplingParams lives.
GREEDY = r"""
import json, random, sys
from server.config import EngineConfig
from server.engine import LLMEngine
try:
    from server.sampling_params import SamplingParams
except ImportError:
    from server.sampling import SamplingParams
rng = random.Random(0)
prompts = [[rng.randrange(50257) for _ in range(rng.randint(1, 700))] for _ in range(48)]
eng = LLMEngine(EngineConfig(model=sys.argv[1], dtype="float16", attention="triton", max_num_batched_tokens=1024))
outs = eng.generate(prompts, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
print(json.dumps([o.token_ids for o in outs]))
"""


def run(tree: Path, args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, *args], cwd=tree, env=env, capture_output=True, text=True, timeout=900)


def throughput_row(tree: Path, label: str, rnd: int, work: Path, model: Path) -> dict:
    out = work / f"{label}-{rnd}"
    # the module where the tree has it (benchmarks/ was flat before it was split by subject)
    module = next(m for m in ("benchmarks.engine.bench_throughput", "benchmarks.engine.bench_throughput")
                  if (tree / (m.replace(".", "/") + ".py")).exists())
    p = run(tree, ["-m", module, "--model", str(model), "--out-dir", str(out),
                   "--skip", "flashpage_eager", "hf_eager", "--step-batches", "1", "8", "64", "256"])
    if p.returncode != 0:
        raise RuntimeError(f"{label} round {rnd} failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    rows = json.loads(next(out.glob("throughput_*.json")).read_text())["rows"]
    tput = next(r for r in rows if r["impl"] == "flashpage")
    steps = {r["batch"]: r for r in rows if r["impl"] == "flashpage_step"}
    row = dict(impl="flashpage", tree=label, round=rnd, output_tokens_per_s=tput["output_tokens_per_s"],
               time_split=tput.get("time_split"))  # host launch / device wait / other host time
    for b, r in steps.items():
        row[f"engine_step_ms_b{b}"] = r["engine_step_ms"]
        row[f"graph_ms_b{b}"] = r["graph_ms"]
    print(f"{label:>12} round {rnd}: {row['output_tokens_per_s']:10.1f} tok/s, "
          + ", ".join(f"b{b} step {r['engine_step_ms']:.3f} ms" for b, r in steps.items()), flush=True)
    return row


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old-tree", required=True, type=Path)
    ap.add_argument("--old-label", default="old")
    ap.add_argument("--new-label", default="new")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out-dir", default="benchmarks/results")
    args = ap.parse_args(argv)
    trees = [(args.old_tree.resolve(), args.old_label), (REPO_ROOT, args.new_label)]
    work = Path(tempfile.mkdtemp(prefix="ab-"))
    from benchmarks.shared.checkpoint import make_random_gpt2

    model = make_random_gpt2(work / "gpt2-small", "small")

    tokens = {}
    for tree, label in trees:
        p = run(tree, ["-c", GREEDY, str(model)])
        if p.returncode != 0:
            raise RuntimeError(f"{label}: greedy run failed:\n{p.stderr[-4000:]}")
        tokens[label] = json.loads(p.stdout.strip().splitlines()[-1])
    same = tokens[args.old_label] == tokens[args.new_label]
    print(f"greedy tokens, 48 prompts x 64: {'identical' if same else 'DIFFERENT'}", flush=True)

    rows = [throughput_row(tree, label, rnd, work, model) for rnd in range(args.rounds) for tree, label in trees]
    result = dict(gpu_run_info("benchmarks.engine.ab_commits", argv), greedy_identical=same,
                  workload="bench_throughput.py defaults (256 requests, inputs 128-512, outputs 128-512), "
                           "random GPT-2 small, float16", rows=rows)
    write_result(result, args.out_dir, "ab_throughput")
    print(report(result))
    return result


def report(result: dict) -> str:
    rows = result["rows"]
    labels = list(dict.fromkeys(r["tree"] for r in rows))
    keys = ["output_tokens_per_s"] + sorted((k for k in rows[0] if k.startswith("engine_step_ms_b")),
                                            key=lambda k: int(k.rsplit("b", 1)[1]))
    lines = [f"The offline run of `bench_throughput.py` per tree and round, in turns (old, new, old, ...); "
             "engine step = steady-state `LLMEngine.step()` ms at that batch size (context 512). Greedy tokens "
             f"of both trees identical (48 prompts x 64 tokens): {result['greedy_identical']}.", "",
             "| tree | " + " | ".join(keys) + " |", "|---|" + "---:|" * len(keys)]
    for label in labels:
        mine = [r for r in rows if r["tree"] == label]
        cells = []
        for k in keys:
            fmt = ",.0f" if k == "output_tokens_per_s" else ".3f"
            runs = " / ".join(format(r[k], fmt) for r in mine)
            cells.append(f"{runs} (median {format(statistics.median(r[k] for r in mine), fmt)})")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
