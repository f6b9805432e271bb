"""Command line: `python -m server [--model PATH_OR_ID] [--attention triton|eager|sdpa] ...`."""

from __future__ import annotations

import argparse
import logging

from server.config import EngineConfig


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
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    fields = EngineConfig.__dataclass_fields__
    return EngineConfig(**{k: v for k, v in vars(args).items() if k in fields})


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch
    import uvicorn

    from server.api import create_app
    from server.async_engine import AsyncEngine
    from server.engine import LLMEngine

    torch.manual_seed(args.seed)
    engine = LLMEngine(config_from_args(args))
    app = create_app(AsyncEngine(engine))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=30)


if __name__ == "__main__":
    main()
