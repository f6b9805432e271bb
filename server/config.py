"""Engine configuration: one dataclass, filled from the CLI (server/cli.py) or by code."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    model: str | None = None  # local directory or hub id; None = the embedded model
    served_model_name: str | None = None
    dtype: str = "auto"  # auto = float16 on CUDA, float32 on CPU
    device: str | None = None  # None = cuda if available
    attention: str | None = None  # triton | eager | sdpa; None = triton on CUDA, sdpa on CPU
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | None = None  # bytes
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_admit_delay: int = 8  # steps waiting requests may be held back to share a prefill (server/scheduler.py)
    enforce_eager: bool = False
    async_scheduling: bool = True  # launch step k before step k-1's tokens reach the host
    seed: int = 0
    log_stats_interval: float = 5.0  # seconds between engine summary log lines while busy; 0 = off
