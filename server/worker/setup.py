"""Bringing the device side up: load the model, size and allocate the KV cache, compile, capture.

`start_worker(config)` returns a `Worker`: the runner the engine steps, and the numbers the engine
and request validation need (the model's spec, the context limit, the cache's block count), read
only from the model contract.

With --tensor-parallel-size N it first starts ranks 1..N-1 (server/worker/parallel/), then brings
this process up as rank 0; every rank runs `bring_up`, whose forwards (the profile run, warm-up,
graph captures) meet in the same collectives, and the KV cache's block count is the smallest any
rank's memory allows. A speculative draft is rank 0's alone (server/worker/spec/parallel.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels import pdl
from kvcache import CacheSpec, KVScales, dtype_name, is_fp8_cache, resolve_cache_dtype
from models import (DTYPES, ModelSpec, TensorParallel, WeightsInfo, check_quantized_split, checkpoint_dtype, load_config,
                    load_model, load_tokenizer, shard_spec, tensor_parallel, weights_info)
from server.config import EngineConfig
from server.worker.kv_scales import CALIBRATION_TEXT, decide_kv_scales
from server.worker.runner import ModelRunner
from server.worker.spec import DraftRunner, capture_spec_graphs, load_proposer, shared_blocks
from server.worker.warmup import profile_peak_memory, warmup

log = logging.getLogger("flashpage.worker")


@dataclass(slots=True)
class Worker:
    runner: ModelRunner
    spec: ModelSpec
    cache_spec: CacheSpec
    num_blocks: int
    max_model_len: int
    device: torch.device
    weights: WeightsInfo  # the weights' format and real bytes on the device (quantized or not)
    draft: DraftRunner | None = None  # speculative decoding's draft model or EAGLE-3 head (server/worker/spec/)
    kv_scales: KVScales | None = None  # an fp8 cache's (kvcache/fp8.py), this rank's KV heads


def resolve_device(config: EngineConfig) -> torch.device:
    return torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))


def start_worker(config: EngineConfig, path: Path, tokenizer=None) -> Worker:
    """`tokenizer` (the checkpoint's; loaded where needed when not given) encodes the calibration
    text of an fp8 cache without checkpoint scales."""
    if config.tensor_parallel_size == 1:
        return bring_up(config, path, resolve_device(config), tokenizer=tokenizer)
    from server.worker.parallel.peers import rank_device, start_peers

    check_tensor_parallel(config, path)
    peers = start_peers(config, path)
    try:
        return bring_up(config, path, rank_device(config, 0), peers, tokenizer)
    except BaseException:
        peers.close(graceful=False)
        raise


def check_tensor_parallel(config: EngineConfig, path: Path) -> None:
    """What does not divide stops the start here, before any process starts (ValueError): heads, a
    quantized layer whose blocks or groups a rank's share would cut (named). (A speculative draft
    runs whole on rank 0: it need not divide.)"""
    shard_spec(ModelSpec.from_hf_config(load_config(path)), TensorParallel(0, config.tensor_parallel_size))
    check_quantized_split(path, config.quantization, config.tensor_parallel_size)


def bring_up(config: EngineConfig, path: Path, device: torch.device, peers=None, tokenizer=None) -> Worker:
    """This process's worker (under tensor parallelism, its rank's; `peers`: rank 0's other ranks)."""
    on_cuda = device.type == "cuda"
    dtype = DTYPES[config.dtype] if config.dtype != "auto" else auto_dtype(path, on_cuda)
    attention = config.attention or ("triton" if on_cuda else "sdpa")
    if attention == "triton" and dtype == torch.float32:
        raise ValueError("--attention triton runs in float16 or bfloat16: pass --dtype float16/bfloat16, "
                         "or use --attention sdpa for float32")
    if config.kv_cache_dtype != "auto" and on_cuda and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(f"--kv-cache-dtype {config.kv_cache_dtype} needs a GPU with fp8 conversions (compute "
                         f"capability 8.9 or later: Ada, Hopper); this one is "
                         f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}")
    pdl.enable(config.enable_pdl)  # before any kernel compiles or a graph is captured
    if config.enable_pdl:
        log.info("programmatic dependent launch: %s", "on" if pdl.active(device) else
                 "off (it needs a CUDA GPU of compute capability 9.0 or later)")
    tp = tensor_parallel()
    if tp.size != config.tensor_parallel_size:  # models are built for the process's group
        raise RuntimeError(f"this process runs a tensor-parallel group of {tp.size}: an engine of "
                           f"--tensor-parallel-size {config.tensor_parallel_size} cannot start beside it (close that one first)")
    log.info("loading weights from %s (%s, attention=%s, device=%s%s%s%s)", path, dtype, attention, device,
             ", deterministic" if config.deterministic else "", f", tensor-parallel rank {tp.rank} of {tp.size}"
             if tp.size > 1 else "", ", random weights (--load-format dummy)" if config.load_format == "dummy" else "")
    model = load_model(path, dtype, device, attention, deterministic=config.deterministic,
                       quantization=config.quantization, load_format=config.load_format)
    weights = weights_info(model)
    # The bytes the weights take on the device, which the KV budget below is measured after: a
    # quantized checkpoint's real size (its 16-bit size on the CPU and with --deterministic, where
    # the weights are dequantized at load).
    log.info("weights: %.2f GiB (%s)", weights.bytes / 2**30, weights.quantization or f"{dtype}, not quantized")
    if config.deterministic and on_cuda:
        from kernels.invariant_matmul import check_configs

        found = check_configs(device)
        if not found.configs_agree:
            log.warning("deterministic mode: this GPU's GEMM tile configs differ in bits; every batch size "
                        "uses the small-tile config (slower prefill and large batches)")
        if not found.split_agrees:
            log.warning("deterministic mode: this GPU's split GEMM differs in bits from the unsplit one; "
                        "no GEMM splits over K (slower small batches)")
    spec = model.spec
    max_model_len = spec.max_position_embeddings
    if config.max_model_len is not None:  # never 0 for "the default": the CLI refuses 0
        max_model_len = min(config.max_model_len, max_model_len)
    if spec.sliding_window is not None and max_model_len > spec.sliding_window:
        # Within its window a sliding-window model attends like any other; past it, it must not see
        # the oldest tokens, which our kernels do not implement.
        raise ValueError(f"this model attends over a sliding window of {spec.sliding_window} tokens, which flashpage "
                         f"does not implement; serve it with --max-model-len {spec.sliding_window} or less "
                         f"(the context would be {max_model_len})")
    cache_dtype = resolve_cache_dtype(config.kv_cache_dtype, dtype)
    cache_spec = CacheSpec(spec.num_layers, spec.num_kv_heads, spec.head_dim, config.block_size, cache_dtype)
    runner = ModelRunner(model, cache_spec, device, config.max_num_seqs, config.max_num_batched_tokens, max_model_len)
    if peers is not None:
        runner.attach_peers(peers)
    scales = None
    if is_fp8_cache(cache_dtype):
        # under tensor parallelism every rank decides its own heads' scales (a calibration pass's
        # forwards meet in the same collectives on every rank)
        tokenizer = tokenizer or load_tokenizer(path)
        scales = decide_kv_scales(runner, cache_dtype, dtype, path, config.calculate_kv_scales,
                                  tokenizer(CALIBRATION_TEXT)["input_ids"], max_model_len,
                                  from_checkpoint=config.load_format != "dummy")
        log.info("KV cache %s: scales %s%s", dtype_name(cache_dtype), scales.describe(),
                 f" (rank {tp.rank}'s {spec.num_kv_heads} KV heads)" if tp.size > 1 else "")
    # (rank 0's alone under tensor parallelism)
    draft = load_proposer(config, model, dtype, device, attention, max_model_len, config.block_size, runner.max_tokens)
    num_blocks = kv_cache_blocks(config, cache_spec, runner, device)
    if draft is not None:  # each of this rank's blocks holds the draft's K/V too (server/worker/spec/draft.py)
        num_blocks = shared_blocks(config, num_blocks, cache_spec, draft.bytes_per_block)
    num_blocks = tp.min(num_blocks, device)  # every rank's cache holds them
    log_cache_size(cache_spec, num_blocks, max_model_len, dtype)
    runner.allocate_cache(num_blocks, scales)
    if draft is not None:
        draft.allocate_cache(num_blocks)
    if on_cuda:
        t0 = time.monotonic()
        warmup(runner)
        if draft is not None:
            warmup(draft)
        log.info("compiled and warmed up the attention kernels in %.1f s", time.monotonic() - t0)
        if not config.enforce_eager:
            log.info("capturing CUDA graphs")
            runner.capture_graphs()
            capture_spec_graphs(config.speculative_config, runner, draft)
    return Worker(runner, spec, cache_spec, num_blocks, max_model_len, device, weights, draft, scales)


