"""Command line: `python -m server [--model PATH_OR_ID] [--attention triton|eager|sdpa] ...`."""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import time

from server.api.chat_template import read_chat_template
from server.api.fast_encoder import BACKENDS
from server.api.guards import ServerLimits
from server.api.limit_flags import SIZE, Bound, add_arguments, api_key, parse_bytes
from server.api.reasoning import REASONING_PARSERS
from server.api.tools import TOOL_PARSERS
from server.api.servers import MAX_API_SERVERS, default_api_server_count
from server.config import (ATTENTION_BACKENDS, DTYPE_NAMES, KV_CACHE_DTYPE_NAMES, LOAD_FORMATS, MAX_TENSOR_PARALLEL_SIZE,
                           QUANTIZATION_METHODS, SERVE_MAX_NUM_BATCHED_TOKENS, EngineConfig, SpeculativeConfig,
                           StructuredLimits)


def device(text: str) -> str:
    """--device: cpu, cuda or cuda:N (checked here, so that a typo stops the server before it loads)."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device: give cpu, cuda or cuda:N")
    return text


def name(text: str) -> str:
    """A non-empty name: an empty one would silently mean the default."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty (leave the flag out for the default)")
    return text


def speculative_config(text: str) -> SpeculativeConfig:
    """--speculative-config: vLLM's JSON object (server/config.py SpeculativeConfig.parse)."""
    try:
        return SpeculativeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    # Every engine flag's default comes from server/config.py (EngineConfig; the step budget is the
    # server's own, SERVE_MAX_NUM_BATCHED_TOKENS), and every number is checked against its
    # range (Bound) as it is parsed: a setting the server cannot run with exits 2 naming the flag.
    # A count or size of 0 is refused rather than read as "the default" (leave the flag out for that).
    d = EngineConfig()
    p = argparse.ArgumentParser(prog="python -m server", description="flashpage: serve a language model over HTTP.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", type=name, default=d.model,
                   help="local Hugging Face model directory or hub id (default: the embedded model)")
    p.add_argument("--served-model-name", type=name, default=d.served_model_name,
                   help="name reported by the API (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=Bound(int, 0, 65535), default=8000)
    p.add_argument("--dtype", default=d.dtype, choices=DTYPE_NAMES,
                   help="auto = on CUDA the checkpoint's float16/bfloat16 (else float16), on CPU float32")
    p.add_argument("--device", type=device, default=d.device, help="cuda, cuda:1 or cpu (default: cuda if available)")
    p.add_argument("--quantization", "-q", default=d.quantization, choices=QUANTIZATION_METHODS,
                   help="fp8: quantize a 16-bit checkpoint's linear weights to FP8 at load (per channel; "
                        "activations per token); a quantized checkpoint's format is read from its config.json")
    p.add_argument("--attention", default=d.attention, choices=ATTENTION_BACKENDS,
                   help="attention backend (default: triton on CUDA, sdpa on CPU)")
    p.add_argument("--tensor-parallel-size", "-tp", type=Bound(int, 1, MAX_TENSOR_PARALLEL_SIZE),
                   default=d.tensor_parallel_size,
                   help="GPUs (cuda:0..N-1, or from --device's index) that split the model, each holding 1/N of "
                        "its attention heads and MLP, one process each (on the CPU: N processes over gloo)")
    p.add_argument("--disable-custom-all-reduce", action=argparse.BooleanOptionalAction,
                   default=d.disable_custom_all_reduce,
                   help="tensor parallelism on CUDA: every all-reduce through NCCL, not a decode step's small "
                        "16-bit ones as a one-shot over symmetric memory (NVLink stores, no barrier; the default)")
    p.add_argument("--load-format", default=d.load_format, choices=LOAD_FORMATS,
                   help="auto: the checkpoint's weight files; dummy: random weights at the checkpoint's shape, "
                        "from its config.json alone (benchmarks without the weight files)")
    p.add_argument("--block-size", type=Bound(int, 1, 256, power_of_two=True), default=d.block_size,
                   help="tokens per KV block")
    p.add_argument("--num-blocks", type=Bound(int, 1), default=d.num_blocks,
                   help="KV blocks to allocate (default: as many as the memory budget holds)")
    p.add_argument("--kv-cache-memory", type=Bound(parse_bytes, 1, what=SIZE), default=d.kv_cache_memory,
                   help="KV cache budget, e.g. 512MiB or 2GiB")
    p.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=KV_CACHE_DTYPE_NAMES,
                   help="KV cache storage: auto = the model's dtype; fp8 (= fp8_e4m3, scaled) or fp8_e5m2 "
                        "(unscaled) hold twice the tokens in the same memory")
    p.add_argument("--calculate-kv-scales", action=argparse.BooleanOptionalAction, default=d.calculate_kv_scales,
                   help="fp8_e4m3 cache and no k_scale/v_scale in the checkpoint: calibrate them on a short "
                        "text at start-up (--no-calculate-kv-scales: 1.0, with a warning); checkpoint scales "
                        "are always used where present")
    p.add_argument("--cpu-kv-cache-memory", type=Bound(parse_bytes, 1, what=SIZE), default=d.cpu_kv_cache_memory,
                   help="on the CPU, the KV cache's size in bytes unless --num-blocks or --kv-cache-memory say otherwise")
    p.add_argument("--gpu-memory-utilization", type=Bound(float, above=0, high=1), default=d.gpu_memory_utilization,
                   help="on CUDA, the fraction of GPU memory the process may use, KV cache included")
    p.add_argument("--max-num-seqs", type=Bound(int, 1), default=d.max_num_seqs, help="most sequences in one step")
    p.add_argument("--max-num-batched-tokens", type=Bound(int, 1), default=SERVE_MAX_NUM_BATCHED_TOKENS,
                   help="token budget of one step (larger: fewer, longer prefill steps, which delay the "
                        "tokens of every request decoding beside them)")
    p.add_argument("--max-model-len", type=Bound(int, 1), default=d.max_model_len,
                   help="context limit (default: the model's max_position_embeddings)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=d.enable_prefix_caching)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=d.enable_chunked_prefill)
    p.add_argument("--max-admit-delay", type=Bound(int, 0), default=d.max_admit_delay,
                   help="steps a waiting request may be held back while many others decode, so that "
                        "prompts arriving together share one prefill (0 = admit at once)")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=d.enforce_eager, help="no CUDA graphs")
    p.add_argument("--enable-pdl", action=argparse.BooleanOptionalAction, default=d.enable_pdl,
                   help="programmatic dependent launch on compute capability 9.0+ (Hopper): a decode GEMV starts "
                        "streaming its weights while the kernel before it finishes")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=d.async_scheduling,
                   help="schedule and launch each step while the previous one still runs on the device")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine in its own process, so that HTTP streaming never slows its steps "
                        "(--no-engine-process: a thread of the server process)")
    p.add_argument("--api-server-count", type=Bound(int, 1, MAX_API_SERVERS), default=default_api_server_count(),
                   help="HTTP API processes sharing the port in front of the one engine process (tokenising, "
                        "validation and streaming scale with them; default: from the cores available)")
    p.add_argument("--seed", type=Bound(int, 0, 2**63 - 1), default=d.seed)
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction,
                   default=d.deterministic or os.environ.get("FLASHPAGE_DETERMINISTIC", "0").lower() in ("1", "true", "yes"),
                   help="batch-invariant kernels: each request's tokens and logprobs are bitwise the same whatever "
                        "else is in the batch (sampled ones for the same seed); costs speed, see docs/api.md "
                        "(also FLASHPAGE_DETERMINISTIC=1; needs --attention triton)")
    p.add_argument("--speculative-config", type=speculative_config, default=d.speculative_config, metavar="JSON",
                   help='speculative decoding, vLLM\'s keys: {"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4}, {"method": "draft_model", "model": DIR, "num_speculative_tokens": 4} '
                        'or {"method": "eagle3", "model": EAGLE3_HEAD_DIR, "num_speculative_tokens": 3}; '
                        'optional "disable_by_batch_size" (no speculation above that many running sequences) and '
                        '"min_acceptance" (a sequence backs off below it); flashpage\'s "backoff" (per_sequence, or batch: '
                        'one cost-model decision a step, the default of draft_model and eagle3) and "round_cost"')
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", default="text", choices=["text", "json"],
                   help="text lines, or one JSON object per line (with request_id where known)")
    p.add_argument("--log-stats-interval", type=Bound(float, 0), default=d.log_stats_interval,
                   help="seconds between engine summary lines while busy (0 = off)")
    p.add_argument("--chat-template", type=read_chat_template, default=None, metavar="FILE",
                   help="Jinja chat template for /v1/chat/completions, in place of the tokenizer's own "
                        "(needed when the model has none)")
    p.add_argument("--tokenizer-backend", choices=BACKENDS, default=ServerLimits().tokenizer_backend,
                   help="who encodes prompts: 'auto' uses fastokens (~20x faster) where it encodes a probe set "
                        "exactly as the tokenizer does and the tokenizer's own encoder otherwise (the log says "
                        "which); 'fastokens' refuses to start without it; 'hf' is the tokenizers library")
    add_structured_arguments(p, d.structured)
    tools = ServerLimits().tools
    p.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=tools.parser,
                   help="the format the model writes tool calls in (vLLM's names: hermes for Qwen2.5 and Qwen3, "
                        "llama3_json or pythonic for Llama 3.x, and Mistral's); required and named tool choices "
                        "are written in it (without it: plain JSON)")
    p.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=tools.auto,
                   help="let the model decide whether to call tools (tool_choice 'auto', the default with tools); "
                        "needs --tool-call-parser")
    p.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=tools.reasoning,
                   help="split the model's <think>...</think> reasoning into reasoning_content (chat) and "
                        "reasoning items (Responses)")
    add_arguments(p)  # request and connection limits, queue, deadline, shutdown grace, API key (server/api/limit_flags.py)
    return p


