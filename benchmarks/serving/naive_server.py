"""The naive baseline: a GPT-2 checkpoint behind FastAPI with `transformers` `generate`, static batches.

    python -m benchmarks.serving.naive_server --model PATH [--port 8001] [--max-batch 32] [--batch-wait-ms 0]

This is how many people first put a model behind HTTP, and what the load test compares flashpage
against. It speaks the same API as flashpage (server/api/app.py): `POST /generate` with `prompt` or
`prompt_token_ids`, `max_tokens`, `temperature`, `top_p`, `top_k`, `seed`, `stop`,
`stop_token_ids`, `ignore_eos`, `stream`; the same JSON answer `{id, text, token_ids,
finish_reason, usage}`, the same SSE events (`{id, text, token_ids, finished: false}` per step,
then `{..., finished: true, finish_reason, usage}`, then `data: [DONE]`), 422 for bodies that do
not validate, 400 for prompts that do not fit the context, `GET /health`. It also answers
`GET /info` with the vocab size and context length, which the load test reads.

How it serves
- The model is `transformers.GPT2LMHeadModel` with `attn_implementation="eager"`, fp16 on CUDA and
  fp32 on CPU (`--dtype` overrides), Hugging Face's own KV cache.
- Static batching: requests wait in a FIFO queue. When the model is idle, the batcher takes the
  oldest waiting request and up to `--max-batch` - 1 more that share its sampling settings
  (temperature, top_p, top_k; `generate` takes one set per call), optionally after waiting
  `--batch-wait-ms` for the batch to fill. Prompts are left-padded to the longest, and
  `generate` runs for the largest `max_tokens` in the batch; a request that arrives meanwhile waits
  for the whole batch to finish (no continuous batching: that is the point of the baseline).
- `generate` runs in one worker thread, so the event loop keeps accepting and streaming requests.
- Streaming: a per-batch streamer (a `transformers` BaseStreamer fed one token per row per step)
  hands each step's tokens to the requests' queues, so tokens stream as they are generated, one SSE
  event per step, and a request finishes (its final event and `[DONE]`) as soon as it has its
  `max_tokens`, hits EOS (unless ignore_eos) or a stop token/string, even though its batch runs on.
  A custom stopping criterion marks such rows done; the batch ends when every row is done.
- Each request's output is trimmed to its own limits: EOS and stop token ids are kept as the last
  token (finish_reason "stop"), as flashpage does; stop strings cut the text.
- `seed`: a batch is seeded with the seed of its first request that has one (per-request seeds are
  not possible inside one `generate` call).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from benchmarks.serving.naive_engine import NaiveServer, Pending  # noqa: E402

log = logging.getLogger("naive_server")


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False

    @model_validator(mode="after")
    def _one_prompt(self):
        if (self.prompt is None) == (self.prompt_token_ids is None):
            raise ValueError("give exactly one of 'prompt' or 'prompt_token_ids'")
        return self



def _error(status: int, message: str, kind: str = "invalid_request_error", headers=None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind}}, status_code=status, headers=headers)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def create_app(server: NaiveServer) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        server.start()
        yield
        await server.stop()

    app = FastAPI(title="naive transformers baseline", lifespan=lifespan)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/info")
    async def info():
        return {"model": server.model_name, "vocab_size": server.vocab_size, "max_model_len": server.max_model_len,
                "max_batch": server.max_batch, "device": str(server.device), "dtype": str(server.dtype).removeprefix("torch."),
                "batches": server.batches, "waiting": len(server.waiting)}

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request):
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        headers = {"X-Request-ID": rid}
        ids = body.prompt_token_ids if body.prompt_token_ids is not None else server.tokenizer.encode(body.prompt)
        problem = server.validate(ids, body.max_tokens)
        if problem:
            return _error(400, problem, headers=headers)
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        req = Pending(rid, list(ids), body.max_tokens, body.temperature, body.top_p, body.top_k, body.seed,
                      [s for s in stop if s], list(body.stop_token_ids or []), body.ignore_eos)
        server.submit(req)
        if body.stream:
            return StreamingResponse(_sse(server, req), media_type="text/event-stream", headers=headers)
        try:
            async for _ in server.outputs(req):
                pass
        finally:
            req.stop_flag = True
        headers["X-Batch-Size"] = str(req.batch_size)
        return JSONResponse({"id": rid, "text": req.text, "token_ids": req.token_ids,
                             "finish_reason": req.finish_reason,
                             "usage": _usage(len(req.prompt_token_ids), len(req.token_ids))}, headers=headers)

    return app


async def _sse(server: NaiveServer, req: Pending):
    try:
        async for toks, text in server.outputs(req):
            event = {"id": req.id, "text": text, "token_ids": toks, "finished": False}
            yield f"data: {json.dumps(event)}\n\n"
    finally:
        req.stop_flag = True  # finished, or the client went away: its row stops counting
    final = {"id": req.id, "text": "", "token_ids": [], "finished": True, "finish_reason": req.finish_reason,
             "usage": _usage(len(req.prompt_token_ids), len(req.token_ids))}
    yield f"data: {json.dumps(final)}\n\n"
    yield "data: [DONE]\n\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving.naive_server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="Hugging Face GPT-2 checkpoint directory")
    p.add_argument("--host", default="127.0.0.1", help="default: %(default)s")
    p.add_argument("--port", type=int, default=8001, help="default: %(default)s")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                   help="auto (default) = float16 on CUDA, float32 on CPU")
    p.add_argument("--max-batch", type=int, default=32, help="most requests in one generate call (default: %(default)s)")
    p.add_argument("--batch-wait-ms", type=float, default=0.0,
                   help="after a request arrives at an idle server, wait this long for the batch to fill "
                        "(default: %(default)s)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    t = time.monotonic()
    server = NaiveServer(args.model, args.device, args.dtype, args.max_batch, args.batch_wait_ms)
    log.info("loaded %s on %s (%s) in %.1f s; max batch %d", args.model, server.device, server.dtype,
             time.monotonic() - t, args.max_batch)
    uvicorn.run(create_app(server), host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=30)


if __name__ == "__main__":
    main()