def log_cache_size(cache_spec: CacheSpec, num_blocks: int, max_model_len: int, model_dtype: torch.dtype) -> None:
    """The cache's capacity in blocks, tokens and bytes; an fp8 cache's relative to the model's dtype."""
    tokens = num_blocks * cache_spec.block_size
    per_token = cache_spec.bytes_per_block // cache_spec.block_size
    ratio = ""
    if cache_spec.dtype != model_dtype:
        wide = model_dtype.itemsize / cache_spec.dtype.itemsize
        ratio = f", {wide:g}x the tokens a {dtype_name(model_dtype)} cache holds in this memory"
    log.info("KV cache (%s): %d blocks of %d tokens = %d tokens, %d bytes a token, %.1f MiB%s; %d concurrent "
             "full-length (%d-token) sequences", dtype_name(cache_spec.dtype), num_blocks, cache_spec.block_size,
             tokens, per_token, num_blocks * cache_spec.bytes_per_block / 2**20, ratio, tokens // max_model_len,
             max_model_len)


def auto_dtype(path: Path, on_cuda: bool) -> torch.dtype:
    """--dtype auto: on CUDA the checkpoint's own half-precision dtype (bf16 for the Llama family),
    else float16; on the CPU float32."""
    if not on_cuda:
        return torch.float32
    dtype = checkpoint_dtype(path)
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.float16


