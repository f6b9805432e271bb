"""GPU-only checks for the Llama family (skipped without CUDA): the Triton backend with CUDA graphs,
asynchronous scheduling, chunked prefill and prefix hits gives the greedy tokens of eager attention
run eagerly, at grouped-query shapes with head sizes 64 and 128; `--dtype auto` follows the
checkpoint."""

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
