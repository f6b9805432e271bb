"""Model families by Hugging Face `model_type`: adding a family is its model file and one line here.

Entries name the class as "module:Class" and are imported only when a model is built: a process
that only reads configs and tokenizers (the API front end) never imports a family's module, and
with it transformers' activation and kernel-hub machinery (seconds of start-up on a small CPU).
"""

from __future__ import annotations

import importlib

MODEL_FAMILIES: dict[str, str] = {
    "gpt2": "models.gpt2:GPT2LMHeadModel",
    "llama": "models.llama:LlamaForCausalLM",
    "mistral": "models.llama:LlamaForCausalLM",
    "qwen2": "models.llama:LlamaForCausalLM",
    "qwen3": "models.llama:LlamaForCausalLM",
}


def check_served(model_type: str) -> None:
    """Raise, naming the families served, for a model_type that is not one of them."""
    if model_type not in MODEL_FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not supported; flashpage serves: "
                         f"{', '.join(sorted(MODEL_FAMILIES))}")


def model_class(model_type: str) -> type:
    check_served(model_type)
    module, name = MODEL_FAMILIES[model_type].split(":")
    return getattr(importlib.import_module(module), name)
