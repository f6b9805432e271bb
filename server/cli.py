"""Command line: `python -m server [--model PATH_OR_ID] [--attention triton|eager|sdpa] ...`."""

from __future__ import annotations

import argparse
import gc
import logging
import sys
import time

from server.api.chat_template import read_chat_template
from server.api.guards import ServerLimits, add_arguments, parse_bytes
from server.config import ATTENTION_BACKENDS, DTYPE_NAMES, EngineConfig


def build_parser() -> argparse.ArgumentParser:
    d = EngineConfig()  # every engine flag's default comes from here
    p = argparse.ArgumentParser(prog="python -m server", description="flashpage: serve a language model over HTTP.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=d.model, help="local Hugging Face model directory or hub id (default: the embedded model)")
    p.add_argument("--served-model-name", default=d.served_model_name, help="name reported by the API (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default=d.dtype, choices=DTYPE_NAMES,
                   help="auto = on CUDA the checkpoint's float16/bfloat16 (else float16), on CPU float32")
    p.add_argument("--device", default=d.device, help="cuda, cuda:1 or cpu (default: cuda if available)")
    p.add_argument("--attention", default=d.attention, choices=ATTENTION_BACKENDS,
                   help="attention backend (default: triton on CUDA, sdpa on CPU)")
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    p.add_argument("--num-blocks", type=int, default=d.num_blocks, help="KV blocks to allocate (overrides the memory budget)")
    p.add_argument("--kv-cache-memory", type=parse_bytes, default=d.kv_cache_memory, help="KV cache budget, e.g. 512MiB or 2GiB")
    p.add_argument("--cpu-kv-cache-memory", type=parse_bytes, default=d.cpu_kv_cache_memory,
                   help="on the CPU, the KV cache's size in bytes unless --num-blocks or --kv-cache-memory say otherwise")
    p.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                   help="on CUDA, the fraction of GPU memory the process may use, KV cache included")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="most sequences in one step")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens, help="token budget of one step")
    p.add_argument("--max-model-len", type=int, default=d.max_model_len,
                   help="context limit (default: the model's max_position_embeddings)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=d.enable_prefix_caching)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=d.enable_chunked_prefill)
    p.add_argument("--max-admit-delay", type=int, default=d.max_admit_delay,
                   help="steps a waiting request may be held back while many others decode, so that "
                        "prompts arriving together share one prefill (0 = admit at once)")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=d.enforce_eager, help="no CUDA graphs")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=d.async_scheduling,
                   help="schedule and launch each step while the previous one still runs on the device")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine in its own process, so that HTTP streaming never slows its steps "
                        "(--no-engine-process: a thread of the server process)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", default="text", choices=["text", "json"],
                   help="text lines, or one JSON object per line (with request_id where known)")
    p.add_argument("--log-stats-interval", type=float, default=d.log_stats_interval,
                   help="seconds between engine summary lines while busy (0 = off)")
    p.add_argument("--chat-template", type=read_chat_template, default=None, metavar="FILE",
                   help="Jinja chat template for /v1/chat/completions, in place of the tokenizer's own "
                        "(needed when the model has none)")
    add_arguments(p)  # request limits, queue bound, deadline, shutdown grace, API key (server/api/guards.py)
    return p


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    fields = EngineConfig.__dataclass_fields__
    return EngineConfig(**{k: v for k, v in vars(args).items() if k in fields})


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    from server.logs import setup_logging

    setup_logging(args.log_level, args.log_format)
    import torch

    from server.api.app import create_app
    from server.api.lifecycle import serve
    from server.bridge.async_engine import AsyncEngine
    from server.bridge.engine_process import EngineClient
    from server.engine import LLMEngine

    torch.manual_seed(args.seed)
    log = logging.getLogger("flashpage.cli")
    t0 = time.perf_counter()
    log.info("starting engine: model=%s", args.model or "embedded")
    config = config_from_args(args)
    engine = EngineClient(config, args.log_level, args.log_format) if args.engine_process else LLMEngine(config)
    log.info("engine ready in %.1f s: serving %r (context %d tokens) on http://%s:%d", time.perf_counter() - t0,
             engine.model_name, engine.max_model_len, args.host, args.port)
    limits = ServerLimits.from_args(args)
    aengine = AsyncEngine(engine, max_waiting=limits.max_waiting_requests, request_timeout=limits.request_timeout)
    app = create_app(aengine, limits)
    # Start-up leaves millions of long-lived objects (torch, transformers, the tokenizer); each full
    # collection would walk them all again, a pause in the middle of serving. Freeze them out of it.
    gc.collect()
    gc.freeze()
    # log_config=None: uvicorn's loggers propagate to our handler (text or JSON); our request-id
    # middleware writes the access lines, so uvicorn's own are off.
    # serve(): SIGTERM drains within --shutdown-grace then exits 0; a dead engine exits 1 (server/api/lifecycle.py).
    try:
        code = serve(app, aengine, limits.shutdown_grace, host=args.host, port=args.port, log_level=args.log_level,
                     log_config=None, access_log=False)
    finally:
        gc.unfreeze()  # frozen objects are never freed: triton's bindings would report them leaked at exit
    sys.exit(code)


if __name__ == "__main__":
    main()
