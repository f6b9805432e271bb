"""One engine's offline runs, in a process of its own (so its GPU memory is freed when it ends):

  python -m benchmarks.peers.offline JOB.json OUT.json

JOB: {"engine": "vllm" | "flashpage", "model": DIR, "flags": Flags fields, "tasks": [...]}, each task
    {"name", "kind": "throughput", "prompts": [[ids]], "max_tokens": [n], "temperature", "repeats",
     "warmup_prompt": ids | null}            output tokens / wall time of one generate call (median)
    {"name", "kind": "latency", "prompts": [[ids]], "max_tokens": n, "ttft_runs": k}
        batch 1: TTFT = median time of generate(prompt, max_tokens=1) over the first k prompts,
        e2e = median of generate(prompt, max_tokens=n) over the rest, TPOT = (e2e - TTFT) / (n - 1);
        every call a prompt of its own, so no run finds another's prefix cached
    {"name", "kind": "structured", "prompts": [[ids]], "schema": {...}, "max_tokens": n, "repeats"}
        the prompts constrained by the JSON schema (greedy, to the grammar's end), then the same
        prompts unconstrained with max_tokens at the lengths the constrained run produced
        (ignore_eos), as benchmarks/engine/bench_structured.py does; one pair to warm up, then `repeats`
OUT: {"engine", "versions", "device", "init_s", "rows": [...]}. With FLASHPAGE_PEERS_PROFILE=1 (run.py
--profile) each throughput row also holds `profile`: one more run under torch.profiler (profiled_run).

Both engines take the prompts as token ids and sample with the same parameters; the job is written
by benchmarks/peers/workloads.py, which runs this module once per engine, in each engine's own
environment (benchmarks/peers/engines.py).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.peers.engines import Flags, llm_kwargs, versions  # noqa: E402


PROFILE_ENV = "FLASHPAGE_PEERS_PROFILE"  # "1": one more throughput run under torch.profiler (run.py --profile)


class VllmEngine:
    """vllm.LLM behind the two calls the tasks make."""

    def __init__(self, model: str, flags: Flags) -> None:
        from vllm import LLM

        self.llm = LLM(**llm_kwargs("vllm", model, flags))

    def generate(self, prompts: list[list[int]], params: list[dict]) -> list[tuple[list[int], str]]:
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        sps = [SamplingParams(max_tokens=p["max_tokens"], temperature=p.get("temperature", 0.0),
                              ignore_eos=p.get("ignore_eos", False), seed=p.get("seed"),
                              structured_outputs=StructuredOutputsParams(json=p["json"]) if "json" in p else None)
               for p in params]
        outs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompts], sps, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), o.outputs[0].text) for o in outs]

    def close(self) -> None:
        pass  # vllm.LLM shuts its engine core down at exit


class FlashpageEngine:
    """flashpage's LLMEngine behind the same two calls."""

    def __init__(self, model: str, flags: Flags) -> None:
        import gc

        from server.config import EngineConfig
        from server.engine import LLMEngine

        self.engine = LLMEngine(EngineConfig(**llm_kwargs("flashpage", model, flags)))
        gc.collect()
        gc.freeze()  # as `python -m server` and bench_throughput.py do after start-up

    def generate(self, prompts: list[list[int]], params: list[dict]) -> list[tuple[list[int], str]]:
        from server.sampling_params import SamplingParams, StructuredOutput

        sps = [SamplingParams(max_tokens=p["max_tokens"], temperature=p.get("temperature", 0.0),
                              ignore_eos=p.get("ignore_eos", False), seed=p.get("seed"),
                              structured=StructuredOutput("json", json.dumps(p["json"], sort_keys=True))
                              if "json" in p else None)
               for p in params]
        return [(list(r.token_ids), r.text) for r in self.engine.generate(prompts, sps)]

    def close(self) -> None:
        """As the server's engine loop ends (under tensor parallelism its CUDA graphs go before the
        group: leaving it thaws and collects what start-up froze, models/parallel/group.py)."""
        self.engine.close()


