"""GPU-only checks for the Llama family (skipped without CUDA): the Triton backend with CUDA graphs,
asynchronous scheduling, chunked prefill and prefix hits gives the greedy tokens of eager attention
run eagerly, at grouped-query shapes with head sizes 64 and 128; every family served over HTTP gives
transformers' greedy tokens (up to bf16 near-ties); `--dtype auto` follows the checkpoint."""

import pytest
import torch

from tests.gpu.test_gpu_parity import _assert_same_greedy, _prompts, _run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SHAPES = {  # Llama-3.2-1B's heads (32 / 8, head 64) and Qwen3-0.6B's (16 / 8, head 128), fewer layers
    "llama-32x8-d64": ("llama", dict(num_attention_heads=32, num_key_value_heads=8, hidden_size=2048,
                                     intermediate_size=2048)),
    "qwen3-16x8-d128": ("qwen3", dict(num_attention_heads=16, num_key_value_heads=8, head_dim=128, hidden_size=1024,
                                      intermediate_size=1024)),
}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def ckpt(request, tmp_path_factory):
    from tests.helpers import make_llama_checkpoint

    model_type, shape = SHAPES[request.param]
    return make_llama_checkpoint(tmp_path_factory.mktemp(request.param), model_type, num_hidden_layers=3,
                                 max_position_embeddings=1024, vocab_size=2048, initializer_range=0.05, **shape)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_triton_with_graphs_matches_eager(ckpt, dtype):
    shared = _prompts(1, 150, 150, seed=3)[0]
    prompts = _prompts(16, 1, 300) + [[7], [5] * 17] + [shared + p for p in _prompts(6, 1, 40, seed=4)]
    ref = _run(ckpt, prompts, attention="eager", dtype=dtype, enforce_eager=True, enable_prefix_caching=False)
    got = _run(ckpt, prompts, attention="triton", dtype=dtype, max_num_batched_tokens=256)
    _assert_same_greedy(ckpt, prompts, got, ref, dtype, min_exact=0.5)


def test_dtype_auto_follows_the_checkpoint(tmp_path):
    import json

    from server.config import EngineConfig
    from server.engine import LLMEngine
    from tests.helpers import make_llama_checkpoint

    path = make_llama_checkpoint(tmp_path, "llama")
    cfg = json.loads((path / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    (path / "config.json").write_text(json.dumps(cfg))
    eng = LLMEngine(EngineConfig(model=str(path), device="cuda", num_blocks=64, enforce_eager=True))
    assert eng.runner.kv_caches[0][0].dtype == torch.bfloat16


HTTP_SHAPES = {  # each family at its real head layout (few layers, small vocabulary)
    "llama": dict(num_attention_heads=32, num_key_value_heads=8, hidden_size=2048, intermediate_size=2048),
    "mistral": dict(num_attention_heads=32, num_key_value_heads=8, hidden_size=4096, intermediate_size=2048,
                    sliding_window=None),
    "qwen2": dict(num_attention_heads=14, num_key_value_heads=2, hidden_size=896, intermediate_size=1024),
    "qwen3": dict(num_attention_heads=16, num_key_value_heads=8, head_dim=128, hidden_size=1024,
                  intermediate_size=1024),
}


@pytest.fixture(scope="module")
def http_servers(tmp_path_factory):
    """One Triton-backed server per family (bf16, CUDA graphs and asynchronous scheduling on), all
    started at once, with tests/models/test_families_http.py's small cache and step budget."""
    from concurrent.futures import ThreadPoolExecutor

    from benchmarks.shared.common import ServerProcess
    from tests.helpers import make_llama_checkpoint
    from tests.models.test_families_http import SERVER_ARGS, STEP_SLEEP_ENV

    paths = {family: make_llama_checkpoint(tmp_path_factory.mktemp(f"http-{family}"), family, num_hidden_layers=3,
                                           max_position_embeddings=1024, vocab_size=2048, initializer_range=0.05,
                                           **shape)
             for family, shape in HTTP_SHAPES.items()}
    started = {family: ServerProcess.python_server(["--model", str(path), "--device", "cuda", "--attention", "triton",
                                                    "--dtype", "bfloat16", *SERVER_ARGS],
                                                   extra_env=STEP_SLEEP_ENV)
               for family, path in paths.items()}
    try:
        yield {family: (paths[family], srv.wait_healthy(300).url) for family, srv in started.items()}
    finally:
        with ThreadPoolExecutor(len(started)) as pool:
            list(pool.map(lambda srv: srv.stop(30), started.values()))


@pytest.mark.parametrize("family", sorted(HTTP_SHAPES))
def test_greedy_over_http_matches_transformers(http_servers, family):
    """The CPU exchange of tests/models/test_families_http.py (concurrent mixed lengths, preemption,
    chunked prefill, prefix hits) against the Triton backend: greedy tokens as transformers' fp32
    model gives them, except at bf16 near-ties (each parting checked to be one)."""
    from tests.models.test_families_http import assert_exercised, exchange, hf_greedy_all

    path, url = http_servers[family]
    # Longer outputs than on the CPU: a GPU step takes a millisecond, so 24-token requests can finish
    # before the last of a wave arrives over HTTP, and nothing would need preempting.
    prompts, got, metrics = exchange(url, max_tokens=96)
    ref = hf_greedy_all(path, prompts, max_tokens=96, device="cuda")
    _assert_same_greedy(path, prompts, got, ref, "bfloat16")
    assert_exercised(metrics)
