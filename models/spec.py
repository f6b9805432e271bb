"""ModelSpec: the shape of a model as the engine needs it, read from any Hugging Face config.

Configs name the same things differently (GPT-2: `n_layer`, `n_head`, `n_embd`, `n_positions`;
Llama: `num_hidden_layers`, ...). transformers maps the common names onto each family's own
(`PretrainedConfig.attribute_map`), so one reader serves every family; nothing outside `models/`
reads a config's own names.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig


@dataclass(frozen=True, slots=True)
class ModelSpec:
    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int  # < num_heads: grouped-query attention
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int  # the longest context the model was built for
    sliding_window: int | None = None  # attention reaches only this many tokens back (Mistral); None = all

    @classmethod
    def from_hf_config(cls, config: PretrainedConfig) -> ModelSpec:
        heads = config.num_attention_heads
        return cls(
            model_type=config.model_type,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
            max_position_embeddings=config.max_position_embeddings,
            sliding_window=getattr(config, "sliding_window", None) or None,
        )
