"""Model families by Hugging Face `model_type`: adding a family is its model file and one line here."""

from __future__ import annotations

from models.gpt2 import GPT2LMHeadModel
from models.llama import LlamaForCausalLM

MODEL_FAMILIES: dict[str, type] = {
    "gpt2": GPT2LMHeadModel,
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
}


def model_class(model_type: str) -> type:
    cls = MODEL_FAMILIES.get(model_type)
    if cls is None:
        raise ValueError(f"model_type {model_type!r} is not supported; flashpage serves: "
                         f"{', '.join(sorted(MODEL_FAMILIES))}")
    return cls
