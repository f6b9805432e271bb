"""Every quantized format served over HTTP (`python -m server`, real uvicorn processes, the CPU):
concurrent greedy /generate requests give the token ids of transformers' model built from the
dequantized weights, and /v1/models names the format and the weights' bytes. One server per format
(and one with --quantization fp8 of the 16-bit checkpoint), all started at once."""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from safetensors.torch import load_file

from benchmarks.shared.common import ServerProcess
from benchmarks.quant.quant_checkpoint import FORMATS, quantize_checkpoint
from tests.helpers import hf_greedy, make_llama_checkpoint
from tests.models.test_quant import LLAMA, reference

PROMPTS = [[5, 17, 300, 41], [9] * 20, list(range(100, 137))]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (path, extra server args, the reference model's greedy tokens per prompt)."""
    root = tmp_path_factory.mktemp("quant-http")
    src = make_llama_checkpoint(root / "src", "llama", **LLAMA)
    out = {}
    for fmt in FORMATS:
        deq = quantize_checkpoint(src, root / fmt, fmt)
        ref = reference(src, deq)
        out[fmt] = (root / fmt, [], [hf_greedy(ref, p, MAX_TOKENS) for p in PROMPTS])
    ref = reference(src, quantize_checkpoint(src, root / "online-ref", "fp8-dynamic"))
    out["online-fp8"] = (src, ["--quantization", "fp8"], [hf_greedy(ref, p, MAX_TOKENS) for p in PROMPTS])
    out["params"] = sum(t.numel() for t in load_file(src / "model.safetensors").values())
    return out


@pytest.fixture(scope="module")
def servers(checkpoints):
    started = {}
    try:
        for name, spec in checkpoints.items():
            if name != "params":
                started[name] = ServerProcess.python_server(["--model", str(spec[0]), "--device", "cpu",
                                                             "--no-engine-process", "--num-blocks", "32", *spec[1]])
        yield {name: srv.wait_healthy(240).url for name, srv in started.items()}
    finally:
        for srv in started.values():
            srv.stop(30, sig=signal.SIGKILL)


def _greedy(url: str, prompt: list[int]) -> list[int]:
    r = httpx.post(f"{url}/generate", timeout=120, json={"prompt_token_ids": prompt, "max_tokens": MAX_TOKENS,
                                                          "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["token_ids"]


@pytest.mark.parametrize("name", [*FORMATS, "online-fp8"])
def test_greedy_tokens_over_http_equal_the_dequantized_reference(servers, checkpoints, name):
    url = servers[name]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda p: _greedy(url, p), PROMPTS))
    assert got == checkpoints[name][2]
    card = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]
    assert card["quantization"] and card["quantization"].startswith(
        {"awq": "AWQ", "gptq": "GPTQ", "gptq-desc-act": "GPTQ", "fp8-block": "fp8 (128x128",
         "online-fp8": "fp8 (quantized at load"}.get(name, "compressed-tensors"))
    # the CPU dequantizes at load: the weights' bytes are the fp32 model's (the GPU keeps them quantized)
    assert card["weight_bytes"] == 4 * checkpoints["params"]
