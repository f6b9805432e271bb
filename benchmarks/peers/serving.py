"""One engine's server under load: start `vllm serve` or `python -m server` (benchmarks/peers/
engines.py builds both command lines from one `Flags`), wait for GET /health, warm it up, drive every
level with vLLM's client (`vllm bench serve`, run in vLLM's environment) and then with ours
(benchmarks/serving/load_test.py over streamed /v1/completions), stop it. Both engines get the same levels,
prompts and seeds; each level's rows carry which client measured them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.shared.common import ServerProcess, free_port
from benchmarks.peers.engines import SERVED_NAME, Flags, engine_env, serve_cmd
from benchmarks.peers.vllm_bench import bench_args, parse_result

CLIENTS = ("vllm-bench", "flashpage-load")


@dataclass(frozen=True)
class Level:
    """One measured level: `concurrency` clients in a closed loop (vLLM's client: --max-concurrency
    with every request queued at once), `num_requests` requests of `dataset` (see
    vllm_bench.bench_args; our client runs the random dataset only, as token ids)."""
    name: str
    concurrency: int
    num_requests: int
    dataset: dict
    seed: int
    clients: tuple[str, ...] = CLIENTS

    def warmups(self) -> int:
        return min(self.concurrency, 32)


def vllm_bench_spec(levels: list[Level], url: str, model: str, out_dir: Path, tag: str) -> dict:
    runs = []
    for lv in levels:
        if "vllm-bench" in lv.clients:
            args = bench_args(url, model, SERVED_NAME, dataset=lv.dataset, num_prompts=lv.num_requests,
                              max_concurrency=lv.concurrency, seed=lv.seed, result_dir=str(out_dir),
                              result_filename=f"{tag}_{lv.name}.json", num_warmups=lv.warmups())
            runs.append({"name": lv.name, "args": args})
    return {"runs": runs}


def run_vllm_bench(levels: list[Level], url: str, model: str, out_dir: Path, tag: str, timeout: float) -> list[dict]:
    """Every level through vLLM's client in one process of vLLM's environment; one row per level."""
    spec = vllm_bench_spec(levels, url, model, out_dir, tag)
    if not spec["runs"]:
        return []
    spec_path = out_dir / f"{tag}_vllm_bench_spec.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    log = out_dir / f"{tag}_vllm_bench.log"
    with open(log, "w") as f:
        subprocess.run([sys.executable, "-m", "benchmarks.peers.vllm_bench", str(spec_path)], stdout=f,
                       stderr=subprocess.STDOUT, env=engine_env("vllm"), timeout=timeout, check=False)
    rows = []
    for lv, run in zip([lv for lv in levels if "vllm-bench" in lv.clients], spec["runs"]):
        path = out_dir / f"{tag}_{lv.name}.json"
        data = json.loads(path.read_text()) if path.exists() else {"error": f"no result (see {log.name})"}
        rows.append(dict(parse_result(data), level=lv.name, concurrency=lv.concurrency, dataset=lv.dataset,
                         seed=lv.seed, command="vllm bench serve " + " ".join(run["args"])))
    return rows


def run_load_client(levels: list[Level], url: str, vocab_size: int) -> list[dict]:
    """Every random-dataset level through our client (load_test.run_load, /v1/completions)."""
    from benchmarks.serving.load_test import run_load

    rows = []
    for lv in levels:
        if "flashpage-load" not in lv.clients or lv.dataset["name"] != "random":
            continue
        row = run_load(url, concurrency=lv.concurrency, num_requests=lv.num_requests, warmup=lv.warmups(),
                       input_len=lv.dataset["input_len"], output_len=lv.dataset["output_len"],
                       vocab_size=vocab_size, seed=lv.seed, progress=False, api="completions",
                       extra_body={"model": SERVED_NAME}, label="flashpage-load")
        rows.append(dict({k: v for k, v in row.items() if k != "impl"}, client="flashpage-load", level=lv.name,
                         dataset=lv.dataset))
    return rows


def warm_up(url: str, vocab_size: int) -> None:
    """A few requests before any level: the first requests of a fresh server pay one-time costs."""
    from benchmarks.serving.load_test import run_load

    run_load(url, concurrency=8, num_requests=16, input_len=256, output_len=16, vocab_size=vocab_size, seed=999,
             progress=False, api="completions", extra_body={"model": SERVED_NAME})


def serve_and_measure(engine: str, model: str, flags: Flags, levels: list[Level], out_dir: Path, vocab_size: int,
                      tag: str, startup_timeout: float = 900.0, bench_timeout: float = 1800.0) -> dict:
    """Start `engine`'s server on `model`, run `levels` with both clients, stop it. Returns
    {"engine", "command", "startup_s", "rows"}; the server's log (<tag>_server.log) and vLLM's
    client's files (<tag>_<level>.json) are kept in out_dir."""
    import time

    port = free_port()
    cmd = serve_cmd(engine, model, port, flags)
    log = out_dir / f"{tag}_server.log"
    t0 = time.perf_counter()
    server = ServerProcess(cmd, port, log, env=engine_env(engine))
    try:
        server.wait_healthy(startup_timeout)
        startup_s = time.perf_counter() - t0
        print(f"[{engine}] serving after {startup_s:.1f} s", flush=True)
        warm_up(server.url, vocab_size)
        rows = run_vllm_bench(levels, server.url, model, out_dir, tag, bench_timeout)
        rows += run_load_client(levels, server.url, vocab_size)
    finally:
        server.stop()
    for r in rows:
        r["impl"] = engine
    return {"engine": engine, "command": " ".join(cmd), "startup_s": round(startup_s, 1), "rows": rows}
