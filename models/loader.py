"""Load checkpoints in Hugging Face format (any family in models/registry.py): a local directory or a hub id.

A directory holds `config.json`, weights as `model.safetensors` (optionally sharded with an index)
or `pytorch_model.bin`, and tokenizer files. A hub id is fetched into huggingface_hub's cache when
the network allows. With no model named, the checkpoint embedded in this package is used.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from models.base import CausalLM
from models.kv_scales import is_attention_scale
from models.registry import check_served, model_class

EMBEDDED_MODEL = Path(__file__).parent / "embedded"
_HUB_FILES = ["config.json", "*.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
              "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json",
              "generation_config.json"]

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def resolve_model_path(model: str | None) -> Path:
    if model is None:
        return EMBEDDED_MODEL
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists() or model.startswith((".", "/")):
        raise FileNotFoundError(f"--model {model!r} is not a model directory")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model, allow_patterns=_HUB_FILES))
    except Exception as e:  # offline, unknown id, gated repo: say which
        raise FileNotFoundError(f"could not load {model!r} as a local directory or from the Hugging Face hub: {e}") from e


def load_config(path: Path) -> PretrainedConfig:
    config = AutoConfig.from_pretrained(path)
    check_served(config.model_type)  # raises, naming the families served, for any other model
    return config


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    elif (path / "pytorch_model.bin").exists():
        return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise FileNotFoundError(f"{path} has no model.safetensors or pytorch_model.bin")
    tensors = {}
    for name in files:
        with safe_open(path / name, framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    return tensors


# What nn.Linear, nn.Embedding and nn.LayerNorm call to initialise their parameters.
_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "kaiming_uniform_",
                   "kaiming_normal_", "xavier_uniform_", "xavier_normal_")


@contextmanager
def _no_init() -> Iterator[None]:
    """torch.nn.init's functions as no-ops while a model is built: its parameters stay as
    allocated (uninitialised), and load_weights fills them."""
    saved = {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS}
    for name in _INIT_FUNCTIONS:
        setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def load_model(path: Path, dtype: torch.dtype, device: torch.device | str, attention: str,
               deterministic: bool = False) -> CausalLM:
    """`deterministic`: batch-invariant GEMMs and attention (every family takes the flag)."""
    config = load_config(path)
    # Built on the device with its parameters left uninitialised, as on the meta device followed by
    # to_empty (which it replaces): random init of a meta tensor imports torch's Python meta kernels
    # and to_empty its symbolic shapes, ~1.5 s of CPU in every engine process, for weights that
    # load_weights overwrites.
    with torch.device(device), _no_init():
        model = model_class(config.model_type)(config, attention, deterministic=deterministic)
    model = model.to(dtype)
    # KV-cache scales are not weights: the worker reads them (models/kv_scales.py) for an fp8 cache
    model.load_weights({k: t for k, t in _read_tensors(path).items() if not is_attention_scale(k)})
    return model.eval().requires_grad_(False)


def checkpoint_dtype(path: Path) -> torch.dtype | None:
    """The dtype the checkpoint's config names (`dtype`, formerly `torch_dtype`), if it is one we serve."""
    config = json.loads((path / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype")
    return DTYPES.get(name) if isinstance(name, str) else None


def eos_token_ids(path: Path) -> list[int]:
    """Every end-of-sequence id the checkpoint declares: generation_config.json's `eos_token_id`
    (Llama 3 lists several), then config.json's; each an int or a list."""
    found: list[int] = []
    for name in ("generation_config.json", "config.json"):
        file = path / name
        ids = json.loads(file.read_text()).get("eos_token_id") if file.exists() else None
        for i in ids if isinstance(ids, list) else [ids]:
            if isinstance(i, int) and i not in found:
                found.append(i)
    return found


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(path)
