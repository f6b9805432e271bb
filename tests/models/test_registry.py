"""The model contract (models/base.py, models/spec.py) and the registry (models/registry.py), for
every family served, through the production loader."""

from __future__ import annotations

import json

from functools import partial

import pytest
import torch
from tests.helpers import make_checkpoint, make_llama_checkpoint
from transformers import GPT2Config, LlamaConfig

from kvcache import CacheSpec, allocate_kv_cache
from models import (MODEL_FAMILIES, ModelSpec, StepRows, load_config, load_model, placeholder_id,
                    resolve_placeholders)

# A random checkpoint maker per served family: a family added to the registry without one here
# fails test_every_family_meets_the_contract instead of going untested.
CHECKPOINTS = {
    "gpt2": make_checkpoint,
    **{t: partial(make_llama_checkpoint, model_type=t) for t in ("llama", "mistral", "qwen2", "qwen3")},
}


def _prefill(model, ids: list[int], sampled_ids: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence as a single prefill chunk over a fresh cache: final hidden states."""
    s, n = model.spec, len(ids)
    blocks = -(-n // 16)
    caches = allocate_kv_cache(CacheSpec(s.num_layers, s.num_kv_heads, s.head_dim, 16, torch.float32), blocks, "cpu")
    rows = StepRows(torch.arange(n, dtype=torch.int32), n, torch.tensor([0, n], dtype=torch.int32),
                    torch.zeros(1, dtype=torch.int32), torch.arange(blocks, dtype=torch.int32)[None], [n], [0])
    return model.forward(torch.tensor(ids, dtype=torch.int32), torch.arange(n, dtype=torch.int32), caches,
                         model.attention.metadata(rows), sampled_ids)


@pytest.mark.parametrize("model_type", sorted(MODEL_FAMILIES))
def test_every_family_meets_the_contract(model_type, tmp_path):
    if model_type not in CHECKPOINTS:
        pytest.fail(f"no random checkpoint maker for model_type {model_type!r} in CHECKPOINTS")
    path = CHECKPOINTS[model_type](tmp_path)
    config = load_config(path)
    assert config.model_type == model_type
    model = load_model(path, torch.float32, "cpu", "sdpa")

    spec = model.spec
    assert isinstance(spec, ModelSpec)
    assert spec == ModelSpec.from_hf_config(config)
    heads = config.num_attention_heads
    assert (spec.model_type, spec.num_layers, spec.num_heads, spec.hidden_size, spec.vocab_size,
            spec.max_position_embeddings) == (model_type, config.num_hidden_layers, heads, config.hidden_size,
                                              config.vocab_size, config.max_position_embeddings)
    assert spec.num_kv_heads == (getattr(config, "num_key_value_heads", None) or heads)
    assert spec.head_dim == (getattr(config, "head_dim", None) or config.hidden_size // heads)

    backend = model.attention
    assert backend.name == "sdpa"
    for hook in ("metadata", "forward", "warmup", "graph_tiles", "fill_graph_tiles", "graph_metadata"):
        assert callable(getattr(backend, hook, None)), hook
    assert isinstance(backend.prefill_graphs, bool)

    for method in ("forward", "lm_head", "load_weights"):
        assert callable(getattr(model, method, None)), method
    assert model.vocab_size == config.vocab_size
    assert not model.training

    hidden = _prefill(model, [1, 2, 3, 4, 5])
    assert hidden.shape == (5, spec.hidden_size) and hidden.dtype == torch.float32
    logits = model.lm_head(hidden)
    assert logits.shape[0] == 5 and logits.shape[1] >= model.vocab_size
    assert logits.dtype == torch.float32 and logits.isfinite().all()


@pytest.mark.parametrize("head_dim,want", [(64, 64), (None, 32)], ids=["explicit", "derived"])
def test_spec_reads_any_config_by_common_names(head_dim, want):
    # A family flashpage does not serve: the reader goes through transformers' common names only.
    config = LlamaConfig(num_key_value_heads=2, num_attention_heads=8, hidden_size=256, head_dim=head_dim,
                         num_hidden_layers=3, vocab_size=1000, max_position_embeddings=512)
    assert ModelSpec.from_hf_config(config) == ModelSpec(
        model_type="llama", num_layers=3, num_heads=8, num_kv_heads=2, head_dim=want, hidden_size=256,
        vocab_size=1000, max_position_embeddings=512)


def test_spec_defaults_kv_heads_and_head_dim():
    # A config with neither attribute (GPT-2's): one kv head per query head, hidden / heads wide.
    config = GPT2Config(n_layer=3, n_head=6, n_embd=96, n_positions=300, vocab_size=700, bos_token_id=0,
                        eos_token_id=0)
    assert not hasattr(config, "num_key_value_heads") and not hasattr(config, "head_dim")
    assert ModelSpec.from_hf_config(config) == ModelSpec("gpt2", 3, 6, 6, 16, 96, 700, 300)


def test_resolve_placeholders():
    ids = torch.tensor([5, placeholder_id(0), 7, placeholder_id(2)], dtype=torch.int32)
    got = resolve_placeholders(ids, torch.tensor([11, 12, 13]))
    assert got.dtype == torch.int64 and got.tolist() == [5, 11, 7, 13]
    same = resolve_placeholders(ids, None)
    assert same.dtype == torch.int64 and same.tolist() == ids.tolist()
    assert placeholder_id(0) == -1 and placeholder_id(2) == -3


@pytest.mark.parametrize("model_type", sorted(MODEL_FAMILIES))
def test_every_family_resolves_placeholders(model_type, tmp_path):
    model = load_model(CHECKPOINTS[model_type](tmp_path), torch.float32, "cpu", "sdpa")
    x, t = 3, 42
    sampled = torch.tensor([x, t], dtype=torch.int32)
    resolved = _prefill(model, [placeholder_id(1)], sampled)
    torch.testing.assert_close(resolved, _prefill(model, [t]), atol=0, rtol=0)
    # Row 0's token gives another state: the comparison above would catch a wrong row.
    assert not torch.allclose(resolved, _prefill(model, [x]))


def test_load_config_refuses_unserved_families(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    with pytest.raises(ValueError) as err:
        load_config(tmp_path)
    msg = str(err.value)
    assert "mamba" in msg
    for family in MODEL_FAMILIES:
        assert family in msg.split("serves:")[-1]


def test_families_are_imported_only_when_a_model_is_built():
    """The API front end reads configs and tokenizers only: importing it must not import a family's
    module (and transformers' activation machinery with it, seconds of start-up per process)."""
    import subprocess
    import sys

    code = ("import sys, server.api.app, models; "
            "loaded = sorted(m for m in sys.modules if m in ('models.gpt2', 'models.llama')); "
            "assert not loaded, loaded; "
            "assert models.model_class('qwen3').__name__ == 'LlamaForCausalLM' and 'models.llama' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
