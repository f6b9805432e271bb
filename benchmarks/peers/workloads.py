"""The side-by-side workloads: what each one runs, on which checkpoint shape, under which `Flags`.

| workload | where | what |
|---|---|---|
| offline | `LLM.generate` / `LLMEngine.generate` | 256 requests, inputs and outputs uniform in 128–512 tokens, greedy, ignore_eos |
| nanovllm | the same engines | nano-vllm's bench.py protocol (256 requests, `random.seed(0)`, prompts of 100–1024 ids in [0, 10000], outputs 100–1024, temperature 0.6, ignore_eos, max_model_len 4096) |
| batch1 | the same engines | one request at a time: TTFT (512-token prompt, 1 output) and TPOT (256 outputs) |
| structured | the same engines | 64 prompts under a JSON schema (XGrammar in both) against the same lengths unconstrained |
| long | the same engines, max_model_len 33,024 | batch-1 TTFT and TPOT at 8k and 32k-token prompts (Llama-3.1-8B shape) |
| long-fp8 | the same, `--kv-cache-dtype fp8` in both | the long workload over FP8 KV caches (the random checkpoint has no scales: vLLM stores with 1.0, flashpage calibrates; the speed is the same either way) |
| http | `vllm serve` / `python -m server` | streamed /v1/completions, 512 in / 256 out, 1, 32, 256 and 1024 clients, driven by `vllm bench serve` and by our load client; both servers with the same API process count (run.py --api-server-count) |
| prefix | the same servers | shared prefixes (`vllm bench serve --dataset-name prefix_repetition`: 8 prefixes of 1,024 tokens, 128-token suffixes, 128 outputs, 64 clients), prefix caching on in both |

A shape may name a quantized copy of its random checkpoint, `<shape>.<format>` (e.g.
`llama-3.1-8b.fp8-dynamic`, `llama-3.1-8b.awq`): benchmarks/quant/quant_checkpoint.py writes it from the
16-bit one, and both engines read its `quantization_config` (issue 47's side by side).

Each workload is a list of `Job`s: an offline job (one `benchmarks.peers.offline` process per
engine) or a serving job (one server per engine, benchmarks/peers/serving.py). Jobs of the same kind,
shape and flags are run as one (the workloads selected together share an engine's start-up); each
workload still writes its own result file. Prompts are drawn here, once, and both engines get them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

from benchmarks.peers.engines import Flags
from benchmarks.peers.serving import Level
from server.config import SERVE_MAX_NUM_BATCHED_TOKENS

WORKLOADS = ("offline", "nanovllm", "batch1", "structured", "long", "long-fp8", "http", "prefix")
SHAPES = ("qwen2.5-0.5b", "llama-3.2-1b", "qwen3-0.6b", "llama-3.1-8b")
# benchmarks/quant/quant_checkpoint.py's formats that vLLM reads too (its GPTQ Marlin kernels need symmetric
# weights: not gptq-desc-act, written asymmetric, nor w4a16-asym)
QUANT_FORMATS = ("fp8-dynamic", "fp8-static", "fp8-block", "awq", "gptq", "w4a16")
DEFAULT_SHAPES = {"offline": SHAPES, "nanovllm": SHAPES, "batch1": SHAPES, "structured": ("qwen2.5-0.5b",), "long": ("llama-3.1-8b",),
                  "long-fp8": ("llama-3.1-8b",), "http": ("qwen2.5-0.5b",), "prefix": ("qwen2.5-0.5b",)}
HTTP_CLIENTS = (1, 32, 256, 1024)
OFFLINE_FLAGS = Flags(max_model_len=4096, enable_prefix_caching=False)  # repeated runs must not hit the cache
SERVE_FLAGS = Flags(max_model_len=4096, max_num_batched_tokens=SERVE_MAX_NUM_BATCHED_TOKENS)
LONG_FLAGS = replace(OFFLINE_FLAGS, max_model_len=32768 + 256)
LONG_FLAGS_BY_WORKLOAD = {"long": LONG_FLAGS, "long-fp8": replace(LONG_FLAGS, kv_cache_dtype="fp8")}


# shapes served only with --load-format dummy (random weights made on the GPUs: no 140 GB of files),
# at the --tensor-parallel-size that holds them (issue 50's TP rows beside vLLM's)
DUMMY_SHAPES = ("llama-3.1-70b",)


def split_shape(shape: str) -> tuple[str, str | None]:
    """(the random checkpoint's shape, the quantized format or None): "llama-3.1-8b.awq" ->
    ("llama-3.1-8b", "awq"); ValueError for a name that is neither."""
    if shape in SHAPES or shape in DUMMY_SHAPES:
        return shape, None
    base, _, fmt = shape.rpartition(".")
    if base in SHAPES and fmt in QUANT_FORMATS:
        return base, fmt
    raise ValueError(f"unknown shape {shape!r} (choose from {', '.join(SHAPES)}, each optionally "
                     f"followed by .FORMAT of {', '.join(QUANT_FORMATS)})")


@dataclass
class Job:
    kind: str  # "offline" or "serve"
    shape: str
    flags: Flags
    tasks: list[dict] = field(default_factory=list)  # offline: benchmarks/peers/offline.py tasks, each with "workload"
    levels: list[Level] = field(default_factory=list)  # serve
    level_workload: dict[str, str] = field(default_factory=dict)  # serve: level name -> workload

    def key(self) -> tuple:
        return (self.kind, self.shape, self.flags)


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def nano_vllm_workload() -> tuple[list[list[int]], list[int]]:
    """nano-vllm's bench.py, draw for draw: seed(0), then each prompt's length and ids, then each
    request's max_tokens (https://github.com/GeeeekExplorer/nano-vllm/blob/main/bench.py)."""
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(256)]
    max_tokens = [rng.randint(100, 1024) for _ in range(256)]
    return prompts, max_tokens


