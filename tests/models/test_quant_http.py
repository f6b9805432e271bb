"""Quantized checkpoints served over the HTTP app (server/api/app.py in-process, through Starlette's
TestClient, its engine on a thread; the CPU): concurrent greedy /generate requests, batched, give
the token ids of transformers' model built from the dequantized weights, and /v1/models names the
format and the weights' bytes. Each engine's config comes from the command line's parser, as
`python -m server` makes it. One app for each family's loading path: AWQ (int4), quant_method fp8
(FP8 blocks), and --quantization fp8 of the 16-bit checkpoint. Past loading, the CPU serves every
format alike (dequantized at load), so test_quant.py covers the other formats, their names
included, at the loader; nothing here depends on a real socket (the HTTP layer's own tests start
uvicorn servers)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from safetensors.torch import load_file
from starlette.testclient import TestClient

from server.api.app import create_app
from server.bridge.async_engine import AsyncEngine
from server.cli import build_parser, config_from_args
from server.engine import LLMEngine
from tests.helpers import hf_greedy
from tests.models.test_quant import NAMES, reference

PROMPTS = [[5, 17, 300, 41], [9] * 20, list(range(100, 137))]
MAX_TOKENS = 12
CASES = {"awq": ("awq", []), "fp8-block": ("fp8-block", []), "online-fp8": ("fp8-dynamic", ["--quantization", "fp8"])}


@pytest.fixture(scope="module", params=list(CASES))
def served(request, quant_src, quantized):
    """(name, client, the reference model's greedy tokens per prompt): `online-fp8` serves the 16-bit
    checkpoint with --quantization fp8, whose reference is the writer's per-channel FP8 copy."""
    name = request.param
    ref_fmt, flags = CASES[name]
    path = quant_src if flags else quantized[name][0]
    ref = reference(quant_src, quantized[ref_fmt][1])
    args = build_parser().parse_args(["--model", str(path), "--device", "cpu", "--num-blocks", "32", *flags])
    with TestClient(create_app(AsyncEngine(LLMEngine(config_from_args(args))))) as client:
        yield name, client, [hf_greedy(ref, p, MAX_TOKENS) for p in PROMPTS]


def test_greedy_tokens_over_http_equal_the_dequantized_reference(served, quant_src):
    name, client, want = served

    def greedy(prompt: list[int]) -> list[int]:
        r = client.post("/generate", json={"prompt_token_ids": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                                           "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()["token_ids"]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        assert list(pool.map(greedy, PROMPTS)) == want
    card = client.get("/v1/models").json()["data"][0]
    assert card["quantization"] and card["quantization"].startswith(NAMES[name])
    # the CPU dequantizes at load: the weights' bytes are the fp32 model's (the GPU keeps them quantized)
    params = sum(t.numel() for t in load_file(quant_src / "model.safetensors").values())
    assert card["weight_bytes"] == 4 * params
