"""Model families over a flat token batch and the paged KV cache, their checkpoint loading and the
attention backends. The engine speaks only the contract (models/base.py, models/spec.py,
models/attention/base.py); a family's own names stay in its file. Depends on kernels/ and kvcache/."""

from models.attention import BACKENDS, AttentionBackend, AttentionMetadata, StepRows
from models.base import CausalLM, KVCaches, placeholder_id, resolve_placeholders
from models.kv_scales import checkpoint_kv_scales
from models.loader import (DTYPES, EMBEDDED_MODEL, checkpoint_dtype, eos_token_ids, load_config, load_model,
                           load_tokenizer, resolve_model_path)
from models.registry import MODEL_FAMILIES, check_served, model_class
from models.spec import ModelSpec

__all__ = ["BACKENDS", "AttentionBackend", "AttentionMetadata", "StepRows", "CausalLM", "KVCaches",
           "placeholder_id", "resolve_placeholders", "DTYPES", "EMBEDDED_MODEL", "checkpoint_dtype", "eos_token_ids",
           "load_config", "load_model",
           "checkpoint_kv_scales", "load_tokenizer", "resolve_model_path", "MODEL_FAMILIES", "check_served",
           "model_class", "ModelSpec"]