def offline_task(vocab: int, repeats: int = 3) -> dict:
    rng = random.Random(0)
    prompts = [random_ids(rng, rng.randint(128, 512), vocab) for _ in range(256)]
    outs = [rng.randint(128, 512) for _ in range(256)]
    return dict(workload="offline", name="random", kind="throughput", prompts=prompts, max_tokens=outs,
                temperature=0.0, repeats=repeats)


def nano_vllm_task(repeats: int = 3) -> dict:
    prompts, max_tokens = nano_vllm_workload()
    return dict(workload="nanovllm", name="nano-vllm", kind="throughput", prompts=prompts, max_tokens=max_tokens,
                temperature=0.6, repeats=repeats)


def latency_task(workload: str, name: str, vocab: int, prompt_len: int, max_tokens: int, ttft_runs: int,
                 e2e_runs: int, seed: int) -> dict:
    rng = random.Random(seed)
    prompts = [random_ids(rng, prompt_len, vocab) for _ in range(1 + ttft_runs + e2e_runs)]
    return dict(workload=workload, name=name, kind="latency", prompts=prompts, max_tokens=max_tokens,
                ttft_runs=ttft_runs)


def structured_task(vocab: int, repeats: int = 3) -> dict:
    from benchmarks.engine.bench_structured import SCHEMA

    rng = random.Random(0)
    return dict(workload="structured", name="json-schema", kind="structured", schema=SCHEMA, max_tokens=256,
                prompts=[random_ids(rng, 128, vocab) for _ in range(64)], repeats=repeats)


def http_levels(clients=HTTP_CLIENTS) -> list[Level]:
    """512 in / 256 out; each level's requests: 16 at one client, else 4 per client (at least 128),
    every level its own seed (prefix caching is on: no level may find another's prompts cached)."""
    return [Level(f"c{c}", c, 16 if c == 1 else max(128, 4 * c) if c < 1024 else 2 * c,
                  dict(name="random", input_len=512, output_len=256), seed=100 + i)
            for i, c in enumerate(clients)]


def prefix_levels() -> list[Level]:
    return [Level("shared-prefix", 64, 512, dict(name="prefix_repetition", prefix_len=1024, suffix_len=128,
                                                 num_prefixes=8, output_len=128), seed=200, clients=("vllm-bench",))]