def timed(engine, prompts, params) -> tuple[float, list]:
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    return time.perf_counter() - t0, outs


def run_throughput(engine, task: dict) -> dict:
    prompts, max_tokens, temp = task["prompts"], task["max_tokens"], task.get("temperature", 0.0)
    params = [dict(max_tokens=n, temperature=temp, ignore_eos=True) for n in max_tokens]
    warm = task.get("warmup_prompt") or prompts[0][:16]
    engine.generate([warm], [dict(max_tokens=16, temperature=temp)])
    engine.generate(prompts[:4], params[:4])  # each path's first run is cold
    runs = []
    for _ in range(task.get("repeats", 3)):
        dt, outs = timed(engine, prompts, params)
        tokens = sum(len(ids) for ids, _ in outs)
        if tokens != sum(max_tokens):
            raise RuntimeError(f"{task['name']}: {tokens} output tokens, {sum(max_tokens)} asked for (ignore_eos)")
        runs.append((dt, tokens))
    dt, tokens = sorted(runs)[len(runs) // 2]
    row = dict(task=task["name"], kind="throughput", requests=len(prompts), output_tokens=tokens,
               input_tokens=sum(map(len, prompts)), temperature=temp, seconds=round(dt, 6),
               output_tokens_per_s=round(tokens / dt, 1), runs_tokens_per_s=[round(t / d, 1) for d, t in runs])
    if os.environ.get(PROFILE_ENV) == "1":
        try:
            row["profile"] = profiled_run(engine, prompts, params)
        except Exception as e:  # noqa: BLE001 -- the row measured stays; the profile says why it is missing
            row["profile"] = {"error": f"{type(e).__name__}: {e}"}
    return row


def profiled_run(engine, prompts, params, top: int = 40) -> dict:
    """One more run of the task under torch.profiler: its wall time, the device's kernels over the
    whole run by category and by name (benchmarks/profiling/kernel_categories.breakdown, the top
    `top`), and the device idle (wall less the time some kernel ran). vLLM's kernels are in this
    process only with VLLM_ENABLE_V1_MULTIPROCESSING=0 (run.py sets it; not its tensor-parallel
    workers, which stay processes of their own: then this raises, and the row says so); the
    profiler's host cost lengthens the wall time, so the throughput is the unprofiled runs' and this
    is where time goes. The breakdown's "per step" figures are the whole run's (one step)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.profiling.kernel_categories import breakdown, profiled_events

    on_cuda = torch.cuda.is_available()  # on the CPU (the tests) the "kernels" are operators by self time
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    sync()
    with profile(activities=[ProfilerActivity.CUDA if on_cuda else ProfilerActivity.CPU]) as prof:
        dt, _ = timed(engine, prompts, params)
        sync()
    events = profiled_events(prof, on_cuda)
    if not events:
        raise RuntimeError("the profiler saw no kernel: the engine runs its model in another process")
    out = {"wall_ms": round(dt * 1e3, 2), **breakdown(events, 1)}
    out["idle_ms"] = round(out["wall_ms"] - out["busy_ms"], 2)
    out["kernels"] = out["kernels"][:top]
    return out


def run_latency(engine, task: dict) -> dict:
    prompts, n, k = task["prompts"], task["max_tokens"], task.get("ttft_runs", 3)
    if len(prompts) <= k + 1 or n < 2:
        raise ValueError(f"{task['name']}: needs more than ttft_runs + 1 prompts and max_tokens >= 2")
    engine.generate([prompts[0][:32]], [dict(max_tokens=4)])  # warm-up (its prefix is no other prompt's)
    ttft = [timed(engine, [p], [dict(max_tokens=1)])[0] for p in prompts[1:k + 1]]
    e2e = []
    for p in prompts[k + 1:]:
        dt, outs = timed(engine, [p], [dict(max_tokens=n, ignore_eos=True)])
        if len(outs[0][0]) != n:
            raise RuntimeError(f"{task['name']}: {len(outs[0][0])} tokens, {n} asked for (ignore_eos)")
        e2e.append(dt)
    t, e = statistics.median(ttft), statistics.median(e2e)
    return dict(task=task["name"], kind="latency", prompt_len=len(prompts[1]), max_tokens=n,
                ttft_ms=round(t * 1e3, 3), e2e_ms=round(e * 1e3, 3), tpot_ms=round((e - t) / (n - 1) * 1e3, 4),
                ttft_runs_ms=[round(x * 1e3, 3) for x in ttft], e2e_runs_ms=[round(x * 1e3, 3) for x in e2e])


def structured_pair(engine, prompts, schema: dict, max_tokens: int) -> dict:
    dt_s, outs = timed(engine, prompts, [dict(max_tokens=max_tokens, json=schema) for _ in prompts])
    lengths = [len(ids) for ids, _ in outs]
    parsed = 0
    for _, text in outs:
        try:
            json.loads(text)
            parsed += 1
        except ValueError:
            pass
    dt_u, outs_u = timed(engine, prompts, [dict(max_tokens=n, ignore_eos=True) for n in lengths])
    if [len(ids) for ids, _ in outs_u] != lengths:
        raise RuntimeError("the unconstrained twin decoded other lengths than asked")
    tokens = sum(lengths)
    return dict(tokens=tokens, with_s=dt_s, without_s=dt_u, parsed=parsed)


def run_structured(engine, task: dict) -> dict:
    prompts, schema, n = task["prompts"], task["schema"], task["max_tokens"]
    structured_pair(engine, prompts, schema, n)  # warm-up: compiles the schema, first matchers
    runs = [structured_pair(engine, prompts, schema, n) for _ in range(task.get("repeats", 3))]
    with_s = statistics.median(r["tokens"] / r["with_s"] for r in runs)
    without_s = statistics.median(r["tokens"] / r["without_s"] for r in runs)
    return dict(task=task["name"], kind="structured", batch=len(prompts), max_tokens=n,
                with_tok_s=round(with_s, 1), without_tok_s=round(without_s, 1), ratio=round(with_s / without_s, 3),
                parsed=min(r["parsed"] for r in runs), mean_len=round(runs[-1]["tokens"] / len(prompts), 1),
                runs=[{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()} for r in runs])


RUNNERS = {"throughput": run_throughput, "latency": run_latency, "structured": run_structured}


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    job = json.loads(Path(args[0]).read_text())
    engine_name = job["engine"]
    flags = Flags(**{k: tuple(v) if isinstance(v, list) else v for k, v in job["flags"].items()})
    t0 = time.perf_counter()
    engine = (VllmEngine if engine_name == "vllm" else FlashpageEngine)(job["model"], flags)
    init_s = time.perf_counter() - t0
    print(f"[{engine_name}] ready in {init_s:.1f} s", flush=True)
    try:
        run_tasks(engine, engine_name, job["tasks"], Path(args[1]), init_s)
    finally:
        engine.close()
    return 0


def run_tasks(engine, engine_name: str, tasks: list[dict], out: Path, init_s: float) -> None:
    """Each task's row, the rows file rewritten after each (a run cut short keeps what it measured)."""
    rows = []
    for task in tasks:
        row = dict(engine=engine_name, impl=engine_name, workload=task.get("workload"),
                   **RUNNERS[task["kind"]](engine, task))
        print(f"[{engine_name}] {json.dumps({k: v for k, v in row.items() if not k.endswith('runs') and 'runs_' not in k})}",
              flush=True)
        rows.append(row)
        out.write_text(json.dumps(dict(engine=engine_name, versions=_versions(engine_name),
                                       device=device_name(), init_s=round(init_s, 1), rows=rows)))


def _versions(engine: str) -> dict:
    import torch
    import triton

    out = dict(versions(engine), torch=torch.__version__, triton=triton.__version__)
    if engine == "vllm":
        import vllm

        out["vllm"] = vllm.__version__
    return out


if __name__ == "__main__":
    sys.exit(main())
