"""GPT-2 model, checkpoint loading and attention backends. Depends on kernels/ and kvcache/."""

from models.attention import BACKENDS, AttentionMetadata
from models.gpt2 import GPT2LMHeadModel
from models.loader import DTYPES, EMBEDDED_MODEL, load_config, load_model, load_tokenizer, resolve_model_path

__all__ = ["BACKENDS", "AttentionMetadata", "GPT2LMHeadModel", "DTYPES", "EMBEDDED_MODEL", "load_config",
           "load_model", "load_tokenizer", "resolve_model_path"]