def jobs_for(workload: str, shape: str, vocab: int, clients=HTTP_CLIENTS) -> list[Job]:
    """The jobs of one workload on one shape (`vocab`: the checkpoint's vocabulary size)."""
    if workload == "offline":
        return [Job("offline", shape, OFFLINE_FLAGS, tasks=[offline_task(vocab)])]
    if workload == "nanovllm":
        return [Job("offline", shape, OFFLINE_FLAGS, tasks=[nano_vllm_task()])]
    if workload == "batch1":
        return [Job("offline", shape, OFFLINE_FLAGS,
                    tasks=[latency_task("batch1", "batch1-512", vocab, 512, 256, ttft_runs=5, e2e_runs=3, seed=1)])]
    if workload == "structured":
        return [Job("offline", shape, OFFLINE_FLAGS, tasks=[structured_task(vocab)])]
    if workload in LONG_FLAGS_BY_WORKLOAD:
        return [Job("offline", shape, LONG_FLAGS_BY_WORKLOAD[workload],
                    tasks=[latency_task(workload, "prompt-8k", vocab, 8192, 128, ttft_runs=3, e2e_runs=2, seed=2),
                           latency_task(workload, "prompt-32k", vocab, 32768, 128, ttft_runs=2, e2e_runs=2, seed=3)])]
    if workload in ("http", "prefix"):
        levels = http_levels(clients) if workload == "http" else prefix_levels()
        return [Job("serve", shape, SERVE_FLAGS, levels=levels, level_workload={lv.name: workload for lv in levels})]
    raise ValueError(f"unknown workload {workload!r}")


def merge_jobs(jobs: list[Job]) -> list[Job]:
    """Jobs of the same kind, shape and flags as one, in first-seen order."""
    merged: dict[tuple, Job] = {}
    for job in jobs:
        if job.key() in merged:
            m = merged[job.key()]
            m.tasks += job.tasks
            m.levels += job.levels
            m.level_workload.update(job.level_workload)
        else:
            merged[job.key()] = Job(job.kind, job.shape, job.flags, list(job.tasks), list(job.levels),
                                    dict(job.level_workload))
    return list(merged.values())


# Rough H100 minutes, to split a comparison over 10-minute device calls (run.py --estimate): each
# engine's start-up (vLLM's includes torch.compile and graph capture, ~1 min cold), a random
# checkpoint (the 8B's ~1 min to initialise on the GPU and write 16 GB), and the measured part.
START_MIN = {"flashpage": 0.5, "vllm": 1.2}
CKPT_MIN = {"llama-3.1-8b": 1.0}
QUANT_CKPT_MIN = 0.7  # a quantized copy of the 8B (read, quantized on the GPU, written); a fifth of it for the small shapes
# The measured parts, from flashpage's own H100 figures (benchmarks/results/throughput_*, nanovllm_*:
# 1-3 s a run of the 128-512 workload, 6-11 s of nano-vllm's on the small shapes) times three runs
# and both engines, and the HTTP levels' requests at the clients' rates.
WORK_MIN = {("offline", False): 0.5, ("offline", True): 1.0, ("nanovllm", False): 0.8, ("nanovllm", True): 2.0, ("batch1", False): 0.15, ("batch1", True): 0.4,
            ("structured", False): 0.4, ("structured", True): 1.0, ("long", True): 1.2, ("long", False): 0.6,
            ("long-fp8", True): 1.2, ("long-fp8", False): 0.6,
            ("http", False): 3.0, ("http", True): 4.5, ("prefix", False): 0.4, ("prefix", True): 0.8}


def estimate_minutes(selection: list[tuple[str, str]]) -> float:
    """Minutes for (workload, shape) pairs run together: per merged job, both engines' start-ups and
    each workload's measured part on both; plus each checkpoint made once."""
    jobs = merge_jobs([Job("offline" if w not in ("http", "prefix") else "serve", s,
                           LONG_FLAGS_BY_WORKLOAD.get(w) or (SERVE_FLAGS if w in ("http", "prefix") else OFFLINE_FLAGS))
                       for w, s in selection])
    total = sum(START_MIN.values()) * len(jobs)
    total += sum(WORK_MIN[(w, split_shape(s)[0] == "llama-3.1-8b")] for w, s in selection)
    shapes = [split_shape(s) for s in {s for _, s in selection}]
    total += sum(CKPT_MIN.get(base, 0.15) for base in {base for base, _ in shapes})
    total += sum(QUANT_CKPT_MIN * (1 if base == "llama-3.1-8b" else 0.2) for base, fmt in shapes if fmt)
    return round(total, 1)
