"""The two engines under one set of flags: `Flags` holds what both get (the issue's list: most
sequences, context, memory share, KV block size, chunked prefill, prefix caching, KV cache dtype,
CUDA graphs on in both, vLLM's own attention backend), and the functions here turn it into each
engine's command line (`vllm serve`, `python -m server`) or constructor arguments (`vllm.LLM`,
`LLMEngine`'s `EngineConfig`), and each engine's environment: vLLM runs from its carried site
(`VLLM_SITE`, /tmp/vllm-site after benchmarks/peers/fetch/unpack_vllm.sh), flashpage from this checkout
with the server's wheels (PYTHONPATH as the caller has it). Imports only the standard library and
server/config.py, so vLLM's processes can import it too.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from server.config import NCCL_ENV, EngineConfig  # noqa: E402  (a dataclass and constants: no torch, no server stack)

REPO_ROOT = Path(__file__).resolve().parents[2]
VLLM_VERSION = "0.26.0"
SERVED_NAME = "model"  # both servers' --served-model-name: what every request names
ENGINES = ("flashpage", "vllm")
# XGrammar in both, and JSON without "any whitespace" in both: flashpage compiles schemas so
# (server/engine/grammar.py: small models otherwise emit whitespace until max_tokens); vLLM's default
# allows it, which would make the two engines decode different grammars.
VLLM_STRUCTURED = {"backend": "xgrammar", "disable_any_whitespace": True}


def vllm_site(env: dict | None = None) -> str:
    return (os.environ if env is None else env).get("VLLM_SITE", "/tmp/vllm-site")


@dataclass(frozen=True)
class Flags:
    """What both engines are given, recorded in every result file. Defaults are flashpage's
    (server/config.py); `max_num_batched_tokens` is the offline engine's budget (the server's is
    SERVE_MAX_NUM_BATCHED_TOKENS, set by the serving workloads)."""
    max_model_len: int = 4096
    max_num_seqs: int = EngineConfig.max_num_seqs
    max_num_batched_tokens: int = EngineConfig.max_num_batched_tokens
    gpu_memory_utilization: float = EngineConfig.gpu_memory_utilization
    block_size: int = EngineConfig.block_size
    enable_prefix_caching: bool = EngineConfig.enable_prefix_caching
    enable_chunked_prefill: bool = EngineConfig.enable_chunked_prefill
    kv_cache_dtype: str = "auto"
    dtype: str = "bfloat16"
    seed: int = 0
    tensor_parallel_size: int = 1  # GPUs one model is split over (both engines' --tensor-parallel-size)
    load_format: str = "auto"  # "dummy": random weights made on the GPUs from config.json alone (both engines')
    api_server_count: int | None = None  # serving only; None: each engine's own default
    vllm_args: tuple[str, ...] = ()  # serving only: more of `vllm serve`'s flags, recorded
    flashpage_args: tuple[str, ...] = ()  # serving only: more of `python -m server`'s flags, recorded

    def record(self) -> dict:
        return asdict(self)


def _bool_flag(name: str, on: bool) -> str:
    return f"--{name}" if on else f"--no-{name}"


def _shared_extras(flags: Flags) -> dict:
    """The Flags fields both engines name alike (CLI flags and constructor arguments), where they
    differ from the engines' defaults (Flags'), by name."""
    return {name: getattr(flags, name) for name in ("kv_cache_dtype", "tensor_parallel_size", "load_format")
            if getattr(flags, name) != getattr(Flags, name)}


def serve_cmd(engine: str, model: str, port: int, flags: Flags) -> list[str]:
    """The server's command line: `vllm serve` (through its CLI module, so no console script is
    needed) or `python -m server`, on 127.0.0.1:`port`, serving `model` as SERVED_NAME."""
    common = ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME,
              "--dtype", flags.dtype, "--max-model-len", str(flags.max_model_len),
              "--max-num-seqs", str(flags.max_num_seqs), "--max-num-batched-tokens", str(flags.max_num_batched_tokens),
              "--gpu-memory-utilization", str(flags.gpu_memory_utilization), "--block-size", str(flags.block_size),
              _bool_flag("enable-prefix-caching", flags.enable_prefix_caching),
              _bool_flag("enable-chunked-prefill", flags.enable_chunked_prefill), "--seed", str(flags.seed)]
    common += [a for name, v in _shared_extras(flags).items() for a in (f"--{name.replace('_', '-')}", str(v))]
    if flags.api_server_count is not None:
        common += ["--api-server-count", str(flags.api_server_count)]
    if engine == "vllm":
        # the default attention backend (FlashAttention 3 on Hopper) and torch.compile + CUDA graphs
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, *common,
               "--structured-outputs-config", json.dumps(VLLM_STRUCTURED), "--uvicorn-log-level", "warning",
               "--disable-uvicorn-access-log"]
    elif engine == "flashpage":
        cmd = [sys.executable, "-m", "server", "--model", model, *common, "--attention", "triton",
               "--log-level", "warning"]
    else:
        raise ValueError(f"unknown engine {engine!r}")
    return cmd + list(flags.vllm_args if engine == "vllm" else flags.flashpage_args)


def llm_kwargs(engine: str, model: str, flags: Flags) -> dict:
    """Constructor arguments of the offline engine: `vllm.LLM(**kw)` or `EngineConfig(**kw)`."""
    kw = dict(model=model, dtype=flags.dtype, max_model_len=flags.max_model_len, max_num_seqs=flags.max_num_seqs,
              max_num_batched_tokens=flags.max_num_batched_tokens,
              gpu_memory_utilization=flags.gpu_memory_utilization, block_size=flags.block_size,
              enable_prefix_caching=flags.enable_prefix_caching, enable_chunked_prefill=flags.enable_chunked_prefill,
              seed=flags.seed, enforce_eager=False)
    kw.update(_shared_extras(flags))
    if engine == "vllm":
        kw.update(structured_outputs_config=dict(VLLM_STRUCTURED), disable_log_stats=True)
    elif engine == "flashpage":
        kw.update(attention="triton", log_stats_interval=0)
    else:
        raise ValueError(f"unknown engine {engine!r}")
    return kw


def engine_env(engine: str, base: dict | None = None) -> dict:
    """The environment an engine's process runs in. vLLM: its carried site first and this checkout
    (for benchmarks.peers), and not the flashpage server's wheels (vLLM pins its own fastapi,
    pydantic and xgrammar). flashpage: this checkout, then whatever the caller's PYTHONPATH holds."""
    env = dict(os.environ if base is None else base)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if engine == "vllm":
        paths = [vllm_site(env), str(REPO_ROOT)]
        env.setdefault("VLLM_NO_USAGE_STATS", "1")  # no network there; no thread trying it
        env.setdefault("VLLM_USE_DEEP_GEMM", "0")  # the carried site has no DeepGEMM (fetch_vllm.sh says why)
        # nor FlashInfer: vLLM 0.26.0's GPU model runner builds its Sampler with
        # flashinfer_sampler_supported(), which imports vllm.v1.attention.backends.flashinfer (and so
        # flashinfer) unless this is 0; every engine start failed on that import in the first H100 run
        # (2026-11-27). With 0 it samples top-k/top-p with its own PyTorch/Triton ops.
        env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        # Tensor parallel: vLLM's default all-reduce on Hopper tries torch's symmetric-memory multimem
        # path first, which needs NVLink multicast; the GPU machines keep multicast off (NCCL_ENV), so it
        # would disable itself with a warning. Off by name, vLLM takes its next default, its custom
        # all-reduce over CUDA IPC (as ours: --disable-custom-all-reduce off), else NCCL.
        env.setdefault("VLLM_ALLREDUCE_USE_SYMM_MEM", "0")
    else:
        paths = [str(REPO_ROOT), *[p for p in paths if p != str(REPO_ROOT)]]
    env.update(NCCL_ENV)  # both engines: multicast stays off in every process (server/config.py)
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def versions(engine: str) -> dict:
    """What a result row names as the engine's version (read without importing the engine)."""
    if engine == "vllm":
        return {"vllm": VLLM_VERSION, "site": vllm_site()}
    import subprocess

    if os.environ.get("FLASHPAGE_COMMIT"):  # the device's copy of the tree has no .git
        return {"flashpage": os.environ["FLASHPAGE_COMMIT"]}
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"flashpage": commit}