def add_structured_arguments(p: argparse.ArgumentParser, d: StructuredLimits) -> None:
    """The bounds on structured-output specs (server/engine/grammar_bounds.py) and their compile
    (server/engine/grammar_compile.py): over one, a request is a 400 that names its flag."""
    g = p.add_argument_group("structured outputs (every spec is bounded, then compiled in a sacrificial process)")
    g.add_argument("--max-structured-spec-bytes", type=Bound(parse_bytes, 1, what=SIZE),
                   default=d.max_structured_spec_bytes,
                   help="largest JSON schema (as JSON), regular expression, EBNF grammar or choice list")
    g.add_argument("--max-structured-depth", type=Bound(int, 1), default=d.max_structured_depth,
                   help="deepest nesting of objects and arrays in a JSON schema, counting what its $refs name")
    g.add_argument("--max-structured-length", type=Bound(int, 1), default=d.max_structured_length,
                   help="largest count a spec may ask for: a JSON schema's maxLength, minLength, maxItems, minItems, "
                        "maxProperties, minProperties, and {m,n} in a regular expression or EBNF grammar")
    g.add_argument("--max-structured-items", type=Bound(int, 1), default=d.max_structured_items,
                   help="most entries of one list in a JSON schema (enum, anyOf, oneOf, required, ...) or of a choice")
    g.add_argument("--max-structured-properties", type=Bound(int, 1), default=d.max_structured_properties,
                   help="most properties of one object in a JSON schema")
    g.add_argument("--max-structured-regex-chars", type=Bound(int, 1), default=d.max_structured_regex_chars,
                   help="longest regular expression, as a spec or a JSON schema's pattern")
    g.add_argument("--structured-cache-memory", type=Bound(parse_bytes, 1, what=SIZE), default=d.structured_cache_memory,
                   help="compiled grammars each process that compiles keeps (least recently used go first), e.g. 256MiB")
    g.add_argument("--structured-compile-timeout", type=Bound(float, above=0), default=d.structured_compile_timeout,
                   help="seconds a new spec may take to compile; past them its request is a 400 and the compile "
                        "process is replaced")


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    fields, given = EngineConfig.__dataclass_fields__, vars(args)
    structured = StructuredLimits(**{k: v for k, v in given.items() if k in StructuredLimits.__dataclass_fields__})
    return EngineConfig(**{k: v for k, v in given.items() if k in fields}, structured=structured)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    env_key = os.environ.get("FLASHPAGE_API_KEY")
    if args.api_key is None and env_key:  # the key's other spelling gets the flag's check
        try:
            api_key(env_key)
        except argparse.ArgumentTypeError as e:
            parser.error(f"FLASHPAGE_API_KEY {e}")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser (the format to read the calls in)")
    limits = ServerLimits.from_args(args)
    if args.api_server_count > 1 and not args.engine_process:
        parser.error("--api-server-count above 1 needs the engine in its own process: drop --no-engine-process")
    from server.api.connections import raise_fd_limit
    from server.logs import setup_logging

    setup_logging(args.log_level, args.log_format)
    raise_fd_limit(limits.max_connections)  # before the model loads: a cap the process cannot hold stops it here
    if args.api_server_count > 1:  # the engine and N API processes, each its own (server/api/servers.py)
        from server.api.servers import run_servers

        sys.exit(run_servers(config_from_args(args), limits, args.api_server_count, args.host, args.port,
                             args.log_level, args.log_format))
    from server.bridge.engine_spawn import spawn_engine

    log = logging.getLogger("flashpage.cli")
    t0 = time.perf_counter()
    log.info("starting engine: model=%s", args.model or "embedded")
    config = config_from_args(args)
    # The engine process first: its imports and model load run while this process imports torch,
    # transformers and the HTTP stack (~3 s of CPU each side; one after the other, start-up took both).
    spawned = spawn_engine(config, 1, args.log_level, args.log_format) if args.engine_process else None
    import torch

    from server.api.app import create_app
    from server.api.lifecycle import serve
    from server.bridge.async_engine import AsyncEngine
    from server.bridge.engine_process import EngineClient
    from server.engine import LLMEngine

    torch.manual_seed(args.seed)
    if spawned is not None:
        process, (channel,) = spawned
        engine = EngineClient(config, channel, process)  # waits until the engine is ready
    else:
        engine = LLMEngine(config)
    log.info("engine ready in %.1f s: serving %r (context %d tokens) on http://%s:%d", time.perf_counter() - t0,
             engine.model_name, engine.max_model_len, args.host, args.port)
    aengine = AsyncEngine(engine, max_waiting=limits.max_waiting_requests, request_timeout=limits.request_timeout)
    app = create_app(aengine, limits)
    # log_config=None: uvicorn's loggers propagate to our handler (text or JSON); our request-id
    # middleware writes the access lines, so uvicorn's own are off.
    # serve(): SIGTERM drains within --shutdown-grace then exits 0; a dead engine exits 1; it also
    # freezes what start-up built out of garbage collection (server/api/lifecycle.py).
    code = serve(app, aengine, limits, host=args.host, port=args.port, log_level=args.log_level,
                 log_config=None, access_log=False)
    sys.exit(code)


if __name__ == "__main__":
    main()
