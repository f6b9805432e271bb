"""benchmarks/shared/checkpoint.py: random checkpoints at the published shapes, loadable by our loader."""

import pytest
import torch
import transformers

from benchmarks.shared import checkpoint

# Parameter counts of the published checkpoints (their config.json, as transformers builds them).
PUBLISHED = {"qwen2.5-0.5b": 494_032_768, "llama-3.2-1b": 1_235_814_400, "qwen3-0.6b": 596_049_920,
             "llama-3.1-8b": 8_030_261_248, "llama-3.1-70b": 70_553_706_496}


@pytest.mark.parametrize("shape", sorted(checkpoint.LLAMA_SHAPES))
def test_each_shape_has_the_published_parameter_count(shape):
    fields = dict(checkpoint.LLAMA_SHAPES[shape])
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):  # no memory: an 8B model is only counted
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED[shape]


def test_a_random_checkpoint_built_on_a_device_loads_and_matches_transformers(tmp_path, monkeypatch):
    """The `device` path (an 8B shape is built on the GPU): what it writes is a checkpoint our loader
    reads into the same logits transformers computes from it."""
    from models import load_model
    from tests.helpers import prefill_logits

    tiny = dict(checkpoint.LLAMA_SHAPES["llama-3.1-8b"], num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=512)
    monkeypatch.setitem(checkpoint.LLAMA_SHAPES, "tiny", tiny)
    path = checkpoint.make_random_llama(tmp_path / "tiny", "tiny", device="cpu")
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert not reference.config.tie_word_embeddings  # the 8B shape's own head, not the embedding
    ours = load_model(path, torch.float32, "cpu", "sdpa")
    ids = [1, 7, 42, 300, 5, 511, 0, 9]
    with torch.no_grad():
        want = reference(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(prefill_logits(ours, ids), want, atol=2e-4, rtol=2e-4)


def test_a_config_only_checkpoint_serves_dummy_weights_at_its_shape(tmp_path, monkeypatch):
    """What the 70B benchmark starts from: config.json and a tokenizer, no weight files; the loader's
    dummy format builds the model at that shape."""
    from models import load_model

    tiny = dict(checkpoint.LLAMA_SHAPES["llama-3.1-70b"], num_hidden_layers=2, hidden_size=64, num_attention_heads=8,
                num_key_value_heads=2, head_dim=8, intermediate_size=96, vocab_size=512)
    monkeypatch.setitem(checkpoint.LLAMA_SHAPES, "tiny", tiny)
    path = checkpoint.make_config_only_llama(tmp_path / "tiny", "tiny")
    assert not list(path.glob("*.safetensors")) and (path / "tokenizer.json").exists()
    model = load_model(path, torch.float32, "cpu", "sdpa", load_format="dummy")
    assert (model.spec.num_layers, model.spec.num_heads, model.spec.num_kv_heads) == (2, 8, 2)
    assert model.lm_head_weight.abs().sum() > 0  # the untied head, set
