"""Model families over a flat token batch and the paged KV cache, their checkpoint loading and the
attention backends. The engine speaks only the contract (models/base.py, models/spec.py,
models/attention/base.py); a family's own names stay in its file. Depends on kernels/ and kvcache/."""

from models.attention import BACKENDS, AttentionBackend, AttentionMetadata, StepRows
from models.base import CausalLM, KVCaches, placeholder_id, resolve_placeholders
from models.kv_scales import checkpoint_kv_scales
from models.loader import (DTYPES, EMBEDDED_DRAFT, EMBEDDED_EAGLE3, EMBEDDED_MODEL, LOAD_FORMATS, check_quantized_split,
                           checkpoint_dtype, eos_token_ids, is_eagle3_head, load_config, load_model, load_tokenizer,
                           resolve_model_path)
from models.parallel import (TensorParallel, built_as, close_tensor_parallel, init_tensor_parallel, shard_spec,
                             tensor_parallel)
from models.quant import METHODS as QUANTIZATION_METHODS
from models.quant import WeightsInfo, weights_info
from models.quant import detect as quantization_scheme
from models.registry import MODEL_FAMILIES, check_served, model_class
from models.spec import ModelSpec

__all__ = ["BACKENDS", "AttentionBackend", "AttentionMetadata", "StepRows", "CausalLM", "KVCaches",
           "placeholder_id", "resolve_placeholders", "DTYPES", "EMBEDDED_MODEL", "LOAD_FORMATS", "checkpoint_dtype",
           "eos_token_ids", "TensorParallel", "built_as", "close_tensor_parallel", "init_tensor_parallel", "shard_spec",
           "tensor_parallel",
           "load_config", "load_model", "check_quantized_split",
           "checkpoint_kv_scales", "load_tokenizer", "resolve_model_path", "MODEL_FAMILIES", "check_served",
           "model_class", "ModelSpec", "QUANTIZATION_METHODS", "quantization_scheme", "WeightsInfo", "weights_info",
           "EMBEDDED_DRAFT", "EMBEDDED_EAGLE3", "is_eagle3_head", "load_eagle3_head", "eagle3_token_table"]


def load_eagle3_head(path, target: CausalLM, dtype, device, attention: str, max_model_len: int, token_table=None):
    """An EAGLE-3 draft head for `target` (models/eagle3.py: imported here only when one is loaded,
    so that a process reading configs alone never imports a family's module)."""
    from models.eagle3 import load_head

    return load_head(path, target, dtype, device, attention, max_model_len, token_table)


def eagle3_token_table(target: CausalLM, path):
    """The target's token table whole, gathered from every rank of its tensor-parallel group (each
    calls it), for the EAGLE-3 head at `path` if it shares it (models/eagle3.py `whole_token_table`);
    None for a head with its own (every rank reads the same checkpoint, so all skip the gather)."""
    from models.eagle3 import shares_token_table, whole_token_table

    return whole_token_table(target) if shares_token_table(path) else None
