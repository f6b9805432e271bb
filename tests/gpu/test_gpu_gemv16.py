"""GPU-only (skipped without CUDA): by default (models/linear.py; FLASHPAGE_GEMV16=0 turns it off)
a 16-bit linear's one-row products go through kernels/gemv.py's gemv16 instead of cuBLAS, in
batch-1 decode steps, eagerly and captured in CUDA graphs; the greedy tokens are cuBLAS's, except
where two bf16 runs part at a near-tie (checked against transformers' fp32 logits, as
test_gpu_parity does)."""

import json

import pytest
import torch

from server.config import EngineConfig
from server.engine import LLMEngine
from server.sampling_params import SamplingParams
from tests.gpu.test_gpu_parity import _assert_same_greedy, _prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tests.helpers import make_llama_checkpoint

    # Llama-3.2-1B's attention (32 heads of 64 over 8 K/V heads), 3 layers, a 2048-token vocabulary
    path = make_llama_checkpoint(tmp_path_factory.mktemp("gemv16-llama"), "llama", num_hidden_layers=3,
                                 num_attention_heads=32, num_key_value_heads=8, hidden_size=2048,
                                 intermediate_size=8192, max_position_embeddings=1024, vocab_size=2048,
                                 initializer_range=0.02)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "dtype": "bfloat16"}))
    return path


def _one_at_a_time(path, prompts, enforce_eager):
    """Each prompt alone (every decode step one row), 24 greedy tokens."""
    eng = LLMEngine(EngineConfig(model=str(path), device="cuda", num_blocks=512, max_model_len=1024,
                                 enforce_eager=enforce_eager))
    try:
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        return [eng.generate([p], params)[0].token_ids for p in prompts]
    finally:
        eng.close()


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_gemv16_gives_cublas_greedy_tokens(ckpt, monkeypatch, enforce_eager):
    import models.linear as linear

    prompts = _prompts(6, 1, 300, seed=5)
    monkeypatch.setenv(linear.GEMV16_ENV, "0")  # cuBLAS's tokens
    ref = _one_at_a_time(ckpt, prompts, enforce_eager)
    calls = []
    real = linear.gemv16
    monkeypatch.setattr(linear, "gemv16", lambda *a: calls.append(a[1].shape) or real(*a))
    monkeypatch.delenv(linear.GEMV16_ENV)  # the default
    got = _one_at_a_time(ckpt, prompts, enforce_eager)
    # every projection of the model's layers at one row (under graphs: at their capture)
    assert {(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)} <= set(calls), set(calls)
    _assert_same_greedy(ckpt, prompts, got, ref, "bfloat16")