def kv_cache_blocks(config: EngineConfig, cache_spec: CacheSpec, runner: ModelRunner, device: torch.device) -> int:
    """KV blocks to allocate: --num-blocks, else --kv-cache-memory, else (CUDA) what is left under
    --gpu-memory-utilization after the weights and the largest step's activations, else (CPU)
    --cpu-kv-cache-memory."""
    # What the budget is left after is measured, not computed: torch's allocator holds the weights in
    # their real (quantized) bytes when the largest step is profiled.
    if config.num_blocks is not None:
        return _at_least_one(config.num_blocks, cache_spec, "--num-blocks")
    if config.kv_cache_memory is not None:
        return _at_least_one(cache_spec.blocks_for_budget(config.kv_cache_memory), cache_spec, "--kv-cache-memory")
    if device.type == "cuda":
        # Size from what is left under the utilisation cap after weights and the activations of
        # the largest possible step (measured by running it), as vLLM does.
        peak = profile_peak_memory(runner)
        torch.cuda.empty_cache()  # the cache is one allocation: free segments must be given back first
        free, total = torch.cuda.mem_get_info(device)
        in_use_elsewhere = total - free - torch.cuda.memory_reserved(device)
        budget = config.gpu_memory_utilization * total - peak - in_use_elsewhere
        log.info("memory: %.2f GiB total, peak step %.2f GiB, other processes %.2f GiB -> KV budget %.2f GiB",
                 total / 2**30, peak / 2**30, in_use_elsewhere / 2**30, budget / 2**30)
        return _at_least_one(cache_spec.blocks_for_budget(int(budget)), cache_spec, "--gpu-memory-utilization")
    return _at_least_one(cache_spec.blocks_for_budget(config.cpu_kv_cache_memory), cache_spec, "--cpu-kv-cache-memory")


def _at_least_one(num_blocks: int, cache_spec: CacheSpec, flag: str) -> int:
    """A budget that holds no block would start a server that refuses every request: stop instead."""
    if num_blocks < 1:
        raise ValueError(f"the KV cache ({flag}) holds no block of {cache_spec.bytes_per_block} bytes: "
                         f"raise {flag}" + (", or give --num-blocks" if flag != "--num-blocks" else ""))
    return num_blocks
