"""Command line: `python -m server [--model PATH_OR_ID] [--attention triton|eager|sdpa] ...`."""

from __future__ import annotations

import argparse
import gc
import logging
import sys
import time

from server.config import EngineConfig
from server.limits import ServerLimits, add_arguments


def _bytes(text: str) -> int:
    units = {"k": 2**10, "m": 2**20, "g": 2**30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m server", description="flashpage: serve a GPT-2-family model over HTTP.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None, help="local Hugging Face model directory or hub id (default: the embedded model)")
    p.add_argument("--served-model-name", default=None, help="name reported by the API (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="auto = float16 on CUDA, float32 on CPU")
    p.add_argument("--device", default=None, help="cuda, cuda:1 or cpu (default: cuda if available)")
    p.add_argument("--attention", default=None, choices=["triton", "eager", "sdpa"],
                   help="attention backend (default: triton on CUDA, sdpa on CPU)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks to allocate (overrides the memory budget)")
    p.add_argument("--kv-cache-memory", type=_bytes, default=None, help="KV cache budget, e.g. 512MiB or 2GiB")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="on CUDA, the fraction of GPU memory the process may use, KV cache included")
    p.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one step")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="token budget of one step")
    p.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's n_positions)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--max-admit-delay", type=int, default=8,
                   help="steps a waiting request may be held back while many others decode, so that "
                        "prompts arriving together share one prefill (0 = admit at once)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="schedule and launch each step while the previous one still runs on the device")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine in its own process, so that HTTP streaming never slows its steps "
                        "(--no-engine-process: a thread of the server process)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", default="text", choices=["text", "json"],
                   help="text lines, or one JSON object per line (with request_id where known)")
    p.add_argument("--log-stats-interval", type=float, default=5.0,
                   help="seconds between engine summary lines while busy (0 = off)")
    add_arguments(p)  # request limits, queue bound, deadline, shutdown grace, API key (server/limits.py)
    return p


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    fields = EngineConfig.__dataclass_fields__
    return EngineConfig(**{k: v for k, v in vars(args).items() if k in fields})


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    from server.logs import setup_logging

    setup_logging(args.log_level, args.log_format)
    import torch

    from server.api import create_app
    from server.async_engine import AsyncEngine
    from server.engine import LLMEngine
    from server.engine_process import EngineClient
    from server.lifecycle import serve

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
    # serve(): SIGTERM drains within --shutdown-grace then exits 0; a dead engine exits 1 (server/lifecycle.py).
    try:
        code = serve(app, aengine, limits.shutdown_grace, host=args.host, port=args.port, log_level=args.log_level,
                     log_config=None, access_log=False)
    finally:
        gc.unfreeze()  # frozen objects are never freed: triton's bindings would report them leaked at exit
    sys.exit(code)


if __name__ == "__main__":
    main()
