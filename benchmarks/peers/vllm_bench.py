"""vLLM's own load client, `vllm bench serve`, as the harness drives it: the command line of one
level (`bench_args`), the row its --save-result JSON makes (`parse_result`), and a driver that runs
several levels in one process (the CLI costs ~20 s of imports and tokenizer loading per start):

  PYTHONPATH=/tmp/vllm-site:. python3 -m benchmarks.peers.vllm_bench SPEC.json

SPEC: {"runs": [{"name", "args": [...]}]}, each args what follows `vllm bench serve`; every level
is parsed by vLLM's own parser and run by its own `vllm.benchmarks.serve.main`, exactly what the CLI
does, and writes its JSON where --result-dir/--result-filename say. A level that fails is written
as {"error": ...} in that file's place, so the other levels still run.

Workloads: the random dataset (`--random-input-len`/`--random-output-len`, range ratio 0: fixed
lengths; prompts are random token ids decoded to text, which both servers tokenize alike) and
prefix repetition (`--prefix-repetition-*`: a few shared prefixes, each request one of them and a
unique suffix). Requests are streamed /v1/completions with ignore_eos (every output its full length).
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (50, 90, 99)


def bench_args(base_url: str, model_dir: str, served_name: str, *, dataset: dict, num_prompts: int,
               max_concurrency: int | None, seed: int, result_dir: str, result_filename: str,
               num_warmups: int = 0, request_rate: float | None = None) -> list[str]:
    """The arguments after `vllm bench serve` for one level. `dataset`: {"name": "random",
    "input_len", "output_len"} or {"name": "prefix_repetition", "prefix_len", "suffix_len",
    "num_prefixes", "output_len"}."""
    args = ["--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
            "--model", model_dir, "--served-model-name", served_name, "--tokenizer", model_dir,
            "--num-prompts", str(num_prompts), "--seed", str(seed), "--ignore-eos",
            "--request-rate", "inf" if request_rate is None else str(request_rate),
            "--percentile-metrics", ",".join(METRICS), "--metric-percentiles", ",".join(map(str, PERCENTILES)),
            "--num-warmups", str(num_warmups), "--disable-tqdm", "--save-result",
            "--result-dir", result_dir, "--result-filename", result_filename]
    if max_concurrency is not None:
        args += ["--max-concurrency", str(max_concurrency)]
    name = dataset["name"]
    if name == "random":
        args += ["--dataset-name", "random", "--random-input-len", str(dataset["input_len"]),
                 "--random-output-len", str(dataset["output_len"]), "--random-range-ratio", "0"]
    elif name == "prefix_repetition":
        args += ["--dataset-name", "prefix_repetition",
                 "--prefix-repetition-prefix-len", str(dataset["prefix_len"]),
                 "--prefix-repetition-suffix-len", str(dataset["suffix_len"]),
                 "--prefix-repetition-num-prefixes", str(dataset["num_prefixes"]),
                 "--prefix-repetition-output-len", str(dataset["output_len"])]
    else:
        raise ValueError(f"unknown dataset {name!r}")
    return args


def parse_result(data: dict) -> dict:
    """A `vllm bench serve` --save-result JSON as a harness row (the load test's names:
    output_tokens_per_s, ttft_p50_ms, ...). Its TPOT is per request, (latency - TTFT) / (output
    tokens - 1); its ITL values are the gaps between streamed chunks; its output tokens are the
    servers' usage counts."""
    if "error" in data:
        return {"client": "vllm-bench", "error": data["error"]}
    row = {"client": "vllm-bench", "concurrency": data.get("max_concurrency"), "num_requests": data.get("num_prompts"),
           "completed": data["completed"], "errors": data.get("failed", 0), "duration_s": data["duration"],
           "output_tokens_per_s": data["output_throughput"], "requests_per_s": data["request_throughput"],
           "input_tokens": data["total_input_tokens"], "output_tokens": data.get("total_output_tokens"),
           "max_concurrent_requests": data.get("max_concurrent_requests")}
    for metric in METRICS:
        name = "e2e" if metric == "e2el" else metric
        row[f"{name}_mean_ms"] = data.get(f"mean_{metric}_ms")
        for p in PERCENTILES:
            key = "median" if p == 50 else f"p{p}"
            row[f"{name}_p{p}_ms"] = data.get(f"{key}_{metric}_ms", data.get(f"p{p}_{metric}_ms"))
    return row


def run_spec(spec: dict) -> int:
    """Every level of `spec` through vLLM's own parser and main; the number that failed."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    failed = 0
    for run in spec["runs"]:
        parser = FlexibleArgumentParser(prog="vllm bench serve")
        add_cli_args(parser)
        args = parser.parse_args(run["args"])
        print(f"=== vllm bench serve {run['name']}", flush=True)
        try:
            bench_main(args)
        except Exception as e:  # noqa: BLE001 -- one level's failure is recorded, the rest still run
            failed += 1
            traceback.print_exc()
            out = Path(args.result_dir) / args.result_filename
            out.write_text(json.dumps({"error": f"{type(e).__name__}: {e}"[:500]}))
    return failed


if __name__ == "__main__":
    sys.exit(1 if run_spec(json.loads(Path(sys.argv[1]).read_text())) else 0)
